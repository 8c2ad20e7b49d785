//! rackfill-engine: continuous batching with chunked prefill, and the expert-parallel runtime that
//! balances every MoE layer on its exact load (count exchange, plan, replica streaming, dispatch,
//! expert compute, combine).
//!
//! - [`ep`]: the EP runtime over a [`fabric::Fabric`] (one process holding every rank, or any
//!   subset of them): the model and its MoE data plane (`plane`) on the host, or (feature
//!   `cuda`) both on a device ([`ModelDevice`]), every step through one layer loop;
//! - [`rack_cost`]: the cost of one MoE layer and of a step's schedule on a rack, shared with
//!   `rackfill simulate`;
//! - [`validation`]: the checks every request passes once, before it is queued;
//! - [`scheduler`] and [`sequence`]: admission, chunked prefill, decode, sampling, stop handling;
//! - [`engine`]: the engine thread and the [`EngineHandle`] the server talks to;
//! - `group` (feature `mpi`): one process per EP rank under `mpirun` / `srun`, the leader
//!   serving HTTP and every process stepping the MoE layers together;
//! - [`metrics`] and [`routing_trace`]: what the engine reports.

pub mod engine;
pub mod ep;
pub mod error;
pub mod fabric;
#[cfg(feature = "mpi")]
pub mod group;
pub mod health;
pub mod kv_export;
pub mod metrics;
pub mod model_device;
pub mod model_weights;
mod plane;
pub mod prefix_cache;
pub mod rack_cost;
pub mod request;
pub mod routing_trace;
pub mod sampling;
pub mod scheduler;
pub mod sequence;
pub mod stop;
pub mod validation;

pub use engine::{EngineConfig, EngineHandle, EngineInfo};
pub use ep::{EpConfig, EpRuntime, LayerReport, StepOutput};
pub use error::{EngineError, Result};
pub use health::EngineHealth;
pub use model_device::ModelDevice;
pub use model_weights::ModelWeights;
pub use plane::PhaseTimes;
pub use rack_cost::{
    LayerPhases, MoeCost, MoeDims, MoeTerms, Rack, Schedule, SimulatedMakespan, SlotMemory,
};
pub use request::{
    Event, FinishEvent, FinishReason, GenerateRequest, RequestStream, StopReason, TokenEvent, Usage,
};
pub use sampling::{SamplingParams, TokenLogprob};
pub use scheduler::{Scheduler, SchedulerConfig};
pub use validation::{ContextLength, RequestError, RequestLimits, ValidatedRequest};
