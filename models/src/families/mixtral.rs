//! Mixtral (`MixtralForCausalLM`): GQA, every layer sparse, softmax top-k router renormalised
//! over the chosen experts, experts named `w1` (gate), `w3` (up), `w2` (down) under
//! `block_sparse_moe` (hub checkpoints) or `mlp` (newer transformers module naming).

use crate::checkpoint::Weights;
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::expert_selection::ExpertSelection;
use crate::layers::experts::load_experts;
use crate::layers::moe::MoeBlock;
use crate::layers::router::Router;
use crate::layers::{Mlp, MlpNames};

use super::shared::{gqa_attention, FamilyLoader};

pub(crate) const LOADER: FamilyLoader = FamilyLoader {
    attention: gqa_attention,
    moe,
    dense,
};

/// The MoE block under whichever prefix the checkpoint uses.
fn moe(w: &Weights, config: &ModelConfig, selection: &ExpertSelection) -> Result<MoeBlock> {
    let block = if w.contains("block_sparse_moe.gate.weight") {
        w.pp("block_sparse_moe")
    } else {
        w.pp("mlp")
    };
    let router = Router::load(&block.pp("gate"), config.hidden_size, &config.moe)?;
    let experts = load_experts(&block.pp("experts"), config, MlpNames::MIXTRAL, selection)?;
    Ok(MoeBlock::new(router, experts, None))
}

/// Mixtral has no dense layers; the config marks every layer sparse, so this never runs.
fn dense(_: &Weights, _: &ModelConfig) -> Result<Mlp> {
    Err(ModelError::Input("Mixtral has no dense MLP layers".into()))
}
