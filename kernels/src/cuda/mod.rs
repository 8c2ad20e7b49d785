//! The GPU data plane (feature `cuda`): CUDA C kernels compiled at run time by NVRTC, launched
//! through the CUDA driver API (cudarc), with cuBLAS for the grouped expert GEMMs.
//!
//! - [`solver`]: the quota solver (UltraEP §5.3), one cooperative thread block that reproduces
//!   [`rackfill_balancer::quota::QuotaPlanner`]'s plan bit for bit, outputs left on the device
//!   for the token permute;
//! - [`tile_plan`] + [`replicate`]: replica weight distribution (§6): the relay trees and tile
//!   tasks built on the device from the plan, streamed by a persistent kernel with per-chunk
//!   ready flags; [`tiles`] compiles any host relay schedule to the same tasks (the reference);
//! - [`permute`]: token permute by physical instance, grouping per expert instance, return and
//!   weighted combine (§5.2), each bitwise equal to the CPU reference in [`crate::permute`];
//! - [`gemm`]: grouped expert GEMM over main and replica experts with cuBLAS;
//! - [`moe`]: all of the above as one MoE layer's data plane for ranks sharing a GPU (what the
//!   engine runs on a GPU host);
//! - [`device_moe`]: the same layer in bf16 on an [`exec::Executor`], fed by the GPU model's
//!   router where it left its output (the whole-model path at EP > 1; runs on the emulator);
//! - [`nccl`]: NCCL loaded at run time (probe, communicator, all-gather and grouped send/recv),
//!   what the engine's NCCL fabric moves bytes between GPUs with;
//! - [`exec`]: one executor interface for the whole-model kernels, run on the GPU or, without
//!   one, on the host emulator;
//! - [`bench`]: the GPU measurements of `rackfill kernels bench`;
//! - `device_plan`: a plan in the flat form the device reads ([`PlanArrays`], [`DevicePlan`]),
//!   written by the solver and read by the permute and the relay planner; `error`: every error
//!   type of the GPU path.
//!
//! Nothing here panics on a machine without CUDA: every library is located (see [`libs`]) and
//! every first driver call is guarded before cudarc, which panics on a missing library, is
//! used. [`probe`] answers "is there a usable GPU?" with a typed error when there is not.

pub mod bench;
pub mod device_moe;
mod device_plan;
mod error;
mod exchange;
pub mod exec;
pub mod gemm;
mod home_weights;
mod libs;
pub mod moe;
pub mod nccl;
pub mod nvrtc;
pub mod permute;
mod probe;
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
pub use probe::{probe, DeviceInfo, Gpu};
