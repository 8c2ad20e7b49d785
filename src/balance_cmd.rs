//! `rackfill bench balance`: routing loads through every balancer.
//!
//! `--synthetic` replays the synthetic grid of [`rackfill_bench::synthetic::default_grid`]
//! (restricted to `--shapes` and `--tokens`) and prints one markdown table per group.
//! `--trace FILE.jsonl` (a `--record-routing` trace) and `--synthetic-trace PATTERN` (a generated
//! multi-layer trace, optionally saved with `--write-trace`) replay a trace step by step, one
//! planner per balancer and layer, and print one table; `--json` adds the per-step series and
//! `--plot` draws imbalance over steps (docs/bench-balance.md). Progress goes to stderr. Any plan
//! that fails validation makes the command exit non-zero after the report is printed and written.

use crate::flags::{
    dedup, parse_positive, BALANCER_ALIASES, EP_SIZE_ALIASES, REDUNDANT_SLOTS_ALIASES,
};
use crate::report_file::{create_report_file, write_json};
use anyhow::{bail, Context as _};
use rackfill_balancer::{Algo, Layout, Settings};
use rackfill_bench::balance::{run_balance, BalanceRun};
use rackfill_bench::plot::write_chart;
use rackfill_bench::replay::{read_home_map, replay, ReplayConfig, ReplayEvent, ReplayReport};
use rackfill_bench::synthetic::multilayer::{TraceGenerator, TracePattern, TraceSpec};
use rackfill_bench::synthetic::{
    default_grid, Popularity, Shape, DEFAULT_SHAPES, DEFAULT_TOKENS, MAX_TOKENS_PER_RANK,
};
use rackfill_engine::routing_trace::{TraceReader, TraceWriter};
use rackfill_engine::EpConfig;
use std::io::Write as _;
use std::path::{Path, PathBuf};

/// The shape `--synthetic-trace` generates unless `--shapes`, `--ep-size` or
/// `--redundant-slots` say otherwise: DeepSeek-V3's 256 experts over 64 ranks.
const SYNTHETIC_TRACE_SHAPE: Shape = Shape::new(64, 256, 2);

/// `rackfill bench balance`.
#[derive(Debug, Clone, clap::Args)]
pub struct BalanceArgs {
    /// Replay a routing trace recorded by `rackfill serve --record-routing FILE` (JSON Lines, one
    /// line per step and MoE layer), step by step, one planner per balancer and layer.
    #[arg(long, value_name = "FILE.jsonl", conflicts_with_all = ["synthetic", "synthetic_trace"])]
    pub trace: Option<PathBuf>,

    /// Replay the synthetic grid of single-layer suites (Zipf/lognormal popularity; stationary,
    /// drifting and switching hot sets) and report per group.
    #[arg(long)]
    pub synthetic: bool,

    /// Replay a synthetic multi-layer trace: stationary, drifting, switching (domain switches at
    /// random steps) or mixed (drift and switches); every layer has its own popularity and
    /// neighbouring layers are correlated. Shape from --shapes (one), tokens from --tokens (one).
    #[arg(long, value_name = "PATTERN", conflicts_with = "synthetic")]
    pub synthetic_trace: Option<TracePattern>,

    /// Steps: per suite for --synthetic [default: 20], of the trace for --synthetic-trace
    /// [default: 200]
    #[arg(long, value_parser = parse_steps)]
    pub steps: Option<usize>,

    /// MoE layers per step of --synthetic-trace (layers x ranks x experts at most 67108864)
    /// [default: 8]
    #[arg(long, value_parser = parse_positive)]
    pub layers: Option<usize>,

    /// Popularity family of --synthetic-trace: zipf-S or lognormal-SIGMA [default: zipf-1.0]
    #[arg(long)]
    pub family: Option<Popularity>,

    /// Master seed; the same seed gives the same loads.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// EP shapes RANKS/EXPERTS/SLOTS, comma-separated: 1-1024 ranks, 8-4096 experts, at most one
    /// slot per expert
    /// [default: 8/64/2,32/256/4,40/160/4,64/128/2,64/256/2,72/256/2; --synthetic-trace: 64/256/2]
    #[arg(long, value_delimiter = ',', value_parser = parse_shape)]
    pub shapes: Vec<Shape>,

    /// Tokens per rank per step, comma-separated, each at most 1048576
    /// [default: 256,1024,4096,8192; --synthetic-trace: 1024]
    #[arg(long, value_delimiter = ',', value_parser = parse_tokens)]
    pub tokens: Vec<u64>,

    /// Expert-parallel ranks: with --trace, checked against the trace's ranks; with
    /// --synthetic-trace, the ranks of the generated trace [default: the trace's; the shape's]
    #[arg(long, value_parser = parse_positive, aliases = EP_SIZE_ALIASES)]
    pub ep_size: Option<usize>,

    // Help set below: its default is the engine's, shown from `EpConfig::default()`.
    #[arg(long, aliases = REDUNDANT_SLOTS_ALIASES, help = redundant_slots_help())]
    pub redundant_slots: Option<usize>,

    /// Home rank of every expert, a JSON file `[rank; E]` or `{"home": [rank; E]}`
    /// [default: contiguous runs]
    #[arg(long, value_name = "FILE.json")]
    pub home: Option<PathBuf>,

    /// Balancers to replay, comma-separated: none, quota, quota-paper, eplb-exact, eplb-history,
    /// greedy-move [default: all]
    #[arg(long, value_delimiter = ',', aliases = BALANCER_ALIASES)]
    pub balancer: Vec<Algo>,

    /// Bytes of one expert's weights, to report replica bytes moved (DeepSeek-V3 in FP8:
    /// 44040192) [default: unknown, replica counts only]
    #[arg(long, value_parser = parse_expert_bytes)]
    pub expert_bytes: Option<u64>,

    /// Also save the --synthetic-trace trace in the recorded format (replayable with --trace).
    #[arg(long, value_name = "FILE.jsonl")]
    pub write_trace: Option<PathBuf>,

    /// Plot imbalance over steps (mean over layers, one line per balancer) to FILE.svg or
    /// FILE.png (--trace and --synthetic-trace).
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,

    /// Smallest quota a new replica must carry (quota planner) [default: the planner's default]
    #[arg(long)]
    pub u_min: Option<u64>,

    /// Steps of past load eplb-history plans from [default: the planner's default]
    #[arg(long, value_parser = parse_positive)]
    pub history_window: Option<usize>,

    /// eplb-history re-plans every this many steps [default: the planner's default]
    #[arg(long, value_parser = parse_positive)]
    pub rebalance_interval: Option<usize>,

    /// Also write the full report as JSON to FILE (with --trace/--synthetic-trace: including the
    /// per-step series).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

fn redundant_slots_help() -> String {
    format!(
        "Redundant slots per rank [default: {} for --trace, the shape's for --synthetic-trace]",
        EpConfig::default().redundant_slots
    )
}

fn parse_expert_bytes(s: &str) -> Result<u64, String> {
    match s.trim().parse::<u64>() {
        Ok(b) if b >= 1 => Ok(b),
        _ => Err(format!(
            "invalid expert size '{s}': expected a positive number of bytes"
        )),
    }
}

fn parse_shape(s: &str) -> Result<Shape, String> {
    s.parse()
}

fn parse_tokens(s: &str) -> Result<u64, String> {
    match s.trim().parse::<u64>() {
        Ok(t) if (1..=MAX_TOKENS_PER_RANK).contains(&t) => Ok(t),
        _ => Err(format!(
            "invalid token count '{s}': expected an integer in 1..={MAX_TOKENS_PER_RANK}"
        )),
    }
}

fn parse_steps(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if (1..=1_000_000).contains(&n) => Ok(n),
        _ => Err(format!(
            "invalid step count '{s}': expected an integer in 1..=1000000"
        )),
    }
}

/// Runs `rackfill bench balance`.
pub fn run(args: BalanceArgs) -> anyhow::Result<()> {
    if args.trace.is_some() || args.synthetic_trace.is_some() {
        return balance_trace(args);
    }
    if !args.synthetic {
        bail!(
            "choose the loads: --trace FILE.jsonl (from `rackfill serve --record-routing`), \
             --synthetic-trace PATTERN or --synthetic"
        );
    }
    balance_grid(args)
}

/// `rackfill bench balance --synthetic`: the synthetic grid, one table per group.
fn balance_grid(args: BalanceArgs) -> anyhow::Result<()> {
    for (given, flag) in [
        (args.write_trace.is_some(), "--write-trace"),
        (args.layers.is_some(), "--layers"),
        (args.family.is_some(), "--family"),
        (args.ep_size.is_some(), "--ep-size"),
        (args.redundant_slots.is_some(), "--redundant-slots"),
        (args.home.is_some(), "--home"),
        (args.expert_bytes.is_some(), "--expert-bytes"),
        (args.plot.is_some(), "--plot"),
    ] {
        if given {
            bail!(
                "{flag} applies to --trace and --synthetic-trace, not to the --synthetic grid \
                 (its shapes come from --shapes)"
            );
        }
    }
    let shapes = if args.shapes.is_empty() {
        DEFAULT_SHAPES.to_vec()
    } else {
        dedup(&args.shapes)
    };
    let tokens = if args.tokens.is_empty() {
        DEFAULT_TOKENS.to_vec()
    } else {
        dedup(&args.tokens)
    };
    let steps = args.steps.unwrap_or(20);
    let settings = balance_settings(&args);
    let json_file = create_report_file(args.json.as_deref())?;

    let suites = default_grid(&shapes, &tokens, steps);
    let mut run = BalanceRun::new(suites, args.seed, settings);
    if !args.balancer.is_empty() {
        run.algos = dedup(&args.balancer);
    }
    note!(
        "bench balance: {} suites x {} steps x {} balancers (seed {})",
        run.suites.len(),
        steps,
        run.algos.len(),
        args.seed
    );
    let report = run_balance(&run, |p| {
        let last_of_shape = run
            .suites
            .get(p.done)
            .is_none_or(|next| next.shape() != p.suite.shape());
        if last_of_shape {
            note!(
                "  [{}/{}] shape {} done, {:.1} s",
                p.done,
                p.total,
                p.suite.shape(),
                p.elapsed.as_secs_f64()
            );
        }
    })?;

    let mut stdout = std::io::stdout().lock();
    stdout.write_all(report.to_table().as_bytes())?;
    stdout.flush()?;
    if let (Some(file), Some(path)) = (json_file, &args.json) {
        write_json(file, path, &report)?;
    }
    if report.validation_failures > 0 {
        bail!(
            "{} plans failed validation (see the report)",
            report.validation_failures
        );
    }
    Ok(())
}

/// Planner settings from the command line over the planners' defaults.
fn balance_settings(args: &BalanceArgs) -> Settings {
    let mut settings = Settings::default();
    if let Some(u) = args.u_min {
        settings.u_min = u;
    }
    if let Some(w) = args.history_window {
        settings.history_window = w;
    }
    if let Some(i) = args.rebalance_interval {
        settings.rebalance_interval = i;
    }
    settings
}

/// `rackfill bench balance --trace FILE` or `--synthetic-trace PATTERN`: a multi-layer trace
/// through every balancer, one table, optional JSON report, plot and trace copy.
fn balance_trace(args: BalanceArgs) -> anyhow::Result<()> {
    if let Some(plot) = &args.plot {
        check_plot_name(plot)?;
    }
    let json_file = create_report_file(args.json.as_deref())?;
    let report = match (&args.trace, args.synthetic_trace) {
        (Some(path), _) => replay_recorded(&args, path)?,
        (None, Some(pattern)) => replay_synthetic(&args, pattern)?,
        (None, None) => bail!("a load source is required"),
    };

    let mut stdout = std::io::stdout().lock();
    stdout.write_all(report.to_table().as_bytes())?;
    stdout.flush()?;
    if let (Some(file), Some(path)) = (json_file, &args.json) {
        write_json(file, path, &report)?;
    }
    if let Some(path) = &args.plot {
        write_chart(path, &report.imbalance_chart())?;
        note!("plot written to {}", path.display());
    }
    if report.validation_failures > 0 {
        bail!(
            "{} plans failed validation (see the report)",
            report.validation_failures
        );
    }
    Ok(())
}

/// Refuses a `--plot` file the chart writer cannot write (found out before the replay).
fn check_plot_name(plot: &Path) -> anyhow::Result<()> {
    let ext = plot
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    if !matches!(ext.as_deref(), Some("svg" | "png")) {
        bail!(
            "--plot {}: the file name must end in .svg or .png",
            plot.display()
        );
    }
    Ok(())
}

/// The replay's layout (contiguous, or from `--home`), settings and balancers.
fn replay_config(
    args: &BalanceArgs,
    ranks: usize,
    experts: usize,
    slots: usize,
) -> anyhow::Result<ReplayConfig> {
    let layout = match &args.home {
        Some(path) => Layout::with_home(ranks, read_home_map(path, ranks, experts)?, slots)?,
        None => Layout::contiguous(ranks, experts, slots)?,
    };
    let algos = if args.balancer.is_empty() {
        Algo::ALL.to_vec()
    } else {
        dedup(&args.balancer)
    };
    Ok(ReplayConfig {
        layout,
        settings: balance_settings(args),
        algos,
        expert_bytes: args.expert_bytes,
    })
}

/// Progress on stderr every 2 s and after the last of `total` steps (when known).
fn replay_progress(total: Option<usize>) -> impl FnMut(ReplayEvent<'_>) {
    let mut last_print = std::time::Instant::now();
    move |event: ReplayEvent<'_>| {
        if let ReplayEvent::Step {
            steps_done,
            elapsed,
        } = event
        {
            if last_print.elapsed().as_secs_f64() >= 2.0 || Some(steps_done) == total {
                last_print = std::time::Instant::now();
                let of = total.map_or(String::new(), |t| format!("/{t}"));
                note!("  step {steps_done}{of}, {:.1} s", elapsed.as_secs_f64());
            }
        }
    }
}

/// `--trace FILE`: a recorded trace, streamed from the file.
fn replay_recorded(args: &BalanceArgs, path: &Path) -> anyhow::Result<ReplayReport> {
    for (given, flag) in [
        (!args.shapes.is_empty(), "--shapes"),
        (!args.tokens.is_empty(), "--tokens"),
        (args.steps.is_some(), "--steps"),
        (args.layers.is_some(), "--layers"),
        (args.family.is_some(), "--family"),
        (args.write_trace.is_some(), "--write-trace"),
    ] {
        if given {
            bail!("{flag} applies to --synthetic-trace, not to --trace");
        }
    }
    let source = path.display().to_string();
    let reader = TraceReader::open(path).map_err(|e| match e.line() {
        Some(_) => anyhow::anyhow!("{source}: {e}"),
        None => anyhow::anyhow!(e),
    })?;
    if let Some(ep_size) = args.ep_size {
        if ep_size != reader.ranks() {
            bail!(
                "--ep-size is {ep_size} but {source} was recorded with {} ranks",
                reader.ranks()
            );
        }
    }
    let slots = args
        .redundant_slots
        .unwrap_or(EpConfig::default().redundant_slots);
    let config = replay_config(args, reader.ranks(), reader.experts(), slots)?;
    let layers = reader.layers().to_vec();
    note!(
        "bench balance: {} ({} ranks, {} experts, {} layers) x {} balancers",
        source,
        reader.ranks(),
        reader.experts(),
        layers.len(),
        config.algos.len()
    );
    let report = replay(reader, &source, &layers, &config, replay_progress(None));
    report.context(source)
}

/// The shape `--synthetic-trace` generates: `--shapes` (one) or the default, with `--ep-size`
/// and `--redundant-slots` over it.
fn synthetic_trace_shape(args: &BalanceArgs) -> anyhow::Result<Shape> {
    let mut shape = match args.shapes.as_slice() {
        [] => SYNTHETIC_TRACE_SHAPE,
        [shape] => *shape,
        _ => bail!("--synthetic-trace takes one --shapes value"),
    };
    shape.ranks = args.ep_size.unwrap_or(shape.ranks);
    shape.slots = args.redundant_slots.unwrap_or(shape.slots);
    shape
        .check()
        .map_err(|why| anyhow::anyhow!("--synthetic-trace shape {shape}: {why}"))?;
    Ok(shape)
}

/// `--synthetic-trace PATTERN`: a generated trace, optionally saved with `--write-trace` while
/// it replays.
fn replay_synthetic(args: &BalanceArgs, pattern: TracePattern) -> anyhow::Result<ReplayReport> {
    let shape = synthetic_trace_shape(args)?;
    let tokens = match args.tokens.as_slice() {
        [] => 1024,
        [tokens] => *tokens,
        _ => bail!("--synthetic-trace takes one --tokens value"),
    };
    let steps = args.steps.unwrap_or(200);
    let mut spec = TraceSpec::new(
        pattern,
        shape.ranks,
        shape.experts,
        args.layers.unwrap_or(8),
        steps,
        tokens,
    );
    spec.family = args.family.unwrap_or(spec.family);
    // The balancer benchmark's recorded figures were drawn token by token; it keeps that
    // reference (`rackfill simulate` draws rows by their counts).
    spec.sampler = rackfill_bench::synthetic::Sampler::Tokens;
    let generator = TraceGenerator::new(&spec, args.seed)?;
    let config = replay_config(args, shape.ranks, shape.experts, shape.slots)?;
    let name = format!(
        "synthetic {pattern} {}/{} {} t{tokens} seed {}",
        shape.ranks,
        shape.experts,
        spec.family.label(),
        args.seed
    );
    note!(
        "bench balance: {name}, {steps} steps x {} layers x {} balancers",
        spec.layers,
        config.algos.len()
    );
    let layers = spec.layer_ids();
    let progress = replay_progress(Some(steps));
    let Some(path) = &args.write_trace else {
        let source = generator.map(Ok::<_, std::convert::Infallible>);
        return Ok(replay(source, &name, &layers, &config, progress)?);
    };
    let cannot = |e: std::io::Error| {
        std::io::Error::new(e.kind(), format!("cannot write {}: {e}", path.display()))
    };
    let mut writer = TraceWriter::create(path, layers.clone()).map_err(cannot)?;
    let source = generator.map(|step| writer.write_step(&step).map(|()| step).map_err(cannot));
    let report = replay(source, &name, &layers, &config, progress)?;
    writer.finish().map_err(cannot)?;
    note!("trace written to {}", path.display());
    Ok(report)
}
