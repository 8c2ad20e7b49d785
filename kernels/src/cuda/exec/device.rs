//! The GPU as an [`Executor`]: kernels from the sources [`super::super::Gpu::open`] compiled and
//! loaded, launched by name through `cuLaunchKernel`; GEMMs with cuBLAS in bf16 or f32 with f32
//! accumulation (`cublasGemmStridedBatchedEx`), all on the GPU's one stream.

use super::executor::{
    DType, DeviceBuffer, Executor, Gemm, KernelArg, Launch, Owner, PackedArgs, WeightLayout,
};
use crate::cuda::gemm::open_blas;
use crate::cuda::{CudaError, Gpu};
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::CudaBlas;
use cudarc::driver::DevicePtr;

/// Kernels and GEMMs on one GPU.
pub struct GpuExecutor {
    gpu: Gpu,
    blas: CudaBlas,
}

impl GpuExecutor {
    /// Binds cuBLAS (a typed error when it is missing) to the opened GPU's stream.
    pub fn new(gpu: Gpu) -> Result<Self, CudaError> {
        let blas = open_blas(&gpu)?;
        Ok(Self { gpu, blas })
    }

    /// Makes the device's context current on the calling thread: the raw driver and cuBLAS
    /// calls below need it, and the engine calls from its own thread, not the one that opened
    /// the GPU (cudarc's own calls bind it themselves).
    fn bind(&self) -> Result<(), CudaError> {
        Ok(self.gpu.context().bind_to_thread()?)
    }
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

    fn alloc_zeroed(&self, bytes: usize) -> Result<DeviceBuffer, CudaError> {
        let stream = self.gpu.stream();
        let slice = stream.alloc_zeros::<u8>(bytes.max(1))?;
        let ptr = {
            let (ptr, _sync) = slice.device_ptr(stream);
            ptr
        };
        Ok(DeviceBuffer {
            ptr,
            bytes,
            _owner: Owner::Device(slice),
        })
    }

    fn write(&self, dst: &DeviceBuffer, offset: usize, bytes: &[u8]) -> Result<(), CudaError> {
        dst.check(offset, bytes.len())?;
        self.bind()?;
        let stream = self.gpu.stream();
        // SAFETY: the destination range lies inside `dst` (checked); the stream is synchronised
        // before `bytes` can go away.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(dst.at(offset), bytes, stream.cu_stream())
        }?;
        stream.synchronize()?;
        Ok(())
    }

    fn read(&self, src: &DeviceBuffer, offset: usize, out: &mut [u8]) -> Result<(), CudaError> {
        src.check(offset, out.len())?;
        self.bind()?;
        let stream = self.gpu.stream();
        // SAFETY: the source range lies inside `src` (checked); `out` is written before the
        // synchronisation returns.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(out, src.at(offset), stream.cu_stream())
        }?;
        stream.synchronize()?;
        Ok(())
    }

    fn synchronize(&self) -> Result<(), CudaError> {
        self.bind()?;
        Ok(self.gpu.stream().synchronize()?)
    }

    fn copy(
        &self,
        src: &DeviceBuffer,
        src_offset: usize,
        dst: &DeviceBuffer,
        dst_offset: usize,
        bytes: usize,
    ) -> Result<(), CudaError> {
        src.check(src_offset, bytes)?;
        dst.check(dst_offset, bytes)?;
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: both ranges lie inside their buffers (checked), which outlive the queued copy
        // (their owners drop them only after the stream has been synchronised by a read).
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                dst.at(dst_offset),
                src.at(src_offset),
                bytes,
                self.gpu.stream().cu_stream(),
            )
        }?;
        Ok(())
    }

    unsafe fn launch(
        &self,
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
                what: "a whole-model kernel",
                needed: launch.shared_bytes as usize,
                limit: shared_limit,
            });
        }
        self.bind()?;
        let mut packed = PackedArgs::new(args);
        let mut params = packed.pointers();
        let [gx, gy, gz] = launch.grid;
        // SAFETY: the caller vouches for the arguments (this function's contract); `params`
        // points into `packed`, alive until the launch has read them (cuLaunchKernel copies
        // parameters before it returns).
        unsafe {
            cudarc::driver::result::launch_kernel(
                function.cu_function(),
                (gx, gy, gz),
                (launch.block, 1, 1),
                launch.shared_bytes,
                self.gpu.stream().cu_stream(),
                &mut params,
            )
        }?;
        Ok(())
    }

    unsafe fn gemm(&self, g: &Gemm) -> Result<(), CudaError> {
        g.check()?;
        self.bind()?;
        let int = |v: usize| v as i32;
        // cuBLAS is column-major, so it sees each row-major matrix transposed and computes
        // cᵀ (n x m) = op(b)ᵀ-as-stored · aᵀ: b stored `n x k` (OutByIn) reads as `k x n` and is
        // transposed back; stored `k x n` (InByOut) it reads as the `n x k` wanted.
        let op_b = match g.b_layout {
            WeightLayout::OutByIn => cublasOperation_t::CUBLAS_OP_T,
            WeightLayout::InByOut => cublasOperation_t::CUBLAS_OP_N,
        };
        let (alpha, beta) = (g.alpha, g.beta);
        // SAFETY: the caller vouches for the operands (this function's contract); alpha and
        // beta live across the call, and the handle is bound to the GPU's stream.
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                *self.blas.handle(),
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
    }
}
