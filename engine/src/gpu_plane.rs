//! The MoE data plane on a GPU (feature `cuda`): every rank's expert weights, slots and token
//! buffers on one device, run by [`rackfill_kernels::cuda::moe::GpuMoe`].
//!
//! The router, attention, shared experts and the residual stay where the model runs (the CPU);
//! per MoE layer the runtime hands this plane the routed activations and gets the routed-expert
//! outputs back. With a quota balancer the plan is solved on the device too, and the relay trees,
//! tile tasks, replica streaming and token permute all read it there; other balancers plan on
//! the host and the plan is uploaded.

use rackfill_balancer::quota::TargetRule;
use rackfill_balancer::{Algo, Layout, LoadMatrix, Plan};
use rackfill_kernels::cuda::moe::{ExpertWeights, GpuMoe, LayerRun, RankInput};
use rackfill_kernels::cuda::{CudaError, Gpu};
use rackfill_models::{FeedForward, MoeModel};

use crate::ep::EpConfig;
use crate::error::{EngineError, Result};

/// The GPU data plane of one model.
pub(crate) struct GpuPlane {
    moe: GpuMoe,
    /// Model layer index to its index among the MoE layers.
    moe_ordinal: Vec<Option<usize>>,
}

impl GpuPlane {
    /// Opens device `ordinal`, compiles the kernels and uploads every MoE layer's experts.
    pub(crate) fn open(
        model: &MoeModel,
        layout: &Layout,
        config: &EpConfig,
        ordinal: usize,
    ) -> Result<Self> {
        let gpu = Gpu::open(ordinal).map_err(gpu_error)?;
        let mc = model.config();
        let mut moe_ordinal = Vec::with_capacity(model.layers().len());
        let mut layers: Vec<Vec<ExpertWeights<'_>>> = Vec::new();
        for layer in model.layers() {
            match layer.ffn() {
                FeedForward::Moe(block) => {
                    moe_ordinal.push(Some(layers.len()));
                    layers.push(block.experts.iter().map(|e| e.weights()).collect());
                }
                FeedForward::Dense(_) => moe_ordinal.push(None),
            }
        }
        let solver = match config.balancer {
            Algo::Quota => Some((config.settings.u_min, TargetRule::BestFit)),
            Algo::QuotaPaper => Some((config.settings.u_min, TargetRule::LargestSlack)),
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
        moe.set_verify(config.verify_plans);
        Ok(Self { moe, moe_ordinal })
    }

    /// Whether plans are solved on the device.
    pub(crate) fn solves(&self) -> bool {
        self.moe.has_solver()
    }

    /// Solves model layer `layer`'s `load` on the device (only when [`Self::solves`]) and starts
    /// its replica distribution there.
    pub(crate) fn solve(&mut self, layer: usize, load: &LoadMatrix) -> Result<Plan> {
        let ordinal = self.moe_ordinal(layer)?;
        self.moe.solve_layer(ordinal, load).map_err(gpu_error)
    }

    /// Replication (over the relay trees of the engine's [`rackfill_balancer::relay::RelayConfig`],
    /// as on the CPU plane), dispatch, expert compute and combine of model layer `layer`.
    pub(crate) fn run_layer(
        &mut self,
        layer: usize,
        plan: &Plan,
        inputs: &[RankInput<'_>],
        top_k: usize,
    ) -> Result<LayerRun> {
        let ordinal = self.moe_ordinal(layer)?;
        self.moe
            .run_layer(ordinal, plan, inputs, top_k)
            .map_err(gpu_error)
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

fn gpu_error(err: CudaError) -> EngineError {
    EngineError::Gpu(err.to_string())
}
