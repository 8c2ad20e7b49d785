//! [`ServeBenchError`]: why a benchmark could not run.

use super::arrivals::ArrivalError;
use super::client::ClientError;
use super::dataset::DatasetError;

/// Why a benchmark could not run (failed requests are results, not errors).
#[derive(Debug, thiserror::Error)]
pub enum ServeBenchError {
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    #[error(transparent)]
    Arrivals(#[from] ArrivalError),
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("the warm-up request to {url} failed: {message}")]
    Warmup { url: String, message: String },
    #[error("{0}")]
    Config(String),
    #[error(transparent)]
    Plot(#[from] crate::plot::PlotError),
}
