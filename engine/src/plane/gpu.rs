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
use rackfill_kernels::cuda::moe::{ExpertWeights, GpuMoe, LayerRun, RankInput};
use rackfill_kernels::cuda::{CudaError, Gpu};
use rackfill_models::{FeedForward, MoeModel};

use super::work::{LayerWork, PhaseTimes, PlaneConfig, PlaneOutput};
use crate::error::{EngineError, Result};

/// The GPU data plane of one model.
pub(crate) struct GpuPlane {
    moe: GpuMoe,
    /// Model layer index to its index among the MoE layers.
    moe_ordinal: Vec<Option<usize>>,
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
        Ok(Self { moe, moe_ordinal })
    }

    /// Solves model layer `layer`'s `load` on the device and starts its replica distribution
    /// there; `None` when this plane has no device solver for the balancer.
    pub(crate) fn solve(&mut self, layer: usize, load: &LoadMatrix) -> Result<Option<Plan>> {
        if !self.moe.has_solver() {
            return Ok(None);
        }
        let ordinal = self.moe_ordinal(layer)?;
        self.moe
            .solve_layer(ordinal, load)
            .map(Some)
            .map_err(gpu_error)
    }

    /// Replication (over the relay trees of the plane's relay config, as on the CPU plane),
    /// dispatch, expert compute and combine of one layer, its outputs back as tensors.
    pub(crate) fn run_layer(&mut self, work: &LayerWork<'_>) -> Result<PlaneOutput> {
        let ordinal = self.moe_ordinal(work.layer)?;
        let inputs: Vec<RankInput<'_>> = work
            .routed
            .iter()
            .map(|(xs, routing)| RankInput {
                x: xs,
                experts: &routing.experts,
                weights: &routing.weights,
            })
            .collect();
        let run = self
            .moe
            .run_layer(ordinal, work.plan, &inputs, work.top_k)
            .map_err(gpu_error)?;
        plane_output(run, work.hidden)
    }

    fn moe_ordinal(&self, layer: usize) -> Result<usize> {
        self.moe_ordinal
            .get(layer)
            .copied()
            .flatten()
            .ok_or_else(|| EngineError::Config(format!("layer {layer} is not an MoE layer")))
    }

    /// What rank `rank`'s redundant slot `slot` holds (a download; tests and debugging).
    pub(crate) fn slot_contents(&self, rank: usize, slot: usize) -> Option<Vec<f32>> {
        self.moe.slot_contents(rank, slot).ok()
    }
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
