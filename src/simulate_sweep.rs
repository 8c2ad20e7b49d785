//! `rackfill simulate --sweep`: the cross product of the `--model-shape`, `--ep-size`,
//! `--redundant-slots`, `--schedule` and `--trace` lists, every balancer at every point, on
//! `--jobs` threads (see `rackfill_bench::simulate::sweep` and docs/simulate.md#sweeps). Prints
//! the table, or the report as JSON with `--json`; progress goes to standard error.

use crate::simulate_cmd::{
    check_plot_format, print_report, refuse_synthetic_only_flags, sim_spec, SimulateArgs,
};
use anyhow::{bail, Result};
use rackfill_bench::simulate::shape::ModelShape;
use rackfill_bench::simulate::sweep::{run_sweep, sweep_plots, sweep_table, SweepSpec};
use rackfill_bench::simulate::trace::TraceSource;
use std::io::Write as _;
use std::path::Path;

/// Runs `rackfill simulate --sweep`: fails (exit 2) on a bad flag or when no point ran; a point
/// that failed is a row with its error.
pub(crate) fn run(args: &SimulateArgs) -> Result<()> {
    check_plot_format(args)?;
    for (given, flag) in [
        (args.requests.is_some(), "--requests"),
        (!args.rates.is_empty(), "--rates"),
    ] {
        if given {
            bail!("{flag} simulates serving a request trace; --sweep runs throughput mode only");
        }
    }
    if let Some(prefix) = &args.plot_prefix {
        // Found out before the sweep runs, not after.
        let dir = Path::new(prefix)
            .parent()
            .filter(|d| !d.as_os_str().is_empty());
        if let Some(dir) = dir.filter(|d| !d.is_dir()) {
            bail!(
                "--plot-prefix {prefix}: directory {} does not exist",
                dir.display()
            );
        }
    }
    let traces: Vec<TraceSource> = args.trace.iter().map(|t| TraceSource::parse(t)).collect();
    refuse_synthetic_only_flags(args, &traces)?;
    let shapes = args
        .model_shape
        .iter()
        .map(|s| ModelShape::load(s))
        .collect::<Result<Vec<_>, _>>()?;
    let (Some(shape), Some(&ep), Some(&slots), Some(&schedule)) = (
        shapes.first(),
        args.ep_size.first(),
        args.redundant_slots.first(),
        args.schedule.first(),
    ) else {
        bail!(
            "--sweep needs at least one value of --model-shape, --ep-size, --redundant-slots \
             and --schedule"
        );
    };
    let spec = SweepSpec {
        template: sim_spec(args, shape.clone(), ep, slots, schedule)?,
        shapes,
        eps: args.ep_size.clone(),
        slots: args.redundant_slots.clone(),
        schedules: args.schedule.clone(),
        traces,
        sample_layers: args.sample_layers,
        steps: args.steps,
        context_tokens: args.context_tokens,
        jobs: args
            .jobs
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
    };
    let stderr = std::io::stderr();
    let report = run_sweep(&spec, |done, total| {
        let _ = write!(stderr.lock(), "\rsimulated point {done}/{total}");
    })?;
    let _ = writeln!(stderr.lock());
    print_report(args.json, &report, || sweep_table(&report))?;
    if report.succeeded() == 0 {
        let first = report.points.iter().find_map(|p| p.error.as_deref());
        bail!(
            "no point of the sweep ran; the first failed with: {}",
            first.unwrap_or("no error recorded")
        );
    }
    if let Some(prefix) = &args.plot_prefix {
        for path in sweep_plots(&report, prefix, &args.plot_format)? {
            note!("wrote {}", path.display());
        }
    }
    Ok(())
}
