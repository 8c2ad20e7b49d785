//! `POST /v1/completions`: prompts as a string, strings, token ids or lists of token ids; `echo`
//! with `logprobs` scores the prompt (first token `null`), the way evaluation harnesses compute
//! log-likelihoods with `max_tokens: 0`.
//!
//! A request goes: JSON shape ([`CompletionPlan::read`]) -> admission -> text prompts tokenized
//! ([`crate::prompt_text`]) -> the engine validates and queues every prompt times `n` -> a JSON
//! body or an SSE stream ([`CompletionFormat`]).

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use metrics::counter;
use rackfill_engine::{FinishEvent, GenerateRequest, TokenEvent, TokenLogprob};
use serde_json::Value;

use crate::api_error::{ApiError, PromptField};
use crate::api_types::{
    cached_prompt_tokens, finish_reason, ApiStopReason, ChunkUsage, CompletionChoice,
    CompletionChunk, CompletionRequest, CompletionResponse, LegacyLogprobs, Usage,
};
use crate::generate::{self, ChunkFormat, Output, Timing};
use crate::metrics as m;
use crate::params::{common_params, CommonParams, Resolved, StreamUsage};
use crate::request_json;
use crate::token_text::{token_bytes, TextOffsets};
use crate::{prompt_text, unix_now, AppState};

/// Most sequences (prompts times `n`) one request may ask for.
pub const MAX_SEQUENCES_PER_REQUEST: usize = 1024;

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

/// A request read from its JSON: everything but the prompts' token ids.
struct CompletionPlan {
    inputs: Vec<PromptInput>,
    resolved: Resolved,
    echo: bool,
    user: Option<String>,
}

impl CompletionPlan {
    /// The JSON's shape: the model, the prompt forms, the shared fields, and the fields only a
    /// completion has. The values' ranges are checked by the engine once the prompts are
    /// tokenized.
    fn read(state: &AppState, request: CompletionRequest) -> Result<Self, ApiError> {
        request_json::check_model(request.model.as_deref(), &state.backend().info().name)?;
        let inputs = parse_prompt(&request.prompt)?;
        let mut resolved = common_params!(request).resolve(state)?;
        if request.best_of.is_some_and(|b| b != resolved.n as i64) {
            return Err(ApiError::invalid(
                "best_of",
                "`best_of` other than `n` is not supported",
            ));
        }
        if request.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid("suffix", "`suffix` is not supported"));
        }
        let max_tokens = request.max_tokens.unwrap_or(16);
        let max_tokens = request_json::int_in("max_tokens", max_tokens, 0, u32::MAX.into())?;
        let logprobs = request
            .logprobs
            .map(|n| request_json::int_in("logprobs", n, 0, u32::MAX.into()))
            .transpose()?
            .map(|n| n as u32);
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
        let echo = request.echo.unwrap_or(false);
        resolved.params.max_tokens = max_tokens as u32;
        resolved.params.logprobs = logprobs;
        resolved.params.prompt_logprobs = if echo { logprobs } else { None };
        let limits = &state.backend().info().limits;
        limits
            .check_sampling(&resolved.params)
            .map_err(|e| ApiError::from_request(e, PromptField::Prompt { n: resolved.n }))?;
        Ok(Self {
            inputs,
            resolved,
            echo,
            user: request.user,
        })
    }

    /// Every prompt times `n`, in choice order; choice `i` of a prompt seeds with `seed + i`.
    fn sequences(&self, prompts: &[Prompt]) -> Vec<GenerateRequest> {
        let n = self.resolved.n;
        prompts
            .iter()
            .flat_map(|prompt| {
                (0..n).map(|i| {
                    let mut params = self.resolved.params.clone();
                    params.seed = params.seed.map(|s| s.wrapping_add(i as u64));
                    GenerateRequest {
                        prompt: prompt.ids.clone(),
                        params,
                    }
                })
            })
            .collect()
    }
}

/// A tokenized prompt and the text `echo` returns for it (a text prompt's own text; the
/// decoded ids of a token-id prompt, filled in only when `echo` needs it).
struct Prompt {
    ids: Vec<u32>,
    text: Option<String>,
}

/// Tokenizes text prompts (with the tokenizer's special tokens, as vLLM does), each bounded by
/// the engine's cheap length check first ([`prompt_text::tokenize`]).
async fn tokenize(
    state: &AppState,
    inputs: Vec<PromptInput>,
    max_tokens: usize,
    field: PromptField,
) -> Result<Vec<Prompt>, ApiError> {
    let mut prompts = Vec::with_capacity(inputs.len());
    for input in inputs {
        prompts.push(match input {
            PromptInput::Text(text) => {
                let (text, ids) =
                    prompt_text::tokenize(state, text, true, max_tokens, field).await?;
                Prompt {
                    ids,
                    text: Some(text),
                }
            }
            PromptInput::Tokens(ids) => Prompt { ids, text: None },
        });
    }
    Ok(prompts)
}

/// Decodes the token-id prompts whose text `echo` returns, off the async runtime.
async fn decode_for_echo(
    state: &AppState,
    mut prompts: Vec<Prompt>,
) -> Result<Vec<Prompt>, ApiError> {
    if prompts.iter().all(|p| p.text.is_some()) {
        return Ok(prompts);
    }
    let backend = state.backend().clone();
    tokio::task::spawn_blocking(move || {
        for prompt in prompts.iter_mut().filter(|p| p.text.is_none()) {
            prompt.text = Some(backend.detokenize(&prompt.ids).unwrap_or_default());
        }
        prompts
    })
    .await
    .map_err(|e| ApiError::Internal(format!("decoding the prompt failed: {e}")))
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
    let mut plan = CompletionPlan::read(&state, request_json::parse_json(&body)?)?;
    state.check_draining()?;
    let permit = state.admit()?;
    let mut timing = Timing::start();
    tracing::debug!(user = plan.user.as_deref().unwrap_or(""), "completion");

    let field = PromptField::Prompt { n: plan.resolved.n };
    let max_tokens = plan.resolved.params.max_tokens as usize;
    let inputs = std::mem::take(&mut plan.inputs);
    let prompts = tokenize(&state, inputs, max_tokens, field).await?;
    let seqs = generate::submit(
        &state,
        plan.sequences(&prompts),
        field,
        plan.resolved.export_kv,
    )?;
    let prompts = if plan.echo {
        decode_for_echo(&state, prompts).await?
    } else {
        prompts
    };
    let format = CompletionFormat::new(&state, &plan, prompts);
    counter!(m::PROMPT_TOKENS).increment(format.prompt_tokens() as u64);
    if plan.resolved.stream {
        return Ok(generate::stream_response(
            &state, seqs, format, permit, timing,
        ));
    }
    let outputs = generate::collect_all(&state, seqs, &mut timing).await?;
    drop(permit);
    Ok(Json(format.response(outputs)).into_response())
}

/// Adds one position to OpenAI's legacy `logprobs`; `lp` `None` is a position with nothing
/// before it (the first prompt token). The sampled or scored token is always among
/// `top_logprobs`, as in OpenAI.
fn push_logprob(
    out: &mut LegacyLogprobs,
    state: &AppState,
    token: u32,
    lp: Option<&TokenLogprob>,
    offsets: &mut TextOffsets,
) {
    let backend = state.backend();
    let text = backend.token_text(token);
    out.text_offset.push(offsets.next(&token_bytes(&text)));
    match lp {
        None => {
            out.token_logprobs.push(None);
            out.top_logprobs.push(None);
        }
        Some(lp) => {
            out.token_logprobs.push(Some(f64::from(lp.logprob)));
            let mut top = std::collections::BTreeMap::new();
            for &(id, logprob) in &lp.top_logprobs {
                top.entry(backend.token_text(id))
                    .or_insert(f64::from(logprob));
            }
            top.entry(text.clone()).or_insert(f64::from(lp.logprob));
            out.top_logprobs.push(Some(top));
        }
    }
    out.tokens.push(text);
}

/// Builds a completion's response, whole or chunk by chunk, and counts its usage.
struct CompletionFormat {
    id: String,
    created: u64,
    model: String,
    state: AppState,
    prompts: Vec<Prompt>,
    n: usize,
    echo: bool,
    logprobs: bool,
    usage: StreamUsage,
    /// Running `text_offset` of each choice's stream.
    offsets: Vec<TextOffsets>,
    /// Tokens generated so far, per choice.
    generated: Vec<usize>,
    /// Prompt tokens reused from the prefix cache, per finished choice.
    cached: Vec<usize>,
}

impl CompletionFormat {
    fn new(state: &AppState, plan: &CompletionPlan, prompts: Vec<Prompt>) -> Self {
        let choices = prompts.len() * plan.resolved.n;
        Self {
            id: format!("cmpl-{}", crate::random_id()),
            created: unix_now(),
            model: state.backend().info().name.clone(),
            state: state.clone(),
            prompts,
            n: plan.resolved.n,
            echo: plan.echo,
            logprobs: plan.resolved.params.logprobs.is_some(),
            usage: plan.resolved.usage,
            offsets: vec![TextOffsets::default(); choices],
            generated: vec![0; choices],
            cached: vec![0; choices],
        }
    }

    fn prompt_of(&self, index: usize) -> &Prompt {
        &self.prompts[index / self.n]
    }

    fn prompt_text(&self, index: usize) -> String {
        self.prompt_of(index).text.clone().unwrap_or_default()
    }

    /// Prompt tokens of the request: each prompt once, whatever its `n` (as OpenAI counts).
    fn prompt_tokens(&self) -> usize {
        self.prompts.iter().map(|p| p.ids.len()).sum()
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
            push_logprob(out, &self.state, token, lp, offsets);
        }
    }

    /// The whole (non-streamed) response.
    fn response(&self, outputs: Vec<Output>) -> CompletionResponse {
        let kv_transfer_params = outputs.first().and_then(|o| o.finish.kv_transfer.clone());
        let completion_tokens = outputs
            .iter()
            .map(|o| o.finish.usage.completion_tokens)
            .sum();
        let cached: Vec<usize> = outputs
            .iter()
            .map(|o| o.finish.usage.cached_tokens)
            .collect();
        let cached = cached_prompt_tokens(&cached, self.n);
        CompletionResponse {
            choices: outputs
                .into_iter()
                .enumerate()
                .map(|(index, out)| self.choice(index, out))
                .collect(),
            created: self.created,
            id: self.id.clone(),
            model: self.model.clone(),
            object: "text_completion",
            usage: Usage::new(self.prompt_tokens(), completion_tokens, cached),
            kv_transfer_params,
        }
    }

    /// One choice of the whole response.
    fn choice(&self, index: usize, out: Output) -> CompletionChoice {
        let mut text = if self.echo {
            self.prompt_text(index)
        } else {
            String::new()
        };
        text.push_str(&out.text);
        let logprobs = self.logprobs.then(|| {
            let mut lps = LegacyLogprobs::default();
            let mut offsets = TextOffsets::default();
            if self.echo {
                let prompt_logprobs = out.prompt_logprobs.as_deref();
                self.prompt_positions(index, prompt_logprobs, &mut lps, &mut offsets);
            }
            for (&token, lp) in out.tokens.iter().zip(&out.logprobs) {
                push_logprob(&mut lps, &self.state, token, lp.as_ref(), &mut offsets);
            }
            lps
        });
        CompletionChoice {
            finish_reason: Some(finish_reason(out.finish.reason)),
            index,
            logprobs,
            stop_reason: Some(ApiStopReason(out.finish.stop)),
            text,
        }
    }

    /// A chunk with one choice's delta.
    fn chunk(&self, choice: CompletionChoice) -> CompletionChunk {
        let usage = match self.usage {
            StreamUsage::None => ChunkUsage::Omitted,
            StreamUsage::Closing => ChunkUsage::Null,
            StreamUsage::Continuous => ChunkUsage::Counts(Usage::new(
                self.prompt_of(choice.index).ids.len(),
                self.generated[choice.index],
                self.cached[choice.index],
            )),
        };
        CompletionChunk {
            choices: vec![choice],
            created: self.created,
            id: self.id.clone(),
            model: self.model.clone(),
            object: "text_completion",
            usage,
            kv_transfer_params: None,
        }
    }

    fn delta(index: usize, text: String, logprobs: Option<LegacyLogprobs>) -> CompletionChoice {
        CompletionChoice {
            finish_reason: None,
            index,
            logprobs,
            stop_reason: None,
            text,
        }
    }
}

impl ChunkFormat for CompletionFormat {
    type Chunk = CompletionChunk;

    fn start(&mut self, index: usize) -> Vec<CompletionChunk> {
        if self.echo && !self.logprobs {
            let text = self.prompt_text(index);
            vec![self.chunk(Self::delta(index, text, None))]
        } else {
            Vec::new()
        }
    }

    fn prompt_logprobs(
        &mut self,
        index: usize,
        logprobs: Vec<Option<TokenLogprob>>,
    ) -> Vec<CompletionChunk> {
        if !(self.echo && self.logprobs) {
            return Vec::new();
        }
        let mut lps = LegacyLogprobs::default();
        let mut offsets = std::mem::take(&mut self.offsets[index]);
        self.prompt_positions(index, Some(&logprobs), &mut lps, &mut offsets);
        self.offsets[index] = offsets;
        let text = self.prompt_text(index);
        vec![self.chunk(Self::delta(index, text, Some(lps)))]
    }

    fn token(&mut self, index: usize, token: TokenEvent) -> Option<CompletionChunk> {
        self.generated[index] += 1;
        let logprobs = self.logprobs.then(|| {
            let mut lps = LegacyLogprobs::default();
            let offsets = &mut self.offsets[index];
            push_logprob(
                &mut lps,
                &self.state,
                token.token,
                token.logprob.as_ref(),
                offsets,
            );
            lps
        });
        if token.text.is_empty() && logprobs.is_none() {
            return None;
        }
        Some(self.chunk(Self::delta(index, token.text, logprobs)))
    }

    /// The finishing chunk carries the held-back text and no token; with logprobs it has an
    /// empty (well-formed) `logprobs` object, so clients can read every chunk's lists alike.
    fn finish(&mut self, index: usize, finish: &FinishEvent) -> CompletionChunk {
        self.generated[index] = finish.usage.completion_tokens;
        self.cached[index] = finish.usage.cached_tokens;
        let mut chunk = self.chunk(CompletionChoice {
            finish_reason: Some(finish_reason(finish.reason)),
            index,
            logprobs: self.logprobs.then(LegacyLogprobs::default),
            stop_reason: Some(ApiStopReason(finish.stop.clone())),
            text: finish.text.clone(),
        });
        chunk.kv_transfer_params = finish.kv_transfer.clone();
        chunk
    }

    fn closing_usage(&mut self) -> Option<CompletionChunk> {
        (self.usage != StreamUsage::None).then(|| CompletionChunk {
            choices: Vec::new(),
            created: self.created,
            id: self.id.clone(),
            model: self.model.clone(),
            object: "text_completion",
            kv_transfer_params: None,
            usage: ChunkUsage::Counts(Usage::new(
                self.prompt_tokens(),
                self.generated.iter().sum(),
                cached_prompt_tokens(&self.cached, self.n),
            )),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_keep_the_bytes_clients_got_from_json_maps() {
        let mut lps = LegacyLogprobs::default();
        lps.text_offset.push(0);
        lps.token_logprobs.push(Some(f64::from(-0.5f32)));
        lps.tokens.push("a".into());
        lps.top_logprobs
            .push(Some([("b".to_string(), f64::from(-1.1f32))].into()));
        let response = CompletionResponse {
            choices: vec![CompletionChoice {
                finish_reason: Some("length"),
                index: 0,
                logprobs: Some(lps),
                stop_reason: Some(ApiStopReason(None)),
                text: "a".into(),
            }],
            created: 7,
            id: "cmpl-1".into(),
            model: "m".into(),
            object: "text_completion",
            usage: Usage::new(3, 1, 0),
            kv_transfer_params: None,
        };
        assert_eq!(
            serde_json::to_string(&response).unwrap(),
            r#"{"choices":[{"finish_reason":"length","index":0,"logprobs":{"text_offset":[0],"token_logprobs":[-0.5],"tokens":["a"],"top_logprobs":[{"b":-1.100000023841858}]},"stop_reason":null,"text":"a"}],"created":7,"id":"cmpl-1","model":"m","object":"text_completion","usage":{"completion_tokens":1,"prompt_tokens":3,"total_tokens":4,"prompt_tokens_details":{"cached_tokens":0}}}"#
        );
    }
}
