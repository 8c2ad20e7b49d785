//! `rackfill bench attention`: the fused paged attention kernel against the unfused baseline
//! (a cuBLAS GEMM for the scores, a softmax kernel, a second cuBLAS GEMM), on one GQA layer's
//! prefill chunks over a cached context, on a GPU or the host emulator. The default shape is
//! Qwen3-30B-A3B's attention (32 query heads, 4 KV heads, head_dim 128).

use crate::flags::{parse_device, parse_positive, parse_repeats};
use crate::report_file::create_report_file;
use rackfill_engine::ModelDevice;
use std::path::PathBuf;

/// `rackfill bench attention`.
#[derive(Debug, Clone, clap::Args)]
pub struct AttentionArgs {
    /// Query heads.
    #[arg(long, default_value_t = 32, value_parser = parse_positive)]
    pub heads: usize,

    /// Key/value heads (divides --heads).
    #[arg(long, default_value_t = 4, value_parser = parse_positive)]
    pub kv_heads: usize,

    /// Width of one head.
    #[arg(long, default_value_t = 128, value_parser = parse_positive)]
    pub head_dim: usize,

    /// Tokens already cached before the chunk, comma-separated: one case each.
    #[arg(long, value_delimiter = ',', default_value = "0,2048,6144")]
    pub context: Vec<usize>,

    /// New tokens (the queries) of every case.
    #[arg(long, default_value_t = 2048, value_parser = parse_positive)]
    pub chunk: usize,

    /// Timed runs of each side per case (after one warm-up); the median is reported.
    #[arg(long, default_value_t = 10, value_parser = parse_repeats)]
    pub repeats: usize,

    /// `cuda` / `cuda:N` (a GPU) or `emulator` (the same kernels on the host, a check).
    #[arg(long, default_value = "cuda", value_parser = parse_device)]
    pub device: ModelDevice,

    /// Also write the report as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// Runs `rackfill bench attention`.
pub fn run(args: AttentionArgs) -> anyhow::Result<()> {
    if args.device == ModelDevice::Cpu {
        anyhow::bail!("bench attention times the GPU path: --device cuda, cuda:N or emulator");
    }
    if !args.heads.is_multiple_of(args.kv_heads) {
        anyhow::bail!(
            "--heads {} is not a multiple of --kv-heads {}",
            args.heads,
            args.kv_heads
        );
    }
    let json_file = create_report_file(args.json.as_deref())?;
    measure(&args, json_file)
}

#[cfg(feature = "cuda")]
fn measure(args: &AttentionArgs, json_file: Option<std::fs::File>) -> anyhow::Result<()> {
    use rackfill_models::gpu::{bench_attention, AttentionCase};
    let exec = crate::gpu_exec::open_executor(args.device)?;
    let device = exec.describe();
    note!(
        "bench attention on {device}: {} query heads, {} KV heads, head_dim {}, chunk {}, {} \
         repeats",
        args.heads,
        args.kv_heads,
        args.head_dim,
        args.chunk,
        args.repeats
    );
    outln!("| context | chunk | fused ms | cuBLAS + softmax ms | speedup | rel. L2 diff |");
    outln!("|--:|--:|--:|--:|--:|--:|");
    let mut timings = Vec::with_capacity(args.context.len());
    for &context in &args.context {
        let case = AttentionCase {
            q_heads: args.heads,
            kv_heads: args.kv_heads,
            head_dim: args.head_dim,
            context,
            chunk: args.chunk,
        };
        let t = bench_attention(exec.as_ref(), case, args.repeats)?;
        outln!(
            "| {context} | {} | {:.3} | {:.3} | {:.2}x | {:.1e} |",
            args.chunk,
            t.fused_ms,
            t.baseline_ms,
            t.speedup,
            t.rel_l2
        );
        // bf16 probabilities and outputs on both sides: beyond a few percent one of them is
        // wrong, not rounded.
        if t.rel_l2.is_nan() || t.rel_l2 > 2e-2 {
            anyhow::bail!(
                "the fused kernel and the baseline disagree at context {context}: relative L2 \
                 difference {:.3e}",
                t.rel_l2
            );
        }
        timings.push(t);
    }
    if let (Some(file), Some(path)) = (json_file, &args.json) {
        let report = serde_json::json!({ "device": device, "timings": timings });
        crate::report_file::write_json(file, path, &report)?;
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn measure(args: &AttentionArgs, _: Option<std::fs::File>) -> anyhow::Result<()> {
    anyhow::bail!(
        "--device {} needs the GPU path of the default build (this binary was built with \
         --no-default-features)",
        args.device
    )
}
