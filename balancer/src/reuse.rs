//! Replica reuse across steps: with slots kept per layer (`--slot-memory per-layer`), a replica
//! already resident from the layer's last plan costs no bytes to "stream". [`prefer_resident`]
//! moves a quota plan's replicas onto ranks that already hold the same expert, keeping every
//! quota, as long as the busiest rank's load stays within a stated tolerance of the
//! unconstrained plan's.
//!
//! Steps, in order, all deterministic (fixed iteration order, integer loads):
//! 1. `unplaced_replicas`: the plan's replicas whose `(rank, expert)` is not resident;
//! 2. `move_to_free_slot`: each such replica goes to a rank where its expert is resident and a slot
//!    is free, if the bound holds there;
//! 3. `swap_with_unreused`: else it trades ranks with a replica on that rank which is not reused
//!    itself, if the bound holds on both ranks;
//! 4. the plan is assembled again from the main quotas and the moved replicas (the split `Q`
//!    recomputed locality-first for the new ranks).
//!
//! [`replica_stream`] then says what must still move: the replicas not resident, directly from
//! their homes, or the whole plan over its relay trees, whichever loads the busiest rank less.

use crate::plan::{Replica, SplitPolicy};
use crate::relay::{plan_transfers, tally_bytes, RelayConfig, TransferSchedule};
use crate::{Algo, Layout, LoadMatrix, Plan};

/// Whether [`prefer_resident`] may move `algo`'s plans: the quota planners', whose reroute split
/// is locality-first (the split it recomputes); others keep their plans.
pub fn moves_replicas_of(algo: Algo) -> bool {
    matches!(algo, Algo::Quota | Algo::QuotaPaper)
}

/// Moves `plan`'s replicas onto ranks whose slots already hold the same expert (`resident`: the
/// layer's last plan's slots, `R x n_slot` row-major as [`Plan::slots`]) when the busiest rank's
/// load stays at most `(1 + tolerance)` times the plan's own. Quotas are kept, so the plan stays
/// valid for the same `u_min`; the reroute split is recomputed locality-first (quota planners'
/// policy), so pass only quota-driven plans. Returns the plan unchanged when nothing moves.
pub fn prefer_resident(
    layout: &Layout,
    load: &LoadMatrix,
    plan: &Plan,
    resident: &[Option<u32>],
    tolerance: f64,
) -> Plan {
    let n_slot = plan.slots_per_rank();
    if resident.len() != plan.ranks() * n_slot || plan.replicas() == 0 {
        return plan.clone();
    }
    let mut loads = plan.rank_loads();
    let peak = loads.iter().copied().max().unwrap_or(0);
    let bound = (peak as f64 * (1.0 + tolerance.max(0.0))).floor() as u64;
    let mut replicas = replicas_of(plan);
    let is_resident = |rank: usize, expert: u32| {
        resident[rank * n_slot..(rank + 1) * n_slot].contains(&Some(expert))
    };
    let mut moved = false;
    for i in unplaced_replicas(&replicas, is_resident) {
        let expert = replicas[i].expert;
        let targets: Vec<usize> = (0..plan.ranks())
            .filter(|&q| {
                is_resident(q, expert)
                    && q != layout.home(expert as usize)
                    && !replicas
                        .iter()
                        .any(|r| r.expert == expert && r.rank as usize == q)
            })
            .collect();
        for q in targets {
            if move_to_free_slot(&mut replicas, &mut loads, (i, q), n_slot, bound)
                || swap_with_unreused(
                    &mut replicas,
                    &mut loads,
                    (i, q),
                    layout,
                    bound,
                    is_resident,
                )
            {
                moved = true;
                break;
            }
        }
    }
    if !moved {
        return plan.clone();
    }
    let main_quota: Vec<u64> = (0..plan.experts())
        .map(|e| plan.instances(e)[0].quota)
        .collect();
    Plan::assemble(
        layout,
        Some(load),
        &main_quota,
        &mut replicas,
        SplitPolicy::LocalityFirst,
    )
}

/// What streams a plan's replicas into slots that may hold some already: the plan the stream
/// fills and its transfer schedule.
pub struct ReplicaStream {
    /// The plan itself, or with the slots of replicas already resident left empty (they are
    /// filled; a stream must not be asked to fill them). For the stream only: dispatch with the
    /// plan itself.
    pub plan: Plan,
    pub schedule: TransferSchedule,
}

/// The replica stream of `plan` into slots that hold `previous` (the layer's last plan's slots,
/// `R x n_slot`, all `None` before its first plan): the whole plan over its relay trees, or only
/// the replicas not resident on their rank, sent directly from their homes, whichever loads the
/// busiest rank (sending or receiving) less; ties go to the direct one. `None`: slots no one
/// tracks (shared by every layer), so the whole plan over its relay trees. Every rank computes
/// the same stream from the same plan.
pub fn replica_stream(
    plan: &Plan,
    previous: Option<&[Option<u32>]>,
    expert_bytes: u64,
    relay: &RelayConfig,
) -> ReplicaStream {
    let whole = || ReplicaStream {
        plan: plan.clone(),
        schedule: plan_transfers(plan, expert_bytes, relay),
    };
    let n_slot = plan.slots_per_rank();
    let Some(previous) = previous.filter(|p| p.len() == plan.ranks() * n_slot) else {
        return whole();
    };
    let resident = |rank: usize, expert: u32| {
        previous[rank * n_slot..(rank + 1) * n_slot].contains(&Some(expert))
    };
    let direct = RelayConfig {
        threshold: usize::MAX,
        ..*relay
    };
    let mut fresh = plan_transfers(plan, expert_bytes, &direct);
    fresh
        .transfers
        .retain(|t| !resident(t.dst as usize, t.expert));
    (fresh.send_bytes, fresh.recv_bytes) = tally_bytes(plan.ranks(), &fresh.transfers);
    let relayed = whole();
    let busiest = |s: &TransferSchedule| {
        s.send_bytes
            .iter()
            .chain(&s.recv_bytes)
            .copied()
            .max()
            .unwrap_or(0)
    };
    if busiest(&fresh) <= busiest(&relayed.schedule) {
        ReplicaStream {
            plan: plan.without_filled_slots(resident),
            schedule: fresh,
        }
    } else {
        relayed
    }
}

/// Every replica of `plan` (its instances past the main one), by expert then rank.
fn replicas_of(plan: &Plan) -> Vec<Replica> {
    (0..plan.experts())
        .flat_map(|e| {
            plan.instances(e)[1..].iter().map(move |inst| Replica {
                expert: e as u32,
                rank: inst.rank,
                quota: inst.quota,
            })
        })
        .collect()
}

/// Indices of the replicas whose expert is not resident on their rank.
fn unplaced_replicas(replicas: &[Replica], is_resident: impl Fn(usize, u32) -> bool) -> Vec<usize> {
    (0..replicas.len())
        .filter(|&i| !is_resident(replicas[i].rank as usize, replicas[i].expert))
        .collect()
}

/// Moves replica `i` to rank `q` if `q` has a free slot and its load stays within `bound`.
fn move_to_free_slot(
    replicas: &mut [Replica],
    loads: &mut [u64],
    (i, q): (usize, usize),
    n_slot: usize,
    bound: u64,
) -> bool {
    let used = replicas.iter().filter(|r| r.rank as usize == q).count();
    let quota = replicas[i].quota;
    if used >= n_slot || loads[q] + quota > bound {
        return false;
    }
    loads[replicas[i].rank as usize] -= quota;
    loads[q] += quota;
    replicas[i].rank = q as u32;
    true
}

/// Trades ranks between replica `i` and a replica on rank `q` that is not resident there itself
/// and whose expert may go to `i`'s rank (not its home, not already there), if both ranks' loads
/// stay within `bound`; the first such replica in order.
fn swap_with_unreused(
    replicas: &mut [Replica],
    loads: &mut [u64],
    (i, q): (usize, usize),
    layout: &Layout,
    bound: u64,
    is_resident: impl Fn(usize, u32) -> bool,
) -> bool {
    let p = replicas[i].rank as usize;
    let quota = replicas[i].quota;
    let partner = (0..replicas.len()).find(|&j| {
        let other = replicas[j];
        other.rank as usize == q
            && !is_resident(q, other.expert)
            && layout.home(other.expert as usize) != p
            && !replicas
                .iter()
                .any(|r| r.expert == other.expert && r.rank as usize == p)
            && loads[p] - quota + other.quota <= bound
            && loads[q] - other.quota + quota <= bound
    });
    let Some(j) = partner else { return false };
    let other_quota = replicas[j].quota;
    loads[p] = loads[p] - quota + other_quota;
    loads[q] = loads[q] - other_quota + quota;
    replicas[i].rank = q as u32;
    replicas[j].rank = p as u32;
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Settings;

    /// 4 ranks, 8 experts (2 per rank), 1 slot: expert 0 hot.
    fn setup() -> (Layout, LoadMatrix) {
        let layout = Layout::contiguous(4, 8, 1).unwrap();
        let rows = [
            [400u64, 10, 10, 10, 10, 10, 10, 10],
            [400, 10, 10, 10, 10, 10, 10, 10],
            [400, 10, 10, 10, 10, 10, 10, 10],
            [400, 10, 10, 10, 10, 10, 10, 10],
        ];
        (layout, LoadMatrix::from_rows(&rows).unwrap())
    }

    fn quota_plan(layout: &Layout, load: &LoadMatrix) -> Plan {
        Algo::Quota
            .build(&Settings::default())
            .plan(layout, load)
            .unwrap()
    }

    #[test]
    fn a_plan_that_already_reuses_every_replica_is_unchanged() {
        let (layout, load) = setup();
        let plan = quota_plan(&layout, &load);
        assert!(plan.replicas() > 0, "expert 0 is replicated");
        let resident: Vec<Option<u32>> = plan.slots().to_vec();
        assert_eq!(prefer_resident(&layout, &load, &plan, &resident, 0.5), plan);
    }

    #[test]
    fn replicas_follow_the_resident_set_within_the_tolerance_only() {
        let layout = Layout::contiguous(4, 8, 1).unwrap();
        // Expert 0 (home rank 0) hot from rank 0 only; quota puts one replica somewhere.
        let rows = [
            [300u64, 10, 10, 10, 10, 10, 10, 10],
            [0, 10, 10, 10, 10, 10, 10, 10],
            [0, 10, 10, 10, 10, 10, 10, 10],
            [0, 10, 10, 10, 10, 10, 10, 10],
        ];
        let load = LoadMatrix::from_rows(&rows).unwrap();
        let plan = quota_plan(&layout, &load);
        let placed: Vec<usize> = (0..4)
            .filter(|&r| plan.rank_slots(r).contains(&Some(0)))
            .collect();
        assert!(!placed.is_empty(), "expert 0 replicated: {plan:?}");
        // Resident: expert 0 on a rank the plan did not pick (rank 3 unless picked, else 1).
        let target = if placed.contains(&3) { 1 } else { 3 };
        let mut resident = vec![None; 4];
        resident[target] = Some(0);
        let peak = *plan.rank_loads().iter().max().unwrap();
        let moved = prefer_resident(&layout, &load, &plan, &resident, 0.5);
        moved
            .validate(&layout, &load, Settings::default().u_min)
            .unwrap();
        assert!(moved.rank_slots(target).contains(&Some(0)), "{moved:?}");
        assert!(*moved.rank_loads().iter().max().unwrap() as f64 <= peak as f64 * 1.5);
        // Same quotas, so the same number of replicas and the same total load.
        assert_eq!(moved.replicas(), plan.replicas());
        // With no tolerance, a move that raises the peak is refused.
        let tight = prefer_resident(&layout, &load, &plan, &resident, 0.0);
        assert!(*tight.rank_loads().iter().max().unwrap() <= peak);
    }

    #[test]
    fn only_replicas_not_resident_are_streamed() {
        let (layout, load) = setup();
        let plan = quota_plan(&layout, &load);
        let relay = RelayConfig::default();
        let whole = replica_stream(&plan, None, 1000, &relay);
        assert_eq!(whole.plan, plan);
        assert_eq!(whole.schedule, plan_transfers(&plan, 1000, &relay));
        // Everything resident: nothing to stream, no slot left to fill.
        let all = replica_stream(&plan, Some(plan.slots()), 1000, &relay);
        assert!(all.schedule.transfers.is_empty());
        assert!(all.plan.slots().iter().all(Option::is_none));
        // One replica missing: only its bytes move, into its slot.
        let (missing, expert) = plan
            .slots()
            .iter()
            .enumerate()
            .find_map(|(i, s)| s.map(|e| (i, e)))
            .unwrap();
        let mut previous = plan.slots().to_vec();
        previous[missing] = None;
        let one = replica_stream(&plan, Some(&previous), 1000, &relay);
        let rank = missing / plan.slots_per_rank();
        assert!(one
            .schedule
            .transfers
            .iter()
            .all(|t| (t.dst as usize, t.expert) == (rank, expert)));
        assert_eq!(one.schedule.recv_bytes[rank], 1000);
        assert_eq!(one.plan.rank_slots(rank).iter().flatten().count(), 1);
    }

    #[test]
    fn a_resident_set_of_another_shape_changes_nothing() {
        let (layout, load) = setup();
        let plan = quota_plan(&layout, &load);
        assert_eq!(
            prefer_resident(&layout, &load, &plan, &[Some(0)], 1.0),
            plan
        );
    }
}
