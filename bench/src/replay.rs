//! Routing-trace replay: every step of a multi-layer trace (recorded by `rackfill serve
//! --record-routing` or synthetic) through every balancer, in step order.
//!
//! Every (balancer, layer) pair has its own planner instance, as in the engine, so `eplb-history`
//! keeps one history window per layer and re-plans it every `rebalance_interval` of its steps.
//! The [`Balancer`] trait feeds it one load per `plan` call and the planner records that load only
//! after planning, so a placement is always made from earlier steps and never sees the step it
//! serves (the current load only sets the token split, as deployed).
//!
//! Only `Balancer::plan` is timed. Every plan is checked with
//! [`Plan::validate`](rackfill_balancer::Plan::validate) against the planner's own `u_min`; failures
//! are counted and the first `MAX_FAILURES_KEPT` kept, never silently dropped. Plans are evaluated
//! with [`metrics::evaluate`] and dropped after the step: memory is constant in the trace length
//! apart from the per-step series (a handful of numbers per step and balancer) and the samples the
//! percentiles need (two per layer-step and balancer).

use crate::markdown::MAX_FAILURES_KEPT;
use crate::stats::{percentile, round_us};
use rackfill_balancer::{metrics, Algo, Balancer, Layout, LoadMatrix, Plan, Settings};
use rackfill_engine::routing_trace::TraceStep;
use serde::Serialize;
use std::path::Path;
use std::time::{Duration, Instant};

/// What to replay against.
#[derive(Debug, Clone)]
pub struct ReplayConfig {
    /// The layout of every layer (contiguous or from a home map), with its slots per rank.
    pub layout: Layout,
    pub settings: Settings,
    /// Balancers in report order.
    pub algos: Vec<Algo>,
    /// Bytes of one expert's weights, to turn replica counts into bytes (none: counts only).
    pub expert_bytes: Option<u64>,
}

/// What the replay reports while it runs.
#[derive(Debug)]
pub enum ReplayEvent<'a> {
    /// `balancer` planned layer `layers[layer_index]` of the step at `step_index`; the plan passed
    /// validation.
    Plan {
        step_index: usize,
        layer_index: usize,
        balancer: Algo,
        plan: &'a Plan,
    },
    /// A step went through every balancer.
    Step {
        steps_done: usize,
        elapsed: Duration,
    },
}

/// Why a replay stopped before its end.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The trace source failed (a malformed line, an unwritable copy, ...).
    #[error(transparent)]
    Source(Box<dyn std::error::Error + Send + Sync>),
    #[error("{0}")]
    Layout(String),
}

/// One plan that was not counted: the planner failed or its plan broke an invariant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReplayFailure {
    pub balancer: String,
    /// The trace's step number and layer id.
    pub step: u64,
    pub layer: usize,
    pub error: String,
}

/// Aggregates of one balancer over every step and layer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayStats {
    pub balancer: String,
    /// Plans that passed validation (the statistics below are over these).
    pub plans: usize,
    pub validation_failures: usize,
    /// Mean imbalance with main experts only (`none`'s imbalance, the same for every balancer).
    pub imbalance_before_mean: f64,
    pub imbalance_mean: f64,
    pub imbalance_p50: f64,
    pub imbalance_p99: f64,
    pub imbalance_max: f64,
    /// `max L / lower_bound`, mean and worst.
    pub gap_mean: f64,
    pub gap_max: f64,
    /// Replicas per layer-step, and over the whole replay.
    pub replicas_mean: f64,
    pub replicas_total: u64,
    pub max_fanout_mean: f64,
    pub max_fanout_max: usize,
    /// Bytes the shared-slot data plane streams per step (every replica of every layer, refilled
    /// per layer as rackfill does): `replicas x expert_bytes` summed over layers, mean over steps.
    pub replica_bytes_per_step: Option<f64>,
    /// Redundant slots whose expert differs from the same layer's previous plan, per step (summed
    /// over layers): what a deployment with per-layer persistent slots would have to reload.
    pub slot_changes_per_step: f64,
    /// [`Self::slot_changes_per_step`] in bytes.
    pub slot_change_bytes_per_step: Option<f64>,
    pub inflight_ratio_mean: f64,
    pub token_straggler_mean: f64,
    pub solve_us_mean: f64,
    pub solve_us_p99: f64,
    /// Mean imbalance per layer, in the order of [`ReplayReport::layers`].
    pub layer_imbalance_mean: Vec<f64>,
    /// Per step, over that step's layers.
    pub series: StepSeries,
}

/// One value per replayed step (parallel arrays, in step order).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct StepSeries {
    pub imbalance_mean: Vec<f64>,
    pub imbalance_max: Vec<f64>,
    pub replicas: Vec<u64>,
    pub slot_changes: Vec<u64>,
    pub solve_us_mean: Vec<f64>,
}

/// The result of a replay.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayReport {
    /// Where the trace came from (a file name or a synthetic spec).
    pub source: String,
    pub ranks: usize,
    pub experts: usize,
    pub slots_per_rank: usize,
    /// The MoE layers of every step.
    pub layers: Vec<usize>,
    pub steps: usize,
    pub u_min: u64,
    pub history_window: usize,
    pub rebalance_interval: usize,
    pub expert_bytes: Option<u64>,
    pub balancers: Vec<String>,
    pub validation_failures: usize,
    /// The first failures (at most `MAX_FAILURES_KEPT`, 20), each verbatim.
    pub failures: Vec<ReplayFailure>,
    /// The trace's step numbers, in replay order.
    pub step_ids: Vec<u64>,
    /// Per step, mean over layers of the imbalance with main experts only.
    pub imbalance_before_series: Vec<f64>,
    pub wall_ms: f64,
    pub stats: Vec<ReplayStats>,
}

impl ReplayReport {
    /// The statistics of one balancer by name.
    pub fn balancer(&self, name: &str) -> Option<&ReplayStats> {
        self.stats.iter().find(|s| s.balancer == name)
    }
}

/// Replays `source` (steps with one matrix per entry of `layers`) through every balancer of
/// `config`. `source` errors stop the replay and are returned as [`ReplayError::Source`].
pub fn replay<E>(
    source: impl IntoIterator<Item = Result<TraceStep, E>>,
    source_name: &str,
    layers: &[usize],
    config: &ReplayConfig,
    mut on_event: impl FnMut(ReplayEvent<'_>),
) -> Result<ReplayReport, ReplayError>
where
    E: std::error::Error + Send + Sync + 'static,
{
    let started = Instant::now();
    if layers.is_empty() {
        return Err(ReplayError::Layout("the trace has no layers".into()));
    }
    let mut replayer = Replayer::new(config, layers);
    for (step_index, item) in source.into_iter().enumerate() {
        let step = item.map_err(|e| ReplayError::Source(Box::new(e)))?;
        replayer.check_step(&step)?;
        replayer.replay_step(step_index, &step, &mut on_event);
        on_event(ReplayEvent::Step {
            steps_done: replayer.step_ids.len(),
            elapsed: started.elapsed(),
        });
    }
    Ok(replayer.finish(source_name, started.elapsed()))
}

/// A replay in progress: every planner with its running sums.
struct Replayer<'a> {
    config: &'a ReplayConfig,
    layers: &'a [usize],
    /// `planners[b][l]`: balancer `b` on layer `l`.
    planners: Vec<Vec<Box<dyn Balancer>>>,
    accs: Vec<Acc>,
    /// Previous slot contents per balancer and layer (empty before the first plan).
    previous_slots: Vec<Vec<Vec<Option<u32>>>>,
    failures: Vec<ReplayFailure>,
    failure_count: usize,
    step_ids: Vec<u64>,
    before_series: Vec<f64>,
}

impl<'a> Replayer<'a> {
    fn new(config: &'a ReplayConfig, layers: &'a [usize]) -> Self {
        let n_layers = layers.len();
        Self {
            config,
            layers,
            planners: config
                .algos
                .iter()
                .map(|a| (0..n_layers).map(|_| a.build(&config.settings)).collect())
                .collect(),
            accs: config.algos.iter().map(|_| Acc::new(n_layers)).collect(),
            previous_slots: vec![vec![Vec::new(); n_layers]; config.algos.len()],
            failures: Vec::new(),
            failure_count: 0,
            step_ids: Vec::new(),
            before_series: Vec::new(),
        }
    }

    /// Refuses a step whose matrices do not fit the layer list or the layout.
    fn check_step(&self, step: &TraceStep) -> Result<(), ReplayError> {
        let n_layers = self.layers.len();
        if step.loads.len() != n_layers {
            return Err(ReplayError::Layout(format!(
                "step {} has {} load matrices for {n_layers} layers",
                step.step,
                step.loads.len()
            )));
        }
        for load in &step.loads {
            load.check_shape(&self.config.layout).map_err(|e| {
                ReplayError::Layout(format!("step {}: {e} (check --home)", step.step))
            })?;
        }
        Ok(())
    }

    /// Plans every layer of `step` with every balancer.
    fn replay_step(
        &mut self,
        step_index: usize,
        step: &TraceStep,
        on_event: &mut impl FnMut(ReplayEvent<'_>),
    ) {
        let layout = &self.config.layout;
        let mut before_sum = 0.0;
        for acc in &mut self.accs {
            acc.begin_step();
        }
        for (l, load) in step.loads.iter().enumerate() {
            before_sum += metrics::imbalance(&rackfill_balancer::main_rank_loads(
                layout,
                &load.expert_totals(),
            ));
            for b in 0..self.planners.len() {
                self.plan_layer(b, l, step, load, step_index, on_event);
            }
        }
        for acc in &mut self.accs {
            acc.end_step();
        }
        self.before_series
            .push(before_sum / self.layers.len() as f64);
        self.step_ids.push(step.step);
    }

    /// Balancer `b` plans layer `l` of `step`; the plan is validated, evaluated and dropped, or
    /// counted as a failure.
    fn plan_layer(
        &mut self,
        b: usize,
        l: usize,
        step: &TraceStep,
        load: &LoadMatrix,
        step_index: usize,
        on_event: &mut impl FnMut(ReplayEvent<'_>),
    ) {
        let layout = &self.config.layout;
        let planner = &mut self.planners[b][l];
        // The planner runs right after the load all-gather in the engine, with the matrix in
        // cache: touch it so the timing is the solve, not the trace reader's cache misses.
        std::hint::black_box(load.total());
        let t = Instant::now();
        let result = planner.plan(layout, load);
        let solve_us = t.elapsed().as_nanos() as f64 / 1e3;
        let checked = result
            .map_err(|e| format!("planner error: {e}"))
            .and_then(|plan| {
                plan.validate(layout, load, planner.u_min())
                    .map(|()| plan)
                    .map_err(|e| format!("invalid plan: {e}"))
            });
        match checked {
            Ok(plan) => {
                let m = metrics::evaluate(layout, load, &plan);
                let previous = &mut self.previous_slots[b][l];
                let changes = slot_changes(previous, plan.slots());
                previous.clear();
                previous.extend_from_slice(plan.slots());
                self.accs[b].add(l, &m, solve_us, changes);
                on_event(ReplayEvent::Plan {
                    step_index,
                    layer_index: l,
                    balancer: self.config.algos[b],
                    plan: &plan,
                });
            }
            Err(error) => {
                self.failure_count += 1;
                self.accs[b].failures += 1;
                if self.failures.len() < MAX_FAILURES_KEPT {
                    self.failures.push(ReplayFailure {
                        balancer: planner.name().to_string(),
                        step: step.step,
                        layer: self.layers[l],
                        error,
                    });
                }
            }
        }
    }

    fn finish(self, source_name: &str, wall: Duration) -> ReplayReport {
        let config = self.config;
        let layout = &config.layout;
        let steps = self.step_ids.len();
        let stats = self
            .accs
            .into_iter()
            .zip(&config.algos)
            .map(|(acc, algo)| acc.finish(algo.name(), steps, config.expert_bytes))
            .collect();
        ReplayReport {
            source: source_name.to_string(),
            ranks: layout.ranks(),
            experts: layout.experts(),
            slots_per_rank: layout.slots_per_rank(),
            layers: self.layers.to_vec(),
            steps,
            u_min: config.settings.u_min,
            history_window: config.settings.history_window,
            rebalance_interval: config.settings.rebalance_interval,
            expert_bytes: config.expert_bytes,
            balancers: config.algos.iter().map(|a| a.name().to_string()).collect(),
            validation_failures: self.failure_count,
            failures: self.failures,
            step_ids: self.step_ids,
            imbalance_before_series: self.before_series,
            wall_ms: wall.as_secs_f64() * 1e3,
            stats,
        }
    }
}

/// Slots whose expert differs from `previous` (a first plan counts every filled slot: loading it
/// is a change).
fn slot_changes(previous: &[Option<u32>], now: &[Option<u32>]) -> u64 {
    if previous.is_empty() {
        return now.iter().filter(|s| s.is_some()).count() as u64;
    }
    previous
        .iter()
        .zip(now)
        .filter(|(a, b)| a != b && b.is_some())
        .count() as u64
}

/// Running sums of one balancer.
struct Acc {
    failures: usize,
    imbalance: Vec<f64>,
    solve_us: Vec<f64>,
    before: f64,
    gap_sum: f64,
    gap_max: f64,
    replicas: u64,
    fanout_sum: f64,
    fanout_max: usize,
    slot_changes: u64,
    inflight: f64,
    straggler: f64,
    layer_imbalance: Vec<f64>,
    layer_plans: Vec<usize>,
    series: StepSeries,
    /// The current step's sums: imbalance, its max, replicas, slot changes, solve time, plans.
    step: (f64, f64, u64, u64, f64, usize),
}

impl Acc {
    fn new(layers: usize) -> Self {
        Self {
            failures: 0,
            imbalance: Vec::new(),
            solve_us: Vec::new(),
            before: 0.0,
            gap_sum: 0.0,
            gap_max: 0.0,
            replicas: 0,
            fanout_sum: 0.0,
            fanout_max: 0,
            slot_changes: 0,
            inflight: 0.0,
            straggler: 0.0,
            layer_imbalance: vec![0.0; layers],
            layer_plans: vec![0; layers],
            series: StepSeries::default(),
            step: (0.0, 0.0, 0, 0, 0.0, 0),
        }
    }

    fn begin_step(&mut self) {
        self.step = (0.0, 0.0, 0, 0, 0.0, 0);
    }

    fn add(&mut self, layer: usize, m: &metrics::PlanMetrics, solve_us: f64, changes: u64) {
        self.imbalance.push(m.imbalance_after);
        self.solve_us.push(solve_us);
        self.before += m.imbalance_before;
        self.gap_sum += m.gap;
        self.gap_max = self.gap_max.max(m.gap);
        self.replicas += m.replicas as u64;
        self.fanout_sum += m.max_fanout as f64;
        self.fanout_max = self.fanout_max.max(m.max_fanout);
        self.slot_changes += changes;
        self.inflight += m.inflight_ratio;
        self.straggler += m.token_straggler;
        self.layer_imbalance[layer] += m.imbalance_after;
        self.layer_plans[layer] += 1;
        let s = &mut self.step;
        s.0 += m.imbalance_after;
        s.1 = s.1.max(m.imbalance_after);
        s.2 += m.replicas as u64;
        s.3 += changes;
        s.4 += solve_us;
        s.5 += 1;
    }

    fn end_step(&mut self) {
        let (imb, imb_max, replicas, changes, solve, plans) = self.step;
        let n = plans.max(1) as f64;
        let nan_if_none = |v: f64| if plans == 0 { f64::NAN } else { v };
        self.series.imbalance_mean.push(nan_if_none(imb / n));
        self.series.imbalance_max.push(nan_if_none(imb_max));
        self.series.replicas.push(replicas);
        self.series.slot_changes.push(changes);
        self.series
            .solve_us_mean
            .push(nan_if_none(round_us(solve / n)));
    }

    fn finish(mut self, name: &str, steps: usize, expert_bytes: Option<u64>) -> ReplayStats {
        let n = self.imbalance.len();
        let mean = |sum: f64| if n == 0 { 0.0 } else { sum / n as f64 };
        let per_step = |sum: f64| if steps == 0 { 0.0 } else { sum / steps as f64 };
        let imbalance_mean = mean(self.imbalance.iter().sum());
        let solve_us_mean = round_us(mean(self.solve_us.iter().sum()));
        self.imbalance.sort_by(f64::total_cmp);
        self.solve_us.sort_by(f64::total_cmp);
        let bytes = |count: u64| expert_bytes.map(|b| per_step(count as f64 * b as f64));
        ReplayStats {
            balancer: name.to_string(),
            plans: n,
            validation_failures: self.failures,
            imbalance_before_mean: mean(self.before),
            imbalance_mean,
            imbalance_p50: percentile(&self.imbalance, 0.5),
            imbalance_p99: percentile(&self.imbalance, 0.99),
            imbalance_max: self.imbalance.last().copied().unwrap_or(0.0),
            gap_mean: mean(self.gap_sum),
            gap_max: self.gap_max,
            replicas_mean: mean(self.replicas as f64),
            replicas_total: self.replicas,
            max_fanout_mean: mean(self.fanout_sum),
            max_fanout_max: self.fanout_max,
            replica_bytes_per_step: bytes(self.replicas),
            slot_changes_per_step: per_step(self.slot_changes as f64),
            slot_change_bytes_per_step: bytes(self.slot_changes),
            inflight_ratio_mean: mean(self.inflight),
            token_straggler_mean: mean(self.straggler),
            solve_us_mean,
            solve_us_p99: percentile(&self.solve_us, 0.99),
            layer_imbalance_mean: self
                .layer_imbalance
                .iter()
                .zip(&self.layer_plans)
                .map(|(&s, &p)| if p == 0 { f64::NAN } else { s / p as f64 })
                .collect(),
            series: self.series,
        }
    }
}

/// Reads a home map for [`Layout::with_home`]: a JSON file holding `[rank; E]` or
/// `{"home": [rank; E]}` (the field `rackfill plan` load files use), checked against the trace's
/// ranks and experts.
pub fn read_home_map(path: &Path, ranks: usize, experts: usize) -> Result<Vec<u32>, ReplayError> {
    let fail = |why: String| ReplayError::Layout(format!("home map {}: {why}", path.display()));
    let text = std::fs::read_to_string(path).map_err(|e| fail(e.to_string()))?;
    let doc: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| fail(format!("not JSON: {e}")))?;
    let list = match &doc {
        serde_json::Value::Object(fields) => fields.get("home").unwrap_or(&serde_json::Value::Null),
        other => other,
    };
    let Some(list) = list.as_array() else {
        return Err(fail("expected [rank; E] or {\"home\": [rank; E]}".into()));
    };
    if list.len() != experts {
        return Err(fail(format!(
            "{} entries, the trace has {experts} experts",
            list.len()
        )));
    }
    list.iter()
        .enumerate()
        .map(|(e, v)| match v.as_u64() {
            Some(rank) if rank < ranks as u64 => Ok(rank as u32),
            _ => Err(fail(format!("home[{e}] = {v} is not a rank in 0..{ranks}"))),
        })
        .collect()
}
