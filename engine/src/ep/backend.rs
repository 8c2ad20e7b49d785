//! Where a runtime's model and MoE data plane run, and each micro-batch's share of them for a
//! step: the one place that knows both backends (the variants carry the `cfg`), so the layer
//! loop (`step`) and the runtime never name a backend's types.

use std::sync::Arc;

use rackfill_models::MoeModel;

#[cfg(feature = "cuda")]
use super::device::{DeviceModel, OnDevice};
use crate::plane::cpu::{CpuPlane, MicroPlane};

/// The model and the data plane of a runtime.
pub(super) enum Backend {
    /// The model on the host (candle, f32), the CPU data plane beside it.
    Host {
        model: Arc<MoeModel>,
        plane: CpuPlane,
    },
    /// The model and the data plane on a device (a GPU, or the host emulator).
    #[cfg(feature = "cuda")]
    Device(Box<OnDevice>),
}

/// The model, shared by the micro-batches of a step.
#[derive(Clone, Copy)]
pub(super) enum ModelRef<'m> {
    Host(&'m MoeModel),
    #[cfg(feature = "cuda")]
    Device(DeviceModel<'m>),
}

/// One micro-batch's share of the data plane: its own slots on the host, its own lane of
/// streams (and slots, planner, solver) on a device.
pub(super) enum Lane<'p> {
    Host(MicroPlane<'p>),
    #[cfg(feature = "cuda")]
    Device(&'p mut rackfill_kernels::cuda::moe::MoeLane),
}

impl Backend {
    /// The model and one lane per micro-batch of the schedule.
    pub fn split(&mut self) -> (ModelRef<'_>, Vec<Lane<'_>>) {
        match self {
            Backend::Host { model, plane } => (
                ModelRef::Host(model),
                plane.micro_planes().into_iter().map(Lane::Host).collect(),
            ),
            #[cfg(feature = "cuda")]
            Backend::Device(device) => {
                let (model, lanes) = device.split();
                (
                    ModelRef::Device(model),
                    lanes.iter_mut().map(Lane::Device).collect(),
                )
            }
        }
    }

    /// A copy of local rank `rank`'s redundant slot `slot` of micro-batch `micro_batch` in the
    /// slots model layer `layer` uses.
    pub fn slot_contents(
        &self,
        (micro_batch, layer): (usize, usize),
        rank: usize,
        slot: usize,
    ) -> Option<Vec<f32>> {
        match self {
            Backend::Host { plane, .. } => plane.slot_contents((micro_batch, layer), rank, slot),
            #[cfg(feature = "cuda")]
            Backend::Device(device) => device.slot_contents((micro_batch, layer), rank, slot),
        }
    }
}
