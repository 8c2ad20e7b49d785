//! One line of a routing trace, in both directions, and the step it belongs to.

use rackfill_balancer::LoadMatrix;
use serde::{Deserialize, Serialize};

/// The load matrices of one step, one per MoE layer, in the order of the trace's layer list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceStep {
    /// The step number recorded in the trace.
    pub step: u64,
    /// `loads[i]` belongs to layer `layers[i]` of the trace.
    pub loads: Vec<LoadMatrix>,
}

/// One line as it is read. Unknown fields are refused, as in every other input file: a misspelt
/// field must not pass for a trace (writers write exactly these five).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct LineIn {
    pub step: u64,
    pub layer: usize,
    pub ranks: usize,
    pub experts: usize,
    pub load: Vec<Vec<u64>>,
}

/// What a line must be, for lines that are not JSON objects: serde would read a struct from an
/// array of its fields too, and name the Rust type in its error.
pub(super) const LINE_EXPECTED: &str =
    "expected a JSON object {\"step\", \"layer\", \"ranks\", \"experts\", \"load\"}";

/// One line as it is written.
#[derive(Serialize)]
struct LineOut<'a> {
    step: u64,
    layer: usize,
    ranks: usize,
    experts: usize,
    load: Vec<&'a [u64]>,
}

/// Appends the lines of step `step` (one per `(layer, load)`, newline-terminated) to `out`, so a
/// writer can hand the whole step to its output at once.
pub(super) fn encode_step<'a>(
    out: &mut Vec<u8>,
    step: u64,
    layers: impl IntoIterator<Item = (usize, &'a LoadMatrix)>,
) {
    for (layer, load) in layers {
        let line = LineOut {
            step,
            layer,
            ranks: load.ranks(),
            experts: load.experts(),
            load: (0..load.ranks()).map(|r| load.row(r)).collect(),
        };
        // Writing integers into a Vec cannot fail.
        serde_json::to_writer(&mut *out, &line).expect("a trace line serializes");
        out.push(b'\n');
    }
}
