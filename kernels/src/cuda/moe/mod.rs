//! A whole MoE layer's data plane on the GPU, for `R` ranks whose buffers all live on one device:
//! what the engine runs on a GPU host instead of its CPU data plane (docs/architecture.md, "One
//! MoE layer of one step").
//!
//! Per layer, after the plan is known (solved here by [`crate::cuda::solver::GpuQuotaSolver`], or by any host
//! balancer and uploaded):
//!
//! 1. replica weights, on the replica stream: the relay trees and tile tasks built on the device
//!    from the plan ([`crate::cuda::tile_plan`]) and streamed by the persistent kernel from the home
//!    weights into every rank's redundant slots ([`crate::cuda::replicate`]). With the device solver,
//!    solve, relay planning and streaming are queued back to back ([`GpuMoe::solve_layer`]): the
//!    host's copy of the plan is downloaded on a side stream while the replicas stream;
//! 2. token permute by cumulative quotas on every source rank ([`crate::cuda::permute`]);
//! 3. dispatch: each destination's segments copied device to device into its receive buffer,
//!    sender after sender (the all-to-all of ranks sharing one GPU);
//! 4. grouping by expert instance, the gate-up grouped GEMM, `silu(gate) * up`, the down grouped
//!    GEMM (cuBLAS; main experts read the home weights, replicas their slot). With pipelined
//!    experts steps 2-4 of the main experts run while the replicas stream, and each replica
//!    instance's GEMMs wait only for their own slot: `tile_stream` counts the bytes landed per
//!    slot, and a one-thread `wait_slot` kernel holds the main stream until the slot is whole;
//! 5. return: outputs back to received order and copied into each source's send layout;
//! 6. the weighted combine in top-k order, downloaded for the shared experts and the residual.
//!
//! Every expert's weights are uploaded once when the plane is built: per rank, its main
//! experts of every MoE layer, layer after layer, each as the engine stores it (`[H, 2I]`
//! gate-up then `[I, H]` down, row-major f32). The slots are shared by all layers, as on a rack.
//!
//! The layer runs in three stages (`layer.rs`) that queue their work without waiting on the host
//! in between. A second lane ([`GpuMoe::another_lane`]: its own streams, slots, tile planner and
//! cuBLAS handle over the same home weights) lets two micro-batches be in flight together, each
//! on its own streams.

mod layer;
mod plane;

pub use layer::LayerInFlight;
pub use plane::{ExpertWeights, GpuMoe, GpuPhases, LayerRun, RankInput};
