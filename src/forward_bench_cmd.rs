//! `rackfill bench forward`: prefill tokens/s of the dense single-device forward, on the CPU
//! (candle, f32) or the whole model on a GPU (bf16), of the bench shape, a real model's
//! shape with synthetic weights generated where the model runs (`--model-shape`: Qwen3-30B-A3B,
//! DeepSeek-V3 or a config.json, optionally its first `--layers`), or a checkpoint (`--model`). Each length also
//! gets its model FLOPs per second and, on a GPU, model FLOP utilisation against the card's
//! dense bf16 peak and the device time per phase of one more, profiled, prefill.

use std::path::PathBuf;

use crate::flags::parse_positive;
use crate::report_file::{create_report_file, write_json};
use rackfill_bench::forward::{
    check_lengths, run_forward, synthetic_bench_checkpoint, ForwardReport, ModelShape,
};
use rackfill_engine::ModelDevice;
use rackfill_models::{Checkpoint, ModelConfig};

/// `rackfill bench forward`.
#[derive(Debug, Clone, clap::Args)]
pub struct ForwardArgs {
    /// Checkpoint directory or HF id [default: the bench shape, seeded synthetic weights]
    #[arg(long, conflicts_with = "model_shape")]
    pub model: Option<String>,

    /// A real model's shape with seeded random weights generated where the model runs (no
    /// file, no host copy): qwen3-30b-a3b, deepseek-v3, or the path of a Qwen3-MoE or
    /// DeepSeek-V3 config.json (or its directory).
    #[arg(long, value_parser = ModelShape::parse)]
    pub model_shape: Option<ModelShape>,

    /// With --model-shape: only the first N decoder layers (DeepSeek-V3's first 3 are dense).
    #[arg(long, requires = "model_shape", value_parser = parse_positive)]
    pub layers: Option<usize>,

    /// Prompt lengths in tokens, comma-separated, each at most the model's context
    /// (max_position_embeddings: 8192 for the bench shape).
    #[arg(long, value_delimiter = ',', value_parser = parse_positive, default_value = "512,2048,4096")]
    pub tokens: Vec<usize>,

    /// Timed runs per length (after one warm-up), at most 1000; the median is reported.
    #[arg(long, default_value_t = 3, value_parser = crate::flags::parse_repeats)]
    pub repeats: usize,

    /// Seed for the random weights and prompts.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Where the forward runs: `cpu` (candle, f32), `cuda` / `cuda:N` (the whole model on the
    /// GPU in bf16, every expert local) or `emulator` (that path on the host emulator).
    #[arg(long, default_value = "cpu", value_parser = crate::flags::parse_device)]
    pub device: ModelDevice,

    /// How the GPU path runs the routed experts: `grouped` (one tensor-core launch of each MLP
    /// half for all experts of a layer) or `per-expert` (a cuBLAS GEMM pair per expert: the
    /// baseline the grouped kernels are measured against).
    #[arg(long, value_enum, default_value_t = ExpertGemmsArg::Grouped)]
    pub expert_gemms: ExpertGemmsArg,

    /// The card's dense bf16 peak in TFLOP/s, for model FLOP utilisation (default: from the
    /// GPU's name, where rackfill knows it).
    #[arg(long, value_name = "TFLOPS")]
    pub peak_tflops: Option<f64>,

    /// Also write the report as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// `--expert-gemms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExpertGemmsArg {
    Grouped,
    PerExpert,
}

/// Runs `rackfill bench forward`.
pub fn run(args: ForwardArgs) -> anyhow::Result<()> {
    if args.device == ModelDevice::Cpu && args.expert_gemms != ExpertGemmsArg::Grouped {
        anyhow::bail!("--expert-gemms chooses the GPU path's expert kernels: give --device cuda");
    }
    let json_file = create_report_file(args.json.as_deref())?;
    // The checkpoint, memory-mapped or synthetic: the CPU path builds its f32 model from it,
    // the GPU path uploads (or generates) it on the device (no model in host memory).
    let (config, checkpoint, name) = match (&args.model, &args.model_shape) {
        (Some(spec), _) => {
            let dir = rackfill_models::source::resolve(spec)?;
            (
                ModelConfig::load(&dir)?,
                Checkpoint::open(&dir)?,
                spec.clone(),
            )
        }
        (None, Some(shape)) => {
            let (config, checkpoint) = shape.synthetic(args.layers, args.seed)?;
            let layers = config.num_layers;
            (
                config,
                checkpoint,
                format!("{} ({layers} layers)", shape.name()),
            )
        }
        (None, None) => {
            let (config, checkpoint) = synthetic_bench_checkpoint(args.seed)?;
            (config, checkpoint, "bench-shape".to_string())
        }
    };
    check_lengths(&config, &args.tokens)?;
    note!(
        "bench forward: {name}, prompts {:?} tokens, {} repeats",
        args.tokens,
        args.repeats
    );
    let mut report = match args.device {
        ModelDevice::Cpu => {
            let model = rackfill_models::MoeModel::from_checkpoint(config.clone(), &checkpoint)?;
            run_forward(&model, &name, &args.tokens, args.repeats, args.seed)?
        }
        device => run_forward_on_gpu((&config, &checkpoint), &name, &args, device)?,
    };
    report.add_flops(
        &config,
        args.peak_tflops.or_else(|| device_peak(&report.device)),
    );
    report.config = match &args.model_shape {
        Some(shape) => Some(shape.config_json(args.layers)?),
        None => None,
    };
    print_report(&report);
    if let (Some(file), Some(path)) = (json_file, &args.json) {
        write_json(file, path, &report)?;
    }
    Ok(())
}

/// The dense bf16 peak of the GPU named `device`, where rackfill knows it.
fn device_peak(device: &str) -> Option<f64> {
    #[cfg(feature = "cuda")]
    return rackfill_kernels::cuda::peak::dense_bf16_peak_tflops(device);
    #[cfg(not(feature = "cuda"))]
    return {
        let _ = device;
        None
    };
}

fn print_report(report: &ForwardReport) {
    let of_peak = |mfu: Option<f64>| mfu.map_or("-".into(), |m| format!("{:.1}%", 100.0 * m));
    outln!("| tokens | tokens/s | model TFLOP/s | MFU | seconds (each run) |");
    outln!("|-------:|---------:|-------:|----:|:-------------------|");
    for r in &report.results {
        let runs: Vec<String> = r.seconds.iter().map(|s| format!("{s:.3}")).collect();
        outln!(
            "| {} | {:.0} | {:.1} | {} | {} |",
            r.tokens,
            r.tokens_per_s,
            r.model_tflops,
            of_peak(r.mfu),
            runs.join(", ")
        );
    }
    let Some(first) = report.results.iter().find(|r| !r.phases_ms.is_empty()) else {
        return;
    };
    let phases: Vec<&String> = first.phases_ms.keys().collect();
    outln!("");
    outln!(
        "device time per phase, ms (one profiled prefill): | tokens | {} | sum |",
        phases
            .iter()
            .map(|p| p.as_str())
            .collect::<Vec<_>>()
            .join(" | ")
    );
    for r in &report.results {
        let cells: Vec<String> = phases
            .iter()
            .map(|p| format!("{:.2}", r.phases_ms.get(*p).copied().unwrap_or(0.0)))
            .collect();
        let sum: f64 = r.phases_ms.values().sum();
        outln!("| {} | {} | {sum:.2} |", r.tokens, cells.join(" | "));
    }
}

/// [`run_forward`] with the whole model on `device`'s GPU path (bf16, every expert local): a GPU,
/// or the host emulator, loaded from the checkpoint straight to the device. After the timed
/// runs, one more prefill per length runs with every operation bracketed by events
/// ([`Profiled`](rackfill_kernels::cuda::exec::Profiled)), for the time per phase.
#[cfg(feature = "cuda")]
fn run_forward_on_gpu(
    (config, checkpoint): (&ModelConfig, &Checkpoint),
    name: &str,
    args: &ForwardArgs,
    device: ModelDevice,
) -> anyhow::Result<ForwardReport> {
    use std::sync::Arc;

    use rackfill_bench::forward::{random_prompt, time_prefills, ForwardBenchError};
    use rackfill_kernels::cuda::exec::Profiled;
    use rackfill_kernels::cuda::grouped_gemm::ExpertGemms;
    use rackfill_models::gpu::{phases::forward_phase, ExpertPlacement, GpuInput, GpuModel};
    use rackfill_models::LogitsFor;

    let exec = crate::gpu_exec::open_executor(device)?;
    let device = exec.describe();
    let profiled = Arc::new(Profiled::new(exec, forward_phase));
    profiled.set_enabled(false);
    let longest = args.tokens.iter().copied().max().unwrap_or(1);
    let (mut gpu, _) = GpuModel::load(
        profiled.clone(),
        config,
        checkpoint,
        longest,
        ExpertPlacement::Here,
    )?;
    gpu.set_expert_gemms(match args.expert_gemms {
        ExpertGemmsArg::Grouped => ExpertGemms::Grouped,
        ExpertGemmsArg::PerExpert => ExpertGemms::PerGroup,
    });
    let vocab = config.vocab_size;
    let prefill = |prompt: &[u32]| -> Result<(), ForwardBenchError> {
        let mut sequence = gpu.new_sequence();
        gpu.forward(&mut [GpuInput {
            tokens: prompt,
            sequence: &mut sequence,
            logits: LogitsFor::LastPosition,
        }])?;
        Ok(())
    };
    let mut results = time_prefills(&args.tokens, args.repeats, args.seed, vocab, prefill)?;
    for r in &mut results {
        let prompt = random_prompt(r.tokens, args.seed ^ 0x5eed, vocab);
        profiled.set_enabled(true);
        let ran = prefill(&prompt);
        profiled.set_enabled(false);
        ran?;
        r.phases_ms = profiled
            .take()?
            .into_iter()
            .map(|(phase, time)| (phase.to_string(), time.as_secs_f64() * 1e3))
            .collect();
    }
    Ok(ForwardReport {
        implementation: "rackfill",
        device,
        model: match args.expert_gemms {
            ExpertGemmsArg::Grouped => name.to_string(),
            ExpertGemmsArg::PerExpert => format!("{name}, per-expert GEMMs"),
        },
        threads: 1,
        peak_tflops: None,
        config: None,
        results,
    })
}

#[cfg(not(feature = "cuda"))]
fn run_forward_on_gpu(
    _: (&ModelConfig, &Checkpoint),
    _: &str,
    args: &ForwardArgs,
    _: ModelDevice,
) -> anyhow::Result<ForwardReport> {
    anyhow::bail!(
        "--device {} needs the GPU path of the default build (this binary was built with \
         --no-default-features)",
        args.device
    )
}
