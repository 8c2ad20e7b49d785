//! `rackfill bench serve-trace`: writes a synthetic JSONL request trace with the Mooncake
//! trace's prefix-sharing structure, for `rackfill bench serve --dataset trace` (the generator is
//! [`rackfill_bench::serve::dataset::prefix_trace`]; this file parses flags and writes the file).
//! The defaults are the Mooncake trace's statistics scaled down so that the built-in model serves
//! the trace in well under a minute on two CPU cores; docs/bench-serve.md says where each comes
//! from.

use std::path::PathBuf;

use anyhow::{bail, Context as _};
use rackfill_bench::serve::dataset::prefix_trace::{self, PrefixTraceParams};

/// `rackfill bench serve-trace`.
#[derive(Debug, Clone, clap::Args)]
pub struct TraceGenArgs {
    /// The JSONL trace to write.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// Requests (lines) [Mooncake: 23,608 in an hour]
    #[arg(long, default_value_t = 300)]
    pub requests: usize,
    /// Tokens per hash id; replay with the same `bench serve --block-size` [Mooncake: 512]
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Mean prompt tokens [Mooncake: ~7,590]
    #[arg(long, default_value_t = 384)]
    pub input_len: usize,
    /// Prompt lengths uniform in [len * (1 - r), len * (1 + r)], 0 <= r < 1.
    #[arg(long, default_value_t = 0.5)]
    pub input_range_ratio: f64,
    /// Mean output tokens (max_tokens) [Mooncake: ~182, 1/42 of the input]
    #[arg(long, default_value_t = 9)]
    pub output_len: usize,
    /// Output lengths uniform in [len * (1 - r), len * (1 + r)], 0 <= r < 1.
    #[arg(long, default_value_t = 0.5)]
    pub output_range_ratio: f64,
    /// Share of each prompt's blocks that are a shared prefix's, 0 to 1 [Mooncake: ~50% of
    /// blocks reusable]
    #[arg(long, default_value_t = 0.5)]
    pub shared_fraction: f64,
    /// Distinct shared prefixes (system prompts, documents).
    #[arg(long, default_value_t = 16)]
    pub prefixes: usize,
    /// Zipf exponent of the prefixes' popularity (0: uniform).
    #[arg(long, default_value_t = 1.0)]
    pub zipf: f64,
    /// Mean requests/s of the Poisson arrivals [Mooncake: ~6.6]
    #[arg(long, default_value_t = 10.0)]
    pub rate: f64,
    /// Seeds every draw: the same seed writes the same trace.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Generates the trace, writes it and prints what it holds.
pub fn run(args: TraceGenArgs) -> anyhow::Result<()> {
    let params = PrefixTraceParams {
        requests: args.requests,
        block_size: args.block_size,
        input_len: args.input_len,
        input_range_ratio: args.input_range_ratio,
        output_len: args.output_len,
        output_range_ratio: args.output_range_ratio,
        shared_fraction: args.shared_fraction,
        prefixes: args.prefixes,
        zipf: args.zipf,
        rate: args.rate,
    };
    let lines = prefix_trace::generate(&params, args.seed)?;
    if args.out.is_dir() {
        bail!("--out {} is a directory", args.out.display());
    }
    let file = std::fs::File::create(&args.out)
        .with_context(|| format!("cannot write {}", args.out.display()))?;
    prefix_trace::write_jsonl(&lines, std::io::BufWriter::new(file))
        .with_context(|| format!("cannot write {}", args.out.display()))?;
    let s = prefix_trace::stats(&lines);
    note!(
        "wrote {}: {} requests over {:.1} s, mean input {:.0} and output {:.1} tokens, {} blocks \
         of {} tokens, {:.1}% of them named by an earlier request; replay with: rackfill bench \
         serve --dataset trace --dataset-path {} --block-size {}",
        args.out.display(),
        s.requests,
        s.span_s,
        s.mean_input_len,
        s.mean_output_len,
        s.blocks,
        args.block_size,
        s.reusable_fraction * 100.0,
        args.out.display(),
        args.block_size
    );
    Ok(())
}
