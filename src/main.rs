//! The `rackfill` command line.

/// `println!` for command output: when stdout is a pipe whose reader has gone
/// (`rackfill kernels check | head -3`), the process ends quietly with the status a process
/// killed by SIGPIPE has (141), as Unix tools do, instead of panicking. Rust ignores SIGPIPE so
/// that a server's writes to a closed socket fail instead of killing it; this keeps that.
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::write_out(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `print!` for command output, ending the process on a closed pipe as [`outln!`] does.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::write_out(format_args!($($arg)*))
    };
}

/// `eprintln!` for progress and notes: a closed stderr (`rackfill bench balance 2>&1 | head -1`)
/// loses the line instead of panicking.
macro_rules! note {
    ($($arg:tt)*) => {
        $crate::write_err(format_args!("{}\n", format_args!($($arg)*)))
    };
}

mod allocator;
mod attention_bench_cmd;
mod balance_cmd;
mod bench_cmd;
mod flags;
mod forward_bench_cmd;
#[cfg(feature = "cuda")]
mod gpu_exec;
mod kernels_cmd;
mod kv_export_args;
mod overhead_cmd;
mod plan_cmd;
mod report_file;
mod serve_bench_cmd;
mod serve_cmd;
mod serve_group;
mod simulate_cmd;
mod simulate_sweep;
mod trace_gen_cmd;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// rackfill: prefill serving engine for MoE models under large expert parallelism.
#[derive(Debug, Parser)]
#[command(name = "rackfill", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Solve one layer's replication plan from a load matrix.
    Plan(plan_cmd::PlanArgs),
    /// Benchmarks (balancer quality and solve time).
    #[command(subcommand)]
    Bench(bench_cmd::BenchCommand),
    /// Serve the OpenAI-compatible API (the built-in model when --model is omitted).
    Serve(serve_cmd::ServeArgs),
    /// GPU engine: compile-check the CUDA kernels, probe the GPU, GPU benchmarks.
    #[command(subcommand)]
    Kernels(kernels_cmd::KernelsCommand),
    /// Rack-scale what-if: per-term step cost of balancers against the force-balanced ideal.
    Simulate(simulate_cmd::SimulateArgs),
}

/// Writes command output to stdout (see [`outln!`]).
fn write_out(text: std::fmt::Arguments<'_>) {
    use std::io::Write;
    if let Err(err) = std::io::stdout().lock().write_fmt(text) {
        if err.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(141);
        }
        note!("error: cannot write to stdout: {err}");
        std::process::exit(2);
    }
}

/// Writes to stderr, ignoring a failure (see [`note!`]).
fn write_err(text: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let _ = std::io::stderr().lock().write_fmt(text);
}

/// Help and version go to stdout (exit 0) as clap prints them; a bad flag or value gets the
/// project's one-line error (clap's message, usage and tips folded into that line), exit 2.
fn flag_error(err: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(
        err.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        err.exit();
    }
    let text = err.to_string();
    let line: Vec<&str> = text
        .lines()
        .map(str::trim)
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .filter(|l| !l.is_empty())
        .collect();
    note!("{}", line.join(" "));
    ExitCode::from(2)
}

/// Whether `err` comes from writing to a pipe whose reader has gone.
fn is_broken_pipe(err: &anyhow::Error) -> bool {
    let broken = Some(std::io::ErrorKind::BrokenPipe);
    err.chain().any(|cause| {
        cause.downcast_ref::<std::io::Error>().map(|io| io.kind()) == broken
            || cause
                .downcast_ref::<serde_json::Error>()
                .and_then(serde_json::Error::io_error_kind)
                == broken
    })
}

fn main() -> ExitCode {
    allocator::configure();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => return flag_error(err),
    };
    let result = match cli.command {
        Command::Plan(args) => plan_cmd::run(args),
        Command::Bench(cmd) => bench_cmd::run(cmd),
        Command::Serve(args) => serve_group::run(args),
        Command::Kernels(cmd) => kernels_cmd::run(cmd),
        Command::Simulate(args) if args.sweep => simulate_sweep::run(&args),
        Command::Simulate(args) => simulate_cmd::run(args),
    };
    let code = match result {
        Ok(()) => ExitCode::SUCCESS,
        // Output went to a pipe that closed (`| head`): end quietly, as `outln!` does.
        Err(err) if is_broken_pipe(&err) => ExitCode::from(141),
        Err(err) => {
            // One line: the chain of causes, joined.
            note!("error: {err:#}");
            ExitCode::from(2)
        }
    };
    leave_without_nixl_teardown(code == ExitCode::SUCCESS);
    code
}

/// A process that loaded NIXL ends here, once its own work is done and its output flushed:
/// the libraries the NIXL 1.5 wheels bundle (libnl, through UCX's InfiniBand transport) crash
/// in their exit-time destructors, which would turn a clean exit into a SIGSEGV.
fn leave_without_nixl_teardown(success: bool) {
    if !rackfill_engine::kv_export::nixl::loaded() {
        return;
    }
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: ends the process without running destructors, which is the point.
    unsafe { libc::_exit(if success { 0 } else { 2 }) }
}
