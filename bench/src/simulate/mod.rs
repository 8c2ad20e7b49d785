//! `rackfill simulate`: a rack-scale what-if. Given a rack, a model shape, an EP size, redundant
//! slots, balancers and routing, it costs every prefill step term by term (UltraEP Eq. 1: solve,
//! replica streaming over relay trees, dispatch, expert compute, combine, plus attention and the
//! dense FFN under data-parallel attention) and reports throughput as a fraction of the
//! force-balanced ideal, a per-term breakdown like UltraEP Fig. 13, and (with a request trace)
//! TTFT versus request rate.
//!
//! - `rackfill_engine::rack_cost::rack`: hardware figures and the GEMM efficiency curve
//!   (`--rack nvl72|FILE.json`), the same rack the EP runtime costs its layers on;
//! - [`shape`]: model dimensions (`--model-shape` presets, shape files, HF configs);
//! - [`cost`]: the cost of each term (the MoE terms are the engine's `rackfill_engine::rack_cost`);
//! - [`spec`], [`step`], [`throughput`]: what a simulation is given, how a step is costed for
//!   every balancer, and the throughput mode;
//! - [`trace`]: routing (`synthetic-mixed` or a recorded trace) and the ideal's even routing;
//! - [`queue`]: the request-trace queueing simulation (TTFT per request);
//! - [`report`]: reports, the readable tables and the plots.
//!
//! Balancers are the real planners (`Algo::build`), one instance per MoE layer so history-based
//! ones keep a per-layer window, planned on all cores; every re-plan is charged a modelled GPU
//! solve time (`--solve-us`, the calibration's device solver, or UltraEP's 111 us) unless
//! `--host-solve-time` measures `Balancer::plan` on this host. Every plan is validated before it
//! is costed. [`calibration`] replaces the rack's assumed kernel rates with a GPU session's
//! measured ones; [`sweep`] runs the cross product of shapes, EP sizes, slots, schedules and
//! traces.

pub mod calibration;
pub mod cost;
mod error;
pub mod queue;
pub mod report;
pub mod shape;
pub mod spec;
pub mod step;
pub mod sweep;
pub mod throughput;
pub mod trace;

pub use error::SimError;
pub use spec::{SimSpec, MAX_CHUNK_TOKENS, MAX_STEPS};
pub use step::{AlgoStep, StepCoster};
pub use throughput::{run_throughput, ThroughputRun};
