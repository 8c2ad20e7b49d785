//! `rackfill simulate`: a rack-scale what-if. Given a rack, a model shape, an EP size, redundant
//! slots, balancers and routing, it costs every prefill step term by term (UltraEP Eq. 1: solve,
//! replica streaming over relay trees, dispatch, expert compute, combine, plus attention and the
//! dense FFN under data-parallel attention) and reports throughput as a fraction of the
//! force-balanced ideal, a per-term breakdown like UltraEP Fig. 13, and (with a request trace)
//! TTFT versus request rate.
//!
//! - [`rack`]: hardware figures and the GEMM efficiency curve (`--rack nvl72|FILE.json`);
//! - [`shape`]: model dimensions (`--model-shape` presets, shape files, HF configs);
//! - [`cost`]: the cost of each term;
//! - [`trace`]: routing (`synthetic-mixed` or a recorded trace) and the ideal's even routing;
//! - [`queue`]: the request-trace queueing simulation (TTFT per request);
//! - [`report`]: reports, the readable tables and the plots.
//!
//! Balancers are the real planners (`Algo::build`), one instance per MoE layer so history-based
//! ones keep a per-layer window; their solve time is measured around `Balancer::plan` unless
//! `--solve-us` fixes it. Every plan is validated before it is costed.

pub mod cost;
pub mod queue;
pub mod rack;
pub mod report;
pub mod shape;
pub mod trace;

use crate::stats::round_us;
use crate::synthetic::multilayer::MAX_STEP_COUNTS;
use cost::{CostModel, ReplicaTraffic, Segment, Terms};
use rack::Rack;
use rackfill_balancer::metrics::imbalance;
use rackfill_balancer::relay::{plan_transfers, RelayConfig};
use rackfill_balancer::{main_rank_loads, Algo, Balancer, Layout, LoadMatrix, Plan, Settings};
use report::{BalancerReport, Imbalance, ThroughputReport, TimedTerms};
use shape::ModelShape;
use std::time::Instant;
use trace::{even_load, Routing, TraceSource};

/// Most tokens a rank prefills per step (`--chunk-tokens`): chunked prefill runs a few thousand
/// to tens of thousands per rank, and synthetic routing samples every token of every rank and
/// layer, so this also bounds a step's work. Longer prompts are chunks with `--context-tokens`.
pub const MAX_CHUNK_TOKENS: u64 = 1 << 16;

/// Most steps one simulation runs: `--steps`, and the fewest steps a request trace needs.
pub const MAX_STEPS: usize = 1_000_000;

/// Why a simulation could not run: always one line, naming the input at fault.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SimError {
    /// A bad argument or input file.
    #[error("{0}")]
    Input(String),
    /// A planner failed or produced a plan that breaks an invariant (a planner bug).
    #[error("balancer {balancer} at step {step}, layer {layer}: {message}")]
    Plan {
        balancer: String,
        step: usize,
        layer: usize,
        message: String,
    },
}

/// What every simulation shares: rack, model, EP group and balancers.
#[derive(Debug, Clone)]
pub struct SimSpec {
    pub rack: Rack,
    pub shape: ModelShape,
    /// EP ranks `R` (one GPU each).
    pub ep: usize,
    /// Redundant slots per rank.
    pub slots: usize,
    /// Balancers to compare, in report order.
    pub algos: Vec<Algo>,
    pub settings: Settings,
    /// Relay trees for replica streaming (`threshold: usize::MAX` streams every replica directly).
    pub relay: RelayConfig,
    /// Solve time per layer in microseconds instead of measuring the planner (reproducible runs).
    pub solve_us: Option<f64>,
    /// MoE layers simulated per step on synthetic routing; each stands for
    /// `moe_layers / sim_layers` of the model's. A recorded trace simulates each of its own layers
    /// once per step instead (see [`run_throughput`]).
    pub sim_layers: usize,
    /// Tokens each rank prefills per step (`--chunk-tokens`) on synthetic routing and in request
    /// mode; a recorded trace's tokens come from its rows.
    pub chunk_tokens: u64,
    pub seed: u64,
}

impl SimSpec {
    /// Checks the combination before anything runs.
    pub fn validate(&self) -> Result<(), SimError> {
        let bad = |s: String| Err(SimError::Input(s));
        // Loaded shapes and racks are checked already; built ones are checked here.
        if let Err(why) = self.shape.validate() {
            return bad(format!("model shape {}: {why}", self.shape.name));
        }
        if let Err(why) = self.rack.validate() {
            return bad(format!("rack {}: {why}", self.rack.name));
        }
        if self.ep == 0 {
            return bad("--ep must be at least 1".into());
        }
        if self.ep > self.rack.gpus {
            return bad(format!(
                "--ep {} exceeds the {} GPUs of rack '{}'",
                self.ep, self.rack.gpus, self.rack.name
            ));
        }
        if self.algos.is_empty() {
            return bad("--balancer needs at least one balancer".into());
        }
        if !(1..=MAX_CHUNK_TOKENS).contains(&self.chunk_tokens) {
            return bad(format!(
                "--chunk-tokens must be in 1..={MAX_CHUNK_TOKENS}, got {}",
                self.chunk_tokens
            ));
        }
        if self.sim_layers == 0 || self.sim_layers > self.shape.moe_layers() {
            return bad(format!(
                "--sample-layers must be in 1..={} (the model's MoE layers), got {}",
                self.shape.moe_layers(),
                self.sim_layers
            ));
        }
        if let Some(us) = self.solve_us {
            if !(us.is_finite() && us >= 0.0) {
                return bad(format!(
                    "--solve-us must be a non-negative number, got {us}"
                ));
            }
        }
        Ok(())
    }

    /// Refuses steps of more than [`MAX_STEP_COUNTS`] load counts (`layers` matrices of
    /// `ep x experts`): a step's routing is held whole.
    fn check_step_size(&self, layers: usize) -> Result<(), SimError> {
        let counts = layers
            .saturating_mul(self.ep)
            .saturating_mul(self.shape.experts);
        if counts > MAX_STEP_COUNTS {
            return Err(SimError::Input(format!(
                "{layers} simulated layers x {} ranks x {} experts is {counts} load counts per \
                 step, more than {MAX_STEP_COUNTS} (simulate fewer layers or use a smaller --ep)",
                self.ep, self.shape.experts
            )));
        }
        Ok(())
    }

    fn cost(&self) -> CostModel<'_> {
        CostModel {
            rack: &self.rack,
            shape: &self.shape,
        }
    }
}

/// The balancers of one algorithm: one planner per simulated layer, and the slots each layer's
/// last plan filled (for history-based planners, whose replicas stay resident between steps).
struct AlgoState {
    algo: Algo,
    planners: Vec<Box<dyn Balancer>>,
    previous_slots: Vec<Option<Vec<Option<u32>>>>,
}

/// What one algorithm cost in one step.
#[derive(Debug, Clone, Copy, Default)]
pub struct AlgoStep {
    pub terms: Terms,
    /// Means over the simulated layers.
    pub imbalance_before: f64,
    pub imbalance_after: f64,
    pub replicas: f64,
    pub max_fanout: f64,
    /// Replica bytes the busiest rank sends or receives, MB (1e6 bytes).
    pub replica_mb: f64,
    pub solve_us: f64,
}

/// Steps a set of balancers through routing, costing each step.
pub struct Engine<'a> {
    spec: &'a SimSpec,
    /// Load matrices every step brings (one planner per layer and algorithm).
    layers: usize,
    layout: Layout,
    states: Vec<AlgoState>,
    step: usize,
}

/// History-based planners keep a placement for many steps; deployments keep those replicas
/// resident per layer and copy only what changes. Exact-load planners re-plan every layer and
/// stream into shared slots (UltraEP §4.1).
fn keeps_replicas(algo: Algo) -> bool {
    algo == Algo::EplbHistory
}

impl<'a> Engine<'a> {
    /// An engine for `algos` (any subset of the spec's; none for an ideal-only timeline) over the
    /// spec's `sim_layers` layers.
    pub fn new(spec: &'a SimSpec, algos: &[Algo]) -> Result<Self, SimError> {
        Self::with_layers(spec, algos, spec.sim_layers)
    }

    /// An engine whose steps bring `layers` load matrices (a recorded trace's own layers).
    pub fn with_layers(spec: &'a SimSpec, algos: &[Algo], layers: usize) -> Result<Self, SimError> {
        spec.validate()?;
        spec.check_step_size(layers)?;
        let layout = Layout::contiguous(spec.ep, spec.shape.experts, spec.slots)
            .map_err(|e| SimError::Input(e.to_string()))?;
        let states = algos
            .iter()
            .map(|&algo| AlgoState {
                algo,
                planners: (0..layers).map(|_| algo.build(&spec.settings)).collect(),
                previous_slots: vec![None; layers],
            })
            .collect();
        Ok(Self {
            spec,
            layers,
            layout,
            states,
            step: 0,
        })
    }

    /// The force-balanced ideal of a step in which rank `r` prefills `batch[r]`.
    pub fn ideal(&self, batch: &[Vec<Segment>]) -> Terms {
        let cost = self.spec.cost();
        let tokens: Vec<u64> = batch
            .iter()
            .map(|s| s.iter().map(|x| x.tokens).sum())
            .collect();
        let even = even_load(&tokens, self.spec.shape.experts, self.spec.shape.top_k);
        let plan = Plan::main_only(&self.layout, &even.expert_totals());
        let dispatch = cost.dispatch_ms(&even, &plan);
        let per_layer = Terms {
            dispatch,
            expert: cost.expert_ms(&plan),
            combine: dispatch,
            ..Terms::default()
        };
        cost.step_dense_terms(batch) + per_layer.scaled(self.spec.shape.moe_layers() as f64)
    }

    /// Rank-level imbalance of the ideal's routing: 1 unless the experts do not divide evenly
    /// over the ranks (256 experts on 72 ranks put 4 on some ranks and 3 on others).
    pub fn ideal_imbalance(&self, batch: &[Vec<Segment>]) -> f64 {
        let tokens: Vec<u64> = batch
            .iter()
            .map(|s| s.iter().map(|x| x.tokens).sum())
            .collect();
        let even = even_load(&tokens, self.spec.shape.experts, self.spec.shape.top_k);
        imbalance(&main_rank_loads(&self.layout, &even.expert_totals()))
    }

    /// Costs one step for every algorithm: `batch[r]` is what rank `r` prefills, `loads[l]` the
    /// routing of simulated layer `l`.
    pub fn step(
        &mut self,
        batch: &[Vec<Segment>],
        loads: &[LoadMatrix],
    ) -> Result<Vec<AlgoStep>, SimError> {
        let spec = self.spec;
        if loads.len() != self.layers {
            return Err(SimError::Input(format!(
                "a step brought {} load matrices for {} simulated layers",
                loads.len(),
                self.layers
            )));
        }
        let cost = spec.cost();
        let dense = cost.step_dense_terms(batch);
        let scale = spec.shape.moe_layers() as f64 / loads.len() as f64;
        let layers = loads.len() as f64;
        let bytes = spec.shape.expert_bytes();
        let step = self.step;
        self.step += 1;
        let mut out = Vec::with_capacity(self.states.len());
        for state in &mut self.states {
            if step == 0 {
                warm_up(state.algo, &self.spec.settings, &self.layout, loads);
            }
            let mut acc = AlgoStep::default();
            for (l, load) in loads.iter().enumerate() {
                let planner = &mut state.planners[l];
                let fail = |message: String| SimError::Plan {
                    balancer: state.algo.name().into(),
                    step,
                    layer: l,
                    message,
                };
                let started = Instant::now();
                let plan = planner
                    .plan(&self.layout, load)
                    .map_err(|e| fail(e.to_string()))?;
                let measured_us = started.elapsed().as_secs_f64() * 1e6;
                plan.validate(&self.layout, load, planner.u_min())
                    .map_err(|e| fail(e.to_string()))?;
                // A history balancer re-plans every few steps and keeps its placement between
                // re-plans: only a step whose placement changed pays its solve and its reloads.
                let (traffic, replanned) = if keeps_replicas(state.algo) {
                    let previous = state.previous_slots[l].as_deref();
                    let replanned = previous != Some(plan.slots());
                    let traffic =
                        ReplicaTraffic::new_replicas(&self.layout, &plan, previous, bytes);
                    state.previous_slots[l] = Some(plan.slots().to_vec());
                    (traffic, replanned)
                } else {
                    // Per-rank volumes do not depend on the chunking (chunk 0: one transfer per
                    // copy instead of one per MiB; the chunk size only sets the relay fill term).
                    let whole = RelayConfig {
                        chunk_bytes: 0,
                        ..spec.relay
                    };
                    let schedule = plan_transfers(&plan, bytes, &whole);
                    (ReplicaTraffic::streamed(&schedule), true)
                };
                let solve_us = match state.algo {
                    Algo::None => 0.0,
                    _ if !replanned => 0.0,
                    _ => spec.solve_us.unwrap_or(measured_us),
                };
                let busiest = traffic.send.iter().chain(&traffic.recv).copied().max();
                acc.replica_mb += busiest.unwrap_or(0) as f64 / 1e6 / layers;
                let dispatch = cost.dispatch_ms(load, &plan);
                acc.terms += Terms {
                    solve: solve_us * 1e-3,
                    replicate: cost.replicate_ms(&traffic, spec.relay.chunk_bytes),
                    dispatch,
                    expert: cost.expert_ms(&plan),
                    combine: dispatch,
                    ..Terms::default()
                };
                let before = main_rank_loads(&self.layout, &load.expert_totals());
                acc.imbalance_before += imbalance(&before) / layers;
                acc.imbalance_after += imbalance(&plan.rank_loads()) / layers;
                acc.replicas += plan.replicas() as f64 / layers;
                acc.max_fanout += plan.max_fanout() as f64 / layers;
                acc.solve_us += solve_us / layers;
            }
            acc.terms = dense + acc.terms.scaled(scale);
            out.push(acc);
        }
        Ok(out)
    }
}

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
    mut progress: impl FnMut(usize, usize),
) -> Result<ThroughputReport, SimError> {
    let spec = &run.spec;
    if !(1..=MAX_STEPS).contains(&run.steps) {
        return Err(SimError::Input(format!(
            "--steps must be in 1..={MAX_STEPS}, got {}",
            run.steps
        )));
    }
    spec.validate()?;
    let mut routing = match &run.trace {
        TraceSource::SyntheticMixed => Routing::synthetic_mixed(
            spec.ep,
            spec.shape.experts,
            spec.shape.top_k,
            spec.sim_layers,
            spec.chunk_tokens,
            run.steps,
            spec.seed,
        )?,
        TraceSource::File(path) => Routing::recorded(path, spec.ep, spec.shape.experts)?,
    };
    let mut engine = Engine::with_layers(spec, &spec.algos, routing.layers())?;
    let mut ideal = TimedTerms::default();
    let mut algos: Vec<TimedTerms> = vec![TimedTerms::default(); spec.algos.len()];
    let mut stats = vec![AlgoStep::default(); spec.algos.len()];
    let mut steps = 0;
    let mut ideal_imbalance = 0.0;
    while steps < run.steps {
        let Some(loads) = routing.next_step() else {
            break;
        };
        let loads = loads?;
        let batch = step_batch(run, &loads);
        let tokens: u64 = batch.iter().flatten().map(|s| s.tokens).sum();
        ideal.push(engine.ideal(&batch), tokens);
        ideal_imbalance += engine.ideal_imbalance(&batch);
        for ((acc, stat), result) in algos
            .iter_mut()
            .zip(&mut stats)
            .zip(engine.step(&batch, &loads)?)
        {
            acc.push(result.terms, tokens);
            stat.imbalance_before += result.imbalance_before;
            stat.imbalance_after += result.imbalance_after;
            stat.replicas += result.replicas;
            stat.max_fanout += result.max_fanout;
            stat.replica_mb += result.replica_mb;
            stat.solve_us += result.solve_us;
        }
        steps += 1;
        progress(steps, run.steps);
    }
    if steps == 0 {
        return Err(SimError::Input("the routing trace has no steps".into()));
    }
    let n = steps as f64;
    let moe_layers = spec.shape.moe_layers() as f64;
    let balancers = spec
        .algos
        .iter()
        .zip(&algos)
        .zip(&stats)
        .map(|((algo, acc), stat)| BalancerReport {
            balancer: algo.name().into(),
            tokens_per_s: acc.tokens_per_s(),
            fraction_of_ideal: ideal.total_ms() / acc.total_ms(),
            step_ms: acc.total_ms() / n,
            breakdown_ms: acc.terms.scaled(1.0 / n),
            layer_ms: acc.terms.scaled(1.0 / (n * moe_layers)),
            mean_imbalance: Imbalance {
                before: stat.imbalance_before / n,
                after: stat.imbalance_after / n,
            },
            replicas_mean: stat.replicas / n,
            max_fanout_mean: stat.max_fanout / n,
            replica_mb_busiest_mean: stat.replica_mb / n,
            solve_us_mean: round_us(stat.solve_us / n),
            step_ms_series: acc.step_ms.clone(),
        })
        .collect();
    Ok(ThroughputReport {
        model: spec.shape.name.clone(),
        rack: spec.rack.name.clone(),
        ep: spec.ep,
        slots: spec.slots,
        trace: run.trace.label(),
        steps,
        seed: spec.seed,
        chunk_tokens: match run.trace {
            TraceSource::SyntheticMixed => Some(spec.chunk_tokens),
            TraceSource::File(_) => None,
        },
        tokens_per_rank_mean: ideal.tokens as f64 / (n * spec.ep as f64),
        context_tokens: run.context_tokens,
        moe_layers: spec.shape.moe_layers(),
        simulated_layers: routing.layers(),
        solve_us_override: spec.solve_us,
        ideal: report::IdealReport {
            tokens_per_s: ideal.tokens_per_s(),
            step_ms: ideal.total_ms() / n,
            breakdown_ms: ideal.terms.scaled(1.0 / n),
            layer_ms: ideal.terms.scaled(1.0 / (n * moe_layers)),
            imbalance: ideal_imbalance / n,
            step_ms_series: ideal.step_ms,
        },
        balancers,
    })
}

/// What every rank prefills in a throughput step: a full chunk on synthetic routing; on a
/// recorded trace, the tokens its first layer's row implies (row sum / top-k).
fn step_batch(run: &ThroughputRun, loads: &[LoadMatrix]) -> Vec<Vec<Segment>> {
    let spec = &run.spec;
    match run.trace {
        TraceSource::SyntheticMixed => vec![
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

/// Plans the first step once with a throwaway planner, untimed, so the measured solve of step 0
/// is not a cold start (first-touch allocations, cold caches) that a serving engine pays once,
/// not per layer. A throwaway instance keeps history planners' windows clean.
fn warm_up(algo: Algo, settings: &Settings, layout: &Layout, loads: &[LoadMatrix]) {
    let mut planner = algo.build(settings);
    for load in loads {
        // A failing plan is reported by the timed call that follows.
        let _ = planner.plan(layout, load);
    }
}
