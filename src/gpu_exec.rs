//! Opening the executor a benchmark's GPU path runs on: GPU N for `--device cuda[:N]`, the host
//! emulator for `--device emulator`.

use rackfill_engine::ModelDevice;

/// The executor for `device` (not `cpu`: the caller runs the CPU path itself).
#[cfg(feature = "cuda")]
pub(crate) fn open_executor(
    device: ModelDevice,
) -> anyhow::Result<std::sync::Arc<dyn rackfill_kernels::cuda::exec::Executor>> {
    use rackfill_kernels::cuda::exec::{Emulator, GpuExecutor};
    match device {
        ModelDevice::Cpu => anyhow::bail!("--device cpu has no GPU path to open"),
        ModelDevice::Emulator => Emulator::shared()
            .map(|e| e as _)
            .ok_or_else(|| anyhow::anyhow!("--device emulator needs a C++ compiler (CXX)")),
        cuda => {
            let ordinal = cuda.gpu_ordinal(None).unwrap_or(0);
            Ok(std::sync::Arc::new(GpuExecutor::open(ordinal).map_err(
                |e| anyhow::anyhow!("--device cuda:{ordinal}: {e}"),
            )?))
        }
    }
}
