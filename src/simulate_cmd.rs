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
use rackfill_bench::simulate::queue::{run_requests, RequestRun};
use rackfill_bench::simulate::report::{
    request_plots, request_table, throughput_plots, throughput_table, RequestReport,
};
use rackfill_bench::simulate::shape::ModelShape;
use rackfill_bench::simulate::trace::TraceSource;
use rackfill_bench::simulate::{run_throughput, SimSpec, ThroughputRun};
use rackfill_engine::{EpConfig, Rack, Schedule, SlotMemory};
use std::io::Write as _;
use std::path::PathBuf;

/// Tokens each rank prefills per step unless `--chunk-tokens` says otherwise.
const DEFAULT_CHUNK_TOKENS: u64 = 4096;

/// Ranks a rack-scale simulation spreads the experts over unless `--ep-size` says otherwise
/// (64 of an NVL72's 72 GPUs; the engine's own default, one host's, is much smaller).
const DEFAULT_EP_SIZE: usize = 64;

/// What `simulate` compares by default: the engine's balancer, the history-based baseline and
/// none.
fn simulated_balancers() -> [Algo; 3] {
    [EpConfig::default().balancer, Algo::EplbHistory, Algo::None]
}

/// Arguments of `rackfill simulate`.
#[derive(Debug, clap::Args)]
pub struct SimulateArgs {
    /// Model shape: qwen3-235b, deepseek-v3, glm-4.7, or a JSON file (a shape file or a Hugging
    /// Face config.json).
    #[arg(long)]
    model_shape: String,
    /// EP ranks (one GPU each); at most the rack's GPUs.
    #[arg(long, default_value_t = DEFAULT_EP_SIZE, aliases = EP_SIZE_ALIASES)]
    ep_size: usize,
    /// Redundant expert slots per rank.
    #[arg(long, default_value_t = EpConfig::default().redundant_slots,
          aliases = REDUNDANT_SLOTS_ALIASES)]
    redundant_slots: usize,
    // Help set below: it shows the default list comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = simulated_balancers(),
          hide_default_value = true, aliases = BALANCER_ALIASES,
          help = help_with_list_default(
              "Balancers to compare, comma-separated (none, quota, quota-paper, eplb-exact, \
               eplb-history, greedy-move)",
              &simulated_balancers()))]
    balancer: Vec<Algo>,
    /// How a step's phases overlap: ultraep (one micro-batch, solve and replica streaming on the
    /// critical path), pipelined (dispatch and the main experts' GEMMs do not wait for the
    /// replicas), two-batch (two micro-batches overlapping each other's compute and
    /// communication), overlapped (both). Every run also reports all four (the ablation); the
    /// names `rackfill serve --schedule` runs.
    #[arg(long, default_value = "overlapped", value_parser = crate::flags::parse_schedule)]
    schedule: Schedule,
    /// Where replicas live between steps: shared (one set of slots for every MoE layer, each
    /// layer's replicas streamed afresh every step) or per-layer (each layer keeps its slots and
    /// streams only replicas not already resident; the slot memory times the MoE layers).
    #[arg(long, default_value = "shared", value_parser = crate::flags::parse_slot_memory)]
    slot_memory: SlotMemory,
    /// With --slot-memory per-layer: quota plans move replicas onto ranks that still hold the
    /// same expert while the busiest rank's load stays within this fraction of the solved
    /// plan's (0.02: 2% more); `off` keeps the plans as solved.
    #[arg(long, default_value = "0.02", value_parser = crate::flags::parse_reuse_tolerance)]
    reuse_tolerance: crate::flags::ReuseTolerance,
    /// Routing: synthetic-mixed (the default), synthetic-stationary, synthetic-drifting,
    /// synthetic-switching (the same popularity with one kind of dynamics each), or a routing
    /// trace recorded with --record-routing.
    #[arg(long, default_value = "synthetic-mixed")]
    trace: String,
    /// Rack: nvl72, or a rack JSON file (see docs/simulate.md).
    #[arg(long, default_value = "nvl72")]
    rack: String,
    /// Tokens each rank prefills per step, at most 65536 (synthetic routing and --requests; a
    /// recorded trace's rows set its tokens) [default: 4096]
    #[arg(long)]
    chunk_tokens: Option<u64>,
    /// Steps to simulate, at most 1000000 (throughput mode; a recorded trace may end sooner).
    #[arg(long, default_value_t = 100)]
    steps: usize,
    /// Seed of the synthetic routing and the request arrivals.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Charge this solve time per layer instead of measuring the planner (reproducible output).
    #[arg(long)]
    solve_us: Option<f64>,
    /// Simulate this many MoE layers per step, each standing for moe_layers / N of the model's
    /// (synthetic routing; a recorded trace simulates each of its layers) [default: all].
    #[arg(long)]
    sample_layers: Option<usize>,
    /// Prior context, in tokens, of every synthetic chunk's request (attention cost only).
    #[arg(long, default_value_t = 0)]
    context_tokens: u64,
    /// Request trace (JSONL lines {"timestamp" ms, "input_length", "output_length"}): simulate
    /// serving it and report TTFT instead of throughput.
    #[arg(long, value_name = "FILE")]
    requests: Option<PathBuf>,
    /// Request rates (req/s) to re-time --requests at, comma-separated [default: the trace's
    /// timestamps].
    #[arg(long, value_delimiter = ',')]
    rates: Vec<f64>,
    /// Experts with more replicas than this are streamed over a two-stage relay tree.
    #[arg(long, default_value_t = RelayConfig::default().threshold)]
    relay_threshold: usize,
    /// Stream every replica straight from its home rank (no relay trees).
    #[arg(long)]
    no_relay: bool,
    /// Smallest quota a new replica must carry (quota planners).
    #[arg(long, default_value_t = Settings::default().u_min)]
    u_min: u64,
    /// Steps of load history eplb-history plans from.
    #[arg(long, default_value_t = Settings::default().history_window,
          value_parser = parse_positive)]
    history_window: usize,
    /// eplb-history re-plans every this many steps.
    #[arg(long, default_value_t = Settings::default().rebalance_interval,
          value_parser = parse_positive)]
    rebalance_interval: usize,
    /// Write plots to PREFIX-breakdown, PREFIX-steps (or PREFIX-rps-ttft, PREFIX-rps-p99-ttft).
    #[arg(long)]
    plot_prefix: Option<String>,
    /// Plot file format: svg or png.
    #[arg(long, default_value = "svg")]
    plot_format: String,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// Runs `rackfill simulate`.
pub fn run(args: SimulateArgs) -> Result<()> {
    if !matches!(args.plot_format.as_str(), "svg" | "png") {
        bail!(
            "--plot-format must be svg or png, got '{}'",
            args.plot_format
        );
    }
    let trace = TraceSource::parse(&args.trace);
    if let TraceSource::File(path) = &trace {
        // A recorded trace sets both from its own lines; a flag that changes nothing is refused.
        for (given, flag) in [
            (args.sample_layers.is_some(), "--sample-layers"),
            (args.chunk_tokens.is_some(), "--chunk-tokens"),
        ] {
            if given {
                bail!(
                    "{flag} applies to synthetic routing: --trace {} simulates each of its layers \
                     with the tokens its rows hold",
                    path.display()
                );
            }
        }
    }
    let shape = ModelShape::load(&args.model_shape)?;
    let spec = SimSpec {
        rack: Rack::load(&args.rack)?,
        ep: args.ep_size,
        slots: args.redundant_slots,
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
        solve_us: args.solve_us,
        sim_layers: args.sample_layers.unwrap_or(shape.moe_layers()),
        chunk_tokens: args.chunk_tokens.unwrap_or(DEFAULT_CHUNK_TOKENS),
        seed: args.seed,
        schedule: args.schedule,
        slot_memory: args.slot_memory,
        reuse_tolerance: args.reuse_tolerance.0,
        shape,
    };
    spec.validate()?;
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
    let report = run_throughput(&run, |done, total| {
        if done % 10 == 0 || done == total {
            let _ = write!(stderr.lock(), "\rsimulated step {done}/{total}");
        }
    })?;
    let _ = writeln!(stderr.lock());
    print_report(args.json, &report, || throughput_table(&report))?;
    if let Some(prefix) = &args.plot_prefix {
        for path in throughput_plots(&report, prefix, &args.plot_format)? {
            note!("wrote {}", path.display());
        }
    }
    Ok(())
}

fn print_report<T: serde::Serialize>(
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
