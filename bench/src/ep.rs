//! `rackfill bench ep`: the EP runtime against the dense path on one host.
//!
//! One step prefills `sequences` prompts (sequence `i` on rank `i % R`, data-parallel attention)
//! through the dense single-device path and through the EP runtime at each requested EP size and
//! balancer, alternating configurations every round so machine noise hits all of them. Reported
//! per configuration: prefill tokens/s (median over rounds) and its ratio to dense, which is the
//! EP machinery's overhead on one host, and, from the runtime's per-rank cost model, the
//! simulated MoE makespan with the plan and without balancing, summed over layers. Each
//! configuration also names its data plane, so a GPU host times the CPU and GPU planes side by
//! side in one run.

use std::time::Instant;

use rackfill_balancer::Algo;
use rackfill_engine::{DataPlane, EpConfig, EpRuntime, StepOutput};
use rackfill_models::{LogitsFor, MoeModel, SequenceInput};
use serde::Serialize;
use std::sync::Arc;

/// Errors of the EP bench.
#[derive(Debug, thiserror::Error)]
pub enum EpBenchError {
    #[error(transparent)]
    Model(#[from] rackfill_models::ModelError),
    #[error(transparent)]
    Engine(#[from] rackfill_engine::EngineError),
    #[error("no prompts to run")]
    NoPrompts,
}

/// One EP configuration to time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct EpCase {
    pub ep_size: usize,
    #[serde(serialize_with = "algo_name")]
    pub balancer: Algo,
    /// Where the MoE data plane runs (`cpu`, `gpu:N`).
    #[serde(serialize_with = "plane_name")]
    pub data_plane: DataPlane,
}

fn algo_name<S: serde::Serializer>(algo: &Algo, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(algo.name())
}

fn plane_name<S: serde::Serializer>(plane: &DataPlane, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(plane)
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
    /// Cost-model MoE makespan summed over layers, microseconds: with the plan, and the same
    /// loads without balancing.
    pub simulated_moe_us: f64,
    pub simulated_moe_unbalanced_us: f64,
    pub replicas: usize,
    pub replica_bytes: u64,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct EpReport {
    pub model: String,
    pub sequences: usize,
    pub tokens_per_step: usize,
    pub redundant_slots: usize,
    pub results: Vec<EpResult>,
}

/// Runs the comparison over `rounds` alternating rounds after one warm-up round.
pub fn run_ep(
    model: Arc<MoeModel>,
    model_name: &str,
    prompts: &[Vec<u32>],
    cases: &[EpCase],
    redundant_slots: usize,
    rounds: usize,
) -> Result<EpReport, EpBenchError> {
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
        return Err(EpBenchError::NoPrompts);
    }
    let tokens: usize = prompts.iter().map(Vec::len).sum();
    let mut runtimes: Vec<EpRuntime> = cases
        .iter()
        .map(|c| {
            EpRuntime::new(
                Arc::clone(&model),
                EpConfig {
                    ep_size: c.ep_size,
                    redundant_slots,
                    balancer: c.balancer,
                    data_plane: c.data_plane,
                    ..EpConfig::default()
                },
            )
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
        let mut out = String::from(
            "| path | tokens/s | dense / this | imbalance before -> after | simulated MoE us (plan / none) | replicas | replica MB |\n\
             |:--|--:|--:|:--|:--|--:|--:|\n",
        );
        for r in &self.results {
            let name = match r.case {
                None => "dense (1 device)".to_string(),
                Some(c) => match c.data_plane {
                    DataPlane::Cpu => format!("EP {} {}", c.ep_size, c.balancer.name()),
                    gpu => format!("EP {} {} ({gpu})", c.ep_size, c.balancer.name()),
                },
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
