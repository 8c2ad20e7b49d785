//! The host emulator as an [`Executor`]: every CUDA source ([`nvrtc::SOURCES`]) compiled by the
//! host's C++ compiler against `kernels/emulator/emu.h` into a shared library, loaded into this
//! process. Device memory is host memory (shared anonymous mappings, so that the processes of a
//! concurrent grid see it), a launch runs its blocks one after another (each CUDA thread a fiber,
//! switched at barriers and warp operations), or all at once as forked processes ([`EmulatorSettings::concurrent_blocks`]), and a
//! GEMM is a plain f32-accumulating loop (in the library too) standing in for cuBLAS. Every call runs to completion
//! before it returns, so streams are names and events timestamps.
//!
//! What it shows: the kernels' arithmetic, indexing and block-level synchronisation, run from the
//! same host code as on a GPU. What it cannot: the GPU's memory ordering and stream concurrency,
//! timing, or a cuBLAS call's exact summation order (the reference GEMM is a different order,
//! within f32 rounding).

use super::executor::{
    DType, DeviceBuffer, Event, EventInner, Executor, Gemm, KernelArg, Launch, Owner, PackedArgs,
    Stream, WeightLayout,
};
use super::host_memory::Mapping;
use super::shared::{boot_id, Decoded, SharedHandle};
use crate::cuda::{nvrtc, CudaError};
use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CString};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

const EMU_H: &str = include_str!("../../../emulator/emu.h");
const LAUNCH_CPP: &str = include_str!("../../../emulator/launch.cpp");

/// Dynamic shared memory a block may take: an H100's opt-in maximum.
const SHARED_LIMIT: usize = 227 * 1024;

/// Why the emulator could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EmulatorUnavailable {
    #[error("no C++ compiler ({cxx}): set CXX to one that takes -std=c++20")]
    NoCompiler { cxx: String },
    #[error("the kernels do not build as host C++:\n{log}")]
    Build { log: String },
    #[error("emulator: {0}")]
    Io(String),
}

/// What the emulation of a launch may change; `EmuSettings` in `launch.cpp`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmulatorSettings {
    /// 1: the blocks of a grid run at once, each a forked process (one-dimensional grids).
    pub concurrent_blocks: u32,
    /// Microseconds every system-scope fence stalls before it completes: holds producers back
    /// so that consumers in other blocks really wait.
    pub fence_delay_us: u32,
    /// How long the replica stream waits for a relay chunk before it declares the stream broken
    /// (`TILE_STALL_NS` on a GPU).
    pub tile_stall_ns: u64,
    /// 1: the quota solver picks targets by packed 32-bit keys where they fit (as on a GPU); 0:
    /// always by the shuffle tree.
    pub packed_keys: u32,
    reserved: u32,
}

impl Default for EmulatorSettings {
    fn default() -> Self {
        Self {
            concurrent_blocks: 0,
            fence_delay_us: 0,
            tile_stall_ns: 5_000_000_000,
            packed_keys: 1,
            reserved: 0,
        }
    }
}

/// What one launch observed (`EmuStats` in `launch.cpp`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct LaunchStats {
    backoffs: u64,
    max_warp_ops: u64,
}

type LaunchFn = unsafe extern "C" fn(
    *const c_char,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_ulonglong,
    *mut *mut c_void,
    *const EmulatorSettings,
    *mut LaunchStats,
) -> c_int;

/// A GEMM operand as `emu_gemm` reads it (`EmuMatrix` in `launch.cpp`).
#[repr(C)]
struct EmuMatrix {
    ptr: u64,
    ld: u64,
    batch_stride: u64,
    dtype: u32,
    reserved: u32,
}

impl EmuMatrix {
    fn of(m: &super::executor::MatrixRef) -> Self {
        Self {
            ptr: m.ptr,
            ld: m.ld as u64,
            batch_stride: m.batch_stride as u64,
            dtype: match m.dtype {
                DType::F32 => 0,
                DType::Bf16 => 1,
            },
            reserved: 0,
        }
    }
}

type GemmFn = unsafe extern "C" fn(
    c_ulonglong,
    c_ulonglong,
    c_ulonglong,
    c_ulonglong,
    *const EmuMatrix,
    *const EmuMatrix,
    c_uint,
    *const EmuMatrix,
    f32,
    f32,
);

/// The library every [`Emulator`] of a process shares.
struct Library {
    _library: libloading::Library,
    launch: LaunchFn,
    gemm: GemmFn,
    /// The emulation keeps a launch's state in globals of the library: one launch at a time.
    running: Mutex<()>,
    path: PathBuf,
}

/// Every kernel on the CPU.
pub struct Emulator {
    library: Arc<Library>,
    settings: EmulatorSettings,
    streams: AtomicUsize,
    backoffs: AtomicU64,
    max_warp_ops: AtomicU64,
    bytes_written: AtomicU64,
}

impl Emulator {
    /// The emulator for this process, built (or found built, by the sources' hash) under the
    /// system's temporary directory on first use; `None`, after printing why, where there is no
    /// C++ compiler. Tests use it so that a machine without one skips instead of failing.
    pub fn shared() -> Option<Arc<Emulator>> {
        static SHARED: OnceLock<Option<Arc<Emulator>>> = OnceLock::new();
        SHARED
            .get_or_init(|| {
                let dir = std::env::temp_dir().join("rackfill-emulator");
                match Emulator::build(&dir) {
                    Ok(emulator) => Some(Arc::new(emulator)),
                    Err(e @ EmulatorUnavailable::NoCompiler { .. }) => {
                        eprintln!("host emulator skipped: {e}");
                        None
                    }
                    Err(e) => panic!("{e}"),
                }
            })
            .clone()
    }

    /// An emulator over the same library whose launches run with `settings` (its own streams
    /// and counters): a test's emulation settings never reach another test's launches.
    pub fn with_settings(&self, settings: EmulatorSettings) -> Emulator {
        Emulator {
            library: Arc::clone(&self.library),
            settings,
            streams: AtomicUsize::new(1),
            backoffs: AtomicU64::new(0),
            max_warp_ops: AtomicU64::new(0),
            bytes_written: AtomicU64::new(0),
        }
    }

    /// Wait-loop back-offs (`__nanosleep`) of this emulator's launches so far, over every block.
    pub fn backoffs(&self) -> u64 {
        self.backoffs.load(Ordering::Relaxed)
    }

    /// The most warp-synchronous operations (shuffles, reductions, warp barriers) one thread ran
    /// in one launch of this emulator so far: the length of a kernel's warp-level critical
    /// path, a count and not a time.
    pub fn max_warp_ops(&self) -> u64 {
        self.max_warp_ops.load(Ordering::Relaxed)
    }

    /// Builds the emulator library in `dir` (reused when the same sources were built there
    /// before) and loads it.
    pub fn build(dir: &Path) -> Result<Self, EmulatorUnavailable> {
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
        if Command::new(&cxx).arg("--version").output().is_err() {
            return Err(EmulatorUnavailable::NoCompiler { cxx });
        }
        let (kernels, entries) = host_sources();
        let hash = fnv1a(&[EMU_H, LAUNCH_CPP, &kernels, &entries, &cxx].concat());
        let lib = dir.join(format!("librackfill-emulator-{hash:016x}.so"));
        let io = |e: std::io::Error| EmulatorUnavailable::Io(e.to_string());
        if !lib.exists() {
            // Built in a directory of its own and renamed into place, so that test processes
            // building at the same time never load a half-written library.
            let work = dir.join(format!("build-{hash:016x}-{}", std::process::id()));
            std::fs::create_dir_all(&work).map_err(io)?;
            for (name, text) in [
                ("emu.h", EMU_H),
                ("launch.cpp", LAUNCH_CPP),
                ("kernels.inc", kernels.as_str()),
                ("entries.inc", entries.as_str()),
            ] {
                std::fs::write(work.join(name), text).map_err(io)?;
            }
            let out = Command::new(&cxx)
                .args([
                    "-std=c++20",
                    "-O2",
                    "-shared",
                    "-fPIC",
                    "-pthread",
                    "-w",
                    "-I",
                ])
                .arg(&work)
                .arg(work.join("launch.cpp"))
                .arg("-o")
                .arg(work.join("lib.so"))
                .output()
                .map_err(io)?;
            if !out.status.success() {
                return Err(EmulatorUnavailable::Build {
                    log: String::from_utf8_lossy(&out.stderr).into_owned(),
                });
            }
            std::fs::rename(work.join("lib.so"), &lib).map_err(io)?;
            let _ = std::fs::remove_dir_all(&work);
        }
        // SAFETY: the library was built just now (or earlier, from the same sources, by this
        // code) from the emulator's own sources; loading it runs no foreign initialisers.
        let library = unsafe { libloading::Library::new(&lib) }
            .map_err(|e| EmulatorUnavailable::Io(format!("{}: {e}", lib.display())))?;
        // SAFETY: launch.cpp defines emu_launch with exactly LaunchFn's C signature.
        let launch = unsafe { library.get::<LaunchFn>(b"emu_launch\0") }
            .map(|f| *f)
            .map_err(|e| EmulatorUnavailable::Io(e.to_string()))?;
        // SAFETY: launch.cpp defines emu_gemm with exactly GemmFn's C signature.
        let gemm = unsafe { library.get::<GemmFn>(b"emu_gemm\0") }
            .map(|f| *f)
            .map_err(|e| EmulatorUnavailable::Io(e.to_string()))?;
        let library = Library {
            _library: library,
            launch,
            gemm,
            running: Mutex::new(()),
            path: lib,
        };
        Ok(Self {
            library: Arc::new(library),
            settings: EmulatorSettings::default(),
            streams: AtomicUsize::new(1),
            backoffs: AtomicU64::new(0),
            max_warp_ops: AtomicU64::new(0),
            bytes_written: AtomicU64::new(0),
        })
    }
}

/// Every source as host C++ (`kernels.inc`) and its launch table (`entries.inc`).
fn host_sources() -> (String, String) {
    let prelude = nvrtc::QUOTA_SOLVER
        .program()
        .split_once("#line 1")
        .map(|(prelude, _)| prelude.to_string())
        .unwrap_or_default();
    // The replica stream's stall limit is the emulator's, set per launch.
    let mut kernels = prelude + "#define TILE_STALL_NS g_tile_stall_ns\n";
    let mut entries = String::new();
    for source in nvrtc::SOURCES {
        kernels += &format!("#line 1 \"{}\"\n{}\n", source.file, source.source);
        for entry in source.entry_points {
            entries += &format!("KERNEL({entry})\n");
        }
    }
    let kernels = kernels
        .replace(
            "extern __shared__ __align__(16) u8 smem[];",
            "u8* smem = g_smem;",
        )
        .replace("extern __shared__ u32 shm[];", "u32* shm = (u32*)g_smem;")
        .replace("extern \"C\" __global__", "");
    (kernels, entries)
}

/// 64-bit FNV-1a: names a build by its inputs.
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

impl Emulator {
    fn check_stream(&self, stream: Stream) -> Result<(), CudaError> {
        if stream.0 < self.streams.load(Ordering::Relaxed) {
            Ok(())
        } else {
            Err(CudaError::Exec(format!(
                "{stream:?} was not made by this executor"
            )))
        }
    }
}

impl Executor for Emulator {
    fn describe(&self) -> String {
        format!("host emulator ({})", self.library.path.display())
    }

    fn multiprocessors(&self) -> u32 {
        1
    }

    fn shared_limit(&self, _kernel: &str) -> Result<usize, CudaError> {
        Ok(SHARED_LIMIT)
    }

    fn new_stream(&self) -> Result<Stream, CudaError> {
        Ok(Stream(self.streams.fetch_add(1, Ordering::Relaxed)))
    }

    fn alloc_zeroed_on(&self, stream: Stream, bytes: usize) -> Result<DeviceBuffer, CudaError> {
        self.check_stream(stream)?;
        let memory = Mapping::new(bytes)?;
        Ok(DeviceBuffer {
            ptr: memory.address(),
            bytes,
            _owner: Owner::Host(memory),
        })
    }

    fn peer_memory(&self) -> Option<&'static str> {
        Some("memfd")
    }

    fn alloc_shared(&self, bytes: usize) -> Result<(DeviceBuffer, SharedHandle), CudaError> {
        let (memory, fd) = Mapping::shared(bytes)?;
        let handle = SharedHandle::memfd(std::process::id(), fd, bytes);
        Ok((
            DeviceBuffer {
                ptr: memory.address(),
                bytes,
                _owner: Owner::Host(memory),
            },
            handle,
        ))
    }

    fn open_shared(&self, handle: &SharedHandle) -> Result<DeviceBuffer, CudaError> {
        match handle.decode()? {
            Decoded::Memfd {
                pid,
                fd,
                bytes,
                boot,
            } => {
                if boot != boot_id() {
                    return Err(CudaError::Exec(format!(
                        "peer memory of process {pid} is on another host: the emulator maps \
                         memory only between processes of one host"
                    )));
                }
                let memory = Mapping::open(pid, fd, bytes)?;
                Ok(DeviceBuffer {
                    ptr: memory.address(),
                    bytes,
                    _owner: Owner::Host(memory),
                })
            }
            Decoded::CudaIpc { .. } | Decoded::CudaFabric { .. } => Err(CudaError::Exec(
                "the host emulator cannot map a GPU's memory".into(),
            )),
        }
    }

    fn write_on(
        &self,
        stream: Stream,
        dst: &DeviceBuffer,
        offset: usize,
        bytes: &[u8],
    ) -> Result<(), CudaError> {
        self.check_stream(stream)?;
        dst.check(offset, bytes.len())?;
        // SAFETY: checked to lie inside `dst`, host memory this emulator allocated.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst.at(offset) as *mut u8, bytes.len());
        }
        self.bytes_written
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn read_on(
        &self,
        stream: Stream,
        src: &DeviceBuffer,
        offset: usize,
        out: &mut [u8],
    ) -> Result<(), CudaError> {
        self.check_stream(stream)?;
        src.check(offset, out.len())?;
        // SAFETY: as in `write_on`.
        unsafe {
            std::ptr::copy_nonoverlapping(src.at(offset) as *const u8, out.as_mut_ptr(), out.len());
        }
        Ok(())
    }

    fn zero_on(
        &self,
        stream: Stream,
        dst: &DeviceBuffer,
        offset: usize,
        bytes: usize,
    ) -> Result<(), CudaError> {
        self.check_stream(stream)?;
        dst.check(offset, bytes)?;
        // SAFETY: as in `write_on`.
        unsafe { std::ptr::write_bytes(dst.at(offset) as *mut u8, 0, bytes) };
        Ok(())
    }

    fn copy_on(
        &self,
        stream: Stream,
        (src, src_offset): (&DeviceBuffer, usize),
        (dst, dst_offset): (&DeviceBuffer, usize),
        bytes: usize,
    ) -> Result<(), CudaError> {
        self.check_stream(stream)?;
        src.check(src_offset, bytes)?;
        dst.check(dst_offset, bytes)?;
        // SAFETY: both ranges lie inside host memory this emulator allocated (checked); `copy`
        // allows them to overlap.
        unsafe {
            std::ptr::copy(
                src.at(src_offset) as *const u8,
                dst.at(dst_offset) as *mut u8,
                bytes,
            );
        }
        Ok(())
    }

    unsafe fn launch_on(
        &self,
        stream: Stream,
        kernel: &str,
        launch: Launch,
        args: &[KernelArg],
    ) -> Result<(), CudaError> {
        self.check_stream(stream)?;
        if launch.shared_bytes as usize > SHARED_LIMIT {
            return Err(CudaError::SharedMemory {
                what: "a kernel launch",
                needed: launch.shared_bytes as usize,
                limit: SHARED_LIMIT,
            });
        }
        let name =
            CString::new(kernel).map_err(|_| CudaError::Exec("kernel name holds a NUL".into()))?;
        let mut packed = PackedArgs::new(args);
        let mut pointers = packed.pointers();
        let [gx, gy, gz] = launch.grid;
        let mut stats = LaunchStats::default();
        let status = {
            let _one_at_a_time = self
                .library
                .running
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            // SAFETY: the caller vouches for the arguments (this function's contract); the
            // library reads `pointers.len()` parameters of the kernel's own types, the settings
            // and writes the stats, both live across the call.
            unsafe {
                (self.library.launch)(
                    name.as_ptr(),
                    gx,
                    gy,
                    gz,
                    launch.block,
                    u64::from(launch.shared_bytes),
                    pointers.as_mut_ptr(),
                    &self.settings,
                    &mut stats,
                )
            }
        };
        self.backoffs.fetch_add(stats.backoffs, Ordering::Relaxed);
        self.max_warp_ops
            .fetch_max(stats.max_warp_ops, Ordering::Relaxed);
        match status {
            0 => Ok(()),
            1 => Err(CudaError::Exec(format!(
                "the emulator has no kernel '{kernel}'"
            ))),
            3 => Err(CudaError::Exec(format!(
                "{kernel}: a block of a concurrent grid died"
            ))),
            _ => Err(CudaError::Exec(format!(
                "{kernel}: unrunnable launch {launch:?}"
            ))),
        }
    }

    unsafe fn gemm_on(&self, stream: Stream, gemm: &Gemm) -> Result<(), CudaError> {
        self.check_stream(stream)?;
        gemm.check()?;
        let (a, b, c) = (
            EmuMatrix::of(&gemm.a),
            EmuMatrix::of(&gemm.b),
            EmuMatrix::of(&gemm.c),
        );
        let layout = match gemm.b_layout {
            WeightLayout::OutByIn => 0,
            WeightLayout::InByOut => 1,
        };
        // SAFETY: the caller vouches that every operand addresses host memory of this emulator
        // holding the described matrices (this function's contract); the operand descriptions
        // live across the call. The GEMM touches no global of the library, so it needs no lock.
        unsafe {
            (self.library.gemm)(
                gemm.m as u64,
                gemm.n as u64,
                gemm.k as u64,
                gemm.batch as u64,
                &a,
                &b,
                layout,
                &c,
                gemm.alpha,
                gemm.beta,
            )
        };
        Ok(())
    }

    fn record(&self, stream: Stream) -> Result<Event, CudaError> {
        self.check_stream(stream)?;
        Ok(Event {
            inner: EventInner::Host(Instant::now()),
        })
    }

    fn wait_for(&self, stream: Stream, event: &Event) -> Result<(), CudaError> {
        self.check_stream(stream)?;
        match event.inner {
            // Recorded after its work had run: nothing to wait for.
            EventInner::Host(_) => Ok(()),
            EventInner::Device(_) => Err(CudaError::Exec("an event of another executor".into())),
        }
    }

    fn elapsed(&self, from: &Event, to: &Event) -> Result<Duration, CudaError> {
        match (&from.inner, &to.inner) {
            (EventInner::Host(from), EventInner::Host(to)) => {
                Ok(to.saturating_duration_since(*from))
            }
            _ => Err(CudaError::Exec("an event of another executor".into())),
        }
    }

    fn synchronize(&self) -> Result<(), CudaError> {
        Ok(()) // every launch and GEMM has finished when its call returns
    }

    fn bytes_uploaded(&self) -> u64 {
        self.bytes_written.load(Ordering::Relaxed)
    }
}
