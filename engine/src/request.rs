//! What goes into the engine (a tokenized prompt and its sampling parameters, checked in
//! [`crate::validation`]) and what comes back (a stream of events), independent of any HTTP
//! shape.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::kv_export::KvTransferParams;
use crate::sampling::{SamplingParams, TokenLogprob};

/// One sequence to generate (or score): a tokenized prompt and its sampling parameters. A
/// request of several prompts, or `n` choices, is several of these validated together
/// ([`crate::EngineHandle::validate`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
}

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FinishReason {
    /// An end-of-sequence token, a stop token id or a stop string.
    Stop,
    /// `max_tokens` generated (also a scoring request with `max_tokens: 0`).
    Length,
    /// The client went away or the request was cancelled.
    Cancelled,
}

/// One generated token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenEvent {
    pub token: u32,
    /// Text that became safe to emit with this token (possibly empty: a stop string may still
    /// be forming, or a multi-byte character is incomplete).
    pub text: String,
    /// The token's logprob and alternatives, when the request asked for them.
    pub logprob: Option<TokenLogprob>,
}

/// Token counts, as OpenAI's `usage`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache instead of being computed.
    pub cached_tokens: usize,
}

/// What ended a sequence with [`FinishReason::Stop`], when it was not end-of-sequence.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum StopReason {
    /// A stop string (`stop`); it is not part of the returned text.
    String(String),
    /// A token of the request's `stop_token_ids`.
    Token(u32),
}

/// The last event of a request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FinishEvent {
    pub reason: FinishReason,
    /// Held-back text released at the end (text that turned out not to start a stop string).
    pub text: String,
    /// The stop string or requested stop token that ended the sequence, if one did (not set
    /// for an end-of-sequence token: vLLM's `stop_reason`).
    pub stop: Option<StopReason>,
    pub usage: Usage,
    /// Time from submission to the first scheduled step.
    pub queue_time: Duration,
    /// Where a decode engine finds the prompt's KV, when the request asked to export it
    /// (`kv_transfer_params.do_remote_decode`).
    pub kv_transfer: Option<KvTransferParams>,
}

/// Everything the engine tells a request's owner, in order: optional prompt logprobs, tokens,
/// then exactly one `Finished` or `Error`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Event {
    /// Logprobs of the prompt tokens (the first is `None`: nothing precedes it), sent once when
    /// prefill completes, if the request asked for them.
    PromptLogprobs(Vec<Option<TokenLogprob>>),
    Token(TokenEvent),
    Finished(FinishEvent),
    /// The engine failed this request after accepting it.
    Error(String),
}

/// The receiving end of a submitted request. Dropping it cancels the sequence.
#[derive(Debug)]
pub struct RequestStream {
    pub id: u64,
    pub events: mpsc::UnboundedReceiver<Event>,
}
