//! Reroute: turning per-instance quotas into the per-source split `q[r][e][t]` (UltraEP §5.2).
//!
//! Both functions fill one expert's dense `R x |H(e)|` block (row = source rank, column = instance
//! in [`crate::Plan::instances`] order) and keep both marginals exact: every row sums to
//! `load[r][e]` and every column to the instance's quota.

use crate::instance::Instance;
use crate::LoadMatrix;

/// Scratch buffers for [`split_locality_first`], reused across the experts of one plan.
#[derive(Debug, Default)]
pub(crate) struct SplitScratch {
    /// Per instance: quota left after the local tokens.
    quota_left: Vec<u64>,
    /// Per instance: what the proportional pass gave it.
    given: Vec<u64>,
    /// Per source rank: demand left after the local tokens, then after the proportional pass.
    demand: Vec<u64>,
}

/// Locality first, then proportional. Tokens already on a host rank consume that rank's quota
/// (UltraEP §5.2). The residual demand `d_r` of every source is then split in proportion to the
/// residual quotas `c_i`: source `r` sends `floor(d_r c_i / C)` to instance `i` (`C = sum c_i =
/// sum d_r`). Rounding down leaves every source short by fewer than `|H(e)|` tokens
/// and every instance short by some, with equal totals; a northwest-corner pass (sources
/// ascending, instances ascending) hands those out, so both marginals are exact: every row sums to
/// `load[r][e]`, every column to the instance's quota.
///
/// Rows are independent until that last pass, so the split pipelines well. It runs for every
/// (source, instance) pair of every replicated expert; splitting row by row against the capacity
/// that remains was one long dependency chain and most of the planner's time.
pub(crate) fn split_locality_first(
    load: &LoadMatrix,
    expert: usize,
    instances: &[Instance],
    block: &mut [u64],
    scratch: &mut SplitScratch,
) {
    let n = instances.len();
    let experts = load.experts();
    let SplitScratch {
        quota_left,
        given,
        demand,
    } = scratch;
    demand.clear();
    demand.extend(load.as_flat()[expert..].iter().step_by(experts));
    quota_left.clear();
    quota_left.extend(instances.iter().map(|i| i.quota));
    for (i, inst) in instances.iter().enumerate() {
        let host = inst.rank as usize;
        let local = demand[host].min(inst.quota);
        block[host * n + i] = local;
        quota_left[i] -= local;
        demand[host] -= local;
    }
    let capacity: u64 = quota_left.iter().sum();
    debug_assert_eq!(
        capacity,
        demand.iter().sum::<u64>(),
        "quotas do not match the load"
    );
    if capacity == 0 {
        return;
    }
    given.clear();
    given.resize(n, 0);
    split_proportionally(block, demand, quota_left, given, capacity);
    for (c, g) in quota_left.iter_mut().zip(given.iter()) {
        *c -= g;
    }
    settle_shortfalls(block, demand, quota_left);
}

/// The proportional pass: `block[r][i] += floor(d_r c_i / C)` (see [`FloorShare`]).
/// Afterwards `demand` holds what each source still has to send; `given` what each instance got.
fn split_proportionally(
    block: &mut [u64],
    demand: &mut [u64],
    quotas: &[u64],
    given: &mut [u64],
    capacity: u64,
) {
    let n = quotas.len();
    let max_demand = demand.iter().copied().max().unwrap_or(0);
    let max_quota = quotas.iter().copied().max().unwrap_or(0);
    let share = FloorShare::new(capacity, max_demand, max_quota);
    for (row, d) in block.chunks_exact_mut(n).zip(demand.iter_mut()) {
        if *d == 0 {
            continue;
        }
        let mut sent = 0;
        for ((cell, &c), g) in row.iter_mut().zip(quotas).zip(given.iter_mut()) {
            let q = share.of(*d, c);
            *cell += q;
            *g += q;
            sent += q;
        }
        *d -= sent;
    }
}

/// Northwest-corner pass: sources ascending, each fills its shortfall from the instances with
/// quota left, in instance order. Both lists total the same, so both end at zero.
fn settle_shortfalls(block: &mut [u64], demand: &[u64], quota_left: &mut [u64]) {
    let n = quota_left.len();
    let mut i = 0;
    for (r, &d) in demand.iter().enumerate() {
        let mut short = d;
        while short > 0 {
            while quota_left[i] == 0 {
                i += 1;
            }
            let take = short.min(quota_left[i]);
            block[r * n + i] += take;
            quota_left[i] -= take;
            short -= take;
        }
    }
}

/// `floor(d * c / C)` for one expert's split (`C` fixed), exactly. With the fixed-point reciprocal
/// `m = floor((2^64 - 1) / C)`, `(d c m) >> 64` undershoots `d c / C` by less than `2 d c / 2^64`,
/// below one while `d c < 2^63`: one multiply and one check replace a division per cell. Larger
/// counts take a 128-bit division.
struct FloorShare {
    capacity: u64,
    reciprocal: u64,
    fits: bool,
}

impl FloorShare {
    fn new(capacity: u64, max_demand: u64, max_quota: u64) -> Self {
        Self {
            capacity,
            reciprocal: u64::MAX / capacity,
            fits: max_demand
                .checked_mul(max_quota)
                .is_some_and(|p| p < 1 << 63),
        }
    }

    #[inline]
    fn of(&self, d: u64, c: u64) -> u64 {
        if self.fits {
            let num = d * c;
            let x = ((num as u128 * self.reciprocal as u128) >> 64) as u64;
            x + u64::from((x as u128 + 1) * self.capacity as u128 <= num as u128)
        } else {
            (d as u128 * c as u128 / self.capacity as u128) as u64
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Splits expert 0 of `rows` over `instances` and checks both marginals exactly.
    fn split(rows: &[Vec<u64>], instances: &[Instance]) -> Vec<u64> {
        let load = LoadMatrix::from_rows(rows).unwrap();
        let n = instances.len();
        let mut block = vec![0; load.ranks() * n];
        split_locality_first(
            &load,
            0,
            instances,
            &mut block,
            &mut SplitScratch::default(),
        );
        for (r, row) in block.chunks_exact(n).enumerate() {
            assert_eq!(row.iter().sum::<u64>(), load.get(r, 0), "row {r}");
        }
        for (i, inst) in instances.iter().enumerate() {
            let column: u64 = block.iter().skip(i).step_by(n).sum();
            assert_eq!(column, inst.quota, "instance {i}");
        }
        block
    }

    fn inst(rank: u32, quota: u64) -> Instance {
        Instance { rank, quota }
    }

    #[test]
    fn host_tokens_stay_home_and_the_rest_is_proportional() {
        // Expert 0 lives on rank 0 (quota 40) with a replica on rank 1 (quota 60).
        let rows = vec![vec![30], vec![10], vec![30], vec![30]];
        let block = split(&rows, &[inst(0, 40), inst(1, 60)]);
        assert_eq!(&block[0..2], &[30, 0], "rank 0 keeps its own tokens");
        assert_eq!(&block[2..4], &[0, 10], "rank 1 keeps its own tokens");
        // Residual quotas 10 and 50 split ranks 2 and 3 (30 each) 1:5.
        assert_eq!(&block[4..6], &[5, 25]);
        assert_eq!(&block[6..8], &[5, 25]);
    }

    #[test]
    fn rounding_shortfalls_are_handed_out_exactly() {
        // Thirds that never divide evenly: every row and column must still add up.
        let rows: Vec<Vec<u64>> = (0..7).map(|r| vec![1 + r * 3]).collect();
        let total: u64 = rows.iter().map(|r| r[0]).sum();
        let block = split(&rows, &[inst(6, 1), inst(2, 1), inst(4, total - 2)]);
        // Each cell is within a few tokens of the proportional share.
        for (r, row) in block.chunks_exact(3).enumerate() {
            let share = rows[r][0] as f64 * (total - 2) as f64 / total as f64;
            assert!((row[2] as f64 - share).abs() <= 3.0, "row {r}: {row:?}");
        }
    }

    #[test]
    fn huge_counts_take_the_wide_path_and_stay_exact() {
        let big = 1u64 << 40;
        let rows = vec![vec![big + 7], vec![3 * big + 1], vec![big - 5]];
        let total = 5 * big + 3;
        split(&rows, &[inst(0, big / 3), inst(2, total - big / 3)]);
    }

    #[test]
    fn even_split_rotates_the_remainder() {
        let load = LoadMatrix::from_rows(&[vec![5u64], vec![5]]).unwrap();
        let mut instances = [inst(0, 0), inst(1, 0)];
        let mut block = vec![0; 4];
        split_evenly(&load, 0, &mut instances, &mut block);
        assert_eq!(block, vec![3, 2, 2, 3]);
        assert_eq!(instances.map(|i| i.quota), [5, 5]);
    }
}
