//! `rackfill bench serve`: load-test any OpenAI-compatible endpoint with a request dataset and
//! report vLLM's serving metrics (see [`rackfill_bench::serve`], which does the work; this file
//! parses flags, prints and writes files).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context as _};
use rackfill_bench::serve::arrivals::{Arrivals, RequestRate};
use rackfill_bench::serve::client::Api;
use rackfill_bench::serve::dataset::{
    self, EvalParams, MultiTurnParams, RandomParams, ShareGptParams, Synthesis,
};
use rackfill_bench::serve::plots::{write_plots, PlotFormat};
use rackfill_bench::serve::remote_decode::{peak_held_bytes, RemoteDecode, RemoteDecodeSummary};
use rackfill_bench::serve::report::ReportOptions;
use rackfill_bench::serve::runner::{warmup, RunOptions, Target, TargetConfig};
use rackfill_bench::serve::table::{format_sweep, format_table};
use rackfill_bench::serve::{run_sweep, RateReport, ServeBenchError, SweepPlan, Workload};

/// Dataset kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DatasetKind {
    /// Random token ids (completions) or words (chat) of --random-input-len.
    Random,
    /// ShareGPT JSON (--dataset-path): first human turn and the gpt reply's length.
    Sharegpt,
    /// JSONL trace (--dataset-path): timestamp ms, input_length, output_length, hash_ids.
    Trace,
    /// Conversations (--num-prompts of them) whose every turn resends the whole conversation:
    /// a shared system prompt, earlier turns and replies, a new user message (/v1/completions).
    MultiTurn,
    /// Evaluation-harness scoring: --num-prompts contexts, each with --eval-continuations
    /// continuations sent with echo, logprobs 1 and max_tokens 0 (/v1/completions).
    Eval,
}

impl DatasetKind {
    /// The name reported as `dataset`.
    fn name(self) -> &'static str {
        match self {
            Self::Random => "random",
            Self::Sharegpt => "sharegpt",
            Self::Trace => "trace",
            Self::MultiTurn => "multi-turn",
            Self::Eval => "eval",
        }
    }
}

/// Plot image formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PlotFormatArg {
    Png,
    Svg,
}

/// `rackfill bench serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeBenchArgs {
    /// Server to load: scheme, host and port, without /v1.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub base_url: String,
    /// API path: /v1/completions or /v1/chat/completions.
    #[arg(long, default_value = "/v1/completions")]
    pub endpoint: String,
    /// Model sent with every request [default: the first id GET /v1/models lists]
    #[arg(long)]
    pub model: Option<String>,
    /// Bearer token [default: $OPENAI_API_KEY]
    #[arg(long)]
    pub api_key: Option<String>,
    /// Where requests come from.
    #[arg(long, value_enum, default_value_t = DatasetKind::Random, alias = "dataset-name")]
    pub dataset: DatasetKind,
    /// ShareGPT JSON or JSONL trace file.
    #[arg(long, value_name = "FILE")]
    pub dataset_path: Option<PathBuf>,
    /// Requests to send [default: 1000; a trace: all of its lines; multi-turn: conversations;
    /// eval: contexts]
    #[arg(long)]
    pub num_prompts: Option<usize>,
    /// Random dataset: prompt tokens.
    #[arg(long, default_value_t = 1024)]
    pub random_input_len: usize,
    /// Random dataset: max_tokens.
    #[arg(long, default_value_t = 128)]
    pub random_output_len: usize,
    /// Random dataset: lengths uniform in [len * (1 - r), len * (1 + r)], 0 <= r < 1.
    #[arg(long, default_value_t = 0.0)]
    pub random_range_ratio: f64,
    /// ShareGPT: fixed max_tokens instead of the reply's length.
    #[arg(long)]
    pub sharegpt_output_len: Option<usize>,
    /// Tokenizer counting ShareGPT lengths exactly: rackfill-tiny-moe, a tokenizer.json, or a
    /// checkpoint directory / HF id holding one [default: ~4 characters per token]
    #[arg(long)]
    pub tokenizer: Option<String>,
    /// Synthetic token ids are drawn from [0, N) [default: the tokenizer's vocabulary, else 4096]
    #[arg(long, value_name = "N")]
    pub vocab_size: Option<u32>,
    /// Multi-turn: tokens of the system prompt every conversation opens with.
    #[arg(long, default_value_t = 512)]
    pub multi_turn_system_len: usize,
    /// Multi-turn: tokens of each turn's new user message.
    #[arg(long, default_value_t = 128)]
    pub multi_turn_user_len: usize,
    /// Multi-turn: turns (requests) per conversation.
    #[arg(long, default_value_t = 5)]
    pub multi_turn_turns: usize,
    /// Multi-turn: max_tokens of each turn.
    #[arg(long, default_value_t = 64)]
    pub multi_turn_output_len: usize,
    /// Eval: tokens of each context.
    #[arg(long, default_value_t = 512)]
    pub eval_context_len: usize,
    /// Eval: continuations scored per context (one request each).
    #[arg(long, default_value_t = 4)]
    pub eval_continuations: usize,
    /// Eval: tokens of each continuation.
    #[arg(long, default_value_t = 16)]
    pub eval_continuation_len: usize,
    /// Trace: tokens per hash_ids block (Mooncake traces use 512).
    #[arg(long, default_value_t = dataset::DEFAULT_BLOCK_SIZE)]
    pub block_size: usize,
    /// Trace: replay this many times faster than recorded [default: 1]
    #[arg(long)]
    pub trace_speedup: Option<f64>,
    /// Trace: ignore the timestamps and send at --request-rate instead.
    #[arg(long)]
    pub retime: bool,
    /// Requests/s (Poisson, or gamma with --burstiness) or inf; a comma-separated list sweeps,
    /// one full run per rate [default: inf]
    #[arg(long, value_delimiter = ',', value_name = "RATE[,RATE...]")]
    pub request_rate: Vec<RequestRate>,
    /// Gamma shape of the arrival gaps: 1 is Poisson, below 1 burstier, above more regular
    /// [default: 1]
    #[arg(long)]
    pub burstiness: Option<f64>,
    /// At most this many requests in flight.
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Stop sending after this many seconds (requests in flight still finish and count).
    #[arg(long, value_name = "SECONDS")]
    pub duration: Option<f64>,
    /// Seeds the dataset and the arrival process.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Send ignore_eos: true so every request generates exactly max_tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Sampling temperature of every request.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Percentiles reported besides mean and median, comma-separated.
    #[arg(
        long,
        alias = "metric-percentiles",
        value_delimiter = ',',
        default_value = "90,99"
    )]
    pub percentiles: Vec<f64>,
    /// Write the summary as JSON (one object; a list of objects for a rate sweep).
    #[arg(long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Add per-request arrays (ttfts, itls, input_lens, output_lens, errors, ...) to --output.
    #[arg(long)]
    pub save_detailed: bool,
    /// Write PREFIX-ttft-vs-rps and PREFIX-ttft-cdf charts.
    #[arg(long, value_name = "PREFIX")]
    pub plot_prefix: Option<PathBuf>,
    /// Chart image format.
    #[arg(long, value_enum, default_value_t = PlotFormatArg::Png)]
    pub plot_format: PlotFormatArg,
    /// No progress bar (it is also hidden when stderr is not a terminal).
    #[arg(long)]
    pub no_progress: bool,
    /// Skip the unmeasured first request that checks the endpoint before the run.
    #[arg(long)]
    pub no_warmup: bool,
    /// Play the decode tier of disaggregated prefill: every request asks for its KV
    /// (kv_transfer_params.do_remote_decode, a server started with --kv-export), which is pulled
    /// over NIXL as a vLLM decode instance does (needs the nixl wheel); reports what was pulled
    /// and the peak KV the server held waiting.
    #[arg(long)]
    pub remote_decode: bool,
    /// Seconds after each response before its KV is pulled (a decode tier that picks requests
    /// up late; the server holds their blocks meanwhile).
    #[arg(long, default_value_t = 0.0, requires = "remote_decode")]
    pub remote_decode_delay: f64,
    /// Seconds one request may take, connection to end of stream.
    #[arg(long, default_value_t = 3600.0, value_name = "SECONDS")]
    pub request_timeout: f64,
}

/// Longest `--duration` or `--request-timeout`: about 31 years, far from where adding it to
/// the clock could overflow.
const MAX_SECONDS: f64 = 1e9;

fn seconds(flag: &str, value: f64) -> anyhow::Result<Duration> {
    if !(value.is_finite() && value > 0.0) {
        bail!("{flag} must be a positive number of seconds, got {value}");
    }
    if value > MAX_SECONDS {
        bail!("{flag} must be at most {MAX_SECONDS:e} seconds, got {value}");
    }
    Ok(Duration::from_secs_f64(value))
}

/// Runs the benchmark: flags checked and files named before anything is sent, then the sweep,
/// then the tables and files.
pub fn run(args: ServeBenchArgs) -> anyhow::Result<()> {
    let arrivals = arrivals(&args)?;
    let duration = args
        .duration
        .map(|d| seconds("--duration", d))
        .transpose()?;
    let request_timeout = seconds("--request-timeout", args.request_timeout)?;
    let tokenizer = args
        .tokenizer
        .as_deref()
        .map(dataset::load_tokenizer)
        .transpose()?;
    let workload = workload(&args, tokenizer.as_ref())?;
    if let Some(api) = Api::of_endpoint(&args.endpoint) {
        workload.check_api(api)?;
    }
    let config = target_config(&args, tokenizer.as_ref(), request_timeout)?;
    // Raised by the first Ctrl-C of the run (see `run_sweep_interruptible`).
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    let plan = sweep_plan(&args, arrivals, duration, stop_rx);
    plan.check(&workload)?;
    let outputs = Outputs::check(&args)?;
    let (reports, pulled) = run_sweep_interruptible(&args, config, &workload, &plan, stop)?;
    let interrupted = plan.run.stopped();
    print_reports(&reports);
    if let Some(pulled) = &pulled {
        print_remote_decode(pulled);
    }
    outputs.write(&reports)?;
    if interrupted {
        use std::io::Write as _;
        let _ = std::io::stdout().flush();
        note!("bench serve: interrupted; the results above cover the requests sent before it");
        std::process::exit(130);
    }
    if reports.iter().all(|r| r.summary.completed == 0) {
        let first = reports
            .iter()
            .flat_map(|r| r.summary.error_samples.first())
            .next()
            .map_or("none recorded".to_string(), |s| s.message.clone());
        bail!("no request succeeded; first error: {first}");
    }
    Ok(())
}

/// The endpoint, credentials and request settings; synthetic token ids come from `--vocab-size`,
/// else the tokenizer's vocabulary, else the default.
fn target_config(
    args: &ServeBenchArgs,
    tokenizer: Option<&rackfill_models::Tokenizer>,
    request_timeout: Duration,
) -> anyhow::Result<TargetConfig> {
    let vocab_size = match (args.vocab_size, tokenizer) {
        (Some(0), _) => bail!("--vocab-size must be at least 1"),
        (Some(n), _) => n,
        (None, Some(t)) => u32::try_from(t.vocab_size()).unwrap_or(u32::MAX),
        (None, None) => dataset::DEFAULT_VOCAB_SIZE,
    };
    Ok(TargetConfig {
        base_url: args.base_url.clone(),
        endpoint: args.endpoint.clone(),
        model: args.model.clone(),
        api_key: args.api_key.clone().or_else(|| {
            std::env::var("OPENAI_API_KEY")
                .ok()
                .filter(|k| !k.is_empty())
        }),
        request_timeout,
        ignore_eos: args.ignore_eos,
        temperature: args.temperature,
        synthesis: Synthesis {
            vocab_size,
            block_size: args.block_size,
            seed: args.seed,
        },
        remote_decode: args
            .remote_decode
            .then(|| {
                let delay = match args.remote_decode_delay {
                    0.0 => Duration::ZERO,
                    delay => seconds("--remote-decode-delay", delay)?,
                };
                anyhow::Ok(RemoteDecode::new(delay)?)
            })
            .transpose()?,
    })
}

/// The sweep over `arrivals` with the run limits and report options; `stop` ends it early.
fn sweep_plan(
    args: &ServeBenchArgs,
    arrivals: Vec<Arrivals>,
    duration: Option<Duration>,
    stop: tokio::sync::watch::Receiver<bool>,
) -> SweepPlan {
    SweepPlan {
        arrivals,
        seed: args.seed,
        // Sent by `run_sweep_interruptible` before anything is printed, so a bad target fails
        // with one line.
        warmup: false,
        run: RunOptions {
            max_concurrency: args.max_concurrency,
            duration,
            progress: !args.no_progress,
            label: String::new(),
            stop: Some(stop),
        },
        report: ReportOptions {
            percentiles: args.percentiles.clone(),
            detailed: args.save_detailed,
        },
    }
}

/// Connects, sends the warm-up request and runs the sweep. From the first request on, the first
/// Ctrl-C raises `stop`: nothing more is sent, the requests in flight finish, and the runs so
/// far are returned. A second Ctrl-C quits at once.
fn run_sweep_interruptible(
    args: &ServeBenchArgs,
    config: TargetConfig,
    workload: &Workload,
    plan: &SweepPlan,
    stop: tokio::sync::watch::Sender<bool>,
) -> anyhow::Result<(Vec<RateReport>, Option<RemoteDecodeSummary>)> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let decode = config.remote_decode.clone();
    let reports = runtime.block_on(async {
        let target = Target::connect(config).await?;
        if !args.no_warmup {
            warmup(&target, &workload.requests[0]).await?;
        }
        note!(
            "bench serve: {} requests ({}) to {}{} model {}",
            workload.requests.len(),
            workload.dataset,
            args.base_url.trim_end_matches('/'),
            args.endpoint,
            target.model()
        );
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_err() {
                return;
            }
            note!(
                "bench serve: interrupted: sending no more requests, waiting for those in \
                 flight (Ctrl-C again to quit now)"
            );
            let _ = stop.send(true);
            if tokio::signal::ctrl_c().await.is_ok() {
                std::process::exit(130);
            }
        });
        let reports = run_sweep(&target, workload, plan).await?;
        let pulled = match &decode {
            Some(decode) => Some(remote_decode_summary(decode, &args.base_url).await),
            None => None,
        };
        Ok::<_, ServeBenchError>((reports, pulled))
    })?;
    Ok(reports)
}

/// Waits for the decode side's pulls, and reads the server's peak of KV held waiting.
async fn remote_decode_summary(decode: &RemoteDecode, base_url: &str) -> RemoteDecodeSummary {
    let mut summary = decode.finish().await;
    let url = format!("{}/metrics", base_url.trim_end_matches('/'));
    if let Ok(response) = reqwest::get(url).await {
        if let Ok(text) = response.text().await {
            summary.server_peak_held_bytes = peak_held_bytes(&text);
        }
    }
    summary
}

/// The decode side's line.
fn print_remote_decode(summary: &RemoteDecodeSummary) {
    let peak = summary.server_peak_held_bytes.map_or(
        "unknown (no rackfill:kv_export_peak_held_bytes)".into(),
        |b| format!("{:.2} MB", b / 1e6),
    );
    out!(
        "\nRemote decode: {} pulled, {} failed; {:.2} MB at {:.2} GB/s (READ); mean pickup \
         {:.1} ms; the server's peak KV held for pickup: {peak}",
        summary.pulled,
        summary.failed,
        summary.bytes as f64 / 1e6,
        summary.read_gbps,
        summary.mean_pickup_ms
    );
    if let Some(error) = &summary.first_error {
        out!("first pull error: {error}");
    }
}

/// One table per run, then the sweep's table when there were several.
fn print_reports(reports: &[RateReport]) {
    for report in reports {
        out!("{}", format_table(&report.summary));
    }
    if reports.len() > 1 {
        let summaries: Vec<_> = reports.iter().map(|r| r.summary.clone()).collect();
        out!("\n{}", format_sweep(&summaries));
    }
}

/// The files a run writes, checked before it starts (which may take hours).
struct Outputs<'a> {
    json: Option<&'a Path>,
    plots: Option<(&'a Path, PlotFormat)>,
}

impl<'a> Outputs<'a> {
    fn check(args: &'a ServeBenchArgs) -> anyhow::Result<Self> {
        if let Some(path) = &args.output {
            if path.is_dir() {
                bail!("--output {} is a directory", path.display());
            }
            existing_parent("--output", path, path)?;
        }
        let plots = args.plot_prefix.as_deref().map(|prefix| {
            let format = match args.plot_format {
                PlotFormatArg::Png => PlotFormat::Png,
                PlotFormatArg::Svg => PlotFormat::Svg,
            };
            (prefix, format)
        });
        if let Some((prefix, _)) = plots {
            let mut chart = prefix.as_os_str().to_owned();
            chart.push("-ttft-cdf");
            existing_parent("--plot-prefix", prefix, Path::new(&chart))?;
        }
        Ok(Self {
            json: args.output.as_deref(),
            plots,
        })
    }

    /// `--output`: one summary object, or a list of them for a sweep; `--plot-prefix`: charts.
    fn write(&self, reports: &[RateReport]) -> anyhow::Result<()> {
        if let Some(path) = self.json {
            let json = match reports {
                [one] => serde_json::to_string_pretty(&one.summary),
                many => serde_json::to_string_pretty(
                    &many.iter().map(|r| &r.summary).collect::<Vec<_>>(),
                ),
            }?;
            std::fs::write(path, json + "\n")
                .with_context(|| format!("cannot write {}", path.display()))?;
            note!("wrote {}", path.display());
        }
        if let Some((prefix, format)) = self.plots {
            for path in write_plots(prefix, format, reports)? {
                note!("wrote {}", path.display());
            }
        }
        Ok(())
    }
}

/// Refuses `value` of `flag` when the directory of `file`, a file it names, does not exist.
fn existing_parent(flag: &str, value: &Path, file: &Path) -> anyhow::Result<()> {
    let parent = match file.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if !parent.is_dir() {
        bail!(
            "{flag} {}: the directory {} does not exist",
            value.display(),
            parent.display()
        );
    }
    Ok(())
}

fn arrivals(args: &ServeBenchArgs) -> anyhow::Result<Vec<Arrivals>> {
    let replay = args.dataset == DatasetKind::Trace && !args.retime;
    if args.retime && args.dataset != DatasetKind::Trace {
        bail!("--retime applies to --dataset trace only");
    }
    if args.trace_speedup.is_some() && !replay {
        bail!(
            "--trace-speedup applies to a trace replayed at its timestamps (--dataset trace \
             without --retime)"
        );
    }
    if replay {
        if !args.request_rate.is_empty() || args.burstiness.is_some() {
            bail!(
                "a trace is replayed at its timestamps; add --retime to send it at --request-rate"
            );
        }
        return Ok(vec![Arrivals::Replay {
            speedup: args.trace_speedup.unwrap_or(1.0),
        }]);
    }
    let burstiness = args.burstiness.unwrap_or(1.0);
    let rates = if args.request_rate.is_empty() {
        vec![RequestRate::Infinite]
    } else {
        args.request_rate.clone()
    };
    Ok(rates
        .into_iter()
        .map(|rate| Arrivals::Rate { rate, burstiness })
        .collect())
}

fn workload(
    args: &ServeBenchArgs,
    tokenizer: Option<&rackfill_models::Tokenizer>,
) -> anyhow::Result<Workload> {
    let path = || {
        args.dataset_path
            .as_deref()
            .context("--dataset sharegpt and --dataset trace need --dataset-path FILE")
    };
    let file_based = matches!(args.dataset, DatasetKind::Sharegpt | DatasetKind::Trace);
    if !file_based && args.dataset_path.is_some() {
        bail!(
            "--dataset-path is for --dataset sharegpt or trace, not {}",
            args.dataset.name()
        );
    }
    let n = args.num_prompts.unwrap_or(1000);
    let requests = match args.dataset {
        DatasetKind::Random => {
            let params = RandomParams {
                input_len: args.random_input_len,
                output_len: args.random_output_len,
                range_ratio: args.random_range_ratio,
            };
            dataset::random(&params, n, args.seed)?
        }
        DatasetKind::Sharegpt => {
            let params = ShareGptParams {
                tokenizer,
                output_len: args.sharegpt_output_len,
            };
            let requests = dataset::load_sharegpt(path()?, params, n, args.seed)?;
            if requests.len() < n {
                note!(
                    "bench serve: only {} conversations pass the length filter ({n} requested)",
                    requests.len()
                );
            }
            requests
        }
        DatasetKind::Trace => dataset::load_trace(path()?, args.block_size, args.num_prompts)?,
        DatasetKind::MultiTurn => {
            let params = MultiTurnParams {
                system_len: args.multi_turn_system_len,
                user_len: args.multi_turn_user_len,
                turns: args.multi_turn_turns,
                output_len: args.multi_turn_output_len,
            };
            dataset::multi_turn(&params, n)?
        }
        DatasetKind::Eval => {
            let params = EvalParams {
                context_len: args.eval_context_len,
                continuations: args.eval_continuations,
                continuation_len: args.eval_continuation_len,
            };
            dataset::eval(&params, n)?
        }
    };
    let mut workload = Workload::new(requests, args.dataset.name());
    workload.tokenizer_id = args.tokenizer.clone();
    Ok(workload)
}
