//! Is NCCL usable in this process? The one line `--fabric auto|nccl` and `rackfill kernels
//! probe` report.

pub use rackfill_kernels::cuda::nccl::NcclInfo;
use rackfill_kernels::cuda::nccl::{probe, NcclError};

/// Loads libnccl (once per process) and reads its version. Needs no GPU and never panics: a host
/// without NCCL gets one line, e.g. "NCCL not available: libnccl.so.2 not found (searched ...;
/// install the NCCL runtime, e.g. libnccl2 or the nvidia-nccl-cu13 wheel, or use --fabric mpi)".
pub fn probe_nccl() -> Result<NcclInfo, String> {
    probe().map_err(|e| match e {
        NcclError::Unavailable(_) => e.to_string(),
        other => format!("NCCL not available: {other}"),
    })
}
