//! vLLM's tokenizer routes: `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::chat::MessageIn;

/// `POST /tokenize`: either a `prompt` (vLLM's `TokenizeCompletionRequest`) or chat `messages`
/// rendered with the chat template first (`TokenizeChatRequest`).
#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub prompt: Option<String>,
    #[serde(default)]
    pub messages: Option<Vec<MessageIn>>,
    /// Let the tokenizer's post-processor add its special tokens (a BOS): default true for a
    /// prompt, false for messages (the template writes them), as in vLLM and as
    /// `/v1/completions` and `/v1/chat/completions` tokenize.
    #[serde(default)]
    pub add_special_tokens: Option<bool>,
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    #[serde(default)]
    pub continue_final_message: Option<bool>,
    #[serde(default)]
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// Also return each token's vocabulary string.
    #[serde(default)]
    pub return_token_strs: Option<bool>,
    /// A template sent with the request (refused: the model's own is used).
    #[serde(default)]
    pub chat_template: Option<String>,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
}

/// The token ids of a prompt, as `usage.prompt_tokens` counts them.
#[derive(Debug, Serialize)]
pub struct TokenizeResponse {
    pub count: usize,
    pub max_model_len: usize,
    pub tokens: Vec<u32>,
    pub token_strs: Option<Vec<String>>,
}

/// `POST /detokenize`.
#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

/// The text of the ids.
#[derive(Debug, Serialize)]
pub struct DetokenizeResponse {
    pub prompt: String,
}

/// `GET /tokenizer_info`: the tokenizer's configuration in the shape of `tokenizer_config.json`
/// (what vLLM returns, and what evaluation harnesses with a remote tokenizer read: they need
/// `eos_token`, and `chat_template` to render chats themselves).
#[derive(Debug, Clone, Serialize)]
pub struct TokenizerInfo {
    pub bos_token: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<String>,
    pub eos_token: Option<String>,
    pub model_max_length: usize,
    pub pad_token: Option<String>,
    pub tokenizer_class: &'static str,
}
