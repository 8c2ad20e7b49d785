//! Where every pair of a layer goes, worked out on the host from the plan's split and the load
//! counts, exactly as the lookup kernel will route them: what sizes every copy and GEMM of the
//! device data plane without reading anything back.

use rackfill_balancer::{LoadMatrix, Plan};

use super::super::{instance_offsets, CudaError};
use crate::KernelError;

/// Rows per (source, destination) and per expert instance.
pub(super) struct Routes {
    /// `[src][dst]`: rows `src` sends `dst`.
    sent: Vec<Vec<usize>>,
    /// `[dst]`: (expert, instance, rows) of the instances computed there that get rows, in the
    /// order of their global instance index (the grouping kernel's order).
    pub groups: Vec<Vec<(u32, u32, usize)>>,
}

impl Routes {
    /// The rows of (source, expert) split over the expert's instances as the lookup kernel does:
    /// the `j`-th pair goes to the first instance whose cumulative quota exceeds `j`, the rest
    /// to the last.
    pub(super) fn new(plan: &Plan, load: &LoadMatrix) -> Result<Self, CudaError> {
        let ranks = plan.ranks();
        check("ranks of the load", load.ranks(), ranks)?;
        check("experts of the load", load.experts(), plan.experts())?;
        let offsets = instance_offsets(plan)?;
        let mut inst_rows = vec![0usize; *offsets.last().unwrap_or(&0) as usize];
        let mut sent = vec![vec![0usize; ranks]; ranks];
        for (src, sent_from) in sent.iter_mut().enumerate() {
            for (e, &c) in load.row(src).iter().enumerate() {
                let instances = plan.instances(e);
                let mut per = vec![0u64; instances.len()];
                match plan.split(src, e) {
                    None => per[0] = c,
                    Some(quotas) => {
                        let mut end = 0u64;
                        for (t, &q) in quotas.iter().enumerate() {
                            let lo = end.min(c);
                            end += q;
                            per[t] = if t + 1 == quotas.len() { c } else { end.min(c) } - lo;
                        }
                    }
                }
                for ((inst, n), rows) in instances
                    .iter()
                    .zip(per)
                    .zip(&mut inst_rows[offsets[e] as usize..])
                {
                    *rows += n as usize;
                    sent_from[inst.rank as usize] += n as usize;
                }
            }
        }
        let mut groups = vec![Vec::new(); ranks];
        for e in 0..plan.experts() {
            for (t, inst) in plan.instances(e).iter().enumerate() {
                let rows = inst_rows[offsets[e] as usize + t];
                if rows > 0 {
                    groups[inst.rank as usize].push((e as u32, t as u32, rows));
                }
            }
        }
        Ok(Self { sent, groups })
    }

    /// Rows `src` sends `dst`.
    pub(super) fn sent(&self, src: usize, dst: usize) -> usize {
        self.sent[src][dst]
    }

    /// Rows `src` sends before its segment for `dst` (the segment's start in its send layout).
    pub(super) fn send_offset(&self, src: usize, dst: usize) -> usize {
        self.sent[src][..dst].iter().sum()
    }

    /// Rows `dst` receives before those of `src` (where they start in its receive buffer).
    pub(super) fn recv_offset(&self, src: usize, dst: usize) -> usize {
        self.sent[..src].iter().map(|row| row[dst]).sum()
    }

    /// Rows `dst` receives in all.
    pub(super) fn received(&self, dst: usize) -> usize {
        self.sent.iter().map(|row| row[dst]).sum()
    }

    /// Rows `src` sends in all (its pairs).
    pub(super) fn sent_total(&self, src: usize) -> usize {
        self.sent[src].iter().sum()
    }

    /// Per rank: rows it receives from other ranks, times `row_bytes`.
    pub(super) fn received_from_others(&self, row_bytes: u64) -> Vec<u64> {
        let ranks = self.sent.len();
        (0..ranks)
            .map(|dst| {
                let rows: usize = (0..ranks)
                    .filter(|&src| src != dst)
                    .map(|src| self.sent[src][dst])
                    .sum();
                rows as u64 * row_bytes
            })
            .collect()
    }

    /// Per rank: rows it sends other ranks (and gets back from them), times `row_bytes`.
    pub(super) fn sent_to_others(&self, row_bytes: u64) -> Vec<u64> {
        self.sent
            .iter()
            .enumerate()
            .map(|(src, row)| {
                let rows: usize = row
                    .iter()
                    .enumerate()
                    .filter(|&(dst, _)| dst != src)
                    .map(|(_, n)| n)
                    .sum();
                rows as u64 * row_bytes
            })
            .collect()
    }
}

/// `len == expected`, else a typed length error naming `what`.
pub(super) fn check(what: &'static str, len: usize, expected: usize) -> Result<(), KernelError> {
    if len != expected {
        return Err(KernelError::Length {
            what,
            len,
            expected,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rackfill_balancer::{Algo, Layout, LoadMatrix, Settings};

    #[test]
    fn every_counted_pair_is_routed_once_and_groups_follow_the_instances() {
        let layout = Layout::contiguous(4, 16, 2).unwrap();
        // Uneven counts with one hot expert, so the plan replicates and splits.
        let counts: Vec<Vec<u64>> = (0..4u64)
            .map(|r| {
                (0..16u64)
                    .map(|e| (e * 7 + r * 3) % 11 + if e == 3 { 400 } else { 0 })
                    .collect()
            })
            .collect();
        let load = LoadMatrix::from_rows(&counts).unwrap();
        let settings = Settings {
            u_min: 1,
            ..Settings::default()
        };
        let plan = Algo::Quota.build(&settings).plan(&layout, &load).unwrap();
        assert!(plan.replicas() > 0, "the hot expert is replicated");
        let routes = Routes::new(&plan, &load).unwrap();
        let total: u64 = counts.iter().flatten().sum();
        let sent: usize = routes.sent.iter().flatten().sum();
        let grouped: usize = routes.groups.iter().flatten().map(|g| g.2).sum();
        assert_eq!((sent as u64, grouped as u64), (total, total));
        for (dst, groups) in routes.groups.iter().enumerate() {
            let received: usize = (0..4).map(|src| routes.sent[src][dst]).sum();
            assert_eq!(groups.iter().map(|g| g.2).sum::<usize>(), received);
            for &(e, t, _) in groups {
                assert_eq!(plan.instances(e as usize)[t as usize].rank as usize, dst);
            }
        }
        assert_eq!(
            routes.send_offset(1, 2),
            routes.sent[1][0] + routes.sent[1][1]
        );
        assert_eq!(
            routes.recv_offset(2, 1),
            routes.sent[0][1] + routes.sent[1][1]
        );
    }
}
