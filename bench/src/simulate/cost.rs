//! The per-term cost model of one prefill step (UltraEP Eq. 1, with every term costed from bytes
//! and FLOPs on the [`Rack`]).
//!
//! The MoE terms of a layer (`replicate`, `dispatch`, `expert`, `combine`) are the EP runtime's
//! own cost model, [`rackfill_engine::rack_cost::MoeCost`], the code behind every `LayerReport`'s
//! simulated makespan: a recorded routing trace simulated here gives the same per-layer MoE
//! figures the engine reported while recording it. This file adds what surrounds them in a step,
//! each phase ending when its busiest rank finishes:
//!
//! | term        | cost on the busiest rank                                                         |
//! |-------------|----------------------------------------------------------------------------------|
//! | `attention` | projections + router as GEMMs over the rank's own tokens (data-parallel attention), plus the causal attention core over its context |
//! | `dense_ffn` | the shared experts (MoE layers) or the dense MLP (dense layers) on the rank's own tokens |
//! | `solve`     | the planner's solve time (measured, or `--solve-us`)                             |
//!
//! Solving is on the critical path, before replica streaming (UltraEP §4.2).

use super::shape::ModelShape;
use rackfill_engine::rack_cost::MoeCost;
use rackfill_engine::Rack;
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

/// The step cost model over one rack and one model shape.
#[derive(Debug, Clone, Copy)]
pub struct StepCost<'a> {
    pub rack: &'a Rack,
    pub shape: &'a ModelShape,
}

impl StepCost<'_> {
    /// The MoE-layer cost model (the EP runtime's) for this rack and shape.
    pub fn moe(&self) -> MoeCost<'_> {
        MoeCost {
            rack: self.rack,
            dims: self.shape.moe_dims(),
        }
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
        self.rack.gemm_ms(per_token * tokens as f64, tokens as f64) + core
    }

    /// A dense gated MLP of intermediate width `width` over `tokens` tokens (shared experts and
    /// dense layers): three `H x width` GEMMs.
    pub fn dense_mlp_ms(&self, tokens: u64, width: usize) -> f64 {
        let flops = 6.0 * self.shape.hidden as f64 * width as f64 * tokens as f64;
        self.rack.gemm_ms(flops, tokens as f64)
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
}
