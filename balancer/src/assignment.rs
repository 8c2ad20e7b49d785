//! Token assignment by cumulative quotas (UltraEP §5.2): the j-th local token of (source rank r,
//! expert e) goes to the first instance whose cumulative quota exceeds j. This is the lookup the
//! dispatch step (CPU or GPU) performs per token.

use crate::Plan;

/// Cumulative reroute split of one plan, flattened for one-lookup token dispatch.
///
/// Only experts with replicas carry a table; every other expert maps all tokens to its main
/// instance. Tables are stored per expert as `R` rows of `|H(e)|` cumulative ends, the layout a GPU
/// kernel reads with one binary search in a row of a handful of entries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenAssignment {
    ranks: usize,
    /// Per expert: offset into `cumulative` (`u32::MAX` when the expert has no replica).
    table: Vec<u32>,
    /// Per expert: the ranks of its instances' offsets into `instance_ranks`.
    instance_offsets: Vec<u32>,
    instance_ranks: Vec<u32>,
    cumulative: Vec<u64>,
}

/// Marks experts without replicas in [`TokenAssignment::table`].
const NO_TABLE: u32 = u32::MAX;

impl TokenAssignment {
    /// Prefix-scans a plan's split into cumulative quotas.
    pub fn new(plan: &Plan) -> Self {
        let experts = plan.experts();
        let ranks = plan.ranks();
        let mut table = Vec::with_capacity(experts);
        let mut instance_offsets = Vec::with_capacity(experts + 1);
        let mut instance_ranks = Vec::new();
        let mut cumulative = Vec::new();
        for e in 0..experts {
            let inst = plan.instances(e);
            instance_offsets.push(instance_ranks.len() as u32);
            instance_ranks.extend(inst.iter().map(|i| i.rank));
            if inst.len() == 1 {
                table.push(NO_TABLE);
                continue;
            }
            table.push(cumulative.len() as u32);
            for r in 0..ranks {
                let mut end = 0u64;
                for &q in plan.split(r, e).expect("replicated experts carry a split") {
                    end += q;
                    cumulative.push(end);
                }
            }
        }
        instance_offsets.push(instance_ranks.len() as u32);
        Self {
            ranks,
            table,
            instance_offsets,
            instance_ranks,
            cumulative,
        }
    }

    /// Instance index (in [`Plan::instances`] order) of the `j`-th token that source rank `r`
    /// routes to expert `e`. Tokens past the source's load are clamped to the last instance.
    pub fn instance_of(&self, rank: usize, expert: usize, j: u64) -> usize {
        let offset = self.table[expert];
        if offset == NO_TABLE {
            return 0;
        }
        let n = self.instances(expert).len();
        let start = offset as usize + rank * n;
        let row = &self.cumulative[start..start + n];
        row.partition_point(|&end| end <= j).min(n - 1)
    }

    /// Rank that computes the `j`-th token of (source `r`, expert `e`).
    pub fn rank_of(&self, rank: usize, expert: usize, j: u64) -> usize {
        self.instances(expert)[self.instance_of(rank, expert, j)] as usize
    }

    /// Ranks of expert `e`'s instances (main first).
    pub fn instances(&self, expert: usize) -> &[u32] {
        &self.instance_ranks
            [self.instance_offsets[expert] as usize..self.instance_offsets[expert + 1] as usize]
    }

    /// Number of source ranks.
    pub fn ranks(&self) -> usize {
        self.ranks
    }
}
