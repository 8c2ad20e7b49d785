//! Typed loading and compute errors. Every variant names the file (and tensor) involved, so a user
//! with a broken checkpoint learns what to fix without reading a backtrace.

use std::path::PathBuf;

/// Everything that can go wrong while resolving, loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file the checkpoint needs is absent.
    #[error("{path}: file not found")]
    MissingFile { path: PathBuf },

    /// Reading a file failed for a reason other than absence.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A JSON file (config, index, tokenizer config) does not parse or has wrong field types.
    #[error("{path}: invalid JSON: {message}")]
    Json { path: PathBuf, message: String },

    /// `config.json` names an architecture this build cannot run.
    #[error("{path}: unsupported architecture {found:?} (supported: {supported})")]
    UnknownArchitecture {
        path: PathBuf,
        found: String,
        supported: &'static str,
    },

    /// `config.json` parses but its values are inconsistent or unsupported.
    #[error("{path}: invalid config: {message}")]
    Config { path: PathBuf, message: String },

    /// A tensor the architecture needs is in no safetensors file of the checkpoint.
    #[error("{path}: missing tensor {name:?}")]
    MissingTensor { path: PathBuf, name: String },

    /// A tensor exists but its shape disagrees with `config.json`.
    #[error("{path}: tensor {name:?} has shape {found:?}, expected {expected:?}")]
    TensorShape {
        path: PathBuf,
        name: String,
        found: Vec<usize>,
        expected: Vec<usize>,
    },

    /// A tensor is stored in a dtype the loader does not convert (only bf16, f16, f32 and, in
    /// an FP8 checkpoint, F8_E4M3 are).
    #[error(
        "{path}: tensor {name:?} has dtype {dtype}, expected bf16, f16, f32 (or F8_E4M3 with \
         block scales)"
    )]
    TensorDtype {
        path: PathBuf,
        name: String,
        dtype: String,
    },

    /// An FP8 tensor cannot be read: no fp8 `quantization_config`, or its block scales are
    /// missing or of the wrong shape or dtype.
    #[error("{path}: tensor {name:?} {message}")]
    Quantization {
        path: PathBuf,
        name: String,
        message: String,
    },

    /// A safetensors file is truncated or its header is malformed.
    #[error("{path}: corrupt safetensors file: {message}")]
    Safetensors { path: PathBuf, message: String },

    /// `tokenizer.json` cannot be loaded.
    #[error("{path}: cannot load tokenizer: {message}")]
    Tokenizer { path: PathBuf, message: String },

    /// Encoding or decoding text failed at run time.
    #[error("tokenizer: {0}")]
    Tokenize(String),

    /// The chat template does not compile, or fails (or raises) while rendering.
    #[error("chat template ({origin}): {message}")]
    Template { origin: String, message: String },

    /// A model id is neither a local directory nor present in the Hugging Face cache, and
    /// downloading is impossible or failed.
    #[error("model {id:?}: {message}")]
    NotFound { id: String, message: String },

    /// A routed expert this process did not load (a sharded load holds only its EP ranks' home
    /// experts) was asked for: by the dense path, which runs every expert, or by an EP runtime
    /// whose ranks home experts outside the loaded set.
    #[error(
        "routed expert {expert} is not loaded in this process, which holds {loaded} of \
         {num_experts} (a sharded load for its EP ranks: the dense path needs every expert, \
         an EP runtime its local ranks' home experts)"
    )]
    ExpertNotLoaded {
        expert: String,
        loaded: String,
        num_experts: usize,
    },

    /// Inputs handed to the model are inconsistent (wrong lengths, token id beyond the vocabulary).
    #[error("invalid model input: {0}")]
    Input(String),

    /// The GPU path failed (a driver, cuBLAS or kernel error, or a full KV cache).
    #[cfg(feature = "cuda")]
    #[error("GPU: {0}")]
    Gpu(#[from] rackfill_kernels::cuda::CudaError),

    /// The paged KV cache refused (full, or a block table that does not belong to its pool).
    #[error("KV cache: {0}")]
    KvCache(#[from] rackfill_kernels::kv_blocks::PagedError),

    /// A tensor operation failed (a shape bug, never user input).
    #[error("tensor computation failed: {0}")]
    Compute(#[from] candle_core::Error),
}

/// Shorthand used across the crate.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;
