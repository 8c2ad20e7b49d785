//! `POST /v1/chat/completions`: messages rendered with the model's chat template
//! ([`crate::chat_prompt`]), then generated like a completion.
//!
//! A request goes: JSON shape ([`ChatPlan::read`]) -> admission -> the chat rendered and
//! tokenized -> `max_tokens` settled -> the engine validates and queues `n` sequences -> a JSON
//! body or an SSE stream ([`ChatFormat`]).

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use metrics::counter;
use rackfill_engine::{FinishEvent, GenerateRequest, TokenEvent, TokenLogprob};
use rackfill_models::ChatMessage;
use serde_json::Value;

use crate::api_error::{ApiError, PromptField};
use crate::api_types::{
    cached_prompt_tokens, finish_reason, ApiStopReason, ChatChoice, ChatChunk, ChatChunkChoice,
    ChatChunkLogprobs, ChatLogprobEntry, ChatLogprobs, ChatRequest, ChatResponse, ChunkUsage,
    Delta, MessageOut, TopLogprob, Usage,
};
use crate::chat_prompt;
use crate::generate::{self, ChunkFormat, Output, Timing};
use crate::metrics as m;
use crate::params::{common_params, CommonParams, Resolved, StreamUsage};
use crate::request_json;
use crate::token_text::token_bytes;
use crate::{prompt_text, unix_now, AppState, ChatRender};

/// A chat request read from its JSON: everything but the prompt's tokens.
struct ChatPlan {
    chat: Vec<ChatMessage>,
    render: ChatRender,
    resolved: Resolved,
    /// `max_completion_tokens` or `max_tokens`; without either, whatever room the context
    /// leaves (capped by the model's `max_new_tokens`), as vLLM does.
    max_tokens: Option<u32>,
    logprobs: bool,
    user: Option<String>,
}

impl ChatPlan {
    /// The JSON's shape: the model, the messages, the shared fields, the chat-only fields. The
    /// values' ranges are checked by the engine once the prompt is tokenized.
    fn read(state: &AppState, request: ChatRequest) -> Result<Self, ApiError> {
        request_json::check_model(request.model.as_deref(), &state.backend().info().name)?;
        let chat = chat_prompt::messages(&request.messages)?;
        let mut resolved = common_params!(request).resolve(state)?;
        chat_prompt::refuse_tool_calls(
            [
                ("tools", request.tools.as_ref()),
                ("functions", request.functions.as_ref()),
            ],
            [
                ("tool_choice", request.tool_choice.as_ref()),
                ("function_call", request.function_call.as_ref()),
            ],
        )?;
        match &request.response_format {
            None | Some(Value::Null) => {}
            Some(format) if format.get("type").and_then(Value::as_str) == Some("text") => {}
            Some(_) => {
                return Err(ApiError::invalid(
                    "response_format",
                    "only `{\"type\": \"text\"}` is supported",
                ))
            }
        }
        if request.echo == Some(true) {
            return Err(ApiError::invalid(
                "echo",
                "`echo` is not supported on chat completions; use /v1/completions",
            ));
        }
        let render = chat_prompt::render_options(
            request.add_generation_prompt,
            request.continue_final_message,
            request.chat_template_kwargs.as_ref(),
        )?;
        let (max_param, max_tokens) = match (request.max_completion_tokens, request.max_tokens) {
            (Some(n), _) => ("max_completion_tokens", Some(n)),
            (None, n) => ("max_tokens", n),
        };
        let max_tokens = max_tokens
            .map(|n| request_json::int_in(max_param, n, 0, u32::MAX.into()))
            .transpose()?
            .map(|n| n as u32);
        let logprobs = request.logprobs.unwrap_or(false);
        let top_logprobs = request
            .top_logprobs
            .map(|n| request_json::int_in("top_logprobs", n, 0, u32::MAX.into()))
            .transpose()?;
        if top_logprobs.is_some() && !logprobs {
            return Err(ApiError::invalid(
                "top_logprobs",
                "`top_logprobs` requires `logprobs: true`",
            ));
        }
        resolved.params.logprobs = logprobs.then_some(top_logprobs.unwrap_or(0) as u32);
        // Checked now, before admission; an absent max_tokens is filled from the prompt later
        // (and the whole request checked again), so it cannot fail this check.
        let mut params = resolved.params.clone();
        params.max_tokens = max_tokens.unwrap_or(u32::MAX);
        let limits = &state.backend().info().limits;
        limits
            .check_sampling(&params)
            .map_err(|e| ApiError::from_request(e, PromptField::Messages))?;
        chat_prompt::require_template(state)?;
        Ok(Self {
            chat,
            render,
            resolved,
            max_tokens,
            logprobs,
            user: request.user,
        })
    }

    /// `max_tokens` for a prompt of `prompt_tokens`: the requested one, or the room the context
    /// leaves (at least 1, so an overlong prompt still gets its context-length error).
    fn max_tokens_for(&self, state: &AppState, prompt_tokens: usize) -> u32 {
        self.max_tokens.unwrap_or_else(|| {
            let info = state.backend().info();
            let room = info.limits.max_context.saturating_sub(prompt_tokens).max(1);
            let room = u32::try_from(room).unwrap_or(u32::MAX);
            info.generation
                .max_new_tokens
                .map_or(room, |cap| room.min(cap))
        })
    }

    /// The `n` choices of `prompt`; choice `i` seeds with `seed + i`.
    fn sequences(&self, prompt: &[u32]) -> Vec<GenerateRequest> {
        (0..self.resolved.n)
            .map(|i| {
                let mut params = self.resolved.params.clone();
                params.seed = params.seed.map(|s| s.wrapping_add(i as u64));
                GenerateRequest {
                    prompt: prompt.to_vec(),
                    params,
                }
            })
            .collect()
    }
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
    let mut plan = ChatPlan::read(&state, request_json::parse_json(&body)?)?;
    state.check_draining()?;
    let permit = state.admit()?;
    let mut timing = Timing::start();
    tracing::debug!(user = plan.user.as_deref().unwrap_or(""), "chat completion");

    let chat = std::mem::take(&mut plan.chat);
    let text = chat_prompt::render(&state, chat, plan.render.clone()).await?;
    let bound_max_tokens = plan.max_tokens.map_or(1, |n| n as usize);
    let field = PromptField::Messages;
    let (_, prompt) = prompt_text::tokenize(&state, text, false, bound_max_tokens, field).await?;
    plan.resolved.params.max_tokens = plan.max_tokens_for(&state, prompt.len());
    let seqs = generate::submit(
        &state,
        plan.sequences(&prompt),
        field,
        plan.resolved.export_kv,
    )?;
    counter!(m::PROMPT_TOKENS).increment(prompt.len() as u64);
    let format = ChatFormat::new(&state, &plan, prompt.len());
    if plan.resolved.stream {
        return Ok(generate::stream_response(
            &state, seqs, format, permit, timing,
        ));
    }
    let outputs = generate::collect_all(&state, seqs, &mut timing).await?;
    drop(permit);
    Ok(Json(format.response(outputs)).into_response())
}

/// Builds a chat's response, whole or chunk by chunk, and counts its usage.
struct ChatFormat {
    id: String,
    created: u64,
    model: String,
    state: AppState,
    logprobs: bool,
    usage: StreamUsage,
    prompt_tokens: usize,
    /// Tokens generated so far, per choice.
    generated: Vec<usize>,
    /// Prompt tokens reused from the prefix cache, per finished choice.
    cached: Vec<usize>,
}

impl ChatFormat {
    fn new(state: &AppState, plan: &ChatPlan, prompt_tokens: usize) -> Self {
        Self {
            id: format!("chatcmpl-{}", crate::random_id()),
            created: unix_now(),
            model: state.backend().info().name.clone(),
            state: state.clone(),
            logprobs: plan.logprobs,
            usage: plan.resolved.usage,
            prompt_tokens,
            generated: vec![0; plan.resolved.n],
            cached: vec![0; plan.resolved.n],
        }
    }

    fn logprob_entry(&self, token: u32, lp: Option<&TokenLogprob>) -> ChatLogprobEntry {
        let backend = self.state.backend();
        let text = backend.token_text(token);
        let top_logprobs = lp
            .map(|lp| {
                lp.top_logprobs
                    .iter()
                    .map(|&(id, logprob)| {
                        let token = backend.token_text(id);
                        TopLogprob {
                            bytes: token_bytes(&token),
                            logprob: f64::from(logprob),
                            token,
                        }
                    })
                    .collect()
            })
            .unwrap_or_default();
        ChatLogprobEntry {
            bytes: token_bytes(&text),
            logprob: lp.map(|lp| f64::from(lp.logprob)),
            token: text,
            top_logprobs,
        }
    }

    /// The whole (non-streamed) response.
    fn response(&self, outputs: Vec<Output>) -> ChatResponse {
        let kv_transfer_params = outputs.first().and_then(|o| o.finish.kv_transfer.clone());
        let completion_tokens = outputs
            .iter()
            .map(|o| o.finish.usage.completion_tokens)
            .sum();
        let cached: Vec<usize> = outputs
            .iter()
            .map(|o| o.finish.usage.cached_tokens)
            .collect();
        let cached = cached_prompt_tokens(&cached, cached.len());
        ChatResponse {
            choices: outputs
                .into_iter()
                .enumerate()
                .map(|(index, out)| self.choice(index, out))
                .collect(),
            created: self.created,
            id: self.id.clone(),
            model: self.model.clone(),
            object: "chat.completion",
            system_fingerprint: None,
            usage: Usage::new(self.prompt_tokens, completion_tokens, cached),
            kv_transfer_params,
        }
    }

    fn choice(&self, index: usize, out: Output) -> ChatChoice {
        let logprobs = self.logprobs.then(|| ChatLogprobs {
            content: out
                .tokens
                .iter()
                .zip(&out.logprobs)
                .map(|(&token, lp)| self.logprob_entry(token, lp.as_ref()))
                .collect(),
            refusal: None,
        });
        ChatChoice {
            finish_reason: finish_reason(out.finish.reason),
            index,
            logprobs,
            message: MessageOut {
                content: out.text,
                refusal: None,
                role: "assistant",
            },
            stop_reason: ApiStopReason(out.finish.stop),
        }
    }

    /// A chunk with one choice's delta.
    fn chunk(&self, choice: ChatChunkChoice) -> ChatChunk {
        let usage = match self.usage {
            StreamUsage::None => ChunkUsage::Omitted,
            StreamUsage::Closing => ChunkUsage::Null,
            StreamUsage::Continuous => ChunkUsage::Counts(Usage::new(
                self.prompt_tokens,
                self.generated[choice.index],
                self.cached[choice.index],
            )),
        };
        ChatChunk {
            choices: vec![choice],
            created: self.created,
            id: self.id.clone(),
            model: self.model.clone(),
            object: "chat.completion.chunk",
            system_fingerprint: None,
            usage,
            kv_transfer_params: None,
        }
    }
}

impl ChunkFormat for ChatFormat {
    type Chunk = ChatChunk;

    fn start(&mut self, index: usize) -> Vec<ChatChunk> {
        let delta = Delta {
            content: Some(String::new()),
            role: Some("assistant"),
        };
        vec![self.chunk(ChatChunkChoice {
            delta,
            finish_reason: None,
            index,
            logprobs: None,
            stop_reason: None,
        })]
    }

    fn prompt_logprobs(&mut self, _index: usize, _: Vec<Option<TokenLogprob>>) -> Vec<ChatChunk> {
        Vec::new()
    }

    fn token(&mut self, index: usize, token: TokenEvent) -> Option<ChatChunk> {
        self.generated[index] += 1;
        let logprobs = self.logprobs.then(|| ChatChunkLogprobs {
            content: vec![self.logprob_entry(token.token, token.logprob.as_ref())],
        });
        if token.text.is_empty() && logprobs.is_none() {
            return None;
        }
        Some(self.chunk(ChatChunkChoice {
            delta: Delta {
                content: Some(token.text),
                role: None,
            },
            finish_reason: None,
            index,
            logprobs,
            stop_reason: None,
        }))
    }

    /// The finishing chunk carries the held-back text and no token; with logprobs it has an
    /// empty (well-formed) `logprobs` object.
    fn finish(&mut self, index: usize, finish: &FinishEvent) -> ChatChunk {
        self.generated[index] = finish.usage.completion_tokens;
        self.cached[index] = finish.usage.cached_tokens;
        let content = (!finish.text.is_empty()).then(|| finish.text.clone());
        let mut chunk = self.chunk(ChatChunkChoice {
            delta: Delta {
                content,
                role: None,
            },
            finish_reason: Some(finish_reason(finish.reason)),
            index,
            logprobs: self.logprobs.then(|| ChatChunkLogprobs {
                content: Vec::new(),
            }),
            stop_reason: Some(ApiStopReason(finish.stop.clone())),
        });
        chunk.kv_transfer_params = finish.kv_transfer.clone();
        chunk
    }

    fn closing_usage(&mut self) -> Option<ChatChunk> {
        (self.usage != StreamUsage::None).then(|| ChatChunk {
            choices: Vec::new(),
            created: self.created,
            id: self.id.clone(),
            model: self.model.clone(),
            object: "chat.completion.chunk",
            system_fingerprint: None,
            kv_transfer_params: None,
            usage: ChunkUsage::Counts(Usage::new(
                self.prompt_tokens,
                self.generated.iter().sum(),
                cached_prompt_tokens(&self.cached, self.cached.len()),
            )),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_keep_the_bytes_clients_got_from_json_maps() {
        let chunk = ChatChunk {
            choices: vec![ChatChunkChoice {
                delta: Delta {
                    content: Some(String::new()),
                    role: Some("assistant"),
                },
                finish_reason: None,
                index: 0,
                logprobs: None,
                stop_reason: None,
            }],
            created: 7,
            id: "chatcmpl-1".into(),
            model: "m".into(),
            object: "chat.completion.chunk",
            system_fingerprint: None,
            usage: ChunkUsage::Null,
            kv_transfer_params: None,
        };
        assert_eq!(
            serde_json::to_string(&chunk).unwrap(),
            r#"{"choices":[{"delta":{"content":"","role":"assistant"},"finish_reason":null,"index":0,"logprobs":null}],"created":7,"id":"chatcmpl-1","model":"m","object":"chat.completion.chunk","system_fingerprint":null,"usage":null}"#
        );
    }
}
