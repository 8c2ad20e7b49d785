//! Replica distribution on plans from the real quota planner: every replica slot ends up equal to
//! its home expert byte for byte, concurrently and sequentially, and bad schedules are errors that
//! leave the buffers untouched; the schedule check the fabrics share gives every part of the ranks
//! the same verdict and places.

use rackfill_balancer::relay::{plan_transfers, RelayConfig, TransferSchedule};
use rackfill_balancer::{Algo, Layout, LoadMatrix, Plan, Settings};
use rackfill_kernels::{
    check_schedule, distribute_replicas, distribute_replicas_sequential, KernelError,
    ReplicationStats, SlotBuffers, TransferFault,
};

const RANKS: usize = 32;
const EXPERTS: usize = 64;
const SLOTS: usize = 2;
/// Deliberately not a multiple of any chunk size used below.
const EXPERT_BYTES: usize = 1531;
/// Slots are padded so that writes past an expert's end would show.
const SLOT_BYTES: usize = EXPERT_BYTES + 13;
const FILL: u8 = 0xAA;

mod common;

use common::Rng;

/// A skewed load (one very hot expert, one warm one) planned by the quota planner.
fn skewed_plan(seed: u64) -> Plan {
    let mut rng = Rng(seed);
    let hot = rng.below(EXPERTS as u64) as usize;
    let warm = (hot + 1 + rng.below(EXPERTS as u64 - 1) as usize) % EXPERTS;
    let mut load = LoadMatrix::zeros(RANKS, EXPERTS);
    for r in 0..RANKS {
        for e in 0..EXPERTS {
            *load.get_mut(r, e) = match e {
                e if e == hot => 2000 + rng.below(200),
                e if e == warm => 600 + rng.below(100),
                _ => rng.below(40),
            };
        }
    }
    let layout = Layout::contiguous(RANKS, EXPERTS, SLOTS).unwrap();
    let mut planner = Algo::Quota.build(&Settings::default());
    let plan = planner.plan(&layout, &load).unwrap();
    plan.validate(&layout, &load, planner.u_min()).unwrap();
    plan
}

/// Distinct bytes for every expert.
fn expert_weights(seed: u64) -> Vec<Vec<u8>> {
    let mut rng = Rng(seed ^ 0x5EED);
    (0..EXPERTS)
        .map(|_| (0..EXPERT_BYTES).map(|_| rng.next() as u8).collect())
        .collect()
}

/// Expert `e` as segments of varying shapes: [gate_up, down], an empty first segment, or three.
fn segments(weights: &[u8], e: u32) -> Vec<&[u8]> {
    match e % 3 {
        0 => vec![&weights[..1024], &weights[1024..]],
        1 => vec![&weights[..0], weights],
        _ => vec![&weights[..7], &weights[7..900], &weights[900..]],
    }
}

fn fresh_slots() -> Vec<Vec<u8>> {
    vec![vec![FILL; SLOTS * SLOT_BYTES + 7]; RANKS]
}

type Distribute = for<'w> fn(
    &Plan,
    &TransferSchedule,
    usize,
    &dyn Fn(u32) -> Vec<&'w [u8]>,
    &mut [&mut [u8]],
    usize,
) -> Result<ReplicationStats, KernelError>;

const BOTH: [(&str, Distribute); 2] = [
    ("concurrent", distribute_replicas),
    ("sequential", distribute_replicas_sequential),
];

/// Runs one distribution on fresh buffers.
fn run(
    distribute: Distribute,
    plan: &Plan,
    schedule: &TransferSchedule,
    weights: &[Vec<u8>],
    slot_bytes: usize,
) -> (Result<ReplicationStats, KernelError>, Vec<Vec<u8>>) {
    let mut bufs = fresh_slots();
    let mut views: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    let source = |e: u32| segments(&weights[e as usize], e);
    let result = distribute(
        plan,
        schedule,
        EXPERT_BYTES,
        &source,
        &mut views,
        slot_bytes,
    );
    (result, bufs)
}

/// Every replica slot holds its home expert exactly; every other byte is untouched.
fn assert_replicas_exact(plan: &Plan, weights: &[Vec<u8>], bufs: &[Vec<u8>]) {
    for (t, buf) in bufs.iter().enumerate() {
        for (s, slot) in plan.rank_slots(t).iter().enumerate() {
            let bytes = &buf[s * SLOT_BYTES..(s + 1) * SLOT_BYTES];
            let pad_from = match slot {
                Some(e) => {
                    assert!(
                        bytes[..EXPERT_BYTES] == weights[*e as usize][..],
                        "rank {t} slot {s} differs from expert {e}"
                    );
                    EXPERT_BYTES
                }
                None => 0,
            };
            assert!(
                bytes[pad_from..].iter().all(|&b| b == FILL),
                "rank {t} slot {s} padding"
            );
        }
        assert!(buf[SLOTS * SLOT_BYTES..].iter().all(|&b| b == FILL));
    }
}

fn assert_stats(stats: &ReplicationStats, schedule: &TransferSchedule) {
    assert_eq!(stats.sent_bytes, schedule.send_bytes);
    assert_eq!(stats.received_bytes, schedule.recv_bytes);
    assert_eq!(stats.transfers, schedule.transfers.len());
    let stage2 = schedule.transfers.iter().filter(|t| t.stage == 2).count();
    assert_eq!(stats.stage2_copies, stage2);
    assert_eq!(stats.stage1_copies, schedule.transfers.len() - stage2);
}

#[test]
fn every_replica_slot_equals_its_home_expert() {
    let configs = [(4, 64), (4, 100), (4, 0), (4, 4096), (0, 97), (1000, 128)];
    for seed in 0..3 {
        let plan = skewed_plan(seed);
        assert!(plan.max_fanout() > 8, "fan-out {}", plan.max_fanout());
        let weights = expert_weights(seed);
        for (threshold, chunk_bytes) in configs {
            let config = RelayConfig {
                threshold,
                chunk_bytes,
            };
            let schedule = plan_transfers(&plan, EXPERT_BYTES as u64, &config);
            if threshold == 4 {
                assert!(!schedule.trees.is_empty());
            }
            let (seq, seq_bufs) = run(BOTH[1].1, &plan, &schedule, &weights, SLOT_BYTES);
            let seq = seq.unwrap();
            assert_stats(&seq, &schedule);
            assert_replicas_exact(&plan, &weights, &seq_bufs);
            if threshold == 4 && chunk_bytes > 0 && (chunk_bytes as usize) < EXPERT_BYTES {
                assert!(seq.stage2_copies > 0 && seq.stage1_copies > 0);
            }
            // Repeat the concurrent run: races, if any, would not show every time.
            for _ in 0..4 {
                let (par, par_bufs) = run(BOTH[0].1, &plan, &schedule, &weights, SLOT_BYTES);
                assert_eq!(par.unwrap(), seq);
                assert!(par_bufs == seq_bufs, "concurrent and sequential differ");
            }
        }
    }
}

#[test]
fn empty_experts_and_plans_without_replicas_move_nothing() {
    let plan = skewed_plan(7);
    let schedule = plan_transfers(&plan, 0, &RelayConfig::default());
    for (name, distribute) in BOTH {
        let mut bufs = fresh_slots();
        let mut views: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
        let stats = distribute(&plan, &schedule, 0, &|_| Vec::new(), &mut views, 0).unwrap();
        assert_eq!(stats.transfers, 0, "{name}");
        assert!(bufs.iter().flatten().all(|&b| b == FILL), "{name}");
    }
    let layout = Layout::contiguous(RANKS, EXPERTS, SLOTS).unwrap();
    let bare = Plan::main_only(&layout, &[0; EXPERTS]);
    let schedule = plan_transfers(&bare, EXPERT_BYTES as u64, &RelayConfig::default());
    let weights = expert_weights(7);
    for (_, distribute) in BOTH {
        let (stats, bufs) = run(distribute, &bare, &schedule, &weights, SLOT_BYTES);
        assert_eq!(stats.unwrap().sent_bytes, vec![0; RANKS]);
        assert_replicas_exact(&bare, &weights, &bufs);
    }
}

/// A relay schedule with both stages and several chunks per expert.
fn relay_setup() -> (Plan, TransferSchedule, Vec<Vec<u8>>) {
    let plan = skewed_plan(11);
    let config = RelayConfig {
        threshold: 4,
        chunk_bytes: 256,
    };
    let schedule = plan_transfers(&plan, EXPERT_BYTES as u64, &config);
    assert!(schedule.transfers.iter().any(|t| t.stage == 2));
    (plan, schedule, expert_weights(11))
}

/// Both paths reject `schedule` with `check`, and neither touches a byte.
fn assert_rejected(
    plan: &Plan,
    schedule: &TransferSchedule,
    weights: &[Vec<u8>],
    check: impl Fn(&KernelError) -> bool,
) {
    for (name, distribute) in BOTH {
        let (result, bufs) = run(distribute, plan, schedule, weights, SLOT_BYTES);
        let err = result.expect_err(name);
        assert!(check(&err), "{name}: unexpected {err}");
        assert!(bufs.iter().flatten().all(|&b| b == FILL), "{name} wrote");
    }
}

fn fault_at(err: &KernelError, at: usize, want: fn(&TransferFault) -> bool) -> bool {
    matches!(err, KernelError::Transfer { index, fault } if *index == at && want(fault))
}

#[test]
fn out_of_range_transfers_are_rejected() {
    let (plan, schedule, weights) = relay_setup();
    let mut bad = schedule.clone();
    bad.transfers[3].offset = EXPERT_BYTES as u64 - 1;
    assert_rejected(&plan, &bad, &weights, |e| {
        fault_at(e, 3, |f| matches!(f, TransferFault::Range { .. }))
    });
    let mut bad = schedule.clone();
    bad.transfers[5].len = u64::MAX;
    assert_rejected(&plan, &bad, &weights, |e| {
        fault_at(e, 5, |f| matches!(f, TransferFault::Range { .. }))
    });
    let mut bad = schedule.clone();
    bad.transfers[2].dst = RANKS as u32;
    assert_rejected(&plan, &bad, &weights, |e| {
        fault_at(e, 2, |f| matches!(f, TransferFault::Rank { .. }))
    });
    let mut bad = schedule.clone();
    bad.transfers[0].expert = EXPERTS as u32;
    assert_rejected(&plan, &bad, &weights, |e| {
        fault_at(e, 0, |f| matches!(f, TransferFault::Expert { .. }))
    });
}

#[test]
fn destinations_without_a_slot_are_rejected() {
    let (plan, schedule, weights) = relay_setup();
    let mut bad = schedule.clone();
    // Transfer 0 is a stage-1 copy; the home rank never holds its own expert in a slot.
    assert_eq!(bad.transfers[0].stage, 1);
    bad.transfers[0].dst = bad.transfers[0].src;
    assert_rejected(&plan, &bad, &weights, |e| {
        fault_at(e, 0, |f| matches!(f, TransferFault::NoSlot { .. }))
    });
}

#[test]
fn stage_two_needs_an_earlier_delivery_and_the_right_flag() {
    let (plan, schedule, weights) = relay_setup();
    let first2 = schedule
        .transfers
        .iter()
        .position(|t| t.stage == 2)
        .unwrap();
    // Forwarding before the relay has the chunk.
    let mut bad = schedule.clone();
    let early = bad.transfers.remove(first2);
    bad.transfers.insert(0, early);
    assert_rejected(&plan, &bad, &weights, |e| {
        fault_at(e, 0, |f| matches!(f, TransferFault::NotRelayed { .. }))
    });
    // Not waiting on the relay's flag.
    let mut bad = schedule.clone();
    bad.transfers[first2].wait_for_chunk_on = None;
    assert_rejected(&plan, &bad, &weights, |e| {
        fault_at(e, first2, |f| matches!(f, TransferFault::Wait { .. }))
    });
    // Stage 1 that claims to wait.
    let mut bad = schedule.clone();
    bad.transfers[0].wait_for_chunk_on = Some(bad.transfers[0].src);
    assert_rejected(&plan, &bad, &weights, |e| {
        fault_at(e, 0, |f| matches!(f, TransferFault::Wait { .. }))
    });
    // Stage 1 from a rank that is not the home.
    let mut bad = schedule.clone();
    bad.transfers[1].src = (bad.transfers[1].src + 1) % RANKS as u32;
    assert_rejected(&plan, &bad, &weights, |e| {
        fault_at(e, 1, |f| matches!(f, TransferFault::NotFromHome { .. }))
    });
    let mut bad = schedule.clone();
    bad.transfers[1].stage = 3;
    assert_rejected(&plan, &bad, &weights, |e| {
        fault_at(e, 1, |f| matches!(f, TransferFault::Stage { stage: 3 }))
    });
}

#[test]
fn duplicate_overlapping_and_missing_copies_are_rejected() {
    let (plan, schedule, weights) = relay_setup();
    let n = schedule.transfers.len();
    let mut bad = schedule.clone();
    bad.transfers.push(schedule.transfers[0]);
    assert_rejected(&plan, &bad, &weights, |e| {
        fault_at(e, n, |f| matches!(f, TransferFault::Duplicate { .. }))
    });
    // Same bytes under another chunk id: the destination would be written twice.
    let mut bad = schedule.clone();
    let mut again = schedule.transfers[0];
    again.chunk += 1000;
    bad.transfers.push(again);
    assert_rejected(&plan, &bad, &weights, |e| {
        fault_at(e, n, |f| matches!(f, TransferFault::Overlap { .. }))
    });
    // A replica that would be left incomplete.
    let mut bad = schedule.clone();
    let last = bad.transfers.pop().unwrap();
    assert_rejected(&plan, &bad, &weights, |e| {
        matches!(e, KernelError::IncompleteReplica { rank, expert, .. }
            if *rank == last.dst as usize && *expert == last.expert)
    });
}

#[test]
fn bad_buffers_and_sources_are_rejected() {
    let (plan, schedule, weights) = relay_setup();
    for (name, distribute) in BOTH {
        let (result, _) = run(distribute, &plan, &schedule, &weights, EXPERT_BYTES - 1);
        assert!(
            matches!(result, Err(KernelError::SlotTooSmall { .. })),
            "{name}"
        );
        // Slots so wide that the last one runs past the buffer.
        let (result, _) = run(distribute, &plan, &schedule, &weights, SLOT_BYTES + 8);
        assert!(
            matches!(result, Err(KernelError::SlotBufferTooShort { rank: 0, .. })),
            "{name}"
        );
        let mut bufs = fresh_slots();
        let mut views: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
        let short = |e: u32| vec![&weights[e as usize][1..]];
        let result = distribute(
            &plan,
            &schedule,
            EXPERT_BYTES,
            &short,
            &mut views,
            SLOT_BYTES,
        );
        assert!(
            matches!(result, Err(KernelError::SourceSize { len, .. }) if len == EXPERT_BYTES - 1),
            "{name}"
        );
        let source = |e: u32| segments(&weights[e as usize], e);
        let result = distribute(
            &plan,
            &schedule,
            EXPERT_BYTES,
            &source,
            &mut views[1..],
            SLOT_BYTES,
        );
        assert!(
            matches!(result, Err(KernelError::RankCount { got, ranks: RANKS }) if got == RANKS - 1),
            "{name}"
        );
        assert!(bufs.iter().flatten().all(|&b| b == FILL), "{name} wrote");
    }
}

/// The schedule check the engine's fabrics run on a part of the ranks: the same places as over
/// every rank, only the held ranks' slot buffers measured, the same verdict on a bad schedule.
#[test]
fn a_part_of_the_ranks_is_checked_by_the_same_rules() {
    let (plan, schedule, _) = relay_setup();
    let needed = plan.slots_per_rank() * SLOT_BYTES;
    let check = |schedule: &TransferSchedule, first_rank: usize, lens: &[usize]| {
        let buffers = SlotBuffers {
            expert_bytes: EXPERT_BYTES,
            slot_bytes: SLOT_BYTES,
            first_rank,
            lens,
        };
        check_schedule(&plan, schedule, buffers)
    };
    let all = check(&schedule, 0, &[needed; RANKS]).unwrap();
    assert_eq!(all.len(), schedule.transfers.len());
    for (index, (t, place)) in schedule.transfers.iter().zip(&all).enumerate() {
        if t.stage == 1 {
            assert_eq!((place.from_slot, place.forwards), (None, None));
            continue;
        }
        // A relay forwards what an earlier transfer landed in its slot, from where it landed.
        let producer = place.forwards.unwrap();
        let delivered = &schedule.transfers[producer];
        assert!(producer < index);
        assert_eq!(delivered.dst, t.src);
        assert_eq!(
            (delivered.offset, delivered.len, delivered.chunk),
            (t.offset, t.len, t.chunk)
        );
        assert_eq!(place.from_slot, Some(all[producer].to_slot));
    }
    let mut bad = schedule.clone();
    bad.transfers[3].offset = EXPERT_BYTES as u64 - 1;
    for rank in [0, RANKS / 2, RANKS - 1] {
        assert_eq!(check(&schedule, rank, &[needed]).unwrap(), all);
        let err = check(&schedule, rank, &[needed - 1]).unwrap_err();
        assert!(
            matches!(err, KernelError::SlotBufferTooShort { rank: r, .. } if r == rank),
            "{err}"
        );
        let err = check(&bad, rank, &[needed]).unwrap_err();
        assert!(
            fault_at(&err, 3, |f| matches!(f, TransferFault::Range { .. })),
            "{err}"
        );
    }
    // Every held rank's buffer is measured, named by its rank in the plan.
    let err = check(&schedule, 0, &[needed, needed - 1]).unwrap_err();
    assert!(matches!(
        err,
        KernelError::SlotBufferTooShort { rank: 1, .. }
    ));
    assert!(check(&schedule, 0, &[needed]).is_ok());
    assert!(matches!(
        check(&schedule, RANKS - 1, &[needed, needed]),
        Err(KernelError::RankRange { .. })
    ));
}
