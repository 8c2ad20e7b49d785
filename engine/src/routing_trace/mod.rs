//! Routing traces: every engine step's per-layer expert load matrices on disk, the one format
//! `rackfill serve --record-routing FILE` writes ([`RoutingRecorder`]), `rackfill bench balance
//! --trace` and `rackfill simulate --trace` read ([`TraceReader`]), and the synthetic trace
//! generators write ([`TraceWriter`], `bench balance --write-trace`), so every trace replays the
//! same way. This is the format's only definition; docs/bench-balance.md describes it for users.
//!
//! # Format
//!
//! JSON Lines, one object per step and MoE layer, in step then layer order:
//!
//! ```json
//! {"step": 0, "layer": 1, "ranks": 8, "experts": 64, "load": [[u64; 64]; 8]}
//! ```
//!
//! `load[r][e]` is the number of token-expert pairs source rank `r` routed to expert `e` (top-k
//! counted k times): exactly the matrix the planner solved on. The five fields are written in
//! this order and no others are allowed.
//!
//! Every step holds the same layers, each once, in increasing order; step numbers increase but
//! may skip (a trace cut out of a longer one is still a trace); `ranks` and `experts` never
//! change within a trace; blank lines are ignored.
//!
//! # Whole steps only
//!
//! Writers hand each step to the output as one buffer. The recorder never leaves a partial step:
//! it stops before a step that would take the file past its byte cap, and after a failed write
//! (a full disk) it cuts the file back to the last whole step. A file whose last line was cut
//! short anyway (a writer killed mid-write, a file copied while recording) still reads: the
//! reader drops that line, and the step it left incomplete, and says so on stderr once.

mod error;
mod line;
mod reader;
mod recorder;
mod writer;

pub use error::TraceError;
pub use line::TraceStep;
pub use reader::{RoutingTrace, TraceReader, TruncatedTail};
pub use recorder::{RecordingStopped, RoutingRecorder, RoutingTraceConfig, TraceSink};
pub use writer::TraceWriter;
