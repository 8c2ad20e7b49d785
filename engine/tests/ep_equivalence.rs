//! The EP runtime must compute what the dense single-rank path computes: for EP sizes 1, 2, 3,
//! 4 and 8, every balancer, prompts chunked across steps and several sequences per rank, the
//! logits of every position equal the dense logits within 1e-4 (max abs difference), and every
//! replica slot holds its home expert's weights byte for byte after streaming. With feature
//! `cuda` on a GPU host the same holds for the GPU data plane (tolerance [`GPU_TOLERANCE`]).

use std::path::PathBuf;
use std::sync::Arc;

use rackfill_balancer::Algo;
use rackfill_engine::{DataPlane, EpConfig, EpRuntime};
use rackfill_models::{KvCache, LogitsFor, ModelBundle, MoeModel, SequenceInput};

/// Max abs logit difference allowed between EP and dense (f32 on CPU; the combine is done in the
/// same order, so in practice the difference is zero or a few ulp).
const TOLERANCE: f32 = 1e-4;

/// The GPU plane computes experts with cuBLAS SGEMM (full f32, no TF32) and `expf`, in another
/// summation order than the CPU GEMM: its logits may differ by accumulated rounding.
#[cfg(feature = "cuda")]
const GPU_TOLERANCE: f32 = 2e-3;

fn builtin() -> Arc<MoeModel> {
    Arc::new(ModelBundle::builtin().expect("built-in model").model)
}

fn fixture(family: &str) -> Arc<MoeModel> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models/tests/fixtures")
        .join(family);
    Arc::new(MoeModel::load(&dir).expect("fixture loads"))
}

/// Deterministic prompts of assorted lengths over the model's vocabulary.
fn prompts(vocab: usize, lens: &[usize]) -> Vec<Vec<u32>> {
    lens.iter()
        .enumerate()
        .map(|(i, &n)| {
            (0..n)
                .map(|j| ((i * 7919 + j * 104_729 + j * j * 31) % vocab) as u32)
                .collect()
        })
        .collect()
}

/// Dense logits of every position of each prompt, one forward per prompt.
fn dense_logits(model: &MoeModel, prompts: &[Vec<u32>]) -> Vec<Vec<Vec<f32>>> {
    prompts
        .iter()
        .map(|p| {
            let mut cache = model.new_cache();
            let mut batch = [SequenceInput {
                tokens: p,
                cache: &mut cache,
            }];
            model
                .forward(&mut batch, LogitsFor::AllPositions)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap()
        })
        .collect()
}

/// Runs `prompts` through the EP runtime, sequence `i` on rank `i % R`, in steps of at most
/// `chunk` tokens per sequence; returns every position's logits per prompt.
fn ep_logits(
    runtime: &mut EpRuntime,
    model: &MoeModel,
    prompts: &[Vec<u32>],
    chunk: usize,
) -> (Vec<Vec<Vec<f32>>>, usize) {
    let ranks = runtime.config().ep_size;
    let mut replicas = 0;
    let mut caches: Vec<KvCache> = prompts.iter().map(|_| model.new_cache()).collect();
    let mut out: Vec<Vec<Vec<f32>>> = prompts.iter().map(|_| Vec::new()).collect();
    let mut done = vec![0usize; prompts.len()];
    while done.iter().zip(prompts).any(|(d, p)| *d < p.len()) {
        let mut members: Vec<Vec<usize>> = vec![Vec::new(); ranks];
        let mut batches: Vec<Vec<SequenceInput<'_>>> = (0..ranks).map(|_| Vec::new()).collect();
        for (i, cache) in caches.iter_mut().enumerate() {
            if done[i] >= prompts[i].len() {
                continue;
            }
            let end = (done[i] + chunk).min(prompts[i].len());
            batches[i % ranks].push(SequenceInput {
                tokens: &prompts[i][done[i]..end],
                cache,
            });
            members[i % ranks].push(i);
        }
        let which: Vec<Vec<LogitsFor>> = batches
            .iter()
            .map(|b| vec![LogitsFor::AllPositions; b.len()])
            .collect();
        let step = runtime.forward(&mut batches, &which).unwrap();
        drop(batches);
        for (rank, logits) in step.logits.iter().enumerate() {
            let Some(logits) = logits else { continue };
            let mut rows = logits.to_vec2::<f32>().unwrap().into_iter();
            for &i in &members[rank] {
                let end = (done[i] + chunk).min(prompts[i].len());
                out[i].extend(rows.by_ref().take(end - done[i]));
                done[i] = end;
            }
        }
        check_replica_slots(runtime, model, &step);
        replicas += step
            .layers
            .iter()
            .map(|l| l.metrics.replicas)
            .sum::<usize>();
    }
    (out, replicas)
}

/// After a step, every replica slot of the last MoE layer holds that layer's home expert's
/// weights exactly.
fn check_replica_slots(runtime: &EpRuntime, model: &MoeModel, step: &rackfill_engine::StepOutput) {
    let Some(last) = step.layers.last() else {
        return;
    };
    let rackfill_models::FeedForward::Moe(block) = model.layers()[last.layer].ffn() else {
        panic!("reported layer {} is not an MoE layer", last.layer);
    };
    let mut checked = 0;
    for (rank, slots) in last.slots.iter().enumerate() {
        for (slot, expert) in slots.iter().enumerate() {
            let Some(expert) = expert else { continue };
            let [gate_up, down] = block.experts[*expert as usize].weights();
            let held = runtime.slot_contents(rank, slot).unwrap();
            let (held_gate_up, held_down) = held.split_at(gate_up.len());
            assert!(
                held_gate_up
                    .iter()
                    .zip(gate_up)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
                    && held_down
                        .iter()
                        .zip(down)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                "rank {rank} slot {slot} differs from expert {expert}'s weights"
            );
            checked += 1;
        }
    }
    assert_eq!(checked, last.metrics.replicas, "every replica slot checked");
}

fn max_abs_diff(a: &[Vec<Vec<f32>>], b: &[Vec<Vec<f32>>]) -> f32 {
    let mut worst = 0f32;
    for (pa, pb) in a.iter().zip(b) {
        assert_eq!(pa.len(), pb.len(), "positions per prompt");
        for (ra, rb) in pa.iter().zip(pb) {
            for (x, y) in ra.iter().zip(rb) {
                worst = worst.max((x - y).abs());
            }
        }
    }
    worst
}

fn check(model: Arc<MoeModel>, ep_sizes: &[usize], algos: &[Algo], lens: &[usize], chunk: usize) {
    check_on(
        model,
        DataPlane::Cpu,
        TOLERANCE,
        ep_sizes,
        algos,
        lens,
        chunk,
    );
}

fn check_on(
    model: Arc<MoeModel>,
    data_plane: DataPlane,
    tolerance: f32,
    ep_sizes: &[usize],
    algos: &[Algo],
    lens: &[usize],
    chunk: usize,
) {
    let prompts = prompts(model.config().vocab_size, lens);
    let want = dense_logits(&model, &prompts);
    for &ep_size in ep_sizes {
        for &balancer in algos {
            let config = EpConfig {
                ep_size,
                redundant_slots: 2,
                balancer,
                verify_plans: true,
                data_plane,
                ..EpConfig::default()
            };
            let mut runtime = EpRuntime::new(Arc::clone(&model), config).unwrap();
            let (got, replicas) = ep_logits(&mut runtime, &model, &prompts, chunk);
            if ep_size > 1 && balancer == Algo::Quota {
                // Otherwise the replica path would be untested.
                assert!(replicas > 0, "EP {ep_size}: quota made no replicas");
            }
            let diff = max_abs_diff(&got, &want);
            assert!(
                diff <= tolerance,
                "EP {ep_size} with {balancer} on {data_plane:?}: max abs logit difference {diff}"
            );
        }
    }
}

#[test]
fn builtin_model_every_ep_size_and_balancer_matches_dense() {
    // Nine sequences of assorted lengths, chunks of 24 tokens: prompts span up to four steps,
    // ranks hold one to nine sequences, some ranks idle in late steps.
    check(
        builtin(),
        &[1, 2, 3, 4, 8],
        &Algo::ALL,
        &[70, 5, 33, 64, 1, 48, 90, 17, 25],
        24,
    );
}

#[test]
fn shared_experts_and_dense_layers_match_dense() {
    // Qwen2-MoE (sigmoid-gated shared expert), DeepSeek-V3 (MLA, grouped sigmoid router, dense
    // first layers, shared experts), Mixtral (sharded checkpoint), Qwen3-MoE with a dense layer.
    for family in ["qwen2_moe", "deepseek_v3", "mixtral", "qwen3_moe"] {
        check(
            fixture(family),
            &[3, 4],
            &[Algo::Quota, Algo::EplbExact],
            &[19, 7, 30, 12],
            8,
        );
    }
}

/// The GPU data plane (device solver for quota, relay trees and tile tasks built on the device,
/// tile streaming, device permute, cuBLAS experts) against the dense CPU path, every balancer,
/// plus the fixtures with shared experts and dense layers. `verify_plans` also makes every layer
/// compare the device's tile stream with the host compiler's. Skips with the reason on a machine
/// without a GPU; `RACKFILL_REQUIRE_GPU=1` makes a missing GPU a failure.
#[cfg(feature = "cuda")]
#[test]
fn gpu_data_plane_matches_dense() {
    let probe = rackfill_kernels::cuda::probe();
    if let Err(why) = probe {
        assert!(
            std::env::var("RACKFILL_REQUIRE_GPU").map_or(true, |v| v != "1"),
            "RACKFILL_REQUIRE_GPU=1 but no GPU: {why}"
        );
        eprintln!("gpu_data_plane_matches_dense: skipped, no CUDA GPU ({why})");
        return;
    }
    let gpu = DataPlane::Gpu { ordinal: 0 };
    check_on(
        builtin(),
        gpu,
        GPU_TOLERANCE,
        &[1, 2, 4, 8],
        &Algo::ALL,
        &[70, 5, 33, 64, 1, 48, 90, 17, 25],
        24,
    );
    for family in ["qwen2_moe", "deepseek_v3", "mixtral", "qwen3_moe"] {
        check_on(
            fixture(family),
            gpu,
            GPU_TOLERANCE,
            &[3, 4],
            &[Algo::Quota, Algo::EplbExact],
            &[19, 7, 30, 12],
            8,
        );
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn gpu_data_plane_needs_the_cuda_feature() {
    let config = EpConfig {
        ep_size: 2,
        data_plane: DataPlane::Gpu { ordinal: 0 },
        ..EpConfig::default()
    };
    let err = EpRuntime::new(builtin(), config).err().expect("refused");
    assert!(err.to_string().contains("--features cuda"), "{err}");
}
