//! What `rackfill simulate` reports: the JSON documents (`--json`), the readable tables, and the
//! plots (`--plot-prefix`).

use super::calibration::CalibrationReport;
use super::cost::{Terms, TERM_NAMES};
use super::step::ScheduledStep;
use crate::plot::{write_chart, Chart, PlotError, Series};
use serde::Serialize;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Running sums of one balancer's (or the ideal's) steps.
#[derive(Debug, Clone, Default)]
pub struct TimedTerms {
    /// Work per term, summed over the steps.
    pub terms: Terms,
    pub tokens: u64,
    /// Each step's makespan under its schedule.
    pub step_ms: Vec<f64>,
    /// Replica MB the busiest rank moved per layer, summed over the steps.
    pub replica_mb: f64,
}

impl TimedTerms {
    /// Adds one step that prefilled `tokens` tokens.
    pub fn push(&mut self, step: &ScheduledStep, tokens: u64) {
        self.terms += step.terms;
        self.tokens += tokens;
        self.step_ms.push(step.step_ms);
        self.replica_mb += step.replica_mb;
    }

    /// The steps' time: their makespans summed.
    pub fn total_ms(&self) -> f64 {
        self.step_ms.iter().sum()
    }

    pub fn tokens_per_s(&self) -> f64 {
        self.tokens as f64 / (self.total_ms() / 1e3)
    }
}

/// Mean rank-level imbalance (`max L / mean L`) over layers and steps.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Imbalance {
    /// Main experts only (`L0`).
    pub before: f64,
    /// After the balancer's plan.
    pub after: f64,
}

/// The force-balanced ideal: same tokens, every expert equally loaded, no replicas, no solve.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct IdealReport {
    pub tokens_per_s: f64,
    pub step_ms: f64,
    /// Per-term milliseconds of an average step (all layers).
    pub breakdown_ms: Terms,
    /// The same per MoE layer (`breakdown_ms / moe_layers`), as UltraEP Fig. 13 reports.
    pub layer_ms: Terms,
    /// Rank-level imbalance of the even routing (above 1 only when experts do not divide evenly
    /// over the ranks).
    pub imbalance: f64,
    /// The ideal under every schedule of the ablation.
    pub schedules: Vec<ScheduleReport>,
    #[serde(skip)]
    pub step_ms_series: Vec<f64>,
}

/// One schedule's figures (the ablation): a balancer's, or the ideal's (fraction 1).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScheduleReport {
    pub schedule: String,
    pub tokens_per_s: f64,
    /// The ideal's time under the same schedule over this time.
    pub fraction_of_ideal: f64,
    pub step_ms: f64,
    /// Work per term per MoE layer, every micro-batch's phases summed.
    pub layer_ms: Terms,
    /// Replica MB the busiest rank moved per MoE layer (both micro-batches' replicas).
    pub replica_mb_busiest_mean: f64,
}

/// One balancer's throughput result.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BalancerReport {
    pub balancer: String,
    pub tokens_per_s: f64,
    /// Ideal time over this balancer's time for the same tokens, both under the report's
    /// schedule.
    pub fraction_of_ideal: f64,
    /// Tokens/s under the report's schedule over tokens/s under UltraEP's (one micro-batch,
    /// solve and replication on the critical path): what the schedule gains a user.
    pub speedup_over_ultraep: f64,
    /// The step's makespan under the report's schedule.
    pub step_ms: f64,
    /// Work per term of an average step (every micro-batch's phases summed; with overlap it
    /// exceeds `step_ms`).
    pub breakdown_ms: Terms,
    pub layer_ms: Terms,
    pub mean_imbalance: Imbalance,
    /// Replicas per layer.
    pub replicas_mean: f64,
    /// Largest fan-out (replicas of one expert) per layer.
    pub max_fanout_mean: f64,
    /// Replica-weight MB the busiest rank sends or receives per layer.
    pub replica_mb_busiest_mean: f64,
    /// Solve time per layer as charged (0 for `none`).
    pub solve_us_mean: f64,
    /// Every schedule of the ablation: UltraEP's, pipelined experts, two-batch overlap, both.
    pub schedules: Vec<ScheduleReport>,
    #[serde(skip)]
    pub step_ms_series: Vec<f64>,
}

/// `rackfill simulate` without `--requests`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ThroughputReport {
    pub model: String,
    pub rack: String,
    pub ep: usize,
    pub slots: usize,
    pub trace: String,
    pub steps: usize,
    pub seed: u64,
    /// `--chunk-tokens`, when it set the tokens (synthetic routing); `None` for a recorded trace,
    /// whose rows set them.
    pub chunk_tokens: Option<u64>,
    /// Tokens a rank prefilled per step, on average: what actually ran.
    pub tokens_per_rank_mean: f64,
    pub context_tokens: u64,
    pub moe_layers: usize,
    /// Load matrices costed per step, each standing for `moe_layers / simulated_layers` layers.
    pub simulated_layers: usize,
    /// Solve time charged per layer; `None`: measured live on this host.
    pub solve_us_override: Option<f64>,
    /// Where the charged solve time comes from, e.g. `modelled: UltraEP's planner on a GB200`.
    pub solve_time: String,
    /// How synthetic routing drew each rank's row (`counts` or `tokens`).
    pub sampler: String,
    /// The measured rates the rack was calibrated with (`--calibration`), and what is assumed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub calibration: Option<CalibrationReport>,
    /// The schedule the headline figures are under (`--schedule`).
    pub schedule: String,
    /// `shared` or `per-layer` (`--slot-memory`).
    pub slot_memory: String,
    /// With per-layer slots: how much more load the busiest rank may take for quota plans to
    /// reuse resident replicas (`--reuse-tolerance`); `None`: plans as solved.
    pub reuse_tolerance: Option<f64>,
    /// Redundant-slot memory per GPU under the headline schedule, GB.
    pub slot_gb_per_gpu: f64,
    pub ideal: IdealReport,
    pub balancers: Vec<BalancerReport>,
}

/// One (balancer or ideal, rate) point of a request-trace simulation, with the serving
/// benchmark field names.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RateReport {
    pub balancer: String,
    /// Requests/s the trace was re-timed at; `None`: its own timestamps.
    pub request_rate: Option<f64>,
    pub completed: usize,
    pub duration_s: f64,
    pub request_throughput: f64,
    pub input_throughput: f64,
    pub mean_ttft_ms: f64,
    pub median_ttft_ms: f64,
    pub p99_ttft_ms: f64,
    pub steps: usize,
    pub mean_step_ms: f64,
}

/// `rackfill simulate --requests`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RequestReport {
    pub model: String,
    pub rack: String,
    pub ep: usize,
    pub slots: usize,
    pub requests: usize,
    pub seed: u64,
    pub chunk_tokens: u64,
    pub moe_layers: usize,
    pub simulated_layers: usize,
    pub solve_us_override: Option<f64>,
    pub results: Vec<RateReport>,
}

fn terms_row(out: &mut String, label: &str, terms: &Terms) {
    let _ = write!(out, "{label:<14}");
    for v in terms.values() {
        let _ = write!(out, " {v:>10.3}");
    }
    let _ = writeln!(out, " {:>10.3}", terms.total());
}

/// The readable form of a throughput report.
pub fn throughput_table(r: &ThroughputReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} on {}: EP {}, {} slots/rank, trace {}, {} steps x {} MoE layers ({} simulated), \
         {}{}",
        r.model,
        r.rack,
        r.ep,
        r.slots,
        r.trace,
        r.steps,
        r.moe_layers,
        r.simulated_layers,
        match r.chunk_tokens {
            Some(chunk) => format!("{chunk} tokens/rank/step"),
            None => format!(
                "tokens/rank/step from the trace (mean {:.1})",
                r.tokens_per_rank_mean
            ),
        },
        match r.solve_us_override {
            Some(us) => format!(", solve {us} us/layer ({})", r.solve_time),
            None => ", solve measured on this host".into(),
        }
    );
    let _ = writeln!(
        out,
        "schedule: {}, slot memory: {} ({:.1} GB of redundant slots per GPU){}",
        r.schedule,
        r.slot_memory,
        r.slot_gb_per_gpu,
        match r.reuse_tolerance {
            Some(t) => format!(
                ", resident replicas preferred within {:.1}% of the peak",
                t * 100.0
            ),
            None => String::new(),
        }
    );
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:<14} {:>12} {:>9} {:>9} {:>10} {:>10} {:>10} {:>9} {:>8} {:>8} {:>9}",
        "balancer",
        "tokens/s",
        "of ideal",
        "x ultraep",
        "step ms",
        "imb before",
        "imb after",
        "replicas",
        "fan-out",
        "repl MB",
        "solve us"
    );
    let _ = writeln!(
        out,
        "{:<14} {:>12.0} {:>9.3} {:>9} {:>10.2} {:>10} {:>10.3} {:>9} {:>8} {:>8} {:>9}",
        "ideal",
        r.ideal.tokens_per_s,
        1.0,
        "-",
        r.ideal.step_ms,
        "-",
        r.ideal.imbalance,
        0,
        0,
        0,
        0
    );
    for b in &r.balancers {
        let _ = writeln!(
            out,
            "{:<14} {:>12.0} {:>9.3} {:>9.3} {:>10.2} {:>10.3} {:>10.3} {:>9.1} {:>8.1} {:>8.1} {:>9.1}",
            b.balancer,
            b.tokens_per_s,
            b.fraction_of_ideal,
            b.speedup_over_ultraep,
            b.step_ms,
            b.mean_imbalance.before,
            b.mean_imbalance.after,
            b.replicas_mean,
            b.max_fanout_mean,
            b.replica_mb_busiest_mean,
            b.solve_us_mean
        );
    }
    let _ = writeln!(out);
    let _ = write!(out, "{:<14}", "ms per MoE layer");
    for name in TERM_NAMES {
        let _ = write!(out, " {name:>10}");
    }
    let _ = writeln!(out, " {:>10}", "total");
    terms_row(&mut out, "ideal", &r.ideal.layer_ms);
    for b in &r.balancers {
        terms_row(&mut out, &b.balancer, &b.layer_ms);
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:<14} {:<12} {:>12} {:>9} {:>10} {:>10} {:>8}",
        "ablation", "schedule", "tokens/s", "of ideal", "step ms", "work ms", "repl MB"
    );
    let rows = std::iter::once(("ideal", &r.ideal.schedules)).chain(
        r.balancers
            .iter()
            .map(|b| (b.balancer.as_str(), &b.schedules)),
    );
    for (label, schedules) in rows {
        for s in schedules {
            let _ = writeln!(
                out,
                "{:<14} {:<12} {:>12.0} {:>9.3} {:>10.2} {:>10.3} {:>8.1}",
                label,
                s.schedule,
                s.tokens_per_s,
                s.fraction_of_ideal,
                s.step_ms,
                s.layer_ms.total(),
                s.replica_mb_busiest_mean
            );
        }
    }
    let _ = writeln!(
        out,
        "(work ms: every phase of every micro-batch per MoE layer, summed; overlap hides part of it)"
    );
    out
}

/// The readable form of a request-trace report.
pub fn request_table(r: &RequestReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} on {}: EP {}, {} slots/rank, {} requests, {} tokens/rank/step",
        r.model, r.rack, r.ep, r.slots, r.requests, r.chunk_tokens
    );
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:<14} {:>8} {:>10} {:>12} {:>12} {:>12} {:>14} {:>8}",
        "balancer",
        "rate",
        "req/s",
        "mean ttft ms",
        "p50 ttft ms",
        "p99 ttft ms",
        "input tok/s",
        "steps"
    );
    for p in &r.results {
        let rate = p
            .request_rate
            .map_or("trace".to_string(), |x| format!("{x}"));
        let _ = writeln!(
            out,
            "{:<14} {:>8} {:>10.3} {:>12.1} {:>12.1} {:>12.1} {:>14.0} {:>8}",
            p.balancer,
            rate,
            p.request_throughput,
            p.mean_ttft_ms,
            p.median_ttft_ms,
            p.p99_ttft_ms,
            p.input_throughput,
            p.steps
        );
    }
    out
}

/// `PREFIX-breakdown.EXT` (ms per MoE layer for each term, one line per balancer and the
/// ideal) and `PREFIX-steps.EXT` (step time over steps); returns the files written.
pub fn throughput_plots(
    r: &ThroughputReport,
    prefix: &str,
    ext: &str,
) -> Result<Vec<PathBuf>, PlotError> {
    let term_axis = TERM_NAMES
        .iter()
        .enumerate()
        .map(|(i, n)| format!("{} {n}", i + 1))
        .collect::<Vec<_>>()
        .join(", ");
    let terms_series = |label: &str, t: &Terms| Series {
        label: label.to_string(),
        points: t
            .values()
            .iter()
            .enumerate()
            .map(|(i, &v)| ((i + 1) as f64, v))
            .collect(),
    };
    let steps_series = |label: &str, s: &[f64]| Series {
        label: label.to_string(),
        points: s.iter().enumerate().map(|(i, &v)| (i as f64, v)).collect(),
    };
    let mut breakdown = vec![terms_series("ideal", &r.ideal.layer_ms)];
    let mut steps = vec![steps_series("ideal", &r.ideal.step_ms_series)];
    for b in &r.balancers {
        breakdown.push(terms_series(&b.balancer, &b.layer_ms));
        steps.push(steps_series(&b.balancer, &b.step_ms_series));
    }
    let title = format!("{} on {}, EP {}, {} slots", r.model, r.rack, r.ep, r.slots);
    let charts = [
        (
            "breakdown",
            Chart {
                title: format!("ms per MoE layer by term: {title}"),
                x_label: format!("term ({term_axis})"),
                y_label: "ms per MoE layer".into(),
                series: breakdown,
                log_x: false,
            },
        ),
        (
            "steps",
            Chart {
                title: format!("step time: {title}"),
                x_label: "step".into(),
                y_label: "step time (ms)".into(),
                series: steps,
                log_x: false,
            },
        ),
    ];
    write_all(prefix, ext, &charts)
}

/// `PREFIX-rps-ttft.EXT` (mean TTFT versus request rate) and `PREFIX-rps-p99-ttft.EXT`, one line
/// per balancer and the ideal; needs `--rates`.
pub fn request_plots(
    r: &RequestReport,
    prefix: &str,
    ext: &str,
) -> Result<Vec<PathBuf>, PlotError> {
    let mut labels: Vec<&str> = Vec::new();
    for p in &r.results {
        if !labels.contains(&p.balancer.as_str()) {
            labels.push(&p.balancer);
        }
    }
    let series = |f: fn(&RateReport) -> f64| -> Vec<Series> {
        labels
            .iter()
            .map(|&label| Series {
                label: label.to_string(),
                points: r
                    .results
                    .iter()
                    .filter(|p| p.balancer == label)
                    .filter_map(|p| p.request_rate.map(|rate| (rate, f(p))))
                    .collect(),
            })
            .collect()
    };
    let title = format!("{} on {}, EP {}, {} slots", r.model, r.rack, r.ep, r.slots);
    let charts = [
        (
            "rps-ttft",
            Chart {
                title: format!("mean TTFT: {title}"),
                x_label: "request rate (req/s)".into(),
                y_label: "mean TTFT (ms)".into(),
                series: series(|p| p.mean_ttft_ms),
                log_x: false,
            },
        ),
        (
            "rps-p99-ttft",
            Chart {
                title: format!("p99 TTFT: {title}"),
                x_label: "request rate (req/s)".into(),
                y_label: "p99 TTFT (ms)".into(),
                series: series(|p| p.p99_ttft_ms),
                log_x: false,
            },
        ),
    ];
    write_all(prefix, ext, &charts)
}

fn write_all(prefix: &str, ext: &str, charts: &[(&str, Chart)]) -> Result<Vec<PathBuf>, PlotError> {
    let mut written = Vec::new();
    for (name, chart) in charts {
        let path = PathBuf::from(format!("{prefix}-{name}.{ext}"));
        write_chart(Path::new(&path), chart)?;
        written.push(path);
    }
    Ok(written)
}
