//! Replica weight distribution with two-stage relay trees (UltraEP §6.2).
//!
//! After planning, every main expert's home rank must send its weights to each replica. Receivers
//! are bounded (a rank has at most `n_slot` inbound replicas) but senders are not: a hot expert with
//! fan-out 32 makes its home push 32 copies while its neighbours idle. For experts whose fan-out
//! exceeds a threshold the home instead seeds `k ~ sqrt(fan-out)` relays, and each relay forwards to
//! its share of the leaves. Relays and leaf attachment are chosen load-aware, against the send
//! volume every rank already carries, so the fan-out spreads onto ranks with spare send capacity.
//!
//! Transfers are cut into chunks so that a relay forwards chunk `c` as soon as it lands (waiting on
//! a per-chunk ready flag) instead of waiting for the whole expert: the two stages pipeline with no
//! global barrier.

use crate::Plan;
use serde::Serialize;

/// Fan-out above which a relay tree is built, by default.
pub const DEFAULT_RELAY_THRESHOLD: usize = 4;
/// Chunk size by default: large enough to keep per-chunk flag overhead small, small enough that a
/// multi-megabyte expert streams through a relay in many pipelined pieces.
pub const DEFAULT_CHUNK_BYTES: u64 = 1 << 20;

/// Relay planner settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RelayConfig {
    /// Experts with more replicas than this get a relay tree; the rest are sent directly (a tree
    /// adds a hop of latency that only pays off once the source's fan-out dominates).
    pub threshold: usize,
    /// Bytes per streamed chunk (0 sends each expert as one chunk). The last chunk of an expert is
    /// short when the expert size is not a multiple.
    pub chunk_bytes: u64,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            threshold: DEFAULT_RELAY_THRESHOLD,
            chunk_bytes: DEFAULT_CHUNK_BYTES,
        }
    }
}

/// The two-stage tree of one hot expert: `source` (its home) sends to every relay, each relay
/// forwards to its leaves. Relays are replicas themselves, so they keep what they receive.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RelayTree {
    pub expert: u32,
    pub source: u32,
    /// `(relay rank, leaf ranks)`, relays in ascending rank, leaves in ascending rank.
    pub relays: Vec<(u32, Vec<u32>)>,
}

/// One chunk copy from `src` to `dst`: bytes `offset..offset + len` of `expert`'s weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Transfer {
    pub expert: u32,
    pub chunk: u32,
    pub offset: u64,
    pub len: u64,
    pub src: u32,
    pub dst: u32,
    /// 1: from the home rank (direct sends and relay seeding); 2: relay to leaf.
    pub stage: u8,
    /// Stage 2 only: the rank whose per-chunk ready flag for (`expert`, `chunk`) must be set before
    /// this copy may start (the relay, which is `src`).
    pub wait_for_chunk_on: Option<u32>,
}

/// Everything the weight-distribution kernel needs for one plan.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct TransferSchedule {
    /// Relay trees, in the order they were planned (descending fan-out, ties lower expert id).
    pub trees: Vec<RelayTree>,
    /// Chunk-major, then stage, expert, source, destination: stage-2 copies of chunk `c` follow the
    /// stage-1 copies of chunk `c`, so a task stream consumed in order never waits on a flag whose
    /// producer has not been issued, and relays forward `c` while `c + 1` is still arriving.
    pub transfers: Vec<Transfer>,
    /// Bytes each rank sends (sum of its transfers' `len`).
    pub send_bytes: Vec<u64>,
    /// Bytes each rank receives.
    pub recv_bytes: Vec<u64>,
}

/// Per-rank send bytes with plain fan-out (every home sends its expert to each replica): the
/// baseline relay trees are measured against.
pub fn direct_send_bytes(plan: &Plan, expert_bytes: u64) -> Vec<u64> {
    let mut send = vec![0u64; plan.ranks()];
    for e in 0..plan.experts() {
        let inst = plan.instances(e);
        let src = inst[0].rank as usize;
        send[src] = send[src].saturating_add(copies(inst.len() - 1, expert_bytes));
    }
    send
}

/// Builds the relay trees and the chunked transfer list for a plan's replicas.
pub fn plan_transfers(plan: &Plan, expert_bytes: u64, config: &RelayConfig) -> TransferSchedule {
    let trees = build_relay_trees(plan, expert_bytes, config.threshold);
    let transfers = chunk_transfers(plan, &trees, expert_bytes, config.chunk_bytes);
    let (send_bytes, recv_bytes) = tally_bytes(plan.ranks(), &transfers);
    TransferSchedule {
        trees,
        transfers,
        send_bytes,
        recv_bytes,
    }
}

/// `n * bytes`, saturating (byte counters are estimates for scheduling, never indices).
fn copies(n: usize, bytes: u64) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX).saturating_mul(bytes)
}

/// Relay frontier size `k = round(sqrt(fan-out))` (at least 1): it balances the source's `k`
/// sends against each relay's `fan-out / k - 1` forwards.
fn relay_count(fanout: usize) -> usize {
    let k = fanout.isqrt();
    // round(sqrt(n)) = k + 1 exactly when n >= (k + 1/2)^2, i.e. n > k^2 + k.
    (if fanout - k * k > k { k + 1 } else { k }).max(1)
}

/// Load-aware relay scheduling. Send volumes start from what the plan fixes before any tree is
/// chosen: direct fan-out of the experts under the threshold, and the `k` seeding sends of every
/// hot expert's source. Hot experts are then processed by descending fan-out (ties expert id):
/// relays are the `k` replica ranks with the smallest volume (ties lower rank), and each remaining
/// leaf (ascending rank) joins the relay whose volume after taking it is smallest (ties lower rank).
fn build_relay_trees(plan: &Plan, expert_bytes: u64, threshold: usize) -> Vec<RelayTree> {
    let mut volume = vec![0u64; plan.ranks()];
    let mut hot = Vec::new();
    for e in 0..plan.experts() {
        let inst = plan.instances(e);
        let fanout = inst.len() - 1;
        let sends = if fanout > threshold {
            hot.push(e);
            relay_count(fanout)
        } else {
            fanout
        };
        let src = inst[0].rank as usize;
        volume[src] = volume[src].saturating_add(copies(sends, expert_bytes));
    }
    hot.sort_by_key(|&e| (std::cmp::Reverse(plan.instances(e).len()), e));
    hot.into_iter()
        .map(|e| relay_tree(plan, e, expert_bytes, &mut volume))
        .collect()
}

/// The tree of one hot expert; charges each leaf's forward to its relay's volume.
fn relay_tree(plan: &Plan, expert: usize, expert_bytes: u64, volume: &mut [u64]) -> RelayTree {
    let inst = plan.instances(expert);
    let replicas: Vec<u32> = inst[1..].iter().map(|i| i.rank).collect();
    let k = relay_count(replicas.len());
    let mut by_volume = replicas.clone();
    by_volume.sort_by_key(|&r| (volume[r as usize], r));
    let mut relay_ranks = by_volume[..k].to_vec();
    relay_ranks.sort_unstable();
    let mut relays: Vec<(u32, Vec<u32>)> = relay_ranks.iter().map(|&r| (r, Vec::new())).collect();
    for leaf in replicas.into_iter().filter(|r| !relay_ranks.contains(r)) {
        let (relay, leaves) = relays
            .iter_mut()
            .min_by_key(|(r, _)| (volume[*r as usize], *r))
            .expect("k >= 1 relays");
        leaves.push(leaf);
        volume[*relay as usize] = volume[*relay as usize].saturating_add(expert_bytes);
    }
    RelayTree {
        expert: expert as u32,
        source: inst[0].rank,
        relays,
    }
}

/// One copy edge of the transfer graph, before chunking.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Edge {
    stage: u8,
    expert: u32,
    src: u32,
    dst: u32,
}

/// Every (source, destination) edge: stage 1 for direct replicas and relay seeding, stage 2 for
/// relay-to-leaf forwards; sorted so chunk expansion yields the documented order.
fn transfer_edges(plan: &Plan, trees: &[RelayTree]) -> Vec<Edge> {
    let mut relayed = vec![false; plan.experts()];
    let mut edges = Vec::new();
    for tree in trees {
        relayed[tree.expert as usize] = true;
        for (relay, leaves) in &tree.relays {
            let seed = (1, tree.expert, tree.source, *relay);
            edges.push(seed);
            edges.extend(leaves.iter().map(|&leaf| (2, tree.expert, *relay, leaf)));
        }
    }
    for (e, _) in relayed.iter().enumerate().filter(|(_, &r)| !r) {
        let inst = plan.instances(e);
        edges.extend(
            inst[1..]
                .iter()
                .map(|i| (1, e as u32, inst[0].rank, i.rank)),
        );
    }
    let mut edges: Vec<Edge> = edges
        .into_iter()
        .map(|(stage, expert, src, dst)| Edge {
            stage,
            expert,
            src,
            dst,
        })
        .collect();
    edges.sort_unstable();
    edges
}

/// The chunk size in effect and the chunk count of one expert of `expert_bytes` (> 0): `chunk_bytes`
/// (0: the whole expert), raised if needed so that chunk indices fit in `u32`. The GPU's own relay
/// planner uses the same geometry.
pub fn chunk_geometry(expert_bytes: u64, chunk_bytes: u64) -> (u64, u64) {
    let min_chunk = expert_bytes.div_ceil(u64::from(u32::MAX));
    let chunk = if chunk_bytes == 0 {
        expert_bytes
    } else {
        chunk_bytes.max(min_chunk)
    }
    .max(1);
    (chunk, expert_bytes.div_ceil(chunk))
}

/// Expands every edge into per-chunk transfers, chunk-major.
fn chunk_transfers(
    plan: &Plan,
    trees: &[RelayTree],
    expert_bytes: u64,
    chunk_bytes: u64,
) -> Vec<Transfer> {
    if expert_bytes == 0 {
        return Vec::new();
    }
    let (chunk, n_chunks) = chunk_geometry(expert_bytes, chunk_bytes);
    let edges = transfer_edges(plan, trees);
    let mut transfers = Vec::with_capacity(edges.len().saturating_mul(n_chunks as usize));
    for c in 0..n_chunks {
        let offset = c * chunk;
        let len = chunk.min(expert_bytes - offset);
        transfers.extend(edges.iter().map(|edge| Transfer {
            expert: edge.expert,
            chunk: c as u32,
            offset,
            len,
            src: edge.src,
            dst: edge.dst,
            stage: edge.stage,
            wait_for_chunk_on: (edge.stage == 2).then_some(edge.src),
        }));
    }
    transfers
}

/// Per-rank send and receive bytes, summed from the transfers themselves.
pub(crate) fn tally_bytes(ranks: usize, transfers: &[Transfer]) -> (Vec<u64>, Vec<u64>) {
    let mut send = vec![0u64; ranks];
    let mut recv = vec![0u64; ranks];
    for t in transfers {
        send[t.src as usize] = send[t.src as usize].saturating_add(t.len);
        recv[t.dst as usize] = recv[t.dst as usize].saturating_add(t.len);
    }
    (send, recv)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Replica, SplitPolicy};
    use crate::{Layout, LoadMatrix};
    use std::collections::BTreeMap;

    /// A plan with the given replica sets (expert -> replica ranks) on a contiguous layout.
    fn plan_with(ranks: usize, slots: usize, sets: &[(u32, Vec<u32>)]) -> Plan {
        let layout = Layout::contiguous(ranks, ranks, slots).unwrap();
        let load = LoadMatrix::zeros(ranks, ranks);
        let mut replicas: Vec<Replica> = sets
            .iter()
            .flat_map(|(e, rs)| {
                rs.iter().map(|&rank| Replica {
                    expert: *e,
                    rank,
                    quota: 0,
                })
            })
            .collect();
        let plan = Plan::assemble(
            &layout,
            Some(&load),
            &vec![0; ranks],
            &mut replicas,
            SplitPolicy::Even,
        );
        plan.validate(&layout, &load, 0).unwrap();
        plan
    }

    /// Two hot experts (fan-out 32 from rank 0, 16 from rank 1) and a small one (fan-out 2).
    fn hot_plan() -> Plan {
        plan_with(
            40,
            2,
            &[
                (0, (1..=32).collect()),
                (1, (2..=17).collect()),
                (2, vec![33, 34]),
            ],
        )
    }

    /// Every replica rank receives every byte of its expert exactly once, and nobody else
    /// receives anything.
    fn assert_exactly_once(plan: &Plan, schedule: &TransferSchedule, bytes: u64) {
        let mut got: BTreeMap<(u32, u32), Vec<(u64, u64)>> = BTreeMap::new();
        for t in &schedule.transfers {
            got.entry((t.expert, t.dst))
                .or_default()
                .push((t.offset, t.len));
        }
        let mut expected = 0;
        for e in 0..plan.experts() {
            for replica in &plan.instances(e)[1..] {
                expected += 1;
                let mut pieces = got.remove(&(e as u32, replica.rank)).unwrap_or_default();
                pieces.sort_unstable();
                let mut end = 0;
                for (offset, len) in pieces {
                    assert_eq!(
                        offset, end,
                        "expert {e} on rank {} has a gap/overlap",
                        replica.rank
                    );
                    end += len;
                }
                assert_eq!(end, bytes);
            }
        }
        assert!(got.is_empty(), "transfers to non-replicas: {got:?}");
        assert!(expected > 0);
    }

    /// Stage-2 copies wait on their relay, which received the same chunk earlier in stage 1.
    fn assert_stage_two_follows_stage_one(schedule: &TransferSchedule) {
        for (i, t) in schedule.transfers.iter().enumerate() {
            match t.stage {
                1 => assert_eq!(t.wait_for_chunk_on, None),
                2 => {
                    assert_eq!(t.wait_for_chunk_on, Some(t.src));
                    let seeded = schedule.transfers[..i].iter().any(|s| {
                        s.stage == 1 && s.expert == t.expert && s.chunk == t.chunk && s.dst == t.src
                    });
                    assert!(seeded, "stage-2 transfer {t:?} has no earlier stage-1 seed");
                }
                s => panic!("bad stage {s}"),
            }
        }
    }

    #[test]
    fn relay_count_rounds_the_square_root() {
        let ks: Vec<usize> = [1, 2, 3, 5, 6, 7, 12, 13, 16, 32].map(relay_count).to_vec();
        assert_eq!(ks, vec![1, 1, 2, 2, 2, 3, 3, 4, 4, 6]);
    }

    #[test]
    fn relays_cut_the_peak_send_volume_of_hot_experts() {
        let plan = hot_plan();
        let bytes = 10 * 4096 + 123;
        let config = RelayConfig {
            threshold: 4,
            chunk_bytes: 4096,
        };
        let schedule = plan_transfers(&plan, bytes, &config);
        let direct = direct_send_bytes(&plan, bytes);
        let peak_direct = *direct.iter().max().unwrap();
        let peak_relay = *schedule.send_bytes.iter().max().unwrap();
        assert_eq!(peak_direct, 32 * bytes);
        assert!(
            2 * peak_direct >= 3 * peak_relay,
            "{peak_relay} vs {peak_direct}"
        );
        // Relays of expert 0 avoid rank 1, which seeds expert 1's tree.
        assert_eq!(schedule.trees.len(), 2);
        assert_eq!(schedule.trees[0].expert, 0);
        assert_eq!(schedule.trees[0].relays.len(), 6);
        assert_eq!(schedule.trees[1].relays.len(), 4);
        assert!(schedule.trees[0].relays.iter().all(|(r, _)| *r != 1));
        assert_exactly_once(&plan, &schedule, bytes);
        assert_stage_two_follows_stage_one(&schedule);
        // 11 chunks, the last one short.
        let last = schedule.transfers.last().unwrap();
        assert_eq!((last.chunk, last.len), (10, 123));
        assert_eq!(plan_transfers(&plan, bytes, &config), schedule);
    }

    #[test]
    fn single_hot_experts_of_fan_out_16_and_32() {
        for fanout in [16u32, 32] {
            let plan = plan_with(33, 1, &[(7, (8..8 + fanout).map(|r| r % 33).collect())]);
            let schedule = plan_transfers(&plan, 3 << 20, &RelayConfig::default());
            let direct = direct_send_bytes(&plan, 3 << 20);
            let peak_relay = *schedule.send_bytes.iter().max().unwrap();
            assert_eq!(*direct.iter().max().unwrap(), u64::from(fanout) * (3 << 20));
            assert!(2 * u64::from(fanout) * (3 << 20) >= 3 * peak_relay);
            assert_exactly_once(&plan, &schedule, 3 << 20);
            assert_stage_two_follows_stage_one(&schedule);
        }
    }

    #[test]
    fn send_and_receive_bytes_match_the_plan() {
        let plan = hot_plan();
        let bytes = 1000;
        let schedule = plan_transfers(&plan, bytes, &RelayConfig::default());
        for t in 0..plan.ranks() {
            let hosted = plan.rank_slots(t).iter().filter(|s| s.is_some()).count() as u64;
            assert_eq!(schedule.recv_bytes[t], hosted * bytes);
        }
        let total: u64 = schedule.send_bytes.iter().sum();
        assert_eq!(total, plan.replicas() as u64 * bytes);
        assert_eq!(total, schedule.recv_bytes.iter().sum::<u64>());
        // Sources send k seeds; relays forward to their leaves.
        for tree in &schedule.trees {
            let leaves: usize = tree.relays.iter().map(|(_, l)| l.len()).sum();
            assert_eq!(
                leaves + tree.relays.len(),
                plan.instances(tree.expert as usize).len() - 1
            );
        }
    }

    #[test]
    fn fan_out_at_or_below_the_threshold_is_sent_directly() {
        let plan = plan_with(8, 1, &[(0, vec![1, 2, 3, 4]), (5, vec![0, 6])]);
        let bytes = 5000;
        let schedule = plan_transfers(&plan, bytes, &RelayConfig::default());
        assert!(schedule.trees.is_empty());
        assert!(schedule.transfers.iter().all(|t| t.stage == 1));
        assert_eq!(schedule.send_bytes, direct_send_bytes(&plan, bytes));
        assert_exactly_once(&plan, &schedule, bytes);
    }

    #[test]
    fn degenerate_sizes() {
        let plan = hot_plan();
        let empty = plan_transfers(&plan, 0, &RelayConfig::default());
        assert!(empty.transfers.is_empty());
        assert_eq!(empty.send_bytes, vec![0; 40]);
        // chunk_bytes 0: one chunk per expert.
        let whole = RelayConfig {
            threshold: 0,
            chunk_bytes: 0,
        };
        let schedule = plan_transfers(&plan, 777, &whole);
        assert!(schedule
            .transfers
            .iter()
            .all(|t| t.chunk == 0 && t.len == 777));
        assert_exactly_once(&plan, &schedule, 777);
        assert_stage_two_follows_stage_one(&schedule);
        // No replicas at all.
        let bare = plan_with(1, 0, &[]);
        let schedule = plan_transfers(&bare, 4096, &RelayConfig::default());
        assert!(schedule.transfers.is_empty() && schedule.trees.is_empty());
        assert_eq!(direct_send_bytes(&bare, u64::MAX), vec![0]);
    }
}
