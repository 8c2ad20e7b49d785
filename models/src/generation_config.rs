//! `generation_config.json`: the checkpoint's stop tokens and default sampling settings.
//!
//! Chat models often stop on more than the tokenizer's EOS (Llama 3 lists `<|eot_id|>` and
//! `<|end_of_text|>`), and requests that omit `temperature` or `top_p` should get the authors'
//! defaults, as they do with `transformers` and vLLM.

use std::path::Path;

use serde::{Deserialize, Deserializer};

use crate::{ModelError, Result};

/// The fields of `generation_config.json` rackfill uses; all are optional in the file.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationConfig {
    /// Beginning-of-sequence token.
    pub bos_token_id: Option<u32>,
    /// Every token that ends a generation (`eos_token_id` is an int or a list in the file).
    pub eos_token_ids: Vec<u32>,
    /// Padding token.
    pub pad_token_id: Option<u32>,
    /// Default sampling temperature.
    pub temperature: Option<f32>,
    /// Default nucleus-sampling mass.
    pub top_p: Option<f32>,
    /// Default top-k cutoff.
    pub top_k: Option<u32>,
    /// Default min-p cutoff.
    pub min_p: Option<f32>,
    /// Default repetition penalty (1 is none).
    pub repetition_penalty: Option<f32>,
    /// Default cap on generated tokens.
    pub max_new_tokens: Option<u32>,
    /// Whether the authors sample by default (`false` means greedy).
    pub do_sample: Option<bool>,
}

/// Mirror of the file; unknown fields are ignored, as `transformers` keeps them as extras.
#[derive(Deserialize)]
struct RawGenerationConfig {
    #[serde(default)]
    bos_token_id: Option<u32>,
    #[serde(default, deserialize_with = "one_or_many")]
    eos_token_id: Vec<u32>,
    #[serde(default)]
    pad_token_id: Option<u32>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    top_k: Option<u32>,
    #[serde(default)]
    min_p: Option<f32>,
    #[serde(default)]
    repetition_penalty: Option<f32>,
    #[serde(default)]
    max_new_tokens: Option<u32>,
    #[serde(default)]
    do_sample: Option<bool>,
}

/// `eos_token_id`: null, one id, or a list of ids.
fn one_or_many<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<u32>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(u32),
        Many(Vec<u32>),
    }
    match Option::<serde_json::Value>::deserialize(deserializer)? {
        None => Ok(Vec::new()),
        Some(value) => match OneOrMany::deserialize(value) {
            Ok(OneOrMany::One(id)) => Ok(vec![id]),
            Ok(OneOrMany::Many(ids)) => Ok(ids),
            Err(_) => Err(serde::de::Error::custom(
                "eos_token_id must be a token id or a list of token ids",
            )),
        },
    }
}

impl GenerationConfig {
    /// Reads `dir/generation_config.json`; `Ok(None)` when the checkpoint has none (it is
    /// optional), an error when it exists but is unreadable or malformed.
    pub fn load(dir: &Path) -> Result<Option<Self>> {
        let path = dir.join("generation_config.json");
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(ModelError::Io { path, source }),
        };
        Self::from_json_str(&text, &path.display().to_string()).map(Some)
    }

    /// Parses the contents of a `generation_config.json`; `origin` names it in errors.
    pub fn from_json_str(text: &str, origin: &str) -> Result<Self> {
        let error = |message: String| ModelError::Json {
            path: origin.into(),
            message,
        };
        // serde would also accept a struct written as a JSON array; the file is an object.
        if !text.trim_start().starts_with('{') {
            return Err(error("expected a JSON object".into()));
        }
        let raw: RawGenerationConfig =
            serde_json::from_str(text).map_err(|e| error(e.to_string()))?;
        Ok(Self {
            bos_token_id: raw.bos_token_id,
            eos_token_ids: raw.eos_token_id,
            pad_token_id: raw.pad_token_id,
            temperature: raw.temperature,
            top_p: raw.top_p,
            top_k: raw.top_k,
            min_p: raw.min_p,
            repetition_penalty: raw.repetition_penalty,
            max_new_tokens: raw.max_new_tokens,
            do_sample: raw.do_sample,
        })
    }
}
