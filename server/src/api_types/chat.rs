//! `POST /v1/chat/completions`: the request, the response, its stream chunks and the chat
//! `logprobs` objects.

use rackfill_engine::kv_export::KvTransferParams;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::common::{ApiStopReason, ChunkUsage, StreamOptions, Usage};

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
    /// (`params::UNSUPPORTED_FIELDS`).
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// One message as sent.
#[derive(Debug, Deserialize)]
pub struct MessageIn {
    pub role: String,
    /// A string, an array of text parts, or null (see `chat::messages`).
    #[serde(default)]
    pub content: Option<Value>,
}

/// A whole (non-streamed) chat completion.
#[derive(Debug, Serialize)]
pub struct ChatResponse {
    pub choices: Vec<ChatChoice>,
    pub created: u64,
    pub id: String,
    pub model: String,
    pub object: &'static str,
    pub system_fingerprint: Option<String>,
    pub usage: Usage,
    /// vLLM's disaggregation field: where a decode engine pulls the prompt's KV (only for a
    /// request with `kv_transfer_params.do_remote_decode`; on a stream, its finishing chunk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<KvTransferParams>,
}

/// One whole choice.
#[derive(Debug, Serialize)]
pub struct ChatChoice {
    pub finish_reason: &'static str,
    pub index: usize,
    pub logprobs: Option<ChatLogprobs>,
    pub message: MessageOut,
    pub stop_reason: ApiStopReason,
}

/// The assistant's message.
#[derive(Debug, Serialize)]
pub struct MessageOut {
    pub content: String,
    pub refusal: Option<String>,
    pub role: &'static str,
}

/// A whole choice's logprobs, one entry per generated token.
#[derive(Debug, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatLogprobEntry>,
    pub refusal: Option<String>,
}

/// One token with its logprob and the most likely alternatives.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatLogprobEntry {
    pub bytes: Vec<u8>,
    pub logprob: Option<f64>,
    pub token: String,
    pub top_logprobs: Vec<TopLogprob>,
}

/// An alternative token at one position.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TopLogprob {
    pub bytes: Vec<u8>,
    pub logprob: f64,
    pub token: String,
}

/// One `data:` event of a streamed chat: one choice's delta, or no choice and the usage of the
/// whole request (the closing chunk of `include_usage`).
#[derive(Debug, Serialize)]
pub struct ChatChunk {
    pub choices: Vec<ChatChunkChoice>,
    pub created: u64,
    pub id: String,
    pub model: String,
    pub object: &'static str,
    pub system_fingerprint: Option<String>,
    #[serde(skip_serializing_if = "ChunkUsage::is_omitted")]
    pub usage: ChunkUsage,
    /// vLLM's disaggregation field: where a decode engine pulls the prompt's KV (only for a
    /// request with `kv_transfer_params.do_remote_decode`; on a stream, its finishing chunk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<KvTransferParams>,
}

/// One choice's delta in a chunk.
#[derive(Debug, Serialize)]
pub struct ChatChunkChoice {
    pub delta: Delta,
    pub finish_reason: Option<&'static str>,
    pub index: usize,
    pub logprobs: Option<ChatChunkLogprobs>,
    /// Present on the chunk that finishes the choice.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<ApiStopReason>,
}

/// The logprobs of the tokens of one chunk (none in the chunk that finishes a choice).
#[derive(Debug, Serialize)]
pub struct ChatChunkLogprobs {
    pub content: Vec<ChatLogprobEntry>,
}

/// What a chunk adds to the message: the role first, then content.
#[derive(Debug, Default, Serialize)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
}
