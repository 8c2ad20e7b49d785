//! rackfill-engine: continuous batching with chunked prefill, and the expert-parallel runtime that
//! balances every MoE layer on its exact load (count exchange, plan, replica streaming, dispatch,
//! expert compute, combine).
//!
//! - [`ep`]: the EP runtime (`R` ranks in one process) over a [`fabric::Fabric`], its MoE data
//!   plane on the CPU or (feature `cuda`) on a GPU ([`DataPlane`]);
//! - [`validation`]: the checks every request passes once, before it is queued;
//! - [`scheduler`] and [`sequence`]: admission, chunked prefill, decode, sampling, stop handling;
//! - [`engine`]: the engine thread and the [`EngineHandle`] the server talks to;
//! - [`metrics`] and [`routing_trace`]: what the engine reports.

pub mod cost;
mod cpu_plane;
pub mod engine;
pub mod ep;
pub mod error;
pub mod fabric;
#[cfg(feature = "cuda")]
mod gpu_plane;
pub mod metrics;
pub mod penalties;
pub mod request;
pub mod routing_trace;
pub mod sampling;
pub mod scheduler;
pub mod sequence;
pub mod stop;
pub mod validation;

pub use cost::{CostModel, SimulatedMakespan};
pub use engine::{EngineConfig, EngineHandle, EngineInfo};
pub use ep::{DataPlane, EpConfig, EpRuntime, LayerReport, PhaseTimes, StepOutput};
pub use error::{EngineError, Result};
pub use request::{
    Event, FinishEvent, FinishReason, GenerateRequest, RequestStream, StopReason, TokenEvent, Usage,
};
pub use sampling::{SamplingParams, TokenLogprob};
pub use scheduler::{Scheduler, SchedulerConfig};
pub use validation::{ContextLength, RequestError, RequestLimits, ValidatedRequest};
