//! The CUDA C sources and their run-time compilation by NVRTC.
//!
//! Kernels ship as source (`kernels/cuda/*.cu`, embedded in the binary) and are compiled for the
//! device at hand when a [`super::Gpu`] opens, so one binary serves every architecture NVRTC knows.
//! [`compile`] is also what `rackfill kernels check` runs for a list of architectures on machines
//! without a GPU: NVRTC needs no device.

use super::libs::{self, guard, Lib, LIB_DIR_ENV};
use cudarc::nvrtc::{result, sys, Ptx};
use std::ffi::CString;

/// Why NVRTC cannot compile anything.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NvrtcUnavailable {
    #[error(
        "NVRTC was not found: install it with `pip install nvidia-cuda-nvrtc` and set \
         {LIB_DIR_ENV} (or LD_LIBRARY_PATH) to its site-packages/nvidia/cu13/lib \
         (searched {searched})"
    )]
    NotFound { searched: String },
    #[error("NVRTC is unusable: {0}")]
    Broken(String),
    #[error("'{arch}' is not a GPU architecture NVRTC targets (expected e.g. sm_90 or sm_100)")]
    BadArch { arch: String },
}

/// Environment variable: how many milliseconds a replica-streaming block waits for a relay chunk
/// before it declares the tile stream broken (`CudaError::TileStreamStalled`); default 5000.
/// A healthy stream waits milliseconds at most, but a GPU slowed many times over (under
/// `compute-sanitizer`, a profiler's replay, or time-sliced with other work) can wait longer.
pub const TILE_STALL_ENV: &str = "RACKFILL_TILE_STALL_MS";

/// The largest [`TILE_STALL_ENV`] accepted: one hour.
const MAX_TILE_STALL_MS: u64 = 3_600_000;

/// The prelude every source starts with (types, warp reductions).
const COMMON: &str = include_str!("../../cuda/common.cuh");

/// One CUDA source file and the kernels it defines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSource {
    /// The name reported by `rackfill kernels check` (the file stem).
    pub name: &'static str,
    /// `kernels/cuda/<file>`.
    pub file: &'static str,
    /// The CUDA C text (without the prelude).
    pub source: &'static str,
    /// The `extern "C"` entry points the host loads from the module.
    pub entry_points: &'static [&'static str],
}

/// Quota solver (UltraEP §5.3).
pub const QUOTA_SOLVER: KernelSource = KernelSource {
    name: "quota_solver",
    file: "quota_solver.cu",
    source: include_str!("../../cuda/quota_solver.cu"),
    entry_points: &["quota_solve"],
};

/// Replica distribution by tile streaming with relay trees (UltraEP §6).
pub const REPLICATE: KernelSource = KernelSource {
    name: "replicate",
    file: "replicate.cu",
    source: include_str!("../../cuda/replicate.cu"),
    entry_points: &["tile_stream", "wait_slot"],
};

/// Ready flags between the ranks of a group in peer memory: bounded waits on epochs.
pub const PEER: KernelSource = KernelSource {
    name: "peer",
    file: "peer.cu",
    source: include_str!("../../cuda/peer.cu"),
    entry_points: &["peer_signal", "peer_wait"],
};

/// The relay trees and the tile task stream, built on the device from the plan (UltraEP §6.2).
pub const TILE_PLAN: KernelSource = KernelSource {
    name: "tile_plan",
    file: "tile_plan.cu",
    source: include_str!("../../cuda/tile_plan.cu"),
    entry_points: &["plan_tiles"],
};

/// Token permute by physical instance, grouping, return and weighted combine (UltraEP §5.2).
pub const PERMUTE: KernelSource = KernelSource {
    name: "permute",
    file: "permute.cu",
    source: include_str!("../../cuda/permute.cu"),
    entry_points: &[
        "stable_rank_by_key",
        "lookup_instance",
        "instance_keys",
        "scatter_rows_bf16",
    ],
};

/// `kernels/cuda/<file>` after `fastmath.cuh` (the gated activation's arithmetic), each with
/// its own `#line`, for the sources that share it.
macro_rules! with_fastmath {
    ($file:literal) => {
        concat!(
            "#line 1 \"fastmath.cuh\"\n",
            include_str!("../../cuda/fastmath.cuh"),
            "#line 1 \"",
            $file,
            "\"\n",
            include_str!(concat!("../../cuda/", $file)),
        )
    };
}

/// The dense parts of a decoder layer (whole-model path): embedding, norms, RoPE, adds,
/// conversions, gathers, the bf16 gated activation, the routers.
pub const MODEL: KernelSource = KernelSource {
    name: "model",
    file: "model.cu",
    source: with_fastmath!("model.cu"),
    entry_points: &[
        "embed_rows",
        "f32_to_bf16_rows",
        "rms_norm_to_bf16",
        "rms_norm_inplace",
        "rope",
        "add_inplace",
        "add_bias_rows",
        "sigmoid_scale_rows",
        "silu_mul_to_bf16",
        "combine_topk_rows",
        "router_softmax_topk",
        "router_sigmoid_grouped_topk",
    ],
};

/// Paged KV cache writes and causal flash attention (tensor cores) over a chunk plus its cached
/// context, one kernel per tile shape (`flash::FlashTiles`); the
/// unfused softmax the attention benchmark's cuBLAS baseline uses.
pub const ATTENTION: KernelSource = KernelSource {
    name: "attention",
    file: "attention.cu",
    source: include_str!("../../cuda/attention.cu"),
    entry_points: &[
        "kv_write",
        "flash_attention_k64_v64",
        "flash_attention_k64_v128",
        "flash_attention_k32_v128",
        "flash_attention_k32_v256",
        "causal_softmax_to_bf16",
    ],
};

/// Strided f32 row copies and gathers (whole-model path).
pub const GLUE: KernelSource = KernelSource {
    name: "glue",
    file: "glue.cu",
    source: include_str!("../../cuda/glue.cu"),
    entry_points: &["copy_rows_f32", "gather_rows_f32"],
};

/// A checkpoint's tensors converted on the device at load: f32, f16 and bf16 to bf16 or f32,
/// block-quantized FP8 (e4m3) dequantized by its block scales; a synthetic checkpoint's tensors
/// generated in place.
pub const CONVERT: KernelSource = KernelSource {
    name: "convert",
    file: "convert.cu",
    source: include_str!("../../cuda/convert.cu"),
    entry_points: &["convert_elements", "dequant_fp8_e4m3", "fill_synthetic"],
};

/// The routed experts' grouped GEMMs on tensor cores: every instance of a layer in one launch
/// of each half of the expert MLP, SiLU-mul fused into the gate-up epilogue; the tile table of
/// rows grouped on the device.
pub const GROUPED_GEMM: KernelSource = KernelSource {
    name: "grouped_gemm",
    file: "grouped_gemm.cu",
    source: with_fastmath!("grouped_gemm.cu"),
    entry_points: &["grouped_gate_up_silu", "grouped_down", "expert_tiles"],
};

/// Every kernel source, in the order `rackfill kernels check` reports them.
pub const SOURCES: [KernelSource; 10] = [
    QUOTA_SOLVER,
    REPLICATE,
    PEER,
    TILE_PLAN,
    PERMUTE,
    MODEL,
    ATTENTION,
    GLUE,
    CONVERT,
    GROUPED_GEMM,
];

/// Architectures `rackfill kernels check` compiles for by default: Hopper and Blackwell.
pub const DEFAULT_ARCHS: [&str; 2] = ["sm_90", "sm_100"];

impl KernelSource {
    /// The full program handed to NVRTC: the prelude, then the file with its own line numbers.
    pub fn program(&self) -> String {
        format!("{COMMON}\n#line 1 \"{}\"\n{}", self.file, self.source)
    }
}

/// One source compiled for one architecture.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// PTX text or a CUBIN, ready for `CudaContext::load_module`.
    pub(crate) image: Ptx,
    /// Size of the PTX text (without its terminator) or of the CUBIN, in bytes.
    pub bytes: usize,
}

/// What NVRTC hands back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// Portable PTX, JIT-compiled by the driver (needs a driver at least as new as NVRTC).
    Ptx,
    /// Machine code for exactly `arch` (loads on any driver of NVRTC's major version).
    Cubin,
}

/// Checks that `arch` names a real-architecture target NVRTC accepts: `sm_` then digits and an
/// optional feature suffix (`sm_90`, `sm_90a`, `sm_100f`).
pub fn check_arch(arch: &str) -> Result<(), NvrtcUnavailable> {
    let digits = arch.strip_prefix("sm_").unwrap_or("");
    let num = digits.trim_end_matches(['a', 'f']);
    let suffix = digits.len() - num.len();
    if num.len() >= 2 && num.bytes().all(|b| b.is_ascii_digit()) && suffix <= 1 {
        Ok(())
    } else {
        Err(NvrtcUnavailable::BadArch {
            arch: arch.to_string(),
        })
    }
}

/// Finds and loads NVRTC; returns its version `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32), NvrtcUnavailable> {
    libs::ensure(Lib::Nvrtc).map_err(|searched| NvrtcUnavailable::NotFound { searched })?;
    // SAFETY (inside): the library is loaded; nvrtcVersion writes two ints.
    guard(|| {
        let mut major = 0;
        let mut minor = 0;
        let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
        if status == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
            Ok((major, minor))
        } else {
            Err(format!("nvrtcVersion returned {status:?}"))
        }
    })
    .and_then(|r| r)
    .map_err(NvrtcUnavailable::Broken)
}

/// Why one source did not compile.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompileFailure {
    #[error(transparent)]
    Unavailable(#[from] NvrtcUnavailable),
    #[error("{kernel} for {arch} does not compile:\n{log}")]
    Source {
        kernel: &'static str,
        arch: String,
        log: String,
    },
    #[error(
        "{TILE_STALL_ENV}='{value}': expected whole milliseconds from 1 to {MAX_TILE_STALL_MS}"
    )]
    BadStallLimit { value: String },
}

/// The NVRTC option that sets `tile_stream`'s stall limit from [`TILE_STALL_ENV`]'s `value`
/// (none when unset: the kernel's default).
fn stall_limit_option(value: Option<&str>) -> Result<Option<String>, CompileFailure> {
    let Some(value) = value else {
        return Ok(None);
    };
    match value.trim().parse::<u64>() {
        Ok(ms @ 1..=MAX_TILE_STALL_MS) => {
            Ok(Some(format!("-DTILE_STALL_NS={}ull", ms * 1_000_000)))
        }
        _ => Err(CompileFailure::BadStallLimit {
            value: value.to_string(),
        }),
    }
}

/// An NVRTC program, destroyed on drop.
struct Program(cudarc::nvrtc::sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by create_program and destroyed only here. A failure leaks the program.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

/// The CUBIN of a program compiled for a real architecture.
fn get_cubin(prog: &Program) -> Result<Vec<u8>, result::NvrtcError> {
    let mut size = 0usize;
    // SAFETY: `prog` is a live, compiled program; the buffer has the size NVRTC reports.
    unsafe {
        sys::nvrtcGetCUBINSize(prog.0, &mut size).result()?;
        let mut cubin = vec![0u8; size];
        sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast()).result()?;
        Ok(cubin)
    }
}

fn c_text(chars: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Compiles `source` to PTX for `arch` (e.g. `sm_90`): what `rackfill kernels check` runs.
pub fn compile(source: &KernelSource, arch: &str) -> Result<Compiled, CompileFailure> {
    compile_to(source, arch, Output::Ptx)
}

/// Compiles `source` for `arch` to PTX or CUBIN.
pub fn compile_to(
    source: &KernelSource,
    arch: &str,
    output: Output,
) -> Result<Compiled, CompileFailure> {
    check_arch(arch)?;
    nvrtc_version()?;
    let broken = |what: String| CompileFailure::Unavailable(NvrtcUnavailable::Broken(what));
    let program =
        CString::new(source.program()).map_err(|_| broken("source holds a NUL".into()))?;
    let name = CString::new(source.file).map_err(|_| broken("file name holds a NUL".into()))?;
    let mut options = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "--device-as-default-execution-space".to_string(),
    ];
    let stall = std::env::var(TILE_STALL_ENV).ok();
    options.extend(stall_limit_option(stall.as_deref())?);
    guard(|| {
        let prog = Program(
            result::create_program(&program, Some(&name)).map_err(|e| broken(e.to_string()))?,
        );
        // SAFETY: `prog` is a live program; `program` and `name` outlive it.
        if let Err(e) = unsafe { result::compile_program(prog.0, &options) } {
            // SAFETY: as above.
            let log = unsafe { result::get_program_log(prog.0) }
                .map(|l| c_text(&l))
                .unwrap_or_else(|_| e.to_string());
            return Err(CompileFailure::Source {
                kernel: source.name,
                arch: arch.to_string(),
                log: log.trim_end().to_string(),
            });
        }
        let compiled = match output {
            Output::Ptx => {
                // SAFETY: as above, compiled.
                let ptx = unsafe { result::get_ptx(prog.0) }.map_err(|e| broken(e.to_string()))?;
                let text = c_text(&ptx);
                Compiled {
                    bytes: text.len(),
                    image: Ptx::from_src(text),
                }
            }
            Output::Cubin => {
                let cubin = get_cubin(&prog).map_err(|e| broken(e.to_string()))?;
                Compiled {
                    bytes: cubin.len(),
                    image: Ptx::from_binary(cubin),
                }
            }
        };
        Ok(compiled)
    })
    .map_err(broken)?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stall_limit_comes_from_whole_milliseconds() {
        assert_eq!(stall_limit_option(None).unwrap(), None);
        assert_eq!(
            stall_limit_option(Some("120000")).unwrap().as_deref(),
            Some("-DTILE_STALL_NS=120000000000ull")
        );
        assert_eq!(
            stall_limit_option(Some(" 1 ")).unwrap().as_deref(),
            Some("-DTILE_STALL_NS=1000000ull")
        );
        for bad in [
            "",
            "0",
            "-5",
            "1.5",
            "5s",
            "3600001",
            "99999999999999999999",
        ] {
            let err = stall_limit_option(Some(bad)).unwrap_err();
            assert!(
                matches!(&err, CompileFailure::BadStallLimit { value } if value == bad),
                "{bad}: {err}"
            );
            assert!(err.to_string().starts_with(TILE_STALL_ENV), "{err}");
        }
    }

    #[test]
    fn arch_names_are_checked_before_nvrtc_is_needed() {
        for good in ["sm_90", "sm_100", "sm_90a", "sm_100f", "sm_80"] {
            assert_eq!(check_arch(good), Ok(()), "{good}");
        }
        for bad in [
            "",
            "sm_",
            "sm_9",
            "compute_90",
            "sm_9x",
            "sm_90aa",
            "90",
            "sm_-1",
        ] {
            assert!(check_arch(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn programs_keep_the_file_line_numbers() {
        for source in SOURCES {
            let program = source.program();
            let marker = format!("#line 1 \"{}\"\n", source.file);
            let at = program.find(&marker).expect("line directive");
            assert!(program[at + marker.len()..].starts_with(source.source));
            for entry in source.entry_points {
                assert!(
                    source.source.contains(&format!("__global__ void {entry}("))
                        || source.source.contains(&format!("\n{entry}(")),
                    "{} lacks {entry}",
                    source.file
                );
            }
        }
    }
}
