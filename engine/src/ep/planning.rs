//! A layer's plan on the host: every local rank's planner solving from its own copy of the
//! gathered load, the plans-agree check across processes, and what a finished layer's report is
//! made of (shared by the serial step, the overlapped one and the device runtime).

use std::ops::Range;
use std::time::{Duration, Instant};

use rackfill_balancer::{Balancer, Layout, LoadMatrix, Plan};

use crate::error::{EngineError, Result};
use crate::fabric::Fabric;
use crate::plane::PhaseTimes;

/// One MoE layer's plan and the load it was solved on.
pub(super) struct Solved {
    pub(super) plan: Plan,
    pub(super) load: LoadMatrix,
    pub(super) took: Duration,
}

/// One MoE layer of one micro-batch, done: what its report is made of.
pub(super) struct Finished {
    pub(super) layer: usize,
    pub(super) solved: Solved,
    /// Replica bytes the local ranks received, and every local rank's received bytes.
    pub(super) bytes: (u64, Vec<u64>),
    pub(super) phases: PhaseTimes,
}

/// Fails on every process unless all solved the same `plan` (one all-gather of a 64-bit
/// digest per layer): the plan decides where every token and replica goes, so processes that
/// disagree would exchange garbage. Run whatever the layout, so one process holding every
/// rank moves the same bytes as one process per rank (`verify_plans` also checks a
/// process's own planners against each other).
pub(super) fn check_plans_agree(fabric: &dyn Fabric, layer: usize, plan: &Plan) -> Result<()> {
    let local = fabric.local_ranks();
    let mut hasher = std::hash::DefaultHasher::new();
    std::hash::Hash::hash(plan, &mut hasher);
    let digest = std::hash::Hasher::finish(&hasher);
    let digests = fabric.all_gather(&vec![vec![digest]; local.len()])?;
    match digests.iter().position(|d| d != &digests[0]) {
        None => Ok(()),
        Some(rank) => Err(EngineError::Fabric(format!(
            "layer {layer}: rank {rank} solved a different plan than rank 0 (digest \
             {:016x}, not {:016x}): the ranks no longer agree",
            digests[rank][0], digests[0][0]
        ))),
    }
}

/// [`EpRuntime::solve`] with the host planners of one layer, one per local rank (`local`)
/// when plans are verified, else one.
pub(super) fn solve_on_host(
    planners: &mut [Box<dyn Balancer>],
    layout: &Layout,
    local: Range<usize>,
    layer: usize,
    load: &LoadMatrix,
) -> Result<Solved> {
    let mut first: Option<Solved> = None;
    for (rank, planner) in local.zip(planners.iter_mut()) {
        // Every rank plans from its own copy, as separate hosts would.
        let copy = load.clone();
        let started = Instant::now();
        let mine = planner.plan(layout, &copy)?;
        let took = started.elapsed();
        match &first {
            None => {
                mine.validate(layout, &copy, planner.u_min())
                    .map_err(|violation| EngineError::InvalidPlan { layer, violation })?;
                first = Some(Solved {
                    plan: mine,
                    load: copy,
                    took,
                });
            }
            Some(solved) if solved.plan != mine => {
                return Err(EngineError::Fabric(format!(
                    "layer {layer}: rank {rank} solved a different plan than the first \
                     local rank"
                )));
            }
            Some(_) => {}
        }
    }
    first.ok_or_else(|| EngineError::Config(format!("layer {layer} has no planner")))
}
