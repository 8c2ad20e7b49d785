//! The MoE block: router, routed experts (each its own [`Mlp`], addressable by id so the engine
//! can copy it to replica slots and run it on any rank; a process may hold only its EP ranks'
//! home experts, [`RoutedExperts`]), and optional shared experts.
//!
//! The dense path here runs every expert locally and is the reference the EP engine must match.
//! It groups tokens by expert and runs one GEMM per expert over its token block, never one per
//! token, and sums each token's expert outputs with `rackfill_kernels::combine`, the weighted
//! combine the EP data plane runs too.

use candle_core::{Device, Module, Tensor};
use rayon::prelude::*;

use crate::checkpoint::Weights;
use crate::config::{ModelConfig, SharedExpertConfig};
use crate::error::{ModelError, Result};
use crate::expert_selection::ExpertSelection;
use crate::layers::experts::{load_experts, RoutedExperts};
use crate::layers::router::{Router, Routing};
use crate::layers::{Mlp, MlpNames};

/// Always-on experts beside the routed ones (DeepSeek-V3, Qwen2-MoE).
#[derive(Debug, Clone)]
pub struct SharedExpert {
    pub(crate) mlp: Mlp,
    /// Qwen2-MoE's `shared_expert_gate` (`[1, H]`): output scaled by `sigmoid(gate · x)`.
    pub(crate) gate: Option<Tensor>,
}

impl SharedExpert {
    /// Loads the shared MLP at `w` and, when gated, the gate at `gate`.
    pub fn load(
        w: &Weights,
        gate: &Weights,
        hidden: usize,
        config: &SharedExpertConfig,
    ) -> Result<Self> {
        let mlp = Mlp::load(w, hidden, config.intermediate_size, MlpNames::HF)?;
        let gate = config
            .gated
            .then(|| gate.get(&[1, hidden], "weight"))
            .transpose()?;
        Ok(Self { mlp, gate })
    }

    /// The shared experts' contribution for `x` `[T, H]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let out = self.mlp.forward(x)?;
        Ok(match &self.gate {
            Some(gate) => {
                let scale = candle_nn::ops::sigmoid(&x.matmul(&gate.t()?)?)?;
                out.broadcast_mul(&scale)?
            }
            None => out,
        })
    }
}

/// The token-expert pairs one expert receives: pair `p` is token `p / top_k`'s `p % top_k`-th
/// choice.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExpertGroup {
    pub pairs: Vec<u32>,
}

/// Buckets a routing by expert: `groups[e]` lists the pairs routed to `e`, in token order.
pub fn group_by_expert(routing: &Routing, num_experts: usize) -> Vec<ExpertGroup> {
    let mut groups = vec![ExpertGroup::default(); num_experts];
    for (pair, &e) in routing.experts.iter().enumerate() {
        groups[e as usize].pairs.push(pair as u32);
    }
    groups
}

/// Gathers the token rows of `pairs` (pair `p` reads row `p / top_k`) of a row-major `[T, H]`
/// matrix into a row-major `[pairs, H]` buffer.
pub fn gather_pair_rows(x: &[f32], hidden: usize, top_k: usize, pairs: &[u32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(pairs.len() * hidden);
    for &p in pairs {
        let r = p as usize / top_k.max(1);
        out.extend_from_slice(&x[r * hidden..(r + 1) * hidden]);
    }
    out
}

/// Row-major f32 contents of a 2-D tensor.
pub fn rows_of(x: &Tensor) -> Result<Vec<f32>> {
    Ok(x.flatten_all()?.to_vec1::<f32>()?)
}

/// Router, routed experts and shared experts of one MoE layer.
#[derive(Debug, Clone)]
pub struct MoeBlock {
    pub router: Router,
    pub experts: RoutedExperts,
    pub shared: Option<SharedExpert>,
}

/// Checkpoint names of an MoE block's parts below its prefix (the router is always `gate`).
#[derive(Debug, Clone, Copy)]
pub struct MoeNames {
    /// Names inside each routed expert.
    pub experts: MlpNames,
    /// The shared experts' MLP, loaded when the config has shared experts.
    pub shared: &'static str,
    /// Qwen2-MoE's sigmoid gate on the shared expert, loaded when the config says it is gated.
    pub shared_gate: &'static str,
}

impl MoeBlock {
    /// Loads `gate` (the router), the selected `experts.*` and, when the config has shared
    /// experts, the shared MLP and its gate, all below `w`.
    pub fn load(
        w: &Weights,
        config: &ModelConfig,
        names: MoeNames,
        selection: &ExpertSelection,
    ) -> Result<Self> {
        let router = Router::load(&w.pp("gate"), config.hidden_size, &config.moe)?;
        let experts = load_experts(&w.pp("experts"), config, names.experts, selection)?;
        let shared = config
            .moe
            .shared
            .as_ref()
            .map(|shared| {
                SharedExpert::load(
                    &w.pp(names.shared),
                    &w.pp(names.shared_gate),
                    config.hidden_size,
                    shared,
                )
            })
            .transpose()?;
        Ok(Self::new(router, experts, shared))
    }

    /// Assembles a block from its loaded parts.
    pub fn new(router: Router, experts: RoutedExperts, shared: Option<SharedExpert>) -> Self {
        Self {
            router,
            experts,
            shared,
        }
    }

    /// Dense reference forward: route, run every expert locally on its token group, combine
    /// with the router weights, add the shared experts.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let routing = self.router.route(x)?;
        let routed = self.forward_routed(x, &routing)?;
        self.add_shared(x, routed)
    }

    /// The routed experts' weighted sum for a given routing, all experts local (an error naming
    /// a missing expert on a block loaded for some EP ranks only).
    pub fn forward_routed(&self, x: &Tensor, routing: &Routing) -> Result<Tensor> {
        self.experts.require_all()?;
        let (tokens, hidden) = x.dims2()?;
        let xs = rows_of(x)?;
        let k = routing.top_k;
        let groups = group_by_expert(routing, self.experts.num_experts());
        // One task per expert (largest groups first so the tail is short), each product on one
        // core: per-expert blocks are too small to split well across threads.
        let mut order: Vec<usize> = (0..groups.len())
            .filter(|&e| !groups[e].pairs.is_empty())
            .collect();
        order.sort_by_key(|&e| std::cmp::Reverse(groups[e].pairs.len()));
        let outputs: Vec<(usize, Vec<f32>)> = order
            .par_iter()
            .map(|&e| {
                let pairs = &groups[e].pairs;
                let input = gather_pair_rows(&xs, hidden, k, pairs);
                let expert = self.experts.get(e as u32)?;
                Ok((e, expert.forward_rows(&input, pairs.len())))
            })
            .collect::<Result<_>>()?;
        let mut pair_outputs = vec![0f32; tokens * k * hidden];
        for (e, y) in outputs {
            for (&p, row) in groups[e].pairs.iter().zip(y.chunks_exact(hidden)) {
                let p = p as usize;
                pair_outputs[p * hidden..(p + 1) * hidden].copy_from_slice(row);
            }
        }
        // The one weighted combine of the EP data plane too: sums in top-k order, so the result
        // is bitwise independent of where each pair was computed.
        let acc = rackfill_kernels::combine(&pair_outputs, &routing.weights, tokens, k, hidden)
            .map_err(|e| ModelError::Input(format!("MoE combine: {e}")))?;
        Ok(Tensor::from_vec(acc, (tokens, hidden), &Device::Cpu)?)
    }

    /// Adds the shared experts' output (if any) to the routed output.
    pub fn add_shared(&self, x: &Tensor, routed: Tensor) -> Result<Tensor> {
        match &self.shared {
            Some(shared) => Ok((routed + shared.forward(x)?)?),
            None => Ok(routed),
        }
    }
}
