//! Every error of the GPU path, in one place: what is unavailable, what a driver, cuBLAS or
//! kernel call reported, and what a kernel refused. The files that raise them depend on this one,
//! never the other way round (the NVRTC errors live with the compiler, which needs no other part).

use super::nvrtc;
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
    Attention(#[from] crate::kv_blocks::PagedError),
    #[error(transparent)]
    Balance(#[from] BalanceError),
    #[error("the GPU plan breaks an invariant: {0}")]
    Plan(#[from] PlanViolation),
    #[error("the quota solver kernel stopped with error code {0}")]
    Solver(u64),
    #[error("the device relay planner planned nothing: {0}")]
    TilePlan(#[from] TilePlanFault),
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
    #[error(
        "rank {rank} waited {waited_ms} ms for rank {peer}'s {stage} through peer memory: rank \
         {peer} stalled or died, and the layer's rows cannot be trusted"
    )]
    PeerStalled {
        rank: usize,
        peer: usize,
        stage: &'static str,
        waited_ms: u64,
    },
    #[error("MoE layer {layer}: {stage} before its experts ran")]
    StageOrder { layer: usize, stage: &'static str },
    #[error("tile task {task}: {reason}")]
    UnrunnableTask { task: usize, reason: String },
    #[error("{0}")]
    Exec(String),
    #[error("{what}: the device reported {count} out-of-range entries")]
    DeviceInput { what: &'static str, count: u32 },
}

impl From<cudarc::driver::DriverError> for CudaError {
    fn from(err: cudarc::driver::DriverError) -> Self {
        CudaError::Driver(err.to_string())
    }
}

/// Why `plan_tiles` planned nothing (its status codes); no replica byte moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TilePlanFault {
    #[error("the quota solver reported an error, so there is no plan to distribute")]
    Solver,
    #[error("the plan in device memory is malformed (instance offsets, ranks or slots)")]
    Plan,
    #[error("the plan needs more tile tasks than the planner was sized for")]
    Tasks,
    #[error("the plan needs more tile destinations than the planner was sized for")]
    Destinations,
    #[error("a relay needs more ready counters than each rank has")]
    Flags,
    #[error("unknown status {0}")]
    Unknown(u32),
}

impl TilePlanFault {
    /// The fault for a nonzero status word of the kernel.
    pub fn from_status(status: u32) -> Self {
        match status {
            1 => Self::Solver,
            2 => Self::Plan,
            3 => Self::Tasks,
            4 => Self::Destinations,
            5 => Self::Flags,
            other => Self::Unknown(other),
        }
    }
}

/// `n` as `u32`, or an overflow error naming it (device kernels index with 32-bit integers).
pub(crate) fn to_u32(n: usize, what: &'static str) -> Result<u32, KernelError> {
    u32::try_from(n).map_err(|_| KernelError::Overflow { what })
}
