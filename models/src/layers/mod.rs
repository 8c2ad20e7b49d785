//! Building blocks shared by the families: linear maps, RMSNorm, the gated SiLU MLP (dense
//! layers, shared experts and every routed expert), rotary embeddings, attention with a KV cache,
//! routers and the MoE block.

pub mod attention;
pub mod experts;
pub mod fastmath;
pub mod gemm;
pub mod kv_cache;
pub mod moe;
pub mod rope;
pub mod router;

use candle_core::{Module, Tensor};
use rayon::prelude::*;

use self::gemm::Dims;

use crate::checkpoint::Weights;
use crate::error::Result;

/// `y = x W^T (+ b)`. The weight is stored transposed (`[in, out]`, contiguous), the layout the
/// GEMM kernels stream fastest.
#[derive(Debug, Clone)]
pub struct Linear {
    weight_t: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    /// Loads `w.weight` (and `w.bias` when `bias`).
    pub fn load(w: &Weights, in_dim: usize, out_dim: usize, bias: bool) -> Result<Self> {
        let weight = w.get(&[out_dim, in_dim], "weight")?;
        let bias = bias.then(|| w.get(&[out_dim], "bias")).transpose()?;
        Ok(Self {
            weight_t: weight.t()?.contiguous()?,
            bias,
        })
    }

    /// From an existing `[out, in]` weight (tied embeddings).
    pub fn from_weight(weight: &Tensor) -> Result<Self> {
        Ok(Self {
            weight_t: weight.t()?.contiguous()?,
            bias: None,
        })
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = x.matmul(&self.weight_t)?;
        match &self.bias {
            Some(bias) => y.broadcast_add(bias),
            None => Ok(y),
        }
    }
}

/// Root-mean-square norm with a learned scale, computed in f32 like transformers does.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f32,
}

impl RmsNorm {
    /// Loads `w.weight` of shape `[dim]`.
    pub fn load(w: &Weights, dim: usize, eps: f64) -> Result<Self> {
        Ok(Self {
            weight: w.get(&[dim], "weight")?,
            eps: eps as f32,
        })
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        candle_nn::ops::rms_norm(&x.contiguous()?, &self.weight, self.eps)
    }
}

/// The gated SiLU MLP `down(silu(gate(x)) * up(x))`: dense layers, shared experts and every
/// routed expert. The weights are kept transposed (`[in, out]`, what the GEMM kernels stream
/// fastest) with gate and up fused into one `[H, 2I]` matrix so one product serves both. Each
/// expert owns its two plain buffers, so a replica is a byte copy and runs on any rank.
#[derive(Debug, Clone)]
pub struct Mlp {
    /// `[H, 2I]`: columns `0..I` gate, `I..2I` up.
    gate_up_t: Vec<f32>,
    /// `[I, H]`.
    down_t: Vec<f32>,
    hidden: usize,
    intermediate: usize,
}

impl Mlp {
    /// Loads HF's `gate_proj` / `up_proj` / `down_proj` (or Mixtral's `w1` / `w3` / `w2`).
    pub fn load(w: &Weights, hidden: usize, intermediate: usize, names: MlpNames) -> Result<Self> {
        let gate = w.pp(names.gate).get(&[intermediate, hidden], "weight")?;
        let up = w.pp(names.up).get(&[intermediate, hidden], "weight")?;
        let down = w.pp(names.down).get(&[hidden, intermediate], "weight")?;
        Self::from_parts(&gate, &up, &down)
    }

    /// From HF-layout `[I, H]` gate and up and `[H, I]` down matrices.
    pub fn from_parts(gate: &Tensor, up: &Tensor, down: &Tensor) -> Result<Self> {
        let (intermediate, hidden) = gate.dims2()?;
        let gate_up_t = Tensor::cat(&[gate, up], 0)?.t()?.contiguous()?;
        let down_t = down.t()?.contiguous()?;
        Ok(Self {
            gate_up_t: gate_up_t.flatten_all()?.to_vec1()?,
            down_t: down_t.flatten_all()?.to_vec1()?,
            hidden,
            intermediate,
        })
    }

    /// The expert's weight buffers, `[H, 2I]` gate-up and `[I, H]` down (transposed): what a
    /// replica copies.
    pub fn weights(&self) -> [&[f32]; 2] {
        [&self.gate_up_t, &self.down_t]
    }

    /// Width of the hidden (intermediate) layer.
    pub fn intermediate_size(&self) -> usize {
        self.intermediate
    }

    /// Width of the model (input and output of the MLP).
    pub fn hidden_size(&self) -> usize {
        self.hidden
    }

    /// The MLP on `rows` row-major inputs `[rows, H]`, on the calling thread.
    pub fn forward_rows(&self, x: &[f32], rows: usize) -> Vec<f32> {
        gated_mlp_rows(self.weights(), self.hidden, self.intermediate, x, rows)
    }
}

/// A gated MLP given its weight buffers in [`Mlp::weights`] layout (`[H, 2I]` gate-up, `[I, H]`
/// down), on `rows` row-major inputs `[rows, H]`, on the calling thread. The EP engine runs
/// replica experts with it straight from the slot buffers their weights were streamed into.
pub fn gated_mlp_rows(
    weights: [&[f32]; 2],
    hidden: usize,
    intermediate: usize,
    x: &[f32],
    rows: usize,
) -> Vec<f32> {
    let (h, i) = (hidden, intermediate);
    let [gate_up_t, down_t] = weights;
    let gate_up = gemm::matmul(
        x,
        gate_up_t,
        Dims {
            m: rows,
            k: h,
            n: 2 * i,
        },
    );
    let mut act = vec![0f32; rows * i];
    for (out, gu) in act.chunks_exact_mut(i).zip(gate_up.chunks_exact(2 * i)) {
        let (gate, up) = gu.split_at(i);
        fastmath::silu_mul(out, gate, up);
    }
    gemm::matmul(
        &act,
        down_t,
        Dims {
            m: rows,
            k: i,
            n: h,
        },
    )
}

/// Rows per parallel task when a dense MLP splits its batch across threads.
const MLP_ROWS_PER_TASK: usize = 64;

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (rows, hidden) = x.dims2()?;
        let xs = x.flatten_all()?.to_vec1::<f32>()?;
        let chunk = rows
            .div_ceil(rayon::current_num_threads().max(1))
            .max(MLP_ROWS_PER_TASK);
        let parts: Vec<Vec<f32>> = xs
            .par_chunks(chunk * hidden.max(1))
            .map(|part| self.forward_rows(part, part.len() / hidden.max(1)))
            .collect();
        Tensor::from_vec(parts.concat(), (rows, hidden), x.device())
    }
}

/// Submodule names of an MLP in a checkpoint.
#[derive(Debug, Clone, Copy)]
pub struct MlpNames {
    pub gate: &'static str,
    pub up: &'static str,
    pub down: &'static str,
}

impl MlpNames {
    /// `gate_proj` / `up_proj` / `down_proj` (Qwen, DeepSeek).
    pub const HF: Self = Self {
        gate: "gate_proj",
        up: "up_proj",
        down: "down_proj",
    };
    /// `w1` / `w3` / `w2` (Mixtral).
    pub const MIXTRAL: Self = Self {
        gate: "w1",
        up: "w3",
        down: "w2",
    };
}
