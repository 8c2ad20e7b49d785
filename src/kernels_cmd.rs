//! `rackfill kernels ...`: the GPU engine's kernels on the command line.
//!
//! - `check [--arch sm_90,sm_100]` compiles every CUDA kernel with NVRTC for each architecture;
//!   no GPU is needed, so CI runs it and a kernel that does not compile fails the build;
//! - `probe` says which GPU the data plane would use, or why it would run on the CPU, and whether
//!   NCCL (the GPU fabric of `--fabric nccl`) can load, or why not; both are optional, so neither
//!   changes the exit status;
//! - `bench` measures the GPU figures of docs/gpu.md (GPU host only).
//!
//! All of it needs the GPU engine of the default build; a binary built with
//! `--no-default-features` says so.

use anyhow::Result;

/// `rackfill kernels` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum KernelsCommand {
    /// Compile every CUDA kernel with NVRTC for each architecture (no GPU needed).
    Check(CheckArgs),
    /// Show the GPU the data plane would use, or why it runs on the CPU, and NCCL's version or
    /// why it is unavailable.
    Probe,
    /// Measure solver latency, replica-distribution bandwidth and relay fan-out (GPU host).
    Bench(BenchArgs),
}

/// Arguments of `rackfill kernels check`.
#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// Comma-separated NVRTC architectures.
    #[arg(long, value_delimiter = ',', default_value = "sm_90,sm_100")]
    arch: Vec<String>,
}

/// Arguments of `rackfill kernels bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Timed repetitions per measurement (the median is reported).
    #[arg(long, default_value_t = 50)]
    reps: usize,
    /// Bytes of one expert's weights for the distribution benchmarks.
    #[arg(long, default_value_t = 8 << 20)]
    expert_bytes: u64,
}

/// Runs a `rackfill kernels` subcommand.
pub fn run(cmd: KernelsCommand) -> Result<()> {
    imp::run(cmd)
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::KernelsCommand;
    use anyhow::{bail, Result};

    pub fn run(_cmd: KernelsCommand) -> Result<()> {
        bail!(
            "this rackfill was built without the GPU engine (--no-default-features): \
             the default build (`cargo build --release`) has it"
        )
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use super::{BenchArgs, CheckArgs, KernelsCommand};
    use anyhow::{bail, Result};
    use rackfill_engine::fabric::probe_nccl;
    use rackfill_kernels::cuda::nvrtc::{self, CompileFailure};
    use rackfill_kernels::cuda::{bench, probe};

    pub fn run(cmd: KernelsCommand) -> Result<()> {
        match cmd {
            KernelsCommand::Check(args) => check(args),
            KernelsCommand::Probe => {
                match probe() {
                    Ok(info) => outln!("gpu {info}"),
                    Err(why) => outln!("no usable GPU ({why}); the data plane runs on the CPU"),
                }
                match probe_nccl() {
                    Ok(info) => outln!("nccl {info}"),
                    Err(why) => outln!("{why}"),
                }
                Ok(())
            }
            KernelsCommand::Bench(args) => run_bench(args),
        }
    }

    fn check(args: CheckArgs) -> Result<()> {
        for arch in &args.arch {
            nvrtc::check_arch(arch)?;
        }
        nvrtc::nvrtc_version()?;
        let mut failed = 0;
        for arch in &args.arch {
            for source in nvrtc::SOURCES {
                match nvrtc::compile(&source, arch) {
                    Ok(ptx) => outln!("ok {} {arch} ({} bytes PTX)", source.name, ptx.bytes),
                    Err(CompileFailure::Source { log, .. }) => {
                        note!("FAILED {} {arch}:\n{log}", source.name);
                        failed += 1;
                    }
                    Err(other) => return Err(other.into()),
                }
            }
        }
        if failed > 0 {
            bail!("{failed} kernel compilation(s) failed (NVRTC logs above)");
        }
        Ok(())
    }

    fn run_bench(args: BenchArgs) -> Result<()> {
        if args.reps == 0 {
            bail!("--reps must be at least 1");
        }
        let opened = rackfill_kernels::cuda::exec::GpuExecutor::open(args.device)?;
        outln!("device: {}", opened.info());
        let gpu: std::sync::Arc<dyn rackfill_kernels::cuda::exec::Executor> =
            std::sync::Arc::new(opened);
        let solver = bench::solver_latency(&gpu, 64, 256, 2, args.reps)?;
        outln!(
            "solver R=64 E=256 n_slot=2: gpu median {:.1} us, cpu median {:.1} us, \
             {} of {} plans identical to the CPU planner, {} warps, load staged: {}",
            solver.gpu_median_us,
            solver.cpu_median_us,
            solver.identical,
            solver.inputs,
            solver.warps,
            solver.load_staged
        );
        let tiles = bench::tile_planning_latency(&gpu, 64, 256, 2, args.expert_bytes, args.reps)?;
        outln!(
            "relay planning R=64 E=256 n_slot=2: gpu median {:.1} us (plan in place), host \
             median {:.1} us (schedule + tile compile, plan already downloaded), {} tasks, \
             identical to the host compiler: {}",
            tiles.gpu_median_us,
            tiles.host_median_us,
            tiles.tasks,
            tiles.identical
        );
        let dist =
            bench::distribution_bandwidth(gpu.as_ref(), 64, 256, 2, args.expert_bytes, args.reps)?;
        outln!(
            "replica distribution: {} bytes stored in {:.1} us = {:.1} GB/s; \
             device-to-device copy of the same bytes {:.1} us = {:.1} GB/s; ratio {:.1}%",
            dist.stored_bytes,
            dist.kernel_us,
            dist.kernel_gbps(),
            dist.copy_us,
            dist.copy_gbps(),
            100.0 * dist.kernel_gbps() / dist.copy_gbps()
        );
        for fanout in [8, 16, 32] {
            let r = bench::relay_vs_direct(gpu.as_ref(), fanout, args.expert_bytes, args.reps)?;
            outln!(
                "fan-out {fanout}: direct {:.1} us, relay ({} relays) {:.1} us \
                 (all ranks on one GPU: this measures the tile pipeline, not NVLink links)",
                r.direct_us,
                r.relays,
                r.relay_us
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::CheckArgs;
    use clap::{CommandFactory, Parser};

    #[derive(Parser)]
    struct Check {
        #[command(flatten)]
        args: CheckArgs,
    }

    #[test]
    fn default_arches_are_shown_as_the_comma_list_arch_takes() {
        assert_eq!(Check::parse_from(["check"]).args.arch, ["sm_90", "sm_100"]);
        let help = Check::command().render_help().to_string();
        assert!(help.contains("[default: sm_90,sm_100]"), "{help}");
    }
}
