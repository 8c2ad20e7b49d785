//! `POST /v1/chat/completions`: messages rendered with the model's chat template (off the async
//! runtime), then generated like a completion.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use metrics::counter;
use rackfill_engine::{FinishEvent, GenerateRequest, TokenEvent, TokenLogprob};
use rackfill_models::ChatMessage;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::generate::{self, finish_reason, stop_reason, usage_json, ChunkFormat, Timing};
use crate::metrics as m;
use crate::params::{common_params, CommonParams, StreamOptions};
use crate::token_text::token_bytes;
use crate::validation::{self as v, ApiError};
use crate::{unix_now, AppState, ChatRender};

/// The fields of an OpenAI chat request rackfill reads (unknown fields are ignored).
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Vec<MessageIn>,
    #[serde(default)]
    pub max_tokens: Option<i64>,
    #[serde(default)]
    pub max_completion_tokens: Option<i64>,
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
    pub logprobs: Option<bool>,
    #[serde(default)]
    pub top_logprobs: Option<i64>,
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
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    /// The deprecated form of `tools`.
    #[serde(default)]
    pub functions: Option<Vec<Value>>,
    /// The deprecated form of `tool_choice`.
    #[serde(default)]
    pub function_call: Option<Value>,
    #[serde(default)]
    pub response_format: Option<Value>,
    /// vLLM: end the prompt with the assistant header (default true).
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    /// vLLM: let the model continue the final message (default false).
    #[serde(default)]
    pub continue_final_message: Option<bool>,
    /// vLLM: extra chat template variables.
    #[serde(default)]
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// vLLM: return the final message's text before the generated text (not supported).
    #[serde(default)]
    pub echo: Option<bool>,
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

/// One message as sent.
#[derive(Debug, Deserialize)]
pub struct MessageIn {
    pub role: String,
    #[serde(default)]
    pub content: Option<Value>,
}

/// The rendering fields, checked: `add_generation_prompt` and `continue_final_message` exclude
/// each other (as in vLLM); `echo` is refused.
fn render_options(request: &ChatRequest) -> Result<ChatRender, ApiError> {
    if request.echo == Some(true) {
        return Err(ApiError::invalid(
            "echo",
            "`echo` is not supported on chat completions; use /v1/completions",
        ));
    }
    let continue_final_message = request.continue_final_message.unwrap_or(false);
    let add_generation_prompt = request
        .add_generation_prompt
        .unwrap_or(!continue_final_message);
    if add_generation_prompt && continue_final_message {
        return Err(ApiError::invalid(
            "continue_final_message",
            "`continue_final_message` and `add_generation_prompt` cannot both be true",
        ));
    }
    Ok(ChatRender {
        add_generation_prompt,
        continue_final_message,
        kwargs: request.chat_template_kwargs.clone().unwrap_or_default(),
    })
}

fn messages(input: &[MessageIn]) -> Result<Vec<ChatMessage>, ApiError> {
    if input.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must not be empty",
        ));
    }
    input
        .iter()
        .enumerate()
        .map(|(i, message)| {
            let role = match message.role.as_str() {
                "system" | "developer" => "system",
                "user" => "user",
                "assistant" => "assistant",
                other => {
                    return Err(ApiError::invalid(
                        format!("messages[{i}].role"),
                        format!(
                            "unsupported role `{}`: expected system, developer, user or \
                             assistant",
                            other.chars().take(64).collect::<String>()
                        ),
                    ))
                }
            };
            let content = match &message.content {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => {
                    let mut texts = Vec::with_capacity(parts.len());
                    for (j, part) in parts.iter().enumerate() {
                        match (part.get("type").and_then(Value::as_str), part.get("text")) {
                            (Some("text"), Some(Value::String(text))) => texts.push(text.as_str()),
                            _ => {
                                return Err(ApiError::invalid(
                                    format!("messages[{i}].content[{j}]"),
                                    "only text content parts (`{\"type\": \"text\", \"text\": \
                                     ...}`) are supported",
                                ))
                            }
                        }
                    }
                    texts.join("\n")
                }
                Some(_) => {
                    return Err(ApiError::invalid(
                        format!("messages[{i}].content"),
                        "`content` must be a string or an array of text parts",
                    ))
                }
            };
            Ok(ChatMessage {
                role: role.into(),
                content,
            })
        })
        .collect()
}

/// Tool calling is not supported: refuses tools (`tools`, or the deprecated `functions`) and
/// any `tool_choice` / `function_call` that would demand a call. `none` and `auto` are
/// accepted, since a plain text answer honours both when no tools are given.
fn check_no_tool_calls(request: &ChatRequest) -> Result<(), ApiError> {
    for (param, tools) in [("tools", &request.tools), ("functions", &request.functions)] {
        if tools.as_ref().is_some_and(|t| !t.is_empty()) {
            return Err(ApiError::invalid(param, "tool calling is not supported"));
        }
    }
    for (param, choice) in [
        ("tool_choice", &request.tool_choice),
        ("function_call", &request.function_call),
    ] {
        match choice {
            None | Some(Value::Null) => {}
            Some(Value::String(mode)) if mode == "none" || mode == "auto" => {}
            Some(_) => {
                return Err(ApiError::invalid(
                    param,
                    format!(
                        "tool calling is not supported: `{param}` may only be \"none\" or \"auto\""
                    ),
                ))
            }
        }
    }
    Ok(())
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
    let request: ChatRequest = v::parse_json(&body)?;
    let info = state.backend().info().clone();
    v::check_model(request.model.as_deref(), &info.name)?;
    let chat = messages(&request.messages)?;
    let common = common_params!(request);
    let mut resolved = common.resolve(&state)?;
    check_no_tool_calls(&request)?;
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
    let render = render_options(&request)?;
    let (max_param, max_tokens) = match (request.max_completion_tokens, request.max_tokens) {
        (Some(n), _) => ("max_completion_tokens", Some(n)),
        (None, n) => ("max_tokens", n),
    };
    let max_tokens = max_tokens
        .map(|n| v::int_in(max_param, n, 0, u32::MAX as i64))
        .transpose()?;
    let logprobs = request.logprobs.unwrap_or(false);
    let top_logprobs = request
        .top_logprobs
        .map(|n| v::int_in("top_logprobs", n, 0, 20))
        .transpose()?;
    if top_logprobs.is_some() && !logprobs {
        return Err(ApiError::invalid(
            "top_logprobs",
            "`top_logprobs` requires `logprobs: true`",
        ));
    }
    resolved.params.logprobs = logprobs.then_some(top_logprobs.unwrap_or(0) as u32);
    // Without a cap, `max_tokens` is known once the prompt is rendered (below): validate
    // against no cap now; the engine checks `min_tokens` against the real one at submit.
    resolved.params.max_tokens = max_tokens.map_or(u32::MAX, |n| n as u32);
    resolved
        .params
        .validate(info.vocab_size)
        .map_err(|e| ApiError::from_engine(e.into(), "messages"))?;
    if !info.has_chat_template {
        return Err(ApiError::invalid(
            "messages",
            format!(
                "the model `{}` has no chat template; use /v1/completions",
                info.name
            ),
        ));
    }
    state.check_draining()?;
    let permit = state.admit()?;
    let mut timing = Timing::start();
    tracing::debug!(
        user = request.user.as_deref().unwrap_or(""),
        "chat completion"
    );

    let backend = state.backend().clone();
    let prompt = tokio::task::spawn_blocking(move || {
        let text = backend
            .render_chat(&chat, &render)
            .map_err(|e| ApiError::invalid("messages", e))?;
        backend
            .tokenize(&text, false)
            .map_err(|e| ApiError::invalid("messages", e))
    })
    .await
    .map_err(|e| ApiError::Internal(format!("chat rendering failed: {e}")))??;
    if prompt.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "the chat renders to no tokens",
        ));
    }
    let max_tokens = match max_tokens {
        Some(n) => n as usize,
        // As vLLM: whatever room the context leaves, capped by the model's own default.
        None => {
            let room = info.max_context.saturating_sub(prompt.len()).max(1);
            info.generation
                .max_new_tokens
                .map_or(room, |cap| room.min(cap as usize))
        }
    };
    v::check_context(prompt.len(), max_tokens, info.max_context, "messages")?;
    resolved.params.max_tokens = max_tokens as u32;
    let n = resolved.n;
    let requests = (0..n)
        .map(|i| {
            let mut params = resolved.params.clone();
            params.seed = params.seed.map(|s| s.wrapping_add(i as u64));
            (
                i,
                GenerateRequest {
                    prompt: prompt.clone(),
                    params,
                },
            )
        })
        .collect();
    let seqs = generate::submit_all(&state, requests, "messages")?;
    counter!(m::PROMPT_TOKENS).increment(prompt.len() as u64);
    let format = ChatFormat {
        id: format!("chatcmpl-{}", crate::random_id()),
        created: unix_now(),
        model: info.name.clone(),
        state: state.clone(),
        logprobs,
        include_usage: resolved.include_usage,
    };
    if resolved.stream {
        return Ok(generate::stream_response(
            &state,
            seqs,
            format,
            resolved.include_usage,
            prompt.len(),
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
        .map(|(index, out)| {
            let logprobs = logprobs.then(|| {
                let content: Vec<Value> = out
                    .tokens
                    .iter()
                    .zip(&out.logprobs)
                    .map(|(&token, lp)| format.logprob_entry(token, lp.as_ref()))
                    .collect();
                json!({ "content": content, "refusal": null })
            });
            json!({
                "index": index,
                "message": { "role": "assistant", "content": out.text, "refusal": null },
                "logprobs": logprobs,
                "finish_reason": finish_reason(out.finish.reason),
                "stop_reason": stop_reason(out.finish.stop.as_ref()),
            })
        })
        .collect();
    let body = json!({
        "id": format.id,
        "object": "chat.completion",
        "created": format.created,
        "model": format.model,
        "system_fingerprint": null,
        "choices": choices,
        "usage": usage_json(prompt.len(), completion_tokens),
    });
    Ok(Json(body).into_response())
}

struct ChatFormat {
    id: String,
    created: u64,
    model: String,
    state: AppState,
    logprobs: bool,
    include_usage: bool,
}

impl ChatFormat {
    fn logprob_entry(&self, token: u32, lp: Option<&TokenLogprob>) -> Value {
        let backend = self.state.backend();
        let text = backend.token_text(token);
        let top: Vec<Value> = lp
            .map(|lp| {
                lp.top_logprobs
                    .iter()
                    .map(|&(id, logprob)| {
                        let t = backend.token_text(id);
                        json!({ "token": t, "logprob": logprob, "bytes": token_bytes(&t) })
                    })
                    .collect()
            })
            .unwrap_or_default();
        json!({
            "token": text,
            "logprob": lp.map(|lp| lp.logprob),
            "bytes": token_bytes(&text),
            "top_logprobs": top,
        })
    }

    fn chunk(
        &self,
        index: usize,
        delta: Value,
        logprobs: Option<Value>,
        finish: Option<&str>,
    ) -> Value {
        let mut chunk = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": null,
            "choices": [{
                "index": index,
                "delta": delta,
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

impl ChunkFormat for ChatFormat {
    fn start(&mut self, index: usize) -> Vec<Value> {
        vec![self.chunk(
            index,
            json!({ "role": "assistant", "content": "" }),
            None,
            None,
        )]
    }

    fn prompt_logprobs(
        &mut self,
        _index: usize,
        _logprobs: Vec<Option<TokenLogprob>>,
    ) -> Vec<Value> {
        Vec::new()
    }

    fn token(&mut self, index: usize, token: TokenEvent) -> Option<Value> {
        let logprobs = self.logprobs.then(
            || json!({ "content": [self.logprob_entry(token.token, token.logprob.as_ref())] }),
        );
        if token.text.is_empty() && logprobs.is_none() {
            return None;
        }
        Some(self.chunk(index, json!({ "content": token.text }), logprobs, None))
    }

    fn finish(&mut self, index: usize, finish: &FinishEvent) -> Value {
        let delta = if finish.text.is_empty() {
            json!({})
        } else {
            json!({ "content": finish.text })
        };
        let mut chunk = self.chunk(index, delta, None, Some(finish_reason(finish.reason)));
        chunk["choices"][0]["stop_reason"] = stop_reason(finish.stop.as_ref());
        chunk
    }

    fn usage(&mut self, prompt_tokens: usize, completion_tokens: usize) -> Value {
        json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": null,
            "choices": [],
            "usage": usage_json(prompt_tokens, completion_tokens),
        })
    }
}
