//! The executor interface and its values: device buffers, kernel arguments, launch geometry,
//! GEMM descriptions, the bf16 conversions.

use super::super::CudaError;

/// Device memory owned by an [`Executor`]; freed when dropped.
pub struct DeviceBuffer {
    pub(super) ptr: u64,
    pub(super) bytes: usize,
    pub(super) _owner: Owner,
}

/// What keeps a buffer's memory alive.
pub(super) enum Owner {
    /// Host memory standing in for device memory (the emulator), 16-byte aligned.
    Host(#[allow(dead_code)] Box<[u128]>),
    /// A CUDA allocation.
    Device(#[allow(dead_code)] cudarc::driver::CudaSlice<u8>),
}

impl DeviceBuffer {
    /// The device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The device address `offset` bytes in.
    pub fn at(&self, offset: usize) -> u64 {
        self.ptr + offset as u64
    }

    /// Length in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub(super) fn check(&self, offset: usize, len: usize) -> Result<(), CudaError> {
        if offset.checked_add(len).is_none_or(|end| end > self.bytes) {
            return Err(CudaError::Exec(format!(
                "{len} bytes at offset {offset} do not fit a {}-byte buffer",
                self.bytes
            )));
        }
        Ok(())
    }
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer({:#x}, {} bytes)", self.ptr, self.bytes)
    }
}

/// One kernel parameter, of exactly the type the kernel declares.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KernelArg {
    /// A pointer parameter (any pointee type).
    Ptr(u64),
    U32(u32),
    I32(i32),
    F32(f32),
    U64(u64),
}

impl From<&DeviceBuffer> for KernelArg {
    fn from(buffer: &DeviceBuffer) -> Self {
        Self::Ptr(buffer.ptr)
    }
}

/// The parameter values laid out for `cuLaunchKernel`: `pointers()[i]` points at parameter i.
pub(super) struct PackedArgs {
    values: Vec<u64>,
}

impl PackedArgs {
    pub(super) fn new(args: &[KernelArg]) -> Self {
        let values = args
            .iter()
            .map(|a| match *a {
                KernelArg::Ptr(p) | KernelArg::U64(p) => p,
                KernelArg::U32(v) => u64::from(v),
                KernelArg::I32(v) => u64::from(v as u32),
                KernelArg::F32(v) => u64::from(v.to_bits()),
            })
            .collect();
        Self { values }
    }

    /// One pointer per parameter; each 8-byte slot holds a 4-byte parameter in its first bytes
    /// (little-endian), where the kernel reads it.
    pub(super) fn pointers(&mut self) -> Vec<*mut std::ffi::c_void> {
        self.values
            .iter_mut()
            .map(|v| (v as *mut u64).cast())
            .collect()
    }
}

/// A launch's geometry: a grid of up to three dimensions of 1-D blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    pub grid: [u32; 3],
    /// Threads per block.
    pub block: u32,
    /// Dynamic shared memory per block, in bytes.
    pub shared_bytes: u32,
}

impl Launch {
    /// `blocks` blocks of `threads` threads, no dynamic shared memory.
    pub fn blocks(blocks: u32, threads: u32) -> Self {
        Self {
            grid: [blocks, 1, 1],
            block: threads,
            shared_bytes: 0,
        }
    }
}

/// Element types of GEMM operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    Bf16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 => 2,
        }
    }
}

/// A row-major matrix operand (or a batch of them) in device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatrixRef {
    pub ptr: u64,
    pub dtype: DType,
    /// Elements between the starts of consecutive rows.
    pub ld: usize,
    /// Elements between consecutive matrices of a batch.
    pub batch_stride: usize,
}

/// How the weight operand `b` is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightLayout {
    /// `n x k`, as checkpoints store a linear layer's weight: `c = a · bᵀ`.
    OutByIn,
    /// `k x n`: `c = a · b`.
    InByOut,
}

/// `c = alpha · a · op(b) + beta · c` for `batch` independent problems: `a` is `m x k`, `c` is
/// `m x n`, `b` as [`WeightLayout`] says. `a` and `b` share a dtype; accumulation is f32.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub batch: usize,
    pub a: MatrixRef,
    pub b: MatrixRef,
    pub b_layout: WeightLayout,
    pub c: MatrixRef,
    pub alpha: f32,
    pub beta: f32,
}

impl Gemm {
    /// The plain single product `c[m x n] = a[m x k] · bᵀ` with `b` stored `n x k` and densely
    /// packed operands (what a linear layer is).
    pub fn linear(
        m: usize,
        n: usize,
        k: usize,
        a: (u64, DType),
        b: (u64, DType),
        c: (u64, DType),
    ) -> Self {
        let dense = |(ptr, dtype): (u64, DType), ld| MatrixRef {
            ptr,
            dtype,
            ld,
            batch_stride: 0,
        };
        Self {
            m,
            n,
            k,
            batch: 1,
            a: dense(a, k),
            b: dense(b, k),
            b_layout: WeightLayout::OutByIn,
            c: dense(c, n),
            alpha: 1.0,
            beta: 0.0,
        }
    }

    /// Checks what can be checked without knowing the buffers: nonzero sizes, `a` and `b` of one
    /// dtype, leading dimensions at least the row widths.
    pub fn check(&self) -> Result<(), CudaError> {
        let bad = |why: String| Err(CudaError::Exec(format!("GEMM {self:?}: {why}")));
        if self.a.dtype != self.b.dtype {
            return bad("a and b must share a dtype".into());
        }
        let b_row = match self.b_layout {
            WeightLayout::OutByIn => self.k,
            WeightLayout::InByOut => self.n,
        };
        if self.a.ld < self.k || self.b.ld < b_row || self.c.ld < self.n {
            return bad("a leading dimension is narrower than its rows".into());
        }
        if [self.m, self.n, self.k, self.batch]
            .iter()
            .any(|&d| i32::try_from(d).is_err())
        {
            return bad("a dimension exceeds i32".into());
        }
        Ok(())
    }
}

/// Runs kernels and GEMMs on one device (a GPU, or the host emulator), in order: every call is
/// queued on one stream, and reads ([`Executor::read`]) wait for what was queued before them.
pub trait Executor: Send + Sync {
    /// What runs the kernels, for logs ("NVIDIA H100 (sm_90)", "host emulator").
    fn describe(&self) -> String;

    /// `bytes` of zeroed device memory.
    fn alloc_zeroed(&self, bytes: usize) -> Result<DeviceBuffer, CudaError>;

    /// Copies `bytes` into `dst` at `offset`.
    fn write(&self, dst: &DeviceBuffer, offset: usize, bytes: &[u8]) -> Result<(), CudaError>;

    /// Copies `out.len()` bytes from `src` at `offset`, after all queued work.
    fn read(&self, src: &DeviceBuffer, offset: usize, out: &mut [u8]) -> Result<(), CudaError>;

    /// Waits for everything queued so far (what a phase's wall time is measured to).
    fn synchronize(&self) -> Result<(), CudaError>;

    /// Queues a device-to-device copy of `bytes` from `src` at `src_offset` to `dst` at
    /// `dst_offset` (what moves rows between the buffers of ranks sharing a device).
    fn copy(
        &self,
        src: &DeviceBuffer,
        src_offset: usize,
        dst: &DeviceBuffer,
        dst_offset: usize,
        bytes: usize,
    ) -> Result<(), CudaError>;

    /// Queues kernel `kernel` with `args`.
    ///
    /// # Safety
    /// `args` must match the kernel's parameters in number and type, and every pointer must
    /// address device memory large enough for what the kernel reads and writes at that launch.
    unsafe fn launch(
        &self,
        kernel: &str,
        launch: Launch,
        args: &[KernelArg],
    ) -> Result<(), CudaError>;

    /// Queues `gemm`.
    ///
    /// # Safety
    /// Every operand must address device memory holding the matrices its sizes and strides
    /// describe.
    unsafe fn gemm(&self, gemm: &Gemm) -> Result<(), CudaError>;
}

/// Typed uploads and downloads for any [`Executor`].
pub trait ExecutorExt: Executor {
    /// A new buffer holding `bytes`.
    fn upload(&self, bytes: &[u8]) -> Result<DeviceBuffer, CudaError> {
        let buffer = self.alloc_zeroed(bytes.len())?;
        self.write(&buffer, 0, bytes)?;
        Ok(buffer)
    }

    fn upload_f32(&self, values: &[f32]) -> Result<DeviceBuffer, CudaError> {
        self.upload(&le_bytes(values.iter().map(|v| v.to_le_bytes())))
    }

    /// `values` rounded to bf16 (nearest even), two bytes each.
    fn upload_bf16(&self, values: &[f32]) -> Result<DeviceBuffer, CudaError> {
        self.upload(&le_bytes(
            values.iter().map(|&v| f32_to_bf16(v).to_le_bytes()),
        ))
    }

    fn upload_u32(&self, values: &[u32]) -> Result<DeviceBuffer, CudaError> {
        self.upload(&le_bytes(values.iter().map(|v| v.to_le_bytes())))
    }

    fn download_f32(&self, src: &DeviceBuffer) -> Result<Vec<f32>, CudaError> {
        let mut bytes = vec![0u8; src.bytes() / 4 * 4];
        self.read(src, 0, &mut bytes)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// bf16 values widened to f32.
    fn download_bf16(&self, src: &DeviceBuffer) -> Result<Vec<f32>, CudaError> {
        let mut bytes = vec![0u8; src.bytes() / 2 * 2];
        self.read(src, 0, &mut bytes)?;
        Ok(bytes
            .chunks_exact(2)
            .map(|b| bf16_to_f32(u16::from_le_bytes([b[0], b[1]])))
            .collect())
    }

    fn download_u32(&self, src: &DeviceBuffer) -> Result<Vec<u32>, CudaError> {
        let mut bytes = vec![0u8; src.bytes() / 4 * 4];
        self.read(src, 0, &mut bytes)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }
}

impl<T: Executor + ?Sized> ExecutorExt for T {}

fn le_bytes<const N: usize>(items: impl Iterator<Item = [u8; N]>) -> Vec<u8> {
    items.flatten().collect()
}

/// f32 to bf16 bits, rounding to nearest even (NaN stays NaN): the kernels' `f32_to_bf16`.
pub fn f32_to_bf16(v: f32) -> u16 {
    let u = v.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return 0x7fc0;
    }
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

/// bf16 bits to f32 (exact).
pub fn bf16_to_f32(v: u16) -> f32 {
    f32::from_bits(u32::from(v) << 16)
}

/// `v` rounded to the nearest bf16, as f32: what a value loses by a trip through bf16.
pub fn round_bf16(v: f32) -> f32 {
    bf16_to_f32(f32_to_bf16(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even_and_keeps_nan() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1).
        assert_eq!(f32_to_bf16(1.0 + 2f32.powi(-8)), 0x3f80);
        assert_eq!(f32_to_bf16(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        assert_eq!(bf16_to_f32(f32_to_bf16(-2.5)), -2.5);
        assert_eq!(round_bf16(f32::INFINITY), f32::INFINITY);
    }

    #[test]
    fn a_gemm_with_mixed_operand_types_is_refused() {
        let mut g = Gemm::linear(2, 3, 4, (0, DType::Bf16), (0, DType::F32), (0, DType::F32));
        assert!(g.check().is_err());
        g.b.dtype = DType::Bf16;
        assert!(g.check().is_ok());
        g.a.ld = 3;
        assert!(g.check().is_err());
    }
}
