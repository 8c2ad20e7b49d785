//! The model's weights uploaded to the device: bf16 everywhere but the routers (f32: expert
//! selection must not flip on a rounding), taken from the loaded CPU model so that every family's
//! checkpoint layout, fusion and tying is resolved in one place (the CPU loader).

use candle_core::Tensor;
use rackfill_kernels::cuda::exec::{DType, DeviceBuffer, Executor, ExecutorExt};

use super::ops::{DeviceWeight, RopeTables};
use crate::config::RouterKind;
use crate::error::Result;
use crate::families::deepseek_v3::{MlaAttention, QueryProjection};
use crate::layers::attention::GqaAttention;
use crate::layers::moe::MoeBlock;
use crate::layers::rope::Rope;
use crate::layers::{Linear, Mlp, RmsNorm};
use crate::model::{FeedForward, MoeModel};

/// Where the routed experts of the MoE layers run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Experts {
    /// On this device, every one of them ([`GpuModel::forward`]).
    Here,
    /// On an EP data plane: the model is uploaded without them.
    Elsewhere,
}

fn values(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?.to_vec1::<f32>()?)
}

/// `[rows, cols]` f32 values as a bf16 (or f32) device weight.
fn weight(
    exec: &dyn Executor,
    data: &[f32],
    rows: usize,
    cols: usize,
    dtype: DType,
) -> Result<DeviceWeight> {
    let buffer = match dtype {
        DType::Bf16 => exec.upload_bf16(data)?,
        DType::F32 => exec.upload_f32(data)?,
    };
    Ok(DeviceWeight {
        buffer,
        dtype,
        rows,
        cols,
    })
}

/// A linear layer: bf16 weight `[in, out]` and optional bf16 bias `[out]`.
pub(crate) struct GpuLinear {
    pub weight: DeviceWeight,
    pub bias: Option<DeviceBuffer>,
}

impl GpuLinear {
    fn upload(exec: &dyn Executor, linear: &Linear) -> Result<Self> {
        let (rows, cols) = linear.weight_t().dims2()?;
        Ok(Self {
            weight: weight(exec, &values(linear.weight_t())?, rows, cols, DType::Bf16)?,
            bias: linear
                .bias()
                .map(|b| Ok::<_, crate::error::ModelError>(exec.upload_bf16(&values(b)?)?))
                .transpose()?,
        })
    }

    /// Output width.
    pub fn out_dim(&self) -> usize {
        self.weight.cols
    }
}

/// An RMSNorm scale (bf16) and epsilon.
pub(crate) struct GpuNorm {
    pub weight: DeviceBuffer,
    pub eps: f32,
}

impl GpuNorm {
    fn upload(exec: &dyn Executor, norm: &RmsNorm) -> Result<Self> {
        let (weight, eps) = norm.parts();
        Ok(Self {
            weight: exec.upload_bf16(&values(weight)?)?,
            eps,
        })
    }
}

/// A gated MLP: `[H, 2I]` gate-up and `[I, H]` down, bf16.
pub(crate) struct GpuMlp {
    pub gate_up: DeviceWeight,
    pub down: DeviceWeight,
}

impl GpuMlp {
    fn upload(exec: &dyn Executor, mlp: &Mlp) -> Result<Self> {
        let (h, i) = (mlp.hidden_size(), mlp.intermediate_size());
        let [gate_up, down] = mlp.weights();
        Ok(Self {
            gate_up: weight(exec, gate_up, h, 2 * i, DType::Bf16)?,
            down: weight(exec, down, i, h, DType::Bf16)?,
        })
    }

    pub fn intermediate(&self) -> usize {
        self.down.rows
    }
}

fn rope_tables(exec: &dyn Executor, rope: &Rope) -> Result<RopeTables> {
    Ok(RopeTables {
        inv_freq: exec.upload_f32(rope.inv_freq())?,
        rot_dim: 2 * rope.inv_freq().len(),
        attention_factor: rope.attention_factor(),
        interleaved: rope.interleaved(),
    })
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

/// A router (f32 weight `[H, E]`), its experts and shared experts.
pub(crate) struct GpuMoe {
    pub router: DeviceWeight,
    pub correction_bias: Option<DeviceBuffer>,
    pub kind: RouterKind,
    pub top_k: usize,
    pub experts: Vec<GpuMlp>,
    pub shared: Option<GpuMlp>,
    /// Qwen2-MoE's shared-expert gate, f32 `[H, 1]`.
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
    pub embed: DeviceBuffer,
    pub layers: Vec<GpuLayer>,
    pub norm: GpuNorm,
    pub lm_head: GpuLinear,
}

impl GpuWeights {
    /// Uploads `model`, with its routed experts when they run `Here` (then it must hold all).
    pub fn upload(exec: &dyn Executor, model: &MoeModel, experts: Experts) -> Result<Self> {
        let layers = model
            .layers()
            .iter()
            .map(|layer| {
                Ok(GpuLayer {
                    input_norm: GpuNorm::upload(exec, &layer.input_norm)?,
                    attention: upload_attention(exec, layer.attention.as_any())?,
                    post_norm: GpuNorm::upload(exec, &layer.post_attention_norm)?,
                    ffn: match &layer.ffn {
                        FeedForward::Dense(mlp) => GpuFfn::Dense(GpuMlp::upload(exec, mlp)?),
                        FeedForward::Moe(block) => {
                            GpuFfn::Moe(Box::new(upload_moe(exec, block, experts)?))
                        }
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            embed: exec.upload_bf16(&values(&model.embed_tokens)?)?,
            layers,
            norm: GpuNorm::upload(exec, &model.norm)?,
            lm_head: GpuLinear::upload(exec, &model.lm_head)?,
        })
    }
}

fn upload_attention(exec: &dyn Executor, attention: &dyn std::any::Any) -> Result<GpuAttention> {
    if let Some(a) = attention.downcast_ref::<GqaAttention>() {
        let norm = |n: &Option<RmsNorm>| n.as_ref().map(|n| GpuNorm::upload(exec, n)).transpose();
        return Ok(GpuAttention::Gqa(Box::new(GpuGqa {
            q: GpuLinear::upload(exec, &a.q_proj)?,
            k: GpuLinear::upload(exec, &a.k_proj)?,
            v: GpuLinear::upload(exec, &a.v_proj)?,
            o: GpuLinear::upload(exec, &a.o_proj)?,
            q_norm: norm(&a.q_norm)?,
            k_norm: norm(&a.k_norm)?,
            rope: rope_tables(exec, &a.rope)?,
            heads: a.heads,
            kv_heads: a.kv_heads,
            head_dim: a.head_dim,
        })));
    }
    let a = attention.downcast_ref::<MlaAttention>().ok_or_else(|| {
        crate::error::ModelError::Input("the GPU path knows no such attention".into())
    })?;
    let (q_direct, q_low_rank) = match &a.query {
        QueryProjection::Direct(q) => (Some(GpuLinear::upload(exec, q)?), None),
        QueryProjection::LowRank { a, norm, b } => (
            None,
            Some((
                GpuLinear::upload(exec, a)?,
                GpuNorm::upload(exec, norm)?,
                GpuLinear::upload(exec, b)?,
            )),
        ),
    };
    Ok(GpuAttention::Mla(Box::new(GpuMla {
        q_direct,
        q_low_rank,
        kv_a: GpuLinear::upload(exec, &a.kv_a)?,
        kv_norm: GpuNorm::upload(exec, &a.kv_norm)?,
        kv_b: GpuLinear::upload(exec, &a.kv_b)?,
        o: GpuLinear::upload(exec, &a.o_proj)?,
        rope: rope_tables(exec, &a.rope)?,
        heads: a.heads,
        kv_lora: a.dims.kv_lora_rank,
        nope: a.dims.qk_nope_head_dim,
        rot: a.dims.qk_rope_head_dim,
        v_dim: a.dims.v_head_dim,
        scale: a.scale as f32,
    })))
}

fn upload_moe(exec: &dyn Executor, block: &MoeBlock, experts: Experts) -> Result<GpuMoe> {
    if experts == Experts::Here {
        block.experts.require_all()?;
    }
    let router = &block.router;
    let (e, h) = router.weight.dims2()?;
    let router_t = values(&router.weight.t()?.contiguous()?)?;
    let shared_gate = match block.shared.as_ref().and_then(|s| s.gate.as_ref()) {
        Some(gate) => Some(weight(exec, &values(gate)?, h, 1, DType::F32)?),
        None => None,
    };
    Ok(GpuMoe {
        router: weight(exec, &router_t, h, e, DType::F32)?,
        correction_bias: router
            .correction_bias
            .as_deref()
            .map(|b| exec.upload_f32(b))
            .transpose()?,
        kind: router.kind.clone(),
        top_k: router.top_k,
        experts: match experts {
            Experts::Here => (0..block.experts.num_experts())
                .map(|i| GpuMlp::upload(exec, block.experts.get(i as u32)?))
                .collect::<Result<Vec<_>>>()?,
            Experts::Elsewhere => Vec::new(),
        },
        shared: block
            .shared
            .as_ref()
            .map(|s| GpuMlp::upload(exec, &s.mlp))
            .transpose()?,
        shared_gate,
    })
}
