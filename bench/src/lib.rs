//! rackfill-bench: benchmarks for rackfill.
//!
//! - [`synthetic`]: deterministic synthetic routing loads (Zipf / lognormal popularity, per-rank
//!   variation, stationary / drifting / switching hot sets, exact top-k token sampling);
//! - [`balance`]: replays load sequences through every balancer and reports imbalance, optimality
//!   gap, replicas, fan-out, in-flight ratio and solve time per balancer (`rackfill bench balance`);
//! - [`forward`]: prefill tokens/s of the dense model path (`rackfill bench forward`).

pub mod balance;
pub mod ep;
pub mod forward;
pub mod synthetic;

pub use balance::{run_balance, BalanceReport, BalanceRun, BalancerStats, GroupReport};
pub use synthetic::{default_grid, generate, Family, Generator, Pattern, Shape, Suite};
