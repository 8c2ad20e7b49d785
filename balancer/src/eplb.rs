//! DeepSeek EPLB as a baseline, adapted to rackfill's fixed layout.
//!
//! EPLB plans in three steps: (a) hand out redundant instances one at a time to the expert with the
//! largest load per instance, (b) pack the resulting physical replicas onto ranks heaviest first,
//! each onto the least-loaded rank that can take it, and (c) split every expert's tokens evenly
//! among its instances. Under UltraEP's layout (§4.1) main placement is immutable, every rank has
//! `n_slot` redundant slots and no rank may hold an expert twice, so (b) only fills slots and (a)
//! never asks for more than `R` instances of one expert.
//!
//! Two feeds, compared side by side: [`EplbExact`] plans every layer from its exact load (EPLB's
//! algorithm given UltraEP's information), [`EplbHistory`] plans from a moving window of past loads
//! and keeps its placement for `interval` steps (EPLB as serving stacks deploy it).

use crate::plan::{Replica, SplitPolicy};
use crate::{BalanceError, Balancer, Layout, LoadMatrix, Plan};
use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};

/// Steps of past load [`EplbHistory`] keeps by default.
pub const DEFAULT_HISTORY_WINDOW: usize = 50;
/// [`EplbHistory`] re-plans its placement every this many steps by default.
pub const DEFAULT_REBALANCE_INTERVAL: usize = 50;

/// Fixed-point scale of the per-instance weights used while packing: `lambda_e / cnt_e` is kept as
/// `(lambda_e << 32) / cnt_e`, so rank-load estimates stay integer (and therefore identical on every
/// rank) while losing less than one token in 2^32 per instance.
const WEIGHT_SHIFT: u32 = 32;

/// EPLB fed the exact load of the layer it plans: the strongest form of the baseline, isolating
/// the algorithm (even split, placement by estimated load) from prediction error.
#[derive(Debug, Default, Clone)]
pub struct EplbExact;

impl Balancer for EplbExact {
    fn name(&self) -> &'static str {
        "eplb-exact"
    }

    fn plan(&mut self, layout: &Layout, load: &LoadMatrix) -> Result<Plan, BalanceError> {
        load.check_shape(layout)?;
        let totals = load.expert_totals();
        let mut replicas = place_replicas(layout, &totals);
        Ok(assemble_with_even_split(
            layout,
            load,
            &totals,
            &mut replicas,
        ))
    }
}

/// EPLB as deployed: placement planned from a moving window of past loads, refreshed every
/// `interval` steps, with the current tokens split evenly among whatever instances exist.
///
/// One instance follows one layer's stream of loads. Each [`Balancer::plan`] call is one step.
/// The current load is recorded only *after* planning, so a placement never sees the load it
/// serves. At step 0 there is no history and the plan is main experts only; step 1 bootstraps a
/// placement from step 0 (a deployment would start from offline statistics; starting with nothing
/// for a whole interval would make short benchmark runs meaningless); after that the placement is
/// re-planned from the window's expert totals whenever `step % interval == 0`. A load whose layout
/// differs from the one the placement was made for resets the planner: history, placement and
/// step count.
#[derive(Debug, Clone)]
pub struct EplbHistory {
    window: usize,
    interval: usize,
    step: usize,
    layout: Option<Layout>,
    /// Expert totals of the last `window` steps, oldest first.
    history: VecDeque<Vec<u64>>,
    /// Per-expert sum over `history` (u128: exact add and subtract, no overflow for any window).
    window_sum: Vec<u128>,
    /// The current placement; quotas are recomputed from every step's load.
    placement: Vec<Replica>,
    scratch: Vec<Replica>,
}

impl EplbHistory {
    /// A planner with a window of `window` steps re-planning every `interval` steps (0 is taken as 1
    /// for both: a window must hold something and an interval must advance).
    pub fn new(window: usize, interval: usize) -> Self {
        Self {
            window: window.max(1),
            interval: interval.max(1),
            step: 0,
            layout: None,
            history: VecDeque::new(),
            window_sum: Vec::new(),
            placement: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// Forgets everything learned under another layout.
    fn reset(&mut self, layout: &Layout) {
        self.step = 0;
        self.layout = Some(layout.clone());
        self.history.clear();
        self.window_sum = vec![0; layout.experts()];
        self.placement.clear();
    }

    /// Re-plans the placement from the window's totals (saturated to u64, far beyond real loads).
    fn replan(&mut self, layout: &Layout) {
        let totals: Vec<u64> = self
            .window_sum
            .iter()
            .map(|&s| u64::try_from(s).unwrap_or(u64::MAX))
            .collect();
        self.placement = place_replicas(layout, &totals);
    }

    /// Pushes one step's expert totals into the window, evicting the oldest beyond `window`.
    fn record(&mut self, totals: Vec<u64>) {
        for (sum, &t) in self.window_sum.iter_mut().zip(&totals) {
            *sum += u128::from(t);
        }
        self.history.push_back(totals);
        if self.history.len() > self.window {
            if let Some(old) = self.history.pop_front() {
                for (sum, &t) in self.window_sum.iter_mut().zip(&old) {
                    *sum -= u128::from(t);
                }
            }
        }
    }
}

impl Balancer for EplbHistory {
    fn name(&self) -> &'static str {
        "eplb-history"
    }

    fn plan(&mut self, layout: &Layout, load: &LoadMatrix) -> Result<Plan, BalanceError> {
        load.check_shape(layout)?;
        if self.layout.as_ref() != Some(layout) {
            self.reset(layout);
        }
        if (self.step == 1 || self.step.is_multiple_of(self.interval)) && !self.history.is_empty() {
            self.replan(layout);
        }
        let totals = load.expert_totals();
        self.scratch.clear();
        self.scratch.extend_from_slice(&self.placement);
        let plan = assemble_with_even_split(layout, load, &totals, &mut self.scratch);
        self.record(totals);
        self.step = self.step.wrapping_add(1);
        Ok(plan)
    }
}

/// Steps (a) and (b): which experts get replicas, and on which ranks.
fn place_replicas(layout: &Layout, totals: &[u64]) -> Vec<Replica> {
    let counts = replica_counts(layout, totals);
    balanced_packing(layout, totals, &counts)
}

/// Step (c): every source splits its tokens evenly (round-robin) among the expert's instances.
fn assemble_with_even_split(
    layout: &Layout,
    load: &LoadMatrix,
    totals: &[u64],
    replicas: &mut [Replica],
) -> Plan {
    Plan::assemble(layout, Some(load), totals, replicas, SplitPolicy::Even)
}

/// An expert competing for the next redundant slot, ordered by load per instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Candidate {
    load: u64,
    count: u32,
    expert: u32,
}

impl Ord for Candidate {
    /// Larger `load / count` first (exact, by cross-multiplication), then the lower expert id.
    fn cmp(&self, other: &Self) -> Ordering {
        per_instance_cmp(self.load, self.count, other.load, other.count)
            .then(other.expert.cmp(&self.expert))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Compares `a / ca` with `b / cb` exactly (counts are at least 1).
fn per_instance_cmp(a: u64, ca: u32, b: u64, cb: u32) -> Ordering {
    (u128::from(a) * u128::from(cb)).cmp(&(u128::from(b) * u128::from(ca)))
}

/// Step (a): instance counts (main included). All `R * n_slot` slots go, one at a time, to the
/// expert with the largest load per instance; an expert stops at `R` instances (one per rank, the
/// no-duplicate limit) and experts without load never get a replica.
fn replica_counts(layout: &Layout, totals: &[u64]) -> Vec<u32> {
    let max_instances = u32::try_from(layout.ranks()).unwrap_or(u32::MAX);
    let mut counts = vec![1u32; totals.len()];
    let mut heap: BinaryHeap<Candidate> = totals
        .iter()
        .enumerate()
        .filter(|&(_, &load)| load > 0 && max_instances > 1)
        .map(|(e, &load)| Candidate {
            load,
            count: 1,
            expert: e as u32,
        })
        .collect();
    let slots = layout.ranks().saturating_mul(layout.slots_per_rank());
    for _ in 0..slots {
        let Some(mut best) = heap.pop() else { break };
        best.count += 1;
        counts[best.expert as usize] = best.count;
        if best.count < max_instances {
            heap.push(best);
        }
    }
    counts
}

/// Step (b): replicas, heaviest per-instance weight first (ties lower expert id), each onto the rank
/// with the smallest estimated load (mains weigh `lambda_e / cnt_e` each) that has a free slot and
/// does not yet hold the expert (ties lower rank). A replica with no admissible rank is dropped.
fn balanced_packing(layout: &Layout, totals: &[u64], counts: &[u32]) -> Vec<Replica> {
    let ranks = layout.ranks();
    let weight = |e: usize| (u128::from(totals[e]) << WEIGHT_SHIFT) / u128::from(counts[e].max(1));
    let mut estimate = vec![0u128; ranks];
    for (e, &home) in layout.home_map().iter().enumerate() {
        estimate[home as usize] += weight(e);
    }
    let mut order: Vec<u32> = (0..totals.len() as u32)
        .filter(|&e| counts[e as usize] > 1)
        .collect();
    order.sort_by(|&a, &b| {
        let (a_, b_) = (a as usize, b as usize);
        per_instance_cmp(totals[b_], counts[b_], totals[a_], counts[a_]).then(a.cmp(&b))
    });

    let mut free = vec![layout.slots_per_rank(); ranks];
    let mut holds = vec![false; ranks];
    let mut replicas = Vec::new();
    for &e in &order {
        let expert = e as usize;
        holds.fill(false);
        holds[layout.home(expert)] = true;
        let w = weight(expert);
        for _ in 1..counts[expert] {
            let Some(rank) = least_loaded_admissible(&estimate, &free, &holds) else {
                break; // no rank can take another copy: the remaining replicas are dropped
            };
            free[rank] -= 1;
            holds[rank] = true;
            estimate[rank] += w;
            replicas.push(Replica {
                expert: e,
                rank: rank as u32,
                quota: 0,
            });
        }
    }
    replicas
}

/// The rank with the smallest estimate among those with a free slot not holding the expert.
fn least_loaded_admissible(estimate: &[u128], free: &[usize], holds: &[bool]) -> Option<usize> {
    (0..estimate.len())
        .filter(|&t| free[t] > 0 && !holds[t])
        .min_by_key(|&t| (estimate[t], t))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic test inputs without extra dependencies.
    struct Lcg(u64);

    impl Lcg {
        fn next(&mut self) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            self.0 >> 33
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next() % n.max(1)
        }
    }

    /// A skewed load: a few hot experts, some idle ones.
    fn random_load(rng: &mut Lcg, ranks: usize, experts: usize) -> LoadMatrix {
        let heat: Vec<u64> = (0..experts)
            .map(|_| match rng.below(4) {
                0 => 0,
                1 => 20,
                _ => 1 + rng.below(4),
            })
            .collect();
        let counts = (0..ranks * experts)
            .map(|i| match heat[i % experts] {
                0 => 0,
                h => rng.below(h * 10 + 1),
            })
            .collect();
        LoadMatrix::from_flat(ranks, experts, counts).unwrap()
    }

    fn occupied(plan: &Plan) -> usize {
        plan.slots().iter().filter(|s| s.is_some()).count()
    }

    #[test]
    fn exact_plan_of_one_hot_expert() {
        let layout = Layout::contiguous(4, 4, 1).unwrap();
        let load = LoadMatrix::from_rows(&[[100, 10, 10, 10], [0; 4], [0; 4], [0; 4]]).unwrap();
        let plan = EplbExact.plan(&layout, &load).unwrap();
        plan.validate(&layout, &load, 0).unwrap();
        // Counts: expert 0 takes three slots (100 -> 50 -> 33 -> 25), expert 1 wins the tie for the
        // fourth. Expert 0's copies go to the lightest ranks 1, 2, 3; expert 1's to rank 0.
        let slots: Vec<_> = plan.slots().to_vec();
        assert_eq!(slots, vec![Some(1), Some(0), Some(0), Some(0)]);
        assert_eq!(plan.rank_loads(), vec![30, 30, 35, 35]);
    }

    #[test]
    fn exact_plans_validate_and_are_deterministic_on_random_loads() {
        let mut rng = Lcg(7);
        for _ in 0..300 {
            let ranks = 1 + rng.below(9) as usize;
            let experts = rng.below(20) as usize;
            let slots = (rng.below(4) as usize).min(experts.max(1));
            let layout = Layout::contiguous(ranks, experts, slots).unwrap();
            let load = random_load(&mut rng, ranks, experts);
            let plan = EplbExact.plan(&layout, &load).unwrap();
            plan.validate(&layout, &load, 0).unwrap();
            assert_eq!(plan, EplbExact.plan(&layout, &load).unwrap());
        }
    }

    #[test]
    fn exact_uses_every_slot_when_all_experts_are_loaded() {
        let mut rng = Lcg(11);
        for (ranks, experts, slots) in [(8, 16, 2), (8, 32, 4), (16, 64, 2), (72, 256, 2)] {
            let layout = Layout::contiguous(ranks, experts, slots).unwrap();
            let counts = (0..ranks * experts).map(|_| 1 + rng.below(100)).collect();
            let load = LoadMatrix::from_flat(ranks, experts, counts).unwrap();
            let plan = EplbExact.plan(&layout, &load).unwrap();
            plan.validate(&layout, &load, 0).unwrap();
            assert_eq!(occupied(&plan), ranks * slots);
        }
    }

    #[test]
    fn degenerate_inputs_do_not_panic() {
        for (ranks, experts, slots) in [(1, 4, 2), (1, 0, 0), (4, 2, 2), (5, 7, 0), (3, 0, 1)] {
            let layout = Layout::contiguous(ranks, experts, slots).unwrap();
            for load in [
                LoadMatrix::zeros(ranks, experts),
                LoadMatrix::from_flat(ranks, experts, vec![9; ranks * experts]).unwrap(),
            ] {
                let plan = EplbExact.plan(&layout, &load).unwrap();
                plan.validate(&layout, &load, 0).unwrap();
                let mut history = EplbHistory::new(0, 0);
                for _ in 0..3 {
                    let plan = history.plan(&layout, &load).unwrap();
                    plan.validate(&layout, &load, 0).unwrap();
                }
            }
            // R = 1 or E = 0 or n_slot = 0: nothing to replicate.
            if ranks == 1 || experts == 0 || slots == 0 {
                let load = LoadMatrix::from_flat(ranks, experts, vec![9; ranks * experts]).unwrap();
                assert_eq!(EplbExact.plan(&layout, &load).unwrap().replicas(), 0);
            }
        }
        let layout = Layout::contiguous(2, 2, 1).unwrap();
        let wrong = LoadMatrix::zeros(3, 2);
        assert!(EplbExact.plan(&layout, &wrong).is_err());
        assert!(EplbHistory::new(4, 4).plan(&layout, &wrong).is_err());
    }

    #[test]
    fn zero_load_experts_get_no_replicas() {
        let layout = Layout::contiguous(4, 8, 2).unwrap();
        let mut load = LoadMatrix::zeros(4, 8);
        *load.get_mut(0, 3) = 40;
        let plan = EplbExact.plan(&layout, &load).unwrap();
        plan.validate(&layout, &load, 0).unwrap();
        assert_eq!(plan.instances(3).len(), 4);
        assert_eq!(plan.replicas(), 3);
        assert_eq!(plan.rank_loads(), vec![10, 10, 10, 10]);
    }

    #[test]
    fn history_reuses_its_placement_between_replans() {
        let layout = Layout::contiguous(4, 8, 1).unwrap();
        let hot = |e: usize| {
            let mut load = LoadMatrix::zeros(4, 8);
            for r in 0..4 {
                *load.get_mut(r, e) = 50;
                *load.get_mut(r, (e + 1) % 8) = 1;
            }
            load
        };
        let placement = |plan: &Plan| plan.slots().to_vec();
        let mut history = EplbHistory::new(3, 4);
        // Step 0: no history, main experts only.
        let first = history.plan(&layout, &hot(1)).unwrap();
        assert_eq!(first.replicas(), 0);
        // Step 1: bootstrapped from step 0 (expert 1 hot), kept through step 3.
        let at1 = history.plan(&layout, &hot(0)).unwrap();
        assert_eq!(at1.instances(1).len(), 4);
        for _ in 2..4 {
            let plan = history.plan(&layout, &hot(0)).unwrap();
            assert_eq!(placement(&plan), placement(&at1));
            assert_eq!(plan.instances(0).len(), 1);
        }
        // Step 4: re-planned from steps 1..=3 (expert 0 hot).
        let at4 = history.plan(&layout, &hot(0)).unwrap();
        at4.validate(&layout, &hot(0), 0).unwrap();
        assert_eq!(at4.instances(0).len(), 4);
        // Steps 5..=7: the hot expert moves, the placement stays; quotas follow the current load.
        for _ in 5..8 {
            let load = hot(5);
            let plan = history.plan(&layout, &load).unwrap();
            plan.validate(&layout, &load, 0).unwrap();
            assert_eq!(placement(&plan), placement(&at4));
            assert_eq!(plan.instances(5).len(), 1);
        }
        // Step 8: the window (steps 5..=7) now sees expert 5.
        let at8 = history.plan(&layout, &hot(5)).unwrap();
        at8.validate(&layout, &hot(5), 0).unwrap();
        assert_ne!(placement(&at8), placement(&at4));
        assert_eq!(at8.instances(5).len(), 4);
        // Same input sequence, same plans.
        let mut again = EplbHistory::new(3, 4);
        let mut last = None;
        for step in 0..9 {
            let hot_expert = match step {
                0 => 1,
                1..=4 => 0,
                _ => 5,
            };
            last = Some(again.plan(&layout, &hot(hot_expert)).unwrap());
        }
        assert_eq!(last.unwrap(), at8);
    }

    #[test]
    fn history_resets_on_a_new_layout() {
        let small = Layout::contiguous(2, 4, 1).unwrap();
        let large = Layout::contiguous(4, 8, 1).unwrap();
        let mut history = EplbHistory::new(2, 3);
        let load = LoadMatrix::from_flat(2, 4, vec![10, 0, 0, 0, 10, 0, 0, 0]).unwrap();
        history.plan(&small, &load).unwrap();
        assert_eq!(history.plan(&small, &load).unwrap().replicas(), 1);
        let load = LoadMatrix::from_flat(4, 8, vec![3; 32]).unwrap();
        // Fresh start under the new layout: no history yet.
        let plan = history.plan(&large, &load).unwrap();
        plan.validate(&large, &load, 0).unwrap();
        assert_eq!(plan.replicas(), 0);
        let plan = history.plan(&large, &load).unwrap();
        plan.validate(&large, &load, 0).unwrap();
        assert_eq!(plan.replicas(), 4);
    }
}
