//! Driving one run: the resolved target (endpoint, model, request settings), the warm-up
//! request, and the dispatcher that sends every request at its scheduled time under the
//! concurrency limit and the duration bound.
//!
//! The dispatcher only sleeps and spawns; each request (or conversation, whose turns go one
//! after the other) runs in its own task on the multi-thread runtime, builds its body there
//! (synthetic prompts are generated at send time, see [`Synthesis`]) and streams the response,
//! so a slow request never delays the next send.

use std::io::IsTerminal as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use tokio::sync::Semaphore;

use super::client::{Api, OpenAiClient, Outcome};
use super::dataset::{Prompt, RequestSpec, Synthesis};
use super::error::ServeBenchError;
use super::remote_decode::RemoteDecode;

/// Where and how requests are sent.
#[derive(Debug, Clone)]
pub struct TargetConfig {
    /// `http://host:port` (no `/v1`).
    pub base_url: String,
    /// `/v1/completions` or `/v1/chat/completions` (any path ending in either).
    pub endpoint: String,
    /// The `model` of every request; `None` takes the first id `GET /v1/models` lists.
    pub model: Option<String>,
    pub api_key: Option<String>,
    /// Per-request limit, connection to end of stream.
    pub request_timeout: Duration,
    /// Sends `ignore_eos: true` so every request generates exactly `max_tokens` (vLLM and
    /// rackfill honour it; it is left out otherwise, since OpenAI rejects unknown fields).
    pub ignore_eos: bool,
    pub temperature: f64,
    /// How synthetic prompts are made.
    pub synthesis: Synthesis,
    /// Play the decode side of disaggregated prefill: every request asks for its KV
    /// (`kv_transfer_params.do_remote_decode`), which this pulls over NIXL.
    pub remote_decode: Option<Arc<RemoteDecode>>,
}

/// A target ready for requests: endpoint checked, model resolved.
#[derive(Debug, Clone)]
pub struct Target {
    client: OpenAiClient,
    url: String,
    api: Api,
    model: String,
    config: TargetConfig,
}

impl Target {
    /// Checks the settings and resolves the model (asking the server when `config.model` is
    /// `None`, which is also the reachability check).
    pub async fn connect(config: TargetConfig) -> Result<Self, ServeBenchError> {
        let api = Api::of_endpoint(&config.endpoint).ok_or_else(|| {
            ServeBenchError::Config(format!(
                "unsupported --endpoint '{}': expected /v1/completions or /v1/chat/completions",
                config.endpoint
            ))
        })?;
        if !config.endpoint.starts_with('/') {
            return Err(ServeBenchError::Config(format!(
                "--endpoint '{}' must start with '/'",
                config.endpoint
            )));
        }
        if !(config.temperature.is_finite() && config.temperature >= 0.0) {
            return Err(ServeBenchError::Config(format!(
                "--temperature must be a non-negative number, got {}",
                config.temperature
            )));
        }
        let client = OpenAiClient::new(
            &config.base_url,
            config.api_key.clone(),
            config.request_timeout,
        )?;
        let model = match &config.model {
            Some(model) => model.clone(),
            None => client
                .models()
                .await?
                .into_iter()
                .next()
                .map(|m| m.id)
                .ok_or_else(|| {
                    ServeBenchError::Config(format!(
                        "{} lists no model; pass --model",
                        client.url("/v1/models")
                    ))
                })?,
        };
        Ok(Self {
            url: client.url(&config.endpoint),
            client,
            api,
            model,
            config,
        })
    }

    /// The model every request names.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// The API the endpoint speaks.
    pub fn api(&self) -> Api {
        self.api
    }

    /// The settings it was connected with.
    pub fn config(&self) -> &TargetConfig {
        &self.config
    }

    /// The JSON body of `spec`: streamed, with usage in the last chunk. A later conversation
    /// turn (see [`Prompt::Turn`]) gets an empty history here; runs send it with its own.
    pub fn body(&self, spec: &RequestSpec) -> Vec<u8> {
        let synthesis = &self.config.synthesis;
        let prompt = match (&spec.prompt, self.api) {
            (Prompt::Text(text), _) => PromptJson::Text(text.as_str().into()),
            (Prompt::Synthetic { hash_ids, unique }, Api::Chat) => {
                PromptJson::Text(synthesis.words(hash_ids, *unique, spec.input_len).into())
            }
            _ => PromptJson::Tokens(
                synthesis
                    .prompt_tokens(spec, &[])
                    .unwrap_or_default()
                    .into(),
            ),
        };
        self.body_of(spec, prompt)
    }

    fn body_of(&self, spec: &RequestSpec, prompt: PromptJson<'_>) -> Vec<u8> {
        let common =
            Common {
                model: &self.model,
                temperature: self.config.temperature,
                stream: true,
                stream_options: StreamOptions {
                    include_usage: true,
                },
                ignore_eos: self.config.ignore_eos.then_some(true),
                kv_transfer_params: self.config.remote_decode.is_some().then_some(
                    KvTransferRequest {
                        do_remote_decode: true,
                    },
                ),
            };
        let scored = matches!(spec.prompt, Prompt::Scored { .. });
        let body = match self.api {
            Api::Completions => serde_json::to_vec(&CompletionBody {
                prompt,
                max_tokens: spec.output_len,
                echo: scored.then_some(true),
                logprobs: scored.then_some(1),
                common,
            }),
            Api::Chat => serde_json::to_vec(&ChatBody {
                messages: [Message {
                    role: "user",
                    content: prompt,
                }],
                max_completion_tokens: spec.output_len,
                common,
            }),
        };
        // Plain structs of strings and numbers always serialize.
        body.unwrap_or_default()
    }

    /// Sends `spec` and reads its stream (and with `remote_decode`, has its KV pulled).
    pub async fn send(&self, spec: &RequestSpec) -> Outcome {
        let mut outcome = self.client.stream(&self.url, self.body(spec)).await;
        if let (Some(decode), None) = (&self.config.remote_decode, &outcome.error) {
            match outcome.kv_transfer_params.take() {
                Some(params) => decode.pull_later(params),
                None => {
                    outcome.error =
                        Some("--remote-decode: the response carried no kv_transfer_params".into())
                }
            }
        }
        scored(spec, outcome)
    }

    /// Sends conversation turn `spec` after `history` (see [`Prompt::Turn`]); when `next`
    /// (another turn follows), replaces `history` with this turn's prompt and the ids of its
    /// reply, which `POST /tokenize` gives for the reply's text, untimed. Returns the prompt's
    /// length.
    async fn send_turn(
        &self,
        spec: &RequestSpec,
        history: &mut Vec<u32>,
        next: bool,
    ) -> (usize, Outcome) {
        let ids = self
            .config
            .synthesis
            .prompt_tokens(spec, history)
            .unwrap_or_default();
        let body = self.body_of(spec, PromptJson::Tokens(ids.as_slice().into()));
        let mut outcome = self.client.stream_keeping(&self.url, body, next).await;
        let len = ids.len();
        if let (None, Some(text)) = (&outcome.error, outcome.text.take()) {
            let reply = if text.is_empty() {
                Ok(Vec::new())
            } else {
                self.client.tokenize(&self.model, &text).await
            };
            match reply {
                Ok(reply) => {
                    *history = ids;
                    history.extend(reply);
                }
                Err(e) => {
                    outcome.error = Some(format!(
                        "cannot resend the reply as token ids in the next turn: {e}"
                    ))
                }
            }
        }
        (len, outcome)
    }
}

/// A scored prompt (see [`Prompt::Scored`]) whose response did not score every prompt token is
/// of no use to a harness: it fails.
fn scored(spec: &RequestSpec, mut outcome: Outcome) -> Outcome {
    if matches!(spec.prompt, Prompt::Scored { .. }) && outcome.error.is_none() {
        let prompt = outcome.prompt_tokens.unwrap_or(spec.input_len);
        if outcome.logprob_positions < prompt {
            outcome.error = Some(format!(
                "echo with logprobs came back with {} logprobs for {prompt} prompt tokens",
                outcome.logprob_positions
            ));
        }
    }
    outcome
}

#[derive(Serialize)]
#[serde(untagged)]
enum PromptJson<'a> {
    Text(std::borrow::Cow<'a, str>),
    Tokens(std::borrow::Cow<'a, [u32]>),
}

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

#[derive(Serialize)]
struct Common<'a> {
    model: &'a str,
    temperature: f64,
    stream: bool,
    stream_options: StreamOptions,
    #[serde(skip_serializing_if = "Option::is_none")]
    ignore_eos: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    kv_transfer_params: Option<KvTransferRequest>,
}

/// What a disaggregation proxy asks a prefill server for.
#[derive(Serialize)]
struct KvTransferRequest {
    do_remote_decode: bool,
}

#[derive(Serialize)]
struct CompletionBody<'a> {
    prompt: PromptJson<'a>,
    max_tokens: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    echo: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    logprobs: Option<u32>,
    #[serde(flatten)]
    common: Common<'a>,
}

#[derive(Serialize)]
struct Message<'a> {
    role: &'static str,
    content: PromptJson<'a>,
}

#[derive(Serialize)]
struct ChatBody<'a> {
    messages: [Message<'a>; 1],
    max_completion_tokens: usize,
    #[serde(flatten)]
    common: Common<'a>,
}

/// Sends `spec` once, outside any measurement, and fails when it fails: a wrong URL, model or
/// API is reported once, clearly, instead of as N failed requests.
pub async fn warmup(target: &Target, spec: &RequestSpec) -> Result<(), ServeBenchError> {
    match target.send(spec).await.error {
        None => Ok(()),
        Some(message) => Err(ServeBenchError::Warmup {
            url: target.url.clone(),
            message,
        }),
    }
}

/// Limits of one run.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// At most this many requests in flight; later ones wait (their clock starts when sent).
    pub max_concurrency: Option<usize>,
    /// Stop sending after this long; requests in flight still finish and count.
    pub duration: Option<Duration>,
    /// Draw a progress bar on stderr (only when stderr is a terminal).
    pub progress: bool,
    /// Shown before the progress bar.
    pub label: String,
    /// Once it reads `true` (an interrupt), nothing more is sent; requests in flight finish
    /// and count, as at the end of `duration`.
    pub stop: Option<tokio::sync::watch::Receiver<bool>>,
}

impl RunOptions {
    /// Whether `stop` has been raised.
    pub fn stopped(&self) -> bool {
        self.stop.as_ref().is_some_and(|stop| *stop.borrow())
    }
}

/// Resolves once `stop` reads `true`; never when there is no `stop` or its sender is gone.
async fn raised(stop: Option<tokio::sync::watch::Receiver<bool>>) {
    if let Some(mut stop) = stop {
        while !*stop.borrow_and_update() {
            if stop.changed().await.is_err() {
                break;
            }
        }
        if *stop.borrow() {
            return;
        }
    }
    std::future::pending::<()>().await
}

/// One sent request.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestRecord {
    /// Position in the dataset.
    pub index: usize,
    /// When the arrival process released it, from the start of the run.
    pub scheduled: Duration,
    /// When it was sent (later than `scheduled` when it waited for a concurrency slot).
    pub sent: Duration,
    /// The dataset's input length (see [`RequestSpec::input_len`]); a conversation turn's
    /// actual prompt length.
    pub input_len: usize,
    /// `max_tokens`.
    pub output_len: usize,
    pub outcome: Outcome,
}

/// Every request a run sent, in dataset order, and how long the run took (first send to last
/// response).
#[derive(Debug, Clone, PartialEq)]
pub struct RunResult {
    pub records: Vec<RequestRecord>,
    pub duration: Duration,
}

/// Sends `requests[i]` at `offsets[i]` from now (requests past the end of `offsets` are not
/// sent) and waits for every response. Requests are sent in the order of their offsets, which
/// need not follow the dataset's (a trace's lines may be out of timestamp order); the records
/// come back in dataset order.
///
/// The turns of a conversation (see [`sessions`]) go as one: the first at its offset, each
/// later one as soon as the one before it finished (its own offset is not used), all under one
/// `max_concurrency` slot, as one client holding one chat. A failed turn ends its conversation.
pub async fn run(
    target: &Target,
    requests: &Arc<[RequestSpec]>,
    offsets: &[Duration],
    options: &RunOptions,
) -> RunResult {
    let count = offsets.len().min(requests.len());
    let progress = progress_bar(count, options);
    let target = Arc::new(target.clone());
    // More slots than requests is no limit; the semaphore cannot hold more than
    // `Semaphore::MAX_PERMITS`.
    let slots = options
        .max_concurrency
        .map(|n| Arc::new(Semaphore::new(n.clamp(1, count.max(1)))));
    let start = Instant::now();
    let deadline = options.duration.map(|d| start + d);
    // Ties keep dataset order (a stable sort), so `inf` rates send in dataset order.
    let mut order = sessions(&requests[..count]);
    order.sort_by_key(|session| offsets[session.start]);
    let mut tasks = Vec::with_capacity(order.len());
    for session in order {
        let offset = offsets[session.start];
        let scheduled_at = start + offset;
        if deadline.is_some_and(|d| scheduled_at >= d) || options.stopped() {
            break;
        }
        // The timer has millisecond resolution and rounds up; a request already due goes now.
        if scheduled_at > Instant::now() {
            tokio::select! {
                () = tokio::time::sleep_until(scheduled_at.into()) => {}
                () = raised(options.stop.clone()) => break,
            }
        }
        let (target, requests, slots, progress, options) = (
            target.clone(),
            requests.clone(),
            slots.clone(),
            progress.clone(),
            options.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let _slot = match slots {
                Some(slots) => Some(slots.acquire_owned().await.ok()?),
                None => None,
            };
            let mut records = Vec::with_capacity(session.len());
            let mut history = Vec::new();
            for index in session.clone() {
                if deadline.is_some_and(|d| Instant::now() >= d) || options.stopped() {
                    break;
                }
                let spec = &requests[index];
                let sent = start.elapsed();
                let (input_len, outcome) = if matches!(spec.prompt, Prompt::Turn { .. }) {
                    let next = index + 1 < session.end;
                    target.send_turn(spec, &mut history, next).await
                } else {
                    (spec.input_len, target.send(spec).await)
                };
                progress.inc(1);
                let failed = outcome.error.is_some();
                records.push(RequestRecord {
                    index,
                    scheduled: if index == session.start { offset } else { sent },
                    sent,
                    input_len,
                    output_len: spec.output_len,
                    outcome,
                });
                if failed {
                    break;
                }
            }
            Some(records)
        }));
    }
    let mut records = Vec::with_capacity(count);
    for task in tasks {
        // A session task only ends early by being refused a slot after the deadline; it
        // cannot panic (no unwraps), so a join error is not a case worth a record.
        if let Ok(Some(session)) = task.await {
            records.extend(session);
        }
    }
    records.sort_by_key(|r| r.index);
    let duration = start.elapsed();
    progress.finish_and_clear();
    RunResult { records, duration }
}

/// The requests sent as one, as index ranges in dataset order: each conversation's turns (a
/// request whose prompt [`continues`](Prompt::continues) joins the one before it), every other
/// request alone.
pub fn sessions(requests: &[RequestSpec]) -> Vec<std::ops::Range<usize>> {
    let mut out: Vec<std::ops::Range<usize>> = Vec::new();
    for (i, spec) in requests.iter().enumerate() {
        match out.last_mut() {
            Some(last) if spec.prompt.continues() => last.end = i + 1,
            _ => out.push(i..i + 1),
        }
    }
    out
}

fn progress_bar(len: usize, options: &RunOptions) -> ProgressBar {
    if !options.progress || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let style = ProgressStyle::with_template(
        "{prefix} [{elapsed_precise}] {wide_bar} {pos}/{len} ({per_sec}, eta {eta})",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    ProgressBar::with_draw_target(Some(len as u64), ProgressDrawTarget::stderr())
        .with_style(style)
        .with_prefix(options.label.clone())
}
