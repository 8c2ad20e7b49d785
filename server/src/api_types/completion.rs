//! `POST /v1/completions`: the request, the response, its stream chunks and OpenAI's legacy
//! `logprobs` object.

use rackfill_engine::kv_export::KvTransferParams;
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::common::{ApiStopReason, ChunkUsage, StreamOptions, Usage};

/// The fields of an OpenAI completion request rackfill reads (unknown fields are ignored).
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    /// A string, strings, token ids or lists of token ids (see `completions::parse_prompt`).
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
    /// (`params::UNSUPPORTED_FIELDS`).
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// A whole (non-streamed) completion.
#[derive(Debug, Serialize)]
pub struct CompletionResponse {
    pub choices: Vec<CompletionChoice>,
    pub created: u64,
    pub id: String,
    pub model: String,
    pub object: &'static str,
    pub usage: Usage,
    /// vLLM's disaggregation field: where a decode engine pulls the prompt's KV (only for a
    /// request with `kv_transfer_params.do_remote_decode`; on a stream, its finishing chunk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<KvTransferParams>,
}

/// One choice, whole or as a stream chunk's delta.
#[derive(Debug, Serialize)]
pub struct CompletionChoice {
    pub finish_reason: Option<&'static str>,
    pub index: usize,
    pub logprobs: Option<LegacyLogprobs>,
    /// Present on a whole choice and on the chunk that finishes one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<ApiStopReason>,
    pub text: String,
}

/// One `data:` event of a streamed completion: one choice's delta, or no choice and the usage
/// of the whole request (the closing chunk of `include_usage`).
#[derive(Debug, Serialize)]
pub struct CompletionChunk {
    pub choices: Vec<CompletionChoice>,
    pub created: u64,
    pub id: String,
    pub model: String,
    pub object: &'static str,
    #[serde(skip_serializing_if = "ChunkUsage::is_omitted")]
    pub usage: ChunkUsage,
    /// vLLM's disaggregation field: where a decode engine pulls the prompt's KV (only for a
    /// request with `kv_transfer_params.do_remote_decode`; on a stream, its finishing chunk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<KvTransferParams>,
}

/// OpenAI's legacy `logprobs`: parallel lists, one entry per token. A position with nothing
/// before it (the first prompt token of `echo`) has `null` logprobs.
#[derive(Debug, Default, Clone, PartialEq, Serialize)]
pub struct LegacyLogprobs {
    pub text_offset: Vec<usize>,
    pub token_logprobs: Vec<Option<f64>>,
    pub tokens: Vec<String>,
    /// Token text to logprob (equal texts keep the more likely token's).
    pub top_logprobs: Vec<Option<BTreeMap<String, f64>>>,
}
