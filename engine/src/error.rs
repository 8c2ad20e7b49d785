//! The engine's typed errors: what the server maps to HTTP statuses.

use rackfill_balancer::{BalanceError, PlanViolation};
use rackfill_kernels::KernelError;
use rackfill_models::ModelError;

use crate::sampling::SamplingError;
use crate::validation::RequestError;

/// Everything that can go wrong between a request entering the engine and its last token.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The model rejected its input or failed to compute (bad token id, shape mismatch).
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A sampling parameter is out of range.
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    /// The planner could not plan a layer (a load of the wrong shape).
    #[error("balancer: {0}")]
    Balance(#[from] BalanceError),
    /// A plan broke an invariant the data plane relies on; nothing was moved.
    #[error("plan for layer {layer} is invalid: {violation}")]
    InvalidPlan {
        layer: usize,
        violation: PlanViolation,
    },
    /// The data plane refused a transfer or permutation.
    #[error("data plane: {0}")]
    Kernel(#[from] KernelError),
    /// The device could not start or failed (no device, a kernel that does not load, a device
    /// error during a layer).
    #[error("GPU: {0}")]
    Gpu(String),
    /// Rank-to-rank movement failed (mismatched rank counts, a message of the wrong shape).
    #[error("fabric: {0}")]
    Fabric(String),
    /// The engine configuration is unusable (e.g. an EP size of zero).
    #[error("invalid engine configuration: {0}")]
    Config(String),
    /// The request can never be served as it is (see [`RequestError`]).
    #[error(transparent)]
    Request(#[from] RequestError),
    /// The runtime was handed inconsistent inputs (no logits choice for a sequence, a KV cache
    /// made for another model): a bug of its caller, not of a client's request, which
    /// [`RequestError`] covers.
    #[error("{0}")]
    InvalidRequest(String),
    /// The KV block book-keeping broke an invariant (a double free, an exhausted pool that
    /// admission said had room): a bug, reported rather than risking two sequences sharing a
    /// block they both write.
    #[error("KV blocks: {0}")]
    KvBlocks(String),
    /// The waiting queue cannot take the request's sequences now; try again later. The queue
    /// counts sequences: every prompt of a request, times its `n`.
    #[error(
        "the engine's queue is full: {waiting} of its {limit} sequences are waiting and this \
         request needs {needed} more (every prompt times n is one sequence); retry later"
    )]
    QueueFull {
        waiting: usize,
        needed: usize,
        limit: usize,
    },
    /// The engine is shutting down or its thread has stopped.
    #[error("the engine is not running")]
    Unavailable,
}

/// Result with [`EngineError`].
pub type Result<T, E = EngineError> = std::result::Result<T, E>;
