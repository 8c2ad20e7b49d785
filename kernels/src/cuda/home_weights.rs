//! Every rank's home buffer of expert weights, as a GPU data plane uploads them: per rank its
//! main experts of every MoE layer, layer after layer, each expert `[H, 2I]` gate-up then
//! `[I, H]` down, in the element encoding the plane computes in.

use rackfill_balancer::Layout;

use crate::permute::check_len;
use crate::KernelError;

/// One expert's weights as the engine stores them: `[H, 2I]` gate-up (gate columns first), then
/// `[I, H]` down, row-major f32.
pub type ExpertWeights<'a> = [&'a [f32]; 2];

/// Every rank's home buffer, packed.
pub(crate) struct HomeWeights {
    /// `[rank]`: the buffer's bytes.
    pub bytes: Vec<Vec<u8>>,
    /// `[moe layer][expert]`: where the expert starts in its home rank's buffer, bytes.
    pub offsets: Vec<Vec<u64>>,
}

/// Packs `layers[l][e]` laid out by `layout`; `encode` appends one weight's bytes (f32, or bf16
/// rounded once).
pub(crate) fn pack_home_weights(
    layout: &Layout,
    layers: &[Vec<ExpertWeights<'_>>],
    (hidden, inter): (usize, usize),
    encode: impl Fn(f32, &mut Vec<u8>),
) -> Result<HomeWeights, KernelError> {
    let (gate_up, down) = (hidden * 2 * inter, inter * hidden);
    let mut homes: Vec<Vec<u8>> = vec![Vec::new(); layout.ranks()];
    let mut home_offsets = Vec::with_capacity(layers.len());
    for experts in layers {
        if experts.len() != layout.experts() {
            return Err(KernelError::Length {
                what: "experts of a MoE layer",
                len: experts.len(),
                expected: layout.experts(),
            });
        }
        let mut offsets = vec![0u64; layout.experts()];
        for (rank, home) in homes.iter_mut().enumerate() {
            for &e in layout.main_experts(rank) {
                let [w_gate_up, w_down] = experts[e as usize];
                check_len("expert gate-up weights", w_gate_up.len(), gate_up)?;
                check_len("expert down weights", w_down.len(), down)?;
                offsets[e as usize] = home.len() as u64;
                for &w in w_gate_up.iter().chain(w_down) {
                    encode(w, home);
                }
            }
        }
        home_offsets.push(offsets);
    }
    Ok(HomeWeights {
        bytes: homes,
        offsets: home_offsets,
    })
}
