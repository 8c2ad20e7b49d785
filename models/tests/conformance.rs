//! Conformance against HF transformers: each fixture is a tiny random checkpoint written by
//! `scripts/make_conformance_fixtures.py` with reference logits computed by transformers (f32,
//! eager attention). The checkpoints load through the real loading code; logits must match to
//! 1e-4 (max abs), whole-prompt, chunked across several forward calls with the KV cache, and with
//! all prompts batched together.

use std::path::{Path, PathBuf};

use candle_core::Tensor;
use rackfill_models::{LogitsFor, MoeModel, SequenceInput};
use safetensors::SafeTensors;

const TOLERANCE: f32 = 1e-4;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// `(input_ids, logits [T, V] row-major)` per prompt.
fn references(path: &Path) -> Vec<(Vec<u32>, Vec<f32>)> {
    let bytes = std::fs::read(path).expect("reference file");
    let tensors = SafeTensors::deserialize(&bytes).expect("reference safetensors");
    (0..)
        .map_while(|i| {
            let ids = tensors.tensor(&format!("input_ids_{i}")).ok()?;
            let logits = tensors.tensor(&format!("logits_{i}")).expect("logits");
            let ids = ids
                .data()
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
                .collect();
            let logits = logits
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            Some((ids, logits))
        })
        .collect()
}

fn max_abs_diff(got: &Tensor, want: &[f32]) -> f32 {
    let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(got.len(), want.len(), "logits size");
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
}

fn check_family(name: &str) {
    let dir = fixture(name);
    let model = MoeModel::load(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
    let refs = references(&dir.join("reference.safetensors"));
    assert!(refs.len() >= 3, "{name}: expected >= 3 reference prompts");
    let vocab = model.config().vocab_size;

    for (ids, want) in &refs {
        // Whole prompt in one forward.
        let mut cache = model.new_cache();
        let mut batch = [SequenceInput {
            tokens: ids,
            cache: &mut cache,
        }];
        let logits = model.forward(&mut batch, LogitsFor::AllPositions).unwrap();
        let diff = max_abs_diff(&logits, want);
        assert!(diff <= TOLERANCE, "{name}: whole prompt max |diff| {diff}");

        // The same prompt in chunks of 3 tokens through the KV cache.
        let mut cache = model.new_cache();
        let mut rows = Vec::new();
        for chunk in ids.chunks(3) {
            let mut batch = [SequenceInput {
                tokens: chunk,
                cache: &mut cache,
            }];
            rows.push(model.forward(&mut batch, LogitsFor::AllPositions).unwrap());
        }
        let chunked = Tensor::cat(&rows, 0).unwrap();
        let diff = max_abs_diff(&chunked, want);
        assert!(diff <= TOLERANCE, "{name}: chunked max |diff| {diff}");
        assert_eq!(cache.len(), ids.len());
    }

    // All prompts batched in one forward, last-position logits only.
    let mut caches: Vec<_> = refs.iter().map(|_| model.new_cache()).collect();
    let mut batch: Vec<SequenceInput<'_>> = refs
        .iter()
        .zip(caches.iter_mut())
        .map(|((ids, _), cache)| SequenceInput { tokens: ids, cache })
        .collect();
    let last = model.forward(&mut batch, LogitsFor::LastPosition).unwrap();
    for (i, (ids, want)) in refs.iter().enumerate() {
        let row = last.get(i).unwrap();
        let want_last = &want[(ids.len() - 1) * vocab..ids.len() * vocab];
        let diff = max_abs_diff(&row, want_last);
        assert!(
            diff <= TOLERANCE,
            "{name}: batched prompt {i} max |diff| {diff}"
        );
    }
}

#[test]
fn qwen3_moe_matches_transformers() {
    check_family("qwen3_moe");
}

#[test]
fn qwen3_moe_without_topk_renormalisation_matches_transformers() {
    check_family("qwen3_moe_nonorm");
}

#[test]
fn qwen3_moe_with_attention_bias_matches_transformers() {
    // q, k, v and o projections all carry biases; one KV head.
    check_family("qwen3_moe_attnbias");
}

#[test]
fn qwen2_moe_matches_transformers() {
    check_family("qwen2_moe");
}

#[test]
fn mixtral_sharded_f16_matches_transformers() {
    check_family("mixtral");
}

#[test]
fn deepseek_v3_matches_transformers() {
    check_family("deepseek_v3");
}

#[test]
fn deepseek_v3_without_q_lora_matches_transformers() {
    check_family("deepseek_v3_noqlora");
}

#[test]
fn deepseek_v3_with_linear_rope_and_large_eps_matches_transformers() {
    // The softmax scale takes mscale(factor, mscale_all_dim)^2 for linear RoPE too, and the q/kv
    // latent norms keep eps 1e-6 while every other norm uses rms_norm_eps 1e-2.
    check_family("deepseek_v3_linear_eps");
}
