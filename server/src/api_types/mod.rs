//! The JSON the API reads and writes, as serde types: requests are deserialized into them (the
//! handlers then check what serde cannot), responses and stream chunks are built from them.
//!
//! Response fields are declared in alphabetical order: that is the order clients received them
//! in when responses were built as `serde_json::Value` maps, and the bytes stay the same.
//! Logprobs are `f64` for the same reason (a `Value` widened every `f32`).

mod chat;
mod common;
mod completion;
mod tokenize;

pub use chat::{
    ChatChoice, ChatChunk, ChatChunkChoice, ChatChunkLogprobs, ChatLogprobEntry, ChatLogprobs,
    ChatRequest, ChatResponse, Delta, MessageIn, MessageOut, TopLogprob,
};
pub use common::{
    cached_prompt_tokens, finish_reason, ApiStopReason, ChunkUsage, ErrorBody, ErrorEnvelope,
    Health, ModelCard, ModelList, StreamOptions, Usage, VersionInfo,
};
pub use completion::{
    CompletionChoice, CompletionChunk, CompletionRequest, CompletionResponse, LegacyLogprobs,
};
pub use tokenize::{
    DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse, TokenizerInfo,
};
