//! Every executor this machine runs, for the tests of the whole-model path.

use std::sync::{Arc, OnceLock};

use super::super::{CudaError, CudaUnavailable};
use super::emulated::Emulator;
use super::executor::Executor;
use super::gpu::GpuExecutor;

/// Environment variable: `1` makes [`available`] fail where GPU 0 cannot be opened (the GPU
/// session's test runs, where a silent skip would hide a broken GPU path).
pub const REQUIRE_GPU_ENV: &str = "RACKFILL_REQUIRE_GPU";

/// Every executor this machine runs, each opened once per process: the host emulator (given a
/// C++ compiler) and GPU 0 (given one). What the whole-model tests check their code on; a
/// missing one is skipped with a line saying why, unless [`REQUIRE_GPU_ENV`] is `1`.
pub fn available() -> Vec<Arc<dyn Executor>> {
    static GPU: OnceLock<Option<Arc<GpuExecutor>>> = OnceLock::new();
    let gpu = GPU.get_or_init(|| {
        let required = std::env::var(REQUIRE_GPU_ENV).is_ok_and(|v| v == "1");
        let opened = GpuExecutor::open(0);
        match opened {
            Ok(gpu) => Some(Arc::new(gpu)),
            Err(why) if required => panic!("{REQUIRE_GPU_ENV}=1 but GPU 0 is unusable: {why}"),
            Err(CudaError::Unavailable(
                why @ (CudaUnavailable::NoDriver { .. } | CudaUnavailable::NoDevice),
            )) => {
                eprintln!("GPU skipped: {why}");
                None
            }
            Err(why) => panic!("GPU 0 exists but the whole-model path cannot use it: {why}"),
        }
    });
    let mut all: Vec<Arc<dyn Executor>> = Vec::new();
    all.extend(Emulator::shared().map(|e| e as Arc<dyn Executor>));
    all.extend(gpu.clone().map(|g| g as Arc<dyn Executor>));
    all
}
