//! Finding the CUDA shared libraries before cudarc touches them.
//!
//! cudarc (feature `dynamic-loading`) opens `libcuda`, `libnvrtc` and `libcublas` by bare file
//! name on first use and panics when none is found. rackfill looks first and reports a typed error
//! instead. NCCL is found the same way but never opened through cudarc: cudarc's candidate names
//! lack `libnccl.so.2`, the only name a runtime-only install (`libnccl2`, the `nvidia-nccl-cu*`
//! wheels) provides, so [`nccl`] keeps the library handle and `super::nccl` resolves its entry
//! points from it. It also finds libraries that are not on the loader path, such as NVRTC from the PyPI
//! wheel `nvidia-cuda-nvrtc` (`site-packages/nvidia/cu13/lib`): it opens the file by its full path
//! and keeps it open, and cudarc's later open by bare name (`libnvrtc.so.13`) resolves to the
//! already-loaded library, because the dynamic loader matches loaded libraries by their soname.
//!
//! Search order, first hit wins:
//! 1. every directory in `RACKFILL_CUDA_LIB_DIR` (colon-separated);
//! 2. the loader's own search (`LD_LIBRARY_PATH`, `ld.so.cache`, system directories);
//! 3. `$CUDA_HOME`, `$CUDA_PATH`, `/usr/local/cuda` (`lib64`, `lib`);
//! 4. the NVIDIA PyPI wheels' directories (`nvidia/cu13/lib`, `nvidia/cu12/lib`,
//!    `nvidia/cuda_nvrtc/lib`, `nvidia/cublas/lib`, `nvidia/nccl/lib`) under the usual Python prefixes: `$VIRTUAL_ENV`,
//!    `$CONDA_PREFIX`, `~/.local`, `/usr/local`, `/usr`, and every `~/.pyenv/versions/*`.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// The environment variable naming extra directories to search first.
pub const LIB_DIR_ENV: &str = "RACKFILL_CUDA_LIB_DIR";

/// A CUDA library rackfill loads at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lib {
    Driver,
    Nvrtc,
    Cublas,
}

impl Lib {
    /// File names in preference order: the sonames cudarc's bare-name lookup also tries.
    fn file_names(self) -> &'static [&'static str] {
        match self {
            Lib::Driver => &["libcuda.so.1", "libcuda.so"],
            Lib::Nvrtc => &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"],
            Lib::Cublas => &["libcublas.so.13", "libcublas.so.12", "libcublas.so"],
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Where a library was found, or the one-line description of everything that was searched.
pub(crate) type Found = Result<String, String>;

/// NCCL's file names in preference order (its soname first).
const NCCL_NAMES: &[&str] = &["libnccl.so.2", "libnccl.so"];

/// An opened library and where it was found.
pub(crate) struct Opened {
    pub(crate) library: libloading::Library,
    pub(crate) found_at: String,
}

/// Libraries opened by full path, kept open for the life of the process so that cudarc's
/// bare-name opens resolve to them.
static KEPT: Mutex<Vec<libloading::Library>> = Mutex::new(Vec::new());

/// Finds and opens `lib` once per process; later calls return the first answer.
pub(crate) fn ensure(lib: Lib) -> Found {
    static CACHE: [OnceLock<Found>; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];
    CACHE[lib.index()]
        .get_or_init(|| {
            locate(lib.file_names()).map(|opened| {
                keep(opened.library);
                opened.found_at
            })
        })
        .clone()
}

/// NCCL, found and opened once per process and kept open for its life.
pub(crate) fn nccl() -> Result<&'static Opened, String> {
    static NCCL: OnceLock<Result<Opened, String>> = OnceLock::new();
    NCCL.get_or_init(|| locate(NCCL_NAMES))
        .as_ref()
        .map_err(Clone::clone)
}

fn locate(names: &[&str]) -> Result<Opened, String> {
    let env_dirs = env_dirs();
    let well_known = well_known_dirs();
    for dir in &env_dirs {
        if let Some(found) = open_in(dir, names) {
            return Ok(found);
        }
    }
    for name in names {
        // SAFETY: loading a CUDA library runs its initialisers, which have no preconditions.
        if let Ok(library) = unsafe { libloading::Library::new(*name) } {
            return Ok(Opened {
                library,
                found_at: format!("{name} (loader path)"),
            });
        }
    }
    for dir in &well_known {
        if let Some(found) = open_in(dir, names) {
            return Ok(found);
        }
    }
    let mut searched = vec![format!("${LIB_DIR_ENV}")];
    searched.push("the loader path (LD_LIBRARY_PATH, ld.so.cache)".to_string());
    searched.extend(well_known.iter().map(|d| d.display().to_string()));
    Err(format!("{} in {}", names.join(" / "), searched.join(", ")))
}

/// Opens the first of `names` that exists in `dir`.
fn open_in(dir: &Path, names: &[&str]) -> Option<Opened> {
    for name in names {
        let path = dir.join(name);
        if !path.is_file() {
            continue;
        }
        // SAFETY: as in `locate`.
        if let Ok(library) = unsafe { libloading::Library::new(&path) } {
            return Some(Opened {
                library,
                found_at: path.display().to_string(),
            });
        }
    }
    None
}

fn keep(library: libloading::Library) {
    KEPT.lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .push(library);
}

fn env_dirs() -> Vec<PathBuf> {
    std::env::var_os(LIB_DIR_ENV)
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default()
}

/// Toolkit directories, then the NVIDIA wheels' library directories under every Python prefix.
fn well_known_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    let mut toolkits: Vec<PathBuf> = ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(std::env::var_os)
        .map(PathBuf::from)
        .collect();
    toolkits.push(PathBuf::from("/usr/local/cuda"));
    for root in toolkits {
        dirs.push(root.join("lib64"));
        dirs.push(root.join("lib"));
    }
    let home = std::env::var_os("HOME").map(PathBuf::from);
    let mut prefixes: Vec<PathBuf> = ["VIRTUAL_ENV", "CONDA_PREFIX"]
        .iter()
        .filter_map(std::env::var_os)
        .map(PathBuf::from)
        .collect();
    if let Some(home) = &home {
        prefixes.push(home.join(".local"));
    }
    prefixes.push(PathBuf::from("/usr/local"));
    prefixes.push(PathBuf::from("/usr"));
    if let Some(home) = &home {
        prefixes.extend(subdirs(&home.join(".pyenv/versions")));
    }
    for prefix in prefixes {
        for python in subdirs(&prefix.join("lib")).into_iter().filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("python3"))
        }) {
            for packages in ["site-packages", "dist-packages"] {
                let nvidia = python.join(packages).join("nvidia");
                for wheel in ["cu13", "cu12", "cuda_nvrtc", "cublas", "nccl"] {
                    let dir = nvidia.join(wheel).join("lib");
                    if dir.is_dir() {
                        dirs.push(dir);
                    }
                }
            }
        }
    }
    dirs
}

/// The subdirectories of `dir`, sorted (newest Python versions sort last; order only matters when
/// several hold a library, and then any of them will do).
fn subdirs(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| p.is_dir())
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

/// Runs `f`, turning a panic inside cudarc (a library or entry point that could not be loaded)
/// into an error message. cudarc panics instead of returning errors in exactly those cases.
pub(crate) fn guard<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|payload| {
        payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a CUDA library call panicked".to_string())
    })
}
