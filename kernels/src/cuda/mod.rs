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
//! - [`bench`]: the GPU measurements of `rackfill kernels bench`.
//!
//! Nothing here panics on a machine without CUDA: every library is located (see [`libs`]) and
//! every first driver call is guarded before cudarc, which panics on a missing library, is
//! used. [`probe`] answers "is there a usable GPU?" with a typed error when there is not.

pub mod bench;
mod exchange;
pub mod gemm;
mod libs;
pub mod moe;
pub mod nvrtc;
pub mod permute;
mod probe;
pub mod replicate;
pub mod solver;
pub mod tile_plan;
pub mod tiles;

pub use libs::LIB_DIR_ENV;
pub use probe::{probe, DeviceInfo, Gpu};

use crate::KernelError;
use rackfill_balancer::{BalanceError, PlanViolation};

/// Why no GPU can be used (the server logs this and runs on the CPU).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaUnavailable {
    #[error("the CUDA driver library was not found (searched {searched})")]
    NoDriver { searched: String },
    #[error("the CUDA driver failed to initialise: {0}")]
    Init(String),
    #[error("no CUDA device is visible")]
    NoDevice,
    #[error("CUDA device {ordinal} does not exist ({count} visible)")]
    NoSuchDevice { ordinal: usize, count: usize },
    #[error("the CUDA driver library is unusable: {0}")]
    Broken(String),
}

/// Why NVRTC cannot compile anything.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NvrtcUnavailable {
    #[error(
        "NVRTC was not found: install it with `pip install nvidia-cuda-nvrtc` and set \
         {LIB_DIR_ENV} (or LD_LIBRARY_PATH) to its site-packages/nvidia/cu13/lib \
         (searched {searched})"
    )]
    NotFound { searched: String },
    #[error("NVRTC is unusable: {0}")]
    Broken(String),
    #[error("'{arch}' is not a GPU architecture NVRTC targets (expected e.g. sm_90 or sm_100)")]
    BadArch { arch: String },
}

/// Anything that can go wrong on the GPU path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    #[error(transparent)]
    Unavailable(#[from] CudaUnavailable),
    #[error(transparent)]
    Compile(#[from] nvrtc::CompileFailure),
    #[error(
        "the CUDA driver supports CUDA {driver}; rackfill needs a CUDA {needed} driver or newer \
         (its driver bindings are CUDA 13's, and NVRTC {nvrtc} compiles the kernels): upgrade \
         the driver"
    )]
    DriverTooOld {
        driver: String,
        needed: String,
        nvrtc: String,
    },
    #[error("CUDA driver call failed: {0}")]
    Driver(String),
    #[error("cuBLAS failed: {0}")]
    Blas(String),
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error(transparent)]
    Balance(#[from] BalanceError),
    #[error("the GPU plan breaks an invariant: {0}")]
    Plan(#[from] PlanViolation),
    #[error("the quota solver kernel stopped with error code {0}")]
    Solver(u64),
    #[error("the device relay planner planned nothing: {0}")]
    TilePlan(#[from] tile_plan::TilePlanFault),
    #[error(
        "MoE layer {layer}: the tile stream built on the device differs from the host compiler's"
    )]
    TileMismatch { layer: usize },
    #[error("{what} needs {needed} bytes of shared memory per block, the device allows {limit}")]
    SharedMemory {
        what: &'static str,
        needed: usize,
        limit: usize,
    },
    #[error("rank {rank}: the {what} buffer has {len} bytes, the tasks need {needed}")]
    BufferTooSmall {
        what: &'static str,
        rank: usize,
        len: u64,
        needed: u64,
    },
    #[error(
        "replica streaming stalled: a relay chunk never became ready (a broken tile stream); \
         the slots of this layer cannot be trusted"
    )]
    TileStreamStalled,
    #[error("tile task {task}: {reason}")]
    UnrunnableTask { task: usize, reason: String },
    #[error("{what}: the device reported {count} out-of-range entries")]
    DeviceInput { what: &'static str, count: u32 },
}

impl From<cudarc::driver::DriverError> for CudaError {
    fn from(err: cudarc::driver::DriverError) -> Self {
        CudaError::Driver(err.to_string())
    }
}

/// Runs `f`, turning a panic inside cudarc (a library or entry point that could not be loaded)
/// into an error message. cudarc panics instead of returning errors in exactly those cases.
pub(crate) fn guard<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|payload| {
        payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a CUDA library call panicked".to_string())
    })
}

/// `n` as `u32`, or an overflow error naming it (device kernels index with 32-bit integers).
pub(crate) fn to_u32(n: usize, what: &'static str) -> Result<u32, KernelError> {
    u32::try_from(n).map_err(|_| KernelError::Overflow { what })
}
