//! A layer's plan, the same on every backend: the local counts gathered into the load matrix,
//! the plan solved (on the device by its solver when the data plane has one, else by every
//! local rank's host planner from its own copy of the load), moved onto resident replicas with
//! per-layer slots, checked to agree across processes; and what a finished layer's report is
//! made of.

use std::ops::Range;
use std::time::{Duration, Instant};

use rackfill_balancer::{Balancer, Layout, LoadMatrix, Plan};

use rackfill_balancer::metrics::evaluate;
use rackfill_models::ModelConfig;

use super::config::{reuse_resident, EpConfig, LayerReport};
use crate::error::{EngineError, Result};
use crate::fabric::Fabric;
use crate::plane::PhaseTimes;
use crate::rack_cost::{MoeCost, MoeDims, Rack};

/// What planning a layer uses besides its counts: the fabric, every layer's planners, the
/// layout and the configuration. One micro-batch plans at a time, so a step hands them over.
pub(super) struct Comm<'r> {
    pub fabric: &'r dyn Fabric,
    pub planners: &'r mut [Option<Vec<Box<dyn Balancer>>>],
    pub layout: &'r Layout,
    pub config: &'r EpConfig,
}

/// Solves a layer's load on the device.
pub(super) type DeviceSolve<'p> = &'p mut dyn FnMut(&LoadMatrix) -> Result<Plan>;

/// Where a layer's plan may come from besides the host planners, and what it already holds.
pub(super) struct PlaneSide<'p> {
    /// Solves the load on the device (`None`: this plane has no solver for the balancer).
    pub device_solve: Option<DeviceSolve<'p>>,
    /// Every rank's slots as the layer's last stream left them (per-layer slots).
    pub resident: Option<Vec<Option<u32>>>,
}

impl Comm<'_> {
    /// Model layer `layer`'s plan for the local ranks' `counts` (one row of `E` per local
    /// rank): the counts gathered, the plan solved where `plane` can or on the host (with
    /// `verify_plans`, the host planners solve too and every plan must agree), moved onto
    /// resident replicas, and checked to be every process's.
    pub fn plan_layer(
        &mut self,
        layer: usize,
        counts: &[Vec<u64>],
        plane: PlaneSide<'_>,
    ) -> Result<Solved> {
        let gathered = self.fabric.all_gather(counts)?;
        let load = LoadMatrix::from_rows(&gathered)?;
        let started = Instant::now();
        let mut solved = match plane.device_solve {
            Some(solve) => {
                let plan = solve(&load)?;
                let took = started.elapsed();
                if self.config.verify_plans {
                    let host = self.host_solve(layer, &load)?;
                    if host.plan != plan {
                        return Err(EngineError::Gpu(format!(
                            "layer {layer}: the device solver's plan differs from the host \
                             planner's"
                        )));
                    }
                }
                Solved { plan, load, took }
            }
            None => self.host_solve(layer, &load)?,
        };
        solved.plan = reuse_resident(
            self.config,
            self.layout,
            &solved.load,
            solved.plan,
            plane.resident.as_deref(),
        );
        check_plans_agree(self.fabric, layer, &solved.plan)?;
        Ok(solved)
    }

    /// [`solve_on_host`] with the planners of `layer`.
    fn host_solve(&mut self, layer: usize, load: &LoadMatrix) -> Result<Solved> {
        let planners = self.planners[layer]
            .as_mut()
            .ok_or_else(|| EngineError::Config(format!("layer {layer} has no planner")))?;
        solve_on_host(
            planners,
            self.layout,
            self.fabric.local_ranks(),
            layer,
            load,
        )
    }
}

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

/// What a layer's report is costed and measured against.
pub(super) struct Reports<'a> {
    pub rack: &'a Rack,
    pub layout: &'a Layout,
    pub config: &'a EpConfig,
    pub model: &'a ModelConfig,
}

impl Reports<'_> {
    /// What one MoE layer of micro-batch `micro_batch` did: its exact load, the plan's metrics
    /// and slots, the plan costed on the runtime's rack, the solve time, what the data plane
    /// moved (replica bytes, bytes received per local rank) and its phase times.
    pub fn layer(&self, finished: Finished, micro_batch: usize) -> LayerReport {
        let Finished {
            layer,
            solved: Solved { plan, load, took },
            bytes: (replica_bytes, recv_bytes),
            phases,
        } = finished;
        let cost = MoeCost {
            rack: self.rack,
            dims: MoeDims {
                hidden: self.model.hidden_size,
                intermediate: self.model.moe.intermediate_size,
            },
        };
        LayerReport {
            layer,
            micro_batch,
            metrics: evaluate(self.layout, &load, &plan),
            simulated: cost.makespan(self.layout, &load, &plan, &self.config.relay),
            slots: (0..plan.ranks())
                .map(|r| plan.rank_slots(r).to_vec())
                .collect(),
            load,
            replica_bytes,
            recv_bytes,
            solve_us: took.as_secs_f64() * 1e6,
            phases,
        }
    }
}

impl Finished {
    /// A finished layer: its plan, what its data plane moved and its phases, with the time to
    /// route and to plan (`plan_time`, the gather and the solve) filled in.
    pub(super) fn new(
        layer: usize,
        (solved, plan_time): (Solved, Duration),
        route_time: Duration,
        (replica_bytes, recv_bytes): (u64, Vec<u64>),
        phases: PhaseTimes,
    ) -> Self {
        Self {
            layer,
            solved,
            bytes: (replica_bytes, recv_bytes),
            phases: PhaseTimes {
                route: route_time,
                solve: plan_time,
                ..phases
            },
        }
    }
}

/// Fails on every process unless all solved the same `plan` (one all-gather of a 64-bit
/// digest per layer): the plan decides where every token and replica goes, so processes that
/// disagree would exchange garbage. Run whatever the layout, so one process holding every
/// rank moves the same bytes as one process per rank (`verify_plans` also checks a
/// process's own planners against each other).
fn check_plans_agree(fabric: &dyn Fabric, layer: usize, plan: &Plan) -> Result<()> {
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

/// A layer's plan from the host planners of one layer, one per local rank (`local`) when plans
/// are verified, else one.
fn solve_on_host(
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
