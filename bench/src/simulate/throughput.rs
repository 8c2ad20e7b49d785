//! Throughput mode: every rank prefills a full chunk every step (or what a recorded trace's rows
//! hold), each balancer and the ideal costed on the same routing.

use super::cost::Segment;
use super::error::SimError;
use super::report::{
    self, BalancerReport, Imbalance, ScheduleReport, ThroughputReport, TimedTerms,
};
use super::spec::{SimSpec, MAX_STEPS};
use super::step::{AlgoStep, StepCoster};
use super::trace::{LoadStream, TraceSource};
use crate::stats::round_us;
use rackfill_balancer::LoadMatrix;
use rackfill_engine::Schedule;

/// A throughput simulation: every rank prefills a full chunk every step.
#[derive(Debug, Clone)]
pub struct ThroughputRun {
    pub spec: SimSpec,
    pub trace: TraceSource,
    pub steps: usize,
    /// Tokens of earlier chunks each synthetic chunk's request already holds (attention context).
    pub context_tokens: u64,
}

/// Runs a throughput simulation; `progress(done, total)` after every step.
///
/// Synthetic routing simulates `spec.sim_layers` layers of full `spec.chunk_tokens` chunks. A
/// recorded trace simulates every one of its layers once per step, each standing for
/// `moe_layers / trace layers` of the model's (fewer or more than the model has), with the tokens
/// per rank its rows imply; `spec.sim_layers` and `spec.chunk_tokens` do not apply to it.
pub fn run_throughput(
    run: &ThroughputRun,
    progress: impl FnMut(usize, usize),
) -> Result<ThroughputReport, SimError> {
    run_throughput_shared(&[run], progress)
        .pop()
        .expect("one run, one result")
}

/// Runs simulations that share their routing, drawing it once: they differ only in what does
/// not change the routing (slots, schedule, balancers, slot memory, relay, solve time, context),
/// so their routing is that of `runs[0]` (a sweep's slot counts and schedules at one model, EP
/// size and trace). One result per run, in order; a run whose plan fails carries its error and
/// the others go on. `progress(done, total)` after every step.
pub fn run_throughput_shared(
    runs: &[&ThroughputRun],
    mut progress: impl FnMut(usize, usize),
) -> Vec<Result<ThroughputReport, SimError>> {
    let Some(first) = runs.first() else {
        return Vec::new();
    };
    let fail_all = |e: SimError| runs.iter().map(|_| Err(e.clone())).collect();
    if let Err(e) = shares_routing(runs) {
        return fail_all(e);
    }
    let spec = &first.spec;
    if !(1..=MAX_STEPS).contains(&first.steps) {
        return fail_all(SimError::Input(format!(
            "--steps must be in 1..={MAX_STEPS}, got {}",
            first.steps
        )));
    }
    let mut routing = match spec.validate().and_then(|()| match &first.trace {
        TraceSource::Synthetic(pattern) => LoadStream::synthetic(*pattern, spec, first.steps),
        TraceSource::File(path) => LoadStream::recorded(path, spec.ep, spec.shape.experts),
    }) {
        Ok(routing) => routing,
        Err(e) => return fail_all(e),
    };
    let layers = routing.layers();
    // Per run: its coster and totals, or the error that stopped it.
    let mut states: Vec<Result<(StepCoster, Totals), SimError>> = runs
        .iter()
        .map(|run| {
            let coster = StepCoster::with_layers(&run.spec, &run.spec.algos, layers)?;
            Ok((coster, Totals::new(run.spec.algos.len())))
        })
        .collect();
    let mut steps = 0;
    while steps < first.steps {
        // Synthetic steps are drawn with their micro-batches (the first half of every rank's
        // chunk, then the rest); a recorded trace's are cut from its rows by the coster.
        let Some(routing_step) = routing.next_split_step(spec.chunk_tokens / 2) else {
            break;
        };
        let (loads, halves) = match routing_step {
            Ok(step) => step,
            Err(e) => return fail_all(e),
        };
        for (run, state) in runs.iter().zip(&mut states) {
            let Ok((coster, totals)) = state else {
                continue;
            };
            let batch = step_batch(run, &loads);
            let tokens: u64 = batch.iter().flatten().map(|s| s.tokens).sum();
            let ideal = coster.ideal(&batch);
            for (acc, step) in totals.ideal.iter_mut().zip(&ideal.schedules) {
                acc.push(step, tokens);
            }
            totals.ideal_imbalance += coster.ideal_imbalance(&batch);
            match coster.step_split(&batch, &loads, halves.as_ref()) {
                Ok(step) => totals.add_step(&step, tokens),
                Err(e) => *state = Err(e),
            }
        }
        steps += 1;
        progress(steps, first.steps);
    }
    if steps == 0 {
        return fail_all(SimError::Input("the routing trace has no steps".into()));
    }
    runs.iter()
        .zip(states)
        .map(|(run, state)| state.map(|(_, totals)| totals.report(run, layers)))
        .collect()
}

/// Checks that `runs` route alike (see [`run_throughput_shared`]).
fn shares_routing(runs: &[&ThroughputRun]) -> Result<(), SimError> {
    let key = |r: &ThroughputRun| {
        let s = &r.spec;
        (
            r.trace.clone(),
            r.steps,
            s.shape.name.clone(),
            s.shape.experts,
            s.shape.top_k,
            s.ep,
            s.chunk_tokens,
            s.seed,
            s.sim_layers,
            s.sampler,
        )
    };
    let first = key(runs[0]);
    match runs.iter().all(|r| key(r) == first) {
        true => Ok(()),
        false => Err(SimError::Input(
            "simulations that share routing need the same trace, steps, shape, EP size, \
             chunk, seed, simulated layers and sampler"
                .into(),
        )),
    }
}

/// Running sums over the steps of a throughput simulation, per schedule of
/// [`Schedule::ALL`].
struct Totals {
    steps: usize,
    ideal: [TimedTerms; 4],
    ideal_imbalance: f64,
    /// Per balancer, in the spec's order: its steps under each schedule and its other figures.
    algos: Vec<[TimedTerms; 4]>,
    stats: Vec<AlgoStep>,
}

impl Totals {
    fn new(algos: usize) -> Self {
        Self {
            steps: 0,
            ideal: Default::default(),
            ideal_imbalance: 0.0,
            algos: vec![Default::default(); algos],
            stats: vec![AlgoStep::default(); algos],
        }
    }

    /// Adds one step's results (one per balancer) that prefilled `tokens` tokens.
    fn add_step(&mut self, results: &[AlgoStep], tokens: u64) {
        for ((acc, stat), result) in self.algos.iter_mut().zip(&mut self.stats).zip(results) {
            for (acc, step) in acc.iter_mut().zip(&result.schedules) {
                acc.push(step, tokens);
            }
            stat.imbalance_before += result.imbalance_before;
            stat.imbalance_after += result.imbalance_after;
            stat.replicas += result.replicas;
            stat.max_fanout += result.max_fanout;
            stat.solve_us += result.solve_us;
        }
        self.steps += 1;
    }

    /// The report: means per step (and per MoE layer) of `run`, which simulated
    /// `simulated_layers` load matrices per step.
    fn report(self, run: &ThroughputRun, simulated_layers: usize) -> ThroughputReport {
        let spec = &run.spec;
        let n = self.steps as f64;
        let moe_layers = spec.shape.moe_layers() as f64;
        let chosen = Schedule::ALL
            .iter()
            .position(|s| *s == spec.schedule)
            .expect("the spec's schedule is one of the ablation's (validated)");
        let ultraep = 0;
        let per_schedule = |acc: &[TimedTerms; 4]| -> Vec<ScheduleReport> {
            Schedule::ALL
                .iter()
                .zip(acc)
                .zip(&self.ideal)
                .map(|((schedule, acc), ideal)| ScheduleReport {
                    schedule: schedule.name(),
                    tokens_per_s: acc.tokens_per_s(),
                    fraction_of_ideal: ideal.total_ms() / acc.total_ms(),
                    step_ms: acc.total_ms() / n,
                    layer_ms: acc.terms.scaled(1.0 / (n * moe_layers)),
                    replica_mb_busiest_mean: acc.replica_mb / n,
                })
                .collect()
        };
        let ideal = &self.ideal[chosen];
        let balancers = spec
            .algos
            .iter()
            .zip(&self.algos)
            .zip(&self.stats)
            .map(|((algo, all), stat)| {
                let acc = &all[chosen];
                BalancerReport {
                    balancer: algo.name().into(),
                    tokens_per_s: acc.tokens_per_s(),
                    fraction_of_ideal: ideal.total_ms() / acc.total_ms(),
                    speedup_over_ultraep: acc.tokens_per_s() / all[ultraep].tokens_per_s(),
                    step_ms: acc.total_ms() / n,
                    breakdown_ms: acc.terms.scaled(1.0 / n),
                    layer_ms: acc.terms.scaled(1.0 / (n * moe_layers)),
                    mean_imbalance: Imbalance {
                        before: stat.imbalance_before / n,
                        after: stat.imbalance_after / n,
                    },
                    replicas_mean: stat.replicas / n,
                    max_fanout_mean: stat.max_fanout / n,
                    replica_mb_busiest_mean: acc.replica_mb / n,
                    solve_us_mean: round_us(stat.solve_us / n),
                    schedules: per_schedule(all),
                    step_ms_series: acc.step_ms.clone(),
                }
            })
            .collect();
        ThroughputReport {
            model: spec.shape.name.clone(),
            rack: spec.rack.name.clone(),
            ep: spec.ep,
            slots: spec.slots,
            trace: run.trace.label(),
            steps: self.steps,
            seed: spec.seed,
            chunk_tokens: match run.trace {
                TraceSource::Synthetic(_) => Some(spec.chunk_tokens),
                TraceSource::File(_) => None,
            },
            tokens_per_rank_mean: ideal.tokens as f64 / (n * spec.ep as f64),
            context_tokens: run.context_tokens,
            moe_layers: spec.shape.moe_layers(),
            simulated_layers,
            solve_us_override: spec.solve_us,
            solve_time: match spec.solve_us {
                Some(_) => "fixed".into(),
                None => "measured on this host".into(),
            },
            sampler: spec.sampler.name().into(),
            calibration: None,
            schedule: spec.schedule.name(),
            slot_memory: spec.slot_memory.name().into(),
            reuse_tolerance: spec.resident_preference(),
            slot_gb_per_gpu: spec.slot_gb_per_gpu(),
            ideal: report::IdealReport {
                tokens_per_s: ideal.tokens_per_s(),
                step_ms: ideal.total_ms() / n,
                breakdown_ms: ideal.terms.scaled(1.0 / n),
                layer_ms: ideal.terms.scaled(1.0 / (n * moe_layers)),
                imbalance: self.ideal_imbalance / n,
                schedules: per_schedule(&self.ideal),
                step_ms_series: ideal.step_ms.clone(),
            },
            balancers,
        }
    }
}

/// What every rank prefills in a throughput step: a full chunk on synthetic routing; on a
/// recorded trace, the tokens its first layer's row implies (row sum / top-k).
fn step_batch(run: &ThroughputRun, loads: &[LoadMatrix]) -> Vec<Vec<Segment>> {
    let spec = &run.spec;
    match run.trace {
        TraceSource::Synthetic(_) => vec![
            vec![Segment {
                tokens: spec.chunk_tokens,
                context: run.context_tokens,
            }];
            spec.ep
        ],
        TraceSource::File(_) => (0..spec.ep)
            .map(|r| {
                let pairs: u64 = loads[0].row(r).iter().sum();
                vec![Segment {
                    tokens: pairs.div_ceil(spec.shape.top_k as u64),
                    context: run.context_tokens,
                }]
            })
            .collect(),
    }
}
