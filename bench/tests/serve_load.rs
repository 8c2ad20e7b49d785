//! `rackfill bench serve`'s library against a real rackfill server (the built-in model, EP 2, an
//! ephemeral loopback port): exact output lengths with `ignore_eos`, trace replay timing and
//! prefix sharing, rate sweeps with their plots, and failures counted rather than fatal.

use std::sync::Arc;
use std::time::Duration;

use rackfill_bench::serve::arrivals::{self, Arrivals, RequestRate};
use rackfill_bench::serve::dataset::{self, Prompt, RandomParams, RequestSpec, Synthesis};
use rackfill_bench::serve::plots::{write_plots, PlotFormat};
use rackfill_bench::serve::report::ReportOptions;
use rackfill_bench::serve::runner::{RunOptions, Target, TargetConfig};
use rackfill_bench::serve::{run_sweep, RateReport, ServeBenchError, SweepPlan, Workload};
use rackfill_engine::{EngineConfig, EpConfig, SchedulerConfig};
use rackfill_models::ModelBundle;
use rackfill_server::{AppState, ServerConfig};
use serde_json::Value;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A rackfill server on the built-in model, stopped on drop.
struct Server {
    base: String,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

impl Server {
    async fn start() -> Self {
        Self::start_with(ServerConfig::default()).await
    }

    async fn start_with(config: ServerConfig) -> Self {
        let engine = EngineConfig {
            ep: EpConfig {
                ep_size: 2,
                ..EpConfig::default()
            },
            scheduler: SchedulerConfig {
                chunk_tokens: 512,
                kv_tokens_per_rank: 65_536,
                ..SchedulerConfig::default()
            },
            max_waiting: 256,
            record_routing: None,
            ..EngineConfig::default()
        };
        let bundle = ModelBundle::load(None).expect("built-in model");
        let state = AppState::launch(bundle, engine, config).expect("engine");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(rackfill_server::serve(listener, state, async move {
            let _ = stopped.await;
        }));
        Self {
            base,
            stop: Some(stop),
            task,
        }
    }

    async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let served = tokio::time::timeout(Duration::from_secs(60), &mut self.task).await;
        served.expect("server stops").unwrap().unwrap();
    }
}

fn config(base: &str, endpoint: &str) -> TargetConfig {
    TargetConfig {
        base_url: base.to_string(),
        endpoint: endpoint.to_string(),
        model: None,
        api_key: None,
        request_timeout: Duration::from_secs(120),
        ignore_eos: true,
        temperature: 0.0,
        synthesis: Synthesis {
            vocab_size: 4096,
            block_size: 16,
            seed: 0,
        },
        remote_decode: None,
    }
}

fn plan(arrivals: Vec<Arrivals>) -> SweepPlan {
    SweepPlan {
        arrivals,
        seed: 3,
        warmup: true,
        run: RunOptions::default(),
        report: ReportOptions {
            percentiles: vec![50.0, 90.0, 99.0],
            detailed: true,
        },
    }
}

fn burst() -> Vec<Arrivals> {
    vec![Arrivals::Rate {
        rate: RequestRate::Infinite,
        burstiness: 1.0,
    }]
}

fn random(n: usize, input_len: usize, output_len: usize) -> Workload {
    let params = RandomParams {
        input_len,
        output_len,
        range_ratio: 0.5,
    };
    Workload::new(dataset::random(&params, n, 1).unwrap(), "random")
}

fn one(reports: Vec<RateReport>) -> RateReport {
    assert_eq!(reports.len(), 1);
    reports.into_iter().next().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_requests_with_ignore_eos_generate_exactly_max_tokens() {
    let server = Server::start().await;
    let target = Target::connect(config(&server.base, "/v1/completions"))
        .await
        .unwrap();
    assert_eq!(target.model(), rackfill_models::BUILTIN_MODEL_NAME);
    let workload = random(10, 48, 6);
    // The built-in model never samples its EOS ids, so exact lengths alone would not show that
    // `ignore_eos` is sent: check the body too (and that it is left out when off, for servers
    // that reject unknown fields).
    let body: Value = serde_json::from_slice(&target.body(&workload.requests[0])).unwrap();
    assert_eq!(body["ignore_eos"], true);
    assert_eq!(body["max_tokens"], workload.requests[0].output_len);
    let mut plain = config(&server.base, "/v1/completions");
    plain.ignore_eos = false;
    let plain = Target::connect(plain).await.unwrap();
    let body: Value = serde_json::from_slice(&plain.body(&workload.requests[0])).unwrap();
    assert!(body.get("ignore_eos").is_none(), "{body}");
    let mut plan = plan(burst());
    plan.run.max_concurrency = Some(4);
    let report = one(run_sweep(&target, &workload, &plan).await.unwrap());
    let s = &report.summary;
    assert_eq!(
        (s.completed, s.failed, s.num_prompts),
        (10, 0, 10),
        "{:?}",
        s.error_samples
    );
    assert!(
        s.max_concurrent_requests <= 4,
        "{}",
        s.max_concurrent_requests
    );
    for (record, spec) in report.run.records.iter().zip(workload.requests.iter()) {
        let o = &record.outcome;
        assert_eq!(o.completion_tokens, Some(spec.output_len), "{o:?}");
        assert_eq!(
            o.prompt_tokens,
            Some(spec.input_len),
            "token-id prompts are exact"
        );
        assert!(o.ttft.unwrap() <= o.e2el);
        assert!(o.text_chunks >= 1 && o.text_chunks <= spec.output_len);
        assert_eq!(o.itls.len() + 1, o.text_chunks);
    }
    let expected_out: usize = workload.requests.iter().map(|r| r.output_len).sum();
    let expected_in: usize = workload.requests.iter().map(|r| r.input_len).sum();
    assert_eq!(
        (s.total_output_tokens, s.total_input_tokens),
        (expected_out, expected_in)
    );
    assert!(s.tpot.mean > 0.0 && s.ttft.mean > 0.0 && s.e2el.mean >= s.ttft.mean);
    let json = serde_json::to_value(s).unwrap();
    for key in [
        "completed",
        "failed",
        "duration",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "input_throughput",
        "output_throughput",
        "total_token_throughput",
        "max_concurrency",
        "request_rate",
        "burstiness",
        "mean_ttft_ms",
        "median_ttft_ms",
        "std_ttft_ms",
        "p50_ttft_ms",
        "p90_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "p99_tpot_ms",
        "mean_itl_ms",
        "p90_itl_ms",
        "mean_e2el_ms",
        "p99_e2el_ms",
        "ttfts",
        "itls",
        "input_lens",
        "output_lens",
        "errors",
    ] {
        assert!(json.get(key).is_some(), "{key} missing");
    }
    let lens: Vec<usize> = workload.requests.iter().map(|r| r.output_len).collect();
    assert_eq!(json["output_lens"], serde_json::json!(lens));
    assert_eq!(json["request_rate"], "inf");

    // Chat: the same requests as words through the chat template.
    let chat = Target::connect(config(&server.base, "/v1/chat/completions"))
        .await
        .unwrap();
    let report = one(run_sweep(&chat, &random(4, 24, 5), &plan).await.unwrap());
    assert_eq!(
        report.summary.completed, 4,
        "{:?}",
        report.summary.error_samples
    );
    assert!(report
        .run
        .records
        .iter()
        .all(|r| r.outcome.completion_tokens == Some(r.output_len)));
    assert_eq!(report.summary.backend, "openai-chat");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_replay_honours_timestamps_and_shares_prefixes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.jsonl");
    std::fs::write(
        &path,
        "{\"timestamp\": 1000, \"input_length\": 40, \"output_length\": 2, \"hash_ids\": [1, 2, 3]}\n\
         {\"timestamp\": 1300, \"input_length\": 36, \"output_length\": 3, \"hash_ids\": [1, 2, 4]}\n\
         \n\
         {\"timestamp\": 1600, \"input_length\": 20, \"output_length\": 2, \"hash_ids\": [9]}\n\
         {\"timestamp\": 1700, \"input_length\": 16, \"output_length\": 2}\n",
    )
    .unwrap();
    let requests = dataset::load_trace(&path, 16, None).unwrap();
    assert_eq!(requests.len(), 4);
    let server = Server::start().await;
    let target = Target::connect(config(&server.base, "/v1/completions"))
        .await
        .unwrap();

    // Prefix blocks: the bodies sent share exactly the tokens of their shared hash ids.
    let prompt = |spec: &RequestSpec| -> Vec<u64> {
        let body: Value = serde_json::from_slice(&target.body(spec)).unwrap();
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(body["ignore_eos"], true);
        body["prompt"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect()
    };
    let (a, b, c) = (
        prompt(&requests[0]),
        prompt(&requests[1]),
        prompt(&requests[2]),
    );
    assert_eq!((a.len(), b.len(), c.len()), (40, 36, 20));
    assert_eq!(a[..32], b[..32], "hash ids 1 and 2 are shared");
    assert_ne!(a[32..36], b[32..36], "hash ids 3 and 4 differ");
    assert_ne!(a[..16], c[..16]);

    let workload = Workload::new(requests, "trace");
    let speedup = 2.0;
    let plan = plan(vec![Arrivals::Replay { speedup }]);
    let report = one(run_sweep(&target, &workload, &plan).await.unwrap());
    assert_eq!(
        report.summary.completed, 4,
        "{:?}",
        report.summary.error_samples
    );
    assert_eq!(report.summary.request_rate, None);
    assert_eq!(report.summary.trace_speedup, Some(speedup));
    let expected_ms = [0.0, 150.0, 300.0, 350.0];
    for (record, expected) in report.run.records.iter().zip(expected_ms) {
        let scheduled = record.scheduled.as_secs_f64() * 1000.0;
        assert!(
            (scheduled - expected).abs() < 1e-6,
            "{scheduled} vs {expected}"
        );
        assert!(
            record.sent >= record.scheduled,
            "request {} sent at {:?}, before its time {:?}",
            record.index,
            record.sent,
            record.scheduled
        );
        let spec = &workload.requests[record.index];
        assert_eq!(record.outcome.prompt_tokens, Some(spec.input_len));
        assert_eq!(record.outcome.completion_tokens, Some(spec.output_len));
    }
    // Retimed: the same trace at a rate, its timestamps ignored.
    let rate = Arrivals::Rate {
        rate: RequestRate::PerSecond(100.0),
        burstiness: 1.0,
    };
    let offsets = arrivals::schedule(rate, &workload.requests, 3).unwrap();
    let report = one(run_sweep(&target, &workload, &self::plan(vec![rate]))
        .await
        .unwrap());
    let scheduled: Vec<Duration> = report.run.records.iter().map(|r| r.scheduled).collect();
    assert_eq!(scheduled, offsets);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_sweep_gives_one_result_per_rate_and_its_plots() {
    let server = Server::start().await;
    let target = Target::connect(config(&server.base, "/v1/completions"))
        .await
        .unwrap();
    let rates = [
        RequestRate::PerSecond(20.0),
        RequestRate::PerSecond(50.0),
        RequestRate::Infinite,
    ];
    let mut plan = SweepPlan::rates(&rates, 1.0);
    plan.report.percentiles = vec![99.0];
    let reports = run_sweep(&target, &random(6, 16, 3), &plan).await.unwrap();
    assert_eq!(reports.len(), 3);
    for (report, rate) in reports.iter().zip(rates) {
        assert_eq!(report.summary.request_rate, Some(rate));
        assert_eq!(
            report.summary.completed, 6,
            "{:?}",
            report.summary.error_samples
        );
        assert!(report.summary.detailed.is_none());
    }
    let json =
        serde_json::to_value(reports.iter().map(|r| &r.summary).collect::<Vec<_>>()).unwrap();
    assert_eq!(json.as_array().unwrap().len(), 3);
    assert_eq!(json[0]["request_rate"], 20.0);
    assert!(json[0].get("ttfts").is_none());

    let dir = tempfile::tempdir().unwrap();
    for (format, ext) in [(PlotFormat::Svg, "svg"), (PlotFormat::Png, "png")] {
        let prefix = dir.path().join("sweep");
        let paths = write_plots(&prefix, format, &reports).unwrap();
        let names: Vec<String> = paths
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            [
                format!("sweep-ttft-vs-rps.{ext}"),
                format!("sweep-ttft-cdf.{ext}")
            ]
        );
        for path in &paths {
            assert!(
                std::fs::metadata(path).unwrap().len() > 0,
                "{}",
                path.display()
            );
        }
        if format == PlotFormat::Svg {
            let cdf = std::fs::read_to_string(&paths[1]).unwrap();
            assert!(cdf.contains("rate 20 req/s") && cdf.contains("rate inf req/s"));
        }
    }
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_counted_with_their_error_not_fatal() {
    let server = Server::start().await;
    let target = Target::connect(config(&server.base, "/v1/completions"))
        .await
        .unwrap();
    let spec = |output_len: usize, unique: u64| RequestSpec {
        prompt: Prompt::Synthetic {
            hash_ids: vec![],
            unique,
        },
        input_len: 16,
        output_len,
        timestamp_ms: None,
    };
    // One request asks for more tokens than the context holds.
    let workload = Workload::new(vec![spec(2, 0), spec(1_000_000, 1), spec(2, 2)], "random");
    let report = one(run_sweep(&target, &workload, &plan(burst())).await.unwrap());
    let s = &report.summary;
    assert_eq!((s.completed, s.failed), (2, 1));
    let error = report.run.records[1].outcome.error.as_deref().unwrap();
    assert!(
        error.starts_with("HTTP 400: ") && error.contains("maximum context length"),
        "{error}"
    );
    assert_eq!(s.error_samples.len(), 1);
    assert_eq!(s.error_samples[0].count, 1);
    assert_eq!(s.total_output_tokens, 4);

    // A wrong model: every request fails with the server's message; with the warm-up on, the
    // run stops before it starts, with that message.
    let mut wrong = config(&server.base, "/v1/completions");
    wrong.model = Some("no-such-model".into());
    let wrong = Target::connect(wrong).await.unwrap();
    let mut no_warmup = plan(burst());
    no_warmup.warmup = false;
    let report = one(run_sweep(&wrong, &workload, &no_warmup).await.unwrap());
    assert_eq!((report.summary.completed, report.summary.failed), (0, 3));
    assert!(report.summary.error_samples[0]
        .message
        .contains("does not exist"));
    assert_eq!(report.summary.error_samples[0].count, 3);
    let err = run_sweep(&wrong, &workload, &plan(burst()))
        .await
        .unwrap_err();
    assert!(matches!(err, ServeBenchError::Warmup { .. }), "{err}");
    assert!(err.to_string().contains("does not exist"), "{err}");

    // Not an OpenAI server at that path, and an endpoint that is not a completion API.
    let err = Target::connect(config(
        &format!("{}/not-here", server.base),
        "/v1/completions",
    ))
    .await
    .unwrap_err();
    assert!(
        err.to_string().contains("OpenAI-compatible") && err.to_string().contains("HTTP 404"),
        "{err}"
    );
    let err = Target::connect(config(&server.base, "/v1/embeddings"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("unsupported --endpoint"), "{err}");

    // --duration: nothing is sent after it; what was sent finishes and counts.
    let mut bounded = plan(vec![Arrivals::Rate {
        rate: RequestRate::PerSecond(10.0),
        burstiness: 1.0,
    }]);
    bounded.run.duration = Some(Duration::from_millis(400));
    let many = random(40, 16, 2);
    let offsets = arrivals::schedule(bounded.arrivals[0], &many.requests, bounded.seed).unwrap();
    let before = offsets
        .iter()
        .filter(|t| **t < Duration::from_millis(400))
        .count();
    let report = one(run_sweep(&target, &many, &bounded).await.unwrap());
    let sent = report.summary.num_prompts;
    assert!(
        sent >= 1 && sent <= before && before < 40,
        "{sent} of {before}"
    );
    assert_eq!(report.summary.completed, sent);
    assert!(report
        .run
        .records
        .iter()
        .all(|r| r.scheduled < Duration::from_millis(400)));

    server.shutdown().await;

    // Nobody listening: connecting fails with the reason; without a model lookup or warm-up,
    // every request fails with it instead.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    let err = Target::connect(config(&closed, "/v1/completions"))
        .await
        .unwrap_err();
    assert!(err.to_string().starts_with("cannot reach"), "{err}");
    let mut named = config(&closed, "/v1/completions");
    named.model = Some("m".into());
    let target = Target::connect(named).await.unwrap();
    let report = one(run_sweep(&target, &workload, &no_warmup).await.unwrap());
    assert_eq!(report.summary.failed, 3);
    let message = &report.summary.error_samples[0].message;
    assert!(message.to_lowercase().contains("connect"), "{message}");
}

#[test]
fn bad_plans_are_refused_before_anything_is_sent() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let mut named = config("http://127.0.0.1:9", "/v1/completions");
    named.model = Some("m".into());
    let target = runtime.block_on(Target::connect(named)).unwrap();
    let workload = random(2, 4, 1);
    let cases: Vec<(SweepPlan, &str)> = vec![
        (
            {
                let mut p = plan(burst());
                p.run.max_concurrency = Some(0);
                p
            },
            "--max-concurrency",
        ),
        (
            {
                let mut p = plan(burst());
                p.report.percentiles = vec![0.0];
                p
            },
            "percentiles",
        ),
        (
            {
                let mut p = plan(burst());
                p.run.duration = Some(Duration::ZERO);
                p
            },
            "--duration",
        ),
        (
            plan(vec![Arrivals::Replay { speedup: 1.0 }]),
            "no timestamp",
        ),
        (
            plan(vec![Arrivals::Rate {
                rate: RequestRate::PerSecond(1.0),
                burstiness: -1.0,
            }]),
            "--burstiness",
        ),
    ];
    for (mut plan, expected) in cases {
        plan.warmup = false;
        let err = runtime
            .block_on(run_sweep(&target, &workload, &plan))
            .unwrap_err();
        assert!(err.to_string().contains(expected), "{expected}: {err}");
    }
    let empty = Workload {
        requests: Arc::from(Vec::new()),
        dataset: "random".into(),
        tokenizer_id: None,
    };
    let err = runtime
        .block_on(run_sweep(&target, &empty, &plan(burst())))
        .unwrap_err();
    assert!(err.to_string().contains("no requests"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_key_is_sent_as_a_bearer_token() {
    let server = Server::start_with(ServerConfig {
        api_key: Some("sekret".into()),
        ..ServerConfig::default()
    })
    .await;
    let err = Target::connect(config(&server.base, "/v1/completions"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("HTTP 401"), "{err}");
    let mut keyed = config(&server.base, "/v1/completions");
    keyed.api_key = Some("sekret".into());
    let target = Target::connect(keyed).await.unwrap();
    let report = one(run_sweep(&target, &random(2, 8, 2), &plan(burst()))
        .await
        .unwrap());
    assert_eq!(
        report.summary.completed, 2,
        "{:?}",
        report.summary.error_samples
    );
    server.shutdown().await;
}

#[test]
fn plans_with_arrivals_that_cannot_be_scheduled_fail_their_check() {
    // `check` is what the command runs before connecting: a bad burstiness or speed-up must be
    // refused there, not after the warm-up request.
    let workload = random(2, 4, 1);
    let bursty = plan(vec![Arrivals::Rate {
        rate: RequestRate::PerSecond(1.0),
        burstiness: f64::NAN,
    }]);
    let err = bursty.check(&workload).unwrap_err();
    assert!(err.to_string().contains("--burstiness"), "{err}");
    let untimed = plan(vec![Arrivals::Replay { speedup: 1.0 }]);
    let err = untimed.check(&workload).unwrap_err();
    assert!(err.to_string().contains("no timestamp"), "{err}");
    assert!(plan(burst()).check(&workload).is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_order_trace_lines_are_sent_at_their_own_timestamps() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.jsonl");
    std::fs::write(
        &path,
        "{\"timestamp\": 5800, \"input_length\": 8, \"output_length\": 1}\n\
         {\"timestamp\": 5000, \"input_length\": 8, \"output_length\": 1}\n\
         {\"timestamp\": 5400, \"input_length\": 8, \"output_length\": 1}\n",
    )
    .unwrap();
    let workload = Workload::new(dataset::load_trace(&path, 16, None).unwrap(), "trace");
    let server = Server::start().await;
    let target = Target::connect(config(&server.base, "/v1/completions"))
        .await
        .unwrap();
    let report = one(run_sweep(
        &target,
        &workload,
        &plan(vec![Arrivals::Replay { speedup: 1.0 }]),
    )
    .await
    .unwrap());
    assert_eq!(report.summary.completed, 3);
    let indices: Vec<usize> = report.run.records.iter().map(|r| r.index).collect();
    assert_eq!(indices, [0, 1, 2], "records stay in dataset order");
    for (record, expected_ms) in report.run.records.iter().zip([800u64, 0, 400]) {
        let expected = Duration::from_millis(expected_ms);
        assert_eq!(record.scheduled, expected);
        // Sent at its own time, not held back behind an earlier line with a later timestamp.
        assert!(
            record.sent >= expected && record.sent < expected + Duration::from_millis(250),
            "request {} sent at {:?}, scheduled at {expected:?}",
            record.index,
            record.sent
        );
    }
    server.shutdown().await;
}

/// A one-route HTTP server that answers every request with a 200 `text/event-stream` whose
/// chunked body is `sse`, then ends the body, or with `hold` leaves it open for a minute.
async fn canned_sse(sse: &'static str, hold: bool) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                // Read the headers and the body of one request.
                let mut request = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    let Ok(n) = socket.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    request.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&request).to_ascii_lowercase();
                    if let Some(end) = text.find("\r\n\r\n") {
                        let length = text[..end]
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse::<usize>().ok())
                            .unwrap_or(0);
                        if request.len() >= end + 4 + length {
                            break;
                        }
                    }
                }
                // One response per connection, said so: a client must not put the
                // connection back in its pool and race this task's close with its next request.
                let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                            transfer-encoding: chunked\r\nconnection: close\r\n\r\n";
                let body = format!("{:x}\r\n{sse}\r\n", sse.len());
                let _ = socket.write_all(head.as_bytes()).await;
                let _ = socket.write_all(body.as_bytes()).await;
                if hold {
                    tokio::time::sleep(Duration::from_secs(60)).await;
                } else {
                    let _ = socket.write_all(b"0\r\n\r\n").await;
                }
            });
        }
    });
    base
}

/// A target serving `sse` to every request (see [`canned_sse`]) as model `m`.
async fn canned_target(sse: &'static str, hold: bool) -> Target {
    let base = canned_sse(sse, hold).await;
    let mut config = config(&base, "/v1/completions");
    config.model = Some("m".into());
    config.request_timeout = Duration::from_secs(20);
    Target::connect(config).await.unwrap()
}

/// One chunk of text, then `[DONE]`.
const ONE_CHUNK: &str =
    "data: {\"choices\": [{\"index\": 0, \"text\": \" x\"}]}\n\ndata: [DONE]\n\n";

async fn canned_run(sse: &'static str, hold: bool) -> RateReport {
    let target = canned_target(sse, hold).await;
    let mut plan = plan(burst());
    plan.warmup = false;
    one(run_sweep(&target, &random(2, 4, 3), &plan).await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_without_a_choice_fail() {
    // Nothing but [DONE] (or chunks that are not completions): no output was streamed, which
    // is a failure (vLLM: "never received a valid chunk"), not a completed request.
    for sse in [
        "data: [DONE]\n\n",
        "data: {\"foo\": 1}\n\ndata: {\"foo\": 2}\n\ndata: [DONE]\n\n",
    ] {
        let report = canned_run(sse, false).await;
        assert_eq!((report.summary.completed, report.summary.failed), (0, 2));
        let message = &report.summary.error_samples[0].message;
        assert!(message.contains("no chunk with a choice"), "{message}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_ends_at_done_even_if_the_server_keeps_the_connection_open() {
    // The request ends at [DONE]; it does not wait for its 20 s timeout and fail.
    const HELD: &str = "data: {\"choices\": [{\"index\": 0, \"text\": \" x\"}]}\n\n\
                        data: {\"choices\": [{\"index\": 0, \"text\": \" y\"}]}\n\n\
                        data: [DONE]\n\n";
    let started = std::time::Instant::now();
    let report = canned_run(HELD, true).await;
    assert_eq!(
        report.summary.completed, 2,
        "{:?}",
        report.summary.error_samples
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert!(
        report.summary.e2el.mean < 1000.0,
        "{}",
        report.summary.e2el.mean
    );
    assert_eq!(report.summary.total_output_tokens, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrency_limit_beyond_any_semaphore_is_no_limit() {
    let target = canned_target(ONE_CHUNK, false).await;
    let mut plan = plan(burst());
    plan.warmup = false;
    plan.run.max_concurrency = Some(usize::MAX);
    let report = one(run_sweep(&target, &random(3, 4, 1), &plan).await.unwrap());
    assert_eq!(
        report.summary.completed, 3,
        "{:?}",
        report.summary.error_samples
    );
    assert_eq!(report.summary.max_concurrency, Some(usize::MAX));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn null_choices_are_empty_and_misshapen_chunks_are_named() {
    // `"choices": null` in a usage chunk is an empty list, not a failure.
    const NULL_CHOICES: &str = "data: {\"choices\": [{\"index\": 0, \"text\": \" x\"}]}\n\n\
         data: {\"choices\": null, \"usage\": {\"prompt_tokens\": 4, \"completion_tokens\": 1}}\n\n\
         data: [DONE]\n\n";
    let report = canned_run(NULL_CHOICES, false).await;
    assert_eq!(
        report.summary.completed, 2,
        "{:?}",
        report.summary.error_samples
    );
    assert_eq!(report.summary.total_output_tokens, 2);

    // JSON of the wrong shape is named as such, not as "not JSON".
    let report = canned_run("data: {\"choices\": 3}\n\ndata: [DONE]\n\n", false).await;
    assert_eq!(report.summary.failed, 2);
    let message = &report.summary.error_samples[0].message;
    assert!(
        message.starts_with("stream event is not an OpenAI completion chunk"),
        "{message}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raised_stop_ends_the_sweep_and_keeps_what_ran() {
    let target = canned_target(ONE_CHUNK, false).await;
    let rate = |r: f64| Arrivals::Rate {
        rate: RequestRate::PerSecond(r),
        burstiness: 1.0,
    };
    let mut plan = plan(vec![rate(20.0), rate(40.0)]);
    plan.warmup = false;
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    plan.run.stop = Some(stop_rx);
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(500)).await;
        stop.send(true).unwrap();
    });
    let started = std::time::Instant::now();
    let reports = run_sweep(&target, &random(200, 4, 1), &plan).await.unwrap();
    // 200 requests at 20/s take 10 s: the stop ends the first rate, and the second never runs.
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    let report = one(reports);
    let sent = report.summary.num_prompts;
    assert!((1..40).contains(&sent), "{sent}");
    assert_eq!(report.summary.completed, sent);
    assert!(report
        .run
        .records
        .iter()
        .all(|r| r.scheduled < Duration::from_millis(800)));
}
