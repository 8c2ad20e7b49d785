//! The cost of one MoE layer on a rack: the one model both the EP runtime's per-layer simulated
//! makespan ([`MoeCost::makespan`], reported as `LayerReport::simulated`) and `rackfill simulate`
//! (which adds attention, the dense FFN and the solve around it) cost with, on the same
//! [`Rack`], so their figures compare.
//!
//! On the host the engine runs on, all ranks share a few cores, so wall time cannot show what
//! balancing buys on a rack, where ranks run concurrently. Per MoE layer, in order, each phase
//! ends when its busiest rank finishes (every phase ends in an all-to-all or needs every rank's
//! result, so ranks re-synchronise between phases):
//!
//! | term        | cost on the busiest rank                                                      |
//! |-------------|-------------------------------------------------------------------------------|
//! | `replicate` | replica weights over the relay schedule: `max(send, recv)` bytes, one latency per stage, one chunk to fill a relay pipeline |
//! | `dispatch`  | token-expert pairs leaving their source rank, `H` BF16 values each               |
//! | `expert`    | every instance's `6 H I m` FLOPs at the GEMM efficiency of its `m` rows          |
//! | `combine`   | the same pairs back to their source rank                                         |
//!
//! Replica streaming is *not* overlapped with dispatch or expert compute: UltraEP's forward
//! pipeline (§4.2, Eq. 1) overlaps it only with the reroute and lets token dispatch wait for it,
//! so replication is on the critical path. Weights and tokens are BF16 on the rack, whatever
//! precision the host computes in.

use rackfill_balancer::relay::{plan_transfers, RelayConfig, TransferSchedule};
use rackfill_balancer::reuse::replica_stream;
use rackfill_balancer::{Layout, LoadMatrix, Plan};
use serde::Serialize;

use super::rack::Rack;

/// Bytes of one weight or activation value on the rack (BF16).
pub const BYTES_PER_ELEMENT: u64 = 2;

/// The dimensions of one MoE layer that its cost depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MoeDims {
    /// Hidden size `H`: one token's row.
    pub hidden: usize,
    /// Routed expert width `I`.
    pub intermediate: usize,
}

impl MoeDims {
    /// Bytes of one routed expert's weights (gate, up and down projections, BF16): what a replica
    /// transfer moves.
    pub fn expert_bytes(&self) -> u64 {
        3 * (self.hidden as u64) * (self.intermediate as u64) * BYTES_PER_ELEMENT
    }

    /// FLOPs of one token through one routed expert (three `H x I` products, two FLOPs each).
    pub fn flops_per_pair(&self) -> f64 {
        6.0 * self.hidden as f64 * self.intermediate as f64
    }

    /// Bytes of one token's hidden state on the wire (dispatch and combine are both BF16).
    pub fn token_bytes(&self) -> u64 {
        self.hidden as u64 * BYTES_PER_ELEMENT
    }
}

/// Time of each phase of one MoE layer on the rack, milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct MoeTerms {
    pub replicate: f64,
    pub dispatch: f64,
    pub expert: f64,
    pub combine: f64,
}

impl MoeTerms {
    /// The layer's time: the phases run one after another.
    pub fn total(&self) -> f64 {
        self.replicate + self.dispatch + self.expert + self.combine
    }
}

/// Simulated makespan of one MoE layer on a rack, with the plan and without balancing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct SimulatedMakespan {
    /// [`MoeTerms::total`] under the plan (replicas streamed, pairs rerouted), microseconds.
    pub balanced_us: f64,
    /// The same load on the main experts only (no replicas, nothing streamed), microseconds.
    pub unbalanced_us: f64,
    /// The terms behind `balanced_us`, milliseconds.
    pub balanced: MoeTerms,
}

/// The MoE-layer cost model over one rack and one layer shape.
#[derive(Debug, Clone, Copy)]
pub struct MoeCost<'a> {
    pub rack: &'a Rack,
    pub dims: MoeDims,
}

impl MoeCost<'_> {
    /// Expert compute of one layer on its busiest rank: every physical instance with `m > 0`
    /// rows costs `6 H I m` FLOPs at the GEMM efficiency of `m` rows (empty instances launch
    /// nothing and read no weights).
    pub fn expert_ms(&self, plan: &Plan) -> f64 {
        self.expert_split_ms(plan).1
    }

    /// Expert compute split for pipelined experts: the main instances' GEMMs on the rank where
    /// they take longest, and the whole layer's ([`Self::expert_ms`]); a replica's GEMMs follow
    /// its rank's main ones, so `total - main` is what waits for the replicas.
    pub fn expert_split_ms(&self, plan: &Plan) -> (f64, f64) {
        let mut main = vec![0.0f64; plan.ranks()];
        let mut all = vec![0.0f64; plan.ranks()];
        let flops = self.dims.flops_per_pair();
        for e in 0..plan.experts() {
            for (i, inst) in plan.instances(e).iter().enumerate() {
                let m = inst.quota as f64;
                let ms = self.rack.gemm_ms(flops * m, m);
                all[inst.rank as usize] += ms;
                if i == 0 {
                    main[inst.rank as usize] += ms;
                }
            }
        }
        let busiest = |v: Vec<f64>| v.into_iter().fold(0.0, f64::max);
        (busiest(main), busiest(all))
    }

    /// Dispatch (equal to combine, which moves the same pairs back): see [`token_traffic`].
    pub fn dispatch_ms(&self, load: &LoadMatrix, plan: &Plan) -> f64 {
        let (send, recv) = token_traffic(load, plan);
        let busiest = send.iter().chain(&recv).copied().max().unwrap_or(0);
        self.rack
            .comm_ms(busiest.saturating_mul(self.dims.token_bytes()))
    }

    /// Replica streaming of one layer: the busiest rank's larger direction over the achieved
    /// bandwidth, one latency per stage (two when any relay tree is used), plus one chunk's
    /// time for the relay pipeline to fill (a relay forwards chunk `c` once it has landed).
    pub fn replicate_ms(&self, traffic: &ReplicaTraffic, chunk_bytes: u64) -> f64 {
        let busiest = traffic
            .send
            .iter()
            .chain(&traffic.recv)
            .copied()
            .max()
            .unwrap_or(0);
        if busiest == 0 {
            return 0.0;
        }
        let mut ms = self.rack.comm_ms(busiest);
        if traffic.relayed {
            let fill = chunk_bytes.min(self.dims.expert_bytes());
            ms +=
                fill as f64 / self.rack.link_bytes_per_s() * 1e3 + self.rack.link_latency_us * 1e-3;
        }
        ms
    }

    /// Every phase of one layer under `plan`, whose replicas move as `replicas` says, streamed in
    /// chunks of `chunk_bytes`.
    pub fn layer(
        &self,
        load: &LoadMatrix,
        plan: &Plan,
        replicas: &ReplicaTraffic,
        chunk_bytes: u64,
    ) -> MoeTerms {
        let dispatch = self.dispatch_ms(load, plan);
        MoeTerms {
            replicate: self.replicate_ms(replicas, chunk_bytes),
            dispatch,
            expert: self.expert_ms(plan),
            combine: dispatch,
        }
    }

    /// The layer with `plan` (every replica streamed afresh over `relay`'s trees, as the EP
    /// runtime does) and without balancing (`plan`'s load on the main experts of `layout`).
    pub fn makespan(
        &self,
        layout: &Layout,
        load: &LoadMatrix,
        plan: &Plan,
        relay: &RelayConfig,
    ) -> SimulatedMakespan {
        let streamed = ReplicaTraffic::planned(plan, self.dims.expert_bytes(), relay);
        let balanced = self.layer(load, plan, &streamed, relay.chunk_bytes);
        let main_only = Plan::main_only(layout, &load.expert_totals());
        let unbalanced = self.layer(load, &main_only, &ReplicaTraffic::default(), 0);
        SimulatedMakespan {
            balanced_us: balanced.total() * 1e3,
            unbalanced_us: unbalanced.total() * 1e3,
            balanced,
        }
    }
}

/// Token-expert pairs each rank sends and receives in dispatch under `plan`'s reroute split.
///
/// A pair is sent once per (token, expert instance): tokens going to two experts on the same
/// rank are counted twice (DeepEP-style deduplication per destination rank would send them once;
/// with top-8 over 2-4 experts per rank that saves a few percent) and pairs whose instance lives
/// on the source rank never touch the fabric.
pub fn token_traffic(load: &LoadMatrix, plan: &Plan) -> (Vec<u64>, Vec<u64>) {
    let (ranks, experts) = (load.ranks(), plan.experts());
    let mut send = vec![0u64; ranks];
    let mut recv = vec![0u64; ranks];
    // Experts without a split (no replica: most of them) send every pair to their main
    // instance: each source sends its row over them (a masked sum, which vectorises) less what
    // sits on its own rank, and each main receives its column less its own rank's.
    let home: Vec<Option<usize>> = (0..experts)
        .map(|e| {
            plan.split(0, e)
                .is_none()
                .then(|| plan.instances(e)[0].rank as usize)
        })
        .collect();
    let mask: Vec<u64> = home
        .iter()
        .map(|h| if h.is_some() { u64::MAX } else { 0 })
        .collect();
    for (r, sent) in send.iter_mut().enumerate() {
        *sent = load.row(r).iter().zip(&mask).map(|(&q, &m)| q & m).sum();
    }
    let totals = load.expert_totals();
    for (e, home) in home.iter().enumerate() {
        if let Some(h) = *home {
            let local = load.get(h, e);
            send[h] -= local;
            recv[h] += totals[e] - local;
        }
    }
    for e in (0..experts).filter(|&e| home[e].is_none()) {
        let inst = plan.instances(e);
        for (r, sent) in send.iter_mut().enumerate() {
            let row = plan
                .split(r, e)
                .expect("an expert with a split has one for every rank");
            for (&q, i) in row.iter().zip(inst) {
                let t = i.rank as usize;
                if t != r {
                    *sent += q;
                    recv[t] += q;
                }
            }
        }
    }
    (send, recv)
}

/// Replica-weight bytes each rank sends and receives for one layer (empty: nothing moves).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ReplicaTraffic {
    pub send: Vec<u64>,
    pub recv: Vec<u64>,
    /// Some transfers go through relay trees (two stages).
    pub relayed: bool,
}

impl ReplicaTraffic {
    /// Every replica streamed this layer over `schedule` (redundant slots are shared across
    /// layers, UltraEP §4.1, so each layer's replicas arrive afresh).
    pub fn streamed(schedule: &TransferSchedule) -> Self {
        Self {
            send: schedule.send_bytes.clone(),
            recv: schedule.recv_bytes.clone(),
            relayed: !schedule.trees.is_empty(),
        }
    }

    /// [`Self::streamed`] over the relay trees `relay` plans for `plan`'s replicas of
    /// `expert_bytes` each. Per-rank volumes do not depend on the chunking, so the schedule is
    /// planned with whole copies (one transfer per copy instead of one per chunk); the chunk size
    /// only sets [`MoeCost::replicate_ms`]'s relay fill term.
    pub fn planned(plan: &Plan, expert_bytes: u64, relay: &RelayConfig) -> Self {
        if plan.replicas() == 0 {
            return Self::default();
        }
        let whole = RelayConfig {
            chunk_bytes: 0,
            ..*relay
        };
        Self::streamed(&plan_transfers(plan, expert_bytes, &whole))
    }

    /// Replicas into per-layer slots that hold `previous` (the layer's last plan's slots, all
    /// `None` before its first plan): what [`replica_stream`] streams, the new replicas directly
    /// or the whole plan over its relay trees, whichever loads the busiest rank less (the engine's
    /// rule with `--slot-memory per-layer`). Planned with whole copies, as [`Self::planned`].
    pub fn reused(
        plan: &Plan,
        previous: &[Option<u32>],
        expert_bytes: u64,
        relay: &RelayConfig,
    ) -> Self {
        let whole = RelayConfig {
            chunk_bytes: 0,
            ..*relay
        };
        Self::streamed(&replica_stream(plan, Some(previous), expert_bytes, &whole).schedule)
    }

    /// Replicas kept per layer between steps (history-based placement, as EPLB deployments keep
    /// them): only those not already resident, `(rank, expert)` absent from `previous` (the
    /// layer's slots in its last plan), are copied, directly from the expert's home rank.
    pub fn new_replicas(
        layout: &Layout,
        plan: &Plan,
        previous: Option<&[Option<u32>]>,
        expert_bytes: u64,
    ) -> Self {
        let ranks = plan.ranks();
        let n_slot = plan.slots_per_rank();
        let mut traffic = Self {
            send: vec![0; ranks],
            recv: vec![0; ranks],
            relayed: false,
        };
        for r in 0..ranks {
            for &expert in plan.rank_slots(r).iter().flatten() {
                let resident = previous
                    .is_some_and(|prev| prev[r * n_slot..(r + 1) * n_slot].contains(&Some(expert)));
                if !resident {
                    traffic.send[layout.home(expert as usize)] += expert_bytes;
                    traffic.recv[r] += expert_bytes;
                }
            }
        }
        traffic
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rackfill_balancer::{Algo, Settings};

    /// 1 MFLOP/s (FLOPs read as microseconds), 1000 B/s links at 50% (a byte costs 2 ms), 10 us
    /// latency, flat GEMM efficiency.
    fn tiny_rack() -> Rack {
        Rack {
            name: "tiny".into(),
            gpus: 8,
            scale_up_gbytes_per_s: 1e-6,
            link_efficiency: 0.5,
            link_latency_us: 10.0,
            bf16_tflops: 1e-6,
            hbm_tbytes_per_s: 1e-6,
            attention_efficiency: 0.5,
            overlap_compute_efficiency: 1.0,
            gemm_efficiency: vec![[1.0, 1.0], [1e9, 1.0]],
        }
    }

    #[test]
    fn makespan_is_the_sum_of_the_busiest_ranks_phases() {
        let rack = tiny_rack();
        // Hidden 8, width 4: 192 FLOPs per pair, 16-byte tokens, 192-byte experts.
        let dims = MoeDims {
            hidden: 8,
            intermediate: 4,
        };
        assert_eq!(
            (
                dims.flops_per_pair(),
                dims.token_bytes(),
                dims.expert_bytes()
            ),
            (192.0, 16, 192)
        );
        let cost = MoeCost { rack: &rack, dims };
        // Two ranks, one expert each; everything routed to expert 0 (rank 0).
        let layout = Layout::contiguous(2, 2, 1).unwrap();
        let load = LoadMatrix::from_rows(&[vec![4, 0], vec![4, 0]]).unwrap();
        let none = Plan::main_only(&layout, &load.expert_totals());
        // Unbalanced: rank 1's 4 pairs (64 bytes) go to rank 0 and come back: 128 ms + 10 us
        // each way; rank 0 computes 8 pairs: 1.536 ms.
        let got = cost.makespan(&layout, &load, &none, &RelayConfig::default());
        let dispatch = 128.01;
        assert!((got.unbalanced_us - (2.0 * dispatch + 1.536) * 1e3).abs() < 1e-6);
        assert_eq!(got.balanced_us, got.unbalanced_us);
        // Balanced: quota replicates expert 0 onto rank 1 (192 bytes at 500 B/s = 384 ms + 10
        // us); each rank computes its own 4 pairs (0.768 ms) and nothing is dispatched.
        let plan = Algo::Quota
            .build(&Settings {
                u_min: 1,
                ..Settings::default()
            })
            .plan(&layout, &load)
            .unwrap();
        assert_eq!(plan.replicas(), 1);
        let got = cost.makespan(&layout, &load, &plan, &RelayConfig::default());
        let want = MoeTerms {
            replicate: 384.01,
            dispatch: 0.0,
            expert: 0.768,
            combine: 0.0,
        };
        assert!(
            (got.balanced.total() - want.total()).abs() < 1e-9,
            "{got:?}"
        );
        assert!((got.balanced_us - want.total() * 1e3).abs() < 1e-6);
    }

    #[test]
    fn token_traffic_counts_every_pair_that_leaves_its_rank() {
        use rand::{Rng, SeedableRng};
        // Skewed loads on 6 ranks x 12 experts, planned with replicas, against pair-by-pair
        // counting over the split (or the main instance where an expert has none).
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let layout = Layout::contiguous(6, 12, 2).unwrap();
        let mut planner = Algo::Quota.build(&Settings {
            u_min: 1,
            ..Settings::default()
        });
        let mut replicated = 0;
        for _ in 0..20 {
            let rows: Vec<Vec<u64>> = (0..6)
                .map(|_| {
                    (0..12)
                        .map(|e| rng.gen_range(0..40 * (e % 4 + 1) as u64))
                        .collect()
                })
                .collect();
            let load = LoadMatrix::from_rows(&rows).unwrap();
            let plan = planner.plan(&layout, &load).unwrap();
            replicated += plan.replicas();
            let (mut send, mut recv) = (vec![0u64; 6], vec![0u64; 6]);
            for (r, row) in rows.iter().enumerate() {
                for (e, &q) in row.iter().enumerate() {
                    let inst = plan.instances(e);
                    let parts: Vec<(usize, u64)> = match plan.split(r, e) {
                        None => vec![(inst[0].rank as usize, q)],
                        Some(split) => inst
                            .iter()
                            .map(|i| i.rank as usize)
                            .zip(split.iter().copied())
                            .collect(),
                    };
                    for (t, n) in parts.into_iter().filter(|&(t, _)| t != r) {
                        send[r] += n;
                        recv[t] += n;
                    }
                }
            }
            assert_eq!(token_traffic(&load, &plan), (send, recv));
        }
        assert!(replicated > 20, "the loads exercise the split path");
    }
}
