//! Qwen3-MoE (`Qwen3MoeForCausalLM`): GQA with per-head q/k RMSNorm, softmax top-k router with
//! optional renormalisation (`norm_topk_prob`), dense MLP layers per `mlp_only_layers` /
//! `decoder_sparse_step`, no shared expert.

use crate::checkpoint::Weights;
use crate::layers::moe::MoeNames;
use crate::layers::MlpNames;

use super::shared::{dense_mlp, gqa_attention, FamilyLoader};

pub(crate) const LOADER: FamilyLoader = FamilyLoader {
    attention: gqa_attention,
    moe_names,
    dense: dense_mlp,
};

/// `mlp.gate` and `mlp.experts.*` (no shared expert: the config has none).
fn moe_names<'a>(w: &Weights<'a>) -> (Weights<'a>, MoeNames) {
    let names = MoeNames {
        experts: MlpNames::HF,
        shared: "shared_expert",
        shared_gate: "shared_expert_gate",
    };
    (w.pp("mlp"), names)
}
