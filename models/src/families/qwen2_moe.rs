//! Qwen2-MoE (`Qwen2MoeForCausalLM`): GQA with q/k/v bias, softmax top-k router, and a shared
//! expert whose output is scaled by `sigmoid(shared_expert_gate(x))`.

use crate::checkpoint::Weights;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::layers::moe::{load_experts, MoeBlock, SharedExpert};
use crate::layers::router::Router;
use crate::layers::MlpNames;
use crate::model::FamilyLoader;

use super::qwen3_moe;

pub(crate) const LOADER: FamilyLoader = FamilyLoader {
    attention: qwen3_moe::attention,
    moe,
    dense: qwen3_moe::dense,
};

/// `mlp.gate`, `mlp.experts.*`, `mlp.shared_expert.*` and `mlp.shared_expert_gate`.
fn moe(w: &Weights, config: &ModelConfig) -> Result<MoeBlock> {
    let w = w.pp("mlp");
    let router = Router::load(&w.pp("gate"), config.hidden_size, &config.moe)?;
    let experts = load_experts(&w.pp("experts"), config, MlpNames::HF)?;
    let shared = config
        .moe
        .shared
        .as_ref()
        .map(|shared| {
            SharedExpert::load(
                &w.pp("shared_expert"),
                &w.pp("shared_expert_gate"),
                config.hidden_size,
                shared,
            )
        })
        .transpose()?;
    Ok(MoeBlock::new(router, experts, shared))
}
