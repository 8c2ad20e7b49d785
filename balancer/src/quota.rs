//! UltraEP's quota-driven planner (Algorithm 1, §5.1) with locality-first reroute (§5.2).
//!
//! The planner looks for the smallest rank-load threshold `tau` that replication alone can reach.
//! For a probe `tau`, ranks above it must shed `exc[r] = L0[r] - tau` and ranks below it can absorb
//! `slk[t] = tau - L0[t]`. A greedy oracle drains the overloaded ranks (largest excess first) by
//! moving load of their hottest main experts to the admissible rank with the largest slack; every
//! accepted move creates one replica whose quota is exactly the load moved, so the placement already
//! encodes the reroute capacity. A binary search over `tau` keeps the best feasible probe.
//!
//! Improvements over the paper's pseudo-code (measured side by side in docs/balancer.md):
//! - target choice ([`TargetRule::BestFit`], the default): when some admissible rank's slack covers
//!   what the expert still has to shed, take the *smallest* such slack, so one replica finishes
//!   the job and large slacks stay whole for larger excesses; otherwise take the largest slack,
//!   as the paper does. Largest-slack-always strands slack on ranks whose slots run out, and the
//!   search then settles on a higher threshold. [`TargetRule::LargestSlack`] keeps the paper's rule;
//! - the search starts at the plan-independent lower bound ([`crate::metrics::lower_bound`])
//!   and gallops upward from it (the answer is almost always within a percent of the bound)
//!   before bisecting; a feasible probe lowers the upper end to the load it actually reached;
//! - ranks are sorted by load once per layer, so every probe reads its overloaded ranks and its
//!   targets (by ascending slack) off that order without sorting; admissible targets sit in a
//!   small sorted vector searched by a branch-free count and re-filed by a rotate.
//!
//! Why admissibility is only "slack and a free slot": an overloaded rank has no slack, so a target
//! is never the expert's home, and each move exhausts the excess, the target's slack, the expert's
//! remaining load or the target's last slot; so the same expert never lands twice on one rank.

use crate::metrics::lower_bound;
use crate::plan::{Replica, SplitPolicy};
use crate::{main_rank_loads, BalanceError, Balancer, Layout, LoadMatrix, Plan};
use std::cmp::Reverse;

/// Default smallest quota of a new replica: one token-expert pair, i.e. never an empty replica.
pub const DEFAULT_U_MIN: u64 = 1;

/// How the greedy oracle picks the rank that takes a replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TargetRule {
    /// The smallest slack that covers what the expert still has to shed, else the largest slack.
    #[default]
    BestFit,
    /// Always the largest slack (UltraEP Algorithm 1 as published).
    LargestSlack,
}

/// The quota-driven planner. Keeps its scratch buffers between layers.
#[derive(Debug, Clone)]
pub struct QuotaPlanner {
    u_min: u64,
    rule: TargetRule,
    scratch: Scratch,
}

#[derive(Debug, Clone, Default)]
struct Scratch {
    totals: Vec<u64>,
    rank_load: Vec<u64>,
    /// Main experts of every rank by descending load (ties: lower expert id), CSR like the layout.
    hottest_first: Vec<u32>,
    hottest_offsets: Vec<usize>,
    /// Ranks by descending main load (ties: lower rank), sorted once per layer: for any threshold
    /// the overloaded ranks are a prefix and the admissible targets, by ascending slack, the rest.
    by_load: Vec<u32>,
    slack: Vec<u64>,
    free_slots: Vec<usize>,
    /// Admissible targets (slack > 0 and a free slot) sorted by ascending `(slack, rank)`: the
    /// last entry is the largest slack, ties to the higher rank.
    targets: Vec<(u64, u32)>,
    moves: Vec<Replica>,
    best: Vec<Replica>,
}

impl QuotaPlanner {
    /// A planner whose replicas each take at least `u_min` token-expert pairs (0 is treated as 1:
    /// an empty replica only costs a weight transfer).
    pub fn new(u_min: u64) -> Self {
        Self::with_rule(u_min, TargetRule::default())
    }

    /// A planner with an explicit target rule (for ablations against the published algorithm).
    pub fn with_rule(u_min: u64, rule: TargetRule) -> Self {
        Self {
            u_min: u_min.max(1),
            rule,
            scratch: Scratch::default(),
        }
    }

    /// The quota floor in force.
    pub fn u_min(&self) -> u64 {
        self.u_min
    }
}

impl Default for QuotaPlanner {
    fn default() -> Self {
        Self::new(DEFAULT_U_MIN)
    }
}

impl Balancer for QuotaPlanner {
    fn name(&self) -> &'static str {
        match self.rule {
            TargetRule::BestFit => "quota",
            TargetRule::LargestSlack => "quota-paper",
        }
    }

    fn plan(&mut self, layout: &Layout, load: &LoadMatrix) -> Result<Plan, BalanceError> {
        load.check_shape(layout)?;
        let s = &mut self.scratch;
        load.expert_totals_into(&mut s.totals);
        s.rank_load = main_rank_loads(layout, &s.totals);
        order_mains_hottest_first(layout, s);
        order_ranks_by_load(s);
        let reached = search_threshold(layout, s, self.u_min, self.rule);
        let mut main_quota = s.totals.clone();
        if reached.is_some() {
            for m in &s.best {
                main_quota[m.expert as usize] -= m.quota;
            }
        } else {
            s.best.clear();
        }
        Ok(Plan::assemble(
            layout,
            Some(load),
            &main_quota,
            &mut s.best,
            SplitPolicy::LocalityFirst,
        ))
    }

    fn u_min(&self) -> u64 {
        self.u_min
    }
}

/// Sorts each rank's main experts by descending load once per layer; every probe walks them in
/// this order.
fn order_mains_hottest_first(layout: &Layout, s: &mut Scratch) {
    s.hottest_first.clear();
    s.hottest_offsets.clear();
    for r in 0..layout.ranks() {
        s.hottest_offsets.push(s.hottest_first.len());
        let start = s.hottest_first.len();
        s.hottest_first.extend_from_slice(layout.main_experts(r));
        let totals = &s.totals;
        s.hottest_first[start..].sort_unstable_by_key(|&e| (Reverse(totals[e as usize]), e));
    }
    s.hottest_offsets.push(s.hottest_first.len());
}

/// Sorts the ranks by descending main load once per layer.
fn order_ranks_by_load(s: &mut Scratch) {
    s.by_load.clear();
    s.by_load.extend(0..s.rank_load.len() as u32);
    let loads = &s.rank_load;
    s.by_load
        .sort_unstable_by_key(|&r| (Reverse(loads[r as usize]), r));
}

/// Searches for the smallest feasible threshold: gallops up from the lower bound, then bisects.
/// Leaves the best probe's moves in `s.best` and returns the max rank load it reaches, or `None`
/// when no probe beats the unbalanced layout.
fn search_threshold(layout: &Layout, s: &mut Scratch, u_min: u64, rule: TargetRule) -> Option<u64> {
    let ranks = layout.ranks() as u64;
    let total: u64 = s.rank_load.iter().sum();
    // Without any move the busiest rank is feasible, so `hi` is always a known-feasible load.
    let mut hi = s.rank_load.iter().copied().max().unwrap_or(0);
    let mut lo = lower_bound(layout, &s.totals).max(total.div_ceil(ranks));
    let mut step = (lo / 1024).max(1);
    let mut galloping = true;
    let mut reached = None;
    while lo < hi {
        let tau = if galloping {
            (lo + step - 1).min(hi - 1)
        } else {
            lo + (hi - lo) / 2
        };
        match probe(layout, s, tau, u_min, rule) {
            Some(max_load) => {
                std::mem::swap(&mut s.best, &mut s.moves);
                reached = Some(max_load);
                hi = max_load;
                galloping = false;
            }
            None => {
                lo = tau + 1;
                step = step.saturating_mul(2);
            }
        }
    }
    reached
}

/// The greedy feasibility oracle for one threshold. On success `s.moves` holds one entry per new
/// replica and the result is the largest rank load after the moves.
fn probe(layout: &Layout, s: &mut Scratch, tau: u64, u_min: u64, rule: TargetRule) -> Option<u64> {
    let overloaded = s
        .by_load
        .partition_point(|&r| s.rank_load[r as usize] > tau);
    seed_targets(layout, s, tau, overloaded);
    s.moves.clear();
    for k in 0..overloaded {
        let r = s.by_load[k] as usize;
        let excess = drain_rank(s, r, s.rank_load[r] - tau, u_min, rule);
        if excess > 0 {
            return None;
        }
    }
    // Loads after the moves: overloaded ranks sit exactly at tau, receivers at tau - slack.
    let receivers_max = s.by_load[overloaded..]
        .iter()
        .map(|&t| tau - s.slack[t as usize])
        .max()
        .unwrap_or(0);
    Some(if overloaded == 0 {
        receivers_max
    } else {
        tau.max(receivers_max)
    })
}

/// Every rank below the threshold with a free slot is a candidate target; `by_load` past the
/// overloaded prefix already lists them by ascending slack.
fn seed_targets(layout: &Layout, s: &mut Scratch, tau: u64, overloaded: usize) {
    let n_slot = layout.slots_per_rank();
    s.slack.clear();
    s.slack
        .extend(s.rank_load.iter().map(|&l| tau.saturating_sub(l)));
    s.free_slots.clear();
    s.free_slots.resize(layout.ranks(), n_slot);
    s.targets.clear();
    if n_slot > 0 {
        let slack = &s.slack;
        s.targets.extend(
            s.by_load[overloaded..]
                .iter()
                .map(|&t| (slack[t as usize], t))
                .filter(|&(slk, _)| slk > 0),
        );
        // Equal loads were ordered by ascending rank: ascending (slack, rank) already.
        debug_assert!(s.targets.is_sorted());
    }
}

/// Index in `targets` of the rank that should take up to `need` pairs under `rule`.
fn pick_target(targets: &[(u64, u32)], need: u64, rule: TargetRule) -> usize {
    let largest = targets.len() - 1;
    match rule {
        TargetRule::LargestSlack => largest,
        TargetRule::BestFit => count_below(targets, (need, 0)).min(largest),
    }
}

/// Number of entries below `key` in a sorted slice: a branch-free scan, which beats a binary
/// search's mispredicted branches at the few dozen entries a target set holds.
fn count_below(targets: &[(u64, u32)], key: (u64, u32)) -> usize {
    targets.iter().map(|&t| usize::from(t < key)).sum()
}

/// Sheds rank `r`'s excess through replicas of its hottest main experts; returns what is left.
fn drain_rank(s: &mut Scratch, r: usize, mut excess: u64, u_min: u64, rule: TargetRule) -> u64 {
    for k in s.hottest_offsets[r]..s.hottest_offsets[r + 1] {
        let expert = s.hottest_first[k];
        let mut cap = s.totals[expert as usize];
        while excess > 0 && cap > 0 {
            if s.targets.is_empty() {
                return excess;
            }
            let need = excess.min(cap);
            let at = pick_target(&s.targets, need, rule);
            let (slack, t) = s.targets[at];
            let delta = need.min(slack);
            if delta < u_min {
                break;
            }
            s.moves.push(Replica {
                expert,
                rank: t,
                quota: delta,
            });
            excess -= delta;
            cap -= delta;
            let t = t as usize;
            s.slack[t] -= delta;
            s.free_slots[t] -= 1;
            if s.slack[t] > 0 && s.free_slots[t] > 0 {
                // The slack only shrank: the entry moves down to its new place.
                let entry = (s.slack[t], t as u32);
                let to = count_below(&s.targets[..at], entry);
                s.targets[to..=at].rotate_right(1);
                s.targets[to] = entry;
            } else {
                s.targets.remove(at);
            }
        }
        if excess == 0 {
            break;
        }
    }
    excess
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::evaluate;

    fn plan(layout: &Layout, rows: &[Vec<u64>], u_min: u64) -> (LoadMatrix, Plan) {
        let load = LoadMatrix::from_rows(rows).unwrap();
        let plan = QuotaPlanner::new(u_min).plan(layout, &load).unwrap();
        plan.validate(layout, &load, u_min).unwrap();
        (load, plan)
    }

    #[test]
    fn hot_expert_is_replicated_to_reach_the_mean() {
        // 4 ranks, 1 expert each; expert 0 takes 70 of 100 pairs.
        let layout = Layout::contiguous(4, 4, 1).unwrap();
        let rows = vec![
            vec![40, 5, 5, 0],
            vec![10, 0, 5, 5],
            vec![10, 0, 0, 5],
            vec![10, 0, 0, 5],
        ];
        let (load, plan) = plan(&layout, &rows, 1);
        assert_eq!(plan.rank_loads(), vec![25, 25, 25, 25]);
        let m = evaluate(&layout, &load, &plan);
        assert_eq!(m.imbalance_after, 1.0);
        assert_eq!(m.replicas, 3);
        // The main instance is home and keeps tau; replicas sit in rank order.
        let ranks: Vec<u32> = plan.instances(0).iter().map(|i| i.rank).collect();
        assert_eq!(ranks, vec![0, 1, 2, 3]);
    }

    #[test]
    fn balanced_load_creates_no_replica() {
        let layout = Layout::contiguous(2, 4, 2).unwrap();
        let (_, plan) = plan(&layout, &[vec![5, 5, 5, 5], vec![5, 5, 5, 5]], 1);
        assert_eq!(plan.replicas(), 0);
        assert_eq!(plan.rank_loads(), vec![20, 20]);
    }

    #[test]
    fn u_min_floor_refuses_small_replicas() {
        let layout = Layout::contiguous(2, 2, 1).unwrap();
        // Rank 0 is 6 over the mean of 50 + 3; a floor of 10 forbids shedding 3.
        let rows = vec![vec![28, 25], vec![28, 25]];
        let (_, floored) = plan(&layout, &rows, 10);
        assert_eq!(floored.replicas(), 0);
        let (_, free) = plan(&layout, &rows, 1);
        assert_eq!(free.rank_loads(), vec![53, 53]);
    }

    #[test]
    fn slots_bound_the_replicas() {
        // 4 ranks, expert 0 holds everything; one slot each lets 3 replicas share the load.
        let layout = Layout::contiguous(4, 4, 1).unwrap();
        let (_, p) = plan(&layout, &vec![vec![100, 0, 0, 0]; 4], 1);
        assert_eq!(p.rank_loads(), vec![100, 100, 100, 100]);
        let no_slots = Layout::contiguous(4, 4, 0).unwrap();
        let (_, p) = plan(&no_slots, &vec![vec![100, 0, 0, 0]; 4], 1);
        assert_eq!(p.replicas(), 0);
    }

    #[test]
    fn locality_first_keeps_host_tokens_home() {
        let layout = Layout::contiguous(2, 2, 1).unwrap();
        let rows = vec![vec![30, 0], vec![10, 0]];
        let (_, p) = plan(&layout, &rows, 1);
        assert_eq!(p.rank_loads(), vec![20, 20]);
        // Rank 1 hosts the replica and its 10 local tokens stay local.
        assert_eq!(p.split(1, 0), Some(&[0, 10][..]));
        assert_eq!(p.split(0, 0), Some(&[20, 10][..]));
    }
}
