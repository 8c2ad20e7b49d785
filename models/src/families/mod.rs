//! One file per model family: how its checkpoint names map onto the shared building blocks,
//! plus whatever is unique to it (DeepSeek's latent attention, Qwen2-MoE's gated shared expert).
//! `loader` picks a family's constructors; `shared` holds the loaders several families use.

pub mod deepseek_v3;
pub mod mixtral;
pub mod qwen2_moe;
pub mod qwen3_moe;
pub(crate) mod shared;

pub(crate) use shared::FamilyLoader;

use crate::config::Family;

/// The constructors of a layer's parts for `family`.
pub(crate) fn loader(family: Family) -> FamilyLoader {
    match family {
        Family::Qwen3Moe => qwen3_moe::LOADER,
        Family::Qwen2Moe => qwen2_moe::LOADER,
        Family::Mixtral => mixtral::LOADER,
        Family::DeepseekV3 => deepseek_v3::LOADER,
    }
}
