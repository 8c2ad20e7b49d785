//! What a dataset yields: one [`RequestSpec`] per request.

/// One request of a workload.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestSpec {
    /// What the prompt is.
    pub prompt: Prompt,
    /// Prompt tokens: exact for synthetic prompts sent as token ids and for text counted with a
    /// tokenizer, an estimate otherwise (the server's `usage` replaces it in the results).
    pub input_len: usize,
    /// `max_tokens` of the request.
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
}
