//! Running the kernels: one [`Executor`] interface with two implementations, the GPU
//! ([`GpuExecutor`]: NVRTC-compiled kernels through the driver API, cuBLAS for GEMMs, streams and
//! events) and the host emulator ([`Emulator`]: the same CUDA C sources compiled as C++ and run
//! on the CPU, a reference GEMM in the same library). Code written against [`Executor`] (the GPU model in
//! `rackfill-models`, the MoE data plane in [`super::moe`]) therefore runs unchanged, and is
//! checked, on machines without a GPU. cudarc's types appear only beneath it.
//!
//! Memory is raw: a [`DeviceBuffer`] is a device address and a length, kernels take
//! [`KernelArg`]s exactly as `cuLaunchKernel` takes parameters, and GEMMs are described by
//! addresses and strides ([`Gemm`]). That is why [`Executor::launch`] and [`Executor::gemm`] are
//! `unsafe`: the caller vouches that the arguments match the kernel and the buffers are large
//! enough, as with any CUDA launch. [`Profiled`] wraps either and files the device time of what
//! it queues under phases.

mod available;
mod emulated;
mod executor;
mod gpu;
mod gpu_shared;
mod host_memory;
mod profiled;
mod shared;

pub use available::{available, REQUIRE_GPU_ENV};
pub use emulated::{Emulator, EmulatorSettings, EmulatorUnavailable};
pub use executor::{
    bf16_to_f32, f32_to_bf16, round_bf16, DType, DeviceBuffer, Event, Executor, ExecutorExt, Gemm,
    KernelArg, KernelParams, Launch, MatrixRef, ParamBytes, Stream, WeightLayout,
};
pub use gpu::GpuExecutor;
pub use profiled::{Classifier, Profiled, COPY, GEMM};
pub use shared::SharedHandle;
