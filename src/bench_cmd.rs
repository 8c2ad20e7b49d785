//! `rackfill bench ...`: benchmark subcommands.
//!
//! `balance` lives in [`crate::balance_cmd`]; the other subcommands are here or in their own
//! modules (`serve_bench_cmd`, `overhead_cmd`).

use crate::balance_cmd::BalanceArgs;
use crate::flags::{
    dedup, help_with_list_default, parse_positive, BALANCER_ALIASES, EP_SIZE_ALIASES,
    REDUNDANT_SLOTS_ALIASES,
};
use crate::report_file::{create_report_file, write_json};
use anyhow::{bail, Context as _};
use rackfill_balancer::Algo;
use rackfill_bench::ep::{check_step, random_prompts, run_ep, EpCase};
use rackfill_bench::forward::synthetic_bench_model;
use rackfill_engine::{EpConfig, Rack};
use rackfill_models::ModelBundle;
use std::path::PathBuf;

/// Benchmarks.
#[derive(Debug, clap::Subcommand)]
pub enum BenchCommand {
    /// Replay routing loads (a `--record-routing` trace, a synthetic multi-layer trace or the
    /// synthetic grid) through every balancer (none, quota, quota-paper, eplb-exact,
    /// eplb-history, greedy-move) and report imbalance, optimality gap, replicas, fan-out, in-flight ratio and
    /// solve time.
    Balance(BalanceArgs),
    /// Prefill tokens/s of the dense single-device forward (the bench shape with seeded random
    /// weights, a real model's shape with --model-shape, or a checkpoint given with --model),
    /// with model FLOP utilisation and time per phase on a GPU.
    Forward(crate::forward_bench_cmd::ForwardArgs),
    /// The EP runtime against the dense path: prefill tokens/s (the EP machinery's overhead on
    /// one host), imbalance before and after, and the cost model's simulated MoE makespan with
    /// each balancer versus no balancing.
    Ep(EpArgs),
    /// Latency the HTTP layer adds over a direct engine call (short prompt, `max_tokens: 1`,
    /// concurrent clients of both kinds against one engine), and requests/s.
    HttpOverhead(crate::overhead_cmd::OverheadArgs),
    /// Load-test any OpenAI-compatible endpoint (random, ShareGPT or timestamped trace
    /// requests; Poisson/gamma arrivals or trace replay; rate sweeps) and report TTFT, TPOT,
    /// ITL, end-to-end latency and throughput under vLLM's field names.
    Serve(crate::serve_bench_cmd::ServeBenchArgs),
    /// Write a synthetic JSONL request trace with the Mooncake trace's prefix-sharing structure
    /// (Zipf-popular shared prefixes, unique tails, Poisson arrivals) for `bench serve --dataset
    /// trace`.
    ServeTrace(crate::trace_gen_cmd::TraceGenArgs),
    /// The fused paged attention kernel against the unfused cuBLAS + softmax + cuBLAS baseline
    /// on one GQA layer's prefill chunks over a cached context (GPU path: a GPU or the host
    /// emulator); both outputs are compared.
    Attention(crate::attention_bench_cmd::AttentionArgs),
}

/// `rackfill bench ep`.
#[derive(Debug, Clone, clap::Args)]
pub struct EpArgs {
    /// Checkpoint directory, HF id, or `rackfill-tiny-moe` (the built-in model)
    /// [default: the bench shape, seeded synthetic weights]
    #[arg(long)]
    pub model: Option<String>,

    /// Prompts, one step: a JSON file with a list of strings (or `{"prompts": [...]}`, the
    /// format of models/builtin/skew.json), tokenized with the model's tokenizer
    /// [default: --sequences random prompts of --tokens tokens]
    #[arg(long, value_name = "FILE")]
    pub prompts: Option<PathBuf>,

    /// Random prompts per step (one per rank at the default EP size); all prompts together hold
    /// at most 65536 tokens.
    #[arg(long, default_value_t = EpConfig::default().ep_size, value_parser = parse_positive)]
    pub sequences: usize,

    /// Tokens per random prompt, at most the model's context.
    #[arg(long, default_value_t = 512, value_parser = parse_positive)]
    pub tokens: usize,

    /// EP sizes to run, comma-separated, each at most the model's routed experts.
    #[arg(long, value_delimiter = ',', value_parser = parse_positive,
          default_values_t = [EpConfig::default().ep_size], aliases = EP_SIZE_ALIASES)]
    pub ep_size: Vec<usize>,

    // Help set below: it shows the default list comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = ep_bench_balancers(),
          hide_default_value = true, aliases = BALANCER_ALIASES,
          help = help_with_list_default(
              "Balancers to run at every EP size, comma-separated: none, quota, quota-paper, \
               eplb-exact, eplb-history, greedy-move",
              &ep_bench_balancers()))]
    pub balancer: Vec<Algo>,

    /// Redundant expert slots per rank.
    #[arg(long, default_value_t = EpConfig::default().redundant_slots,
          aliases = REDUNDANT_SLOTS_ALIASES)]
    pub redundant_slots: usize,

    /// Schedules to run every configuration with, comma-separated: `ultraep` (replicas, then
    /// dispatch and experts), `pipelined` (main experts while the replicas stream), `two-batch`
    /// (each rank's sequences in two micro-batches, one communicating while the other computes),
    /// `overlapped` (both); the names `rackfill simulate --schedule` takes.
    #[arg(long, value_delimiter = ',', default_value = "ultraep",
          value_parser = crate::flags::parse_schedule)]
    pub schedule: Vec<rackfill_engine::Schedule>,

    /// Replica slot memory to run every configuration with, comma-separated: `shared` (one set
    /// for every MoE layer), `per-layer` (each layer keeps its replicas resident between steps,
    /// quota plans moved onto them within 2%).
    #[arg(long, value_delimiter = ',', default_value = "shared",
          value_parser = crate::flags::parse_slot_memory)]
    pub slot_memory: Vec<rackfill_engine::SlotMemory>,

    /// Rack the simulated MoE makespans are costed on: nvl72, or a rack JSON file (the same
    /// racks and cost model as `rackfill simulate`, so the two compare).
    #[arg(long, default_value = "nvl72")]
    pub rack: String,

    /// Timed rounds after one warm-up, at most 1000; every round runs dense and every
    /// configuration.
    #[arg(long, default_value_t = 3, value_parser = crate::flags::parse_repeats)]
    pub rounds: usize,

    /// Seed for the random weights and prompts.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Also write the report as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// What `bench ep` compares by default: the engine's balancer against none.
fn ep_bench_balancers() -> [Algo; 2] {
    [EpConfig::default().balancer, Algo::None]
}

/// Runs a bench subcommand.
pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Balance(args) => crate::balance_cmd::run(args),
        BenchCommand::Forward(args) => crate::forward_bench_cmd::run(args),
        BenchCommand::Ep(args) => ep(args),
        BenchCommand::HttpOverhead(args) => crate::overhead_cmd::run(args),
        BenchCommand::Serve(args) => crate::serve_bench_cmd::run(args),
        BenchCommand::ServeTrace(args) => crate::trace_gen_cmd::run(args),
        BenchCommand::Attention(args) => crate::attention_bench_cmd::run(args),
    }
}

fn ep(args: EpArgs) -> anyhow::Result<()> {
    let rack = Rack::load(&args.rack)?;
    let json_file = create_report_file(args.json.as_deref())?;
    let (model, tokenizer, name) = match args.model.as_deref() {
        None => (
            synthetic_bench_model(args.seed)?,
            None,
            "bench-shape".to_string(),
        ),
        Some(spec) => {
            let bundle = ModelBundle::load(Some(spec))?;
            (bundle.model, Some(bundle.tokenizer), bundle.name)
        }
    };
    let prompts = match &args.prompts {
        Some(path) => {
            let tokenizer =
                tokenizer.context("--prompts needs a model with a tokenizer (give --model)")?;
            let texts = read_prompt_texts(path)?;
            texts
                .iter()
                .map(|t| tokenizer.encode(t, false))
                .collect::<Result<Vec<_>, _>>()?
        }
        None => random_prompts(&model, args.sequences, args.tokens, args.seed)?,
    };
    let mut cases = Vec::new();
    for ep_size in dedup(&args.ep_size) {
        for &balancer in &args.balancer {
            for schedule in dedup(&args.schedule) {
                for slot_memory in dedup(&args.slot_memory) {
                    cases.push(EpCase {
                        ep_size,
                        balancer,
                        schedule,
                        slot_memory,
                    });
                }
            }
        }
    }
    check_step(&model, &prompts, &cases)?;
    note!(
        "bench ep: {name}, {} prompts ({} tokens), {} rounds",
        prompts.len(),
        prompts.iter().map(Vec::len).sum::<usize>(),
        args.rounds
    );
    let report = run_ep(
        std::sync::Arc::new(model),
        &name,
        &prompts,
        &cases,
        args.redundant_slots,
        &rack,
        args.rounds,
    )?;
    out!("{}", report.to_table());
    if let (Some(file), Some(path)) = (json_file, &args.json) {
        write_json(file, path, &report)?;
    }
    Ok(())
}

/// Prompt texts from a JSON list of strings or an object with a `prompts` list.
fn read_prompt_texts(path: &std::path::Path) -> anyhow::Result<Vec<String>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    let list = value.get("prompts").unwrap_or(&value);
    let texts: Vec<String> = serde_json::from_value(list.clone()).with_context(|| {
        format!(
            "{}: expected a list of strings or {{\"prompts\": [...]}}",
            path.display()
        )
    })?;
    if texts.is_empty() || texts.iter().any(|t| t.is_empty()) {
        bail!("{}: prompts must be non-empty strings", path.display());
    }
    Ok(texts)
}
