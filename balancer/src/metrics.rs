//! Figures of merit for a plan, with the names docs/architecture.md fixes for code, logs and
//! reports.

use crate::{main_rank_loads, Layout, LoadMatrix, Plan};
use serde::Serialize;

/// Everything rackfill reports about one layer's plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlanMetrics {
    /// `L0[t]`: load of rank t's main experts, before balancing.
    pub rank_load_before: Vec<u64>,
    /// `L[t] = sum_e quota[e][t]`, after balancing.
    pub rank_load_after: Vec<u64>,
    /// `max L0 / mean L0`.
    pub imbalance_before: f64,
    /// `max L / mean L` (1.00 is perfect).
    pub imbalance_after: f64,
    /// No plan under the layout's constraints can have a smaller `max L` (see [`lower_bound`]).
    pub lower_bound: u64,
    /// `max L / lower_bound`: how far the plan is from the best possible.
    pub gap: f64,
    /// Replicas created, `sum_e (|H(e)| - 1)`.
    pub replicas: usize,
    /// `max_e (|H(e)| - 1)`.
    pub max_fanout: usize,
    /// Token-expert pairs computed off their source rank, over all pairs.
    pub inflight_ratio: f64,
    /// `max L - mean L`, in token-expert pairs (FEPLB's token straggler).
    pub token_straggler: f64,
}

/// Computes [`PlanMetrics`] for a plan of `load` under `layout`.
pub fn evaluate(layout: &Layout, load: &LoadMatrix, plan: &Plan) -> PlanMetrics {
    let totals = load.expert_totals();
    let before = main_rank_loads(layout, &totals);
    let after = plan.rank_loads();
    let bound = lower_bound(layout, &totals);
    let max_after = after.iter().copied().max().unwrap_or(0);
    let total = load.total();
    PlanMetrics {
        imbalance_before: imbalance(&before),
        imbalance_after: imbalance(&after),
        lower_bound: bound,
        gap: if bound == 0 {
            1.0
        } else {
            max_after as f64 / bound as f64
        },
        replicas: plan.replicas(),
        max_fanout: plan.max_fanout(),
        inflight_ratio: if total == 0 {
            0.0
        } else {
            inflight_tokens(load, plan) as f64 / total as f64
        },
        token_straggler: max_after as f64 - mean(&after),
        rank_load_before: before,
        rank_load_after: after,
    }
}

/// `max / mean` of rank loads; 1.0 for an all-zero (trivially balanced) vector.
pub fn imbalance(loads: &[u64]) -> f64 {
    let m = mean(loads);
    if m == 0.0 {
        return 1.0;
    }
    loads.iter().copied().max().unwrap_or(0) as f64 / m
}

fn mean(loads: &[u64]) -> f64 {
    if loads.is_empty() {
        return 0.0;
    }
    loads.iter().sum::<u64>() as f64 / loads.len() as f64
}

/// A lower bound on `max L` that holds for every plan under the layout's constraints:
/// - averaging: `ceil(total / R)`;
/// - one expert can have at most `min(R, 1 + n_slot (R - 1))` instances (no duplicates on a rank),
///   so some instance carries `ceil(lambda_e / that)`;
/// - rank r can shed load only through replicas of its own main experts, at most
///   `(R - 1) min(n_slot, |E_r|)` of them, each carrying at most `max L`; so
///   `max L >= ceil(L0[r] / (1 + (R - 1) min(n_slot, |E_r|)))`. With `n_slot = 0` this is `max L0`.
pub fn lower_bound(layout: &Layout, expert_totals: &[u64]) -> u64 {
    let ranks = layout.ranks() as u64;
    let n_slot = layout.slots_per_rank() as u64;
    let total: u64 = expert_totals.iter().sum();
    let mut bound = total.div_ceil(ranks);
    let max_instances = ranks.min(1 + n_slot * (ranks - 1));
    for &lambda in expert_totals {
        bound = bound.max(lambda.div_ceil(max_instances));
    }
    for (r, &l0) in main_rank_loads(layout, expert_totals).iter().enumerate() {
        let mains = layout.main_experts(r).len() as u64;
        bound = bound.max(l0.div_ceil(1 + (ranks - 1) * n_slot.min(mains)));
    }
    bound
}

/// Token-expert pairs that leave their source rank under the plan's split.
pub fn inflight_tokens(load: &LoadMatrix, plan: &Plan) -> u64 {
    let mut moved = 0;
    for e in 0..plan.experts() {
        let inst = plan.instances(e);
        for r in 0..load.ranks() {
            match plan.split(r, e) {
                None => {
                    if inst[0].rank as usize != r {
                        moved += load.get(r, e);
                    }
                }
                Some(row) => {
                    moved += row
                        .iter()
                        .zip(inst)
                        .filter(|(_, i)| i.rank as usize != r)
                        .map(|(q, _)| q)
                        .sum::<u64>();
                }
            }
        }
    }
    moved
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn imbalance_of_even_and_skewed_loads() {
        assert_eq!(imbalance(&[5, 5, 5, 5]), 1.0);
        assert_eq!(imbalance(&[8, 0, 0, 0]), 4.0);
        assert_eq!(imbalance(&[0, 0]), 1.0);
    }

    #[test]
    fn lower_bound_without_slots_is_the_busiest_rank() {
        let layout = Layout::contiguous(2, 4, 0).unwrap();
        assert_eq!(lower_bound(&layout, &[10, 10, 1, 1]), 20);
        let with_slots = Layout::contiguous(2, 4, 1).unwrap();
        assert_eq!(lower_bound(&with_slots, &[10, 10, 1, 1]), 11);
    }

    #[test]
    fn one_hot_expert_bounds_by_its_instance_count() {
        // 4 ranks, 1 slot each: the hot expert can live on all 4 ranks.
        let layout = Layout::contiguous(4, 4, 1).unwrap();
        assert_eq!(lower_bound(&layout, &[100, 0, 0, 0]), 25);
    }
}
