//! Request validation, done once: every check a request must pass before the engine queues it
//! (sampling parameters, token ids, context length, sequences and tokens per request), the
//! limits they compare against and their typed errors. A [`ValidatedRequest`] can only be made
//! here ([`crate::EngineHandle::validate`]), so whoever holds one knows every check passed, and
//! the HTTP layer keeps only the checks of the JSON's shape.

use std::fmt;

use rackfill_models::model::{check_vocabulary, OutOfVocabulary};

use crate::kv_export::KvExportSupport;
use crate::request::GenerateRequest;
use crate::sampling::{SamplingError, SamplingParams};

/// How much a tokenizer's normalizer may shrink text, at most: NFKC turns a 4-byte character (a
/// mathematical letter) into one byte; NFC and lowercasing shrink less, and the space-to-`▁`
/// replacement of SentencePiece tokenizers grows text. (Normalizers that delete text, such as
/// `StripAccents`, belong to encoder tokenizers, not to the supported model families.)
const NORMALIZER_SHRINK: usize = 4;

/// What every request is checked against: the served model's vocabulary and context, and the
/// engine's limits per request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestLimits {
    /// Token ids are `0..vocab_size`.
    pub vocab_size: usize,
    /// The longest prompt plus `max_tokens` of one sequence: the smaller of the model's context
    /// length and the KV budget of one rank.
    pub max_context: usize,
    /// The most sequences (prompts times `n`) one request may hold: what the engine's queue
    /// holds ([`crate::EngineConfig::max_waiting`]), so a larger request could never be queued.
    pub max_sequences: usize,
    /// The most tokens one request may reserve, prompt plus `max_tokens` summed over its
    /// sequences ([`crate::EngineConfig::max_request_tokens`]): one request must not hold the
    /// engine for minutes.
    pub max_request_tokens: usize,
    /// The most bytes of text one token stands for
    /// ([`rackfill_models::Tokenizer::max_token_bytes`]), which bounds a text's token count from
    /// below ([`RequestLimits::check_text`]).
    pub max_token_bytes: usize,
    /// Whether a request may ask for its prompt's KV to be exported.
    pub kv_export: KvExportSupport,
}

impl RequestLimits {
    /// Refuses a text prompt that cannot fit the context whatever it tokenizes to: it is at least
    /// `bytes / (max_token_bytes * 4)` tokens (see `NORMALIZER_SHRINK`). Costs nothing, so a
    /// server calls it before tokenizing, which for a long text takes far more memory and time
    /// than the text itself. `max_tokens` is what will be generated after the prompt.
    pub fn check_text(&self, text_bytes: usize, max_tokens: usize) -> Result<(), RequestError> {
        let bytes_per_token = self
            .max_token_bytes
            .max(1)
            .saturating_mul(NORMALIZER_SHRINK);
        let at_least = text_bytes.div_ceil(bytes_per_token);
        if at_least.saturating_add(max_tokens) > self.max_context {
            return Err(RequestError::ContextLength(ContextLength {
                limit: self.max_context,
                prompt_tokens: at_least,
                max_tokens,
                text_bytes: Some(text_bytes),
            }));
        }
        Ok(())
    }

    /// Checks a request's sampling parameters alone, the first of [`Self::validate`]'s checks:
    /// a server calls it as soon as it has read them, so a bad parameter is a 400 before the
    /// request is admitted or its prompt tokenized (`validate` checks them again with the
    /// prompt).
    pub fn check_sampling(&self, params: &SamplingParams) -> Result<(), RequestError> {
        Ok(params.validate(self.vocab_size)?)
    }

    /// Refuses a prompt of `prompt_tokens` whose `max_tokens` would not fit the context.
    pub fn check_context(
        &self,
        prompt_tokens: usize,
        max_tokens: usize,
    ) -> Result<(), RequestError> {
        if prompt_tokens.saturating_add(max_tokens) > self.max_context {
            return Err(RequestError::ContextLength(ContextLength {
                limit: self.max_context,
                prompt_tokens,
                max_tokens,
                text_bytes: None,
            }));
        }
        Ok(())
    }

    /// Checks every sequence of one request, then the request as a whole. The checks run in
    /// this order, the first failure answering: the number of sequences; per sequence its
    /// sampling parameters, an empty prompt, token ids, the context length; the total tokens.
    pub(crate) fn validate(
        &self,
        sequences: Vec<GenerateRequest>,
    ) -> Result<ValidatedRequest, RequestError> {
        if sequences.is_empty() {
            return Err(RequestError::NoSequences);
        }
        if sequences.len() > self.max_sequences {
            return Err(RequestError::TooManySequences {
                sequences: sequences.len(),
                limit: self.max_sequences,
            });
        }
        let mut total = 0usize;
        for (sequence, request) in sequences.iter().enumerate() {
            self.check_sampling(&request.params)?;
            if request.prompt.is_empty() {
                return Err(RequestError::EmptyPrompt { sequence });
            }
            check_vocabulary(&request.prompt, self.vocab_size)
                .map_err(|source| RequestError::OutOfVocabulary { sequence, source })?;
            let (prompt_tokens, max_tokens) =
                (request.prompt.len(), request.params.max_tokens as usize);
            self.check_context(prompt_tokens, max_tokens)?;
            total = total.saturating_add(prompt_tokens + max_tokens);
        }
        if total > self.max_request_tokens {
            return Err(RequestError::TooManyTokens {
                tokens: total,
                sequences: sequences.len(),
                limit: self.max_request_tokens,
            });
        }
        Ok(ValidatedRequest {
            sequences,
            export_kv: false,
        })
    }

    /// [`RequestLimits::validate`] for one sequence whose KV is to be exported, once this
    /// engine can export.
    pub(crate) fn validate_kv_export(
        &self,
        sequence: GenerateRequest,
    ) -> Result<ValidatedRequest, RequestError> {
        match &self.kv_export {
            KvExportSupport::Ready => {}
            KvExportSupport::Off => {
                return Err(RequestError::KvExport(
                    "this server does not export KV: start it with --kv-export".into(),
                ))
            }
            KvExportSupport::Unavailable(why) => {
                return Err(RequestError::KvExport(format!(
                    "this server cannot export KV: {why}"
                )))
            }
        }
        let mut validated = self.validate(vec![sequence])?;
        validated.export_kv = true;
        Ok(validated)
    }
}

/// The sequences of one request, every check of [`RequestLimits`] passed. Only
/// [`crate::EngineHandle::validate`] makes one, for its own engine
/// ([`crate::EngineHandle::enqueue`] queues it whole or not at all).
#[derive(Debug, Clone)]
pub struct ValidatedRequest {
    sequences: Vec<GenerateRequest>,
    /// Whether the prompt's KV is exported when the sequence finishes.
    export_kv: bool,
}

impl ValidatedRequest {
    /// The sequences, in submission order (the order of the streams `enqueue` returns).
    pub fn sequences(&self) -> &[GenerateRequest] {
        &self.sequences
    }

    /// Whether the prompt's KV is exported when the sequence finishes.
    pub fn exports_kv(&self) -> bool {
        self.export_kv
    }

    pub(crate) fn into_sequences(self) -> Vec<GenerateRequest> {
        self.sequences
    }
}

/// A prompt plus `max_tokens` beyond the context. The message names the limit, the prompt's
/// tokens (or their lower bound, for a text refused before tokenization) and `max_tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextLength {
    pub limit: usize,
    /// Tokens of the prompt; a lower bound when `text_bytes` is set.
    pub prompt_tokens: usize,
    pub max_tokens: usize,
    /// The prompt's length in bytes, when it was refused by [`RequestLimits::check_text`]
    /// before being tokenized.
    pub text_bytes: Option<usize>,
}

impl fmt::Display for ContextLength {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Self {
            limit,
            prompt_tokens,
            max_tokens,
            text_bytes,
        } = *self;
        let total = prompt_tokens.saturating_add(max_tokens);
        match text_bytes {
            None => write!(
                f,
                "this model's maximum context length is {limit} tokens, but {prompt_tokens} \
                 prompt tokens plus max_tokens {max_tokens} were requested ({total} in total)"
            ),
            Some(bytes) => write!(
                f,
                "this model's maximum context length is {limit} tokens, but the prompt's {bytes} \
                 bytes of text are at least {prompt_tokens} tokens, plus max_tokens \
                 {max_tokens} ({total} or more in total)"
            ),
        }
    }
}

/// Why a request cannot be queued, whatever the engine's load: what HTTP answers with 400.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    /// A sampling parameter is out of range (the error names the field).
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    /// The request has no sequence at all.
    #[error("the request has no prompt")]
    NoSequences,
    /// Sequence `sequence` has an empty prompt (a text prompt may tokenize to nothing).
    #[error("the prompt has no tokens")]
    EmptyPrompt { sequence: usize },
    /// Sequence `sequence` holds a token id the model has no embedding for.
    #[error("{source}")]
    OutOfVocabulary {
        sequence: usize,
        source: OutOfVocabulary,
    },
    /// A prompt plus `max_tokens` exceeds what the model or one rank's KV budget can hold.
    #[error(transparent)]
    ContextLength(ContextLength),
    /// The request's sequences together reserve more tokens than one request may.
    #[error(
        "this request needs {tokens} tokens (prompt plus max_tokens over its {sequences} \
         sequences, every prompt times n), more than the limit of {limit} tokens per request"
    )]
    TooManyTokens {
        tokens: usize,
        sequences: usize,
        limit: usize,
    },
    /// More sequences than the engine ever queues: waiting would not help.
    #[error(
        "this request needs {sequences} sequences (prompts times n), more than the {limit} the \
         engine queues at once (--max-waiting)"
    )]
    TooManySequences { sequences: usize, limit: usize },
    /// The request asks for its KV to be exported (`kv_transfer_params.do_remote_decode`),
    /// which this engine cannot do; the message says why.
    #[error("kv_transfer_params.do_remote_decode: {0}")]
    KvExport(String),
}

impl std::error::Error for ContextLength {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::SamplingParams;

    fn limits() -> RequestLimits {
        RequestLimits {
            vocab_size: 100,
            max_context: 50,
            max_sequences: 8,
            max_request_tokens: 120,
            max_token_bytes: 5,
            kv_export: KvExportSupport::Off,
        }
    }

    fn sequence(prompt: Vec<u32>, max_tokens: u32) -> GenerateRequest {
        GenerateRequest {
            prompt,
            params: SamplingParams {
                max_tokens,
                ..SamplingParams::default()
            },
        }
    }

    #[test]
    fn a_request_within_every_limit_is_validated_whole() {
        let valid = limits()
            .validate(vec![sequence(vec![1, 2], 48), sequence(vec![99], 10)])
            .unwrap();
        assert_eq!(valid.sequences().len(), 2);
        assert_eq!(valid.sequences()[1].prompt, [99]);
    }

    #[test]
    fn each_check_answers_with_its_own_error() {
        let l = limits();
        assert_eq!(l.validate(vec![]).unwrap_err(), RequestError::NoSequences);
        let nine = vec![sequence(vec![1], 1); 9];
        assert_eq!(
            l.validate(nine).unwrap_err(),
            RequestError::TooManySequences {
                sequences: 9,
                limit: 8
            }
        );
        let empty = vec![sequence(vec![1], 1), sequence(vec![], 1)];
        assert_eq!(
            l.validate(empty).unwrap_err(),
            RequestError::EmptyPrompt { sequence: 1 }
        );
        let err = l.validate(vec![sequence(vec![3, 100], 1)]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "token id 100 is outside the vocabulary (size 100)"
        );
        assert!(matches!(
            err,
            RequestError::OutOfVocabulary { sequence: 0, .. }
        ));
        let mut hot = sequence(vec![1], 1);
        hot.params.temperature = 5.0;
        let err = l.validate(vec![hot]).unwrap_err();
        assert!(matches!(&err, RequestError::Sampling(e) if e.param() == Some("temperature")));
        let mut bias = sequence(vec![1], 1);
        bias.params.logit_bias = vec![(100, 1.0)];
        let err = l.validate(vec![bias]).unwrap_err();
        assert!(matches!(&err, RequestError::Sampling(e) if e.param() == Some("logit_bias")));
    }

    #[test]
    fn the_context_check_names_the_limit_and_both_counts() {
        let err = limits()
            .validate(vec![sequence(vec![7; 30], 21)])
            .unwrap_err();
        assert!(matches!(err, RequestError::ContextLength(_)));
        assert_eq!(
            err.to_string(),
            "this model's maximum context length is 50 tokens, but 30 prompt tokens plus \
             max_tokens 21 were requested (51 in total)"
        );
        assert!(limits().validate(vec![sequence(vec![7; 30], 20)]).is_ok());
    }

    #[test]
    fn the_tokens_of_all_sequences_are_bounded_together() {
        // Three sequences of 40 tokens fit the 120-token limit; a fourth does not, although
        // each alone fits the context.
        assert!(limits()
            .validate(vec![sequence(vec![1; 30], 10); 3])
            .is_ok());
        let err = limits()
            .validate(vec![sequence(vec![1; 30], 10); 4])
            .unwrap_err();
        assert_eq!(
            err,
            RequestError::TooManyTokens {
                tokens: 160,
                sequences: 4,
                limit: 120
            }
        );
        let message = err.to_string();
        assert!(
            message.contains("160") && message.contains("120"),
            "{message}"
        );
    }

    #[test]
    fn a_text_longer_than_any_tokenization_could_fit_is_refused_unread() {
        let l = limits();
        // 5 bytes per token at most, 4x normalizer shrink: 20 bytes per token; 50 tokens of
        // context hold at most 1000 bytes with max_tokens 0.
        assert!(l.check_text(1000, 0).is_ok());
        let err = l.check_text(1001, 0).unwrap_err();
        assert_eq!(
            err.to_string(),
            "this model's maximum context length is 50 tokens, but the prompt's 1001 bytes of \
             text are at least 51 tokens, plus max_tokens 0 (51 or more in total)"
        );
        assert!(l.check_text(900, 5).is_ok());
        assert!(l.check_text(900, 6).is_err());
        assert!(l.check_text(usize::MAX, usize::MAX).is_err());
    }
}
