//! `POST /v1/completions`: prompts as a string, strings, token ids or lists of token ids; `echo`
//! with `logprobs` scores the prompt (first token `null`), the way evaluation harnesses compute
//! log-likelihoods with `max_tokens: 0`.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use metrics::counter;
use rackfill_engine::{FinishEvent, GenerateRequest, TokenEvent, TokenLogprob};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::generate::{self, finish_reason, stop_reason, usage_json, ChunkFormat, Output, Timing};
use crate::metrics as m;
use crate::params::{common_params, CommonParams, StreamOptions};
use crate::token_text::{token_bytes, TextOffsets};
use crate::validation::{self as v, ApiError};
use crate::{unix_now, AppState};

/// Most sequences (prompts times `n`) one request may ask for.
pub const MAX_SEQUENCES_PER_REQUEST: usize = 1024;

/// The fields of an OpenAI completion request rackfill reads (unknown fields are ignored).
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub prompt: Value,
    #[serde(default)]
    pub max_tokens: Option<i64>,
    #[serde(default)]
    pub min_tokens: Option<i64>,
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub top_p: Option<f64>,
    #[serde(default)]
    pub top_k: Option<i64>,
    #[serde(default)]
    pub n: Option<i64>,
    #[serde(default)]
    pub best_of: Option<i64>,
    #[serde(default)]
    pub stop: Option<Value>,
    #[serde(default)]
    pub stop_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    pub seed: Option<i64>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub logprobs: Option<i64>,
    #[serde(default)]
    pub echo: Option<bool>,
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    #[serde(default)]
    pub min_p: Option<f64>,
    #[serde(default)]
    pub presence_penalty: Option<f64>,
    #[serde(default)]
    pub frequency_penalty: Option<f64>,
    #[serde(default)]
    pub repetition_penalty: Option<f64>,
    #[serde(default)]
    pub logit_bias: Option<Map<String, Value>>,
    #[serde(default)]
    pub suffix: Option<String>,
    #[serde(default)]
    pub include_stop_str_in_output: Option<bool>,
    #[serde(default)]
    pub skip_special_tokens: Option<bool>,
    #[serde(default)]
    pub user: Option<String>,
    /// Fields not named above: ignored, except the vLLM fields rackfill refuses
    /// ([`crate::params::UNSUPPORTED_FIELDS`]).
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// A prompt as given: text, or token ids.
enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
}

fn token_id(value: &Value, param: impl FnOnce() -> String) -> Result<u32, ApiError> {
    value
        .as_u64()
        .and_then(|id| u32::try_from(id).ok())
        .ok_or_else(|| {
            ApiError::invalid(
                param(),
                format!("token ids must be non-negative integers, got {value}"),
            )
        })
}

fn parse_prompt(value: &Value) -> Result<Vec<PromptInput>, ApiError> {
    let bad = || {
        ApiError::invalid(
            "prompt",
            "`prompt` must be a string, an array of strings, an array of token ids or an array \
             of arrays of token ids",
        )
    };
    match value {
        Value::String(s) => Ok(vec![PromptInput::Text(s.clone())]),
        Value::Array(items) if items.is_empty() => {
            Err(ApiError::invalid("prompt", "`prompt` must not be empty"))
        }
        Value::Array(items) => match &items[0] {
            Value::String(_) => items
                .iter()
                .enumerate()
                .map(|(i, item)| match item {
                    Value::String(s) => Ok(PromptInput::Text(s.clone())),
                    _ => Err(ApiError::invalid(
                        format!("prompt[{i}]"),
                        "every element of a list of prompts must be a string",
                    )),
                })
                .collect(),
            Value::Number(_) => items
                .iter()
                .enumerate()
                .map(|(i, item)| token_id(item, || format!("prompt[{i}]")))
                .collect::<Result<Vec<_>, _>>()
                .map(|ids| vec![PromptInput::Tokens(ids)]),
            Value::Array(_) => items
                .iter()
                .enumerate()
                .map(|(i, item)| match item {
                    Value::Array(ids) if ids.is_empty() => Err(ApiError::invalid(
                        format!("prompt[{i}]"),
                        "a prompt must not be empty",
                    )),
                    Value::Array(ids) => ids
                        .iter()
                        .enumerate()
                        .map(|(j, id)| token_id(id, || format!("prompt[{i}][{j}]")))
                        .collect::<Result<Vec<_>, _>>()
                        .map(PromptInput::Tokens),
                    _ => Err(ApiError::invalid(
                        format!("prompt[{i}]"),
                        "every element of a list of token-id prompts must be an array",
                    )),
                })
                .collect(),
            _ => Err(bad()),
        },
        _ => Err(bad()),
    }
}

/// A tokenized prompt and the text `echo` returns for it.
struct Prompt {
    ids: Vec<u32>,
    text: String,
}

/// Tokenizes text prompts (with the tokenizer's special tokens, as vLLM does) and decodes
/// token-id prompts for `echo`, off the async runtime.
async fn tokenize(state: &AppState, inputs: Vec<PromptInput>) -> Result<Vec<Prompt>, ApiError> {
    let backend = state.backend().clone();
    tokio::task::spawn_blocking(move || {
        inputs
            .into_iter()
            .enumerate()
            .map(|(i, input)| match input {
                PromptInput::Text(text) => backend
                    .tokenize(&text, true)
                    .map(|ids| Prompt { ids, text })
                    .map_err(|e| ApiError::invalid(format!("prompt[{i}]"), e)),
                PromptInput::Tokens(ids) => {
                    let vocab = backend.info().vocab_size;
                    if let Some(j) = ids.iter().position(|&id| id as usize >= vocab) {
                        return Err(ApiError::invalid(
                            "prompt",
                            format!(
                                "token id {} is outside the vocabulary (size {vocab})",
                                ids[j]
                            ),
                        ));
                    }
                    let text = backend.detokenize(&ids).unwrap_or_default();
                    Ok(Prompt { ids, text })
                }
            })
            .collect()
    })
    .await
    .map_err(|e| ApiError::Internal(format!("tokenization failed: {e}")))?
}

/// The handler.
pub async fn handle(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match run(state, body).await {
        Ok(response) => response,
        Err(err) => err.into_response(),
    }
}

async fn run(state: AppState, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let body = crate::body::buffered(body)?;
    let request: CompletionRequest = v::parse_json(&body)?;
    let info = state.backend().info().clone();
    v::check_model(request.model.as_deref(), &info.name)?;
    let inputs = parse_prompt(&request.prompt)?;
    let common = common_params!(request);
    let mut resolved = common.resolve(&state)?;
    if let Some(best_of) = request.best_of {
        if best_of != resolved.n as i64 {
            return Err(ApiError::invalid(
                "best_of",
                "`best_of` other than `n` is not supported",
            ));
        }
    }
    if request.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix", "`suffix` is not supported"));
    }
    let max_tokens = v::int_in(
        "max_tokens",
        request.max_tokens.unwrap_or(16),
        0,
        u32::MAX as i64,
    )?;
    let logprobs = request
        .logprobs
        .map(|n| v::int_in("logprobs", n, 0, 20))
        .transpose()?
        .map(|n| n as u32);
    let echo = request.echo.unwrap_or(false);
    if inputs.len().saturating_mul(resolved.n) > MAX_SEQUENCES_PER_REQUEST {
        return Err(ApiError::invalid(
            "n",
            format!(
                "{} prompts times n = {} exceed the limit of {MAX_SEQUENCES_PER_REQUEST} \
                 sequences per request",
                inputs.len(),
                resolved.n
            ),
        ));
    }
    resolved.params.max_tokens = max_tokens as u32;
    resolved.params.logprobs = logprobs;
    resolved.params.prompt_logprobs = if echo { logprobs } else { None };
    resolved
        .params
        .validate(info.vocab_size)
        .map_err(|e| ApiError::from_engine(e.into(), "prompt"))?;
    state.check_draining()?;
    let permit = state.admit()?;
    let mut timing = Timing::start();
    tracing::debug!(user = request.user.as_deref().unwrap_or(""), "completion");

    let prompts = tokenize(&state, inputs).await?;
    for (i, prompt) in prompts.iter().enumerate() {
        if prompt.ids.is_empty() {
            return Err(ApiError::invalid(
                format!("prompt[{i}]"),
                "the prompt tokenizes to no tokens",
            ));
        }
        v::check_context(
            prompt.ids.len(),
            max_tokens as usize,
            info.max_context,
            "prompt",
        )?;
    }
    let n = resolved.n;
    let mut requests = Vec::with_capacity(prompts.len() * n);
    for (p, prompt) in prompts.iter().enumerate() {
        for i in 0..n {
            let mut params = resolved.params.clone();
            params.seed = params.seed.map(|s| s.wrapping_add(i as u64));
            requests.push((
                p * n + i,
                GenerateRequest {
                    prompt: prompt.ids.clone(),
                    params,
                },
            ));
        }
    }
    let seqs = generate::submit_all(&state, requests, "prompt")?;
    let prompt_tokens: usize = prompts.iter().map(|p| p.ids.len()).sum();
    counter!(m::PROMPT_TOKENS).increment(prompt_tokens as u64);
    let id = format!("cmpl-{}", crate::random_id());
    let created = unix_now();
    let format = CompletionFormat {
        id,
        created,
        model: info.name.clone(),
        state: state.clone(),
        prompts,
        n,
        echo,
        logprobs: logprobs.is_some(),
        include_usage: resolved.include_usage,
        offsets: vec![TextOffsets::default(); seqs.len()],
    };
    if resolved.stream {
        return Ok(generate::stream_response(
            &state,
            seqs,
            format,
            resolved.include_usage,
            prompt_tokens,
            permit,
            timing,
        ));
    }
    let outputs = generate::collect_all(&state, seqs, &mut timing).await?;
    drop(permit);
    let completion_tokens: usize = outputs
        .iter()
        .map(|o| o.finish.usage.completion_tokens)
        .sum();
    let choices: Vec<Value> = outputs
        .into_iter()
        .enumerate()
        .map(|(index, out)| format.choice(index, out))
        .collect();
    Ok(Json(json!({
        "id": format.id,
        "object": "text_completion",
        "created": created,
        "model": format.model,
        "choices": choices,
        "usage": usage_json(prompt_tokens, completion_tokens),
    }))
    .into_response())
}

/// Builds OpenAI's legacy `logprobs` object incrementally.
#[derive(Default)]
struct LegacyLogprobs {
    tokens: Vec<Value>,
    token_logprobs: Vec<Value>,
    top_logprobs: Vec<Value>,
    text_offset: Vec<Value>,
}

impl LegacyLogprobs {
    /// Adds one position; `lp` `None` is a position with nothing before it (the first prompt
    /// token). The sampled or scored token is always among `top_logprobs`, as in OpenAI.
    fn push(
        &mut self,
        state: &AppState,
        token: u32,
        lp: Option<&TokenLogprob>,
        offsets: &mut TextOffsets,
    ) {
        let backend = state.backend();
        let text = backend.token_text(token);
        self.text_offset
            .push(json!(offsets.next(&token_bytes(&text))));
        match lp {
            None => {
                self.token_logprobs.push(Value::Null);
                self.top_logprobs.push(Value::Null);
            }
            Some(lp) => {
                self.token_logprobs.push(json!(lp.logprob));
                let mut top = Map::new();
                for &(id, logprob) in &lp.top_logprobs {
                    top.entry(backend.token_text(id)).or_insert(json!(logprob));
                }
                top.entry(text.clone()).or_insert(json!(lp.logprob));
                self.top_logprobs.push(Value::Object(top));
            }
        }
        self.tokens.push(json!(text));
    }

    fn into_json(self) -> Value {
        json!({
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        })
    }
}

struct CompletionFormat {
    id: String,
    created: u64,
    model: String,
    state: AppState,
    prompts: Vec<Prompt>,
    n: usize,
    echo: bool,
    logprobs: bool,
    include_usage: bool,
    /// Running `text_offset` of each choice's stream.
    offsets: Vec<TextOffsets>,
}

impl CompletionFormat {
    fn prompt_of(&self, index: usize) -> &Prompt {
        &self.prompts[index / self.n]
    }

    /// Choice `index`'s running offsets, taken out while `self` is borrowed (put them back).
    fn take_offsets(&mut self, index: usize) -> TextOffsets {
        std::mem::take(&mut self.offsets[index])
    }

    /// Prompt positions of `echo` + `logprobs`.
    fn prompt_positions(
        &self,
        index: usize,
        prompt_logprobs: Option<&[Option<TokenLogprob>]>,
        out: &mut LegacyLogprobs,
        offsets: &mut TextOffsets,
    ) {
        let prompt = self.prompt_of(index);
        for (pos, &token) in prompt.ids.iter().enumerate() {
            let lp = prompt_logprobs
                .and_then(|lps| lps.get(pos))
                .and_then(Option::as_ref);
            out.push(&self.state, token, lp, offsets);
        }
    }

    /// One choice of a JSON (non-streamed) response.
    fn choice(&self, index: usize, out: Output) -> Value {
        let mut text = String::new();
        if self.echo {
            text.push_str(&self.prompt_of(index).text);
        }
        text.push_str(&out.text);
        let logprobs = self.logprobs.then(|| {
            let mut lps = LegacyLogprobs::default();
            let mut offsets = TextOffsets::default();
            if self.echo {
                self.prompt_positions(
                    index,
                    out.prompt_logprobs.as_deref(),
                    &mut lps,
                    &mut offsets,
                );
            }
            for (&token, lp) in out.tokens.iter().zip(&out.logprobs) {
                lps.push(&self.state, token, lp.as_ref(), &mut offsets);
            }
            lps.into_json()
        });
        json!({
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason(out.finish.reason),
            "stop_reason": stop_reason(out.finish.stop.as_ref()),
        })
    }

    fn chunk(
        &self,
        index: usize,
        text: String,
        logprobs: Option<Value>,
        finish: Option<&str>,
    ) -> Value {
        let mut chunk = json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [{
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish,
            }],
        });
        if self.include_usage {
            chunk["usage"] = Value::Null;
        }
        chunk
    }
}

impl ChunkFormat for CompletionFormat {
    fn start(&mut self, index: usize) -> Vec<Value> {
        if self.echo && !self.logprobs {
            let text = self.prompt_of(index).text.clone();
            vec![self.chunk(index, text, None, None)]
        } else {
            Vec::new()
        }
    }

    fn prompt_logprobs(&mut self, index: usize, logprobs: Vec<Option<TokenLogprob>>) -> Vec<Value> {
        if !(self.echo && self.logprobs) {
            return Vec::new();
        }
        let mut lps = LegacyLogprobs::default();
        let mut offsets = self.take_offsets(index);
        self.prompt_positions(index, Some(&logprobs), &mut lps, &mut offsets);
        self.offsets[index] = offsets;
        let text = self.prompt_of(index).text.clone();
        vec![self.chunk(index, text, Some(lps.into_json()), None)]
    }

    fn token(&mut self, index: usize, token: TokenEvent) -> Option<Value> {
        let logprobs = self.logprobs.then(|| {
            let mut lps = LegacyLogprobs::default();
            let mut offsets = self.take_offsets(index);
            lps.push(
                &self.state,
                token.token,
                token.logprob.as_ref(),
                &mut offsets,
            );
            self.offsets[index] = offsets;
            lps.into_json()
        });
        if token.text.is_empty() && logprobs.is_none() {
            return None;
        }
        Some(self.chunk(index, token.text, logprobs, None))
    }

    fn finish(&mut self, index: usize, finish: &FinishEvent) -> Value {
        let mut chunk = self.chunk(
            index,
            finish.text.clone(),
            None,
            Some(finish_reason(finish.reason)),
        );
        chunk["choices"][0]["stop_reason"] = stop_reason(finish.stop.as_ref());
        chunk
    }

    fn usage(&mut self, prompt_tokens: usize, completion_tokens: usize) -> Value {
        json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage_json(prompt_tokens, completion_tokens),
        })
    }
}
