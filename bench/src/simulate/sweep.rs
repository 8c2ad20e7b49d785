//! Sweeps (`rackfill simulate --sweep`): the cross product of model shapes, EP sizes, redundant
//! slots, schedules and routing traces, every balancer at every point, run as throughput
//! simulations on a pool of threads; one report (JSON and a readable table) and the plots a
//! reader wants (fraction of the ideal against EP size, tokens/s per GPU against slots).
//!
//! Every point (shape, EP, slots, schedule, trace) runs every balancer on the point's routing.
//! Points at one shape, EP size and trace route alike, so they form one job that draws the
//! routing once ([`run_throughput_shared`]). Jobs run biggest first on `jobs` threads; the
//! report lists the
//! points in a fixed order (shapes, schedules, traces and balancers as given, EP sizes and slot
//! counts ascending; duplicates dropped), whatever the thread timing. A point that cannot run
//! (an EP size larger than the rack, a trace whose experts do not match the shape) is a row with
//! its error; the sweep fails only when no point can run.

use super::error::SimError;
use super::report::{Imbalance, ThroughputReport};
use super::shape::ModelShape;
use super::spec::{SimSpec, MAX_STEPS};
use super::throughput::{run_throughput_shared, ThroughputRun};
use super::trace::TraceSource;
use crate::plot::{write_chart, Chart, PlotError, Series};
use rackfill_engine::Schedule;
use serde::Serialize;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Instant;

/// The EP size the tokens-per-slot plot is drawn at when the sweep has it (`simulate`'s default,
/// 64 of an NVL72's 72 GPUs); otherwise the largest EP size with results.
pub const PLOT_EP: usize = 64;

/// What a sweep runs: the cross product of the lists, everything else from `template`.
#[derive(Debug, Clone)]
pub struct SweepSpec {
    pub shapes: Vec<ModelShape>,
    pub eps: Vec<usize>,
    pub slots: Vec<usize>,
    pub schedules: Vec<Schedule>,
    pub traces: Vec<TraceSource>,
    /// What every point shares: rack, balancers, planner settings, relay trees, solve time, chunk
    /// tokens, seed, slot memory, reuse tolerance. Its shape, EP size, slots, schedule and
    /// simulated layers are each point's.
    pub template: SimSpec,
    /// MoE layers simulated per step on synthetic routing; `None`: every MoE layer of each shape.
    pub sample_layers: Option<usize>,
    /// Steps per point (a recorded trace may end sooner).
    pub steps: usize,
    /// Prior context of every synthetic chunk (attention cost only).
    pub context_tokens: u64,
    /// Points simulated at once (threads).
    pub jobs: usize,
}

/// One point of the cross product, as indices into the sweep's (deduplicated) lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Point {
    shape: usize,
    ep: usize,
    slots: usize,
    schedule: usize,
    trace: usize,
}

/// The sweep's lists without duplicates, EP sizes and slot counts ascending.
struct Lists {
    shapes: Vec<ModelShape>,
    eps: Vec<usize>,
    slots: Vec<usize>,
    schedules: Vec<Schedule>,
    traces: Vec<TraceSource>,
}

fn dedup<T: PartialEq + Clone>(values: &[T]) -> Vec<T> {
    let mut out: Vec<T> = Vec::with_capacity(values.len());
    for v in values {
        if !out.contains(v) {
            out.push(v.clone());
        }
    }
    out
}

fn sorted(values: &[usize]) -> Vec<usize> {
    let mut out = values.to_vec();
    out.sort_unstable();
    out.dedup();
    out
}

impl SweepSpec {
    /// Checks what every point shares before anything runs (the points' own combinations are
    /// checked per point, and a bad one becomes a row with its error).
    pub fn validate(&self) -> Result<(), SimError> {
        let bad = |s: String| Err(SimError::Input(s));
        for (empty, flag) in [
            (self.shapes.is_empty(), "--model-shape"),
            (self.eps.is_empty(), "--ep-size"),
            (self.slots.is_empty(), "--redundant-slots"),
            (self.schedules.is_empty(), "--schedule"),
            (self.traces.is_empty(), "--trace"),
            (self.template.algos.is_empty(), "--balancer"),
        ] {
            if empty {
                return bad(format!("{flag} needs at least one value"));
            }
        }
        if !(1..=MAX_STEPS).contains(&self.steps) {
            return bad(format!(
                "--steps must be in 1..={MAX_STEPS}, got {}",
                self.steps
            ));
        }
        if self.jobs == 0 {
            return bad("--jobs must be at least 1".into());
        }
        Ok(())
    }

    fn lists(&self) -> Lists {
        Lists {
            shapes: dedup(&self.shapes),
            eps: sorted(&self.eps),
            slots: sorted(&self.slots),
            schedules: dedup(&self.schedules),
            traces: dedup(&self.traces),
        }
    }

    /// The throughput simulation of one point.
    fn run_for(&self, lists: &Lists, p: Point) -> ThroughputRun {
        let shape = lists.shapes[p.shape].clone();
        let mut spec = self.template.clone();
        spec.sim_layers = self.sample_layers.unwrap_or(shape.moe_layers());
        spec.shape = shape;
        spec.ep = lists.eps[p.ep];
        spec.slots = lists.slots[p.slots];
        spec.schedule = lists.schedules[p.schedule];
        // Points run side by side on the sweep's own threads; a simulation that spread its own
        // work over threads too would only oversubscribe the cores.
        spec.threads = 1;
        ThroughputRun {
            spec,
            trace: lists.traces[p.trace].clone(),
            steps: self.steps,
            context_tokens: self.context_tokens,
        }
    }
}

impl Lists {
    /// Every point in report order: shape, EP, slots, schedule, trace.
    fn points(&self) -> Vec<Point> {
        let mut out = Vec::new();
        for shape in 0..self.shapes.len() {
            for ep in 0..self.eps.len() {
                for slots in 0..self.slots.len() {
                    for schedule in 0..self.schedules.len() {
                        for trace in 0..self.traces.len() {
                            out.push(Point {
                                shape,
                                ep,
                                slots,
                                schedule,
                                trace,
                            });
                        }
                    }
                }
            }
        }
        out
    }
}

/// A rough size of a point's work, to start the biggest points first (a pool finishes sooner
/// when the longest jobs do not start last).
fn work(run: &ThroughputRun) -> u128 {
    let s = &run.spec;
    let per_rank = s.chunk_tokens as u128 * s.shape.top_k as u128 + s.shape.experts as u128;
    s.ep as u128 * s.sim_layers as u128 * per_rank * s.schedule.micro_batches as u128
}

/// A sweep's results.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SweepReport {
    /// The lists swept, as run (duplicates dropped, EP sizes and slot counts ascending).
    pub models: Vec<String>,
    pub ep_sizes: Vec<usize>,
    pub redundant_slots: Vec<usize>,
    pub schedules: Vec<String>,
    pub traces: Vec<String>,
    pub balancers: Vec<String>,
    pub rack: String,
    /// Steps asked of every point (`points[].steps` says what ran).
    pub steps: usize,
    pub seed: u64,
    /// Tokens per rank and step on synthetic routing (a recorded trace's rows set its own).
    pub chunk_tokens: u64,
    /// `--sample-layers` (synthetic routing); `None`: every MoE layer of each shape.
    pub sample_layers: Option<usize>,
    pub context_tokens: u64,
    pub solve_us_override: Option<f64>,
    pub slot_memory: String,
    /// With per-layer slots, the tolerance quota plans reuse resident replicas within.
    pub reuse_tolerance: Option<f64>,
    /// Points simulated at once.
    pub jobs: usize,
    /// Wall-clock seconds the sweep took (the one figure that differs between identical runs).
    pub elapsed_s: f64,
    /// One per point, with the ideal's figures or the point's error.
    pub points: Vec<SweepPoint>,
    /// One per point and balancer, in the report order of the points, balancers as given.
    pub rows: Vec<SweepRow>,
}

/// One point of a sweep: the force-balanced ideal's figures, or why the point could not run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SweepPoint {
    pub model: String,
    pub ep: usize,
    pub slots: usize,
    pub schedule: String,
    pub trace: String,
    /// Steps that ran (a recorded trace may end sooner than `--steps`).
    pub steps: Option<usize>,
    /// Load matrices costed per step.
    pub simulated_layers: Option<usize>,
    /// The ideal's tokens/s over the EP ranks.
    pub ideal_tokens_per_s_per_gpu: Option<f64>,
    pub ideal_step_ms: Option<f64>,
    /// Redundant-slot memory per GPU, GB (1e9 bytes), under the point's schedule.
    pub slot_gb_per_gpu: f64,
    pub error: Option<String>,
}

/// One balancer at one point; every figure `None` when the point failed (`error` says why).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SweepRow {
    pub model: String,
    pub ep: usize,
    pub slots: usize,
    pub schedule: String,
    pub trace: String,
    pub balancer: String,
    /// Tokens/s of the whole EP group over its ranks.
    pub tokens_per_s_per_gpu: Option<f64>,
    /// The ideal's time over this balancer's for the same tokens, both under the point's schedule.
    pub fraction_of_ideal: Option<f64>,
    /// Tokens/s under the point's schedule over tokens/s under UltraEP's.
    pub speedup_over_ultraep: Option<f64>,
    /// Replica-weight MB the busiest rank sends or receives per MoE layer.
    pub replica_mb_busiest_mean: Option<f64>,
    /// Redundant-slot memory per GPU, GB, under the point's schedule.
    pub slot_gb_per_gpu: f64,
    /// Mean step makespan under the point's schedule.
    pub step_ms: Option<f64>,
    /// Mean rank-level imbalance (`max L / mean L`) before and after balancing.
    pub mean_imbalance: Option<Imbalance>,
    pub error: Option<String>,
}

impl SweepReport {
    /// Points that ran.
    pub fn succeeded(&self) -> usize {
        self.points.iter().filter(|p| p.error.is_none()).count()
    }
}

/// Runs every point of `spec`; `progress(done, total)` on the calling thread after every point
/// that ran. Fails only on a bad sweep (an empty list, bad steps or jobs) or when no point can
/// even start (every one refused by [`SimSpec::validate`]: then the first point's error);
/// a point that fails is reported with its error.
pub fn run_sweep(
    spec: &SweepSpec,
    mut progress: impl FnMut(usize, usize),
) -> Result<SweepReport, SimError> {
    let start = Instant::now();
    spec.validate()?;
    let lists = spec.lists();
    let points = lists.points();
    let runs: Vec<ThroughputRun> = points.iter().map(|&p| spec.run_for(&lists, p)).collect();
    let mut results: Vec<Option<Result<ThroughputReport, SimError>>> = runs
        .iter()
        .map(|run| run.spec.validate().err().map(Err))
        .collect();
    if let Some(Some(Err(first))) = results.first() {
        if results.iter().all(Option::is_some) {
            return Err(first.clone());
        }
    }
    // Points at one model, EP size and trace route alike (slots and schedules do not change
    // the routing): each group is one job that draws the routing once for all its points.
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (i, p) in points
        .iter()
        .enumerate()
        .filter(|&(i, _)| results[i].is_none())
    {
        let same = |g: &Vec<usize>| {
            let q = points[g[0]];
            (q.shape, q.ep, q.trace) == (p.shape, p.ep, p.trace)
        };
        match groups.iter_mut().find(|g| same(g)) {
            Some(group) => group.push(i),
            None => groups.push(vec![i]),
        }
    }
    groups.sort_by_key(|g| std::cmp::Reverse(g.iter().map(|&i| work(&runs[i])).sum::<u128>()));
    let total: usize = groups.iter().map(Vec::len).sum();
    let next = AtomicUsize::new(0);
    let (tx, rx) = mpsc::channel();
    std::thread::scope(|scope| {
        for _ in 0..spec.jobs.min(groups.len()) {
            let (tx, next, groups, runs) = (tx.clone(), &next, &groups, &runs);
            scope.spawn(move || {
                while let Some(group) = groups.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let members: Vec<&ThroughputRun> = group.iter().map(|&i| &runs[i]).collect();
                    let results = run_throughput_shared(&members, |_, _| {});
                    for (&i, result) in group.iter().zip(results) {
                        if tx.send((i, result)).is_err() {
                            return;
                        }
                    }
                }
            });
        }
        drop(tx);
        for (done, (i, result)) in rx.iter().enumerate() {
            results[i] = Some(result);
            progress(done + 1, total);
        }
    });
    let mut report = SweepReport {
        models: lists.shapes.iter().map(|s| s.name.clone()).collect(),
        ep_sizes: lists.eps.clone(),
        redundant_slots: lists.slots.clone(),
        schedules: lists.schedules.iter().map(Schedule::name).collect(),
        traces: lists.traces.iter().map(TraceSource::label).collect(),
        balancers: spec
            .template
            .algos
            .iter()
            .map(|a| a.name().to_string())
            .collect(),
        rack: spec.template.rack.name.clone(),
        steps: spec.steps,
        seed: spec.template.seed,
        chunk_tokens: spec.template.chunk_tokens,
        sample_layers: spec.sample_layers,
        context_tokens: spec.context_tokens,
        solve_us_override: spec.template.solve_us,
        slot_memory: spec.template.slot_memory.name().into(),
        reuse_tolerance: spec.template.resident_preference(),
        jobs: spec.jobs,
        elapsed_s: 0.0,
        points: Vec::with_capacity(runs.len()),
        rows: Vec::with_capacity(runs.len() * spec.template.algos.len()),
    };
    for (run, result) in runs.iter().zip(results) {
        let result = result.expect("every point ran or was refused");
        add_point(&mut report, run, result);
    }
    report.elapsed_s = start.elapsed().as_secs_f64();
    Ok(report)
}

/// Adds one point and its rows (one per balancer) to `report`.
fn add_point(
    report: &mut SweepReport,
    run: &ThroughputRun,
    result: Result<ThroughputReport, SimError>,
) {
    let spec = &run.spec;
    let slot_gb_per_gpu = spec.slot_gb_per_gpu();
    let ep = spec.ep as f64;
    let point = SweepPoint {
        model: spec.shape.name.clone(),
        ep: spec.ep,
        slots: spec.slots,
        schedule: spec.schedule.name(),
        trace: run.trace.label(),
        steps: None,
        simulated_layers: None,
        ideal_tokens_per_s_per_gpu: None,
        ideal_step_ms: None,
        slot_gb_per_gpu,
        error: None,
    };
    let row = |balancer: &str| SweepRow {
        model: point.model.clone(),
        ep: point.ep,
        slots: point.slots,
        schedule: point.schedule.clone(),
        trace: point.trace.clone(),
        balancer: balancer.to_string(),
        tokens_per_s_per_gpu: None,
        fraction_of_ideal: None,
        speedup_over_ultraep: None,
        replica_mb_busiest_mean: None,
        slot_gb_per_gpu,
        step_ms: None,
        mean_imbalance: None,
        error: None,
    };
    match result {
        Ok(r) => {
            for b in &r.balancers {
                report.rows.push(SweepRow {
                    tokens_per_s_per_gpu: Some(b.tokens_per_s / ep),
                    fraction_of_ideal: Some(b.fraction_of_ideal),
                    speedup_over_ultraep: Some(b.speedup_over_ultraep),
                    replica_mb_busiest_mean: Some(b.replica_mb_busiest_mean),
                    step_ms: Some(b.step_ms),
                    mean_imbalance: Some(b.mean_imbalance),
                    ..row(&b.balancer)
                });
            }
            report.points.push(SweepPoint {
                steps: Some(r.steps),
                simulated_layers: Some(r.simulated_layers),
                ideal_tokens_per_s_per_gpu: Some(r.ideal.tokens_per_s / ep),
                ideal_step_ms: Some(r.ideal.step_ms),
                ..point.clone()
            });
        }
        Err(e) => {
            let error = e.to_string();
            for algo in &spec.algos {
                report.rows.push(SweepRow {
                    error: Some(error.clone()),
                    ..row(algo.name())
                });
            }
            report.points.push(SweepPoint {
                error: Some(error),
                ..point.clone()
            });
        }
    }
}

/// The readable form of a sweep report: a header, then one line per point for the ideal and one
/// per balancer, in report order; a point that failed is one line with its error.
pub fn sweep_table(r: &SweepReport) -> String {
    let mut out = String::new();
    let count =
        |n: usize, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
    let _ = writeln!(
        out,
        "sweep on {}: {} x {} x {} x {} x {} = {} points, {} each; {} steps, seed {}, {}{}{}",
        r.rack,
        count(r.models.len(), "model", "models"),
        count(r.ep_sizes.len(), "EP size", "EP sizes"),
        count(r.redundant_slots.len(), "slot count", "slot counts"),
        count(r.schedules.len(), "schedule", "schedules"),
        count(r.traces.len(), "trace", "traces"),
        r.points.len(),
        count(r.balancers.len(), "balancer", "balancers"),
        r.steps,
        r.seed,
        format_args!("{} tokens/rank/step", r.chunk_tokens),
        match r.sample_layers {
            Some(n) => format!(", {n} sampled MoE layers"),
            None => String::new(),
        },
        match r.solve_us_override {
            Some(us) => format!(", solve fixed at {us} us/layer"),
            None => ", solve measured".into(),
        },
    );
    let failed = r.points.len() - r.succeeded();
    let _ = writeln!(
        out,
        "slot memory: {}; {:.1} s on {}{}",
        r.slot_memory,
        r.elapsed_s,
        count(r.jobs, "job", "jobs"),
        if failed > 0 {
            format!("; {} failed", count(failed, "point", "points"))
        } else {
            String::new()
        }
    );
    let _ = writeln!(out);
    let width = |values: &mut dyn Iterator<Item = usize>, header: &str| {
        values.fold(header.len(), usize::max)
    };
    let wm = width(&mut r.points.iter().map(|p| p.model.len()), "model");
    let ws = width(&mut r.points.iter().map(|p| p.schedule.len()), "schedule");
    let wt = width(&mut r.points.iter().map(|p| p.trace.len()), "trace");
    let wb = width(&mut r.balancers.iter().map(String::len), "balancer").max("ideal".len());
    let _ = writeln!(
        out,
        "{:<wm$} {:>4} {:>5} {:<ws$} {:<wt$} {:<wb$} {:>12} {:>8} {:>9} {:>9} {:>10} {:>9} {:>8} {:>7}",
        "model",
        "ep",
        "slots",
        "schedule",
        "trace",
        "balancer",
        "tok/s/GPU",
        "of ideal",
        "x ultraep",
        "step ms",
        "imb before",
        "imb after",
        "repl MB",
        "slot GB"
    );
    let mut rows = r.rows.iter().peekable();
    for p in &r.points {
        let key = format!(
            "{:<wm$} {:>4} {:>5} {:<ws$} {:<wt$}",
            p.model, p.ep, p.slots, p.schedule, p.trace
        );
        let mine = |row: &&SweepRow| {
            row.model == p.model
                && row.ep == p.ep
                && row.slots == p.slots
                && row.schedule == p.schedule
                && row.trace == p.trace
        };
        if let Some(error) = &p.error {
            let _ = writeln!(out, "{key} {:<wb$} error: {error}", "-");
            while rows.next_if(mine).is_some() {}
            continue;
        }
        let _ = writeln!(
            out,
            "{key} {:<wb$} {:>12.0} {:>8.3} {:>9} {:>9.2} {:>10} {:>9} {:>8} {:>7.2}",
            "ideal",
            p.ideal_tokens_per_s_per_gpu.unwrap_or(f64::NAN),
            1.0,
            "-",
            p.ideal_step_ms.unwrap_or(f64::NAN),
            "-",
            "-",
            "-",
            p.slot_gb_per_gpu
        );
        while let Some(row) = rows.next_if(mine) {
            let f = |v: Option<f64>| v.unwrap_or(f64::NAN);
            let imb = row.mean_imbalance;
            let _ = writeln!(
                out,
                "{key} {:<wb$} {:>12.0} {:>8.3} {:>9.3} {:>9.2} {:>10.3} {:>9.3} {:>8.1} {:>7.2}",
                row.balancer,
                f(row.tokens_per_s_per_gpu),
                f(row.fraction_of_ideal),
                f(row.speedup_over_ultraep),
                f(row.step_ms),
                f(imb.map(|i| i.before)),
                f(imb.map(|i| i.after)),
                f(row.replica_mb_busiest_mean),
                row.slot_gb_per_gpu
            );
        }
    }
    let _ = writeln!(
        out,
        "(tok/s/GPU: tokens/s of the EP group over its ranks; of ideal and x ultraep under the \
         point's schedule; repl MB: the busiest rank's replica MB per MoE layer)"
    );
    out
}

/// A name part for a plot file: letters, digits, `.`, `_` and `-` kept, anything else `_`.
fn file_part(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// A trace's name part: a recorded trace's file stem, a synthetic one's label.
fn trace_part(label: &str) -> String {
    if label.starts_with("synthetic-") {
        return file_part(label);
    }
    let stem = Path::new(label)
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or(label);
    file_part(stem)
}

/// The plots of a sweep, one file per model, schedule and trace (each named in the file only when
/// the sweep has more than one of it):
///
/// - `PREFIX-fraction-vs-ep[-MODEL][-SCHEDULE][-TRACE].EXT`: fraction of the ideal against EP
///   size, one line per balancer, at the sweep's largest slot count;
/// - `PREFIX-tokens-vs-slots[...].EXT`: tokens/s per GPU against redundant slots, one line per
///   balancer and the ideal, at EP [`PLOT_EP`] when swept (else the largest EP size with
///   results).
///
/// Failed points are left out; a chart with nothing to draw is not written. Returns the files
/// written.
pub fn sweep_plots(r: &SweepReport, prefix: &str, ext: &str) -> Result<Vec<PathBuf>, PlotError> {
    let mut written = Vec::new();
    let max_slots = r.redundant_slots.iter().copied().max().unwrap_or(0);
    for model in &r.models {
        for schedule in &r.schedules {
            for trace in &r.traces {
                let mut suffix = String::new();
                for (many, part) in [
                    (r.models.len() > 1, file_part(model)),
                    (r.schedules.len() > 1, file_part(schedule)),
                    (r.traces.len() > 1, trace_part(trace)),
                ] {
                    if many {
                        suffix += "-";
                        suffix += &part;
                    }
                }
                let rows: Vec<&SweepRow> = r
                    .rows
                    .iter()
                    .filter(|row| {
                        row.error.is_none()
                            && &row.model == model
                            && &row.schedule == schedule
                            && &row.trace == trace
                    })
                    .collect();
                let points: Vec<&SweepPoint> = r
                    .points
                    .iter()
                    .filter(|p| {
                        p.error.is_none()
                            && &p.model == model
                            && &p.schedule == schedule
                            && &p.trace == trace
                    })
                    .collect();
                let what = format!("{model}, {schedule} schedule, {trace}, on {}", r.rack);
                let by_balancer = |keep: &dyn Fn(&SweepRow) -> Option<(f64, f64)>| {
                    r.balancers
                        .iter()
                        .map(|b| Series {
                            label: b.clone(),
                            points: rows
                                .iter()
                                .filter(|row| &row.balancer == b)
                                .filter_map(|row| keep(row))
                                .collect(),
                        })
                        .collect::<Vec<_>>()
                };
                let fraction = Chart {
                    title: format!("fraction of ideal: {what}, {max_slots} slots"),
                    x_label: "EP size (GPUs)".into(),
                    y_label: "fraction of ideal tokens/s".into(),
                    series: by_balancer(&|row| {
                        (row.slots == max_slots)
                            .then_some(row.fraction_of_ideal)
                            .flatten()
                            .map(|f| (row.ep as f64, f))
                    }),
                    log_x: false,
                };
                let ep = if points.iter().any(|p| p.ep == PLOT_EP) {
                    Some(PLOT_EP)
                } else {
                    points.iter().map(|p| p.ep).max()
                };
                let mut series = by_balancer(&|row| {
                    (Some(row.ep) == ep)
                        .then_some(row.tokens_per_s_per_gpu)
                        .flatten()
                        .map(|t| (row.slots as f64, t))
                });
                series.push(Series {
                    label: "ideal".into(),
                    points: points
                        .iter()
                        .filter(|p| Some(p.ep) == ep)
                        .filter_map(|p| p.ideal_tokens_per_s_per_gpu.map(|t| (p.slots as f64, t)))
                        .collect(),
                });
                let tokens = Chart {
                    title: format!(
                        "tokens/s per GPU: {what}, EP {}",
                        ep.map_or("-".into(), |e| e.to_string())
                    ),
                    x_label: "redundant slots per GPU".into(),
                    y_label: "tokens/s per GPU".into(),
                    series,
                    log_x: false,
                };
                for (name, chart) in [("fraction-vs-ep", fraction), ("tokens-vs-slots", tokens)] {
                    let drawable = chart
                        .series
                        .iter()
                        .flat_map(|s| &s.points)
                        .any(|(x, y)| x.is_finite() && y.is_finite());
                    if !drawable {
                        continue;
                    }
                    let path = PathBuf::from(format!("{prefix}-{name}{suffix}.{ext}"));
                    write_chart(&path, &chart)?;
                    written.push(path);
                }
            }
        }
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> SweepReport {
        let point = |ep: usize, slots: usize, error: Option<&str>| SweepPoint {
            model: "m".into(),
            ep,
            slots,
            schedule: "overlapped".into(),
            trace: "synthetic-mixed".into(),
            steps: error.is_none().then_some(3),
            simulated_layers: error.is_none().then_some(2),
            ideal_tokens_per_s_per_gpu: error.is_none().then_some(1000.0),
            ideal_step_ms: error.is_none().then_some(2.0),
            slot_gb_per_gpu: slots as f64 * 0.1,
            error: error.map(String::from),
        };
        let row = |ep: usize, slots: usize, balancer: &str, f: f64| SweepRow {
            model: "m".into(),
            ep,
            slots,
            schedule: "overlapped".into(),
            trace: "synthetic-mixed".into(),
            balancer: balancer.into(),
            tokens_per_s_per_gpu: Some(1000.0 * f),
            fraction_of_ideal: Some(f),
            speedup_over_ultraep: Some(1.2),
            replica_mb_busiest_mean: Some(10.0),
            slot_gb_per_gpu: slots as f64 * 0.1,
            step_ms: Some(2.0 / f),
            mean_imbalance: Some(Imbalance {
                before: 2.0,
                after: 1.0 / f,
            }),
            error: None,
        };
        let mut failed = row(80, 2, "quota", 0.0);
        failed.tokens_per_s_per_gpu = None;
        failed.fraction_of_ideal = None;
        failed.error = Some("--ep-size 80 exceeds the 72 GPUs of rack 'nvl72'".into());
        SweepReport {
            models: vec!["m".into()],
            ep_sizes: vec![32, 64, 80],
            redundant_slots: vec![0, 2],
            schedules: vec!["overlapped".into()],
            traces: vec!["synthetic-mixed".into()],
            balancers: vec!["quota".into()],
            rack: "nvl72".into(),
            steps: 3,
            seed: 0,
            chunk_tokens: 256,
            sample_layers: Some(2),
            context_tokens: 0,
            solve_us_override: Some(111.0),
            slot_memory: "shared".into(),
            reuse_tolerance: None,
            jobs: 2,
            elapsed_s: 1.5,
            points: vec![
                point(32, 0, None),
                point(32, 2, None),
                point(64, 0, None),
                point(64, 2, None),
                point(
                    80,
                    2,
                    Some("--ep-size 80 exceeds the 72 GPUs of rack 'nvl72'"),
                ),
            ],
            rows: vec![
                row(32, 0, "quota", 0.5),
                row(32, 2, "quota", 0.9),
                row(64, 0, "quota", 0.45),
                row(64, 2, "quota", 0.95),
                failed,
            ],
        }
    }

    #[test]
    fn the_table_has_a_line_per_row_and_ideal_and_names_failures() {
        let r = report();
        let table = sweep_table(&r);
        assert!(table.contains("= 5 points, 1 balancer each"), "{table}");
        assert!(table.contains("1 point failed"), "{table}");
        assert!(
            table.contains("error: --ep-size 80 exceeds the 72 GPUs"),
            "{table}"
        );
        // 4 points x (ideal + quota), the failed point, header and footnote lines.
        let body: Vec<&str> = table.lines().skip(3).collect();
        assert_eq!(body.len(), 1 + 4 * 2 + 1 + 1, "{table}");
        // Aligned: every line of the body starts its figures at the same column.
        let at = body[0].find("tok/s/GPU").unwrap() + "tok/s/GPU".len();
        for line in &body[1..9] {
            assert_eq!(line.as_bytes()[at - 1], b"0"[0], "{line}");
        }
    }

    #[test]
    fn plots_name_their_files_and_skip_failed_points() {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("s");
        let written = sweep_plots(&report(), prefix.to_str().unwrap(), "svg").unwrap();
        let names: Vec<String> = written
            .iter()
            .map(|p| p.file_name().unwrap().to_str().unwrap().to_string())
            .collect();
        assert_eq!(names, ["s-fraction-vs-ep.svg", "s-tokens-vs-slots.svg"]);
        let svg = std::fs::read_to_string(&written[1]).unwrap();
        assert!(svg.contains("EP 64") && svg.contains("ideal"), "{svg}");
        assert_eq!(trace_part("/data/run 1.jsonl"), "run_1");
        assert_eq!(trace_part("synthetic-mixed"), "synthetic-mixed");
    }
}
