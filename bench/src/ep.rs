//! `rackfill bench ep`: the EP runtime against the dense path on one host.
//!
//! One step prefills `sequences` prompts (sequence `i` on rank `i % R`, data-parallel attention)
//! through the dense single-device path and through the EP runtime at each requested EP size and
//! balancer, alternating configurations every round so machine noise hits all of them. Reported
//! per configuration: prefill tokens/s (median over rounds) and its ratio to dense, which is the
//! EP machinery's overhead on one host, and the simulated MoE makespan with the plan and without
//! balancing, summed over layers: every layer's load and plan costed on the runtime's rack (NVL72)
//! by the cost model `rackfill simulate` uses (`rackfill_engine::rack_cost`). Each configuration
//! names its schedule (`rackfill_engine::Schedule`: micro-batches and pipelined experts) and slot
//! memory, in the words `rackfill simulate` uses.

use std::time::Instant;

use rackfill_balancer::Algo;
use rackfill_engine::{EpConfig, EpRuntime, Rack, Schedule, SlotMemory, StepOutput};
use rackfill_models::{LogitsFor, MoeModel, SequenceInput};
use serde::Serialize;
use std::sync::Arc;

/// Most prompt tokens one step may carry, all sequences together: the dense path and every EP
/// configuration prefill them at once in this process (the default is 8 x 512).
pub const MAX_STEP_TOKENS: usize = 1 << 16;

/// Errors of the EP bench.
#[derive(Debug, thiserror::Error)]
pub enum EpBenchError {
    #[error(transparent)]
    Model(#[from] rackfill_models::ModelError),
    #[error(transparent)]
    Engine(#[from] rackfill_engine::EngineError),
    #[error("no prompts to run")]
    NoPrompts,
    #[error("prompt {index} has {tokens} tokens, more than the model's context of {context}")]
    PromptTooLong {
        index: usize,
        tokens: usize,
        context: usize,
    },
    #[error("the prompts hold more than {MAX_STEP_TOKENS} tokens in all (one step prefills them at once)")]
    TooManyTokens,
    #[error(
        "EP size {ep} must be in 1..={experts}: the model has {experts} routed experts, and a rank \
         beyond them would home none"
    )]
    EpSize { ep: usize, experts: usize },
}

/// Checks that one step of prompts of these lengths can run: each within the model's context,
/// together within [`MAX_STEP_TOKENS`] (stops at the first excess, so any count is cheap).
fn check_prompt_lengths(
    model: &MoeModel,
    lengths: impl IntoIterator<Item = usize>,
) -> Result<(), EpBenchError> {
    let context = model.config().max_position_embeddings;
    let mut total = 0usize;
    for (index, tokens) in lengths.into_iter().enumerate() {
        if tokens > context {
            return Err(EpBenchError::PromptTooLong {
                index,
                tokens,
                context,
            });
        }
        total = total.saturating_add(tokens);
        if total > MAX_STEP_TOKENS {
            return Err(EpBenchError::TooManyTokens);
        }
    }
    Ok(())
}

/// `count` seeded random prompts of `len` tokens from the model's vocabulary, checked before
/// anything is allocated.
pub fn random_prompts(
    model: &MoeModel,
    count: usize,
    len: usize,
    seed: u64,
) -> Result<Vec<Vec<u32>>, EpBenchError> {
    use rand::{Rng as _, SeedableRng as _};
    check_prompt_lengths(model, std::iter::repeat_n(len, count))?;
    let vocab = model.config().vocab_size as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5EED);
    Ok((0..count)
        .map(|_| (0..len).map(|_| rng.gen_range(0..vocab)).collect())
        .collect())
}

/// One EP configuration to time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct EpCase {
    pub ep_size: usize,
    #[serde(serialize_with = "algo_name")]
    pub balancer: Algo,
    /// Micro-batches per step and pipelined experts (`ultraep`, `pipelined`, `two-batch`,
    /// `overlapped`).
    #[serde(serialize_with = "schedule_name")]
    pub schedule: Schedule,
    /// One set of replica slots for every MoE layer, or one each (resident replicas reused).
    pub slot_memory: SlotMemory,
}

fn algo_name<S: serde::Serializer>(algo: &Algo, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(algo.name())
}

fn schedule_name<S: serde::Serializer>(schedule: &Schedule, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&schedule.name())
}

/// Figures of one configuration (or of the dense path, `case: None`).
#[derive(Debug, Clone, Serialize)]
pub struct EpResult {
    pub case: Option<EpCase>,
    pub tokens_per_s: f64,
    /// Dense tokens/s over this configuration's (1.0 for dense; 1.15 = 15% overhead).
    pub slowdown_vs_dense: f64,
    pub seconds: Vec<f64>,
    /// Mean over MoE layers of the rank-load imbalance before and after the plan.
    pub mean_imbalance_before: f64,
    pub mean_imbalance_after: f64,
    /// Simulated MoE makespan on the report's rack summed over layers, microseconds: with the
    /// plan, and the same loads without balancing.
    pub simulated_moe_us: f64,
    pub simulated_moe_unbalanced_us: f64,
    pub replicas: usize,
    pub replica_bytes: u64,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct EpReport {
    pub model: String,
    /// The rack the simulated makespans are costed on.
    pub rack: String,
    pub sequences: usize,
    pub tokens_per_step: usize,
    pub redundant_slots: usize,
    pub results: Vec<EpResult>,
}

/// Checks a step can run before anything is built: prompts present, each within the model's
/// context and together within [`MAX_STEP_TOKENS`], and every EP size within the model's experts.
pub fn check_step(
    model: &MoeModel,
    prompts: &[Vec<u32>],
    cases: &[EpCase],
) -> Result<(), EpBenchError> {
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
        return Err(EpBenchError::NoPrompts);
    }
    check_prompt_lengths(model, prompts.iter().map(Vec::len))?;
    let experts = model.config().moe.num_experts;
    match cases.iter().find(|c| !(1..=experts).contains(&c.ep_size)) {
        Some(case) => Err(EpBenchError::EpSize {
            ep: case.ep_size,
            experts,
        }),
        None => Ok(()),
    }
}

/// Runs the comparison over `rounds` alternating rounds after one warm-up round.
pub fn run_ep(
    model: Arc<MoeModel>,
    model_name: &str,
    prompts: &[Vec<u32>],
    cases: &[EpCase],
    redundant_slots: usize,
    rack: &Rack,
    rounds: usize,
) -> Result<EpReport, EpBenchError> {
    check_step(&model, prompts, cases)?;
    let tokens: usize = prompts.iter().map(Vec::len).sum();
    let mut runtimes: Vec<EpRuntime> = cases
        .iter()
        .map(|c| {
            let mut runtime = EpRuntime::new(
                Arc::clone(&model),
                EpConfig {
                    ep_size: c.ep_size,
                    redundant_slots,
                    balancer: c.balancer,
                    schedule: c.schedule,
                    slot_memory: c.slot_memory,
                    ..EpConfig::default()
                },
            )?;
            runtime.set_rack(rack.clone());
            Ok::<_, EpBenchError>(runtime)
        })
        .collect::<Result<_, _>>()?;
    let mut dense_seconds = Vec::new();
    let mut seconds: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    let mut last_steps: Vec<Option<StepOutput>> = cases.iter().map(|_| None).collect();
    for round in 0..=rounds.max(1) {
        let took = time_dense(&model, prompts)?;
        if round > 0 {
            dense_seconds.push(took);
        }
        for (i, runtime) in runtimes.iter_mut().enumerate() {
            let (took, step) = time_ep(runtime, &model, prompts)?;
            if round > 0 {
                seconds[i].push(took);
            }
            last_steps[i] = Some(step);
        }
    }
    let dense_tps = tokens as f64 / median(&dense_seconds);
    let mut results = vec![EpResult {
        case: None,
        tokens_per_s: dense_tps,
        slowdown_vs_dense: 1.0,
        seconds: dense_seconds,
        mean_imbalance_before: 0.0,
        mean_imbalance_after: 0.0,
        simulated_moe_us: 0.0,
        simulated_moe_unbalanced_us: 0.0,
        replicas: 0,
        replica_bytes: 0,
    }];
    for ((case, secs), step) in cases.iter().zip(seconds).zip(last_steps) {
        let layers = step.map(|s| s.layers).unwrap_or_default();
        let n = layers.len().max(1) as f64;
        let tps = tokens as f64 / median(&secs);
        results.push(EpResult {
            case: Some(*case),
            tokens_per_s: tps,
            slowdown_vs_dense: dense_tps / tps,
            seconds: secs,
            mean_imbalance_before: layers
                .iter()
                .map(|l| l.metrics.imbalance_before)
                .sum::<f64>()
                / n,
            mean_imbalance_after: layers
                .iter()
                .map(|l| l.metrics.imbalance_after)
                .sum::<f64>()
                / n,
            simulated_moe_us: layers.iter().map(|l| l.simulated.balanced_us).sum(),
            simulated_moe_unbalanced_us: layers.iter().map(|l| l.simulated.unbalanced_us).sum(),
            replicas: layers.iter().map(|l| l.metrics.replicas).sum(),
            replica_bytes: layers.iter().map(|l| l.replica_bytes).sum(),
        });
    }
    Ok(EpReport {
        model: model_name.to_string(),
        rack: rack.name.clone(),
        sequences: prompts.len(),
        tokens_per_step: tokens,
        redundant_slots,
        results,
    })
}

fn time_dense(model: &MoeModel, prompts: &[Vec<u32>]) -> Result<f64, EpBenchError> {
    let mut caches: Vec<_> = prompts.iter().map(|_| model.new_cache()).collect();
    let mut batch: Vec<SequenceInput<'_>> = prompts
        .iter()
        .zip(caches.iter_mut())
        .map(|(p, cache)| SequenceInput { tokens: p, cache })
        .collect();
    let started = Instant::now();
    model.forward(&mut batch, LogitsFor::LastPosition)?;
    Ok(started.elapsed().as_secs_f64())
}

fn time_ep(
    runtime: &mut EpRuntime,
    model: &MoeModel,
    prompts: &[Vec<u32>],
) -> Result<(f64, StepOutput), EpBenchError> {
    let ranks = runtime.config().ep_size;
    let mut caches: Vec<_> = prompts.iter().map(|_| model.new_cache()).collect();
    let mut batches: Vec<Vec<SequenceInput<'_>>> = (0..ranks).map(|_| Vec::new()).collect();
    for (i, (p, cache)) in prompts.iter().zip(caches.iter_mut()).enumerate() {
        batches[i % ranks].push(SequenceInput { tokens: p, cache });
    }
    let which: Vec<Vec<LogitsFor>> = batches
        .iter()
        .map(|b| vec![LogitsFor::LastPosition; b.len()])
        .collect();
    let started = Instant::now();
    let step = runtime.forward(&mut batches, &which)?;
    Ok((started.elapsed().as_secs_f64(), step))
}

fn median(xs: &[f64]) -> f64 {
    let mut sorted = xs.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN)
}

impl EpReport {
    /// A Markdown table of the results.
    pub fn to_table(&self) -> String {
        let mut out = format!(
            "| path | tokens/s | dense / this | imbalance before -> after | simulated MoE us on {} (plan / none) | replicas | replica MB |\n\
             |:--|--:|--:|:--|:--|--:|--:|\n",
            self.rack
        );
        for r in &self.results {
            let name = match r.case {
                None => "dense (1 device)".to_string(),
                Some(c) => {
                    let mut name = format!(
                        "EP {} {}, {}",
                        c.ep_size,
                        c.balancer.name(),
                        c.schedule.name()
                    );
                    if c.slot_memory != SlotMemory::Shared {
                        name += &format!(", {} slots", c.slot_memory.name());
                    }
                    name
                }
            };
            let (imb, sim) = match r.case {
                None => ("-".to_string(), "-".to_string()),
                Some(_) => (
                    format!(
                        "{:.2} -> {:.2}",
                        r.mean_imbalance_before, r.mean_imbalance_after
                    ),
                    format!(
                        "{:.0} / {:.0} ({:.2}x)",
                        r.simulated_moe_us,
                        r.simulated_moe_unbalanced_us,
                        r.simulated_moe_unbalanced_us / r.simulated_moe_us.max(f64::MIN_POSITIVE)
                    ),
                ),
            };
            out.push_str(&format!(
                "| {name} | {:.0} | {:.3} | {imb} | {sim} | {} | {:.1} |\n",
                r.tokens_per_s,
                r.slowdown_vs_dense,
                r.replicas,
                r.replica_bytes as f64 / 1e6
            ));
        }
        out
    }
}
