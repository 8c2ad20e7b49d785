//! rackfill-balancer: exact-load expert balancing for large expert parallelism.
//!
//! For one MoE layer of one batch, a balancer reads the exact load matrix `load[r][e]` (token-expert
//! pairs from source rank `r` to logical expert `e`) and produces a [`Plan`]: which experts get
//! replicas in which redundant slots (`X`), how many tokens every physical instance takes (`U`), and
//! how each source rank splits its tokens among the instances (`Q`). Every rank runs the same
//! planner on the same gathered matrix, so plans are deterministic by construction: integer
//! arithmetic only, fixed tie-breaking, no hashing, no clocks.
//!
//! Planners (all behind [`Balancer`]):
//! - [`quota::QuotaPlanner`]: UltraEP's quota-driven planner (Algorithm 1) with locality-first
//!   reroute: the one rackfill serves with.
//! - [`NoBalancing`], [`eplb::EplbExact`], [`eplb::EplbHistory`], [`greedy_move::GreedyMove`]:
//!   the baselines it is measured against, under the same layout constraints.
//!
//! [`relay`] turns a plan into a chunked weight-transfer schedule with two-stage relay trees for
//! hot experts; [`TokenAssignment`] gives the per-token dispatch lookup; [`metrics`] computes the
//! figures of merit (imbalance, lower bound, replicas, fan-out, in-flight ratio).
//!
//! No tensors, no I/O, no async: this crate is pure planning.

mod assignment;
pub mod eplb;
pub mod greedy_move;
mod instance;
mod layout;
mod load;
pub mod metrics;
mod plan;
pub mod quota;
pub mod relay;
mod reroute;
pub mod reuse;

pub use assignment::TokenAssignment;
pub use instance::Instance;
pub use layout::{Layout, MAX_SPLIT_CELLS};
pub use load::{main_rank_loads, LoadMatrix};
pub use plan::{Plan, PlanParts, PlanViolation};

use std::fmt;
use std::str::FromStr;

/// Why a balancer could not be set up or run on its input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BalanceError {
    #[error("an EP group needs at least one rank")]
    NoRanks,
    #[error(
        "{slots} redundant slots per rank: at most {experts} (one per expert) can ever hold a \
         replica"
    )]
    TooManySlots { slots: usize, experts: usize },
    #[error(
        "{ranks} ranks x {experts} experts with {slots} slots per rank: a plan could split \
         tokens over {cells} (source rank, instance) pairs, more than {max}; use fewer ranks or \
         slots",
        max = layout::MAX_SPLIT_CELLS
    )]
    PlanTooLarge {
        ranks: usize,
        experts: usize,
        slots: usize,
        cells: u128,
    },
    #[error("input too large: counts or sizes overflow 64-bit totals")]
    TooLarge,
    #[error("home of expert {expert} is rank {home}, but there are only {ranks} ranks")]
    HomeOutOfRange {
        expert: usize,
        home: u64,
        ranks: usize,
    },
    #[error("load row {rank} has {len} experts, row 0 has {expected}")]
    RaggedLoad {
        rank: usize,
        len: usize,
        expected: usize,
    },
    #[error("load buffer has {len} counts, expected {ranks} x {experts}")]
    LoadSize {
        len: usize,
        ranks: usize,
        experts: usize,
    },
    #[error(
        "load matrix is {load_ranks} x {load_experts}, layout is {ranks} ranks x {experts} experts"
    )]
    ShapeMismatch {
        load_ranks: usize,
        load_experts: usize,
        ranks: usize,
        experts: usize,
    },
}

/// A per-layer replication planner.
///
/// `plan` takes `&mut self` so planners can keep scratch buffers (and, for history-based baselines,
/// their window) between layers; two planners built the same way and fed the same sequence of loads
/// return identical plans.
pub trait Balancer: Send {
    /// The name used on the command line and in reports.
    fn name(&self) -> &'static str;

    /// Plans one layer from its load matrix.
    fn plan(&mut self, layout: &Layout, load: &LoadMatrix) -> Result<Plan, BalanceError>;

    /// The smallest quota this planner guarantees for every replica (0 when it gives none).
    fn u_min(&self) -> u64 {
        0
    }
}

/// Main experts only: the reference every other planner is compared with.
#[derive(Debug, Default, Clone)]
pub struct NoBalancing;

impl Balancer for NoBalancing {
    fn name(&self) -> &'static str {
        "none"
    }

    fn plan(&mut self, layout: &Layout, load: &LoadMatrix) -> Result<Plan, BalanceError> {
        load.check_shape(layout)?;
        Ok(Plan::main_only(layout, &load.expert_totals()))
    }
}

/// The planners rackfill ships, by their command-line names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algo {
    None,
    Quota,
    /// The quota planner with the published target rule (largest slack always), for ablations.
    QuotaPaper,
    EplbExact,
    EplbHistory,
    GreedyMove,
}

impl Algo {
    /// Every planner, in report order.
    pub const ALL: [Algo; 6] = [
        Algo::None,
        Algo::Quota,
        Algo::QuotaPaper,
        Algo::EplbExact,
        Algo::EplbHistory,
        Algo::GreedyMove,
    ];

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Algo::None => "none",
            Algo::Quota => "quota",
            Algo::QuotaPaper => "quota-paper",
            Algo::EplbExact => "eplb-exact",
            Algo::EplbHistory => "eplb-history",
            Algo::GreedyMove => "greedy-move",
        }
    }

    /// Builds the planner with its settings.
    pub fn build(self, settings: &Settings) -> Box<dyn Balancer> {
        match self {
            Algo::None => Box::new(NoBalancing),
            Algo::Quota => Box::new(quota::QuotaPlanner::new(settings.u_min)),
            Algo::QuotaPaper => Box::new(quota::QuotaPlanner::with_rule(
                settings.u_min,
                quota::TargetRule::LargestSlack,
            )),
            Algo::EplbExact => Box::new(eplb::EplbExact),
            Algo::EplbHistory => Box::new(eplb::EplbHistory::new(
                settings.history_window,
                settings.rebalance_interval,
            )),
            Algo::GreedyMove => Box::new(greedy_move::GreedyMove),
        }
    }
}

impl fmt::Display for Algo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Algo {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Algo::ALL
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = Algo::ALL.iter().map(|a| a.name()).collect();
                format!(
                    "unknown balancer '{s}' (expected one of: {})",
                    names.join(", ")
                )
            })
    }
}

/// Planner settings shared by the CLI, the bench and (later) the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    /// Smallest quota a new replica must carry (`quota` only).
    pub u_min: u64,
    /// Steps of past load `eplb-history` plans from.
    pub history_window: usize,
    /// `eplb-history` re-plans every this many steps.
    pub rebalance_interval: usize,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            u_min: quota::DEFAULT_U_MIN,
            history_window: eplb::DEFAULT_HISTORY_WINDOW,
            rebalance_interval: eplb::DEFAULT_REBALANCE_INTERVAL,
        }
    }
}
