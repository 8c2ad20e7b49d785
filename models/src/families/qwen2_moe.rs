//! Qwen2-MoE (`Qwen2MoeForCausalLM`): GQA with q/k/v bias, softmax top-k router, and a shared
//! expert whose output is scaled by `sigmoid(shared_expert_gate(x))`.

use crate::checkpoint::Weights;
use crate::layers::moe::MoeNames;
use crate::layers::MlpNames;

use super::shared::{dense_mlp, gqa_attention, FamilyLoader};

pub(crate) const LOADER: FamilyLoader = FamilyLoader {
    attention: gqa_attention,
    moe_names,
    dense: dense_mlp,
};

/// `mlp.gate`, `mlp.experts.*`, `mlp.shared_expert.*` and `mlp.shared_expert_gate`.
fn moe_names<'a>(w: &Weights<'a>) -> (Weights<'a>, MoeNames) {
    let names = MoeNames {
        experts: MlpNames::HF,
        shared: "shared_expert",
        shared_gate: "shared_expert_gate",
    };
    (w.pp("mlp"), names)
}
