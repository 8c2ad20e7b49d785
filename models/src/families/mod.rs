//! One file per model family: how its checkpoint names map onto the shared building blocks,
//! plus whatever is unique to it (DeepSeek's latent attention, Qwen2-MoE's gated shared expert).

pub mod deepseek_v3;
pub mod mixtral;
pub mod qwen2_moe;
pub mod qwen3_moe;
