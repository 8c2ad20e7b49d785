//! `rackfill plan`: solve one layer's replication plan from a load matrix in a JSON file.
//!
//! Input: `{"load": [[count; E]; R], "home": [rank; E]?}`. Every malformed input is rejected with a
//! one-line reason (exit status 2) before any planner runs ([`load_file`]).

mod load_file;

use crate::flags::{BALANCER_ALIASES, EP_SIZE_ALIASES, REDUNDANT_SLOTS_ALIASES};
use anyhow::{bail, Context, Result};
use load_file::LoadInput;
use rackfill_balancer::metrics::evaluate;
use rackfill_balancer::{Algo, Instance, Layout, LoadMatrix, Plan, Settings};
use rackfill_engine::EpConfig;
use serde::Serialize;
use std::io::Write as _;
use std::path::PathBuf;
use std::time::Instant;

/// Arguments of `rackfill plan`.
#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// JSON file with {"load": [[count; E]; R], "home": [rank; E]?}; `-` reads standard input.
    #[arg(long)]
    load: PathBuf,
    /// Expert-parallel ranks; must match the number of load rows when given.
    #[arg(long, aliases = EP_SIZE_ALIASES)]
    ep_size: Option<usize>,
    /// Redundant slots per rank.
    #[arg(long, default_value_t = EpConfig::default().redundant_slots,
          aliases = REDUNDANT_SLOTS_ALIASES)]
    redundant_slots: usize,
    /// Balancer: quota, eplb-exact, greedy-move or none (quota-paper: the published target
    /// rule; eplb-history needs a sequence of loads, see `rackfill bench balance`).
    #[arg(long, default_value_t = EpConfig::default().balancer, aliases = BALANCER_ALIASES)]
    balancer: Algo,
    /// Smallest quota of a new replica (quota planner).
    #[arg(long, default_value_t = Settings::default().u_min)]
    u_min: u64,
    /// Print the plan as JSON instead of a summary.
    #[arg(long)]
    json: bool,
}

/// The JSON document `rackfill plan --json` prints; other tools parse it, keep it stable.
#[derive(Serialize)]
struct PlanReport<'a> {
    algo: String,
    ranks: usize,
    experts: usize,
    slots_per_rank: usize,
    slots: Vec<Vec<Option<u32>>>,
    quotas: Quotas<'a>,
    rank_load_before: Vec<u64>,
    rank_load_after: Vec<u64>,
    imbalance_before: f64,
    imbalance_after: f64,
    lower_bound: u64,
    replicas: usize,
    max_fanout: usize,
    solve_us: f64,
}

/// Runs `rackfill plan`. Errors are input errors: the caller exits 2 with the message.
pub fn run(args: PlanArgs) -> Result<()> {
    let algo = args.balancer;
    if algo == Algo::EplbHistory {
        bail!("eplb-history plans from a history of loads; replay a sequence with `rackfill bench balance`");
    }
    let LoadInput { load, home } = load_file::read(&args.load)?;
    if let Some(ranks) = args.ep_size {
        if ranks != load.ranks() {
            bail!(
                "--ep-size is {ranks} but the load has {} rows",
                load.ranks()
            );
        }
    }
    let layout = match home {
        Some(home) => Layout::with_home(load.ranks(), home, args.redundant_slots)?,
        None => Layout::contiguous(load.ranks(), load.experts(), args.redundant_slots)?,
    };
    let settings = Settings {
        u_min: args.u_min,
        ..Settings::default()
    };
    let (plan, solve_us) = solve_timed(algo, &settings, &layout, &load)?;
    let report = build_report(algo, &layout, &load, &plan, solve_us);
    if args.json {
        // Streamed: the document is several times the input's size.
        let mut out = std::io::BufWriter::new(std::io::stdout().lock());
        serde_json::to_writer(&mut out, &report)?;
        out.write_all(b"\n")?;
        out.flush()?;
    } else {
        print_summary(&report);
    }
    Ok(())
}

/// Solves with a fresh planner several times and reports the median solve time: the first call
/// also pays for allocating scratch buffers, which a serving engine pays once, not per layer.
fn solve_timed(
    algo: Algo,
    settings: &Settings,
    layout: &Layout,
    load: &LoadMatrix,
) -> Result<(Plan, f64)> {
    const RUNS: usize = 5;
    let mut planner = algo.build(settings);
    let mut times = Vec::with_capacity(RUNS);
    let mut plan = None;
    for _ in 0..RUNS {
        let start = Instant::now();
        let p = planner.plan(layout, load)?;
        times.push(start.elapsed().as_secs_f64() * 1e6);
        plan = Some(p);
    }
    times.sort_by(f64::total_cmp);
    let plan = plan.expect("at least one run");
    plan.validate(layout, load, planner.u_min())
        .context("internal error: the planner produced an invalid plan")?;
    Ok((plan, times[RUNS / 2]))
}

/// `quotas[e]`: every instance of expert `e` as `[rank, tokens]`, the main one first; written
/// straight from the plan (one list per expert would take tens of bytes per expert).
struct Quotas<'a>(&'a Plan, usize);

impl Serialize for Quotas<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq((0..self.1).map(|e| Instances(self.0.instances(e))))
    }
}

/// One expert's instances as `[[rank, tokens], ...]`.
struct Instances<'a>(&'a [Instance]);

impl Serialize for Instances<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.0.iter().map(|i| (i.rank, i.quota)))
    }
}

fn build_report<'a>(
    algo: Algo,
    layout: &Layout,
    load: &LoadMatrix,
    plan: &'a Plan,
    solve_us: f64,
) -> PlanReport<'a> {
    let m = evaluate(layout, load, plan);
    PlanReport {
        algo: algo.name().to_string(),
        ranks: layout.ranks(),
        experts: layout.experts(),
        slots_per_rank: layout.slots_per_rank(),
        slots: (0..layout.ranks())
            .map(|r| plan.rank_slots(r).to_vec())
            .collect(),
        quotas: Quotas(plan, layout.experts()),
        rank_load_before: m.rank_load_before,
        rank_load_after: m.rank_load_after,
        imbalance_before: m.imbalance_before,
        imbalance_after: m.imbalance_after,
        lower_bound: m.lower_bound,
        replicas: m.replicas,
        max_fanout: m.max_fanout,
        // Whole nanoseconds, as the bench reports print them (no float noise).
        solve_us: rackfill_bench::stats::round_us(solve_us),
    }
}

fn print_summary(r: &PlanReport) {
    let max_after = r.rank_load_after.iter().max().copied().unwrap_or(0);
    outln!(
        "{}: {} ranks, {} experts, {} slots per rank",
        r.algo,
        r.ranks,
        r.experts,
        r.slots_per_rank
    );
    outln!(
        "imbalance {:.4} -> {:.4}  (max rank load {} -> {}, lower bound {})",
        r.imbalance_before,
        r.imbalance_after,
        r.rank_load_before.iter().max().copied().unwrap_or(0),
        max_after,
        r.lower_bound
    );
    outln!(
        "replicas {}, max fan-out {}, solve {:.1} us",
        r.replicas,
        r.max_fanout,
        r.solve_us
    );
}
