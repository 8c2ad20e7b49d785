//! Reroute: turning per-instance quotas into the per-source split `q[r][e][t]` (UltraEP §5.2).
//!
//! Both functions fill one expert's dense `R x |H(e)|` block (row = source rank, column = instance
//! in [`crate::Plan::instances`] order) and keep both marginals exact: every row sums to
//! `load[r][e]` and every column to the instance's quota.

use crate::{Instance, LoadMatrix};

/// Locality first, then proportional. Tokens already on a host rank consume that rank's quota; the
/// residual demand of each source (in ascending rank) is split over the residual quotas in
/// proportion to what is left of them, rounding by largest remainder (ties to the lower instance).
/// Because each source is split against the capacity that remains, the last source takes exactly
/// what is left and every quota is met without a correction pass.
pub(crate) fn split_locality_first(
    load: &LoadMatrix,
    expert: usize,
    instances: &[Instance],
    block: &mut [u64],
) {
    let n = instances.len();
    let mut residual: Vec<u64> = instances.iter().map(|i| i.quota).collect();
    for (i, inst) in instances.iter().enumerate() {
        let local = load.get(inst.rank as usize, expert).min(inst.quota);
        block[inst.rank as usize * n + i] = local;
        residual[i] -= local;
    }
    let mut remaining: u64 = residual.iter().sum();
    let mut remainders = vec![0u64; n];
    for r in 0..load.ranks() {
        let row = &mut block[r * n..(r + 1) * n];
        let demand = load.get(r, expert) - row.iter().sum::<u64>();
        if demand == 0 {
            continue;
        }
        debug_assert!(demand <= remaining, "quotas do not cover the load");
        let mut given = 0;
        for i in 0..n {
            let exact = demand as u128 * residual[i] as u128;
            let share = (exact / remaining as u128) as u64;
            remainders[i] = (exact % remaining as u128) as u64;
            row[i] += share;
            residual[i] -= share;
            given += share;
        }
        for _ in given..demand {
            // Largest remainder first; a positive remainder guarantees residual capacity is left.
            let (best, _) = remainders
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(&a.0)))
                .expect("an expert has at least one instance");
            row[best] += 1;
            residual[best] -= 1;
            remainders[best] = 0;
        }
        remaining -= demand;
    }
}

/// EPLB-style split: each source spreads its tokens evenly over all instances, the remainder going
/// round-robin starting at an instance that rotates with the source rank. Quotas are the column
/// sums and are written back into `instances`.
pub(crate) fn split_evenly(
    load: &LoadMatrix,
    expert: usize,
    instances: &mut [Instance],
    block: &mut [u64],
) {
    let n = instances.len();
    for inst in instances.iter_mut() {
        inst.quota = 0;
    }
    for r in 0..load.ranks() {
        let tokens = load.get(r, expert);
        let (base, extra) = (tokens / n as u64, (tokens % n as u64) as usize);
        for k in 0..n {
            let i = (r + k) % n;
            let q = base + u64::from(k < extra);
            block[r * n + i] = q;
            instances[i].quota += q;
        }
    }
}
