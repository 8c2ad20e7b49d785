//! The whole model through the GPU path (`rackfill_models::gpu`), run on the host emulator,
//! agrees with the CPU model: the built-in model and one conformance checkpoint per family (and
//! the DeepSeek variants without q LoRA and with linear RoPE), for a batch of sequences of
//! different lengths, a sequence prefilled in chunks over its cached context then decoded, and
//! a sequence that reuses the blocks of one that ended. On every executor there is: the host
//! emulator, and GPU 0 on a GPU host.
//!
//! The CPU reference runs in f32 with the GPU path's expert choices (its own router would pick
//! the same experts but for near ties, where bf16 activations tip a choice: on a random tiny
//! model that happens to a few tokens, and one different expert moves a logit by more than any
//! rounding): so the comparison measures rounding alone, and the choices themselves must agree
//! with the CPU router's for at least 90% of (token, layer) pairs.
//!
//! Tolerance (bf16 weights, bf16 KV cache and GEMM inputs against the CPU's f32): a row of
//! logits within 6% relative L2 error of the CPU's, every logit within `0.08 * max|logit| +
//! 0.08`, and the same arg-max wherever the CPU's top two logits are further apart than that.
//! Measured on the emulator: 0.8% for the built-in model (bf16 checkpoint), 1.4-4.3% for the
//! fixtures (f32 checkpoints rounded to bf16 at upload; random weights amplify rounding more
//! than trained ones), where a wrong index or scale gives tens of percent. Needs a C++ compiler
//! for the emulator; without one it says so and passes.

#![cfg(feature = "cuda")]

/// Largest relative L2 error of a row of logits.
const MAX_RELATIVE_L2: f32 = 0.06;
/// Every logit within this fraction of the row's largest (plus the same, absolute).
const MAX_ABS_FRACTION: f32 = 0.08;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rackfill_kernels::cuda::exec::{available, Executor};
use rackfill_models::gpu::{ExpertPlacement, GpuInput, GpuModel, GpuSequence};
use rackfill_models::model::{FeedForward, LogitsFor, MoeModel};
use rackfill_models::{Checkpoint, KvCache, ModelConfig, Routing, SeqChunk};

fn fixture(name: &str) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    match name {
        "builtin" => root.join("builtin"),
        _ => root.join("tests/fixtures").join(name),
    }
}

fn prompt(len: usize, seed: u32, vocab: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| {
            (i.wrapping_mul(2_654_435_761)
                .wrapping_add(seed.wrapping_mul(40_503))
                >> 7)
                % vocab as u32
        })
        .collect()
}

/// Checks `got` against `want` (both `[rows, vocab]`); returns the largest relative L2 error
/// of a row.
fn check(name: &str, what: &str, got: &[f32], want: &[f32], vocab: usize) -> f32 {
    assert_eq!(got.len(), want.len(), "{name} {what}: logit count");
    let mut worst = 0f32;
    for (row, (g, w)) in got
        .chunks_exact(vocab)
        .zip(want.chunks_exact(vocab))
        .enumerate()
    {
        let norm = w.iter().map(|v| v * v).sum::<f32>().sqrt();
        let err = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b) * (a - b))
            .sum::<f32>()
            .sqrt();
        let relative = err / norm.max(1e-6);
        worst = worst.max(relative);
        assert!(
            relative <= MAX_RELATIVE_L2,
            "{name} {what} row {row}: relative L2 error {relative}"
        );
        let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
        let tol = MAX_ABS_FRACTION * scale + MAX_ABS_FRACTION;
        for (a, b) in g.iter().zip(w) {
            assert!(
                (a - b).abs() <= tol,
                "{name} {what} row {row}: {a} vs {b} (tolerance {tol})"
            );
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

/// The CPU model's f32 forward of `batch` (each sequence continuing from its cache) with every
/// MoE layer's experts chosen as `routing` says; also counts the (token, layer) choices where the
/// CPU's own router agrees.
struct Reference {
    logits: Vec<f32>,
    same_choice: usize,
    choices: usize,
}

fn cpu_reference(
    model: &MoeModel,
    batch: &mut [(&[u32], &mut KvCache)],
    routing: &[Routing],
    which: LogitsFor,
) -> Reference {
    let tokens: Vec<u32> = batch.iter().flat_map(|(t, _)| t.iter().copied()).collect();
    let mut x = model.embed(&tokens).unwrap();
    let (mut moe, mut same_choice, mut choices) = (0, 0, 0);
    for (index, layer) in model.layers().iter().enumerate() {
        let mut chunks: Vec<SeqChunk<'_>> = batch
            .iter_mut()
            .map(|(t, cache)| SeqChunk {
                len: t.len(),
                cache: &mut cache.layers[index],
            })
            .collect();
        let h = layer.attention_residual(&x, &mut chunks).unwrap();
        let input = layer.ffn_input(&h).unwrap();
        let out = match layer.ffn() {
            FeedForward::Dense(mlp) => candle_core::Module::forward(mlp, &input).unwrap(),
            FeedForward::Moe(block) => {
                let chosen = &routing[moe];
                moe += 1;
                let own = block.router.route(&input).unwrap();
                for (a, b) in own
                    .experts
                    .chunks(own.top_k)
                    .zip(chosen.experts.chunks(chosen.top_k))
                {
                    let (mut a, mut b) = (a.to_vec(), b.to_vec());
                    a.sort_unstable();
                    b.sort_unstable();
                    same_choice += usize::from(a == b);
                    choices += 1;
                }
                let routed = block.forward_routed(&input, chosen).unwrap();
                block.add_shared(&input, routed).unwrap()
            }
        };
        x = (h + out).unwrap();
    }
    assert_eq!(moe, routing.len(), "one routing per MoE layer");
    let lens: Vec<usize> = batch.iter().map(|(t, _)| t.len()).collect();
    let logits = model
        .logits_for(x, &lens, &vec![which; batch.len()])
        .unwrap();
    Reference {
        logits: logits.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        same_choice,
        choices,
    }
}

/// Runs one step on both paths and compares; returns (largest difference, same choices, choices).
fn step(
    name: &str,
    what: &str,
    model: &MoeModel,
    gpu: &GpuModel,
    batch: &mut [(&[u32], &mut KvCache, &mut GpuSequence)],
    which: LogitsFor,
) -> (f32, usize, usize) {
    let mut inputs: Vec<GpuInput<'_>> = batch
        .iter_mut()
        .map(|(t, _, s)| GpuInput {
            tokens: t,
            sequence: s,
            logits: which,
        })
        .collect();
    let got = gpu.forward(&mut inputs).unwrap();
    let mut cpu: Vec<(&[u32], &mut KvCache)> =
        batch.iter_mut().map(|(t, c, _)| (*t, &mut **c)).collect();
    let want = cpu_reference(model, &mut cpu, &got.routing, which);
    let vocab = model.config().vocab_size;
    (
        check(name, what, &got.logits, &want.logits, vocab),
        want.same_choice,
        want.choices,
    )
}

fn check_model(name: &str, exec: Arc<dyn Executor>) {
    let dir = fixture(name);
    // The device model from the same checkpoint, straight from its files.
    let (config, checkpoint) = (
        ModelConfig::load(&dir).unwrap(),
        Checkpoint::open(&dir).unwrap(),
    );
    check_checkpoint(name, &config, &checkpoint, exec);
}

/// The CPU model and the device model of `config` from `checkpoint`, stepped side by side.
fn check_checkpoint(
    name: &str,
    config: &ModelConfig,
    checkpoint: &Checkpoint,
    exec: Arc<dyn Executor>,
) {
    let model = MoeModel::from_checkpoint(config.clone(), checkpoint).unwrap();
    let vocab = model.config().vocab_size;
    let (config, checkpoint) = (config, checkpoint);
    let (gpu, homes) =
        GpuModel::load(exec, config, checkpoint, 256, ExpertPlacement::Here).unwrap();
    assert!(homes.is_none());
    let free = gpu.free_blocks();
    let (a, b) = (prompt(17, 1, vocab), prompt(6, 2, vocab));
    let mut results = Vec::new();

    // A batch of two sequences, every position's logits.
    let (mut ca, mut cb) = (model.new_cache(), model.new_cache());
    let (mut sa, mut sb) = (gpu.new_sequence(), gpu.new_sequence());
    results.push(step(
        name,
        "batch",
        &model,
        &gpu,
        &mut [(&a, &mut ca, &mut sa), (&b, &mut cb, &mut sb)],
        LogitsFor::AllPositions,
    ));

    // Chunked prefill over the cached context, then one decoded token.
    let (c1, c2, next) = (
        prompt(13, 3, vocab),
        prompt(18, 4, vocab),
        prompt(1, 5, vocab),
    );
    let (mut cc, mut sc) = (model.new_cache(), gpu.new_sequence());
    for (chunk, which) in [
        (&c1, LogitsFor::LastPosition),
        (&c2, LogitsFor::AllPositions),
        (&next, LogitsFor::LastPosition),
    ] {
        results.push(step(
            name,
            "chunk",
            &model,
            &gpu,
            &mut [(chunk, &mut cc, &mut sc)],
            which,
        ));
    }

    // A sequence ends; a new one takes its blocks and still gets the right logits.
    drop(sa);
    let d = prompt(12, 6, vocab);
    let (mut cd, mut sd) = (model.new_cache(), gpu.new_sequence());
    results.push(step(
        name,
        "reused blocks",
        &model,
        &gpu,
        &mut [(&d, &mut cd, &mut sd)],
        LogitsFor::AllPositions,
    ));
    drop((sb, sc, sd));
    assert_eq!(
        gpu.free_blocks(),
        free,
        "{name}: every block back in the pool"
    );
    let worst = results.iter().map(|r| r.0).fold(0f32, f32::max);
    let (same, all) = results.iter().fold((0, 0), |(s, a), r| (s + r.1, a + r.2));
    eprintln!(
        "{name} on {}: worst relative L2 error of a row of logits {worst:.4}; expert choices \
         as the CPU router's: {same}/{all}",
        gpu.describe()
    );
    assert!(
        same * 100 >= all * 90,
        "{name}: the GPU router agrees with the CPU's on {same} of {all} choices"
    );
}

macro_rules! family {
    ($test:ident, $name:literal) => {
        #[test]
        fn $test() {
            for exec in available() {
                check_model($name, exec);
            }
        }
    };
}

family!(builtin_model_on_the_gpu_path_matches_the_cpu, "builtin");
family!(qwen3_moe_on_the_gpu_path_matches_the_cpu, "qwen3_moe");
family!(
    qwen3_moe_with_attention_bias_on_the_gpu_path_matches_the_cpu,
    "qwen3_moe_attnbias"
);
family!(qwen2_moe_on_the_gpu_path_matches_the_cpu, "qwen2_moe");
family!(mixtral_on_the_gpu_path_matches_the_cpu, "mixtral");
family!(deepseek_v3_on_the_gpu_path_matches_the_cpu, "deepseek_v3");
family!(
    deepseek_v3_without_q_lora_on_the_gpu_path_matches_the_cpu,
    "deepseek_v3_noqlora"
);
family!(
    deepseek_v3_with_linear_rope_on_the_gpu_path_matches_the_cpu,
    "deepseek_v3_linear_eps"
);

#[test]
fn a_synthetic_checkpoint_reads_the_same_on_the_host_and_the_device() {
    // The fixture's tensor names and shapes with no stored values: the device generates each
    // tensor in place (`fill_synthetic`), the CPU model from the same seeds on the host; the
    // two models must agree as two loads of one file do.
    for name in ["qwen3_moe", "deepseek_v3"] {
        let dir = fixture(name);
        let config = ModelConfig::load(&dir).unwrap();
        let shapes = Checkpoint::open(&dir)
            .unwrap()
            .tensor_shapes()
            .into_iter()
            .map(|(name, shape)| (name.to_string(), shape.to_vec()))
            .collect();
        let synthetic = Checkpoint::synthetic("synthetic", shapes, 5);
        for exec in available() {
            check_checkpoint(&format!("synthetic {name}"), &config, &synthetic, exec);
        }
    }
}
