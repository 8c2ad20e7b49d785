//! rackfill-bench: benchmarks for rackfill.
//!
//! - [`synthetic`]: deterministic synthetic routing loads (Zipf / lognormal popularity, per-rank
//!   variation, stationary / drifting / switching hot sets, exact top-k token sampling);
//! - [`balance`]: replays load sequences through every balancer and reports imbalance, optimality
//!   gap, replicas, fan-out, in-flight ratio and solve time per balancer (`rackfill bench balance`);
//! - [`forward`]: prefill tokens/s of the dense model path (`rackfill bench forward`), on real
//!   model shapes from [`model_shapes`] (configs, tensor lists, model FLOPs);
//! - [`replay`]: replays multi-layer routing traces (recorded, and read with
//!   [`rackfill_engine::routing_trace`], or from [`synthetic::multilayer`]) through every
//!   balancer, step by step (`rackfill bench balance --trace` / `--synthetic-trace`);
//! - [`serve`]: request-trace load generator for any OpenAI-compatible endpoint
//!   (`rackfill bench serve`);
//! - [`simulate`]: rack-scale what-if: per-term step cost of every balancer against the
//!   force-balanced ideal, and TTFT versus request rate (`rackfill simulate`);
//! - [`stats`]: percentiles and rounding every balancer report shares.

pub mod balance;
pub mod ep;
pub mod forward;
mod markdown;
pub mod model_shapes;
pub(crate) mod parallel;
pub mod plot;
pub mod replay;
mod replay_report;
pub mod serve;
pub mod simulate;
pub mod stats;
pub mod synthetic;

pub use balance::{run_balance, BalanceReport, BalanceRun, BalancerStats, GroupReport};
pub use synthetic::{default_grid, generate, Generator, Pattern, Popularity, Shape, Suite};
