//! A conversation to prompt text: OpenAI messages read into the template's form, vLLM's
//! rendering fields, tool calling refused, and the model's chat template rendered off the async
//! runtime. `/v1/chat/completions` and `/tokenize` with `messages` share it, so both count the
//! same tokens.

use rackfill_models::ChatMessage;
use serde_json::{Map, Value};

use crate::api_error::ApiError;
use crate::api_types::MessageIn;
use crate::{AppState, ChatRender};

/// The rendering fields, checked: `add_generation_prompt` and `continue_final_message` exclude
/// each other (as in vLLM); `add_generation_prompt` defaults to the opposite of the other.
pub(crate) fn render_options(
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
    kwargs: Option<&Map<String, Value>>,
) -> Result<ChatRender, ApiError> {
    let continue_final_message = continue_final_message.unwrap_or(false);
    let add_generation_prompt = add_generation_prompt.unwrap_or(!continue_final_message);
    if add_generation_prompt && continue_final_message {
        return Err(ApiError::invalid(
            "continue_final_message",
            "`continue_final_message` and `add_generation_prompt` cannot both be true",
        ));
    }
    Ok(ChatRender {
        add_generation_prompt,
        continue_final_message,
        kwargs: kwargs.cloned().unwrap_or_default(),
    })
}

/// The messages as the template sees them: roles checked (`developer` is `system`), content as
/// a string or text parts joined by newlines.
pub(crate) fn messages(input: &[MessageIn]) -> Result<Vec<ChatMessage>, ApiError> {
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
            Ok(ChatMessage {
                role: role(i, &message.role)?.into(),
                content: content(i, message.content.as_ref())?,
            })
        })
        .collect()
}

fn role(i: usize, role: &str) -> Result<&'static str, ApiError> {
    match role {
        "system" | "developer" => Ok("system"),
        "user" => Ok("user"),
        "assistant" => Ok("assistant"),
        other => Err(ApiError::invalid(
            format!("messages[{i}].role"),
            format!(
                "unsupported role `{}`: expected system, developer, user or assistant",
                other.chars().take(64).collect::<String>()
            ),
        )),
    }
}

fn content(i: usize, content: Option<&Value>) -> Result<String, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                match (part.get("type").and_then(Value::as_str), part.get("text")) {
                    (Some("text"), Some(Value::String(text))) => texts.push(text.as_str()),
                    _ => {
                        return Err(ApiError::invalid(
                            format!("messages[{i}].content[{j}]"),
                            "only text content parts (`{\"type\": \"text\", \"text\": ...}`) \
                             are supported",
                        ))
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        Some(_) => Err(ApiError::invalid(
            format!("messages[{i}].content"),
            "`content` must be a string or an array of text parts",
        )),
    }
}

/// Tool calling is not supported: refuses tools (`tools`, or the deprecated `functions`) and
/// any `tool_choice` / `function_call` that would demand a call. `none` and `auto` are
/// accepted, since a plain text answer honours both when no tools are given.
pub(crate) fn refuse_tool_calls(
    tools: [(&'static str, Option<&Vec<Value>>); 2],
    choices: [(&'static str, Option<&Value>); 2],
) -> Result<(), ApiError> {
    for (param, tools) in tools {
        if tools.is_some_and(|t| !t.is_empty()) {
            return Err(ApiError::invalid(param, "tool calling is not supported"));
        }
    }
    for (param, choice) in choices {
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

/// 400 on `messages` when the model has no chat template.
pub(crate) fn require_template(state: &AppState) -> Result<(), ApiError> {
    let info = state.backend().info();
    if info.chat_template.is_none() {
        return Err(ApiError::invalid(
            "messages",
            format!(
                "the model `{}` has no chat template; use /v1/completions",
                info.name
            ),
        ));
    }
    Ok(())
}

/// The prompt text of `chat`, rendered off the async runtime (templates can be slow).
pub(crate) async fn render(
    state: &AppState,
    chat: Vec<ChatMessage>,
    options: ChatRender,
) -> Result<String, ApiError> {
    let backend = state.backend().clone();
    tokio::task::spawn_blocking(move || backend.render_chat(&chat, &options))
        .await
        .map_err(|e| ApiError::Internal(format!("chat rendering failed: {e}")))?
        .map_err(|e| ApiError::invalid("messages", e))
}
