//! The request fields completions and chat share: sampling, stopping, streaming and vLLM's
//! extensions, read into the engine's [`SamplingParams`] with `generation_config.json`'s
//! defaults; and the vLLM fields rackfill does not implement, refused by name instead of
//! silently ignored. Only the JSON's shape is checked here (types, signs, `n`); the values'
//! ranges are the engine's to check, once ([`rackfill_engine::EngineHandle::validate`]).

use rackfill_engine::SamplingParams;
use serde_json::{Map, Value};

use crate::api_error::ApiError;
use crate::api_types::StreamOptions;
use crate::request_json;
use crate::AppState;

/// Largest `n`.
pub const MAX_N: i64 = 128;

/// Borrows the sampling fields that completion and chat requests share (they have the same
/// names in both request types) as [`CommonParams`].
macro_rules! common_params {
    ($request:expr) => {
        CommonParams {
            temperature: $request.temperature,
            top_p: $request.top_p,
            top_k: $request.top_k,
            min_p: $request.min_p,
            n: $request.n,
            min_tokens: $request.min_tokens,
            stop: $request.stop.as_ref(),
            stop_token_ids: $request.stop_token_ids.as_deref(),
            seed: $request.seed,
            ignore_eos: $request.ignore_eos,
            presence_penalty: $request.presence_penalty,
            frequency_penalty: $request.frequency_penalty,
            repetition_penalty: $request.repetition_penalty,
            logit_bias: $request.logit_bias.as_ref(),
            stream: $request.stream,
            stream_options: $request.stream_options.as_ref(),
            include_stop_str_in_output: $request.include_stop_str_in_output,
            skip_special_tokens: $request.skip_special_tokens,
            other: &$request.other,
        }
    };
}
pub(crate) use common_params;

/// Sampling fields shared by completions and chat, already read from the request.
pub(crate) struct CommonParams<'a> {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub n: Option<i64>,
    pub min_tokens: Option<i64>,
    pub stop: Option<&'a Value>,
    pub stop_token_ids: Option<&'a [u32]>,
    pub seed: Option<i64>,
    pub ignore_eos: Option<bool>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub logit_bias: Option<&'a Map<String, Value>>,
    pub stream: Option<bool>,
    pub stream_options: Option<&'a StreamOptions>,
    pub include_stop_str_in_output: Option<bool>,
    pub skip_special_tokens: Option<bool>,
    /// The request's fields the request type does not name, checked against
    /// [`UNSUPPORTED_FIELDS`].
    pub other: &'a Map<String, Value>,
}

/// What [`CommonParams::resolve`] gives back.
pub(crate) struct Resolved {
    pub params: SamplingParams,
    pub n: usize,
    pub stream: bool,
    pub usage: StreamUsage,
    /// `kv_transfer_params.do_remote_decode`: hand the prompt's KV to a decode engine.
    pub export_kv: bool,
}

/// Which usage a stream reports (`stream_options`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StreamUsage {
    /// No usage (no `usage` key in the chunks).
    None,
    /// `include_usage`: a closing chunk with the request's usage (`usage: null` before).
    Closing,
    /// `include_usage` and vLLM's `continuous_usage_stats`: every chunk carries its choice's
    /// usage so far, then the closing chunk.
    Continuous,
}

impl CommonParams<'_> {
    /// Reads the shared fields into [`SamplingParams`] (`max_tokens` and logprobs are set by the
    /// caller); omitted values take `generation_config.json`'s defaults.
    pub fn resolve(&self, state: &AppState) -> Result<Resolved, ApiError> {
        let info = state.backend().info();
        let gen = &info.generation;
        refuse_unsupported(self.other)?;
        let n = request_json::int_in("n", self.n.unwrap_or(1), 1, MAX_N)? as usize;
        let min_tokens = request_json::int_in(
            "min_tokens",
            self.min_tokens.unwrap_or(0),
            0,
            u32::MAX as i64,
        )?;
        let stream = self.stream.unwrap_or(false);
        if self.stream_options.is_some() && !stream {
            return Err(ApiError::invalid(
                "stream_options",
                "`stream_options` is only allowed when `stream` is true",
            ));
        }
        let usage = match self.stream_options {
            Some(StreamOptions {
                include_usage: Some(true),
                continuous_usage_stats,
            }) if *continuous_usage_stats == Some(true) => StreamUsage::Continuous,
            Some(StreamOptions {
                include_usage: Some(true),
                ..
            }) => StreamUsage::Closing,
            _ => StreamUsage::None,
        };
        let default_temperature = match gen.do_sample {
            Some(false) => 0.0,
            _ => gen.temperature.unwrap_or(1.0),
        };
        let top_k = request_json::int_in("top_k", self.top_k.unwrap_or(-1), -1, i64::MAX)?;
        let top_k = match (self.top_k, top_k) {
            (None, _) => gen.top_k.unwrap_or(0),
            (Some(_), -1) => 0,
            (Some(_), k) => k.min(u32::MAX as i64) as u32,
        };
        let params = SamplingParams {
            temperature: self.temperature.map_or(default_temperature, |t| t as f32),
            top_p: self.top_p.map_or(gen.top_p.unwrap_or(1.0), positive_f32),
            top_k,
            min_p: self.min_p.map_or(gen.min_p.unwrap_or(0.0), |p| p as f32),
            presence_penalty: self.presence_penalty.unwrap_or(0.0) as f32,
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0) as f32,
            repetition_penalty: self
                .repetition_penalty
                .map_or(gen.repetition_penalty.unwrap_or(1.0), |p| p as f32),
            logit_bias: self
                .logit_bias
                .map(request_json::logit_bias)
                .transpose()?
                .unwrap_or_default(),
            seed: self.seed.map(|s| s as u64),
            max_tokens: 0,
            min_tokens: min_tokens as u32,
            stop: request_json::stop_strings(self.stop)?,
            include_stop_str_in_output: self.include_stop_str_in_output.unwrap_or(false),
            skip_special_tokens: self.skip_special_tokens.unwrap_or(true),
            stop_token_ids: self.stop_token_ids.map(<[u32]>::to_vec).unwrap_or_default(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            logprobs: None,
            prompt_logprobs: None,
        };
        Ok(Resolved {
            params,
            n,
            stream,
            usage,
            export_kv: kv_transfer(self.other.get("kv_transfer_params"))?,
        })
    }
}

/// Reads vLLM's `kv_transfer_params` (what a disaggregation proxy sends a prefill instance):
/// whether the prompt's KV is to be exported (`do_remote_decode`). The proxy's other keys
/// (`remote_*: null`) are accepted; asking this prefill engine to pull KV is refused.
fn kv_transfer(value: Option<&Value>) -> Result<bool, ApiError> {
    const FIELD: &str = "kv_transfer_params";
    let map = match value {
        None | Some(Value::Null) => return Ok(false),
        Some(Value::Object(map)) => map,
        Some(_) => {
            return Err(ApiError::invalid(
                FIELD,
                "`kv_transfer_params` must be an object",
            ))
        }
    };
    let flag = |key: &str| match map.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::invalid(
            FIELD,
            format!("`kv_transfer_params.{key}` must be a boolean"),
        )),
    };
    if flag("do_remote_prefill")? {
        return Err(ApiError::invalid(
            FIELD,
            "`kv_transfer_params.do_remote_prefill`: rackfill is a prefill engine and does not \
             pull KV from another engine",
        ));
    }
    flag("do_remote_decode")
}

/// `value` as `f32`, except that a positive value below `f32`'s range becomes its smallest
/// positive value instead of 0: a tiny `top_p` is valid (it keeps only the most likely token),
/// and 0 is not.
fn positive_f32(value: f64) -> f32 {
    let narrowed = value as f32;
    if value > 0.0 && narrowed == 0.0 {
        f32::MIN_POSITIVE
    } else {
        narrowed
    }
}

/// vLLM request fields that change what is generated or returned and that rackfill does not
/// implement, with what to use instead: a client relying on one gets a 400 naming it, not a
/// response that silently ignored it. `null` (and `false` for the flags) is accepted as absent.
pub(crate) const UNSUPPORTED_FIELDS: &[(&str, &str)] = &[
    (
        "guided_json",
        "structured output (guided decoding) is not supported",
    ),
    (
        "guided_regex",
        "structured output (guided decoding) is not supported",
    ),
    (
        "guided_choice",
        "structured output (guided decoding) is not supported",
    ),
    (
        "guided_grammar",
        "structured output (guided decoding) is not supported",
    ),
    (
        "guided_decoding_backend",
        "structured output (guided decoding) is not supported",
    ),
    (
        "guided_whitespace_pattern",
        "structured output (guided decoding) is not supported",
    ),
    (
        "structured_outputs",
        "structured output (guided decoding) is not supported",
    ),
    ("use_beam_search", "beam search is not supported"),
    ("length_penalty", "beam search is not supported"),
    (
        "prompt_logprobs",
        "use `echo: true` with `logprobs` on /v1/completions to score a prompt",
    ),
    (
        "logits_processors",
        "custom logits processors are not supported",
    ),
    (
        "bad_words",
        "`bad_words` is not supported; `logit_bias` -100 bans single tokens",
    ),
    ("allowed_token_ids", "`allowed_token_ids` is not supported"),
];

/// 400 for the first field of [`UNSUPPORTED_FIELDS`] that `other` sets.
fn refuse_unsupported(other: &Map<String, Value>) -> Result<(), ApiError> {
    for (field, why) in UNSUPPORTED_FIELDS {
        let set = other
            .get(*field)
            .is_some_and(|value| !matches!(value, Value::Null | Value::Bool(false)));
        if set {
            return Err(ApiError::invalid(*field, format!("`{field}`: {why}")));
        }
    }
    Ok(())
}
