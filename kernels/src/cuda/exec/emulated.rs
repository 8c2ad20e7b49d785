//! The host emulator as an [`Executor`]: the whole-model CUDA sources
//! ([`nvrtc::WHOLE_MODEL_SOURCES`]) compiled by the host's C++ compiler against
//! `kernels/emulator/emu.h` into a shared library, loaded into this process. Device memory is
//! host memory, a launch runs its blocks one after another (one std::thread per CUDA thread),
//! and a GEMM is a plain f32-accumulating loop standing in for cuBLAS.
//!
//! What it shows: the kernels' arithmetic, indexing and block-level synchronisation, run from the
//! same host code as on a GPU. What it cannot: the GPU's memory ordering, timing, or a cuBLAS
//! call's exact summation order (the reference GEMM is a different order, within f32 rounding).

use super::executor::{
    DType, DeviceBuffer, Executor, Gemm, KernelArg, Launch, Owner, PackedArgs, WeightLayout,
};
use crate::cuda::{nvrtc, CudaError};
use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CString};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};

const EMU_H: &str = include_str!("../../../emulator/emu.h");
const LAUNCH_CPP: &str = include_str!("../../../emulator/launch.cpp");

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

type LaunchFn = unsafe extern "C" fn(
    *const c_char,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_ulonglong,
    *mut *mut c_void,
) -> c_int;

/// The whole-model kernels on the CPU.
pub struct Emulator {
    _library: libloading::Library,
    launch: LaunchFn,
    /// The emulation keeps a launch's state in globals of the library: one launch at a time.
    running: Mutex<()>,
    path: PathBuf,
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
        Ok(Self {
            _library: library,
            launch,
            running: Mutex::new(()),
            path: lib,
        })
    }
}

/// The whole-model sources as host C++ (`kernels.inc`) and their launch table (`entries.inc`).
fn host_sources() -> (String, String) {
    let prelude = nvrtc::MODEL
        .program()
        .split_once("#line 1")
        .map(|(prelude, _)| prelude.to_string())
        .unwrap_or_default();
    let mut kernels = prelude;
    let mut entries = String::new();
    for source in nvrtc::WHOLE_MODEL_SOURCES {
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

impl Executor for Emulator {
    fn describe(&self) -> String {
        format!("host emulator ({})", self.path.display())
    }

    fn alloc_zeroed(&self, bytes: usize) -> Result<DeviceBuffer, CudaError> {
        let memory = vec![0u128; bytes.div_ceil(16).max(1)].into_boxed_slice();
        Ok(DeviceBuffer {
            ptr: memory.as_ptr() as u64,
            bytes,
            _owner: Owner::Host(memory),
        })
    }

    fn write(&self, dst: &DeviceBuffer, offset: usize, bytes: &[u8]) -> Result<(), CudaError> {
        dst.check(offset, bytes.len())?;
        // SAFETY: checked to lie inside `dst`, host memory this emulator allocated.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst.at(offset) as *mut u8, bytes.len());
        }
        Ok(())
    }

    fn read(&self, src: &DeviceBuffer, offset: usize, out: &mut [u8]) -> Result<(), CudaError> {
        src.check(offset, out.len())?;
        // SAFETY: as in `write`.
        unsafe {
            std::ptr::copy_nonoverlapping(src.at(offset) as *const u8, out.as_mut_ptr(), out.len());
        }
        Ok(())
    }

    fn synchronize(&self) -> Result<(), CudaError> {
        Ok(()) // every launch and GEMM has finished when its call returns
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

    unsafe fn launch(
        &self,
        kernel: &str,
        launch: Launch,
        args: &[KernelArg],
    ) -> Result<(), CudaError> {
        let name =
            CString::new(kernel).map_err(|_| CudaError::Exec("kernel name holds a NUL".into()))?;
        let mut packed = PackedArgs::new(args);
        let mut pointers = packed.pointers();
        let [gx, gy, gz] = launch.grid;
        let _one_at_a_time = self.running.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the caller vouches for the arguments (this function's contract); the library
        // reads `pointers.len()` parameters of the kernel's own types.
        let status = unsafe {
            (self.launch)(
                name.as_ptr(),
                gx,
                gy,
                gz,
                launch.block,
                u64::from(launch.shared_bytes),
                pointers.as_mut_ptr(),
            )
        };
        match status {
            0 => Ok(()),
            1 => Err(CudaError::Exec(format!(
                "the emulator has no kernel '{kernel}'"
            ))),
            _ => Err(CudaError::Exec(format!(
                "{kernel}: unrunnable launch {launch:?}"
            ))),
        }
    }

    unsafe fn gemm(&self, gemm: &Gemm) -> Result<(), CudaError> {
        gemm.check()?;
        // SAFETY: the caller vouches that every operand addresses host memory of this emulator
        // holding the described matrices (this function's contract).
        unsafe { reference_gemm(gemm) };
        Ok(())
    }
}

/// Reads element `i` of a matrix operand.
///
/// # Safety
/// `ptr` + `i` elements must be readable memory of `dtype`.
unsafe fn load(ptr: u64, dtype: DType, i: usize) -> f32 {
    // SAFETY: the caller's contract.
    unsafe {
        match dtype {
            DType::F32 => *(ptr as *const f32).add(i),
            DType::Bf16 => super::bf16_to_f32(*(ptr as *const u16).add(i)),
        }
    }
}

/// What cuBLAS computes for `g`, in f32, on host memory.
///
/// # Safety
/// As [`Executor::gemm`].
unsafe fn reference_gemm(g: &Gemm) {
    for batch in 0..g.batch {
        let (a, b, c) = (
            g.a.ptr + (batch * g.a.batch_stride * g.a.dtype.size()) as u64,
            g.b.ptr + (batch * g.b.batch_stride * g.b.dtype.size()) as u64,
            g.c.ptr + (batch * g.c.batch_stride * g.c.dtype.size()) as u64,
        );
        for row in 0..g.m {
            for col in 0..g.n {
                let mut acc = 0f32;
                for i in 0..g.k {
                    let b_at = match g.b_layout {
                        WeightLayout::OutByIn => col * g.b.ld + i,
                        WeightLayout::InByOut => i * g.b.ld + col,
                    };
                    // SAFETY: the caller's contract covers every element the sizes describe.
                    acc +=
                        unsafe { load(a, g.a.dtype, row * g.a.ld + i) * load(b, g.b.dtype, b_at) };
                }
                let at = row * g.c.ld + col;
                // SAFETY: as above.
                unsafe {
                    let old = if g.beta == 0.0 {
                        0.0
                    } else {
                        load(c, g.c.dtype, at)
                    };
                    let value = g.alpha * acc + g.beta * old;
                    match g.c.dtype {
                        DType::F32 => *(c as *mut f32).add(at) = value,
                        DType::Bf16 => *(c as *mut u16).add(at) = super::f32_to_bf16(value),
                    }
                }
            }
        }
    }
}
