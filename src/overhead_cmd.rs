//! `rackfill bench http-overhead`: what the HTTP layer adds over a direct engine call.
//!
//! One engine (the built-in model by default) serves two kinds of callers, alternating every
//! round so machine noise hits both: `--clients` concurrent tasks submitting straight to the
//! engine handle, and the same number of HTTP clients posting `/v1/completions` to the real
//! server on a loopback port. Every request is a short prompt with `max_tokens: 1`, so latency is
//! dominated by per-request overhead rather than compute. Reports latency percentiles of both,
//! the difference at each (the HTTP layer's cost), and requests/s.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use rackfill_engine::{
    EngineConfig, EngineHandle, EpConfig, Event, GenerateRequest, SamplingParams,
};
use rackfill_models::ModelBundle;
use rackfill_server::{AppState, ModelMeta, ServerConfig};
use serde::Serialize;

/// `rackfill bench http-overhead`.
#[derive(Debug, Clone, clap::Args)]
pub struct OverheadArgs {
    /// Model to serve [default: the built-in model]
    #[arg(long)]
    pub model: Option<String>,
    /// Concurrent clients of each kind.
    #[arg(long, default_value_t = 32)]
    pub clients: usize,
    /// Requests per client per round.
    #[arg(long, default_value_t = 10)]
    pub requests: usize,
    /// Timed rounds (each runs both kinds) after one warm-up round.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// EP size of the engine.
    #[arg(long, default_value_t = EpConfig::default().ep_size,
          aliases = crate::flags::EP_SIZE_ALIASES)]
    pub ep_size: usize,
    /// The prompt every request sends.
    #[arg(long, default_value = "Hello, how are you?")]
    pub prompt: String,
    /// Also write the report as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<std::path::PathBuf>,
}

/// Latency summary of one kind of caller, milliseconds.
#[derive(Debug, Clone, Serialize)]
struct Latencies {
    requests: usize,
    requests_per_s: f64,
    mean_ms: f64,
    p50_ms: f64,
    p90_ms: f64,
    p99_ms: f64,
}

#[derive(Debug, Clone, Serialize)]
struct Report {
    model: String,
    clients: usize,
    direct: Latencies,
    http: Latencies,
    added_p50_ms: f64,
    added_p99_ms: f64,
}

/// Runs the comparison.
pub fn run(args: OverheadArgs) -> anyhow::Result<()> {
    if args.clients == 0 || args.requests == 0 || args.rounds == 0 {
        bail!("--clients, --requests and --rounds must be positive");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(compare(args))
}

async fn compare(args: OverheadArgs) -> anyhow::Result<()> {
    let bundle = ModelBundle::load(args.model.as_deref())?;
    let prompt = bundle.tokenizer.encode(&args.prompt, false)?;
    let config = EngineConfig {
        ep: EpConfig {
            ep_size: args.ep_size,
            ..EpConfig::default()
        },
        max_waiting: 4 * args.clients,
        ..EngineConfig::default()
    };
    let engine = EngineHandle::spawn(
        Arc::new(bundle.model),
        Arc::new(bundle.tokenizer),
        bundle.stop_token_ids,
        config,
    )?;
    let meta = ModelMeta {
        name: bundle.name.clone(),
        chat_template: bundle.chat_template,
        generation: bundle.generation,
    };
    let state = AppState::from_engine(
        engine.clone(),
        meta,
        ServerConfig {
            max_concurrent_requests: 4 * args.clients,
            ..ServerConfig::default()
        },
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/v1/completions", listener.local_addr()?);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(rackfill_server::serve(listener, state, async {
        let _ = stop_rx.await;
    }));
    let client = reqwest::Client::new();
    let body = serde_json::json!({
        "model": bundle.name,
        "prompt": args.prompt,
        "max_tokens": 1,
        "temperature": 0,
    });
    let (mut direct, mut http) = (Vec::new(), Vec::new());
    let (mut direct_s, mut http_s) = (0.0, 0.0);
    for round in 0..=args.rounds {
        let (d, ds) = fleet(args.clients, args.requests, || {
            direct_call(&engine, &prompt)
        })
        .await?;
        let (h, hs) = fleet(args.clients, args.requests, || {
            http_call(&client, &url, &body)
        })
        .await?;
        if round > 0 {
            direct.extend(d);
            http.extend(h);
            direct_s += ds;
            http_s += hs;
        }
    }
    let _ = stop_tx.send(());
    server.await??;
    let (direct, http) = (summarise(direct, direct_s), summarise(http, http_s));
    let report = Report {
        model: bundle.name,
        clients: args.clients,
        added_p50_ms: http.p50_ms - direct.p50_ms,
        added_p99_ms: http.p99_ms - direct.p99_ms,
        direct,
        http,
    };
    outln!("| caller | requests | req/s | mean ms | p50 ms | p90 ms | p99 ms |");
    outln!("|:--|--:|--:|--:|--:|--:|--:|");
    for (name, l) in [("direct engine", &report.direct), ("HTTP", &report.http)] {
        outln!(
            "| {name} | {} | {:.0} | {:.2} | {:.2} | {:.2} | {:.2} |",
            l.requests,
            l.requests_per_s,
            l.mean_ms,
            l.p50_ms,
            l.p90_ms,
            l.p99_ms
        );
    }
    outln!(
        "HTTP layer adds {:.2} ms at p50 and {:.2} ms at p99 ({} concurrent clients)",
        report.added_p50_ms,
        report.added_p99_ms,
        report.clients
    );
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

/// `clients` concurrent tasks each making `requests` calls; returns every latency and the
/// wall time of the whole fleet.
async fn fleet<F, Fut>(
    clients: usize,
    requests: usize,
    call: F,
) -> anyhow::Result<(Vec<Duration>, f64)>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(clients);
    for _ in 0..clients {
        let calls: Vec<Fut> = (0..requests).map(|_| call()).collect();
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::with_capacity(calls.len());
            for c in calls {
                let t = Instant::now();
                c.await?;
                latencies.push(t.elapsed());
            }
            anyhow::Ok(latencies)
        }));
    }
    let mut all = Vec::with_capacity(clients * requests);
    for task in tasks {
        all.extend(task.await??);
    }
    Ok((all, started.elapsed().as_secs_f64()))
}

fn direct_call(
    engine: &EngineHandle,
    prompt: &[u32],
) -> impl std::future::Future<Output = anyhow::Result<()>> + Send + 'static {
    let engine = engine.clone();
    let prompt = prompt.to_vec();
    async move {
        let params = SamplingParams {
            max_tokens: 1,
            temperature: 0.0,
            ..SamplingParams::default()
        };
        let mut stream = engine.submit(GenerateRequest { prompt, params })?;
        while let Some(event) = stream.events.recv().await {
            match event {
                Event::Finished(_) => return Ok(()),
                Event::Error(e) => bail!("engine error: {e}"),
                _ => {}
            }
        }
        bail!("the engine closed the stream early")
    }
}

fn http_call(
    client: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
) -> impl std::future::Future<Output = anyhow::Result<()>> + Send + 'static {
    let request = client.post(url).json(body);
    async move {
        let response = request.send().await?;
        let status = response.status();
        let text = response.text().await?;
        if !status.is_success() {
            bail!("HTTP {status}: {text}");
        }
        Ok(())
    }
}

fn summarise(mut latencies: Vec<Duration>, seconds: f64) -> Latencies {
    latencies.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let pct = |p: f64| {
        let i = ((latencies.len() as f64 - 1.0) * p).round() as usize;
        latencies.get(i).map_or(f64::NAN, |&d| ms(d))
    };
    let n = latencies.len();
    Latencies {
        requests: n,
        requests_per_s: n as f64 / seconds.max(f64::MIN_POSITIVE),
        mean_ms: latencies.iter().map(|&d| ms(d)).sum::<f64>() / n.max(1) as f64,
        p50_ms: pct(0.5),
        p90_ms: pct(0.9),
        p99_ms: pct(0.99),
    }
}
