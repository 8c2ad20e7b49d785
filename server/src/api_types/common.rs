//! Pieces every route shares: token counts, the error envelope, the model card, stream options
//! and how a sequence's end is spelled.

use rackfill_engine::{FinishReason, StopReason};
use serde::{Deserialize, Serialize, Serializer};

/// `usage`, as OpenAI counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub completion_tokens: usize,
    pub prompt_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
}

impl Usage {
    pub fn new(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Self {
        Self {
            completion_tokens,
            prompt_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
        }
    }
}

/// A request's cached prompt tokens from its choices' (`n` consecutive choices per prompt, as
/// usage counts each prompt once): per prompt, what none of its choices computed, the least
/// any of them reused.
pub fn cached_prompt_tokens(per_choice: &[usize], n: usize) -> usize {
    per_choice
        .chunks(n.max(1))
        .map(|choices| choices.iter().copied().min().unwrap_or(0))
        .sum()
}

/// The `usage` of a stream chunk: absent without `stream_options.include_usage`, `null` on the
/// chunks before the closing usage chunk, or the counts (the closing chunk, and every chunk with
/// `continuous_usage_stats`, as vLLM does).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkUsage {
    Omitted,
    Null,
    Counts(Usage),
}

impl ChunkUsage {
    pub fn is_omitted(&self) -> bool {
        matches!(self, Self::Omitted)
    }
}

impl Serialize for ChunkUsage {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Counts(usage) => usage.serialize(serializer),
            Self::Omitted | Self::Null => serializer.serialize_none(),
        }
    }
}

/// `stream_options`.
#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
    /// vLLM: with `include_usage`, every chunk carries the usage of its choice so far.
    #[serde(default)]
    pub continuous_usage_stats: Option<bool>,
}

/// OpenAI's `finish_reason` (a client that went away is vLLM's `abort`); also the label of the
/// request metrics.
pub fn finish_reason(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Cancelled => "abort",
    }
}

/// vLLM's `stop_reason`: the stop string, the requested stop token's id, or `null`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiStopReason(pub Option<StopReason>);

impl Serialize for ApiStopReason {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match &self.0 {
            Some(StopReason::String(text)) => serializer.serialize_str(text),
            Some(StopReason::Token(id)) => serializer.serialize_u32(*id),
            None => serializer.serialize_none(),
        }
    }
}

/// OpenAI's error envelope `{"error": {...}}`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ErrorEnvelope {
    pub error: ErrorBody,
}

/// The fields of an error: `param` names the request field at fault, when one is.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ErrorBody {
    pub code: Option<&'static str>,
    pub message: String,
    pub param: Option<String>,
    #[serde(rename = "type")]
    pub kind: &'static str,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    pub data: Vec<ModelCard>,
    pub object: &'static str,
}

/// The served model as an OpenAI model object, plus vLLM's `root`, `parent` and
/// `max_model_len`.
#[derive(Debug, Clone, Serialize)]
pub struct ModelCard {
    pub created: u64,
    pub id: String,
    pub max_model_len: usize,
    pub object: &'static str,
    pub owned_by: &'static str,
    pub parent: Option<String>,
    pub root: String,
}

/// `GET /health` when the server can take requests (otherwise the error envelope with 503).
#[derive(Debug, Clone, Serialize)]
pub struct Health {
    pub status: &'static str,
}

/// `GET /version`: which server this is, for clients that adapt to it.
#[derive(Debug, Clone, Serialize)]
pub struct VersionInfo {
    pub name: &'static str,
    pub version: &'static str,
}
