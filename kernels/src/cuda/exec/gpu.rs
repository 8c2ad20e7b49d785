//! The GPU as an [`Executor`]: kernels from the sources [`Gpu::open`] compiled and loaded,
//! launched by name through `cuLaunchKernel`; GEMMs with cuBLAS in bf16 or f32 with f32
//! accumulation (`cublasGemmStridedBatchedEx`); streams forked from the GPU's own, each with its
//! own cuBLAS handle; events with timing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::CudaBlas;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaStream, DevicePtr};

use super::executor::{
    DType, DeviceBuffer, Event, EventInner, Executor, Gemm, KernelArg, Launch, Owner, PackedArgs,
    Stream, WeightLayout,
};
use super::gpu_shared;
use super::shared::{Decoded, SharedHandle};
use crate::cuda::libs::{self, Lib};
use crate::cuda::{CudaError, Gpu};

/// Kernels and GEMMs on one GPU.
pub struct GpuExecutor {
    gpu: Gpu,
    /// Indexed by [`Stream`]: the GPU's own stream first.
    streams: Mutex<Vec<Lane>>,
    /// Bytes written from the host so far.
    uploaded: AtomicU64,
    /// Peer memory by FABRIC handles (usable here: an NVLink domain with IMEX), else CUDA IPC.
    fabric: bool,
}

/// One stream and the cuBLAS handle bound to it.
struct Lane {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
}

impl Lane {
    fn new(stream: Arc<CudaStream>) -> Result<Self, CudaError> {
        let blas = open_blas(&stream)?;
        Ok(Self { stream, blas })
    }
}

impl GpuExecutor {
    /// Binds cuBLAS (a typed error when it is missing) to the opened GPU's stream.
    fn new(gpu: Gpu) -> Result<Self, CudaError> {
        let main = Lane::new(Arc::clone(gpu.stream()))?;
        gpu.context().bind_to_thread()?;
        let fabric = gpu_shared::fabric_usable(gpu.context(), gpu.info().ordinal);
        Ok(Self {
            gpu,
            streams: Mutex::new(vec![main]),
            uploaded: AtomicU64::new(0),
            fabric,
        })
    }

    /// Opens GPU `ordinal` (compiling every kernel for it) as an executor.
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        Self::new(Gpu::open(ordinal)?)
    }

    /// What the probe found about the GPU.
    pub fn info(&self) -> &crate::cuda::DeviceInfo {
        self.gpu.info()
    }

    /// Makes the device's context current on the calling thread: the raw driver and cuBLAS
    /// calls below need it, and the engine calls from its own thread, not the one that opened
    /// the GPU (cudarc's own calls bind it themselves).
    fn bind(&self) -> Result<(), CudaError> {
        Ok(self.gpu.context().bind_to_thread()?)
    }

    /// Runs `f` with `stream`'s lane, the context bound.
    fn on<R>(
        &self,
        stream: Stream,
        f: impl FnOnce(&Lane) -> Result<R, CudaError>,
    ) -> Result<R, CudaError> {
        self.bind()?;
        let lanes = self.streams.lock().unwrap_or_else(|e| e.into_inner());
        let lane = lanes
            .get(stream.0)
            .ok_or_else(|| CudaError::Exec(format!("{stream:?} was not made by this executor")))?;
        f(lane)
    }
}

/// cuBLAS, located first (a typed error when it is missing, never cudarc's panic), bound to
/// `stream`.
fn open_blas(stream: &Arc<CudaStream>) -> Result<CudaBlas, CudaError> {
    libs::ensure(Lib::Cublas).map_err(|searched| {
        CudaError::Blas(format!(
            "libcublas was not found (`pip install nvidia-cublas`; searched {searched})"
        ))
    })?;
    let stream = Arc::clone(stream);
    libs::guard(|| CudaBlas::new(stream))
        .map_err(CudaError::Blas)?
        .map_err(|e| CudaError::Blas(format!("{e:?}")))
}

fn data_type(dtype: DType) -> cudaDataType {
    match dtype {
        DType::F32 => cudaDataType::CUDA_R_32F,
        DType::Bf16 => cudaDataType::CUDA_R_16BF,
    }
}

impl Executor for GpuExecutor {
    fn describe(&self) -> String {
        let info = self.gpu.info();
        format!("{} ({})", info.name, info.arch())
    }

    fn multiprocessors(&self) -> u32 {
        self.gpu.info().multiprocessors.max(1)
    }

    fn shared_limit(&self, kernel: &str) -> Result<usize, CudaError> {
        self.gpu
            .function_named(kernel)
            .map(|(_, limit)| limit)
            .ok_or_else(|| CudaError::Exec(format!("no kernel named '{kernel}' was loaded")))
    }

    fn new_stream(&self) -> Result<Stream, CudaError> {
        self.bind()?;
        let mut lanes = self.streams.lock().unwrap_or_else(|e| e.into_inner());
        let lane = Lane::new(lanes[0].stream.fork()?)?;
        lanes.push(lane);
        Ok(Stream(lanes.len() - 1))
    }

    fn alloc_zeroed_on(&self, stream: Stream, bytes: usize) -> Result<DeviceBuffer, CudaError> {
        self.on(stream, |lane| {
            let slice = lane.stream.alloc_zeros::<u8>(bytes.max(1))?;
            let ptr = {
                let (ptr, _sync) = slice.device_ptr(&lane.stream);
                ptr
            };
            Ok(DeviceBuffer {
                ptr,
                bytes,
                _owner: Owner::Device(slice),
            })
        })
    }

    fn write_on(
        &self,
        stream: Stream,
        dst: &DeviceBuffer,
        offset: usize,
        bytes: &[u8],
    ) -> Result<(), CudaError> {
        dst.check(offset, bytes.len())?;
        if bytes.is_empty() {
            return Ok(());
        }
        self.on(stream, |lane| {
            // SAFETY: the destination range lies inside `dst` (checked); the stream is
            // synchronised before `bytes` can go away.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    dst.at(offset),
                    bytes,
                    lane.stream.cu_stream(),
                )
            }?;
            lane.stream.synchronize()?;
            self.uploaded
                .fetch_add(bytes.len() as u64, Ordering::Relaxed);
            Ok(())
        })
    }

    fn read_on(
        &self,
        stream: Stream,
        src: &DeviceBuffer,
        offset: usize,
        out: &mut [u8],
    ) -> Result<(), CudaError> {
        src.check(offset, out.len())?;
        if out.is_empty() {
            return Ok(());
        }
        self.on(stream, |lane| {
            // SAFETY: the source range lies inside `src` (checked); `out` is written before the
            // synchronisation returns.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(
                    out,
                    src.at(offset),
                    lane.stream.cu_stream(),
                )
            }?;
            Ok(lane.stream.synchronize()?)
        })
    }

    fn zero_on(
        &self,
        stream: Stream,
        dst: &DeviceBuffer,
        offset: usize,
        bytes: usize,
    ) -> Result<(), CudaError> {
        dst.check(offset, bytes)?;
        if bytes == 0 {
            return Ok(());
        }
        self.on(stream, |lane| {
            // SAFETY: the range lies inside `dst` (checked), which outlives the queued memset
            // (the executor's contract).
            unsafe {
                cudarc::driver::result::memset_d8_async(
                    dst.at(offset),
                    0,
                    bytes,
                    lane.stream.cu_stream(),
                )
            }?;
            Ok(())
        })
    }

    fn copy_on(
        &self,
        stream: Stream,
        (src, src_offset): (&DeviceBuffer, usize),
        (dst, dst_offset): (&DeviceBuffer, usize),
        bytes: usize,
    ) -> Result<(), CudaError> {
        src.check(src_offset, bytes)?;
        dst.check(dst_offset, bytes)?;
        if bytes == 0 {
            return Ok(());
        }
        self.on(stream, |lane| {
            // SAFETY: both ranges lie inside their buffers (checked), which outlive the queued
            // copy (the executor's contract).
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    dst.at(dst_offset),
                    src.at(src_offset),
                    bytes,
                    lane.stream.cu_stream(),
                )
            }?;
            Ok(())
        })
    }

    unsafe fn launch_on(
        &self,
        stream: Stream,
        kernel: &str,
        launch: Launch,
        args: &[KernelArg],
    ) -> Result<(), CudaError> {
        let (function, shared_limit) = self
            .gpu
            .function_named(kernel)
            .ok_or_else(|| CudaError::Exec(format!("no kernel named '{kernel}' was loaded")))?;
        if launch.shared_bytes as usize > shared_limit {
            return Err(CudaError::SharedMemory {
                what: "a kernel launch",
                needed: launch.shared_bytes as usize,
                limit: shared_limit,
            });
        }
        let mut packed = PackedArgs::new(args);
        let mut params = packed.pointers();
        let [gx, gy, gz] = launch.grid;
        self.on(stream, |lane| {
            // SAFETY: the caller vouches for the arguments (this function's contract); `params`
            // points into `packed`, alive until the launch has read them (cuLaunchKernel copies
            // parameters before it returns).
            unsafe {
                cudarc::driver::result::launch_kernel(
                    function.cu_function(),
                    (gx, gy, gz),
                    (launch.block, 1, 1),
                    launch.shared_bytes,
                    lane.stream.cu_stream(),
                    &mut params,
                )
            }?;
            Ok(())
        })
    }

    unsafe fn gemm_on(&self, stream: Stream, g: &Gemm) -> Result<(), CudaError> {
        g.check()?;
        let int = |v: usize| v as i32;
        // cuBLAS is column-major, so it sees each row-major matrix transposed and computes
        // cᵀ (n x m) = op(b)ᵀ-as-stored · aᵀ: b stored `n x k` (OutByIn) reads as `k x n` and is
        // transposed back; stored `k x n` (InByOut) it reads as the `n x k` wanted.
        let op_b = match g.b_layout {
            WeightLayout::OutByIn => cublasOperation_t::CUBLAS_OP_T,
            WeightLayout::InByOut => cublasOperation_t::CUBLAS_OP_N,
        };
        let (alpha, beta) = (g.alpha, g.beta);
        self.on(stream, |lane| {
            // SAFETY: the caller vouches for the operands (this function's contract); alpha and
            // beta live across the call, and the handle is bound to the lane's stream.
            unsafe {
                cudarc::cublas::result::gemm_strided_batched_ex(
                    *lane.blas.handle(),
                    op_b,
                    cublasOperation_t::CUBLAS_OP_N,
                    int(g.n),
                    int(g.m),
                    int(g.k),
                    (&alpha as *const f32).cast(),
                    g.b.ptr as *const _,
                    data_type(g.b.dtype),
                    int(g.b.ld),
                    g.b.batch_stride as i64,
                    g.a.ptr as *const _,
                    data_type(g.a.dtype),
                    int(g.a.ld),
                    g.a.batch_stride as i64,
                    (&beta as *const f32).cast(),
                    g.c.ptr as *mut _,
                    data_type(g.c.dtype),
                    int(g.c.ld),
                    g.c.batch_stride as i64,
                    int(g.batch),
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|e| CudaError::Blas(format!("{e:?}")))
        })
    }

    fn record(&self, stream: Stream) -> Result<Event, CudaError> {
        self.on(stream, |lane| {
            let event = lane
                .stream
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            Ok(Event {
                inner: EventInner::Device(event),
            })
        })
    }

    fn wait_for(&self, stream: Stream, event: &Event) -> Result<(), CudaError> {
        let EventInner::Device(event) = &event.inner else {
            return Err(CudaError::Exec("an event of another executor".into()));
        };
        self.on(stream, |lane| Ok(lane.stream.wait(event)?))
    }

    fn elapsed(&self, from: &Event, to: &Event) -> Result<Duration, CudaError> {
        let (EventInner::Device(from), EventInner::Device(to)) = (&from.inner, &to.inner) else {
            return Err(CudaError::Exec("an event of another executor".into()));
        };
        self.bind()?;
        to.synchronize()?;
        let ms = from.elapsed_ms(to)?;
        Ok(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
    }

    fn synchronize(&self) -> Result<(), CudaError> {
        self.bind()?;
        Ok(self.gpu.context().synchronize()?)
    }

    fn bytes_uploaded(&self) -> u64 {
        self.uploaded.load(Ordering::Relaxed)
    }

    fn peer_memory(&self) -> Option<&'static str> {
        Some(if self.fabric {
            "cuda-fabric"
        } else {
            "cuda-ipc"
        })
    }

    fn alloc_shared(&self, bytes: usize) -> Result<(DeviceBuffer, SharedHandle), CudaError> {
        self.bind()?;
        let context = self.gpu.context();
        let (memory, handle) = if self.fabric {
            gpu_shared::alloc_fabric(context, self.gpu.info().ordinal, bytes)?
        } else {
            gpu_shared::alloc_ipc(context, bytes)?
        };
        Ok((
            DeviceBuffer {
                ptr: memory.ptr(),
                bytes,
                _owner: Owner::Shared(memory),
            },
            handle,
        ))
    }

    fn open_shared(&self, handle: &SharedHandle) -> Result<DeviceBuffer, CudaError> {
        self.bind()?;
        let context = self.gpu.context();
        let (memory, bytes) = match handle.decode()? {
            Decoded::CudaIpc { handle, bytes } => (gpu_shared::open_ipc(context, handle)?, bytes),
            Decoded::CudaFabric {
                handle,
                size,
                bytes,
            } => (
                gpu_shared::open_fabric(context, self.gpu.info().ordinal, handle, size)?,
                bytes,
            ),
            Decoded::Memfd { .. } => {
                return Err(CudaError::Exec(
                    "a GPU cannot map the host emulator's memfd".into(),
                ))
            }
        };
        Ok(DeviceBuffer {
            ptr: memory.ptr(),
            bytes,
            _owner: Owner::Shared(memory),
        })
    }
}
