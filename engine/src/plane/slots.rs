//! The CPU plane's redundant slots of one micro-batch: one set shared by every MoE layer
//! (`SlotMemory::Shared`, UltraEP §4.1), or one set per MoE layer (`SlotMemory::PerLayer`), where
//! a replica still resident from the layer's last plan is kept instead of streamed again.

use std::ops::Range;

use rackfill_balancer::Plan;

use crate::error::{EngineError, Result};
use crate::rack_cost::SlotMemory;

/// One micro-batch's slot sets for the local ranks.
pub(crate) struct SlotSets {
    /// `[set][local rank]`: `n_slot` slots of `expert_floats` f32s each.
    sets: Vec<Vec<Vec<f32>>>,
    /// Per model layer: its set (`None` for dense layers).
    set_of_layer: Vec<Option<usize>>,
    /// With per-layer sets, `[set]`: every rank's slots after the set's last completed stream
    /// (`R x n_slot`, as [`Plan::slots`], all `None` at first): what is resident. Shared sets
    /// track nothing (another layer's replicas are no use).
    resident: Option<Vec<Vec<Option<u32>>>>,
    expert_floats: usize,
}

impl SlotSets {
    /// Slots for the `local` ranks of `ranks`, `n_slot` slots each, for the MoE layers
    /// `moe_layers` marks.
    pub(crate) fn new(
        memory: SlotMemory,
        moe_layers: &[bool],
        (local, ranks): (Range<usize>, usize),
        n_slot: usize,
        expert_floats: usize,
    ) -> Self {
        let mut ordinal = 0;
        let set_of_layer: Vec<Option<usize>> = moe_layers
            .iter()
            .map(|&moe| {
                moe.then(|| match memory {
                    SlotMemory::Shared => 0,
                    SlotMemory::PerLayer => {
                        ordinal += 1;
                        ordinal - 1
                    }
                })
            })
            .collect();
        let count = match memory {
            SlotMemory::Shared => 1,
            SlotMemory::PerLayer => ordinal.max(1),
        };
        Self {
            sets: (0..count)
                .map(|_| {
                    local
                        .clone()
                        .map(|_| vec![0f32; n_slot * expert_floats])
                        .collect()
                })
                .collect(),
            set_of_layer,
            resident: (memory == SlotMemory::PerLayer)
                .then(|| vec![vec![None; ranks * n_slot]; count]),
            expert_floats,
        }
    }

    fn set(&self, layer: usize) -> Result<usize> {
        self.set_of_layer
            .get(layer)
            .copied()
            .flatten()
            .ok_or_else(|| EngineError::Config(format!("layer {layer} has no replica slots")))
    }

    /// Per local rank, the slot buffer model layer `layer` streams into and computes from.
    pub(crate) fn buffers(&self, layer: usize) -> Result<&[Vec<f32>]> {
        Ok(&self.sets[self.set(layer)?])
    }

    /// [`Self::buffers`], to write.
    pub(crate) fn buffers_mut(&mut self, layer: usize) -> Result<&mut [Vec<f32>]> {
        let set = self.set(layer)?;
        Ok(&mut self.sets[set])
    }

    /// Every rank's slots as `layer`'s last completed stream left them (all `None` before the
    /// first), with per-layer sets; `None` with shared sets.
    pub(crate) fn resident(&self, layer: usize) -> Option<&[Option<u32>]> {
        let set = self.set(layer).ok()?;
        Some(&self.resident.as_ref()?[set])
    }

    /// Before `plan` streams into `layer`'s set: every replica the set already holds on a local
    /// rank (`local[i]` is local rank `i`'s world rank) is copied to the slot `plan` gives it on
    /// that rank, since slots are numbered per plan. Nothing moves between ranks. Until
    /// [`Self::mark_streamed`], the set counts as holding nothing, so a stream that fails
    /// half-way leaves no stale record.
    pub(crate) fn keep_resident(&mut self, layer: usize, plan: &Plan, local: &Range<usize>) {
        let (Ok(set), Some(resident)) = (self.set(layer), self.resident.as_mut()) else {
            return;
        };
        let previous = std::mem::replace(&mut resident[set], vec![None; plan.slots().len()]);
        let (n_slot, floats) = (plan.slots_per_rank(), self.expert_floats);
        for (rank, buffer) in local.clone().zip(self.sets[set].iter_mut()) {
            let before = &previous[rank * n_slot..(rank + 1) * n_slot];
            let after = plan.rank_slots(rank);
            if before == after {
                continue;
            }
            let old = buffer.clone();
            for (slot, expert) in after.iter().enumerate() {
                let Some(from) = expert.and_then(|e| before.iter().position(|&b| b == Some(e)))
                else {
                    continue;
                };
                buffer[slot * floats..(slot + 1) * floats]
                    .copy_from_slice(&old[from * floats..(from + 1) * floats]);
            }
        }
    }

    /// Records what `layer`'s set holds once `plan` has streamed (per-layer sets only).
    pub(crate) fn mark_streamed(&mut self, layer: usize, plan: &Plan) {
        if let (Ok(set), Some(resident)) = (self.set(layer), self.resident.as_mut()) {
            resident[set] = plan.slots().to_vec();
        }
    }

    /// The contents of local rank `index`'s slot `slot` in `layer`'s set.
    pub(crate) fn contents(&self, layer: usize, index: usize, slot: usize) -> Option<Vec<f32>> {
        let floats = self.expert_floats;
        let start = slot.checked_mul(floats)?;
        self.buffers(layer)
            .ok()?
            .get(index)?
            .get(start..start.checked_add(floats)?)
            .map(<[f32]>::to_vec)
    }
}
