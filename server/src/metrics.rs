//! Prometheus exposition: the process-wide recorder (installed once, shared by every server in
//! the process), vLLM-style buckets, and the server's own metric names.

use std::sync::OnceLock;
use std::time::Duration;

use metrics::{describe_counter, describe_gauge, describe_histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use rackfill_engine::metrics as engine;

/// HTTP requests answered, by `method`, `route` and `status`.
pub const HTTP_REQUESTS: &str = "rackfill:http_requests_total";
/// Time from a request's arrival to the end of its response body (a stream's last event), by
/// `method` and `route`.
pub const HTTP_DURATION: &str = "rackfill:http_request_duration_seconds";
/// HTTP requests being handled, until their response body is done (a stream's last event) or
/// the client went away (`rackfill:num_requests_running` counts sequences in the engine).
pub const HTTP_IN_FLIGHT: &str = "rackfill:http_requests_in_flight";
/// Client connections open now (at most `--max-connections`; more wait in the listen backlog).
pub const HTTP_CONNECTIONS_OPEN: &str = "rackfill:http_connections_open";
/// Bytes of request bodies held in memory now: read from clients and not yet taken by a
/// handler (bodies still arriving included).
pub const HTTP_BODY_BYTES_BUFFERED: &str = "rackfill:http_body_bytes_buffered";
/// Time from a generation request's arrival to its first output (token, prompt logprobs or the
/// end of a `max_tokens: 0` request).
pub const TTFT: &str = "rackfill:time_to_first_token_seconds";
/// Time from a generation request's arrival to its last output.
pub const E2E: &str = "rackfill:e2e_request_latency_seconds";
/// Time a sequence waited in the engine before its first step.
pub const QUEUE_TIME: &str = "rackfill:request_queue_time_seconds";
/// Generation requests finished, by `finished_reason` (`stop`, `length`, `error`, `abort`).
pub const REQUEST_SUCCESS: &str = "rackfill:request_success_total";
/// Prompt tokens processed.
pub const PROMPT_TOKENS: &str = "rackfill:prompt_tokens_total";
/// Tokens generated.
pub const GENERATION_TOKENS: &str = "rackfill:generation_tokens_total";
/// Requests refused by admission control (429).
pub const REJECTED: &str = "rackfill:requests_rejected_total";

/// vLLM's `time_to_first_token_seconds` buckets.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's request-latency buckets (e2e and queue time).
const LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
/// HTTP durations: sub-millisecond resolution for the overhead of small requests.
const HTTP_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
];
const IMBALANCE_BUCKETS: &[f64] = &[
    1.0, 1.02, 1.05, 1.1, 1.2, 1.3, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 16.0,
];
const SOLVE_US_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0,
];
const PHASE_BUCKETS: &[f64] = &[
    1e-6, 1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];
const STEP_TOKEN_BUCKETS: &[f64] = &[
    1.0, 8.0, 32.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 65536.0,
];

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Installs the Prometheus recorder as the process's `metrics` recorder (once; later calls
/// return the same handle) and starts a thread that runs its upkeep every 5 s. `None` when
/// another recorder was installed first: `/metrics` then renders nothing.
pub fn install() -> Option<PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let handle = builder().ok()?.install_recorder().ok()?;
            describe();
            engine::describe();
            let upkeep = handle.clone();
            let _ = std::thread::Builder::new()
                .name("rackfill-metrics-upkeep".into())
                .spawn(move || loop {
                    std::thread::sleep(Duration::from_secs(5));
                    upkeep.run_upkeep();
                });
            Some(handle)
        })
        .clone()
}

/// The server metrics' `# HELP` texts.
fn describe() {
    describe_counter!(
        HTTP_REQUESTS,
        "HTTP requests answered, by method, route and status."
    );
    describe_histogram!(
        HTTP_DURATION,
        "Time from a request's arrival to the end of its response body, seconds."
    );
    describe_gauge!(
        HTTP_IN_FLIGHT,
        "HTTP requests being handled, until their response body is done."
    );
    describe_gauge!(
        HTTP_CONNECTIONS_OPEN,
        "Client connections open now (at most --max-connections)."
    );
    describe_gauge!(
        HTTP_BODY_BYTES_BUFFERED,
        "Bytes of request bodies held in memory: received and not yet taken by a handler."
    );
    describe_histogram!(
        TTFT,
        "Time from a generation request's arrival to its first output, seconds."
    );
    describe_histogram!(
        E2E,
        "Time from a generation request's arrival to its last output, seconds."
    );
    describe_histogram!(
        QUEUE_TIME,
        "Time a sequence waited in the engine before its first step, seconds."
    );
    describe_counter!(
        REQUEST_SUCCESS,
        "Generation requests finished, by finished_reason (stop, length, error, abort)."
    );
    describe_counter!(PROMPT_TOKENS, "Prompt tokens processed.");
    describe_counter!(GENERATION_TOKENS, "Tokens generated.");
    describe_counter!(REJECTED, "Requests refused by admission control (429).");
}

fn builder() -> Result<PrometheusBuilder, metrics_exporter_prometheus::BuildError> {
    let full = |name: &str| Matcher::Full(name.to_string());
    PrometheusBuilder::new()
        .set_buckets(LATENCY_BUCKETS)?
        .set_buckets_for_metric(full(TTFT), TTFT_BUCKETS)?
        .set_buckets_for_metric(full(E2E), LATENCY_BUCKETS)?
        .set_buckets_for_metric(full(QUEUE_TIME), LATENCY_BUCKETS)?
        .set_buckets_for_metric(full(HTTP_DURATION), HTTP_BUCKETS)?
        .set_buckets_for_metric(full(engine::IMBALANCE_BEFORE), IMBALANCE_BUCKETS)?
        .set_buckets_for_metric(full(engine::IMBALANCE_AFTER), IMBALANCE_BUCKETS)?
        .set_buckets_for_metric(full(engine::SOLVE_US), SOLVE_US_BUCKETS)?
        .set_buckets_for_metric(full(engine::PHASE_SECONDS), PHASE_BUCKETS)?
        .set_buckets_for_metric(full(engine::STEP_TOKENS), STEP_TOKEN_BUCKETS)
}
