//! Per-request sampling parameters and their validation: every number comes straight from a
//! request, so each is checked against its documented range and a bad one is reported with the
//! OpenAI field name it came from.

use serde::{Deserialize, Serialize};

/// Largest accepted `temperature` (OpenAI's limit).
pub const MAX_TEMPERATURE: f32 = 2.0;

/// Largest accepted `logprobs` / `prompt_logprobs` (OpenAI's `top_logprobs` limit, and vLLM's).
pub const MAX_LOGPROBS: u32 = 20;

/// Largest `|presence_penalty|` and `|frequency_penalty|` (OpenAI's range).
pub const MAX_PENALTY: f32 = 2.0;

/// Largest `|logit_bias|` value (OpenAI's range).
pub const MAX_LOGIT_BIAS: f32 = 100.0;

/// Smallest and largest `repetition_penalty`: bounded away from 0 so that `l / r` stays finite
/// ([`super::penalties`]).
pub const REPETITION_PENALTY_RANGE: (f32, f32) = (0.01, 100.0);

/// Most stop strings one request may carry (OpenAI's limit). Each string costs a scan of the
/// held-back text on every streamed delta, so the count is bounded.
pub const MAX_STOP_STRINGS: usize = 4;

/// A request parameter or a row of logits that cannot be sampled from.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// A request parameter is out of range; `param` is the OpenAI field name, so the HTTP layer
    /// can fill in the `param` of its error body.
    #[error("invalid `{param}`: {reason}")]
    InvalidParam { param: &'static str, reason: String },
    /// The forward pass produced no logits.
    #[error("logits are empty")]
    EmptyLogits,
    /// More logits than `u32` token ids can name.
    #[error("{len} logits exceed the u32 token id space")]
    TooManyLogits { len: usize },
    /// A NaN or infinite logit: the forward pass overflowed or is broken, and any token drawn
    /// from it would be meaningless.
    #[error("logit of token {index} is not finite ({value})")]
    NonFiniteLogit { index: usize, value: f32 },
    /// A token id (e.g. a prompt token scored for `echo`) outside the row of logits.
    #[error("token id {token} is outside the vocabulary of {vocab_size} tokens")]
    TokenOutOfRange { token: u32, vocab_size: usize },
}

impl SamplingError {
    /// The request parameter at fault, if the error is about one.
    pub fn param(&self) -> Option<&'static str> {
        match self {
            Self::InvalidParam { param, .. } => Some(param),
            _ => None,
        }
    }
}

pub(super) fn invalid(param: &'static str, reason: String) -> SamplingError {
    SamplingError::InvalidParam { param, reason }
}

/// Per-request generation settings, named as in the OpenAI API (plus vLLM's `top_k`, `min_p`,
/// `repetition_penalty`, `stop_token_ids`, `ignore_eos` and `prompt_logprobs`).
///
/// Missing fields take the [`Default`] values when deserialised, so a partial JSON object is a
/// valid input; call [`validate`](Self::validate) before use.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature in `[0, MAX_TEMPERATURE]`; 0 means greedy (argmax).
    pub temperature: f32,
    /// Nucleus mass in `(0, 1]`; 1 disables top-p.
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables top-k.
    pub top_k: u32,
    /// Drop tokens less likely than `min_p` times the most likely one, in `[0, 1]`; 0 disables.
    pub min_p: f32,
    /// Subtracted once from the logit of every token generated so far, in `[-2, 2]`.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit per time it was generated, in `[-2, 2]`.
    pub frequency_penalty: f32,
    /// Divides positive (multiplies negative) logits of tokens in the prompt or the output;
    /// 1 disables.
    pub repetition_penalty: f32,
    /// `(token, bias)` added to the logit, bias in `[-100, 100]` (OpenAI `logit_bias`).
    pub logit_bias: Vec<(u32, f32)>,
    /// Seed for this request's RNG; the same seed and logits give the same tokens, whatever else
    /// shares the batch.
    pub seed: Option<u64>,
    /// Tokens to generate at most; 0 is legal (prompt scoring with `echo`).
    pub max_tokens: u32,
    /// Tokens to generate at least (vLLM's `min_tokens`, at most `max_tokens`): until then
    /// end-of-sequence and `stop_token_ids` are never drawn and stop strings are not matched.
    pub min_tokens: u32,
    /// Strings that end generation; the matched string is returned only with
    /// `include_stop_str_in_output`.
    pub stop: Vec<String>,
    /// Return the stop string that ended generation at the end of the text (vLLM's field).
    pub include_stop_str_in_output: bool,
    /// Leave special tokens (end-of-turn markers and the like) out of the generated text
    /// (vLLM's field, default true); their ids and logprobs are reported either way.
    pub skip_special_tokens: bool,
    /// Token ids that end generation, in addition to EOS.
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past EOS (benchmarks that need a fixed output length).
    pub ignore_eos: bool,
    /// `Some(n)`: return each generated token's logprob and its `n` most likely alternatives.
    pub logprobs: Option<u32>,
    /// `Some(n)`: return the logprob of every prompt token and `n` alternatives (OpenAI `echo`).
    pub prompt_logprobs: Option<u32>,
}

impl Default for SamplingParams {
    /// The OpenAI defaults: plain sampling at temperature 1, 16 tokens, no stops, no logprobs.
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            seed: None,
            max_tokens: 16,
            min_tokens: 0,
            stop: Vec::new(),
            include_stop_str_in_output: false,
            skip_special_tokens: true,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            prompt_logprobs: None,
        }
    }
}

impl SamplingParams {
    /// Checks every parameter against its documented range; `vocab_size` bounds `stop_token_ids`
    /// and the ids of `logit_bias`.
    pub fn validate(&self, vocab_size: usize) -> Result<(), SamplingError> {
        self.validate_sampling()?;
        let mut biased: Vec<u32> = self.logit_bias.iter().map(|&(id, _)| id).collect();
        if let Some(id) = biased.iter().find(|&&id| id as usize >= vocab_size) {
            return Err(invalid(
                "logit_bias",
                format!("token id {id} is outside the vocabulary of {vocab_size} tokens"),
            ));
        }
        biased.sort_unstable();
        if let Some(pair) = biased.windows(2).find(|pair| pair[0] == pair[1]) {
            return Err(invalid(
                "logit_bias",
                format!("token id {} is given more than once", pair[0]),
            ));
        }
        check_logprobs("prompt_logprobs", self.prompt_logprobs)?;
        if self.min_tokens > self.max_tokens {
            return Err(invalid(
                "min_tokens",
                format!(
                    "must be at most max_tokens ({}), got {}",
                    self.max_tokens, self.min_tokens
                ),
            ));
        }
        if self.stop.len() > MAX_STOP_STRINGS {
            return Err(invalid(
                "stop",
                format!(
                    "at most {MAX_STOP_STRINGS} stop strings are allowed, got {}",
                    self.stop.len()
                ),
            ));
        }
        if self.stop.iter().any(String::is_empty) {
            return Err(invalid("stop", "stop strings must not be empty".into()));
        }
        if let Some(id) = self
            .stop_token_ids
            .iter()
            .find(|&&id| id as usize >= vocab_size)
        {
            return Err(invalid(
                "stop_token_ids",
                format!("token id {id} is outside the vocabulary of {vocab_size} tokens"),
            ));
        }
        Ok(())
    }

    /// The checks [`Sampler`] relies on; split out so a sampler can never be built from
    /// parameters that would make its arithmetic meaningless.
    pub(super) fn validate_sampling(&self) -> Result<(), SamplingError> {
        let t = self.temperature;
        if !(0.0..=MAX_TEMPERATURE).contains(&t) {
            return Err(invalid(
                "temperature",
                format!("must be in [0, {MAX_TEMPERATURE}], got {t}"),
            ));
        }
        let p = self.top_p;
        if !(p > 0.0 && p <= 1.0) {
            return Err(invalid("top_p", format!("must be in (0, 1], got {p}")));
        }
        check_range("min_p", self.min_p, 0.0, 1.0)?;
        check_range(
            "presence_penalty",
            self.presence_penalty,
            -MAX_PENALTY,
            MAX_PENALTY,
        )?;
        check_range(
            "frequency_penalty",
            self.frequency_penalty,
            -MAX_PENALTY,
            MAX_PENALTY,
        )?;
        let (low, high) = REPETITION_PENALTY_RANGE;
        check_range("repetition_penalty", self.repetition_penalty, low, high)?;
        for &(_, bias) in &self.logit_bias {
            check_range("logit_bias", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)?;
        }
        check_logprobs("logprobs", self.logprobs)
    }
}

fn check_range(param: &'static str, value: f32, low: f32, high: f32) -> Result<(), SamplingError> {
    if (low..=high).contains(&value) {
        return Ok(());
    }
    Err(invalid(
        param,
        format!("must be in [{low}, {high}], got {value}"),
    ))
}

fn check_logprobs(param: &'static str, n: Option<u32>) -> Result<(), SamplingError> {
    match n {
        Some(n) if n > MAX_LOGPROBS => Err(invalid(
            param,
            format!("must be at most {MAX_LOGPROBS}, got {n}"),
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            ..SamplingParams::default()
        }
    }

    #[test]
    fn validation_names_the_bad_param() {
        let ok = SamplingParams::default();
        assert_eq!(ok.validate(10), Ok(()));
        let cases: Vec<(SamplingParams, &str)> = vec![
            (params(-0.1), "temperature"),
            (params(2.01), "temperature"),
            (params(f32::NAN), "temperature"),
            (params(f32::INFINITY), "temperature"),
            (
                SamplingParams {
                    top_p: 0.0,
                    ..ok.clone()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    top_p: 1.01,
                    ..ok.clone()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    top_p: f32::NAN,
                    ..ok.clone()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    logprobs: Some(21),
                    ..ok.clone()
                },
                "logprobs",
            ),
            (
                SamplingParams {
                    prompt_logprobs: Some(21),
                    ..ok.clone()
                },
                "prompt_logprobs",
            ),
            (
                SamplingParams {
                    stop: vec!["x".into(); 5],
                    ..ok.clone()
                },
                "stop",
            ),
            (
                SamplingParams {
                    stop: vec![String::new()],
                    ..ok.clone()
                },
                "stop",
            ),
            (
                SamplingParams {
                    stop_token_ids: vec![3, 10],
                    ..ok.clone()
                },
                "stop_token_ids",
            ),
        ];
        let with = |f: fn(&mut SamplingParams)| {
            let mut p = ok.clone();
            f(&mut p);
            p
        };
        let cases = cases.into_iter().chain([
            (with(|p| p.min_p = -0.1), "min_p"),
            (with(|p| p.min_p = 1.5), "min_p"),
            (with(|p| p.presence_penalty = 2.5), "presence_penalty"),
            (with(|p| p.frequency_penalty = -2.5), "frequency_penalty"),
            (
                with(|p| p.frequency_penalty = f32::NAN),
                "frequency_penalty",
            ),
            (with(|p| p.repetition_penalty = 0.0), "repetition_penalty"),
            (
                with(|p| p.repetition_penalty = f32::INFINITY),
                "repetition_penalty",
            ),
            (with(|p| p.logit_bias = vec![(1, 101.0)]), "logit_bias"),
            (with(|p| p.logit_bias = vec![(10, 1.0)]), "logit_bias"),
            (
                with(|p| p.logit_bias = vec![(2, 1.0), (2, -1.0)]),
                "logit_bias",
            ),
        ]);
        for (p, param) in cases {
            let err = p.validate(10).unwrap_err();
            assert_eq!(err.param(), Some(param), "{err}");
        }
        let edges = SamplingParams {
            temperature: 2.0,
            top_k: u32::MAX,
            logprobs: Some(20),
            stop: vec!["a".into(); 4],
            stop_token_ids: vec![9],
            min_p: 1.0,
            presence_penalty: -2.0,
            frequency_penalty: 2.0,
            repetition_penalty: 0.01,
            logit_bias: vec![(0, -100.0), (9, 100.0)],
            ..ok.clone()
        };
        assert_eq!(edges.validate(10), Ok(()));
    }

    #[test]
    fn min_tokens_may_not_exceed_max_tokens() {
        let p = SamplingParams {
            max_tokens: 4,
            min_tokens: 4,
            ..SamplingParams::default()
        };
        assert_eq!(p.validate(10), Ok(()));
        let p = SamplingParams { min_tokens: 5, ..p };
        assert_eq!(p.validate(10).unwrap_err().param(), Some("min_tokens"));
    }

    #[test]
    fn params_deserialise_with_defaults() {
        let p: SamplingParams =
            serde_json::from_str(r#"{"temperature": 0, "stop": ["\n"]}"#).unwrap();
        assert_eq!(p.temperature, 0.0);
        assert_eq!(p.max_tokens, 16);
        assert_eq!(p.stop, ["\n"]);
        let back: SamplingParams =
            serde_json::from_value(serde_json::to_value(&p).unwrap()).unwrap();
        assert_eq!(back, p);
    }
}
