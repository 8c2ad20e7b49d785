//! Qwen3-MoE (`Qwen3MoeForCausalLM`): GQA with per-head q/k RMSNorm, softmax top-k router with
//! optional renormalisation (`norm_topk_prob`), dense MLP layers per `mlp_only_layers` /
//! `decoder_sparse_step`, no shared expert.

use crate::checkpoint::Weights;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::expert_selection::ExpertSelection;
use crate::layers::experts::load_experts;
use crate::layers::moe::MoeBlock;
use crate::layers::router::Router;
use crate::layers::MlpNames;

use super::shared::{dense_mlp, gqa_attention, FamilyLoader};

pub(crate) const LOADER: FamilyLoader = FamilyLoader {
    attention: gqa_attention,
    moe,
    dense: dense_mlp,
};

/// `mlp.gate` and the selected `mlp.experts.*`.
fn moe(w: &Weights, config: &ModelConfig, selection: &ExpertSelection) -> Result<MoeBlock> {
    let w = w.pp("mlp");
    let router = Router::load(&w.pp("gate"), config.hidden_size, &config.moe)?;
    let experts = load_experts(&w.pp("experts"), config, MlpNames::HF, selection)?;
    Ok(MoeBlock::new(router, experts, None))
}
