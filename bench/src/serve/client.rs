//! The HTTP side: one pooled `reqwest` client, `GET /v1/models`, and streamed completion
//! requests timed chunk by chunk.
//!
//! Timing follows vLLM's benchmark client: the clock starts just before the request is sent;
//! TTFT is the arrival of the first chunk that carries output text; every later chunk with text
//! adds one inter-token latency; the end-to-end latency ends at `[DONE]`. A request fails (and
//! is counted, never fatal) on a transport error, a non-200 status, a body that is not an SSE
//! stream, an `{"error": ...}` event, an event that is not a JSON completion chunk, a stream
//! without any chunk that has a choice (vLLM's "never received a valid chunk"), or a stream
//! that ends without `[DONE]`. Nothing after `[DONE]` is waited for beyond a short grace, so a
//! server that keeps the connection open after it cannot hold a request until its timeout.

use std::time::{Duration, Instant};

use serde::{Deserialize, Deserializer, Serialize};

/// How long the rest of a response body is read after `[DONE]` (normally just the end of the
/// chunked body, so the connection goes back to the pool) before the connection is dropped.
const AFTER_DONE_GRACE: Duration = Duration::from_millis(500);

/// Which OpenAI API an endpoint speaks, from its path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `/v1/completions`: `prompt` (text or token ids), `max_tokens`, chunks carry `text`.
    Completions,
    /// `/v1/chat/completions`: `messages`, `max_completion_tokens`, chunks carry
    /// `delta.content`.
    Chat,
}

impl Api {
    /// The API behind an endpoint path; `None` for paths that are neither.
    pub fn of_endpoint(endpoint: &str) -> Option<Self> {
        let path = endpoint.trim_end_matches('/');
        if path.ends_with("/chat/completions") {
            Some(Self::Chat)
        } else if path.ends_with("/completions") {
            Some(Self::Completions)
        } else {
            None
        }
    }

    /// vLLM's `backend` name for the API.
    pub fn backend_name(self) -> &'static str {
        match self {
            Self::Completions => "openai",
            Self::Chat => "openai-chat",
        }
    }
}

/// A model listed by `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ModelEntry {
    pub id: String,
    /// vLLM and rackfill list the context length; other servers may not.
    #[serde(default)]
    pub max_model_len: Option<u64>,
}

#[derive(Deserialize)]
struct ModelList {
    data: Vec<ModelEntry>,
}

/// Why the endpoint could not be used at all (per-request failures are [`Outcome::error`]).
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid --base-url '{0}': expected http://HOST[:PORT] or https://...")]
    BaseUrl(String),
    #[error("cannot build the HTTP client: {0}")]
    Build(String),
    #[error("cannot reach {url}: {message}")]
    Unreachable { url: String, message: String },
    #[error("{url} did not answer like an OpenAI-compatible server: {message}")]
    NotOpenAi { url: String, message: String },
}

/// One HTTP client (connection pool, keep-alive) for every request of a benchmark.
#[derive(Debug, Clone)]
pub struct OpenAiClient {
    http: reqwest::Client,
    base_url: String,
    api_key: Option<String>,
}

impl OpenAiClient {
    /// A client for `base_url` (`http://host:port`, no `/v1`); every request gives up after
    /// `request_timeout`.
    pub fn new(
        base_url: &str,
        api_key: Option<String>,
        request_timeout: Duration,
    ) -> Result<Self, ClientError> {
        let base_url = base_url.trim_end_matches('/').to_string();
        let parsed =
            reqwest::Url::parse(&base_url).map_err(|_| ClientError::BaseUrl(base_url.clone()))?;
        if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
            return Err(ClientError::BaseUrl(base_url));
        }
        let http = reqwest::Client::builder()
            .tcp_nodelay(true)
            .pool_idle_timeout(Duration::from_secs(90))
            .connect_timeout(Duration::from_secs(10))
            .timeout(request_timeout)
            .build()
            .map_err(|e| ClientError::Build(error_chain(&e)))?;
        Ok(Self {
            http,
            base_url,
            api_key,
        })
    }

    /// `base_url` + `path`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base_url, path)
    }

    fn authorized(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.api_key {
            Some(key) => request.bearer_auth(key),
            None => request,
        }
    }

    /// `GET /v1/models`: the served models, in the server's order.
    pub async fn models(&self) -> Result<Vec<ModelEntry>, ClientError> {
        let url = self.url("/v1/models");
        let response = self
            .authorized(self.http.get(&url))
            .send()
            .await
            .map_err(|e| ClientError::Unreachable {
                url: url.clone(),
                message: error_chain(&e),
            })?;
        let status = response.status();
        let body = response
            .bytes()
            .await
            .map_err(|e| ClientError::Unreachable {
                url: url.clone(),
                message: error_chain(&e),
            })?;
        let not_openai = |message: String| ClientError::NotOpenAi {
            url: url.clone(),
            message,
        };
        if !status.is_success() {
            return Err(not_openai(format!(
                "HTTP {}: {}",
                status.as_u16(),
                error_message(&body)
            )));
        }
        let list: ModelList = serde_json::from_slice(&body).map_err(|e| {
            not_openai(format!(
                "expected {{\"data\": [{{\"id\": ...}}]}}: {e}: {}",
                snippet(&body)
            ))
        })?;
        Ok(list.data)
    }

    /// POSTs a JSON `body` that asks for a stream and reads the stream to its end.
    pub async fn stream(&self, url: &str, body: Vec<u8>) -> Outcome {
        self.stream_keeping(url, body, false).await
    }

    /// [`Self::stream`], keeping the output text in [`Outcome::text`] when `keep_text`.
    pub async fn stream_keeping(&self, url: &str, body: Vec<u8>, keep_text: bool) -> Outcome {
        let mut outcome = Outcome {
            text: keep_text.then(String::new),
            ..Outcome::default()
        };
        let start = Instant::now();
        let sent = self
            .authorized(self.http.post(url))
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body)
            .send()
            .await;
        let result = match sent {
            Ok(response) => read_stream(response, start, &mut outcome).await,
            Err(e) => Err(error_chain(&e)),
        };
        match result {
            Ok(done_at) => outcome.e2el = done_at - start,
            Err(message) => {
                outcome.e2el = start.elapsed();
                outcome.error = Some(message);
            }
        }
        if outcome.error.is_none() && outcome.ttft.is_none() {
            // A stream that finished without any text (every token decoded to nothing):
            // its first output is its end.
            outcome.ttft = Some(outcome.e2el);
        }
        outcome
    }
}

#[derive(Serialize)]
struct TokenizeBody<'a> {
    model: &'a str,
    prompt: &'a str,
    add_special_tokens: bool,
}

#[derive(Deserialize)]
struct Tokenized {
    tokens: Vec<u32>,
}

impl OpenAiClient {
    /// `POST /tokenize` (vLLM's endpoint, which rackfill serves too): the ids `model`'s
    /// tokenizer gives `text`, without special tokens. The error is one line.
    pub async fn tokenize(&self, model: &str, text: &str) -> Result<Vec<u32>, String> {
        let url = self.url("/tokenize");
        let body = TokenizeBody {
            model,
            prompt: text,
            add_special_tokens: false,
        };
        let response = self
            .authorized(self.http.post(&url))
            .json(&body)
            .send()
            .await
            .map_err(|e| format!("{url}: {}", error_chain(&e)))?;
        let status = response.status();
        let bytes = response
            .bytes()
            .await
            .map_err(|e| format!("{url}: {}", error_chain(&e)))?;
        if !status.is_success() {
            return Err(format!(
                "{url}: HTTP {}: {}",
                status.as_u16(),
                error_message(&bytes)
            ));
        }
        serde_json::from_slice::<Tokenized>(&bytes)
            .map(|t| t.tokens)
            .map_err(|e| format!("{url}: expected {{\"tokens\": [...]}}: {e}"))
    }
}

/// What one request measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Outcome {
    /// Time to the first chunk with output text.
    pub ttft: Option<Duration>,
    /// Gaps between consecutive chunks with output text.
    pub itls: Vec<Duration>,
    /// Send to `[DONE]`, the end of the stream (or to the failure).
    pub e2el: Duration,
    /// `usage.prompt_tokens` of the final chunk, when the server sent usage.
    pub prompt_tokens: Option<usize>,
    /// `usage.completion_tokens` of the final chunk, when the server sent usage.
    pub completion_tokens: Option<usize>,
    /// `usage.prompt_tokens_details.cached_tokens` (OpenAI's field: prompt tokens whose KV
    /// came from a prefix cache), when the server sent it.
    pub cached_tokens: Option<usize>,
    /// Entries of `logprobs.token_logprobs` over every chunk of the first choice: with `echo`,
    /// the prompt positions scored, then one per generated token.
    pub logprob_positions: usize,
    /// The first choice's output text, kept only when the request asked for it (a conversation
    /// resends it).
    pub text: Option<String>,
    /// Chunks that carried output text (the output-token count when there is no usage).
    pub text_chunks: usize,
    /// The `kv_transfer_params` a prefill server put on the stream (disaggregated prefill:
    /// where a decode engine pulls the prompt's KV).
    pub kv_transfer_params: Option<serde_json::Value>,
    /// Why the request failed; `None` when it succeeded.
    pub error: Option<String>,
}

#[derive(Deserialize)]
struct Chunk {
    /// `null` is taken as empty, as some servers send it in their usage chunk.
    #[serde(default, deserialize_with = "null_as_empty")]
    choices: Vec<ChoiceChunk>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    error: Option<serde_json::Value>,
    #[serde(default)]
    kv_transfer_params: Option<serde_json::Value>,
}

fn null_as_empty<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<ChoiceChunk>, D::Error> {
    Ok(Option::<Vec<ChoiceChunk>>::deserialize(d)?.unwrap_or_default())
}

#[derive(Deserialize)]
struct ChoiceChunk {
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    delta: Option<Delta>,
    #[serde(default)]
    logprobs: Option<LegacyLogprobs>,
}

/// Completions' `logprobs`; only the count of positions is read.
#[derive(Deserialize)]
struct LegacyLogprobs {
    #[serde(default)]
    token_logprobs: Vec<serde::de::IgnoredAny>,
}

#[derive(Deserialize)]
struct Delta {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    reasoning_content: Option<String>,
}

#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    prompt_tokens: Option<usize>,
    #[serde(default)]
    completion_tokens: Option<usize>,
    #[serde(default)]
    prompt_tokens_details: Option<PromptTokensDetails>,
}

#[derive(Deserialize)]
struct PromptTokensDetails {
    #[serde(default)]
    cached_tokens: Option<usize>,
}

/// Reads a streamed response into `outcome`; returns when `[DONE]` arrived.
async fn read_stream(
    mut response: reqwest::Response,
    start: Instant,
    outcome: &mut Outcome,
) -> Result<Instant, String> {
    let status = response.status();
    if !status.is_success() {
        let body = response.bytes().await.unwrap_or_default();
        return Err(format!(
            "HTTP {}: {}",
            status.as_u16(),
            error_message(&body)
        ));
    }
    let content_type = response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    if !content_type.starts_with("text/event-stream") {
        let body = response.bytes().await.unwrap_or_default();
        return Err(format!(
            "expected an SSE stream (text/event-stream), got content-type '{content_type}': {}",
            snippet(&body)
        ));
    }
    let mut parser = SseParser::default();
    let mut last_text: Option<Instant> = None;
    let mut done_at: Option<Instant> = None;
    let mut choice_chunks = 0usize;
    'read: while let Some(bytes) = response.chunk().await.map_err(|e| error_chain(&e))? {
        let now = Instant::now();
        for data in parser.feed(&bytes) {
            if data == "[DONE]" {
                done_at = Some(now);
                break 'read;
            }
            let chunk: Chunk = serde_json::from_str(&data).map_err(|e| {
                let what = if e.is_data() {
                    "an OpenAI completion chunk"
                } else {
                    "JSON"
                };
                format!(
                    "stream event is not {what} ({e}): {}",
                    snippet(data.as_bytes())
                )
            })?;
            if let Some(error) = chunk.error {
                return Err(format!("error event: {}", error_field(&error)));
            }
            if !chunk.choices.is_empty() {
                choice_chunks += 1;
            }
            if let Some(params) = chunk.kv_transfer_params.filter(|p| !p.is_null()) {
                outcome.kv_transfer_params = Some(params);
            }
            if let Some(usage) = chunk.usage {
                outcome.prompt_tokens = usage.prompt_tokens.or(outcome.prompt_tokens);
                outcome.completion_tokens = usage.completion_tokens.or(outcome.completion_tokens);
                let cached = usage.prompt_tokens_details.and_then(|d| d.cached_tokens);
                outcome.cached_tokens = cached.or(outcome.cached_tokens);
            }
            let first = chunk.choices.first();
            if let Some(logprobs) = first.and_then(|c| c.logprobs.as_ref()) {
                outcome.logprob_positions += logprobs.token_logprobs.len();
            }
            let texts = first.map_or([None; 3], |c| {
                let delta = c.delta.as_ref();
                [
                    c.text.as_deref(),
                    delta.and_then(|d| d.content.as_deref()),
                    delta.and_then(|d| d.reasoning_content.as_deref()),
                ]
            });
            if let Some(kept) = &mut outcome.text {
                // The answer a conversation resends: the completion's text, or the message's
                // content (reasoning is not part of it).
                kept.extend(texts[..2].iter().flatten().copied());
            }
            let has_text = texts.iter().any(|t| t.is_some_and(|t| !t.is_empty()));
            if has_text {
                match last_text {
                    None => outcome.ttft = Some(now - start),
                    Some(previous) => outcome.itls.push(now - previous),
                }
                last_text = Some(now);
                outcome.text_chunks += 1;
            }
        }
    }
    let Some(done_at) = done_at else {
        return Err("the stream ended without [DONE]".into());
    };
    if choice_chunks == 0 {
        return Err("the stream had no chunk with a choice (no completion was streamed)".into());
    }
    // The end of the body normally follows at once; a server that holds the connection open
    // after [DONE] loses it instead of holding the request until its timeout.
    let _ = tokio::time::timeout(AFTER_DONE_GRACE, async {
        while let Ok(Some(_)) = response.chunk().await {}
    })
    .await;
    Ok(done_at)
}

/// Incremental `text/event-stream` parser: feed bytes, get the `data` of complete events.
#[derive(Debug, Default)]
pub struct SseParser {
    buffer: Vec<u8>,
    data: Option<String>,
}

impl SseParser {
    /// Adds `bytes`; returns every event completed by them (LF or CRLF line ends).
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buffer.extend_from_slice(bytes);
        let mut events = Vec::new();
        let mut start = 0;
        while let Some(offset) = self.buffer[start..].iter().position(|&b| b == b'\n') {
            let end = start + offset;
            let line = &self.buffer[start..end];
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if line.is_empty() {
                events.extend(self.data.take());
            } else if let Some(value) = line.strip_prefix(b"data:") {
                let value = value.strip_prefix(b" ").unwrap_or(value);
                let value = String::from_utf8_lossy(value);
                match &mut self.data {
                    Some(data) => {
                        data.push('\n');
                        data.push_str(&value);
                    }
                    None => self.data = Some(value.into_owned()),
                }
            }
            start = end + 1;
        }
        self.buffer.drain(..start);
        events
    }
}

/// `error.message` of an OpenAI error body, or the start of whatever the body is.
fn error_message(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("error").map(error_field))
        .unwrap_or_else(|| snippet(body))
}

fn error_field(error: &serde_json::Value) -> String {
    match error.get("message").and_then(|m| m.as_str()) {
        Some(message) => message.to_string(),
        None => error.to_string(),
    }
}

/// The first 200 characters of a body, on one line.
fn snippet(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let text: String = text.chars().take(200).collect();
    let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if text.is_empty() {
        "(empty body)".into()
    } else {
        text
    }
}

/// An error and its causes on one line (reqwest's own message omits "connection refused").
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_split_across_reads_and_line_endings() {
        let mut parser = SseParser::default();
        assert!(parser.feed(b"data: {\"a\"").is_empty());
        assert_eq!(parser.feed(b": 1}\n\ndata: [DO"), ["{\"a\": 1}"]);
        assert_eq!(parser.feed(b"NE]\r\n\r\n: comment\n\n"), ["[DONE]"]);
        assert_eq!(parser.feed(b"data:x\ndata: y\n\n"), ["x\ny"]);
    }

    #[test]
    fn endpoints_map_to_apis() {
        assert_eq!(Api::of_endpoint("/v1/completions"), Some(Api::Completions));
        assert_eq!(Api::of_endpoint("/v1/chat/completions/"), Some(Api::Chat));
        assert_eq!(Api::of_endpoint("/v1/embeddings"), None);
    }

    #[test]
    fn error_bodies_become_one_line() {
        let body = br#"{"error": {"message": "the model `x` does not exist", "type": "invalid"}}"#;
        assert_eq!(error_message(body), "the model `x` does not exist");
        assert_eq!(
            error_message(b"<html>\n  <b>502</b>\n</html>"),
            "<html> <b>502</b> </html>"
        );
        assert_eq!(error_message(b""), "(empty body)");
    }

    #[test]
    fn bad_base_urls_are_refused() {
        for bad in ["localhost:8000", "ftp://x", "http://", ""] {
            let err = OpenAiClient::new(bad, None, Duration::from_secs(1)).unwrap_err();
            assert!(matches!(err, ClientError::BaseUrl(_)), "{bad}: {err}");
        }
        let client =
            OpenAiClient::new("http://127.0.0.1:1/", None, Duration::from_secs(1)).unwrap();
        assert_eq!(client.url("/v1/models"), "http://127.0.0.1:1/v1/models");
    }
}
