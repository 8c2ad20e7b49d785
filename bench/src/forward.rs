//! `rackfill bench forward`: prefill tokens/s of the dense single-device path.
//!
//! By default the model is the bench shape (a Qwen3-MoE with hidden 1024, 4 layers,
//! 16/4 heads of 64, 64 experts top-8, moe_intermediate 256, vocab 32000) with seeded synthetic
//! weights generated where they are read, so the bench runs anywhere without files. `--model DIR` loads a real
//! checkpoint instead: `scripts/bench_forward_hf.py` uses it to time transformers and rackfill on
//! the same weights side by side.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use rackfill_models::{Checkpoint, LogitsFor, ModelConfig, MoeModel, SequenceInput};
use rand::{Rng, SeedableRng};
use serde::Serialize;

pub use crate::model_shapes::{prefill_flops, tensor_shapes, ModelShape};

/// Errors of the forward bench.
#[derive(Debug, thiserror::Error)]
pub enum ForwardBenchError {
    #[error(transparent)]
    Model(#[from] rackfill_models::ModelError),
    #[error(transparent)]
    Shape(#[from] crate::model_shapes::ShapeError),
    #[error("prompt length must be positive")]
    EmptyPrompt,
    #[error("prompt length {tokens} exceeds the model's context of {context} tokens")]
    TooLong { tokens: usize, context: usize },
}

/// `config.json` of the bench shape.
pub fn bench_shape_config() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 32000,
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "moe_intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": true,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": false
    })
}

/// The bench-shape model with seeded random weights (norms 1, everything else with standard
/// deviation 0.02, the scale transformers initialises with), read through the real loader from
/// a synthetic checkpoint ([`Checkpoint::synthetic`]).
pub fn synthetic_bench_model(seed: u64) -> Result<MoeModel, ForwardBenchError> {
    let (config, checkpoint) = synthetic_bench_checkpoint(seed)?;
    Ok(MoeModel::from_checkpoint(config, &checkpoint)?)
}

/// The config and synthetic checkpoint of [`synthetic_bench_model`] (what the GPU path loads
/// from, its values generated on the device).
pub fn synthetic_bench_checkpoint(
    seed: u64,
) -> Result<(ModelConfig, Checkpoint), ForwardBenchError> {
    let config_json = bench_shape_config().to_string();
    let config = ModelConfig::from_json_str(&config_json, Path::new("<bench shape>"))?;
    let checkpoint = Checkpoint::synthetic("<bench shape>", tensor_shapes(&config), seed);
    Ok((config, checkpoint))
}

/// One prompt length's timings.
#[derive(Debug, Clone, Serialize)]
pub struct ForwardResult {
    pub tokens: usize,
    /// Median over repeats.
    pub tokens_per_s: f64,
    pub seconds: Vec<f64>,
    /// Model FLOPs of the prefill ([`prefill_flops`]) per second of the median run, TFLOP/s
    /// ([`ForwardReport::add_flops`]).
    pub model_tflops: f64,
    /// Model FLOP utilisation: `model_tflops` over the device's dense bf16 peak, where known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mfu: Option<f64>,
    /// Device time per phase of one profiled prefill, ms (the GPU path).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub phases_ms: BTreeMap<String, f64>,
}

/// The whole bench's output (the JSON `--json` writes).
#[derive(Debug, Clone, Serialize)]
pub struct ForwardReport {
    #[serde(rename = "impl")]
    pub implementation: &'static str,
    /// `cpu`, or the GPU that ran it ("NVIDIA H100 (sm_90)").
    pub device: String,
    pub model: String,
    pub threads: usize,
    /// The dense bf16 peak MFU divides by, TFLOP/s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_tflops: Option<f64>,
    /// The `config.json` of a `--model-shape` model (what `scripts/bench_forward_hf.py` builds
    /// transformers' model of the same shape from).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config: Option<serde_json::Value>,
    pub results: Vec<ForwardResult>,
}

impl ForwardReport {
    /// Fills each result's model TFLOP/s for `config` and, given the device's dense bf16
    /// `peak` (TFLOP/s), its model FLOP utilisation.
    pub fn add_flops(&mut self, config: &ModelConfig, peak: Option<f64>) {
        self.peak_tflops = peak;
        for r in &mut self.results {
            let flops = prefill_flops(config, r.tokens, 0);
            r.model_tflops = flops * r.tokens_per_s / r.tokens as f64 / 1e12;
            r.mfu = peak.map(|p| r.model_tflops / p);
        }
    }
}

/// A seeded random prompt of `len` tokens over `vocab`.
pub fn random_prompt(len: usize, seed: u64, vocab: usize) -> Vec<u32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..len).map(|_| rng.gen_range(0..vocab as u32)).collect()
}

/// Checks every prompt length before the first is timed: positive and within the model's context
/// (2^64-1 tokens overflowed the prompt's allocation, 2^32 ate memory for minutes).
pub fn check_lengths(config: &ModelConfig, lengths: &[usize]) -> Result<(), ForwardBenchError> {
    let context = config.max_position_embeddings;
    for &tokens in lengths {
        if tokens == 0 {
            return Err(ForwardBenchError::EmptyPrompt);
        }
        if tokens > context {
            return Err(ForwardBenchError::TooLong { tokens, context });
        }
    }
    Ok(())
}

/// Times one prefill (whole prompt, last-position logits) per repeat after one warm-up, for each
/// prompt length.
pub fn run_forward(
    model: &MoeModel,
    model_name: &str,
    lengths: &[usize],
    repeats: usize,
    seed: u64,
) -> Result<ForwardReport, ForwardBenchError> {
    check_lengths(model.config(), lengths)?;
    let vocab = model.config().vocab_size;
    let results = time_prefills(lengths, repeats, seed, vocab, |prompt| {
        let mut cache = model.new_cache();
        let mut batch = [SequenceInput {
            tokens: prompt,
            cache: &mut cache,
        }];
        model.forward(&mut batch, LogitsFor::LastPosition)?;
        Ok(())
    })?;
    Ok(ForwardReport {
        implementation: "rackfill",
        device: "cpu".into(),
        model: model_name.to_string(),
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        peak_tflops: None,
        config: None,
        results,
    })
}

/// For each prompt length: a seeded random prompt over `vocab`, one warm-up `prefill` of it, then
/// `repeats` timed ones (wall time of the call, which must return only once the logits are on
/// the host).
pub fn time_prefills(
    lengths: &[usize],
    repeats: usize,
    seed: u64,
    vocab: usize,
    mut prefill: impl FnMut(&[u32]) -> Result<(), ForwardBenchError>,
) -> Result<Vec<ForwardResult>, ForwardBenchError> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut results = Vec::with_capacity(lengths.len());
    for &length in lengths {
        let prompt: Vec<u32> = (0..length)
            .map(|_| rng.gen_range(0..vocab as u32))
            .collect();
        let mut time_once = || -> Result<f64, ForwardBenchError> {
            let start = Instant::now();
            prefill(&prompt)?;
            Ok(start.elapsed().as_secs_f64())
        };
        time_once()?;
        let seconds = (0..repeats.max(1))
            .map(|_| time_once())
            .collect::<Result<Vec<_>, _>>()?;
        let mut sorted = seconds.clone();
        sorted.sort_by(f64::total_cmp);
        let median = sorted[sorted.len() / 2];
        results.push(ForwardResult {
            tokens: length,
            tokens_per_s: length as f64 / median,
            seconds,
            model_tflops: 0.0,
            mfu: None,
            phases_ms: BTreeMap::new(),
        });
    }
    Ok(results)
}
