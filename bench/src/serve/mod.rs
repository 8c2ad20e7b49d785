//! `rackfill bench serve`: a request-trace load generator for any OpenAI-compatible endpoint
//! (rackfill, vLLM, SGLang, OpenAI itself), reporting what vLLM's `benchmark_serving.py`
//! reports under the same field names.
//!
//! Pieces, in the order a run uses them:
//! - [`dataset`]: the requests (random, ShareGPT, timestamped JSONL traces with shared prefix
//!   blocks and a generator of them, multi-turn conversations, evaluation-harness scoring);
//! - [`arrivals`]: when each is sent (Poisson or gamma at a rate, all at once, or the trace's
//!   timestamps sped up);
//! - [`runner`]: the target (endpoint, model), the warm-up request, and the dispatcher with
//!   `--max-concurrency` and `--duration`;
//! - [`client`]: one pooled HTTP client, streamed requests timed chunk by chunk;
//! - [`report`]: the summary (TTFT, TPOT, ITL, E2EL statistics, throughputs, prefix-cache hits)
//!   and its table;
//! - [`plots`]: TTFT versus achieved requests/s and TTFT CDFs of a rate sweep;
//! - [`remote_decode`]: `--remote-decode`, the decode tier of disaggregated prefill (pulls
//!   each response's KV over NIXL);
//! - [`run_sweep`] runs them in that order for a [`Workload`] and a [`SweepPlan`].
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//! use rackfill_bench::serve::{self, arrivals::{Arrivals, RequestRate}, dataset, runner};
//!
//! # async fn demo() -> Result<(), serve::ServeBenchError> {
//! let target = runner::Target::connect(runner::TargetConfig {
//!     base_url: "http://127.0.0.1:8000".into(),
//!     endpoint: "/v1/completions".into(),
//!     model: None,
//!     api_key: None,
//!     request_timeout: Duration::from_secs(600),
//!     ignore_eos: true,
//!     temperature: 0.0,
//!     synthesis: dataset::Synthesis::default(),
//!     remote_decode: None,
//! })
//! .await?;
//! let params = dataset::RandomParams { input_len: 256, output_len: 32, range_ratio: 0.0 };
//! let workload = serve::Workload::new(dataset::random(&params, 100, 0)?, "random");
//! let plan = serve::SweepPlan::rates(&[RequestRate::PerSecond(4.0), RequestRate::Infinite], 1.0);
//! for report in serve::run_sweep(&target, &workload, &plan).await? {
//!     println!("{}", serve::table::format_table(&report.summary));
//! }
//! # Ok(()) }
//! ```

pub mod arrivals;
pub mod client;
pub mod dataset;
mod error;
pub mod plots;
pub mod remote_decode;
pub mod report;
pub mod runner;
mod sweep;
pub mod table;

pub use error::ServeBenchError;
pub use sweep::{run_sweep, RateReport, SweepPlan, Workload};
