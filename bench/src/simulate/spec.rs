//! What every simulation shares (rack, model shape, EP group, balancers, routing bounds) and the
//! checks it passes before anything runs.

use super::cost::StepCost;
use super::error::SimError;
use super::shape::ModelShape;
use crate::synthetic::multilayer::MAX_STEP_COUNTS;
use crate::synthetic::Sampler;
use rackfill_balancer::relay::RelayConfig;
use rackfill_balancer::{Algo, Settings};
use rackfill_engine::{Rack, Schedule, SlotMemory};

/// Most tokens a rank prefills per step (`--chunk-tokens`): chunked prefill runs a few thousand
/// to tens of thousands per rank, and synthetic routing samples every token of every rank and
/// layer, so this also bounds a step's work. Longer prompts are chunks with `--context-tokens`.
pub const MAX_CHUNK_TOKENS: u64 = 1 << 16;

/// Most steps one simulation runs: `--steps`, and the fewest steps a request trace needs.
pub const MAX_STEPS: usize = 1_000_000;

/// What every simulation shares: rack, model, EP group and balancers.
#[derive(Debug, Clone)]
pub struct SimSpec {
    pub rack: Rack,
    pub shape: ModelShape,
    /// EP ranks `R` (one GPU each).
    pub ep: usize,
    /// Redundant slots per rank.
    pub slots: usize,
    /// Balancers to compare, in report order.
    pub algos: Vec<Algo>,
    pub settings: Settings,
    /// Relay trees for replica streaming (`threshold: usize::MAX` streams every replica directly).
    pub relay: RelayConfig,
    /// Solve time per layer in microseconds instead of measuring the planner (reproducible runs).
    pub solve_us: Option<f64>,
    /// MoE layers simulated per step on synthetic routing; each stands for
    /// `moe_layers / sim_layers` of the model's. A recorded trace simulates each of its own layers
    /// once per step instead (see [`run_throughput`]).
    pub sim_layers: usize,
    /// Tokens each rank prefills per step (`--chunk-tokens`) on synthetic routing and in request
    /// mode; a recorded trace's tokens come from its rows.
    pub chunk_tokens: u64,
    pub seed: u64,
    /// How a step's phases overlap (`--schedule`); the report's headline figures are this
    /// schedule's, the ablation covers every one of [`Schedule::ALL`].
    pub schedule: Schedule,
    /// Where replicas live between steps (`--slot-memory`).
    pub slot_memory: SlotMemory,
    /// With [`SlotMemory::PerLayer`], quota plans move replicas onto ranks that still hold the
    /// same expert while the busiest rank's load stays within this fraction of the unconstrained
    /// plan's (`rackfill_balancer::reuse::prefer_resident`); `None`: plans as solved.
    pub reuse_tolerance: Option<f64>,
    /// How synthetic routing draws each rank's row (`--sampler`).
    pub sampler: Sampler,
    /// Threads one simulation samples routing on (a sweep runs its points one thread each).
    pub threads: usize,
}

impl SimSpec {
    /// The tolerance quota plans reuse resident replicas within: only with per-layer slots.
    pub fn resident_preference(&self) -> Option<f64> {
        (self.slot_memory == SlotMemory::PerLayer)
            .then_some(self.reuse_tolerance)
            .flatten()
    }

    /// Checks the combination before anything runs.
    pub fn validate(&self) -> Result<(), SimError> {
        let bad = |s: String| Err(SimError::Input(s));
        // Loaded shapes and racks are checked already; built ones are checked here.
        if let Err(why) = self.shape.validate() {
            return bad(format!("model shape {}: {why}", self.shape.name));
        }
        if let Err(why) = self.rack.validate() {
            return bad(format!("rack {}: {why}", self.rack.name));
        }
        if self.ep == 0 {
            return bad("--ep-size must be at least 1".into());
        }
        if self.ep > self.rack.gpus {
            return bad(format!(
                "--ep-size {} exceeds the {} GPUs of rack '{}'",
                self.ep, self.rack.gpus, self.rack.name
            ));
        }
        if self.algos.is_empty() {
            return bad("--balancer needs at least one balancer".into());
        }
        if !(1..=MAX_CHUNK_TOKENS).contains(&self.chunk_tokens) {
            return bad(format!(
                "--chunk-tokens must be in 1..={MAX_CHUNK_TOKENS}, got {}",
                self.chunk_tokens
            ));
        }
        if self.sim_layers == 0 || self.sim_layers > self.shape.moe_layers() {
            return bad(format!(
                "--sample-layers must be in 1..={} (the model's MoE layers), got {}",
                self.shape.moe_layers(),
                self.sim_layers
            ));
        }
        if !Schedule::ALL.contains(&self.schedule) {
            return bad(format!(
                "schedule {} is not one the simulator costs (ultraep, pipelined, two-batch, overlapped)",
                self.schedule.name()
            ));
        }
        if let Some(us) = self.solve_us {
            if !(us.is_finite() && us >= 0.0) {
                return bad(format!(
                    "--solve-us must be a non-negative number, got {us}"
                ));
            }
        }
        Ok(())
    }

    /// Refuses steps of more than [`MAX_STEP_COUNTS`] load counts (`layers` matrices of
    /// `ep x experts`): a step's routing is held whole.
    pub(super) fn check_step_size(&self, layers: usize) -> Result<(), SimError> {
        let counts = layers
            .saturating_mul(self.ep)
            .saturating_mul(self.shape.experts);
        if counts > MAX_STEP_COUNTS {
            return Err(SimError::Input(format!(
                "{layers} simulated layers x {} ranks x {} experts is {counts} load counts per \
                 step, more than {MAX_STEP_COUNTS} (simulate fewer layers or use a smaller --ep-size)",
                self.ep, self.shape.experts
            )));
        }
        Ok(())
    }

    /// Redundant-slot memory per GPU, GB (1e9 bytes): a slot per micro-batch of the schedule,
    /// per MoE layer with [`SlotMemory::PerLayer`].
    pub fn slot_gb_per_gpu(&self) -> f64 {
        let layers = match self.slot_memory {
            SlotMemory::Shared => 1,
            SlotMemory::PerLayer => self.shape.moe_layers(),
        };
        (self.slots * self.schedule.micro_batches * layers) as f64
            * self.shape.moe_dims().expert_bytes() as f64
            / 1e9
    }

    /// The step cost model on this spec's rack and shape.
    pub fn cost(&self) -> StepCost<'_> {
        StepCost {
            rack: &self.rack,
            shape: &self.shape,
        }
    }
}
