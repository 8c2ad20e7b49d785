//! The whole model through the GPU path (`rackfill_models::gpu`), run on the host emulator,
//! agrees with the CPU model: the built-in model and one conformance checkpoint per family (and
//! the DeepSeek variants without q LoRA and with linear RoPE), for a batch of sequences of
//! different lengths, a sequence prefilled in chunks over its cached context then decoded, and
//! a sequence that reuses the blocks of one that ended.
//!
//! Tolerance (bf16 weights, bf16 KV cache and GEMM inputs against the CPU's f32): every logit
//! within `0.03 * max|logit| + 0.03` of the CPU's, and the same arg-max wherever the CPU's top
//! two logits are more than that apart. Needs a C++ compiler for the emulator; without one it
//! says so and passes.

#![cfg(feature = "cuda")]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rackfill_kernels::cuda::exec::{Emulator, Executor};
use rackfill_models::gpu::{GpuInput, GpuModel};
use rackfill_models::model::{LogitsFor, MoeModel, SequenceInput};

fn fixture(name: &str) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    match name {
        "builtin" => root.join("builtin"),
        _ => root.join("tests/fixtures").join(name),
    }
}

fn prompt(len: usize, seed: u32, vocab: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed.wrapping_mul(40_503)) >> 7) % vocab as u32)
        .collect()
}

/// Checks `got` against `want` (both `[rows, vocab]`); returns the largest difference.
fn check(name: &str, what: &str, got: &[f32], want: &[f32], vocab: usize) -> f32 {
    assert_eq!(got.len(), want.len(), "{name} {what}: logit count");
    let mut worst = 0f32;
    for (row, (g, w)) in got.chunks_exact(vocab).zip(want.chunks_exact(vocab)).enumerate() {
        let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
        let tol = 0.03 * scale + 0.03;
        for (a, b) in g.iter().zip(w) {
            let d = (a - b).abs();
            worst = worst.max(d);
            assert!(d <= tol, "{name} {what} row {row}: {a} vs {b} (tolerance {tol})");
        }
        let mut order: Vec<usize> = (0..vocab).collect();
        order.sort_by(|&x, &y| w[y].total_cmp(&w[x]));
        if w[order[0]] - w[order[1]] > tol {
            let best = (0..vocab).max_by(|&x, &y| g[x].total_cmp(&g[y])).unwrap();
            assert_eq!(best, order[0], "{name} {what} row {row}: arg-max");
        }
    }
    worst
}

fn cpu_logits(model: &MoeModel, batch: &mut [(Vec<u32>, &mut rackfill_models::layers::attention::KvCache)], which: LogitsFor) -> Vec<f32> {
    let mut inputs: Vec<SequenceInput<'_>> =
        batch.iter_mut().map(|(t, c)| SequenceInput { tokens: t, cache: c }).collect();
    model.forward(&mut inputs, which).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

fn check_model(name: &str, exec: Arc<dyn Executor>) {
    let model = MoeModel::load(&fixture(name)).unwrap();
    let vocab = model.config().vocab_size;
    let mut gpu = GpuModel::upload(exec, &model, 256).unwrap();
    let free = gpu.free_blocks();
    let (a, b) = (prompt(21, 1, vocab), prompt(9, 2, vocab));

    // A batch of two sequences, every position's logits.
    let (mut ca, mut cb) = (model.new_cache(), model.new_cache());
    let want = cpu_logits(&model, &mut [(a.clone(), &mut ca), (b.clone(), &mut cb)], LogitsFor::AllPositions);
    let (mut sa, mut sb) = (gpu.new_sequence(), gpu.new_sequence());
    let got = gpu
        .forward(&mut [
            GpuInput { tokens: &a, sequence: &mut sa, logits: LogitsFor::AllPositions },
            GpuInput { tokens: &b, sequence: &mut sb, logits: LogitsFor::AllPositions },
        ])
        .unwrap();
    let mut worst = check(name, "batch", &got, &want, vocab);

    // Chunked prefill over the cached context, then one decoded token, against the CPU's cache.
    let (c1, c2, next) = (prompt(13, 3, vocab), prompt(18, 4, vocab), prompt(1, 5, vocab));
    let mut cc = model.new_cache();
    let mut sc = gpu.new_sequence();
    for (chunk, which) in [(&c1, LogitsFor::LastPosition), (&c2, LogitsFor::AllPositions), (&next, LogitsFor::LastPosition)] {
        let want = cpu_logits(&model, &mut [(chunk.clone(), &mut cc)], which);
        let got = gpu.forward(&mut [GpuInput { tokens: chunk, sequence: &mut sc, logits: which }]).unwrap();
        worst = worst.max(check(name, "chunk", &got, &want, vocab));
    }

    // A sequence ends; a new one takes its blocks and still gets the right logits.
    gpu.release(sa).unwrap();
    let d = prompt(30, 6, vocab);
    let mut cd = model.new_cache();
    let want = cpu_logits(&model, &mut [(d.clone(), &mut cd)], LogitsFor::AllPositions);
    let mut sd = gpu.new_sequence();
    let got = gpu.forward(&mut [GpuInput { tokens: &d, sequence: &mut sd, logits: LogitsFor::AllPositions }]).unwrap();
    worst = worst.max(check(name, "reused blocks", &got, &want, vocab));
    for s in [sb, sc, sd] {
        gpu.release(s).unwrap();
    }
    assert_eq!(gpu.free_blocks(), free, "{name}: every block back in the pool");
    eprintln!("{name}: max |logit difference| {worst:.4}");
}

macro_rules! family {
    ($test:ident, $name:literal) => {
        #[test]
        fn $test() {
            let Some(emulator) = Emulator::shared() else { return };
            check_model($name, emulator);
        }
    };
}

family!(builtin_model_on_the_emulated_gpu_matches_the_cpu, "builtin");
family!(qwen3_moe_on_the_emulated_gpu_matches_the_cpu, "qwen3_moe");
family!(qwen3_moe_with_attention_bias_on_the_emulated_gpu_matches_the_cpu, "qwen3_moe_attnbias");
family!(qwen2_moe_on_the_emulated_gpu_matches_the_cpu, "qwen2_moe");
family!(mixtral_on_the_emulated_gpu_matches_the_cpu, "mixtral");
family!(deepseek_v3_on_the_emulated_gpu_matches_the_cpu, "deepseek_v3");
family!(deepseek_v3_without_q_lora_on_the_emulated_gpu_matches_the_cpu, "deepseek_v3_noqlora");
family!(deepseek_v3_with_linear_rope_on_the_emulated_gpu_matches_the_cpu, "deepseek_v3_linear_eps");
