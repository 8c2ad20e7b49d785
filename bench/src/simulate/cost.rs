//! The per-term cost model of one prefill step (UltraEP Eq. 1, with every term costed from bytes
//! and FLOPs on the [`Rack`]).
//!
//! Per MoE layer, in order, each phase ending when its busiest rank finishes (every phase ends in
//! an all-to-all or needs every rank's result, so ranks re-synchronise between phases):
//!
//! | term        | cost on the busiest rank                                                         |
//! |-------------|----------------------------------------------------------------------------------|
//! | `attention` | projections + router as GEMMs over the rank's own tokens (data-parallel attention), plus the causal attention core over its context |
//! | `dense_ffn` | the shared experts (MoE layers) or the dense MLP (dense layers) on the rank's own tokens |
//! | `solve`     | the planner's solve time (measured, or `--solve-us`)                             |
//! | `replicate` | replica weights over the relay schedule: `max(send, recv)` bytes per direction    |
//! | `dispatch`  | token-expert pairs leaving their source rank, `H` BF16 values each                |
//! | `expert`    | every instance's `6 H I m` FLOPs at the GEMM efficiency of its `m` rows           |
//! | `combine`   | the same pairs back to their source rank                                          |
//!
//! Replica streaming is *not* overlapped with dispatch or expert compute: UltraEP's forward
//! pipeline (§4.2, Eq. 1) overlaps it only with the reroute, and lets token dispatch wait for it so
//! the two do not contend for the links. Solving and replication are therefore on the critical path.

use super::rack::Rack;
use super::shape::ModelShape;
use rackfill_balancer::relay::TransferSchedule;
use rackfill_balancer::{Layout, LoadMatrix, Plan};
use serde::Serialize;
use std::ops::{Add, AddAssign};

/// Term names, in the order of [`Terms::values`].
pub const TERM_NAMES: [&str; 7] = [
    "attention",
    "dense_ffn",
    "solve",
    "replicate",
    "dispatch",
    "expert",
    "combine",
];

/// Time of each term, milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Terms {
    pub attention: f64,
    pub dense_ffn: f64,
    pub solve: f64,
    pub replicate: f64,
    pub dispatch: f64,
    pub expert: f64,
    pub combine: f64,
}

impl Terms {
    /// The terms in [`TERM_NAMES`] order.
    pub fn values(&self) -> [f64; 7] {
        [
            self.attention,
            self.dense_ffn,
            self.solve,
            self.replicate,
            self.dispatch,
            self.expert,
            self.combine,
        ]
    }

    /// Sum of all terms: the step (or layer) time.
    pub fn total(&self) -> f64 {
        self.values().iter().sum()
    }

    /// Every term times `k`.
    pub fn scaled(&self, k: f64) -> Self {
        Self {
            attention: self.attention * k,
            dense_ffn: self.dense_ffn * k,
            solve: self.solve * k,
            replicate: self.replicate * k,
            dispatch: self.dispatch * k,
            expert: self.expert * k,
            combine: self.combine * k,
        }
    }
}

impl Add for Terms {
    type Output = Terms;

    fn add(self, o: Terms) -> Terms {
        Terms {
            attention: self.attention + o.attention,
            dense_ffn: self.dense_ffn + o.dense_ffn,
            solve: self.solve + o.solve,
            replicate: self.replicate + o.replicate,
            dispatch: self.dispatch + o.dispatch,
            expert: self.expert + o.expert,
            combine: self.combine + o.combine,
        }
    }
}

impl AddAssign for Terms {
    fn add_assign(&mut self, o: Terms) {
        *self = *self + o;
    }
}

/// One piece of a rank's prefill chunk: `tokens` new tokens of a request whose first `context`
/// tokens were prefilled in earlier steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub tokens: u64,
    pub context: u64,
}

/// The cost model over one rack and one model shape.
#[derive(Debug, Clone, Copy)]
pub struct CostModel<'a> {
    pub rack: &'a Rack,
    pub shape: &'a ModelShape,
}

impl CostModel<'_> {
    /// Milliseconds of a GEMM of `flops` FLOPs over `rows` rows (tokens), at the curve's
    /// efficiency for that many rows.
    pub fn gemm_ms(&self, flops: f64, rows: f64) -> f64 {
        if rows <= 0.0 || flops <= 0.0 {
            return 0.0;
        }
        flops / (self.rack.peak_flops() * self.rack.gemm_efficiency_at(rows)) * 1e3
    }

    /// Attention of one rank in one layer: q/k/v/o projections (and the router on MoE layers) as
    /// GEMMs over the rank's tokens, plus the causal core: each new token attends to its
    /// request's context and to the new tokens before it and itself, i.e.
    /// `tokens * context + tokens * (tokens + 1) / 2` (query, key) pairs per segment.
    pub fn rank_attention_ms(&self, segments: &[Segment], moe_layer: bool) -> f64 {
        let tokens: u64 = segments.iter().map(|s| s.tokens).sum();
        if tokens == 0 {
            return 0.0;
        }
        let mut per_token = self.shape.attention_projection_flops();
        if moe_layer {
            per_token += self.shape.router_flops();
        }
        let pairs: f64 = segments
            .iter()
            .map(|s| {
                let (n, c) = (s.tokens as f64, s.context as f64);
                n * c + n * (n + 1.0) / 2.0
            })
            .sum();
        let core = pairs * self.shape.attention_flops_per_pair()
            / (self.rack.peak_flops() * self.rack.attention_efficiency)
            * 1e3;
        self.gemm_ms(per_token * tokens as f64, tokens as f64) + core
    }

    /// A dense gated MLP of intermediate width `width` over `tokens` tokens (shared experts and
    /// dense layers): three `H x width` GEMMs.
    pub fn dense_mlp_ms(&self, tokens: u64, width: usize) -> f64 {
        let flops = 6.0 * self.shape.hidden as f64 * width as f64 * tokens as f64;
        self.gemm_ms(flops, tokens as f64)
    }

    /// The non-MoE terms of one step, summed over the model's layers: attention of every layer
    /// and the dense FFN (shared experts of MoE layers, MLP of dense layers), each layer costing
    /// its busiest rank.
    pub fn step_dense_terms(&self, ranks: &[Vec<Segment>]) -> Terms {
        let busiest =
            |f: &dyn Fn(&[Segment]) -> f64| ranks.iter().map(|s| f(s)).fold(0.0, f64::max);
        let tokens = |s: &[Segment]| s.iter().map(|x| x.tokens).sum::<u64>();
        let moe = self.shape.moe_layers() as f64;
        let dense = self.shape.dense_layers as f64;
        let attention = moe * busiest(&|s| self.rank_attention_ms(s, true))
            + dense * busiest(&|s| self.rank_attention_ms(s, false));
        let shared = self.shape.shared_intermediate;
        let dense_ffn = moe * busiest(&|s| self.dense_mlp_ms(tokens(s), shared))
            + dense * busiest(&|s| self.dense_mlp_ms(tokens(s), self.shape.dense_intermediate));
        Terms {
            attention,
            dense_ffn,
            ..Terms::default()
        }
    }

    /// Expert compute of one layer on its busiest rank: every physical instance with `m > 0`
    /// rows costs `6 H I m` FLOPs at the GEMM efficiency of `m` rows (empty instances launch
    /// nothing and read no weights).
    pub fn expert_ms(&self, plan: &Plan) -> f64 {
        let mut per_rank = vec![0.0f64; plan.ranks()];
        let flops = self.shape.flops_per_pair();
        for e in 0..plan.experts() {
            for inst in plan.instances(e) {
                let m = inst.quota as f64;
                per_rank[inst.rank as usize] += self.gemm_ms(flops * m, m);
            }
        }
        per_rank.into_iter().fold(0.0, f64::max)
    }

    /// One all-to-all phase in which the busiest rank sends or receives `bytes` (links are full
    /// duplex, so it is the larger of its two directions): bytes over the achieved bandwidth plus
    /// the phase latency; nothing when nothing moves.
    pub fn comm_ms(&self, bytes: u64) -> f64 {
        if bytes == 0 {
            return 0.0;
        }
        bytes as f64 / self.rack.link_bytes_per_s() * 1e3 + self.rack.link_latency_us * 1e-3
    }

    /// Dispatch (equal to combine, which moves the same pairs back): see [`token_traffic`].
    pub fn dispatch_ms(&self, load: &LoadMatrix, plan: &Plan) -> f64 {
        let (send, recv) = token_traffic(load, plan);
        let busiest = send.iter().chain(&recv).copied().max().unwrap_or(0);
        self.comm_ms(busiest.saturating_mul(self.shape.token_bytes()))
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
        let mut ms = self.comm_ms(busiest);
        if traffic.relayed {
            let fill = chunk_bytes.min(self.shape.expert_bytes());
            ms +=
                fill as f64 / self.rack.link_bytes_per_s() * 1e3 + self.rack.link_latency_us * 1e-3;
        }
        ms
    }
}

/// Token-expert pairs each rank sends and receives in dispatch under `plan`'s reroute split.
///
/// A pair is sent once per (token, expert instance): tokens going to two experts on the same
/// rank are counted twice (DeepEP-style deduplication per destination rank would send them once;
/// with top-8 over 2-4 experts per rank that saves a few percent) and pairs whose instance lives
/// on the source rank never touch the fabric.
pub fn token_traffic(load: &LoadMatrix, plan: &Plan) -> (Vec<u64>, Vec<u64>) {
    let ranks = load.ranks();
    let mut send = vec![0u64; ranks];
    let mut recv = vec![0u64; ranks];
    for e in 0..plan.experts() {
        let inst = plan.instances(e);
        for (r, sent) in send.iter_mut().enumerate() {
            match plan.split(r, e) {
                None => {
                    let home = inst[0].rank as usize;
                    if home != r {
                        let q = load.get(r, e);
                        *sent += q;
                        recv[home] += q;
                    }
                }
                Some(row) => {
                    for (&q, i) in row.iter().zip(inst) {
                        let t = i.rank as usize;
                        if t != r {
                            *sent += q;
                            recv[t] += q;
                        }
                    }
                }
            }
        }
    }
    (send, recv)
}

/// Replica-weight bytes each rank sends and receives for one layer.
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
