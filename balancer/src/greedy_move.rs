//! FEPLB-style whole-expert greedy, as a baseline under rackfill's fixed layout.
//!
//! FEPLB balances by moving whole experts: take the busiest rank, move its heaviest expert that
//! helps to the idlest rank, repeat. Under UltraEP's layout (§4.1) main placement is immutable, so a
//! "move" of a main expert creates a replica in a redundant slot that takes all of the expert's
//! tokens while the main instance keeps quota 0; a replica can move again (freeing its slot) or go
//! back home. Every expert therefore has exactly one instance with positive quota, which is what
//! separates this baseline from quota splitting: it cannot cut a hot expert into pieces.

use crate::plan::{Replica, SplitPolicy};
use crate::{BalanceError, Balancer, Layout, LoadMatrix, Plan};

/// Whole-expert greedy moves from the busiest rank to the idlest admissible one.
#[derive(Debug, Default, Clone)]
pub struct GreedyMove;

impl Balancer for GreedyMove {
    fn name(&self) -> &'static str {
        "greedy-move"
    }

    fn plan(&mut self, layout: &Layout, load: &LoadMatrix) -> Result<Plan, BalanceError> {
        load.check_shape(layout)?;
        let totals = load.expert_totals();
        let mut state = MoveState::new(layout, &totals);
        state.move_until_stuck();
        Ok(state.into_plan(load))
    }
}

/// Where every expert's whole load currently sits, and what that does to the ranks.
struct MoveState<'a> {
    layout: &'a Layout,
    totals: &'a [u64],
    /// The rank computing all of expert `e`'s tokens: its home, or the rank of its one replica.
    active: Vec<u32>,
    rank_load: Vec<u64>,
    free_slots: Vec<usize>,
}

impl<'a> MoveState<'a> {
    /// Main experts only: every expert active on its home rank, every slot free.
    fn new(layout: &'a Layout, totals: &'a [u64]) -> Self {
        let mut rank_load = vec![0u64; layout.ranks()];
        for (e, &home) in layout.home_map().iter().enumerate() {
            rank_load[home as usize] += totals[e];
        }
        Self {
            layout,
            totals,
            active: layout.home_map().to_vec(),
            rank_load,
            free_slots: vec![layout.slots_per_rank(); layout.ranks()],
        }
    }

    /// Moves experts off the busiest rank until no move lowers it. Every accepted move replaces the
    /// busiest load by two strictly smaller ones, so the sorted load vector decreases
    /// lexicographically and the loop ends; the explicit bound only caps the solve time.
    fn move_until_stuck(&mut self) {
        let ranks = self.layout.ranks();
        let max_moves = (self.layout.experts().saturating_add(ranks))
            .saturating_mul(4)
            .saturating_add(ranks.saturating_mul(self.layout.slots_per_rank()));
        for _ in 0..max_moves {
            let busiest = self.busiest_rank();
            if !self.move_one_expert_off(busiest) {
                break;
            }
        }
    }

    /// The rank with the largest load, ties to the lower rank.
    fn busiest_rank(&self) -> usize {
        (0..self.rank_load.len())
            .max_by(|&a, &b| self.rank_load[a].cmp(&self.rank_load[b]).then(b.cmp(&a)))
            .unwrap_or(0)
    }

    /// Experts with positive load active on `rank`, heaviest first (ties lower expert id).
    fn candidates_on(&self, rank: usize) -> Vec<usize> {
        let mut experts: Vec<usize> = (0..self.active.len())
            .filter(|&e| self.active[e] as usize == rank && self.totals[e] > 0)
            .collect();
        experts.sort_by(|&a, &b| self.totals[b].cmp(&self.totals[a]).then(a.cmp(&b)));
        experts
    }

    /// The idlest rank that may take expert `e`'s whole load from `from` (ties lower rank): its
    /// home when the load currently sits on a replica, or any rank with a free slot that does not
    /// already hold the expert.
    fn idlest_target(&self, e: usize, from: usize) -> Option<usize> {
        let home = self.layout.home(e);
        let on_replica = from != home;
        (0..self.rank_load.len())
            .filter(|&t| {
                t != from
                    && if t == home {
                        on_replica
                    } else {
                        self.free_slots[t] > 0
                    }
            })
            .min_by_key(|&t| (self.rank_load[t], t))
    }

    /// Tries the busiest rank's experts in order and applies the first move that lowers
    /// `max(L_busiest - w, L_target + w)` strictly below `L_busiest`. Returns whether one moved.
    fn move_one_expert_off(&mut self, busiest: usize) -> bool {
        let peak = self.rank_load[busiest];
        for e in self.candidates_on(busiest) {
            let w = self.totals[e];
            let Some(target) = self.idlest_target(e, busiest) else {
                continue;
            };
            if self.rank_load[target].saturating_add(w) >= peak {
                continue;
            }
            self.relocate(e, busiest, target);
            return true;
        }
        false
    }

    /// Moves expert `e`'s whole load from `from` to `to`, releasing `from`'s slot when it was a
    /// replica and taking one on `to` unless `to` is home (so no zero-quota replica is left behind).
    fn relocate(&mut self, e: usize, from: usize, to: usize) {
        let home = self.layout.home(e);
        if from != home {
            self.free_slots[from] += 1;
        }
        if to != home {
            self.free_slots[to] -= 1;
        }
        self.rank_load[from] -= self.totals[e];
        self.rank_load[to] += self.totals[e];
        self.active[e] = to as u32;
    }

    /// The plan: moved experts keep a main instance with quota 0 and one replica with all tokens;
    /// locality-first reroute then sends every source's tokens to that replica.
    fn into_plan(self, load: &LoadMatrix) -> Plan {
        let mut main_quota = self.totals.to_vec();
        let mut replicas = Vec::new();
        for (e, &rank) in self.active.iter().enumerate() {
            if rank as usize != self.layout.home(e) {
                main_quota[e] = 0;
                replicas.push(Replica {
                    expert: e as u32,
                    rank,
                    quota: self.totals[e],
                });
            }
        }
        Plan::assemble(
            self.layout,
            Some(load),
            &main_quota,
            &mut replicas,
            SplitPolicy::LocalityFirst,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::main_rank_loads;

    /// Deterministic test inputs without extra dependencies.
    struct Lcg(u64);

    impl Lcg {
        fn below(&mut self, n: u64) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (self.0 >> 33) % n.max(1)
        }
    }

    fn busiest(loads: &[u64]) -> u64 {
        loads.iter().copied().max().unwrap_or(0)
    }

    #[test]
    fn moves_whole_experts_to_the_idlest_rank() {
        // Rank 0 holds experts 0 (40) and 1 (30); ranks 1, 2 are light.
        let layout = Layout::contiguous(3, 6, 1).unwrap();
        let load = LoadMatrix::from_rows(&[[40, 30, 5, 0, 2, 0], [0; 6], [0; 6]]).unwrap();
        let plan = GreedyMove.plan(&layout, &load).unwrap();
        plan.validate(&layout, &load, 0).unwrap();
        // L = [70, 5, 2]. Expert 0 (40) moves to the idlest rank 2: [30, 5, 42]. On rank 2, the
        // replica of expert 0 cannot improve (5 + 40 >= 42), expert 4 (2) moves to rank 1:
        // [30, 7, 40]. Rank 2 again: rank 1 has no free slot, home gives 30 + 40 >= 40: stuck.
        assert_eq!(plan.rank_loads(), vec![30, 7, 40]);
        assert_eq!(plan.instances(0)[0].quota, 0);
        assert_eq!(plan.instances(0)[1].rank, 2);
        assert_eq!(plan.instances(0)[1].quota, 40);
        assert_eq!(plan.instances(4)[1].rank, 1);
        assert_eq!(plan.replicas(), 2);
    }

    #[test]
    fn replicas_move_again_and_go_home() {
        // One slot per rank. Expert 0 leaves rank 0; its replica may later move or return.
        let layout = Layout::contiguous(2, 2, 1).unwrap();
        let load = LoadMatrix::from_rows(&[[10, 0], [0, 3]]).unwrap();
        let plan = GreedyMove.plan(&layout, &load).unwrap();
        plan.validate(&layout, &load, 0).unwrap();
        // Moving 10 onto rank 1 (3) gives 13 > 10: no move.
        assert_eq!(plan.replicas(), 0);

        let mut state = MoveState::new(&layout, &[10, 3]);
        state.relocate(0, 0, 1);
        assert_eq!(state.free_slots, vec![1, 0]);
        state.relocate(0, 1, 0);
        assert_eq!(state.free_slots, vec![1, 1]);
        assert_eq!(state.rank_load, vec![10, 3]);
    }

    #[test]
    fn never_worse_than_no_balancing_and_deterministic() {
        let mut rng = Lcg(3);
        let mut improved = 0;
        for _ in 0..400 {
            let ranks = 1 + rng.below(9) as usize;
            let experts = rng.below(24) as usize;
            let slots = (rng.below(4) as usize).min(experts.max(1));
            let layout = Layout::contiguous(ranks, experts, slots).unwrap();
            let hot = rng.below(experts as u64 + 1) as usize;
            let counts = (0..ranks * experts)
                .map(|i| match rng.below(5) {
                    0 => 0,
                    _ if i % experts == hot => 50 + rng.below(200),
                    _ => rng.below(30),
                })
                .collect();
            let load = LoadMatrix::from_flat(ranks, experts, counts).unwrap();
            let plan = GreedyMove.plan(&layout, &load).unwrap();
            plan.validate(&layout, &load, 0).unwrap();
            assert_eq!(plan, GreedyMove.plan(&layout, &load).unwrap());
            let before = busiest(&main_rank_loads(&layout, &load.expert_totals()));
            let after = busiest(&plan.rank_loads());
            assert!(after <= before);
            improved += usize::from(after < before);
            for e in 0..experts {
                let positive = plan.instances(e).iter().filter(|i| i.quota > 0).count();
                assert!(positive <= 1, "expert {e} split across instances");
                for replica in &plan.instances(e)[1..] {
                    assert!(replica.quota > 0, "zero-quota replica of expert {e}");
                }
            }
        }
        assert!(improved > 100, "only {improved} plans improved");
    }

    #[test]
    fn degenerate_inputs_do_not_panic() {
        for (ranks, experts, slots) in [(1, 3, 2), (3, 0, 1), (4, 2, 0), (5, 7, 3), (2, 2, 2)] {
            let layout = Layout::contiguous(ranks, experts, slots).unwrap();
            for load in [
                LoadMatrix::zeros(ranks, experts),
                LoadMatrix::from_flat(ranks, experts, vec![7; ranks * experts]).unwrap(),
            ] {
                let plan = GreedyMove.plan(&layout, &load).unwrap();
                plan.validate(&layout, &load, 0).unwrap();
            }
        }
        let layout = Layout::contiguous(2, 2, 1).unwrap();
        assert!(GreedyMove.plan(&layout, &LoadMatrix::zeros(2, 3)).is_err());
    }
}
