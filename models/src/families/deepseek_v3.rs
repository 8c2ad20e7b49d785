//! DeepSeek-V3 (`DeepseekV3ForCausalLM`): multi-head latent attention (optional q LoRA,
//! compressed KV with a decoupled shared RoPE key part), sigmoid router with
//! `e_score_correction_bias`, group-limited top-k, `routed_scaling_factor`, shared experts, and
//! dense MLP layers before `first_k_dense_replace`.

use candle_core::{Module, Tensor, D};

use crate::checkpoint::Weights;
use crate::config::{MlaConfig, ModelConfig, RopeScaling};
use crate::error::{ModelError, Result};
use crate::layers::attention::{causal_attention, check_chunks, Attention, SeqChunk};
use crate::layers::moe::MoeNames;
use crate::layers::rope::{yarn_mscale, Rope};
use crate::layers::{Linear, MlpNames, RmsNorm};

use super::shared::{dense_mlp, FamilyLoader};

/// Epsilon of the q and kv latent RMSNorms (`q_a_layernorm`, `kv_a_layernorm`): transformers
/// (like DeepSeek's own code) builds them with the norm's default, not `rms_norm_eps`.
pub(crate) const LATENT_NORM_EPS: f64 = 1e-6;

pub(crate) const LOADER: FamilyLoader = FamilyLoader {
    attention,
    moe_names,
    dense: dense_mlp,
};

/// The query path: a direct projection, or DeepSeek's low-rank `q_a -> norm -> q_b`.
pub(crate) enum QueryProjection {
    Direct(Linear),
    LowRank { a: Linear, norm: RmsNorm, b: Linear },
}

/// Multi-head latent attention. The KV cache holds the expanded per-head keys and values: on a
/// CPU host the expansion costs more than the memory it would save. It also keeps the
/// compressed rows (normalised latent, rotated shared key), which a KV export hands to an MLA
/// decode engine.
pub(crate) struct MlaAttention {
    pub(crate) query: QueryProjection,
    pub(crate) kv_a: Linear,
    pub(crate) kv_norm: RmsNorm,
    pub(crate) kv_b: Linear,
    pub(crate) o_proj: Linear,
    pub(crate) rope: Rope,
    pub(crate) dims: MlaConfig,
    pub(crate) heads: usize,
    pub(crate) scale: f64,
}

fn attention(w: &Weights, config: &ModelConfig) -> Result<Box<dyn Attention>> {
    let dims = config.mla.clone().ok_or_else(|| {
        ModelError::Input("DeepSeek-V3 config lacks the latent attention dimensions".into())
    })?;
    let w = w.pp("self_attn");
    let (hidden, heads) = (config.hidden_size, config.num_heads);
    let bias = config.attention_bias;
    let qk_head = dims.qk_nope_head_dim + dims.qk_rope_head_dim;
    let query = match dims.q_lora_rank {
        None => QueryProjection::Direct(Linear::load(
            &w.pp("q_proj"),
            hidden,
            heads * qk_head,
            false,
        )?),
        Some(rank) => QueryProjection::LowRank {
            a: Linear::load(&w.pp("q_a_proj"), hidden, rank, bias)?,
            norm: RmsNorm::load(&w.pp("q_a_layernorm"), rank, LATENT_NORM_EPS)?,
            b: Linear::load(&w.pp("q_b_proj"), rank, heads * qk_head, false)?,
        },
    };
    let scale = softmax_scale(config, &dims);
    Ok(Box::new(MlaAttention {
        query,
        kv_a: Linear::load(
            &w.pp("kv_a_proj_with_mqa"),
            hidden,
            dims.kv_lora_rank + dims.qk_rope_head_dim,
            bias,
        )?,
        kv_norm: RmsNorm::load(&w.pp("kv_a_layernorm"), dims.kv_lora_rank, LATENT_NORM_EPS)?,
        kv_b: Linear::load(
            &w.pp("kv_b_proj"),
            dims.kv_lora_rank,
            heads * (dims.qk_nope_head_dim + dims.v_head_dim),
            false,
        )?,
        o_proj: Linear::load(&w.pp("o_proj"), heads * dims.v_head_dim, hidden, bias)?,
        rope: Rope::new(&config.rope, dims.qk_rope_head_dim, dims.rope_interleave),
        dims,
        heads,
        scale,
    }))
}

/// The attention's softmax scale: the unabsorbed head width's, times YaRN's `mscale` squared
/// for a scaled RoPE (transformers' DeepseekV3 attention).
pub(crate) fn softmax_scale(config: &ModelConfig, dims: &MlaConfig) -> f64 {
    let qk_head = dims.qk_nope_head_dim + dims.qk_rope_head_dim;
    let mut scale = 1.0 / (qk_head as f64).sqrt();
    let factor = match config.rope.scaling {
        RopeScaling::None => None,
        RopeScaling::Linear { factor } | RopeScaling::Yarn { factor, .. } => Some(factor),
    };
    if let Some(factor) = factor.filter(|_| dims.mscale_all_dim != 0.0) {
        let m = yarn_mscale(factor, dims.mscale_all_dim);
        scale *= m * m;
    }
    scale
}

impl MlaAttention {
    /// `[n, heads * d]` to `[heads, n, d]`.
    fn heads_first(x: &Tensor, heads: usize) -> Result<Tensor> {
        let n = x.dim(0)?;
        Ok(x.reshape((n, heads, ()))?.transpose(0, 1)?.contiguous()?)
    }
}

impl Attention for MlaAttention {
    fn forward(&self, x: &Tensor, chunks: &mut [SeqChunk<'_>]) -> Result<Tensor> {
        check_chunks(x, chunks)?;
        if x.dim(0)? == 0 {
            return Ok(x.clone());
        }
        let d = &self.dims;
        let (nope, rot) = (d.qk_nope_head_dim, d.qk_rope_head_dim);
        let q = match &self.query {
            QueryProjection::Direct(proj) => proj.forward(x)?,
            QueryProjection::LowRank { a, norm, b } => b.forward(&norm.forward(&a.forward(x)?)?)?,
        };
        let kv = self.kv_a.forward(x)?;
        let latent = self
            .kv_norm
            .forward(&kv.narrow(D::Minus1, 0, d.kv_lora_rank)?)?;
        let k_rot = kv.narrow(D::Minus1, d.kv_lora_rank, rot)?;
        let kv = self.kv_b.forward(&latent)?;
        let mut outputs = Vec::with_capacity(chunks.len());
        let mut row = 0;
        for chunk in chunks.iter_mut() {
            let (n, start) = (chunk.len, chunk.cache.len());
            if n == 0 {
                continue;
            }
            let q = Self::heads_first(&q.narrow(0, row, n)?, self.heads)?;
            let q_rot = self.rope.apply(&q.narrow(2, nope, rot)?, start)?;
            let q = Tensor::cat(&[&q.narrow(2, 0, nope)?, &q_rot], 2)?;
            let k_rot = self
                .rope
                .apply(&k_rot.narrow(0, row, n)?.unsqueeze(0)?, start)?;
            let kv = Self::heads_first(&kv.narrow(0, row, n)?, self.heads)?;
            let k_nope = kv.narrow(2, 0, nope)?;
            let values = kv.narrow(2, nope, d.v_head_dim)?.contiguous()?;
            let compressed = Tensor::cat(&[&latent.narrow(0, row, n)?, &k_rot.squeeze(0)?], 1)?;
            let k_rot = k_rot.broadcast_as((self.heads, n, rot))?;
            let keys = Tensor::cat(&[&k_nope, &k_rot], 2)?;
            let (keys, values) = chunk.cache.append(keys, values)?;
            chunk.cache.append_latent(compressed)?;
            outputs.push(causal_attention(&q, &keys, &values, self.scale)?);
            row += n;
        }
        Ok(self.o_proj.forward(&Tensor::cat(&outputs, 0)?)?)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// `mlp.gate` (with `e_score_correction_bias`), `mlp.experts.*`, `mlp.shared_experts`.
fn moe_names<'a>(w: &Weights<'a>) -> (Weights<'a>, MoeNames) {
    let names = MoeNames {
        experts: MlpNames::HF,
        shared: "shared_experts",
        shared_gate: "shared_experts_gate",
    };
    (w.pp("mlp"), names)
}
