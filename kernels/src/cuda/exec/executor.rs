//! The executor interface and its values: device buffers, kernel arguments, launch geometry,
//! GEMM descriptions, the bf16 conversions.

use super::super::CudaError;
use super::shared::SharedHandle;

/// Device memory owned by an [`Executor`]; freed when dropped.
pub struct DeviceBuffer {
    pub(super) ptr: u64,
    pub(super) bytes: usize,
    pub(super) _owner: Owner,
}

/// What keeps a buffer's memory alive.
pub(super) enum Owner {
    /// A shared anonymous mapping of host memory standing in for device memory (the emulator):
    /// page-aligned, and visible to the processes a concurrent grid forks.
    Host(#[allow(dead_code)] super::host_memory::Mapping),
    /// A CUDA allocation.
    Device(#[allow(dead_code)] cudarc::driver::CudaSlice<u8>),
    /// Device memory shared between processes ([`super::shared`]): allocated here for others
    /// to map, or another process's, mapped here.
    Shared(#[allow(dead_code)] super::gpu_shared::SharedMemory),
    /// A part of another buffer, which it keeps alive ([`DeviceBuffer::view`]).
    View(#[allow(dead_code)] std::sync::Arc<DeviceBuffer>),
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

    /// `bytes` of `parent` from `offset`, as a buffer of its own that keeps `parent` alive:
    /// how one large allocation (a peer-memory window) is handed out in parts.
    pub fn view(
        parent: &std::sync::Arc<DeviceBuffer>,
        offset: usize,
        bytes: usize,
    ) -> Result<DeviceBuffer, CudaError> {
        parent.check(offset, bytes)?;
        Ok(DeviceBuffer {
            ptr: parent.at(offset),
            bytes,
            _owner: Owner::View(std::sync::Arc::clone(parent)),
        })
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
    /// A struct passed by value ([`KernelArg::params`]).
    Struct(ParamBytes),
}

impl KernelArg {
    /// A `repr(C)` parameter struct passed by value, byte for byte.
    pub fn params<T: KernelParams>(value: &T) -> Self {
        Self::Struct(ParamBytes::of(value))
    }
}

/// A `repr(C)` struct of plain integers laid out exactly as a kernel's parameter struct, so it
/// can be passed by value as that parameter.
///
/// # Safety
/// The type must be `repr(C)`, hold no padding, pointers or references, and be at most
/// [`ParamBytes::CAPACITY`] bytes.
pub unsafe trait KernelParams: Copy {}

/// The bytes of a by-value struct parameter, 8-byte aligned (at most [`Self::CAPACITY`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ParamBytes {
    words: [u64; 16],
    len: usize,
}

impl ParamBytes {
    /// The largest struct parameter.
    pub const CAPACITY: usize = 128;

    fn of<T: KernelParams>(value: &T) -> Self {
        let len = std::mem::size_of::<T>();
        assert!(
            len <= Self::CAPACITY,
            "a kernel parameter struct of {len} bytes"
        );
        let mut words = [0u64; 16];
        // SAFETY: `T` is plain bytes without padding (the `KernelParams` contract) and fits the
        // words (asserted); the regions do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (value as *const T).cast::<u8>(),
                words.as_mut_ptr().cast::<u8>(),
                len,
            );
        }
        Self { words, len }
    }

    /// The struct's bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes of the words were written from the struct (at most their size).
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.len) }
    }
}

impl From<&DeviceBuffer> for KernelArg {
    fn from(buffer: &DeviceBuffer) -> Self {
        Self::Ptr(buffer.ptr)
    }
}

/// The parameter values laid out for `cuLaunchKernel`: `pointers()[i]` points at parameter i.
pub(super) struct PackedArgs {
    values: Vec<[u64; 16]>,
}

impl PackedArgs {
    pub(super) fn new(args: &[KernelArg]) -> Self {
        let values = args
            .iter()
            .map(|a| {
                let mut slot = [0u64; 16];
                slot[0] = match *a {
                    KernelArg::Ptr(p) | KernelArg::U64(p) => p,
                    KernelArg::U32(v) => u64::from(v),
                    KernelArg::I32(v) => u64::from(v as u32),
                    KernelArg::F32(v) => u64::from(v.to_bits()),
                    KernelArg::Struct(bytes) => return bytes.words,
                };
                slot
            })
            .collect();
        Self { values }
    }

    /// One pointer per parameter; each slot holds a 4-byte parameter in its first bytes
    /// (little-endian), where the kernel reads it, and a struct parameter as its bytes.
    pub(super) fn pointers(&mut self) -> Vec<*mut std::ffi::c_void> {
        self.values
            .iter_mut()
            .map(|v| v.as_mut_ptr().cast())
            .collect()
    }
}

/// An ordered queue of device work on an [`Executor`]: what is queued on one stream runs in
/// order; work on two streams runs concurrently, ordered only by the [`Event`]s one waits for.
/// [`Stream::MAIN`] is every executor's first stream, the one the methods without a stream
/// use; [`Executor::new_stream`] makes more.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Stream(pub(super) usize);

impl Stream {
    /// The executor's first stream.
    pub const MAIN: Stream = Stream(0);
}

/// A point in a stream's work, recorded by [`Executor::record`]: another stream can wait for
/// it ([`Executor::wait_for`]) and two of them time what ran between ([`Executor::elapsed`]).
pub struct Event {
    pub(super) inner: EventInner,
}

pub(super) enum EventInner {
    /// A CUDA event (timing enabled).
    Device(cudarc::driver::CudaEvent),
    /// The emulator runs every call to completion: the time it was recorded.
    Host(std::time::Instant),
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

/// Runs kernels, copies and GEMMs on one device (a GPU, or the host emulator), queued on
/// [`Stream`]s: in order on each, concurrently across them, ordered by [`Event`]s. The methods
/// without a stream argument use [`Stream::MAIN`]; reads wait for what their stream queued.
///
/// Buffers used on several streams must be ordered by events before the one that frees them
/// drops them: a buffer's memory goes back to the device in the order of the stream it was
/// allocated on ([`Executor::alloc_zeroed_on`]).
pub trait Executor: Send + Sync {
    /// What runs the kernels, for logs ("NVIDIA H100 (sm_90)", "host emulator").
    fn describe(&self) -> String;

    /// Streaming multiprocessors (what sizes a persistent grid; 1 on the emulator).
    fn multiprocessors(&self) -> u32;

    /// The most dynamic shared memory one block of `kernel` may take, in bytes.
    fn shared_limit(&self, kernel: &str) -> Result<usize, CudaError>;

    /// A new stream, starting after everything [`Stream::MAIN`] has queued so far.
    fn new_stream(&self) -> Result<Stream, CudaError>;

    /// `bytes` of zeroed device memory, allocated (and later freed) in `stream`'s order.
    fn alloc_zeroed_on(&self, stream: Stream, bytes: usize) -> Result<DeviceBuffer, CudaError>;

    /// Copies `bytes` into `dst` at `offset` after the work `stream` queued; returns once done.
    fn write_on(
        &self,
        stream: Stream,
        dst: &DeviceBuffer,
        offset: usize,
        bytes: &[u8],
    ) -> Result<(), CudaError>;

    /// Copies `out.len()` bytes from `src` at `offset`, after the work `stream` queued.
    fn read_on(
        &self,
        stream: Stream,
        src: &DeviceBuffer,
        offset: usize,
        out: &mut [u8],
    ) -> Result<(), CudaError>;

    /// Queues zeroing `bytes` of `dst` from `offset`.
    fn zero_on(
        &self,
        stream: Stream,
        dst: &DeviceBuffer,
        offset: usize,
        bytes: usize,
    ) -> Result<(), CudaError>;

    /// Queues a device-to-device copy of `bytes` from `src` at `src_offset` to `dst` at
    /// `dst_offset` (what moves rows between the buffers of ranks sharing a device).
    fn copy_on(
        &self,
        stream: Stream,
        src: (&DeviceBuffer, usize),
        dst: (&DeviceBuffer, usize),
        bytes: usize,
    ) -> Result<(), CudaError>;

    /// Queues kernel `kernel` with `args` on `stream`.
    ///
    /// # Safety
    /// `args` must match the kernel's parameters in number and type, and every pointer must
    /// address device memory large enough for what the kernel reads and writes at that launch,
    /// alive until the kernel has run.
    unsafe fn launch_on(
        &self,
        stream: Stream,
        kernel: &str,
        launch: Launch,
        args: &[KernelArg],
    ) -> Result<(), CudaError>;

    /// Queues `gemm` on `stream`.
    ///
    /// # Safety
    /// Every operand must address device memory holding the matrices its sizes and strides
    /// describe, alive until the product has run.
    unsafe fn gemm_on(&self, stream: Stream, gemm: &Gemm) -> Result<(), CudaError>;

    /// An event after everything `stream` queued so far.
    fn record(&self, stream: Stream) -> Result<Event, CudaError>;

    /// Makes `stream`'s later work wait for `event`.
    fn wait_for(&self, stream: Stream, event: &Event) -> Result<(), CudaError>;

    /// The device time between two events of one stream (waits for `to`).
    fn elapsed(&self, from: &Event, to: &Event) -> Result<std::time::Duration, CudaError>;

    /// Waits for everything queued on every stream.
    fn synchronize(&self) -> Result<(), CudaError>;

    /// Bytes copied from the host into device memory so far ([`Self::write_on`] and the uploads
    /// built on it; device-to-device copies and zeroing are not counted): what a loader uploaded.
    fn bytes_uploaded(&self) -> u64;

    /// Which peer memory between processes the executor has (`"cuda-fabric"` across an NVLink
    /// domain, `"cuda-ipc"` within a host, the emulator's `"memfd"`), `None` without any: what
    /// [`Self::alloc_shared`] and [`Self::open_shared`] use.
    fn peer_memory(&self) -> Option<&'static str> {
        None
    }

    /// `bytes` of zeroed device memory that other processes of this host can map
    /// ([`Self::open_shared`] with the returned handle). Allocated synchronously, once, outside
    /// any stream's order: the buffers a group's ranks address each other through.
    fn alloc_shared(&self, bytes: usize) -> Result<(DeviceBuffer, SharedHandle), CudaError> {
        let _ = bytes;
        Err(CudaError::Exec(format!(
            "{} has no peer memory between processes",
            self.describe()
        )))
    }

    /// Maps memory another process allocated with [`Self::alloc_shared`] into this process:
    /// kernels and copies of this executor then address it like their own.
    fn open_shared(&self, handle: &SharedHandle) -> Result<DeviceBuffer, CudaError> {
        let _ = handle;
        Err(CudaError::Exec(format!(
            "{} has no peer memory between processes",
            self.describe()
        )))
    }

    /// [`Self::alloc_zeroed_on`] the main stream.
    fn alloc_zeroed(&self, bytes: usize) -> Result<DeviceBuffer, CudaError> {
        self.alloc_zeroed_on(Stream::MAIN, bytes)
    }

    /// [`Self::write_on`] the main stream.
    fn write(&self, dst: &DeviceBuffer, offset: usize, bytes: &[u8]) -> Result<(), CudaError> {
        self.write_on(Stream::MAIN, dst, offset, bytes)
    }

    /// [`Self::read_on`] the main stream.
    fn read(&self, src: &DeviceBuffer, offset: usize, out: &mut [u8]) -> Result<(), CudaError> {
        self.read_on(Stream::MAIN, src, offset, out)
    }

    /// [`Self::copy_on`] the main stream.
    fn copy(
        &self,
        src: &DeviceBuffer,
        src_offset: usize,
        dst: &DeviceBuffer,
        dst_offset: usize,
        bytes: usize,
    ) -> Result<(), CudaError> {
        self.copy_on(Stream::MAIN, (src, src_offset), (dst, dst_offset), bytes)
    }

    /// [`Self::launch_on`] the main stream.
    ///
    /// # Safety
    /// As [`Self::launch_on`].
    unsafe fn launch(
        &self,
        kernel: &str,
        launch: Launch,
        args: &[KernelArg],
    ) -> Result<(), CudaError> {
        // SAFETY: the caller's contract.
        unsafe { self.launch_on(Stream::MAIN, kernel, launch, args) }
    }

    /// [`Self::gemm_on`] the main stream.
    ///
    /// # Safety
    /// As [`Self::gemm_on`].
    unsafe fn gemm(&self, gemm: &Gemm) -> Result<(), CudaError> {
        // SAFETY: the caller's contract.
        unsafe { self.gemm_on(Stream::MAIN, gemm) }
    }
}

/// Typed uploads and downloads for any [`Executor`].
pub trait ExecutorExt: Executor {
    /// A new buffer holding `bytes`.
    fn upload(&self, bytes: &[u8]) -> Result<DeviceBuffer, CudaError> {
        self.upload_on(Stream::MAIN, bytes)
    }

    /// A new buffer holding `bytes`, allocated in `stream`'s order.
    fn upload_on(&self, stream: Stream, bytes: &[u8]) -> Result<DeviceBuffer, CudaError> {
        let buffer = self.alloc_zeroed_on(stream, bytes.len())?;
        self.write_on(stream, &buffer, 0, bytes)?;
        Ok(buffer)
    }

    fn upload_u64(&self, values: &[u64]) -> Result<DeviceBuffer, CudaError> {
        self.upload(&le_bytes(values.iter().map(|v| v.to_le_bytes())))
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
        self.download_u32_on(Stream::MAIN, src)
    }

    /// The buffer's `u32`s, after the work `stream` queued.
    fn download_u32_on(&self, stream: Stream, src: &DeviceBuffer) -> Result<Vec<u32>, CudaError> {
        let mut bytes = vec![0u8; src.bytes() / 4 * 4];
        self.read_on(stream, src, 0, &mut bytes)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// The buffer's `u64`s, after the work `stream` queued.
    fn download_u64_on(&self, stream: Stream, src: &DeviceBuffer) -> Result<Vec<u64>, CudaError> {
        let mut bytes = vec![0u8; src.bytes() / 8 * 8];
        self.read_on(stream, src, 0, &mut bytes)?;
        Ok(bytes
            .chunks_exact(8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
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
