//! Mixtral (`MixtralForCausalLM`): GQA, every layer sparse, softmax top-k router renormalised
//! over the chosen experts, experts named `w1` (gate), `w3` (up), `w2` (down) under
//! `block_sparse_moe` (hub checkpoints) or `mlp` (newer transformers module naming).

use crate::checkpoint::Weights;
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::layers::moe::MoeNames;
use crate::layers::{Mlp, MlpNames};

use super::shared::{gqa_attention, FamilyLoader};

pub(crate) const LOADER: FamilyLoader = FamilyLoader {
    attention: gqa_attention,
    moe_names,
    dense,
};

/// The MoE block under whichever prefix the checkpoint uses, its experts' `w1` / `w3` / `w2`
/// (no shared expert: the config has none).
fn moe_names<'a>(w: &Weights<'a>) -> (Weights<'a>, MoeNames) {
    let block = if w.contains("block_sparse_moe.gate.weight") {
        w.pp("block_sparse_moe")
    } else {
        w.pp("mlp")
    };
    let names = MoeNames {
        experts: MlpNames::MIXTRAL,
        shared: "shared_expert",
        shared_gate: "shared_expert_gate",
    };
    (block, names)
}

/// Mixtral has no dense layers; the config marks every layer sparse, so this never runs.
fn dense(_: &Weights, _: &ModelConfig) -> Result<Mlp> {
    Err(ModelError::Input("Mixtral has no dense MLP layers".into()))
}
