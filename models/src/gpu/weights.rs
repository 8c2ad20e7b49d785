//! The model's weights on the device: bf16 everywhere but the routers (f32: expert selection
//! must not flip on a rounding), every matrix `[out, in]` as the checkpoint stores it, so a bf16
//! checkpoint's tensors are uploaded byte for byte ([`super::load`] fills them).

use rackfill_kernels::cuda::exec::DeviceBuffer;
use rackfill_kernels::cuda::local_experts::LocalExperts;

use super::ops::{DeviceWeight, RopeTables};
use crate::config::RouterKind;

/// Where the routed experts of the MoE layers run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Experts {
    /// On this device, every one of them ([`super::GpuModel::forward`]).
    Here,
    /// On an EP data plane: the model holds none of them.
    Elsewhere,
}

/// A linear layer: bf16 weight `[out, in]` and optional bf16 bias `[out]`.
pub(crate) struct GpuLinear {
    pub weight: DeviceWeight,
    pub bias: Option<DeviceBuffer>,
}

impl GpuLinear {
    /// Output width.
    pub fn out_dim(&self) -> usize {
        self.weight.out_dim
    }
}

/// An RMSNorm scale (bf16) and epsilon.
pub(crate) struct GpuNorm {
    pub weight: DeviceBuffer,
    pub eps: f32,
}

/// A gated MLP, bf16: `[2I, H]` gate-up (the gate projection's rows, then the up
/// projection's) and `[H, I]` down.
pub(crate) struct GpuMlp {
    pub gate_up: DeviceWeight,
    pub down: DeviceWeight,
}

impl GpuMlp {
    pub fn intermediate(&self) -> usize {
        self.down.in_dim
    }
}

/// Grouped-query attention's weights.
pub(crate) struct GpuGqa {
    pub q: GpuLinear,
    pub k: GpuLinear,
    pub v: GpuLinear,
    pub o: GpuLinear,
    pub q_norm: Option<GpuNorm>,
    pub k_norm: Option<GpuNorm>,
    pub rope: RopeTables,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// DeepSeek's latent attention's weights, for the absorbed form: `kv_b` serves both the key
/// absorption into the query and the value expansion of the output.
pub(crate) struct GpuMla {
    pub q_direct: Option<GpuLinear>,
    pub q_low_rank: Option<(GpuLinear, GpuNorm, GpuLinear)>,
    pub kv_a: GpuLinear,
    pub kv_norm: GpuNorm,
    pub kv_b: GpuLinear,
    pub o: GpuLinear,
    pub rope: RopeTables,
    pub heads: usize,
    pub kv_lora: usize,
    pub nope: usize,
    pub rot: usize,
    pub v_dim: usize,
    pub scale: f32,
}

pub(crate) enum GpuAttention {
    Gqa(Box<GpuGqa>),
    Mla(Box<GpuMla>),
}

/// A router (f32 weight `[E, H]`), its experts and shared experts.
pub(crate) struct GpuMoe {
    pub router: DeviceWeight,
    pub correction_bias: Option<DeviceBuffer>,
    pub kind: RouterKind,
    pub top_k: usize,
    /// The routed experts' weights when they run here: the memory [`Self::local`]'s weight
    /// table points into, owned here (never read through this field).
    #[allow(dead_code)]
    pub experts: Vec<GpuMlp>,
    /// [`Self::experts`] as the whole-model path runs them (rows grouped on the device);
    /// `None` when the routed experts live elsewhere (an EP data plane).
    pub local: Option<LocalExperts>,
    pub shared: Option<GpuMlp>,
    /// Qwen2-MoE's shared-expert gate, f32 `[1, H]`.
    pub shared_gate: Option<DeviceWeight>,
}

pub(crate) enum GpuFfn {
    Dense(GpuMlp),
    Moe(Box<GpuMoe>),
}

pub(crate) struct GpuLayer {
    pub input_norm: GpuNorm,
    pub attention: GpuAttention,
    pub post_norm: GpuNorm,
    pub ffn: GpuFfn,
}

/// Every weight of the model on the device.
pub(crate) struct GpuWeights {
    /// bf16 `[V, H]`.
    pub embed: DeviceWeight,
    pub layers: Vec<GpuLayer>,
    pub norm: GpuNorm,
    /// bf16 `[V, H]`; `None` for tied embeddings (the embedding serves, uploaded once).
    pub lm_head: Option<DeviceWeight>,
}

impl GpuWeights {
    /// The LM head's weight `[V, H]`.
    pub fn lm_head(&self) -> &DeviceWeight {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}
