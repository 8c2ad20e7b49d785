//! The device side (feature `cuda`): CUDA C kernels compiled at run time by NVRTC, run by an
//! [`exec::Executor`]: a GPU (the driver API and cuBLAS through cudarc, which nothing outside
//! `exec` and the probe touches), or the host emulator that runs the same sources on the CPU.
//!
//! - [`exec`]: the executor interface (memory, streams, events, launches by name, GEMMs), the
//!   GPU and the emulator behind it;
//! - [`moe`]: one MoE layer's EP data plane in bf16 on an executor (count, plan, replicas,
//!   dispatch, experts, combine), in lanes for micro-batches in flight together;
//! - [`solver`]: the quota solver (UltraEP §5.3), one cooperative thread block that reproduces
//!   [`rackfill_balancer::quota::QuotaPlanner`]'s plan bit for bit, outputs left on the device
//!   for the token permute and the relay planner;
//! - [`grouped_gemm`]: the routed experts' MLPs over rows grouped by instance, every group of
//!   a layer in one tensor-core launch of each half (the data plane and the whole-model path);
//!   [`local_experts`]: a layer whose experts are all local, its rows grouped on the device;
//! - [`tile_plan`] + [`replicate`]: replica weight distribution (§6): the relay trees and tile
//!   tasks built on the device from the plan, streamed by a persistent kernel with per-chunk
//!   ready flags; [`tiles`] compiles any host relay schedule to the same tasks (the reference);
//! - [`nccl`]: NCCL loaded at run time (probe, communicator, all-gather and grouped send/recv),
//!   what the engine's NCCL fabric moves bytes between GPUs with;
//! - [`bench`]: the GPU measurements of `rackfill kernels bench`; [`peak`]: the cards' dense
//!   bf16 peaks the benchmarks' fractions divide by;
//! - `device_plan`: a plan in the flat form the device reads ([`PlanArrays`], [`DevicePlan`]),
//!   written by the solver and read by the permute and the relay planner; `error`: every error
//!   type of the GPU path.
//!
//! Nothing here panics on a machine without CUDA: every library is located (see [`libs`]) and
//! every first driver call is guarded before cudarc, which panics on a missing library, is
//! used. [`probe`] answers "is there a usable GPU?" with a typed error when there is not.

pub mod bench;
mod device_plan;
mod error;
pub mod exec;
pub mod grouped_gemm;
mod landed;
mod libs;
pub mod local_experts;
pub mod moe;
pub mod nccl;
pub mod nvrtc;
pub mod peak;
mod probe;
mod ranking;
pub mod replicate;
pub mod solver;
pub mod tile_plan;
pub mod tiles;

pub use device_plan::{instance_offsets, DevicePlan, PlanArrays};
pub(crate) use error::to_u32;
pub use error::{CudaError, CudaUnavailable, TilePlanFault};
pub(crate) use libs::guard;
pub use libs::LIB_DIR_ENV;
pub use nvrtc::NvrtcUnavailable;
pub(crate) use probe::Gpu;
pub use probe::{probe, DeviceInfo};
