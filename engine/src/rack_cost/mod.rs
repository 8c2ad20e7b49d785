//! The rack cost model: what a prefill step's MoE layers cost on a rack, the one model both the
//! EP runtime's per-layer simulated makespan (`LayerReport::simulated`) and `rackfill simulate`
//! cost with, so their figures compare.
//!
//! - [`rack`]: the hardware ([`Rack`]: GPUs, scale-up fabric, compute and efficiency curves);
//! - [`moe_layer`]: the per-term cost of one MoE layer on it ([`MoeCost`]);
//! - [`step_schedule`]: the order a step's phases run in and its makespan ([`Schedule`]), with
//!   the engine's setting that follows from it ([`SlotMemory`]).

pub mod moe_layer;
pub mod rack;
pub mod step_schedule;

pub use moe_layer::{
    token_traffic, MoeCost, MoeDims, MoeTerms, ReplicaTraffic, SimulatedMakespan, BYTES_PER_ELEMENT,
};
pub use rack::{roofline_curve, Rack, RackError};
pub use step_schedule::{makespan, LayerPhases, Schedule, SlotMemory};
