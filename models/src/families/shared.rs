//! What the family files share: the per-family table of layer constructors ([`FamilyLoader`])
//! and the loaders for parts that several families name alike (GQA attention under
//! `self_attn`, the dense gated MLP under `mlp`).

use crate::checkpoint::Weights;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::layers::attention::{Attention, GqaAttention};
use crate::layers::moe::MoeNames;
use crate::layers::{Mlp, MlpNames};

/// The per-family constructors of a layer's parts; each family file provides one.
pub(crate) struct FamilyLoader {
    pub attention: fn(&Weights, &ModelConfig) -> Result<Box<dyn Attention>>,
    /// Where a layer's MoE block is (below the layer's weights) and what its parts are called:
    /// what both the CPU loader ([`crate::layers::moe::MoeBlock::load`]) and the GPU loader
    /// read.
    pub moe_names: for<'a> fn(&Weights<'a>) -> (Weights<'a>, MoeNames),
    pub dense: fn(&Weights, &ModelConfig) -> Result<Mlp>,
}

/// GQA attention under `self_attn.*` (q/k norm presence comes from the config): Qwen3-MoE,
/// Qwen2-MoE (with q/k/v bias) and Mixtral.
pub(crate) fn gqa_attention(w: &Weights, config: &ModelConfig) -> Result<Box<dyn Attention>> {
    Ok(Box::new(GqaAttention::load(&w.pp("self_attn"), config)?))
}

/// The dense gated MLP `mlp.{gate,up,down}_proj` of width `intermediate_size`: Qwen's
/// `mlp_only_layers` and DeepSeek's first layers.
pub(crate) fn dense_mlp(w: &Weights, config: &ModelConfig) -> Result<Mlp> {
    Mlp::load(
        &w.pp("mlp"),
        config.hidden_size,
        config.intermediate_size,
        MlpNames::HF,
    )
}
