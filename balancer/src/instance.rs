//! One physical instance of a logical expert: what a plan's quotas and reroute split are indexed
//! by (its own file so that the plan and the reroute split, which fill and read it, depend on it
//! and not on each other).

use serde::Serialize;

/// One physical instance of a logical expert: the rank that computes it and the token-expert pairs
/// it takes after reroute (`quota[e][t]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Instance {
    pub rank: u32,
    pub quota: u64,
}
