//! Text prompts to token ids without letting long texts take the server's memory.
//!
//! Tokenizing takes far more memory than the text (a 4 MiB prompt peaked near 650 MB) and
//! time. Two things bound it: the engine's cheap bound ([`rackfill_engine::RequestLimits::
//! check_text`]) refuses a text that cannot fit the context whatever it tokenizes to, before
//! any tokenization; and the texts being tokenized at once, over the whole process, are at most
//! [`TOKENIZE_BUDGET_BYTES`] long together (a larger text waits until it can run alone).

use tokio::sync::Semaphore;

use crate::api_error::{ApiError, PromptField};
use crate::AppState;

/// Bytes of text tokenized at once by the whole process: one prompt of the default body limit.
pub(crate) const TOKENIZE_BUDGET_BYTES: usize = 4 << 20;

/// Permits are bytes of text being tokenized.
static TOKENIZING: Semaphore = Semaphore::const_new(TOKENIZE_BUDGET_BYTES);

/// Token ids of `text`, a prompt that `max_tokens` generated tokens will follow, tokenized off
/// the async runtime; `text` comes back with them. A text that cannot fit the context is a
/// context-length error on `field` before it is tokenized.
pub(crate) async fn tokenize(
    state: &AppState,
    text: String,
    add_special_tokens: bool,
    max_tokens: usize,
    field: PromptField,
) -> Result<(String, Vec<u32>), ApiError> {
    let backend = state.backend().clone();
    backend
        .info()
        .limits
        .check_text(text.len(), max_tokens)
        .map_err(|e| ApiError::from_request(e, field))?;
    // Within u32 (the semaphore's unit of acquisition): the budget is far below it.
    let bytes = text.len().min(TOKENIZE_BUDGET_BYTES) as u32;
    let _permit = TOKENIZING
        .acquire_many(bytes)
        .await
        .map_err(|e| ApiError::Internal(format!("tokenization budget: {e}")))?;
    tokio::task::spawn_blocking(move || {
        let ids = backend.tokenize(&text, add_special_tokens);
        (text, ids)
    })
    .await
    .map_err(|e| ApiError::Internal(format!("tokenization failed: {e}")))
    .and_then(|(text, ids)| match ids {
        Ok(ids) => Ok((text, ids)),
        Err(e) => Err(ApiError::invalid(field.name(), e)),
    })
}
