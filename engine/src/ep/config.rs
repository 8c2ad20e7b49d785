//! The runtime's configuration and reports, and the rules that follow from the configuration
//! alone: the expert layout, the planners, what the data plane is told, resident replicas.

use std::ops::Range;

use candle_core::Tensor;

use rackfill_balancer::metrics::PlanMetrics;
use rackfill_balancer::relay::RelayConfig;
use rackfill_balancer::reuse::{moves_replicas_of, prefer_resident};
use rackfill_balancer::{Algo, Balancer, Layout, LoadMatrix, Plan, Settings};
use rackfill_models::{FeedForward, ModelConfig, MoeModel};

use crate::error::{EngineError, Result};
use crate::fabric::Fabric;
use crate::plane::{PhaseTimes, PlaneConfig};
use crate::rack_cost::{Schedule, SimulatedMakespan, SlotMemory};

/// How the runtime is laid out and balanced.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EpConfig {
    /// `R`, ranks in the EP group (all of them in this process with the in-process fabric).
    pub ep_size: usize,
    /// `n_slot`, redundant expert slots per rank (shared by all layers).
    pub redundant_slots: usize,
    pub balancer: Algo,
    pub settings: Settings,
    pub relay: RelayConfig,
    /// Solve every layer's plan once per local rank, each from its own copy of the gathered load,
    /// and fail unless all plans are identical (what a multi-host deployment relies on; costs one
    /// solve per rank, so tests turn it on). With the GPU solver, the host planners must agree
    /// with it; on a device, the tile stream built there must equal the host compiler's.
    pub verify_plans: bool,
    /// How a step's phases overlap (`--schedule`): micro-batches each step's sequences are split
    /// into (1 or 2; with 2, one micro-batch communicates while the other computes, each with
    /// its own load, plan and replica slots, on the device each on its own lane of streams), and
    /// whether experts are pipelined (dispatch and main-expert GEMMs run while the replicas
    /// stream; only replica instances wait for them, on the device each for its own slot).
    pub schedule: Schedule,
    /// One set of redundant slots shared by every MoE layer (UltraEP §4.1), or one set per MoE
    /// layer (`PerLayer`), keeping replicas resident between steps.
    pub slot_memory: SlotMemory,
    /// With per-layer slots and a quota balancer: move replicas onto ranks that still hold the
    /// same expert while the busiest rank's load stays within this fraction of the solved
    /// plan's (`rackfill_balancer::reuse::prefer_resident`); `None`: plans as solved.
    pub reuse_tolerance: Option<f64>,
    /// On a device with a quota balancer: solve each layer's plan there (the quota solver in
    /// one block, the relay planner reading the plan where it is) instead of on the host and
    /// uploading it. Off by default: on an H100 the host planner solves the R=64, E=256 layer
    /// in 0.050 ms, the device solver in 0.278 ms (docs/gpu.md).
    pub plan_on_device: bool,
    /// On a device, with ranks in several processes: cross between them through peer memory
    /// (`--moe-transport peer`: every rank's receive side mapped into every process, bytes
    /// device to device) when every process can map its peers, else through host buffers and
    /// the fabric.
    pub peer_memory: bool,
}

impl Default for EpConfig {
    fn default() -> Self {
        Self {
            ep_size: 8,
            redundant_slots: 2,
            balancer: Algo::Quota,
            settings: Settings::default(),
            relay: RelayConfig::default(),
            verify_plans: false,
            schedule: Schedule::ULTRAEP,
            slot_memory: SlotMemory::Shared,
            reuse_tolerance: Some(0.02),
            plan_on_device: false,
            peer_memory: true,
        }
    }
}

/// What one MoE layer of one step did.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerReport {
    pub layer: usize,
    /// The micro-batch of the step this report is for (0 with one micro-batch a step).
    pub micro_batch: usize,
    /// The exact load the plan was solved on (`load[r][e]`, token-expert pairs).
    pub load: LoadMatrix,
    pub metrics: PlanMetrics,
    /// Per rank: the expert each redundant slot holds after this layer.
    pub slots: Vec<Vec<Option<u32>>>,
    /// Replica weight bytes this process's ranks received.
    pub replica_bytes: u64,
    /// Per local rank (the fabric's, in order): bytes received from other ranks, dispatched rows,
    /// combined outputs and replica weights.
    pub recv_bytes: Vec<u64>,
    /// This layer's load and plan costed on the runtime's rack (`EpRuntime::set_rack`) by the
    /// cost model `rackfill simulate` uses, with the plan and without balancing.
    pub simulated: SimulatedMakespan,
    /// Plan solve time on one rank.
    pub solve_us: f64,
    pub phases: PhaseTimes,
}

/// The output of one EP step.
pub struct StepOutput {
    /// Per local rank: logits `[rows, V]`, or `None` when the rank had no tokens.
    pub logits: Vec<Option<Tensor>>,
    /// One report per MoE layer, in layer order.
    pub layers: Vec<LayerReport>,
}

/// How `EpRuntime::slot_contents` lays an expert out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotLayout {
    /// f32, `[H, 2I]` gate-up then `[I, H]` down (the host model's experts).
    HostF32,
    /// bf16 widened to f32, `[2I, H]` (gate rows, then up rows) then `[H, I]` down.
    DeviceBf16,
}

/// What the data plane is told: relay trees, balancer, checks and schedule. `device`: the plane
/// copies replicas beside its compute, so pipelined experts act on every micro-batch; on the
/// host they act on one micro-batch only (with two, each micro-batch's replicas already stream
/// under the other's compute).
pub(super) fn plane_config(config: &EpConfig, device: bool) -> PlaneConfig {
    let schedule = config.schedule;
    PlaneConfig {
        relay: config.relay,
        balancer: config.balancer,
        plan_on_device: config.plan_on_device,
        u_min: config.settings.u_min,
        verify: config.verify_plans,
        micro_batches: schedule.micro_batches,
        slot_memory: config.slot_memory,
        pipelined_experts: schedule.pipelined_experts && (device || schedule.micro_batches == 1),
    }
}

/// Fails unless the schedule runs 1 or 2 micro-batches, and unless plans solved on the device
/// have a device (`on_device`) and a quota balancer to solve them; warns when the CPU runs a
/// schedule as a simpler one.
pub(super) fn check_config(config: &EpConfig, on_device: bool) -> Result<()> {
    config.schedule.check().map_err(EngineError::Config)?;
    if config.plan_on_device && !on_device {
        return Err(EngineError::Config(
            "plans solved on the device need the model on one (--device cuda)".into(),
        ));
    }
    if config.plan_on_device && !matches!(config.balancer, Algo::Quota | Algo::QuotaPaper) {
        return Err(EngineError::Config(format!(
            "the device solves quota plans only; balancer {} plans on the host",
            config.balancer
        )));
    }
    let schedule = config.schedule;
    if !on_device && schedule.pipelined_experts && schedule.micro_batches > 1 {
        tracing::warn!(
            "schedule {}: on the CPU the experts of two micro-batches are not pipelined; \
             it runs as two-batch",
            schedule.name()
        );
    }
    Ok(())
}

/// Fails unless `fabric` holds a non-empty run of the `config.ep_size` ranks.
pub(super) fn check_group(config: &EpConfig, fabric: &dyn Fabric) -> Result<()> {
    let local = fabric.local_ranks();
    if config.ep_size == 0
        || fabric.world_size() != config.ep_size
        || local.is_empty()
        || local.end > config.ep_size
    {
        return Err(EngineError::Config(format!(
            "EP size {} with a fabric holding ranks {local:?} of {}",
            config.ep_size,
            fabric.world_size()
        )));
    }
    Ok(())
}

/// Per layer (`None` for dense layers): one planner per local rank (`local` of them) when plans
/// are verified, else one.
pub(super) fn planners(
    model: &ModelConfig,
    config: &EpConfig,
    local: usize,
) -> Vec<Option<Vec<Box<dyn Balancer>>>> {
    let per_layer = if config.verify_plans { local } else { 1 };
    model
        .sparse_layers
        .iter()
        .map(|&moe| {
            moe.then(|| {
                (0..per_layer)
                    .map(|_| config.balancer.build(&config.settings))
                    .collect()
            })
        })
        .collect()
}

/// The expert layout of an EP group: `ep_size` ranks, each homing a contiguous run of the model's
/// routed experts, with `redundant_slots` slots (the one rule for the runtime and for what a
/// process loads).
pub(super) fn home_layout(model: &ModelConfig, config: &EpConfig) -> Result<Layout> {
    Ok(Layout::contiguous(
        config.ep_size,
        model.moe.num_experts,
        config.redundant_slots,
    )?)
}

/// Fails unless `model` holds, in every MoE layer, every routed expert homed on the `local`
/// ranks: what the data plane computes main instances with and streams replicas from.
pub(super) fn check_home_experts(
    model: &MoeModel,
    layout: &Layout,
    local: Range<usize>,
) -> Result<()> {
    for (index, layer) in model.layers().iter().enumerate() {
        let FeedForward::Moe(block) = layer.ffn() else {
            continue;
        };
        for rank in local.clone() {
            if let Some(missing) = layout
                .main_experts(rank)
                .iter()
                .find(|&&e| !block.experts.is_loaded(e))
            {
                return Err(EngineError::Config(format!(
                    "rank {rank} homes expert {missing} of layer {index}, but the model holds \
                     {} of {} there: load the experts of ranks {local:?} \
                     (EpRuntime::expert_selection)",
                    block.experts.selection(),
                    block.experts.num_experts()
                )));
            }
        }
    }
    Ok(())
}

/// `plan` with its replicas moved onto ranks that still hold the same expert (`resident`, the
/// layer's last plan's slots), within [`EpConfig::reuse_tolerance`]; quota balancers only
/// (their split is locality-first), and as solved otherwise.
pub(super) fn reuse_resident(
    config: &EpConfig,
    layout: &Layout,
    load: &LoadMatrix,
    plan: Plan,
    resident: Option<&[Option<u32>]>,
) -> Plan {
    match (config.reuse_tolerance, resident) {
        (Some(tolerance), Some(resident)) if moves_replicas_of(config.balancer) => {
            prefer_resident(layout, load, &plan, resident, tolerance)
        }
        _ => plan,
    }
}
