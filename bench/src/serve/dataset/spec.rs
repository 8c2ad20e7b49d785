//! What a dataset yields: one [`RequestSpec`] per request.

/// One request of a workload.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestSpec {
    /// What the prompt is.
    pub prompt: Prompt,
    /// Prompt tokens: exact for synthetic prompts sent as token ids and for text counted with a
    /// tokenizer, an estimate otherwise (the server's `usage` replaces it in the results). A
    /// later conversation turn's is an estimate too: its prompt holds what the server generated.
    pub input_len: usize,
    /// `max_tokens` of the request (0 for a scored prompt that generates nothing).
    pub output_len: usize,
    /// When the request arrives in a trace, milliseconds (traces only).
    pub timestamp_ms: Option<f64>,
}

/// A prompt's source.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Text sent as is (ShareGPT).
    Text(String),
    /// `input_len` synthetic tokens: one block of
    /// [`Synthesis::block_size`](super::Synthesis::block_size) tokens per hash id (shared by every
    /// request naming that id), then tokens unique to this request (`unique` seeds them).
    Synthetic { hash_ids: Vec<u64>, unique: u64 },
    /// An evaluation harness's loglikelihood request: `context_len` tokens of context
    /// `context` (the same tokens for every request naming it), then continuation
    /// `continuation` of that context (`input_len - context_len` tokens). Sent with `echo` and
    /// `logprobs`; the response must score every prompt token.
    Scored {
        context: u64,
        context_len: usize,
        continuation: u64,
    },
    /// Turn `turn` of conversation `conversation`. Turn 0 is a system prompt of `system_len`
    /// tokens (the same in every conversation) and a user message of `user_len` tokens; turn
    /// `k > 0` is turn `k - 1`'s whole prompt, the text the server generated for it, and a new
    /// user message of `user_len` tokens. The turns of a conversation follow each other in the
    /// dataset and are sent one after the other, each once the previous one finished.
    Turn {
        conversation: u64,
        turn: usize,
        system_len: usize,
        user_len: usize,
    },
}

impl Prompt {
    /// Whether this prompt continues the conversation of the request before it in the dataset
    /// (so it cannot be sent before that one finished).
    pub fn continues(&self) -> bool {
        matches!(self, Self::Turn { turn, .. } if *turn > 0)
    }
}
