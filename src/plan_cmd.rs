//! `rackfill plan`: solve one layer's replication plan from a load matrix in a JSON file.
//!
//! Input: `{"load": [[count; E]; R], "home": [rank; E]?}`. Every malformed input is rejected with a
//! one-line reason (exit status 2) before any planner runs.

use anyhow::{bail, Context, Result};
use rackfill_balancer::metrics::evaluate;
use rackfill_balancer::{Algo, Layout, LoadMatrix, Plan, Settings};
use serde::Serialize;
use serde_json::Value;
use std::path::PathBuf;
use std::time::Instant;

/// Arguments of `rackfill plan`.
#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// JSON file with {"load": [[count; E]; R], "home": [rank; E]?}; `-` reads standard input.
    #[arg(long)]
    load: PathBuf,
    /// Number of ranks; must match the number of load rows when given.
    #[arg(long)]
    ranks: Option<usize>,
    /// Redundant slots per rank.
    #[arg(long, default_value_t = 2)]
    slots: usize,
    /// Planner: quota, eplb-exact, greedy-move or none (quota-paper: the published target rule).
    #[arg(long, default_value = "quota")]
    algo: String,
    /// Smallest quota of a new replica (quota planner).
    #[arg(long, default_value_t = rackfill_balancer::quota::DEFAULT_U_MIN)]
    u_min: u64,
    /// Print the plan as JSON instead of a summary.
    #[arg(long)]
    json: bool,
}

/// The JSON document `rackfill plan --json` prints; other tools parse it, keep it stable.
#[derive(Debug, Serialize)]
struct PlanReport {
    algo: String,
    ranks: usize,
    experts: usize,
    slots_per_rank: usize,
    slots: Vec<Vec<Option<u32>>>,
    quotas: Vec<Vec<(u32, u64)>>,
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
    let algo: Algo = args.algo.parse().map_err(anyhow::Error::msg)?;
    if algo == Algo::EplbHistory {
        bail!("eplb-history plans from a history of loads; replay a sequence with `rackfill bench balance`");
    }
    let text = if args.load.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin()).context("cannot read standard input")?
    } else {
        std::fs::read_to_string(&args.load)
            .with_context(|| format!("cannot read {}", args.load.display()))?
    };
    let (load, home) = parse_load(&text)?;
    if let Some(ranks) = args.ranks {
        if ranks != load.ranks() {
            bail!("--ranks is {ranks} but the load has {} rows", load.ranks());
        }
    }
    let layout = match home {
        Some(home) => Layout::with_home(load.ranks(), home, args.slots)?,
        None => Layout::contiguous(load.ranks(), load.experts(), args.slots)?,
    };
    let settings = Settings {
        u_min: args.u_min,
        ..Settings::default()
    };
    let (plan, solve_us) = solve_timed(algo, &settings, &layout, &load)?;
    let report = build_report(algo, &layout, &load, &plan, solve_us);
    if args.json {
        outln!("{}", serde_json::to_string(&report)?);
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

fn build_report(
    algo: Algo,
    layout: &Layout,
    load: &LoadMatrix,
    plan: &Plan,
    solve_us: f64,
) -> PlanReport {
    let m = evaluate(layout, load, plan);
    PlanReport {
        algo: algo.name().to_string(),
        ranks: layout.ranks(),
        experts: layout.experts(),
        slots_per_rank: layout.slots_per_rank(),
        slots: (0..layout.ranks())
            .map(|r| plan.rank_slots(r).to_vec())
            .collect(),
        quotas: (0..layout.experts())
            .map(|e| {
                plan.instances(e)
                    .iter()
                    .map(|i| (i.rank, i.quota))
                    .collect()
            })
            .collect(),
        rank_load_before: m.rank_load_before,
        rank_load_after: m.rank_load_after,
        imbalance_before: m.imbalance_before,
        imbalance_after: m.imbalance_after,
        lower_bound: m.lower_bound,
        replicas: m.replicas,
        max_fanout: m.max_fanout,
        // Whole nanoseconds, as the bench reports print them (no float noise).
        solve_us: rackfill_bench::balance::round_us(solve_us),
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

/// The input document. Fields stay JSON values so that errors can name the offending row and
/// column; the struct itself refuses unknown and duplicate fields (a repeated `"load"` must not
/// silently replace the first).
#[derive(serde::Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a JSON object with a \"load\" field and an optional \"home\""
)]
struct LoadDocument {
    load: Option<Value>,
    home: Option<Value>,
}

/// Parses and checks the input document, naming the offending row, column or field.
fn parse_load(text: &str) -> Result<(LoadMatrix, Option<Vec<u32>>)> {
    // serde would also read the struct from an array of its fields; only an object is valid.
    if !text.trim_start().starts_with('{') {
        bail!("load file must be a JSON object with a \"load\" field");
    }
    let doc: LoadDocument = serde_json::from_str(text)
        .map_err(|e| anyhow::anyhow!("load file is not a valid load document: {e}"))?;
    let rows = match &doc.load {
        Some(Value::Array(rows)) => rows,
        Some(Value::Null) | None => bail!("missing field \"load\""),
        Some(_) => bail!("\"load\" must be an array of rows"),
    };
    if rows.is_empty() {
        bail!("\"load\" has no rows: at least one rank is needed");
    }
    let mut matrix = Vec::with_capacity(rows.len());
    for (r, row) in rows.iter().enumerate() {
        let Value::Array(cells) = row else {
            bail!("load row {r} is not an array");
        };
        let counts = cells
            .iter()
            .enumerate()
            .map(|(e, c)| {
                c.as_u64().ok_or_else(|| {
                    anyhow::anyhow!("load[{r}][{e}] = {c} is not a whole number from 0 to 2^64-1")
                })
            })
            .collect::<Result<Vec<u64>>>()?;
        matrix.push(counts);
    }
    let load = LoadMatrix::from_rows(&matrix)?;
    if load.experts() == 0 {
        bail!("load rows are empty: at least one expert is needed");
    }
    let home = match &doc.home {
        None | Some(Value::Null) => None,
        Some(Value::Array(h)) => {
            if h.len() != load.experts() {
                bail!(
                    "\"home\" has {} entries, the load has {} experts",
                    h.len(),
                    load.experts()
                );
            }
            let ranks = load.ranks() as u64;
            let home = h
                .iter()
                .enumerate()
                .map(|(e, v)| match v.as_u64() {
                    Some(rank) if rank < ranks => Ok(rank as u32),
                    _ => Err(anyhow::anyhow!(
                        "home[{e}] = {v} is not a rank in 0..{ranks}"
                    )),
                })
                .collect::<Result<Vec<u32>>>()?;
            Some(home)
        }
        Some(_) => bail!("\"home\" must be an array of ranks"),
    };
    Ok((load, home))
}
