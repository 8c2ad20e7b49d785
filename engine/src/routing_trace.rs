//! `--record-routing FILE`: every step's per-layer load matrices, for replay by
//! `rackfill bench balance`.
//!
//! Format (JSON Lines, one object per step and MoE layer, in step then layer order):
//!
//! ```json
//! {"step": 0, "layer": 1, "ranks": 8, "experts": 64, "load": [[u64; 64]; 8]}
//! ```
//!
//! `load[r][e]` is the number of token-expert pairs source rank `r` routed to expert `e` (top-k
//! counted k times): exactly the matrix the planner solved on.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use serde::Serialize;

use crate::ep::LayerReport;
use crate::error::{EngineError, Result};

/// Appends load matrices to a routing trace file.
pub struct RoutingRecorder {
    out: BufWriter<File>,
}

#[derive(Serialize)]
struct Line<'a> {
    step: u64,
    layer: usize,
    ranks: usize,
    experts: usize,
    load: Vec<&'a [u64]>,
}

impl RoutingRecorder {
    /// Creates (truncates) the trace file.
    pub fn create(path: &Path) -> Result<Self> {
        let file = File::create(path).map_err(|e| {
            EngineError::Config(format!(
                "cannot create routing trace {}: {e}",
                path.display()
            ))
        })?;
        Ok(Self {
            out: BufWriter::new(file),
        })
    }

    /// Writes one line per MoE layer of step `step` and flushes, so a trace is complete up to
    /// the last finished step even if the process is killed.
    pub fn record(&mut self, step: u64, layers: &[LayerReport]) -> std::io::Result<()> {
        for report in layers {
            let load = &report.load;
            let line = Line {
                step,
                layer: report.layer,
                ranks: load.ranks(),
                experts: load.experts(),
                load: (0..load.ranks()).map(|r| load.row(r)).collect(),
            };
            serde_json::to_writer(&mut self.out, &line)?;
            self.out.write_all(b"\n")?;
        }
        self.out.flush()
    }
}
