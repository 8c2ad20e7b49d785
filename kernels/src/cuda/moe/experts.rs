//! The routed experts a process computes with, in device memory: per local rank one home buffer
//! holding its main experts of every MoE layer back to back, each expert in bf16 as a
//! checkpoint stores its linear layers (`[2I, H]`: the gate projection's rows, then the up
//! projection's; then `[H, I]`, the down projection), so a checkpoint's tensors are copied in
//! without a transpose, and a replica is one contiguous run of bytes.

use std::ops::Range;

use rackfill_balancer::Layout;

use super::super::exec::{f32_to_bf16, DeviceBuffer, Executor};
use super::super::CudaError;
use crate::permute::check_len;
use crate::KernelError;

/// One expert's weights in f32 as the engine's CPU model stores them: `[H, 2I]` gate-up (gate
/// columns first), then `[I, H]` down, row-major.
pub type ExpertWeights<'a> = [&'a [f32]; 2];

/// Bytes of one expert in the device layout: `(2I·H + H·I)` bf16 values.
pub fn expert_bytes(hidden: usize, inter: usize) -> usize {
    3 * hidden * inter * 2
}

/// Every local rank's home buffer and where each expert starts in it.
pub struct HomeExperts {
    /// Per local rank (in order): its main experts of every MoE layer.
    pub buffers: Vec<DeviceBuffer>,
    /// `[moe layer][expert]`: byte offset of the expert in its home rank's buffer (experts homed
    /// on other processes' ranks: 0, never read).
    pub offsets: Vec<Vec<u64>>,
    /// Bytes of one expert.
    pub expert_bytes: usize,
}

impl HomeExperts {
    /// Zeroed home buffers for the `local` ranks of `layout` over `moe_layers` MoE layers, for
    /// a loader to fill expert by expert at [`Self::offsets`].
    pub fn allocate(
        exec: &dyn Executor,
        layout: &Layout,
        local: Range<usize>,
        moe_layers: usize,
        (hidden, inter): (usize, usize),
    ) -> Result<Self, CudaError> {
        if hidden == 0 || inter == 0 {
            return Err(KernelError::ZeroDimension {
                what: "hidden and intermediate size",
            }
            .into());
        }
        if local.is_empty() || local.end > layout.ranks() {
            return Err(KernelError::RankCount {
                got: local.end,
                ranks: layout.ranks(),
            }
            .into());
        }
        let bytes = expert_bytes(hidden, inter);
        let mut offsets = vec![vec![0u64; layout.experts()]; moe_layers];
        let mut buffers = Vec::with_capacity(local.len());
        for rank in local {
            let mains = layout.main_experts(rank);
            for (layer, per_layer) in offsets.iter_mut().enumerate() {
                for (i, &e) in mains.iter().enumerate() {
                    per_layer[e as usize] = ((layer * mains.len() + i) * bytes) as u64;
                }
            }
            buffers.push(exec.alloc_zeroed(moe_layers * mains.len() * bytes)?);
        }
        Ok(Self {
            buffers,
            offsets,
            expert_bytes: bytes,
        })
    }

    /// Uploads f32 weights in the engine's layout (`layers[l][e]`, `E` per layer; only the
    /// local ranks' experts are read), rounded once to bf16 and transposed into the device
    /// layout.
    pub fn upload(
        exec: &dyn Executor,
        layout: &Layout,
        local: Range<usize>,
        (hidden, inter): (usize, usize),
        layers: &[Vec<ExpertWeights<'_>>],
    ) -> Result<Self, CudaError> {
        let homes = Self::allocate(exec, layout, local.clone(), layers.len(), (hidden, inter))?;
        for (l, experts) in layers.iter().enumerate() {
            check_len("experts of a MoE layer", experts.len(), layout.experts())?;
            for (index, rank) in local.clone().enumerate() {
                for &e in layout.main_experts(rank) {
                    let bytes = device_layout(experts[e as usize], hidden, inter)?;
                    let at = homes.offsets[l][e as usize] as usize;
                    exec.write(&homes.buffers[index], at, &bytes)?;
                }
            }
        }
        Ok(homes)
    }
}

/// One expert's f32 weights in the engine's layout as the device layout's bf16 bytes.
fn device_layout(
    [gate_up, down]: ExpertWeights<'_>,
    hidden: usize,
    inter: usize,
) -> Result<Vec<u8>, KernelError> {
    check_len("expert gate-up weights", gate_up.len(), hidden * 2 * inter)?;
    check_len("expert down weights", down.len(), inter * hidden)?;
    let mut out = Vec::with_capacity(expert_bytes(hidden, inter));
    let mut push = |v: f32| out.extend(f32_to_bf16(v).to_le_bytes());
    // `[2I, H]`: row j is column j of the engine's `[H, 2I]`.
    for j in 0..2 * inter {
        for h in 0..hidden {
            push(gate_up[h * 2 * inter + j]);
        }
    }
    // `[H, I]`: row h is column h of the engine's `[I, H]`.
    for h in 0..hidden {
        for i in 0..inter {
            push(down[i * hidden + h]);
        }
    }
    Ok(out)
}
