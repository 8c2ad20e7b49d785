//! rackfill-bench: benchmarks for rackfill.
//!
//! - [`synthetic`]: deterministic synthetic routing loads (Zipf / lognormal popularity, per-rank
//!   variation, stationary / drifting / switching hot sets, exact top-k token sampling);
//! - [`balance`]: replays load sequences through every balancer and reports imbalance, optimality
//!   gap, replicas, fan-out, in-flight ratio and solve time per balancer (`rackfill bench balance`);
//! - [`forward`]: prefill tokens/s of the dense model path (`rackfill bench forward`);
//! - [`routing_trace`]: reads and writes routing traces (the `--record-routing` JSONL format);
//! - [`replay`]: replays multi-layer routing traces (recorded, or from
//!   [`synthetic::multilayer`]) through every balancer, step by step
//!   (`rackfill bench balance --trace` / `--synthetic-trace`);
//! - [`serve`]: request-trace load generator for any OpenAI-compatible endpoint
//!   (`rackfill bench serve`);
//! - [`simulate`]: rack-scale what-if: per-term step cost of every balancer against the
//!   force-balanced ideal, and TTFT versus request rate (`rackfill simulate`).

pub mod balance;
pub mod ep;
pub mod forward;
pub mod plot;
pub mod replay;
mod replay_report;
pub mod routing_trace;
pub mod serve;
pub mod simulate;
pub mod synthetic;

pub use balance::{run_balance, BalanceReport, BalanceRun, BalancerStats, GroupReport};
pub use synthetic::{default_grid, generate, Family, Generator, Pattern, Shape, Suite};
