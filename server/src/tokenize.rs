//! vLLM's tokenizer routes, beside `/v1` as in vLLM and behind the same API key:
//! `POST /tokenize` (a prompt, or chat messages rendered with the template), `POST /detokenize`
//! and `GET /tokenizer_info` (evaluation harnesses with a remote tokenizer probe it). A prompt
//! tokenizes exactly as `/v1/completions` and `/v1/chat/completions` tokenize it, so `count`
//! equals their `usage.prompt_tokens`.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::api_error::{ApiError, PromptField};
use crate::api_types::{
    DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse, TokenizerInfo,
};
use crate::chat_prompt;
use crate::request_json;
use crate::{prompt_text, AppState};

/// `POST /tokenize`.
pub async fn tokenize(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    respond(run_tokenize(state, body).await)
}

/// `POST /detokenize`.
pub async fn detokenize(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    respond(run_detokenize(state, body).await)
}

/// `GET /tokenizer_info`.
pub async fn tokenizer_info(State(state): State<AppState>) -> Response {
    let info = state.backend().info();
    let special = &info.special_tokens;
    Json(TokenizerInfo {
        bos_token: special.bos_token.clone(),
        chat_template: info.chat_template.clone(),
        eos_token: special.eos_token.clone(),
        model_max_length: info.limits.max_context,
        pad_token: special.pad_token.clone(),
        // The tokenizer is loaded from `tokenizer.json` alone, as transformers' generic class.
        tokenizer_class: "PreTrainedTokenizerFast",
    })
    .into_response()
}

fn respond<T: serde::Serialize>(result: Result<T, ApiError>) -> Response {
    match result {
        Ok(body) => Json(body).into_response(),
        Err(err) => err.into_response(),
    }
}

async fn run_tokenize(
    state: AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<TokenizeResponse, ApiError> {
    let body = crate::body::buffered(body)?;
    let request: TokenizeRequest = request_json::parse_json(&body)?;
    request_json::check_model(request.model.as_deref(), &state.backend().info().name)?;
    let (text, add_special_tokens, field) = match (request.prompt, &request.messages) {
        (Some(prompt), None) => (
            prompt,
            request.add_special_tokens.unwrap_or(true),
            PromptField::Prompt { n: 1 },
        ),
        (None, Some(messages)) => {
            if request.chat_template.is_some() {
                return Err(ApiError::invalid(
                    "chat_template",
                    "a request's own `chat_template` is not supported; the model's is used",
                ));
            }
            chat_prompt::refuse_tool_calls(
                [("tools", request.tools.as_ref()), ("functions", None)],
                [("tool_choice", None), ("function_call", None)],
            )?;
            let chat = chat_prompt::messages(messages)?;
            let render = chat_prompt::render_options(
                request.add_generation_prompt,
                request.continue_final_message,
                request.chat_template_kwargs.as_ref(),
            )?;
            chat_prompt::require_template(&state)?;
            let text = chat_prompt::render(&state, chat, render).await?;
            let add = request.add_special_tokens.unwrap_or(false);
            (text, add, PromptField::Messages)
        }
        _ => {
            return Err(ApiError::invalid(
                "prompt",
                "give either `prompt` or `messages`",
            ))
        }
    };
    // As vLLM: a prompt longer than the context is refused (its length is what callers ask).
    let (_, tokens) = prompt_text::tokenize(&state, text, add_special_tokens, 0, field).await?;
    let limits = &state.backend().info().limits;
    limits
        .check_context(tokens.len(), 0)
        .map_err(|e| ApiError::from_request(e, field))?;
    let max_model_len = limits.max_context;
    let token_strs = request.return_token_strs.unwrap_or(false).then(|| {
        let backend = state.backend();
        tokens
            .iter()
            .map(|&id| backend.token_str(id).unwrap_or_default())
            .collect()
    });
    Ok(TokenizeResponse {
        count: tokens.len(),
        max_model_len,
        tokens,
        token_strs,
    })
}

async fn run_detokenize(
    state: AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<DetokenizeResponse, ApiError> {
    let body = crate::body::buffered(body)?;
    let request: DetokenizeRequest = request_json::parse_json(&body)?;
    let backend = state.backend().clone();
    request_json::check_model(request.model.as_deref(), &backend.info().name)?;
    let limit = backend.info().limits.max_context;
    if request.tokens.len() > limit {
        return Err(ApiError::invalid(
            "tokens",
            format!(
                "{} tokens are more than this model's maximum context length of {limit}",
                request.tokens.len()
            ),
        ));
    }
    let tokens = request.tokens;
    let prompt = tokio::task::spawn_blocking(move || backend.detokenize(&tokens))
        .await
        .map_err(|e| ApiError::Internal(format!("detokenization failed: {e}")))?
        .map_err(|e| ApiError::invalid("tokens", e))?;
    Ok(DetokenizeResponse { prompt })
}
