//! The MoE data plane on a GPU (feature `cuda`): every rank's expert weights, slots and token
//! buffers on one device, run by [`rackfill_kernels::cuda::moe::GpuMoe`].
//!
//! The router, attention, shared experts and the residual stay where the model runs (the CPU);
//! per MoE layer the runtime hands this plane the routed activations and gets the routed-expert
//! outputs back. With a quota balancer the plan is solved on the device too, and the relay trees,
//! tile tasks, replica streaming and token permute all read it there; other balancers plan on
//! the host and the plan is uploaded. The ranks share the device, so the plane needs a fabric
//! whose process holds every rank.

use candle_core::{Device, Tensor};
use rackfill_balancer::quota::TargetRule;
use rackfill_balancer::{Algo, Layout, LoadMatrix, Plan};
use rackfill_kernels::cuda::moe::{ExpertWeights, GpuMoe, LayerInFlight, LayerRun, RankInput};
use rackfill_kernels::cuda::{CudaError, Gpu};
use rackfill_models::{FeedForward, MoeModel};

use super::work::{LayerWork, PhaseTimes, PlaneConfig, PlaneOutput};
use crate::error::{EngineError, Result};

/// The GPU data plane of one model.
pub(crate) struct GpuPlane {
    /// One lane per micro-batch in flight; the first has the device solver.
    lanes: Vec<GpuMoe>,
    /// Model layer index to its index among the MoE layers.
    moe_ordinal: Vec<Option<usize>>,
}

/// One micro-batch's lane of the GPU plane (`plane::MicroPlane` on a GPU): its layer stages
/// queue device work on the lane's own streams.
pub(crate) struct GpuLane<'p> {
    moe: &'p mut GpuMoe,
    moe_ordinal: &'p [Option<usize>],
}

impl GpuPlane {
    /// Opens device `ordinal`, compiles the kernels and uploads every MoE layer's experts for
    /// `layout`; solves on the device when `config.balancer` is a quota planner.
    pub(crate) fn open(
        model: &MoeModel,
        layout: &Layout,
        config: &PlaneConfig,
        ordinal: usize,
    ) -> Result<Self> {
        let gpu = Gpu::open(ordinal).map_err(gpu_error)?;
        let mc = model.config();
        let (moe_ordinal, layers) = expert_weights(model)?;
        let solver = match config.balancer {
            Algo::Quota => Some((config.u_min, TargetRule::BestFit)),
            Algo::QuotaPaper => Some((config.u_min, TargetRule::LargestSlack)),
            _ => None,
        };
        let mut moe = GpuMoe::new(
            &gpu,
            layout,
            mc.hidden_size,
            mc.moe.intermediate_size,
            &layers,
            solver,
            config.relay,
        )
        .map_err(gpu_error)?;
        moe.set_verify(config.verify);
        moe.set_pipelined_experts(config.pipelined_experts);
        let mut lanes = vec![moe];
        if config.micro_batches > 1 {
            let second = lanes[0].another_lane().map_err(gpu_error)?;
            lanes.push(second);
        }
        Ok(Self { lanes, moe_ordinal })
    }

    /// Each micro-batch's lane, in order.
    pub(crate) fn lanes(&mut self) -> Vec<GpuLane<'_>> {
        let moe_ordinal = &self.moe_ordinal;
        self.lanes
            .iter_mut()
            .map(|moe| GpuLane { moe, moe_ordinal })
            .collect()
    }

    /// Solves model layer `layer`'s `load` on the device and starts its replica distribution
    /// there; `None` when this plane has no device solver for the balancer.
    pub(crate) fn solve(&mut self, layer: usize, load: &LoadMatrix) -> Result<Option<Plan>> {
        if !self.lanes[0].has_solver() {
            return Ok(None);
        }
        let ordinal = moe_ordinal(&self.moe_ordinal, layer)?;
        self.lanes[0]
            .solve_layer(ordinal, load)
            .map(Some)
            .map_err(gpu_error)
    }

    /// Replication (over the relay trees of the plane's relay config, as on the CPU plane),
    /// dispatch, expert compute and combine of one layer, its outputs back as tensors.
    pub(crate) fn run_layer(&mut self, work: &LayerWork<'_>) -> Result<PlaneOutput> {
        let ordinal = moe_ordinal(&self.moe_ordinal, work.layer)?;
        let run = self.lanes[0]
            .run_layer(ordinal, work.plan, &rank_inputs(work), work.top_k)
            .map_err(gpu_error)?;
        plane_output(run, work.hidden)
    }

    /// What rank `rank`'s redundant slot `slot` holds in micro-batch `micro_batch`'s lane (a
    /// download; tests and debugging).
    pub(crate) fn slot_contents(
        &self,
        micro_batch: usize,
        rank: usize,
        slot: usize,
    ) -> Option<Vec<f32>> {
        self.lanes.get(micro_batch)?.slot_contents(rank, slot).ok()
    }
}

impl GpuLane<'_> {
    /// Queues the layer's replicas (its plan uploaded) and its dispatch on this lane.
    pub(crate) fn send(&mut self, work: &LayerWork<'_>) -> Result<LayerInFlight> {
        let ordinal = moe_ordinal(self.moe_ordinal, work.layer)?;
        self.moe
            .dispatch_layer(ordinal, work.plan, &rank_inputs(work), work.top_k)
            .map_err(|e| layer_error(work.layer, e))
    }

    /// Queues the layer's expert GEMMs on this lane.
    pub(crate) fn compute(&self, work: &LayerWork<'_>, flight: &mut LayerInFlight) -> Result<()> {
        self.moe
            .experts_layer(flight)
            .map_err(|e| layer_error(work.layer, e))
    }

    /// Queues the combine and waits for the layer's outputs.
    pub(crate) fn combine(
        &self,
        work: &LayerWork<'_>,
        flight: LayerInFlight,
    ) -> Result<PlaneOutput> {
        let run = self
            .moe
            .combine_layer(flight)
            .map_err(|e| layer_error(work.layer, e))?;
        plane_output(run, work.hidden)
    }
}

/// Model layer `layer`'s index among the MoE layers.
fn moe_ordinal(moe_ordinal: &[Option<usize>], layer: usize) -> Result<usize> {
    moe_ordinal
        .get(layer)
        .copied()
        .flatten()
        .ok_or_else(|| EngineError::Config(format!("layer {layer} is not an MoE layer")))
}

/// Every local rank's routed rows as the device plane takes them.
fn rank_inputs<'w>(work: &'w LayerWork<'_>) -> Vec<RankInput<'w>> {
    work.routed
        .iter()
        .map(|(xs, routing)| RankInput {
            x: xs,
            experts: &routing.experts,
            weights: &routing.weights,
        })
        .collect()
}

/// Per model layer, its index among the MoE layers (`None` for a dense layer), and every MoE
/// layer's experts as the engine stores them: what a device data plane uploads. Every rank is on
/// the device, so every expert is someone's home and the model holds them all.
pub(crate) type MoeExperts<'a> = (Vec<Option<usize>>, Vec<Vec<ExpertWeights<'a>>>);

/// The [`MoeExperts`] of `model`.
pub(crate) fn expert_weights(model: &MoeModel) -> Result<MoeExperts<'_>> {
    let mut moe_ordinal = Vec::with_capacity(model.layers().len());
    let mut layers: Vec<Vec<ExpertWeights<'_>>> = Vec::new();
    for layer in model.layers() {
        match layer.ffn() {
            FeedForward::Moe(block) => {
                moe_ordinal.push(Some(layers.len()));
                let experts = (0..block.experts.num_experts() as u32)
                    .map(|e| block.experts.get(e).map(|mlp| mlp.weights()))
                    .collect::<Result<_, _>>()?;
                layers.push(experts);
            }
            FeedForward::Dense(_) => moe_ordinal.push(None),
        }
    }
    Ok((moe_ordinal, layers))
}

/// A device layer's results as the plane's output: `tokens x hidden` rows as tensors, the bytes
/// each rank received (tokens and replicas), the device's phase times.
fn plane_output(run: LayerRun, hidden: usize) -> Result<PlaneOutput> {
    let routed = run
        .outputs
        .into_iter()
        .map(|rows| {
            let tokens = rows.len() / hidden.max(1);
            (!rows.is_empty())
                .then(|| Tensor::from_vec(rows, (tokens, hidden), &Device::Cpu))
                .transpose()
                .map_err(|e| rackfill_models::ModelError::from(e).into())
        })
        .collect::<Result<_>>()?;
    let recv_bytes = super::received_bytes(&run.token_recv_bytes, &run.replica_recv_bytes);
    let device = run.phases;
    Ok(PlaneOutput {
        routed,
        recv_bytes,
        replica_bytes: run.replica_recv_bytes.iter().sum(),
        phases: PhaseTimes {
            replicate: device.replicate,
            dispatch: device.dispatch,
            experts: device.experts,
            combine: device.combine,
            ..PhaseTimes::default()
        },
    })
}

fn gpu_error(err: CudaError) -> EngineError {
    EngineError::Gpu(err.to_string())
}

/// A device error of model layer `layer` (the micro-batch stages name it themselves; the plane's
/// own calls are named by `plane::at_layer`).
fn layer_error(layer: usize, err: CudaError) -> EngineError {
    EngineError::Gpu(format!("layer {layer}: {err}"))
}
