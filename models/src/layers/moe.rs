//! The MoE block: router, routed experts (each its own [`Mlp`], addressable by id so the engine
//! can copy it to replica slots and run it on any rank), and optional shared experts.
//!
//! The dense path here runs every expert locally and is the reference the EP engine must match.
//! It groups tokens by expert and runs one GEMM per expert over its token block, never one per
//! token.

use candle_core::{Device, Module, Tensor};
use rayon::prelude::*;

use crate::checkpoint::Weights;
use crate::config::{ModelConfig, SharedExpertConfig};
use crate::error::Result;
use crate::layers::router::{Router, Routing};
use crate::layers::{Mlp, MlpNames};

/// Always-on experts beside the routed ones (DeepSeek-V3, Qwen2-MoE).
#[derive(Debug, Clone)]
pub struct SharedExpert {
    mlp: Mlp,
    /// Qwen2-MoE's `shared_expert_gate` (`[1, H]`): output scaled by `sigmoid(gate · x)`.
    gate: Option<Tensor>,
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

/// The tokens (rows) and combine weights one expert receives.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExpertGroup {
    pub rows: Vec<u32>,
    pub weights: Vec<f32>,
}

/// Buckets a routing by expert: `groups[e]` lists the rows routed to `e`, in row order.
pub fn group_by_expert(routing: &Routing, num_experts: usize) -> Vec<ExpertGroup> {
    let mut groups = vec![ExpertGroup::default(); num_experts];
    let k = routing.top_k.max(1);
    for (slot, (&e, &w)) in routing.experts.iter().zip(&routing.weights).enumerate() {
        let group = &mut groups[e as usize];
        group.rows.push((slot / k) as u32);
        group.weights.push(w);
    }
    groups
}

/// Gathers `rows` of a row-major `[T, H]` matrix into a row-major `[rows, H]` buffer.
pub fn gather_rows(x: &[f32], hidden: usize, rows: &[u32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows.len() * hidden);
    for &r in rows {
        let r = r as usize;
        out.extend_from_slice(&x[r * hidden..(r + 1) * hidden]);
    }
    out
}

/// Adds `weights[i] * y[i]` into row `rows[i]` of the row-major accumulator.
pub fn scatter_add_rows(acc: &mut [f32], hidden: usize, rows: &[u32], weights: &[f32], y: &[f32]) {
    for ((&r, &w), src) in rows.iter().zip(weights).zip(y.chunks_exact(hidden)) {
        let dst = &mut acc[r as usize * hidden..(r as usize + 1) * hidden];
        for (d, s) in dst.iter_mut().zip(src) {
            *d += w * s;
        }
    }
}

/// Row-major f32 contents of a 2-D tensor.
pub fn rows_of(x: &Tensor) -> Result<Vec<f32>> {
    Ok(x.flatten_all()?.to_vec1::<f32>()?)
}

/// Router, routed experts and shared experts of one MoE layer.
#[derive(Debug, Clone)]
pub struct MoeBlock {
    pub router: Router,
    pub experts: Vec<Mlp>,
    pub shared: Option<SharedExpert>,
}

impl MoeBlock {
    /// Assembles a block from its loaded parts.
    pub fn new(router: Router, experts: Vec<Mlp>, shared: Option<SharedExpert>) -> Self {
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

    /// The routed experts' weighted sum for a given routing, all experts local.
    pub fn forward_routed(&self, x: &Tensor, routing: &Routing) -> Result<Tensor> {
        let (tokens, hidden) = x.dims2()?;
        let xs = rows_of(x)?;
        let groups = group_by_expert(routing, self.experts.len());
        // One task per expert (largest groups first so the tail is short), each product on one
        // core: per-expert blocks are too small to split well across threads.
        let mut order: Vec<usize> = (0..groups.len())
            .filter(|&e| !groups[e].rows.is_empty())
            .collect();
        order.sort_by_key(|&e| std::cmp::Reverse(groups[e].rows.len()));
        let outputs: Vec<(usize, Vec<f32>)> = order
            .par_iter()
            .map(|&e| {
                let input = gather_rows(&xs, hidden, &groups[e].rows);
                (
                    e,
                    self.experts[e].forward_rows(&input, groups[e].rows.len()),
                )
            })
            .collect();
        let mut acc = vec![0f32; tokens * hidden];
        for (e, y) in outputs {
            scatter_add_rows(&mut acc, hidden, &groups[e].rows, &groups[e].weights, &y);
        }
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

/// Loads the routed experts of a block: per-expert tensors (`experts.{e}.gate_proj.weight`, the
/// classic hub layout) or fused ones (`experts.gate_up_proj` `[E, 2I, H]` and
/// `experts.down_proj` `[E, H, I]`, what newer transformers versions may write).
pub fn load_experts(w: &Weights, config: &ModelConfig, names: MlpNames) -> Result<Vec<Mlp>> {
    let (e, h, i) = (
        config.moe.num_experts,
        config.hidden_size,
        config.moe.intermediate_size,
    );
    if w.contains("gate_up_proj") {
        let gate_up = w.get(&[e, 2 * i, h], "gate_up_proj")?;
        let down = w.get(&[e, h, i], "down_proj")?;
        return (0..e)
            .map(|expert| {
                let fused = gate_up.get(expert)?;
                Mlp::from_parts(
                    &fused.narrow(0, 0, i)?,
                    &fused.narrow(0, i, i)?,
                    &down.get(expert)?,
                )
            })
            .collect();
    }
    (0..e)
        .map(|expert| Mlp::load(&w.pp(expert), h, i, names))
        .collect()
}
