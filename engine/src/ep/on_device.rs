//! What the EP runtime keeps on its GPU (or the host emulator standing in for one): the model's
//! dense parts and, when every rank is in this process, the bf16 MoE data plane beside them.

use rackfill_kernels::cuda::device_moe::DeviceMoe;
use rackfill_models::gpu::GpuModel;

/// The runtime's device state (see `ep/device.rs` for how a step runs on it).
pub(crate) struct OnDevice {
    pub(super) model: GpuModel,
    /// The MoE data plane on the same device, when every rank is in this process.
    pub(super) moe: Option<DeviceMoe>,
    /// Per model layer: its index among the MoE layers (empty without `moe`).
    pub(super) moe_ordinal: Vec<Option<usize>>,
}

impl OnDevice {
    /// Rank `rank`'s slot `slot` on the device data plane, widened to f32 (`None` without that
    /// plane; `Some(None)` for a slot it does not have).
    pub(super) fn slot_contents(&self, rank: usize, slot: usize) -> Option<Option<Vec<f32>>> {
        self.moe
            .as_ref()
            .map(|moe| moe.slot_contents(rank, slot).ok())
    }
}
