//! The whole model on a GPU, per rank: bf16 weights on the device ([`weights`], loaded straight
//! from the checkpoint by [`GpuModel::load`]), the dense layer kernels, paged attention over a
//! device KV cache and the MoE layer ([`forward`]), run through an [`Executor`]: the GPU itself,
//! or the host emulator that checks this very code against the CPU model on machines without
//! one.
//!
//! Two uses: [`GpuModel::forward`] runs everything on the device with every routed expert local
//! (the dense reference, one rank); an EP runtime drives the layers itself
//! ([`GpuModel::begin`], [`GpuModel::attention`], [`GpuModel::finish`]) and runs the MoE layers
//! on its data plane, so the model is loaded without routed experts ([`Experts::Elsewhere`];
//! [`ExpertPlacement::Homes`] fills the data plane's home experts instead):
//! the plane takes the router's output where it is ([`GpuModel::route`]) and adds the routed
//! experts' sum into the block's output ([`GpuModel::add_routed`]).
//!
//! Precision: weights, GEMM inputs and the KV cache are bf16; GEMMs accumulate in f32 and write
//! f32; attention runs on tensor cores (bf16 queries, keys, values and probabilities, f32 scores,
//! softmax statistics and accumulators); the residual stream, norms' arithmetic, RoPE, the routers
//! (weights kept in f32, so selection does not flip on a rounding) and the logits are f32.

mod attention;
mod attention_bench;
mod forward;
mod load;
mod model;
mod ops;
pub mod phases;
mod weights;

pub use attention_bench::{bench_attention, AttentionCase, AttentionTiming, FlashTiming};
pub use forward::GpuBatch;
pub use load::ExpertPlacement;
pub use model::{GpuInput, GpuModel, GpuSequence, GpuStep, BLOCK_TOKENS};
pub use weights::Experts;
