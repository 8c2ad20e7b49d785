//! [`DatasetError`]: a dataset that cannot be used.

/// A dataset that cannot be used, with where and why.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    /// Displayed without its cause, which is the error's `source` (anyhow's `{:#}` adds it).
    #[error("cannot read {path}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    /// A bad line of a JSONL trace (1-based line number).
    #[error("{path}:{line}: {message}")]
    Line {
        path: String,
        line: usize,
        message: String,
    },
    /// A file that is wrong as a whole (not a ShareGPT list, no usable entries).
    #[error("{path}: {message}")]
    File { path: String, message: String },
    /// Parameters that cannot describe a dataset.
    #[error("{0}")]
    Invalid(String),
    #[error("cannot load the tokenizer '{spec}': {message}")]
    Tokenizer { spec: String, message: String },
}
