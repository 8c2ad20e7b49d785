//! `rackfill simulate`: a rack-scale what-if (see `rackfill_bench::simulate` and
//! docs/simulate.md). Prints a readable table, or the report as JSON with `--json`; progress goes
//! to standard error.

use crate::flags::{
    dedup, help_with_list_default, parse_positive, BALANCER_ALIASES, EP_SIZE_ALIASES,
    REDUNDANT_SLOTS_ALIASES,
};
use anyhow::{bail, Result};
use rackfill_balancer::relay::RelayConfig;
use rackfill_balancer::{Algo, Settings};
use rackfill_bench::serve::dataset::load_trace;
use rackfill_bench::simulate::calibration::{calibration_table, Calibration, CalibrationReport};
use rackfill_bench::simulate::queue::{run_requests, RequestRun};
use rackfill_bench::simulate::report::{
    request_plots, request_table, throughput_plots, throughput_table, RequestReport,
};
use rackfill_bench::simulate::shape::ModelShape;
use rackfill_bench::simulate::trace::TraceSource;
use rackfill_bench::simulate::{run_throughput, SimSpec, ThroughputRun};
use rackfill_bench::synthetic::Sampler;
use rackfill_engine::{EpConfig, Rack, Schedule, SlotMemory};
use std::io::Write as _;
use std::path::PathBuf;

/// Tokens each rank prefills per step unless `--chunk-tokens` says otherwise.
const DEFAULT_CHUNK_TOKENS: u64 = 4096;

/// Ranks a rack-scale simulation spreads the experts over unless `--ep-size` says otherwise
/// (64 of an NVL72's 72 GPUs; the engine's own default, one host's, is much smaller).
const DEFAULT_EP_SIZE: usize = 64;

/// Solve time per layer charged to the rack when nothing measured one: UltraEP's planner on a
/// GB200 GPU (its §8.5: 111 us for 256 experts on 72 ranks).
pub(crate) const MODELLED_SOLVE_US: f64 = 111.0;

/// The rack a simulation costs on and the solve time it charges: `--rack` with the
/// `--calibration` report's measured rates, and `--solve-us`, the report's device solver, the
/// modelled GPU figure, or (`--host-solve-time`) none: measured live.
pub(crate) struct Costing {
    pub rack: Rack,
    pub solve_us: Option<f64>,
    /// Where `solve_us` comes from, for the report.
    pub solve_time: String,
    pub calibration: Option<CalibrationReport>,
}

impl Costing {
    pub(crate) fn from_args(args: &SimulateArgs) -> Result<Self> {
        let mut rack = Rack::load(&args.rack)?;
        let calibration = args
            .calibration
            .as_deref()
            .map(Calibration::load)
            .transpose()?;
        let report = calibration.as_ref().map(|c| c.report(&rack));
        if let Some(calibration) = &calibration {
            rack = calibration.apply(&rack);
        }
        let measured = calibration.as_ref().and_then(Calibration::solve_us);
        let (solve_us, solve_time) = match (args.host_solve_time, args.solve_us, measured) {
            (true, _, _) => (None, "measured on this host".to_string()),
            (_, Some(us), _) => (Some(us), "--solve-us".into()),
            (_, None, Some(us)) => (Some(us), "calibrated: the report's device solver".into()),
            _ => (
                Some(MODELLED_SOLVE_US),
                "modelled: UltraEP's planner on a GB200".into(),
            ),
        };
        Ok(Self {
            rack,
            solve_us,
            solve_time,
            calibration: report,
        })
    }
}

/// What `simulate` compares by default: the engine's balancer, the history-based baseline and
/// none.
fn simulated_balancers() -> [Algo; 3] {
    [EpConfig::default().balancer, Algo::EplbHistory, Algo::None]
}

/// Arguments of `rackfill simulate` (`simulate_sweep` reads them too).
#[derive(Debug, clap::Args)]
pub struct SimulateArgs {
    /// Model shape: qwen3-235b, deepseek-v3, glm-4.7, or a JSON file (a shape file or a Hugging
    /// Face config.json); with --sweep, a comma-separated list.
    #[arg(long, value_delimiter = ',', required = true)]
    pub(crate) model_shape: Vec<String>,
    /// EP ranks (one GPU each); at most the rack's GPUs. With --sweep, a comma-separated list.
    #[arg(long, value_delimiter = ',', default_values_t = [DEFAULT_EP_SIZE],
          aliases = EP_SIZE_ALIASES)]
    pub(crate) ep_size: Vec<usize>,
    /// Redundant expert slots per rank. With --sweep, a comma-separated list.
    #[arg(long, value_delimiter = ',', default_values_t = [EpConfig::default().redundant_slots],
          aliases = REDUNDANT_SLOTS_ALIASES)]
    pub(crate) redundant_slots: Vec<usize>,
    // Help set below: it shows the default list comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = simulated_balancers(),
          hide_default_value = true, aliases = BALANCER_ALIASES,
          help = help_with_list_default(
              "Balancers to compare, comma-separated (none, quota, quota-paper, eplb-exact, \
               eplb-history, greedy-move)",
              &simulated_balancers()))]
    pub(crate) balancer: Vec<Algo>,
    /// How a step's phases overlap: ultraep (one micro-batch, solve and replica streaming on the
    /// critical path), pipelined (dispatch and the main experts' GEMMs do not wait for the
    /// replicas), two-batch (two micro-batches overlapping each other's compute and
    /// communication), overlapped (both). Every run also reports all four (the ablation); the
    /// names `rackfill serve --schedule` runs. With --sweep, a comma-separated list.
    #[arg(long, value_delimiter = ',', default_value = "overlapped",
          value_parser = crate::flags::parse_schedule)]
    pub(crate) schedule: Vec<Schedule>,
    /// Where replicas live between steps: shared (one set of slots for every MoE layer, each
    /// layer's replicas streamed afresh every step) or per-layer (each layer keeps its slots and
    /// streams only replicas not already resident; the slot memory times the MoE layers).
    #[arg(long, default_value = "shared", value_parser = crate::flags::parse_slot_memory)]
    pub(crate) slot_memory: SlotMemory,
    /// With --slot-memory per-layer: quota plans move replicas onto ranks that still hold the
    /// same expert while the busiest rank's load stays within this fraction of the solved
    /// plan's (0.02: 2% more); `off` keeps the plans as solved.
    #[arg(long, default_value = "0.02", value_parser = crate::flags::parse_reuse_tolerance)]
    pub(crate) reuse_tolerance: crate::flags::ReuseTolerance,
    /// Routing: synthetic-mixed (the default), synthetic-stationary, synthetic-drifting,
    /// synthetic-switching (the same popularity with one kind of dynamics each), or a routing
    /// trace recorded with --record-routing. With --sweep, a comma-separated list.
    #[arg(long, value_delimiter = ',', default_value = "synthetic-mixed")]
    pub(crate) trace: Vec<String>,
    /// Rack: nvl72, or a rack JSON file (see docs/simulate.md).
    #[arg(long, default_value = "nvl72")]
    pub(crate) rack: String,
    /// Tokens each rank prefills per step, at most 65536 (synthetic routing and --requests; a
    /// recorded trace's rows set its tokens) [default: 4096]
    #[arg(long)]
    pub(crate) chunk_tokens: Option<u64>,
    /// Steps to simulate, at most 1000000 (throughput mode; a recorded trace may end sooner).
    #[arg(long, default_value_t = 100)]
    pub(crate) steps: usize,
    /// Seed of the synthetic routing and the request arrivals.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Solve time charged per layer, microseconds [default: the --calibration report's device
    /// solver, else UltraEP's 111 us on a GB200].
    #[arg(long, conflicts_with = "host_solve_time")]
    pub(crate) solve_us: Option<f64>,
    /// Charge the planners' solve time measured live on this host's CPU instead of a modelled
    /// GPU figure (the results then depend on this machine and its load).
    #[arg(long)]
    pub(crate) host_solve_time: bool,
    /// A GPU run report (scripts/gpu_session.sh's output folder, or one bench JSON) whose
    /// measured rates replace the rack's assumed kernel efficiencies and solve time.
    #[arg(long, value_name = "PATH")]
    pub(crate) calibration: Option<PathBuf>,
    /// How synthetic routing draws each rank's expert counts: counts (per row, fast) or tokens
    /// (every token's experts, the reference) [default: counts].
    #[arg(long)]
    pub(crate) sampler: Option<Sampler>,
    /// Simulate this many MoE layers per step, each standing for moe_layers / N of the model's
    /// (synthetic routing; a recorded trace simulates each of its layers) [default: all].
    #[arg(long)]
    pub(crate) sample_layers: Option<usize>,
    /// Prior context, in tokens, of every synthetic chunk's request (attention cost only).
    #[arg(long, default_value_t = 0)]
    pub(crate) context_tokens: u64,
    /// Request trace (JSONL lines {"timestamp" ms, "input_length", "output_length"}): simulate
    /// serving it and report TTFT instead of throughput.
    #[arg(long, value_name = "FILE")]
    pub(crate) requests: Option<PathBuf>,
    /// Request rates (req/s) to re-time --requests at, comma-separated [default: the trace's
    /// timestamps].
    #[arg(long, value_delimiter = ',')]
    pub(crate) rates: Vec<f64>,
    /// Experts with more replicas than this are streamed over a two-stage relay tree.
    #[arg(long, default_value_t = RelayConfig::default().threshold)]
    pub(crate) relay_threshold: usize,
    /// Stream every replica straight from its home rank (no relay trees).
    #[arg(long)]
    pub(crate) no_relay: bool,
    /// Smallest quota a new replica must carry (quota planners).
    #[arg(long, default_value_t = Settings::default().u_min)]
    pub(crate) u_min: u64,
    /// Steps of load history eplb-history plans from.
    #[arg(long, default_value_t = Settings::default().history_window,
          value_parser = parse_positive)]
    pub(crate) history_window: usize,
    /// eplb-history re-plans every this many steps.
    #[arg(long, default_value_t = Settings::default().rebalance_interval,
          value_parser = parse_positive)]
    pub(crate) rebalance_interval: usize,
    /// Write plots to PREFIX-breakdown, PREFIX-steps (or PREFIX-rps-ttft, PREFIX-rps-p99-ttft;
    /// with --sweep, PREFIX-fraction-vs-ep and PREFIX-tokens-vs-slots).
    #[arg(long)]
    pub(crate) plot_prefix: Option<String>,
    /// Plot file format: svg or png.
    #[arg(long, default_value = "svg")]
    pub(crate) plot_format: String,
    /// Print the report as JSON.
    #[arg(long)]
    pub(crate) json: bool,
    /// Run the cross product of the --model-shape, --ep-size, --redundant-slots, --schedule and
    /// --trace lists, every balancer at every point (throughput mode), and report one row per
    /// point and balancer.
    #[arg(long)]
    pub(crate) sweep: bool,
    /// With --sweep: points simulated at once [default: the available cores].
    #[arg(long, value_parser = parse_positive)]
    pub(crate) jobs: Option<usize>,
}

/// Runs `rackfill simulate` without `--sweep` (`main` runs `simulate_sweep` with it).
pub fn run(args: SimulateArgs) -> Result<()> {
    debug_assert!(!args.sweep, "--sweep runs in simulate_sweep");
    check_plot_format(&args)?;
    if args.jobs.is_some() {
        bail!("--jobs applies to --sweep (points simulated at once)");
    }
    let model_shape = single(&args.model_shape, "--model-shape")?;
    let ep = *single(&args.ep_size, "--ep-size")?;
    let slots = *single(&args.redundant_slots, "--redundant-slots")?;
    let schedule = *single(&args.schedule, "--schedule")?;
    let trace = TraceSource::parse(single(&args.trace, "--trace")?);
    refuse_synthetic_only_flags(&args, std::slice::from_ref(&trace))?;
    let shape = ModelShape::load(model_shape)?;
    let spec = sim_spec(&args, shape, ep, slots, schedule)?;
    spec.validate()?;
    run_one(args, spec, trace)
}

/// Flags that shape synthetic routing only, refused when every `--trace` is a recorded one
/// (it sets its layers and tokens from its own lines); with a synthetic trace among them they
/// apply to it.
pub(crate) fn refuse_synthetic_only_flags(
    args: &SimulateArgs,
    traces: &[TraceSource],
) -> Result<()> {
    let Some(TraceSource::File(path)) = traces.first() else {
        return Ok(());
    };
    if !traces.iter().all(|t| matches!(t, TraceSource::File(_))) {
        return Ok(());
    }
    for (given, flag) in [
        (args.sample_layers.is_some(), "--sample-layers"),
        (args.chunk_tokens.is_some(), "--chunk-tokens"),
        (args.sampler.is_some(), "--sampler"),
    ] {
        if given {
            bail!(
                "{flag} applies to synthetic routing: --trace {} replays each of its layers with \
                 the tokens its rows hold",
                path.display()
            );
        }
    }
    Ok(())
}

/// `--plot-format` is one `plotters` writes.
pub(crate) fn check_plot_format(args: &SimulateArgs) -> Result<()> {
    if !matches!(args.plot_format.as_str(), "svg" | "png") {
        bail!(
            "--plot-format must be svg or png, got '{}'",
            args.plot_format
        );
    }
    Ok(())
}

/// Without --sweep every list flag takes one value.
fn single<'a, T>(values: &'a [T], flag: &str) -> Result<&'a T> {
    match values {
        [one] => Ok(one),
        _ => bail!(
            "{flag} takes one value without --sweep, got {}: --sweep runs the cross product of \
             the --model-shape, --ep-size, --redundant-slots, --schedule and --trace lists",
            values.len()
        ),
    }
}

/// What a simulation of `shape` at `ep` ranks with `slots` slots under `schedule` is given by the
/// other flags (`--sample-layers` unset: every MoE layer of the shape).
pub(crate) fn sim_spec(
    args: &SimulateArgs,
    shape: ModelShape,
    ep: usize,
    slots: usize,
    schedule: Schedule,
) -> Result<SimSpec> {
    let costing = Costing::from_args(args)?;
    Ok(SimSpec {
        rack: costing.rack,
        ep,
        slots,
        algos: dedup(&args.balancer),
        settings: Settings {
            u_min: args.u_min,
            history_window: args.history_window,
            rebalance_interval: args.rebalance_interval,
        },
        relay: RelayConfig {
            threshold: if args.no_relay {
                usize::MAX
            } else {
                args.relay_threshold
            },
            ..RelayConfig::default()
        },
        solve_us: costing.solve_us,
        sim_layers: args.sample_layers.unwrap_or(shape.moe_layers()),
        chunk_tokens: args.chunk_tokens.unwrap_or(DEFAULT_CHUNK_TOKENS),
        seed: args.seed,
        schedule,
        slot_memory: args.slot_memory,
        reuse_tolerance: args.reuse_tolerance.0,
        sampler: args.sampler.unwrap_or_default(),
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        shape,
    })
}

/// One simulation: a request trace's, or throughput.
fn run_one(args: SimulateArgs, spec: SimSpec, trace: TraceSource) -> Result<()> {
    let stderr = std::io::stderr();
    if let Some(path) = &args.requests {
        if trace != TraceSource::SYNTHETIC_MIXED {
            bail!("--requests simulates routing; it needs --trace synthetic-mixed");
        }
        let run = RequestRun {
            requests: load_trace(path, 1, None)?,
            rates: args.rates.clone(),
            spec,
        };
        let results = run_requests(&run, |step| {
            if step % 10 == 0 {
                let _ = write!(stderr.lock(), "\rsimulated step {step}");
            }
        })?;
        let _ = writeln!(stderr.lock());
        let spec = &run.spec;
        let report = RequestReport {
            model: spec.shape.name.clone(),
            rack: spec.rack.name.clone(),
            ep: spec.ep,
            slots: spec.slots,
            requests: run.requests.len(),
            seed: spec.seed,
            chunk_tokens: spec.chunk_tokens,
            moe_layers: spec.shape.moe_layers(),
            simulated_layers: spec.sim_layers,
            solve_us_override: spec.solve_us,
            results,
        };
        print_report(args.json, &report, || request_table(&report))?;
        if let Some(prefix) = &args.plot_prefix {
            if args.rates.is_empty() {
                bail!(
                    "--plot-prefix with --requests needs --rates (the plots are TTFT versus rate)"
                );
            }
            for path in request_plots(&report, prefix, &args.plot_format)? {
                note!("wrote {}", path.display());
            }
        }
        return Ok(());
    }
    if !args.rates.is_empty() {
        bail!("--rates needs --requests FILE");
    }
    let run = ThroughputRun {
        spec,
        trace,
        steps: args.steps,
        context_tokens: args.context_tokens,
    };
    let mut report = run_throughput(&run, |done, total| {
        if done % 10 == 0 || done == total {
            let _ = write!(stderr.lock(), "\rsimulated step {done}/{total}");
        }
    })?;
    let _ = writeln!(stderr.lock());
    let costing = Costing::from_args(&args)?;
    report.solve_time = costing.solve_time;
    if let Some(calibration) = costing.calibration {
        if !args.json {
            print!("{}", calibration_table(&calibration));
            println!();
        }
        report.calibration = Some(calibration);
    }
    print_report(args.json, &report, || throughput_table(&report))?;
    if let Some(prefix) = &args.plot_prefix {
        for path in throughput_plots(&report, prefix, &args.plot_format)? {
            note!("wrote {}", path.display());
        }
    }
    Ok(())
}

pub(crate) fn print_report<T: serde::Serialize>(
    json: bool,
    report: &T,
    table: impl FnOnce() -> String,
) -> Result<()> {
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer_pretty(&mut out, report)?;
        writeln!(out)?;
    } else {
        write!(out, "{}", table())?;
    }
    Ok(())
}
