//! A benchmark run end to end: the workload, the sweep of arrival processes, and one report per
//! run.

use std::sync::Arc;

use std::time::Duration;

use super::arrivals::{self, ArrivalError, Arrivals, RequestRate};
use super::client::Api;
use super::dataset::{Prompt, RequestSpec};
use super::error::ServeBenchError;
use super::report::{ReportOptions, RunMeta, Summary};
use super::runner::{self, RunOptions, RunResult, Target};

/// The requests of a benchmark and where they came from.
#[derive(Debug, Clone)]
pub struct Workload {
    pub requests: Arc<[RequestSpec]>,
    /// `random`, `sharegpt`, `trace`, `multi-turn` or `eval` (reported as `dataset`).
    pub dataset: String,
    /// Reported as `tokenizer_id` when lengths were counted with a tokenizer.
    pub tokenizer_id: Option<String>,
}

impl Workload {
    pub fn new(requests: Vec<RequestSpec>, dataset: &str) -> Self {
        Self {
            requests: requests.into(),
            dataset: dataset.to_string(),
            tokenizer_id: None,
        }
    }

    /// Refuses prompts `api` cannot carry: conversation turns and scored prompts are token ids
    /// for `/v1/completions` (chat takes text, and has no `echo` to score a prompt with).
    pub fn check_api(&self, api: Api) -> Result<(), ServeBenchError> {
        let ids_only =
            |r: &RequestSpec| matches!(r.prompt, Prompt::Turn { .. } | Prompt::Scored { .. });
        if api == Api::Chat && self.requests.iter().any(ids_only) {
            return Err(ServeBenchError::Config(format!(
                "--dataset {} sends token-id prompts to /v1/completions; chat endpoints are not \
                 supported for it",
                self.dataset
            )));
        }
        Ok(())
    }
}

/// One send offset per request: the arrival process runs over the sessions (a conversation
/// arrives once, see [`runner::sessions`]), and every request of a session gets its session's
/// offset.
fn offsets(
    arrivals: Arrivals,
    requests: &[RequestSpec],
    seed: u64,
) -> Result<Vec<Duration>, ArrivalError> {
    let sessions = runner::sessions(requests);
    if sessions.len() == requests.len() {
        return arrivals::schedule(arrivals, requests, seed);
    }
    let heads: Vec<RequestSpec> = sessions.iter().map(|s| requests[s.start].clone()).collect();
    let times = arrivals::schedule(arrivals, &heads, seed)?;
    Ok(sessions
        .into_iter()
        .zip(times)
        .flat_map(|(session, t)| session.map(move |_| t))
        .collect())
}

/// What to run: one full run per entry of `arrivals`, each over the whole workload.
#[derive(Debug, Clone)]
pub struct SweepPlan {
    pub arrivals: Vec<Arrivals>,
    /// Seeds the arrival processes (the same gaps for every rate, scaled).
    pub seed: u64,
    /// Send the first request once, unmeasured, before the first run; its failure aborts.
    pub warmup: bool,
    pub run: RunOptions,
    pub report: ReportOptions,
}

impl SweepPlan {
    /// Runs at `rates` with gamma `burstiness`, warm-up on, no limits, default percentiles.
    pub fn rates(rates: &[RequestRate], burstiness: f64) -> Self {
        Self {
            arrivals: rates
                .iter()
                .map(|&rate| Arrivals::Rate { rate, burstiness })
                .collect(),
            seed: 0,
            warmup: true,
            run: RunOptions::default(),
            report: ReportOptions::default(),
        }
    }

    /// Refuses plans that cannot run (empty workload, zero concurrency or duration, percentiles
    /// outside (0, 100], arrivals that cannot be scheduled: a bad burstiness or speed-up, a
    /// replay of requests without timestamps); [`run_sweep`] checks too, callers may check
    /// before connecting.
    pub fn check(&self, workload: &Workload) -> Result<(), ServeBenchError> {
        let bad = |message: String| Err(ServeBenchError::Config(message));
        if workload.requests.is_empty() {
            return bad("the dataset has no requests (--num-prompts must be at least 1)".into());
        }
        if self.arrivals.is_empty() {
            return bad("no request rate to run".into());
        }
        if self.run.max_concurrency == Some(0) {
            return bad("--max-concurrency must be at least 1".into());
        }
        if self.run.duration.is_some_and(|d| d.is_zero()) {
            return bad("--duration must be positive".into());
        }
        if let Some(p) = self
            .report
            .percentiles
            .iter()
            .find(|p| !(**p > 0.0 && **p <= 100.0))
        {
            return bad(format!("percentiles must be in (0, 100], got {p}"));
        }
        for &arrivals in &self.arrivals {
            offsets(arrivals, &workload.requests, self.seed)?;
        }
        Ok(())
    }
}

/// One run's summary and its raw records.
#[derive(Debug, Clone)]
pub struct RateReport {
    pub summary: Summary,
    pub run: RunResult,
}

/// Runs `plan` against `target`: warm-up, then every arrival process in turn (each waits for
/// the previous run's last response). Once `plan.run.stop` is raised the run in progress
/// sends nothing more and no later run starts; what ran is returned.
pub async fn run_sweep(
    target: &Target,
    workload: &Workload,
    plan: &SweepPlan,
) -> Result<Vec<RateReport>, ServeBenchError> {
    plan.check(workload)?;
    workload.check_api(target.api())?;
    let first = &workload.requests[0];
    if plan.warmup {
        runner::warmup(target, first).await?;
    }
    let mut reports = Vec::with_capacity(plan.arrivals.len());
    for &arrivals in &plan.arrivals {
        let offsets = offsets(arrivals, &workload.requests, plan.seed)?;
        let options = RunOptions {
            label: match arrivals {
                Arrivals::Rate { rate, .. } => format!("rate {rate}"),
                Arrivals::Replay { speedup } => format!("trace x{speedup}"),
            },
            ..plan.run.clone()
        };
        let run = runner::run(target, &workload.requests, &offsets, &options).await;
        let meta = RunMeta {
            backend: target.api().backend_name().into(),
            base_url: target.config().base_url.trim_end_matches('/').into(),
            endpoint: target.config().endpoint.clone(),
            model_id: target.model().into(),
            tokenizer_id: workload.tokenizer_id.clone(),
            dataset: workload.dataset.clone(),
            arrivals,
            max_concurrency: plan.run.max_concurrency,
        };
        let summary = Summary::new(&run, &meta, &plan.report);
        reports.push(RateReport { summary, run });
        if plan.run.stopped() {
            break;
        }
    }
    Ok(reports)
}
