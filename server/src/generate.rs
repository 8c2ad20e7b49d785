//! What completions and chat share: submitting a request's sequences, reading their events (all
//! of them for a JSON body, or as SSE chunks), cancellation on disconnect or shutdown, and the
//! per-request latency metrics.

use std::collections::HashSet;
use std::convert::Infallible;
use std::future::pending;
use std::time::{Duration, Instant};

use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, StreamExt};
use metrics::{counter, histogram};
use rackfill_engine::{
    Event, FinishEvent, FinishReason, GenerateRequest, RequestStream, TokenEvent, TokenLogprob,
};
use serde::Serialize;
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit};
use tracing::Instrument;

use crate::api_error::{ApiError, PromptField};
use crate::api_types::finish_reason;
use crate::metrics as m;
use crate::AppState;

/// One submitted sequence: choice `index` of the response.
pub(crate) struct Seq {
    pub index: usize,
    pub stream: RequestStream,
}

/// Validates the sequences of one request (every prompt times `n`, in choice order) with the
/// engine and queues them, all or none; errors name the request field at fault (`field` holds
/// the prompts). Choice `i` of the response reads `seqs[i]`.
pub(crate) fn submit(
    state: &AppState,
    mut sequences: Vec<GenerateRequest>,
    field: PromptField,
    export_kv: bool,
) -> Result<Vec<Seq>, ApiError> {
    let backend = state.backend();
    let validated = if export_kv {
        if sequences.len() != 1 {
            return Err(ApiError::invalid(
                "kv_transfer_params",
                "`kv_transfer_params.do_remote_decode` needs exactly one sequence (one prompt, \
                 n = 1): the KV of one prompt goes to one decode request",
            ));
        }
        backend.validate_kv_export(sequences.remove(0))
    } else {
        backend.validate(sequences)
    };
    let validated = validated.map_err(|e| ApiError::from_request(e, field))?;
    let streams = backend
        .submit(validated)
        .map_err(|e| ApiError::from_engine(e, field))?;
    Ok(streams
        .into_iter()
        .enumerate()
        .map(|(index, stream)| Seq { index, stream })
        .collect())
}

/// Latency bookkeeping of one generation request.
pub(crate) struct Timing {
    start: Instant,
    first_output: bool,
}

impl Timing {
    pub fn start() -> Self {
        Self {
            start: Instant::now(),
            first_output: false,
        }
    }

    /// Any output (token, prompt logprobs, or the end): records TTFT the first time.
    fn output(&mut self) {
        if !self.first_output {
            self.first_output = true;
            histogram!(m::TTFT).record(self.start.elapsed().as_secs_f64());
        }
    }

    fn finished(&mut self, finish: &FinishEvent) {
        self.output();
        histogram!(m::QUEUE_TIME).record(finish.queue_time.as_secs_f64());
        counter!(m::REQUEST_SUCCESS, "finished_reason" => finish_reason(finish.reason))
            .increment(1);
        counter!(m::GENERATION_TOKENS).increment(finish.usage.completion_tokens as u64);
    }

    fn failed(&self, reason: &'static str) {
        counter!(m::REQUEST_SUCCESS, "finished_reason" => reason).increment(1);
    }

    fn done(&self) {
        histogram!(m::E2E).record(self.start.elapsed().as_secs_f64());
    }
}

/// Resolves once the server aborts in-flight requests (drain timeout, or the engine's group
/// about to stop).
pub(crate) async fn aborted(mut abort: watch::Receiver<Option<String>>) {
    loop {
        if abort.borrow_and_update().is_some() {
            return;
        }
        if abort.changed().await.is_err() {
            pending::<()>().await;
        }
    }
}

/// The error of a request the server aborted, saying why.
fn cancelled(abort: &watch::Receiver<Option<String>>) -> ApiError {
    let why = abort.borrow().clone();
    ApiError::Unavailable(why.unwrap_or_else(|| "the request was cancelled".into()))
}

fn engine_gone() -> ApiError {
    ApiError::Unavailable("the engine stopped before the request finished".into())
}

/// Everything one sequence produced.
#[derive(Debug)]
pub(crate) struct Output {
    pub tokens: Vec<u32>,
    /// Per generated token, when logprobs were requested.
    pub logprobs: Vec<Option<TokenLogprob>>,
    pub text: String,
    pub prompt_logprobs: Option<Vec<Option<TokenLogprob>>>,
    pub finish: FinishEvent,
}

/// Reads every sequence to its end; outputs are in `seqs` order.
pub(crate) async fn collect_all(
    state: &AppState,
    seqs: Vec<Seq>,
    timing: &mut Timing,
) -> Result<Vec<Output>, ApiError> {
    let abort_reason = state.abort_receiver();
    let abort = aborted(abort_reason.clone());
    tokio::pin!(abort);
    let mut outputs = Vec::with_capacity(seqs.len());
    // Holding every stream until the end keeps the not-yet-read sequences alive.
    let mut seqs = seqs;
    for seq in &mut seqs {
        let mut out = Output {
            tokens: Vec::new(),
            logprobs: Vec::new(),
            text: String::new(),
            prompt_logprobs: None,
            finish: FinishEvent {
                reason: FinishReason::Cancelled,
                text: String::new(),
                stop: None,
                usage: Default::default(),
                queue_time: Default::default(),
                kv_transfer: None,
            },
        };
        loop {
            let event = tokio::select! {
                biased;
                event = seq.stream.events.recv() => event,
                () = &mut abort => {
                    timing.failed("abort");
                    return Err(cancelled(&abort_reason));
                }
            };
            match event {
                Some(Event::PromptLogprobs(lp)) => {
                    timing.output();
                    out.prompt_logprobs = Some(lp);
                }
                Some(Event::Token(TokenEvent {
                    token,
                    text,
                    logprob,
                })) => {
                    timing.output();
                    out.tokens.push(token);
                    out.text.push_str(&text);
                    out.logprobs.push(logprob);
                }
                Some(Event::Finished(finish)) => {
                    timing.finished(&finish);
                    out.text.push_str(&finish.text);
                    out.finish = finish;
                    break;
                }
                Some(Event::Error(message)) => {
                    timing.failed("error");
                    return Err(ApiError::Internal(message));
                }
                None => {
                    timing.failed("error");
                    return Err(engine_gone());
                }
            }
        }
        outputs.push(out);
    }
    timing.done();
    Ok(outputs)
}

/// Turns engine events into the chunks of one API's stream, and counts the usage they report.
pub(crate) trait ChunkFormat: Send + 'static {
    /// One `data:` event's JSON.
    type Chunk: Serialize + Send + Sync;
    /// Chunks sent before any event of choice `index`.
    fn start(&mut self, index: usize) -> Vec<Self::Chunk>;
    /// Chunks for the prompt logprobs of choice `index`.
    fn prompt_logprobs(
        &mut self,
        index: usize,
        logprobs: Vec<Option<TokenLogprob>>,
    ) -> Vec<Self::Chunk>;
    /// The chunk of one generated token, if it shows anything.
    fn token(&mut self, index: usize, token: TokenEvent) -> Option<Self::Chunk>;
    /// The last chunk of choice `index`.
    fn finish(&mut self, index: usize, finish: &FinishEvent) -> Self::Chunk;
    /// The closing chunk with the request's usage (`choices: []`), when the client asked for
    /// usage (`stream_options.include_usage`).
    fn closing_usage(&mut self) -> Option<Self::Chunk>;
}

fn sse_json(value: &impl Serialize) -> SseEvent {
    // Serializing plain data structs into a string cannot fail.
    SseEvent::default().data(serde_json::to_string(value).unwrap_or_default())
}

/// How long the last events of an aborted stream (its error and `[DONE]`) may wait for a client
/// that is not reading; [`crate::serve`] gives aborted requests two seconds to close.
const ABORTED_STREAM_GRACE: Duration = Duration::from_secs(1);

/// What became of events handed to the response body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Delivery {
    /// Queued for the client.
    Queued,
    /// The client went away: the body was dropped.
    ClientGone,
    /// The server aborts in-flight requests while the client was not reading.
    Aborted,
}

/// A stream task's way to its response body: the channel the body drains, the server's abort
/// signal, and how long an event may wait for a client that does not read.
struct Outbox {
    tx: mpsc::Sender<SseEvent>,
    abort: watch::Receiver<Option<String>>,
    write_timeout: Duration,
}

impl Outbox {
    /// Sends `event` to the response body, waiting while the client reads slowly, but not past
    /// an abort or `write_timeout` without room: a client that stopped reading must not keep
    /// its sequences, its admission permit (and the engine's shutdown) alive.
    async fn send(&self, event: SseEvent) -> Delivery {
        tokio::select! {
            biased;
            sent = tokio::time::timeout(self.write_timeout, self.tx.send(event)) => match sent {
                Ok(Ok(())) => Delivery::Queued,
                Ok(Err(_)) => Delivery::ClientGone,
                Err(_) => {
                    tracing::info!(
                        timeout_s = self.write_timeout.as_secs_f64(),
                        "client stopped reading the stream; request cancelled"
                    );
                    Delivery::ClientGone
                }
            },
            () = aborted(self.abort.clone()) => Delivery::Aborted,
        }
    }

    /// Sends `chunks` in order until one is not queued: a client gone (or not reading), or an
    /// abort, which is recorded in `failure` (the stream then ends with its error event).
    /// Either counts the request as aborted.
    async fn deliver(
        &self,
        chunks: &[impl Serialize],
        timing: &Timing,
        failure: &mut Option<ApiError>,
    ) -> Delivery {
        for chunk in chunks {
            match self.send(sse_json(chunk)).await {
                Delivery::Queued => {}
                stopped => {
                    timing.failed("abort");
                    if stopped == Delivery::Aborted {
                        *failure = Some(cancelled(&self.abort));
                    }
                    return stopped;
                }
            }
        }
        Delivery::Queued
    }
}

/// Streams `seqs` as SSE (`data: {chunk}` ... `data: [DONE]`). A task reads the engine and
/// writes chunks into a small channel the response body drains; when the client goes away the
/// channel closes, the task ends and drops the sequences, which cancels them in the engine.
/// Errors after the stream started are sent as a final `data: {"error": ...}` event. When the
/// server aborts in-flight requests, the sequences are cancelled at once, even while the task
/// waits for a client that is not reading.
pub(crate) fn stream_response<F: ChunkFormat>(
    state: &AppState,
    seqs: Vec<Seq>,
    mut format: F,
    permit: OwnedSemaphorePermit,
    mut timing: Timing,
) -> Response {
    let (tx, rx) = mpsc::channel::<SseEvent>(64);
    let outbox = Outbox {
        tx,
        abort: state.abort_receiver(),
        write_timeout: state.config().write_timeout,
    };
    let task = async move {
        let _permit = permit;
        let total = seqs.len();
        let mut started = Vec::new();
        for seq in &seqs {
            started.extend(format.start(seq.index));
        }
        let mut failure = None;
        if outbox.deliver(&started, &timing, &mut failure).await == Delivery::ClientGone {
            return;
        }
        let mut merged = stream::select_all(seqs.into_iter().map(|seq| {
            stream::unfold(Some(seq), |state| async move {
                let mut seq = state?;
                match seq.stream.events.recv().await {
                    Some(event) => Some(((seq.index, Some(event)), Some(seq))),
                    None => Some(((seq.index, None), None)),
                }
            })
            .boxed()
        }));
        let mut finished = HashSet::new();
        while failure.is_none() && finished.len() < total {
            let item = tokio::select! {
                biased;
                () = outbox.tx.closed() => {
                    timing.failed("abort");
                    tracing::info!("client disconnected; request cancelled");
                    return;
                }
                () = aborted(outbox.abort.clone()) => {
                    timing.failed("abort");
                    failure = Some(cancelled(&outbox.abort));
                    break;
                }
                item = merged.next() => item,
            };
            let chunks = match item {
                Some((index, Some(Event::PromptLogprobs(lp)))) => {
                    timing.output();
                    format.prompt_logprobs(index, lp)
                }
                Some((index, Some(Event::Token(token)))) => {
                    timing.output();
                    format.token(index, token).into_iter().collect()
                }
                Some((index, Some(Event::Finished(finish)))) => {
                    timing.finished(&finish);
                    finished.insert(index);
                    vec![format.finish(index, &finish)]
                }
                Some((_, Some(Event::Error(message)))) => {
                    timing.failed("error");
                    failure = Some(ApiError::Internal(message));
                    break;
                }
                Some((index, None)) => {
                    if finished.contains(&index) {
                        continue;
                    }
                    timing.failed("error");
                    failure = Some(engine_gone());
                    break;
                }
                None => {
                    timing.failed("error");
                    failure = Some(engine_gone());
                    break;
                }
            };
            // An abort sets `failure`, which ends the loop.
            if outbox.deliver(&chunks, &timing, &mut failure).await == Delivery::ClientGone {
                return;
            }
        }
        // The remaining sequences (on failure) are cancelled here, before the last events.
        drop(merged);
        timing.done();
        let aborting = outbox.abort.borrow().is_some();
        let last = match failure {
            Some(err) => {
                tracing::warn!(%err, "stream failed after it started");
                Some(sse_json(&err.body()))
            }
            None => format.closing_usage().map(|chunk| sse_json(&chunk)),
        };
        let events = last.into_iter().chain([SseEvent::default().data("[DONE]")]);
        for event in events {
            let sent = if aborting {
                // Only a short wait: the client may be the one that stopped reading.
                tokio::time::timeout(ABORTED_STREAM_GRACE, outbox.tx.send(event))
                    .await
                    .is_ok_and(|sent| sent.is_ok())
            } else {
                matches!(outbox.send(event).await, Delivery::Queued)
            };
            if !sent {
                return;
            }
        }
    };
    tokio::spawn(task.instrument(tracing::Span::current()));
    let body = stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|event| (Ok::<_, Infallible>(event), rx))
    });
    Sse::new(body).into_response()
}
