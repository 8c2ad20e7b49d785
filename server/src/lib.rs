//! rackfill-server: the OpenAI-compatible HTTP API (axum), request validation, admission and
//! Prometheus metrics, talking to the engine through a narrow [`Backend`] trait.
//!
//! # Routes
//!
//! | route | what |
//! | --- | --- |
//! | `POST /v1/completions` | prompts as a string, strings, token ids or lists of token ids; `n`, `stop`, `seed`, `echo`, `logprobs`, `stream` (+ `stream_options.include_usage`); penalties, `logit_bias`, `min_p`, `min_tokens` (README) |
//! | `POST /v1/chat/completions` | system/user/assistant messages through the model's chat template; `logprobs` + `top_logprobs`, `stream` |
//! | `GET /v1/models`, `GET /v1/models/{id}` | the served model (404 `model_not_found` for another id) |
//! | `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info` | vLLM's tokenizer routes (a prompt or chat messages; behind the API key like `/v1/*`) |
//! | `GET /health` | 200 `{"status":"ok"}`, 503 when the engine is down or the server is draining |
//! | `GET /metrics` | Prometheus text: HTTP, latency (vLLM buckets) and the engine's balancing metrics |
//! | `GET /version` | `{"name":"rackfill","version":...}` |
//!
//! # Errors
//!
//! Errors use OpenAI's envelope `{"error": {"message", "type", "param", "code"}}` (see
//! [`ApiError`]). A request is checked in this order: the head alone (401, then 415), the body
//! (413, 408), the route (404, 405), then the handler's checks.
//!
//! | status | `code` | when |
//! | --- | --- | --- |
//! | 401 | `invalid_api_key` | an API key is set and the bearer token is missing or wrong, on anything under `/v1` (unknown routes and methods included) and on `/tokenize`, `/detokenize`, `/tokenizer_info`; answered from the head, the body is never buffered (it is read and thrown away behind the answer, so clients that send it all first still get the 401) |
//! | 415 | `unsupported_media_type` | the request carries a body whose `Content-Type` is not `application/json` (parameters such as `; charset=utf-8` and `application/*+json` are fine) or is absent |
//! | 413 | `payload_too_large` | body over [`ServerConfig::max_body_bytes`] |
//! | 408 | `request_timeout` | body not received within [`ServerConfig::read_timeout`] |
//! | 404 | `not_found`, `model_not_found` | unknown route or model |
//! | 405 | `method_not_allowed` | method not taken by the route (`allow` lists the methods) |
//! | 400 | `invalid_value`, `context_length_exceeded`, ... | malformed JSON, wrong type, out of range (`param` names the field), context overflow (both numbers in the message) |
//! | 429 | `rate_limit_exceeded` | admission limit or engine queue full |
//! | 503 | `service_unavailable` | engine stopped or server draining |
//! | 500 | `internal_error` | the engine failed an accepted request |
//!
//! Every response carries `x-request-id` (the client's, when it sent a sane one).
//!
//! # Transport
//!
//! HTTP/1.1 on hyper: at most [`ServerConfig::max_connections`] connections are served at once
//! (more wait in the kernel's listen backlog); a request head must arrive within
//! [`ServerConfig::read_timeout`]; a connection's read buffer is capped at 64 KiB (hyper's
//! default is about 400 KiB), which bounds what each connection holds while a body streams in
//! (a request head beyond about that size gets 431); a client may shut down its sending side
//! once its request is out and still reads the whole response (half-close). The flip side of
//! half-close: a client that closes its connection while a non-streamed request runs cannot be
//! told from one that only half-closed it, so the request runs to its end before the server
//! finds the socket gone (a stream notices at its next event). `rackfill:http_connections_open`
//! and `rackfill:http_body_bytes_buffered` (see [`metrics`]) show what connections and request
//! bodies hold.
//!
//! # Library use
//!
//! ```no_run
//! use std::sync::Arc;
//! use rackfill_engine::EngineConfig;
//! use rackfill_models::ModelBundle;
//! use rackfill_server::{AppState, ServerConfig};
//!
//! # async fn demo() -> anyhow::Result<()> {
//! let bundle = ModelBundle::load(None)?; // the built-in model
//! let state = AppState::launch(bundle, EngineConfig::default(), ServerConfig::default())?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! // `serve` returns once `shutdown` resolved and in-flight requests drained (or were
//! // cancelled after `shutdown_timeout`); it then shuts the engine down.
//! rackfill_server::serve(listener, state, async { let _ = tokio::signal::ctrl_c().await; })
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! Pieces: [`AppState::launch`] (bundle + engine config -> engine thread -> state),
//! [`AppState::from_engine`] (an already spawned [`EngineHandle`] plus the bundle's
//! [`ModelMeta`]), [`AppState::new`] (any [`Backend`]); [`router`] gives the `axum::Router`
//! (for in-process use without a socket), [`serve`] runs it on a listener with graceful
//! shutdown.

mod api_error;
mod api_types;
mod backend;
mod body;
mod chat;
mod chat_prompt;
mod completions;
mod gate;
mod generate;
mod listen;
pub mod metrics;
mod observe;
mod params;
mod prompt_text;
mod request_json;
mod token_text;
mod tokenize;

use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ::metrics::counter;
use axum::extract::rejection::PathRejection;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::header;
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use rackfill_engine::{EngineConfig, EngineError, EngineHandle};
use rackfill_models::ModelBundle;
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};

pub use api_error::ApiError;
pub use backend::{Backend, ChatRender, EngineBackend, ModelInfo, ModelMeta, SpecialTokenTexts};
pub use completions::MAX_SEQUENCES_PER_REQUEST;
pub use params::MAX_N;

/// The request-id header, echoed or generated on every response.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// HTTP-side settings (the engine has its own [`EngineConfig`]).
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Bearer token required on everything under `/v1` and on vLLM's `/tokenize`,
    /// `/detokenize` and `/tokenizer_info`, checked before the body is read; `None` disables
    /// auth.
    pub api_key: Option<String>,
    /// Generation requests handled at once; more are refused with 429 (default 256).
    pub max_concurrent_requests: usize,
    /// Largest accepted request body; larger ones get 413 (default 4 MiB).
    pub max_body_bytes: usize,
    /// Client connections served at once (default 1024). Beyond it the server stops accepting:
    /// new connections wait in the kernel's listen backlog until one closes (or are refused
    /// by the kernel once the backlog is full), so open connections, their tasks and the
    /// bodies they buffer stay bounded.
    pub max_connections: usize,
    /// How long a client may take to send a request head (request line and headers, counted
    /// from when the connection waits for one, so it also closes idle keep-alive connections),
    /// and again its body once the head is in; a body not finished by then gets 408 (default
    /// 30 s).
    pub read_timeout: Duration,
    /// How long a streamed response may wait for a client that stopped reading before the
    /// request is cancelled and its admission permit freed (default 60 s).
    pub write_timeout: Duration,
    /// How long [`serve`] lets in-flight requests finish after the shutdown signal before
    /// cancelling them (default 30 s).
    pub shutdown_timeout: Duration,
    /// How long, at least, a draining server keeps its listener open answering `/health` and
    /// new generation requests with 503 (at most `shutdown_timeout`), so that a load balancer's
    /// probes take it out before connections are refused (default 0 here; `rackfill serve
    /// --health-grace` defaults to 5 s).
    pub health_grace: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            api_key: None,
            max_concurrent_requests: 256,
            max_body_bytes: 4 << 20,
            max_connections: 1024,
            read_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(60),
            shutdown_timeout: Duration::from_secs(30),
            health_grace: Duration::ZERO,
        }
    }
}

struct Inner {
    backend: Arc<dyn Backend>,
    config: ServerConfig,
    admission: Arc<Semaphore>,
    metrics: Option<PrometheusHandle>,
    draining: AtomicBool,
    /// Why in-flight requests are being aborted, once they are.
    abort: watch::Sender<Option<String>>,
}

/// Everything the handlers share; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

impl AppState {
    /// Serves `backend` with `config`. Installs the process-wide Prometheus recorder on first
    /// use (see [`metrics::install`]).
    pub fn new(backend: Arc<dyn Backend>, config: ServerConfig) -> Self {
        let (abort, _) = watch::channel(None);
        Self {
            inner: Arc::new(Inner {
                admission: Arc::new(Semaphore::new(config.max_concurrent_requests.max(1))),
                backend,
                config,
                metrics: metrics::install(),
                draining: AtomicBool::new(false),
                abort,
            }),
        }
    }

    /// Serves a spawned engine; `meta` is the bundle's name, chat template and generation
    /// defaults.
    pub fn from_engine(engine: EngineHandle, meta: ModelMeta, config: ServerConfig) -> Self {
        Self::new(Arc::new(EngineBackend::new(engine, meta)), config)
    }

    /// Spawns the engine on `bundle` (its weights on the host, or left in the checkpoint for a
    /// device) with `engine` settings and serves it.
    pub fn launch<W: Into<rackfill_engine::ModelWeights>>(
        bundle: ModelBundle<W>,
        engine: EngineConfig,
        config: ServerConfig,
    ) -> Result<Self, EngineError> {
        let ModelBundle {
            name,
            model,
            tokenizer,
            chat_template,
            generation,
            stop_token_ids,
            ..
        } = bundle;
        let handle = EngineHandle::spawn(model, Arc::new(tokenizer), stop_token_ids, engine)?;
        let meta = ModelMeta {
            name,
            chat_template,
            generation,
        };
        Ok(Self::from_engine(handle, meta, config))
    }

    /// The backend requests go to.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.inner.backend
    }

    /// The HTTP settings.
    pub fn config(&self) -> &ServerConfig {
        &self.inner.config
    }

    /// Generation requests being handled now.
    pub fn in_flight(&self) -> usize {
        self.inner.config.max_concurrent_requests.max(1) - self.inner.admission.available_permits()
    }

    /// Whether the server stopped taking new generation requests (shutdown began).
    pub fn is_draining(&self) -> bool {
        self.inner.draining.load(Ordering::Acquire)
    }

    /// Refuses new generation requests from now on (503) and fails `/health`.
    pub fn begin_drain(&self) {
        self.inner.draining.store(true, Ordering::Release);
    }

    /// Cancels every in-flight generation request (each gets a 503 or a final error event).
    pub fn abort_in_flight(&self) {
        self.abort_with("the server is shutting down; the request was cancelled".into());
    }

    /// The engine's group is about to stop because of `why`: refuses new work and answers
    /// every in-flight request with a 503 or a final error event naming the cause.
    pub fn fail_in_flight(&self, why: &str) {
        tracing::error!(
            in_flight = self.in_flight(),
            "{why}: answering in-flight requests"
        );
        self.begin_drain();
        self.abort_with(format!(
            "the engine's group is stopping ({why}); the request was cancelled"
        ));
    }

    /// Aborts in-flight requests with `why`, unless they were aborted already.
    fn abort_with(&self, why: String) {
        self.inner.abort.send_if_modified(|abort| {
            abort.is_none() && {
                *abort = Some(why);
                true
            }
        });
    }

    pub(crate) fn abort_receiver(&self) -> watch::Receiver<Option<String>> {
        self.inner.abort.subscribe()
    }

    pub(crate) fn check_draining(&self) -> Result<(), ApiError> {
        if self.is_draining() {
            return Err(ApiError::Unavailable("the server is shutting down".into()));
        }
        Ok(())
    }

    /// One admission permit, held until the response (or its stream) ends.
    pub(crate) fn admit(&self) -> Result<OwnedSemaphorePermit, ApiError> {
        Arc::clone(&self.inner.admission)
            .try_acquire_owned()
            .map_err(|_| {
                counter!(metrics::REJECTED).increment(1);
                ApiError::TooManyRequests(format!(
                    "the server is handling its limit of {} concurrent requests; retry later",
                    self.inner.config.max_concurrent_requests
                ))
            })
    }
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// 32 random hex digits.
pub(crate) fn random_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// The full API as an `axum::Router` (auth on `/v1/*`, JSON content type, body limit, request
/// ids, tracing spans and HTTP metrics included).
pub fn router(state: AppState) -> Router {
    let api = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/models/{*model}", get(model))
        .route("/v1/completions", post(completions::handle))
        .route("/v1/chat/completions", post(chat::handle))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/tokenizer_info", get(tokenize::tokenizer_info));
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .route("/version", get(version))
        .merge(api)
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(not_found)
        // `body::read_body` buffers every body within the limit before the handlers run, once
        // `gate::gate` checked the key and the content type from the head alone.
        .layer(DefaultBodyLimit::disable())
        .layer(middleware::from_fn_with_state(
            state.clone(),
            body::read_body,
        ))
        .layer(middleware::from_fn_with_state(state.clone(), gate::gate))
        .layer(middleware::from_fn(observe::observe))
        .with_state(state)
}

/// Serves `router(state)` on `listener` until `shutdown` resolves (or the backend's group asks
/// to stop), then drains: refuses new generation requests and fails `/health` (503), lets
/// in-flight requests finish for up to `shutdown_timeout` and cancels whatever is left, keeps
/// the listener open answering those 503s for at least `health_grace`, and finally shuts the
/// backend down (blocking work, done off the runtime). When the backend's group is about to
/// stop, every in-flight request is answered at once with the reason. Returns once all of that
/// is done.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    tokio::spawn(answer_on_failure(state.clone()));
    let (drained_tx, mut drained) = watch::channel(false);
    let close = drain(state.clone(), shutdown, drained_tx);
    let server = listen::serve_until(listener, router(state.clone()), state.config(), close);
    tokio::pin!(server);
    let cancelled = async {
        while !*drained.borrow_and_update() {
            if drained.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    };
    let result = tokio::select! {
        result = &mut server => result,
        // Aborted requests send their error and close; give them a moment.
        () = cancelled => match tokio::time::timeout(Duration::from_secs(2), &mut server).await {
            Ok(result) => result,
            Err(_) => Ok(()),
        },
    };
    let backend = Arc::clone(state.backend());
    let _ = tokio::task::spawn_blocking(move || backend.shutdown()).await;
    tracing::info!("server stopped");
    result
}

/// How often a drain checks whether it is done.
const DRAIN_POLL: Duration = Duration::from_millis(20);

/// Resolves when the listener must close: after `shutdown` (or the group's stop request), once
/// nothing is in flight and `health_grace` has passed, or at `shutdown_timeout`, when whatever
/// is left is cancelled (then `cancelled` is set).
async fn drain(
    state: AppState,
    shutdown: impl Future<Output = ()>,
    cancelled: watch::Sender<bool>,
) {
    let mut requested = state.backend().health().watch_stop_request();
    tokio::select! {
        () = shutdown => {}
        _ = requested.wait_for(|stop| *stop) => {
            tracing::info!("the engine's group asked to stop");
        }
    }
    tracing::info!(
        in_flight = state.in_flight(),
        "shutdown requested: draining in-flight requests"
    );
    state.begin_drain();
    let config = state.config();
    let started = tokio::time::Instant::now();
    let deadline = started + config.shutdown_timeout;
    let grace = started + config.health_grace.min(config.shutdown_timeout);
    loop {
        let now = tokio::time::Instant::now();
        if now >= deadline {
            tracing::warn!(
                in_flight = state.in_flight(),
                "shutdown timeout reached: cancelling in-flight requests"
            );
            state.abort_in_flight();
            cancelled.send_replace(true);
            return;
        }
        if state.in_flight() == 0 && now >= grace {
            return;
        }
        tokio::time::sleep(DRAIN_POLL).await;
    }
}

/// Answers every in-flight request with the reason once the backend's group is about to stop.
async fn answer_on_failure(state: AppState) {
    let mut failure = state.backend().health().watch_failure();
    let why = match failure.wait_for(Option::is_some).await {
        Ok(why) => why.clone().unwrap_or_default(),
        Err(_) => return,
    };
    state.fail_in_flight(&why);
}

async fn health(State(state): State<AppState>) -> Response {
    if let Err(why) = state.backend().health().check() {
        return ApiError::Unavailable(why).into_response();
    }
    if state.is_draining() {
        return ApiError::Unavailable("the server is shutting down".into()).into_response();
    }
    Json(api_types::Health { status: "ok" }).into_response()
}

async fn version() -> Response {
    Json(api_types::VersionInfo {
        name: "rackfill",
        version: env!("CARGO_PKG_VERSION"),
    })
    .into_response()
}

async fn metrics_text(State(state): State<AppState>) -> Response {
    let text = state
        .inner
        .metrics
        .as_ref()
        .map(PrometheusHandle::render)
        .unwrap_or_default();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn models(State(state): State<AppState>) -> Response {
    Json(api_types::ModelList {
        data: vec![model_card(&state)],
        object: "list",
    })
    .into_response()
}

/// `GET /v1/models/{model}` (the id may hold slashes, as Hugging Face ids do): the served
/// model's card, 404 `model_not_found` for any other id, or 400 for an id that is not UTF-8
/// once percent-decoded.
async fn model(State(state): State<AppState>, id: Result<Path<String>, PathRejection>) -> Response {
    let id = match id {
        Ok(Path(id)) => id,
        Err(rejection) => {
            return ApiError::InvalidRequest {
                message: format!("invalid model id in the path: {}", rejection.body_text()),
                param: Some("model".into()),
                code: Some("invalid_value"),
            }
            .into_response()
        }
    };
    match request_json::check_model(Some(&id), &state.backend().info().name) {
        Ok(()) => Json(model_card(&state)).into_response(),
        Err(err) => err.into_response(),
    }
}

/// The served model as an OpenAI model object (plus vLLM's `root`, `parent`, `max_model_len`).
fn model_card(state: &AppState) -> api_types::ModelCard {
    let info = state.backend().info();
    api_types::ModelCard {
        created: info.created,
        id: info.name.clone(),
        max_model_len: info.limits.max_context,
        object: "model",
        owned_by: "rackfill",
        parent: None,
        root: info.name.clone(),
    }
}

async fn not_found(request: Request) -> Response {
    ApiError::RouteNotFound(format!("{} {}", request.method(), request.uri().path()))
        .into_response()
}

/// The error envelope for a method the route does not take (axum adds the `allow` header).
async fn method_not_allowed(request: Request) -> Response {
    ApiError::MethodNotAllowed(format!("{} {}", request.method(), request.uri().path()))
        .into_response()
}
