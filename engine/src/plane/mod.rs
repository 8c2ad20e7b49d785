//! The MoE data plane: replica streaming, dispatch, expert compute and combine of one layer once
//! its plan is known, on the CPU ([`cpu`], every build) or on a GPU (`gpu`, feature `cuda`).
//!
//! [`Plane`] is the one type the EP runtime talks to: [`Plane::run_layer`] returns the layer's
//! routed output and its phase times, [`Plane::solve_on_device`] lets a plane that can solve its
//! plans where its data lives do so. Which backend runs, and whether this build has a GPU one at
//! all, is decided here and nowhere else.

mod cpu;
#[cfg(feature = "cuda")]
mod gpu;
mod micro;
mod slots;
mod work;

#[cfg(feature = "cuda")]
pub(crate) use gpu::expert_weights;
pub(crate) use micro::{Computed, MicroPlane, Sent};
#[cfg(feature = "cuda")]
pub(crate) use work::received_bytes;
pub use work::PhaseTimes;
pub(crate) use work::{LayerWork, PlaneConfig, PlaneOutput};

use std::ops::Range;

use rackfill_balancer::{Layout, LoadMatrix, Plan};
use rackfill_models::MoeModel;

use crate::error::{EngineError, Result};
use crate::fabric::Fabric;
use crate::rack_cost::SlotMemory;

/// Where the MoE layers' data plane (replica streaming, dispatch, expert compute, combine) runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DataPlane {
    /// Host memory and the model's own expert MLP (every build).
    #[default]
    Cpu,
    /// Every rank's experts, slots and token buffers on GPU `ordinal`, CUDA kernels and cuBLAS
    /// (builds with feature `cuda`; the router, attention and shared experts stay on the CPU).
    Gpu { ordinal: usize },
}

impl std::fmt::Display for DataPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DataPlane::Cpu => f.write_str("cpu"),
            DataPlane::Gpu { ordinal } => write!(f, "gpu:{ordinal}"),
        }
    }
}

impl std::str::FromStr for DataPlane {
    type Err = String;

    /// `cpu`, `gpu` (device 0) or `gpu:N`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cpu" => Ok(DataPlane::Cpu),
            "gpu" => Ok(DataPlane::Gpu { ordinal: 0 }),
            other => other
                .strip_prefix("gpu:")
                .and_then(|n| n.parse().ok())
                .map(|ordinal| DataPlane::Gpu { ordinal })
                .ok_or_else(|| {
                    format!("unknown data plane '{other}' (expected cpu, gpu or gpu:N)")
                }),
        }
    }
}

/// The data plane of one EP runtime.
pub(crate) struct Plane {
    backend: Backend,
}

/// The backends this build has.
enum Backend {
    Cpu(cpu::CpuPlane),
    #[cfg(feature = "cuda")]
    Gpu(Box<gpu::GpuPlane>),
}

impl Plane {
    /// Opens `choice` for `model` laid out as `layout`, holding the slots of the `local` ranks.
    pub(crate) fn open(
        choice: DataPlane,
        model: &MoeModel,
        layout: &Layout,
        local: Range<usize>,
        config: &PlaneConfig,
    ) -> Result<Self> {
        let backend = match choice {
            DataPlane::Cpu => {
                let mc = model.config();
                let moe_layers: Vec<bool> = model
                    .layers()
                    .iter()
                    .map(|l| matches!(l.ffn(), rackfill_models::FeedForward::Moe(_)))
                    .collect();
                Backend::Cpu(cpu::CpuPlane::new(
                    layout,
                    local,
                    (mc.hidden_size, mc.moe.intermediate_size),
                    &moe_layers,
                    config,
                ))
            }
            DataPlane::Gpu { .. } if config.slot_memory != SlotMemory::Shared => {
                return Err(EngineError::Config(
                    "per-layer replica slots live on the CPU data plane only (--slot-memory \
                     shared with --data-plane gpu)"
                        .into(),
                ))
            }
            DataPlane::Gpu { .. } if local.len() != layout.ranks() => {
                return Err(EngineError::Gpu(format!(
                    "every rank's buffers live on one device, but this process holds ranks \
                     {local:?} of {}",
                    layout.ranks()
                )))
            }
            #[cfg(feature = "cuda")]
            DataPlane::Gpu { ordinal } => Backend::Gpu(Box::new(gpu::GpuPlane::open(
                model, layout, config, ordinal,
            )?)),
            #[cfg(not(feature = "cuda"))]
            DataPlane::Gpu { .. } => {
                return Err(EngineError::Gpu(
                    "this build has no GPU data plane (built without feature `cuda`: \
                     the default build has it)"
                        .into(),
                ))
            }
        };
        Ok(Self { backend })
    }

    /// Solves model layer `layer`'s `load` where the plane's data lives, when it can (the GPU
    /// plane's device solver, which leaves the plan on the device for the permute); `None`: plan
    /// on the host.
    pub(crate) fn solve_on_device(
        &mut self,
        layer: usize,
        load: &LoadMatrix,
    ) -> Result<Option<Plan>> {
        match &mut self.backend {
            Backend::Cpu(_) => {
                let _ = load; // only a device plane reads it
                Ok(None)
            }
            #[cfg(feature = "cuda")]
            Backend::Gpu(gpu) => gpu.solve(layer, load),
        }
        .map_err(|e| at_layer(layer, e))
    }

    /// Replication, dispatch, expert compute and combine of one layer on the local ranks.
    pub(crate) fn run_layer(
        &mut self,
        fabric: &dyn Fabric,
        work: &LayerWork<'_>,
    ) -> Result<PlaneOutput> {
        match &mut self.backend {
            Backend::Cpu(cpu) => cpu.run_layer(fabric, work),
            #[cfg(feature = "cuda")]
            Backend::Gpu(gpu) => gpu.run_layer(work),
        }
        .map_err(|e| at_layer(work.layer, e))
    }

    /// Each micro-batch's share of the plane, for layers of two micro-batches in flight
    /// together: its own slots on the CPU, its own lane on a GPU.
    pub(crate) fn micro_planes(&mut self) -> Vec<MicroPlane<'_>> {
        match &mut self.backend {
            Backend::Cpu(cpu) => cpu
                .micro_planes()
                .into_iter()
                .map(MicroPlane::cpu)
                .collect(),
            #[cfg(feature = "cuda")]
            Backend::Gpu(gpu) => gpu.lanes().into_iter().map(MicroPlane::gpu).collect(),
        }
    }

    /// A copy of local rank `rank`'s redundant slot `slot` of micro-batch `micro_batch`, in the
    /// set model layer `layer` uses (what its last plan streamed there; read back from the
    /// micro-batch's lane on the GPU plane, which has one set per lane).
    pub(crate) fn slot_contents(
        &self,
        (micro_batch, layer): (usize, usize),
        rank: usize,
        slot: usize,
    ) -> Option<Vec<f32>> {
        match &self.backend {
            Backend::Cpu(cpu) => cpu.slot_contents((micro_batch, layer), rank, slot),
            #[cfg(feature = "cuda")]
            Backend::Gpu(gpu) => gpu.slot_contents(micro_batch, rank, slot),
        }
    }

    /// Every rank's slots as model layer `layer`'s last stream left them in micro-batch 0's
    /// per-layer set; `None` with shared slots or on a GPU.
    pub(crate) fn resident(&self, layer: usize) -> Option<Vec<Option<u32>>> {
        match &self.backend {
            Backend::Cpu(cpu) => cpu.resident(layer).map(<[_]>::to_vec),
            #[cfg(feature = "cuda")]
            Backend::Gpu(_) => None,
        }
    }
}

/// A device error names the layer it happened in.
fn at_layer(layer: usize, err: EngineError) -> EngineError {
    match err {
        EngineError::Gpu(why) => EngineError::Gpu(format!("layer {layer}: {why}")),
        other => other,
    }
}
