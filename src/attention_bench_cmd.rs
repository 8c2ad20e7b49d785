//! `rackfill bench attention`: the flash attention kernels, every tile shape in one sweep,
//! against the unfused baseline (a cuBLAS GEMM for the scores, a softmax kernel, a second
//! cuBLAS GEMM), on one GQA layer's prefill chunks of 512 to 16k tokens over a cached context,
//! on a GPU or the host emulator. The default shape is Qwen3-30B-A3B's attention (32 query
//! heads, 4 KV heads, head_dim 128). TFLOP/s count causal attention's FLOPs; the fraction of
//! the card's dense bf16 peak comes from its name or `--peak-tflops`.

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

    /// Tokens already cached before the chunk, comma-separated: one case per context and
    /// chunk.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    pub context: Vec<usize>,

    /// New tokens (the queries), comma-separated: one case per context and chunk.
    #[arg(long, value_delimiter = ',', default_value = "512,1024,2048,4096,8192,16384", value_parser = parse_positive)]
    pub chunk: Vec<usize>,

    /// Flash tile shapes to time: `all` (the sweep), `auto` (the default for the heads), or a
    /// list such as `k64_v128,k32_v128`.
    #[arg(long, default_value = "all")]
    pub tiles: String,

    /// The card's dense bf16 peak in TFLOP/s, for the fraction of peak (default: from the
    /// device's name, where rackfill knows it).
    #[arg(long, value_name = "TFLOPS")]
    pub peak_tflops: Option<f64>,

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

/// The tile shapes `--tiles` names, for heads of `shape`.
#[cfg(feature = "cuda")]
fn tile_list(
    spec: &str,
    shape: &rackfill_kernels::flash::AttentionShape,
    shared_limit: usize,
) -> anyhow::Result<Vec<rackfill_kernels::flash::FlashTiles>> {
    use rackfill_kernels::flash::FlashTiles;
    match spec {
        "all" => Ok(FlashTiles::ALL.to_vec()),
        "auto" => Ok(vec![FlashTiles::choose(shape, shared_limit)?]),
        list => list
            .split(',')
            .map(|name| {
                FlashTiles::ALL
                    .into_iter()
                    .find(|t| t.to_string() == name.trim())
                    .ok_or_else(|| {
                        let known: Vec<String> =
                            FlashTiles::ALL.iter().map(ToString::to_string).collect();
                        anyhow::anyhow!(
                            "--tiles: unknown tile shape '{name}' (all, auto, or some of {})",
                            known.join(", ")
                        )
                    })
            })
            .collect(),
    }
}

#[cfg(feature = "cuda")]
fn measure(args: &AttentionArgs, json_file: Option<std::fs::File>) -> anyhow::Result<()> {
    use rackfill_kernels::cuda::peak::dense_bf16_peak_tflops;
    use rackfill_kernels::flash::{AttentionShape, FlashTiles};
    use rackfill_models::gpu::{bench_attention, AttentionCase};
    let shape = AttentionShape {
        q_heads: u32::try_from(args.heads)?,
        kv_heads: u32::try_from(args.kv_heads)?,
        qk_dim: u32::try_from(args.head_dim)?,
        v_dim: u32::try_from(args.head_dim)?,
    };
    shape.check()?;
    let exec = crate::gpu_exec::open_executor(args.device)?;
    let tiles = tile_list(
        &args.tiles,
        &shape,
        exec.shared_limit(&FlashTiles::ALL[0].kernel())?,
    )?;
    let device = exec.describe();
    let peak = args.peak_tflops.or_else(|| dense_bf16_peak_tflops(&device));
    note!(
        "bench attention on {device}: {} query heads, {} KV heads, head_dim {}, {} repeats, \
         dense bf16 peak {}",
        args.heads,
        args.kv_heads,
        args.head_dim,
        args.repeats,
        peak.map_or("unknown (--peak-tflops)".into(), |p| format!("{p} TFLOP/s"))
    );
    let of_peak = |tflops: f64| peak.map_or("-".into(), |p| format!("{:.1}%", 100.0 * tflops / p));
    outln!(
        "| context | chunk | tiles | flash ms | TFLOP/s | of peak | cuBLAS + softmax ms | \
         TFLOP/s | speedup | rel. L2 diff |"
    );
    outln!("|--:|--:|:--|--:|--:|--:|--:|--:|--:|--:|");
    let mut timings = Vec::new();
    for &context in &args.context {
        for &chunk in &args.chunk {
            let case = AttentionCase {
                q_heads: args.heads,
                kv_heads: args.kv_heads,
                head_dim: args.head_dim,
                context,
                chunk,
            };
            let t = bench_attention(exec.as_ref(), case, &tiles, args.repeats)?;
            for f in &t.flash {
                outln!(
                    "| {context} | {chunk} | {} | {:.3} | {:.1} | {} | {:.3} | {:.1} | {:.2}x | \
                     {:.1e} |",
                    f.tiles,
                    f.ms,
                    f.tflops,
                    of_peak(f.tflops),
                    t.baseline_ms,
                    t.baseline_tflops,
                    f.speedup,
                    f.rel_l2
                );
                // bf16 probabilities and outputs on both sides: beyond a few percent one of
                // them is wrong, not rounded.
                if f.rel_l2.is_nan() || f.rel_l2 > 2e-2 {
                    anyhow::bail!(
                        "flash attention {} and the baseline disagree at context {context}, \
                         chunk {chunk}: relative L2 difference {:.3e}",
                        f.tiles,
                        f.rel_l2
                    );
                }
            }
            if let Some(best) = t.best() {
                note!(
                    "context {context}, chunk {chunk}: fastest {} at {:.1} TFLOP/s ({} of \
                     peak), {:.2}x the baseline",
                    best.tiles,
                    best.tflops,
                    of_peak(best.tflops),
                    best.speedup
                );
            }
            timings.push(t);
        }
    }
    if let (Some(file), Some(path)) = (json_file, &args.json) {
        let report = serde_json::json!({
            "device": device,
            "peak_tflops": peak,
            "timings": timings,
        });
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
