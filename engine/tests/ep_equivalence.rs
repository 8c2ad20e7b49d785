//! The EP runtime must compute what the dense single-rank path computes: for EP sizes 1, 2, 3,
//! 4 and 8, every balancer, prompts chunked across steps and several sequences per rank, the
//! logits of every position equal the dense logits within 1e-4 (max abs difference), and every
//! replica slot holds its home expert's weights byte for byte after streaming. With feature
//! `cuda`, the runtime on a device (the host emulator everywhere, GPU 0 on a GPU host: the model
//! and its MoE data plane in bf16) computes what the device's own dense path computes, for every
//! balancer, EP size, schedule and slot memory, one process or several (tolerance
//! [`DEVICE_TOLERANCE`]).

use std::path::PathBuf;
use std::sync::Arc;

use rackfill_balancer::Algo;
use rackfill_engine::ep::SlotLayout;
use rackfill_engine::fabric::LocalFabric;
use rackfill_engine::{EpConfig, EpRuntime, LayerReport, Schedule, SlotMemory};
use rackfill_models::{KvCache, LogitsFor, ModelBundle, MoeModel, SequenceInput};

/// Max abs logit difference allowed between EP and dense (f32 on CPU; the combine is done in the
/// same order, so in practice the difference is zero or a few ulp).
const TOLERANCE: f32 = 1e-4;

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

/// What a runtime computed for the prompts on its ranks.
struct EpRun {
    /// Per prompt: every position's logits (empty for prompts on other processes' ranks).
    logits: Vec<Vec<Vec<f32>>>,
    /// Replicas over all steps and layers.
    replicas: usize,
    /// Every step's layer reports, in order.
    layers: Vec<LayerReport>,
}

/// Runs `prompts` through the EP runtime, sequence `i` on rank `i % R`, in steps of at most
/// `chunk` tokens per sequence. The runtime computes its local ranks' sequences and steps until
/// every prompt of every rank is done (a process whose ranks are idle still steps with the
/// others, as the fabric requires).
fn ep_logits(
    runtime: &mut EpRuntime,
    model: &MoeModel,
    prompts: &[Vec<u32>],
    chunk: usize,
) -> EpRun {
    try_ep_logits(runtime, model, prompts, chunk).unwrap()
}

/// [`ep_logits`] on a fresh runtime of `config` over `model`.
fn fresh_ep_logits(
    model: &Arc<MoeModel>,
    config: EpConfig,
    prompts: &[Vec<u32>],
    chunk: usize,
) -> EpRun {
    let mut runtime = EpRuntime::new(Arc::clone(model), config).unwrap();
    ep_logits(&mut runtime, model, prompts, chunk)
}

/// [`ep_logits`], or the first step's error.
fn try_ep_logits(
    runtime: &mut EpRuntime,
    model: &MoeModel,
    prompts: &[Vec<u32>],
    chunk: usize,
) -> rackfill_engine::Result<EpRun> {
    let ranks = runtime.config().ep_size;
    let local = runtime.local_ranks();
    let mut run = EpRun {
        logits: prompts.iter().map(|_| Vec::new()).collect(),
        replicas: 0,
        layers: Vec::new(),
    };
    let mut caches: Vec<KvCache> = prompts
        .iter()
        .map(|_| runtime.new_cache(rackfill_models::KV_BLOCK_TOKENS))
        .collect();
    let mut done = vec![0usize; prompts.len()];
    while done.iter().zip(prompts).any(|(d, p)| *d < p.len()) {
        let ends: Vec<usize> = done
            .iter()
            .zip(prompts)
            .map(|(&d, p)| (d + chunk).min(p.len()))
            .collect();
        let mut members: Vec<Vec<usize>> = vec![Vec::new(); local.len()];
        let mut batches: Vec<Vec<SequenceInput<'_>>> =
            (0..local.len()).map(|_| Vec::new()).collect();
        for (i, cache) in caches.iter_mut().enumerate() {
            let rank = i % ranks;
            if done[i] >= prompts[i].len() || !local.contains(&rank) {
                continue;
            }
            batches[rank - local.start].push(SequenceInput {
                tokens: &prompts[i][done[i]..ends[i]],
                cache,
            });
            members[rank - local.start].push(i);
        }
        let which: Vec<Vec<LogitsFor>> = batches
            .iter()
            .map(|b| vec![LogitsFor::AllPositions; b.len()])
            .collect();
        let step = runtime.forward(&mut batches, &which)?;
        drop(batches);
        for (logits, members) in step.logits.iter().zip(&members) {
            let Some(logits) = logits else { continue };
            let mut rows = logits.to_vec2::<f32>().unwrap().into_iter();
            for &i in members {
                run.logits[i].extend(rows.by_ref().take(ends[i] - done[i]));
            }
        }
        done = ends;
        check_replica_slots(runtime, model, &step);
        run.replicas += step
            .layers
            .iter()
            .map(|l| l.metrics.replicas)
            .sum::<usize>();
        run.layers.extend(step.layers);
    }
    Ok(run)
}

/// After a step, every replica slot of the last MoE layer on the runtime's ranks holds that
/// layer's home expert's weights exactly (rounded to bf16 on the device's own data plane), in
/// each micro-batch's own slots; with per-layer slots, every MoE layer's.
fn check_replica_slots(runtime: &EpRuntime, model: &MoeModel, step: &rackfill_engine::StepOutput) {
    let Some(last_layer) = step.layers.last().map(|l| l.layer) else {
        return;
    };
    let per_layer = runtime.config().slot_memory == SlotMemory::PerLayer;
    let lasts: Vec<&LayerReport> = step
        .layers
        .iter()
        .filter(|l| l.layer == last_layer)
        .collect();
    assert_eq!(
        lasts.iter().map(|l| l.micro_batch).collect::<Vec<_>>(),
        (0..runtime.config().schedule.micro_batches).collect::<Vec<_>>(),
        "one report per micro-batch, in order"
    );
    for report in &step.layers {
        if per_layer || report.layer == last_layer {
            check_micro_batch_slots(runtime, model, report);
        }
    }
}

fn check_micro_batch_slots(runtime: &EpRuntime, model: &MoeModel, last: &LayerReport) {
    let rackfill_models::FeedForward::Moe(block) = model.layers()[last.layer].ffn() else {
        panic!("reported layer {} is not an MoE layer", last.layer);
    };
    let local = runtime.local_ranks();
    let mut checked = 0;
    for (rank, slots) in last.slots.iter().enumerate() {
        if !local.contains(&rank) {
            assert!(
                runtime
                    .slot_contents((last.micro_batch, last.layer), rank, 0)
                    .is_none(),
                "rank {rank} is not here"
            );
            continue;
        }
        for (slot, expert) in slots.iter().enumerate() {
            let Some(expert) = expert else { continue };
            let weights = block.experts.get(*expert).unwrap().weights();
            let held = runtime
                .slot_contents((last.micro_batch, last.layer), rank, slot)
                .unwrap();
            let want = as_held(weights, runtime.slot_layout(), model.config().hidden_size);
            assert!(
                held.len() == want.len()
                    && held
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                "rank {rank} slot {slot} differs from expert {expert}'s weights"
            );
            checked += 1;
        }
    }
    let filled: usize = last.slots[local]
        .iter()
        .map(|slots| slots.iter().flatten().count())
        .sum();
    assert_eq!(checked, filled, "every local replica slot checked");
}

/// An expert's host weights (`[H, 2I]` gate-up, `[I, H]` down) as a slot laid out `layout`
/// holds them: as they are on the host; on a device in bf16, each matrix transposed to a
/// checkpoint's `out x in` orientation.
fn as_held([gate_up, down]: [&[f32]; 2], layout: SlotLayout, hidden: usize) -> Vec<f32> {
    match layout {
        SlotLayout::HostF32 => gate_up.iter().chain(down).copied().collect(),
        SlotLayout::DeviceBf16 => {
            let inter = down.len() / hidden;
            // Nearest even, as the device rounds once at upload.
            let round = |v: f32| {
                let u = v.to_bits();
                f32::from_bits(((u + 0x7fff + ((u >> 16) & 1)) >> 16) << 16)
            };
            let mut out = Vec::with_capacity(gate_up.len() + down.len());
            for j in 0..2 * inter {
                out.extend((0..hidden).map(|h| round(gate_up[h * 2 * inter + j])));
            }
            for h in 0..hidden {
                out.extend((0..inter).map(|i| round(down[i * hidden + h])));
            }
            out
        }
    }
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
        EpConfig::default(),
        TOLERANCE,
        ep_sizes,
        algos,
        lens,
        chunk,
    );
}

/// The EP runtime configured as `base` (its data plane, micro-batches and slot memory) at every
/// EP size and balancer, 2 redundant slots, plans verified, against the dense logits.
fn check_on(
    model: Arc<MoeModel>,
    base: EpConfig,
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
                ..base
            };
            let run = fresh_ep_logits(&model, config, &prompts, chunk);
            if ep_size > 1 && balancer == Algo::Quota {
                // Otherwise the replica path would be untested.
                assert!(run.replicas > 0, "EP {ep_size}: quota made no replicas");
            }
            let diff = max_abs_diff(&run.logits, &want);
            assert!(
                diff <= tolerance,
                "EP {ep_size} with {balancer}, schedule {}, {} slots: max abs logit difference \
                 {diff}",
                base.schedule.name(),
                base.slot_memory.name(),
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

/// Two micro-batches in flight (one communicates while the other computes), each with its own
/// load, plan and replica slots: the dense logits within [`TOLERANCE`] for every balancer, on the
/// built-in model (ranks with one sequence, whose second micro-batch is empty, included) and on
/// fixtures with shared experts and dense layers; every micro-batch's slots hold its replicas'
/// exact bytes.
#[test]
fn two_micro_batches_match_dense_for_every_balancer() {
    check_on(
        builtin(),
        two_micro_batches(),
        TOLERANCE,
        &[1, 3, 8],
        &Algo::ALL,
        &[70, 5, 33, 64, 1, 48, 90, 17, 25],
        24,
    );
    for family in ["deepseek_v3", "qwen2_moe"] {
        check_on(
            fixture(family),
            two_micro_batches(),
            TOLERANCE,
            &[3],
            &[Algo::Quota, Algo::EplbExact],
            &[19, 7, 30, 12, 9, 14],
            8,
        );
    }
}

/// Pipelined experts on the CPU plane (`Schedule::PIPELINED`: main experts computed while the
/// replicas stream; the default, `ULTRAEP`, streams the replicas first as every other test runs)
/// match the dense path for every balancer, with replicas in their slots byte-exact; and give
/// bit-identical logits, loads, slots and replica bytes to the replicas-first order: only the
/// order of the work moves.
#[test]
fn pipelined_experts_match_dense_and_the_replicas_first_order() {
    check_on(
        builtin(),
        EpConfig {
            schedule: Schedule::PIPELINED,
            ..EpConfig::default()
        },
        TOLERANCE,
        &[3, 8],
        &Algo::ALL,
        &[70, 5, 33, 64, 1, 48, 90, 17, 25],
        24,
    );
    let model = builtin();
    let prompts = prompts(model.config().vocab_size, &[40, 25, 31, 18, 22, 35]);
    for balancer in [Algo::Quota, Algo::EplbExact] {
        let run_with = |schedule| {
            let config = EpConfig {
                ep_size: 4,
                balancer,
                schedule,
                ..EpConfig::default()
            };
            fresh_ep_logits(&model, config, &prompts, 32)
        };
        let (first, pipelined) = (run_with(Schedule::ULTRAEP), run_with(Schedule::PIPELINED));
        assert_eq!(max_abs_diff(&first.logits, &pipelined.logits), 0.0);
        assert_eq!(first.layers.len(), pipelined.layers.len());
        for (a, b) in first.layers.iter().zip(&pipelined.layers) {
            assert_eq!((a.layer, &a.load, &a.slots), (b.layer, &b.load, &b.slots));
            assert_eq!(a.replica_bytes, b.replica_bytes, "layer {}", a.layer);
        }
        assert!(
            first.layers.iter().any(|l| l.replica_bytes > 0),
            "{}: some layer streams replicas",
            balancer.name()
        );
    }
}

fn two_micro_batches() -> EpConfig {
    EpConfig {
        schedule: Schedule::TWO_BATCH,
        ..EpConfig::default()
    }
}

/// Per-layer replica slots (resident replicas kept between steps, quota plans moved onto them
/// within 2%), with one and two micro-batches: the dense logits within [`TOLERANCE`] for every
/// balancer, and every layer's slots hold their replicas' exact bytes after every step.
#[test]
fn per_layer_slots_with_reuse_match_dense_for_every_balancer() {
    for schedule in [Schedule::ULTRAEP, Schedule::TWO_BATCH] {
        check_on(
            builtin(),
            EpConfig {
                schedule,
                slot_memory: SlotMemory::PerLayer,
                ..EpConfig::default()
            },
            TOLERANCE,
            &[3, 8],
            &Algo::ALL,
            &[70, 5, 33, 64, 1, 48, 90, 17, 25],
            24,
        );
    }
    check_on(
        fixture("deepseek_v3"),
        EpConfig {
            slot_memory: SlotMemory::PerLayer,
            ..EpConfig::default()
        },
        TOLERANCE,
        &[3],
        &[Algo::Quota],
        &[19, 7, 30, 12],
        8,
    );
}

/// The same prompts twice, each time with fresh caches (so the same routing and the same plans):
/// with per-layer slots the second pass streams no replica byte, with shared slots it streams
/// them all again; the logits are the same either way.
#[test]
fn resident_replicas_are_not_streamed_again() {
    let model = builtin();
    let prompts = prompts(model.config().vocab_size, &[40, 25, 31, 18, 22, 35]);
    let twice = |slot_memory| {
        let config = EpConfig {
            ep_size: 4,
            slot_memory,
            verify_plans: true,
            ..EpConfig::default()
        };
        let mut runtime = EpRuntime::new(Arc::clone(&model), config).unwrap();
        let first = ep_logits(&mut runtime, &model, &prompts, 64);
        let second = ep_logits(&mut runtime, &model, &prompts, 64);
        assert_eq!(max_abs_diff(&first.logits, &second.logits), 0.0);
        let bytes = |run: &EpRun| run.layers.iter().map(|l| l.replica_bytes).sum::<u64>();
        (bytes(&first), bytes(&second), first.replicas)
    };
    let (shared_first, shared_second, replicas) = twice(SlotMemory::Shared);
    assert!(replicas > 0 && shared_first > 0, "quota made replicas");
    assert_eq!(
        shared_second, shared_first,
        "shared slots stream every step"
    );
    let (kept_first, kept_second, _) = twice(SlotMemory::PerLayer);
    assert!(kept_first > 0);
    assert_eq!(kept_second, 0, "every replica is still resident");
}

/// With two micro-batches each MoE layer is reported twice, micro-batch 0 then 1; their loads
/// add up to the step's whole load (what one micro-batch would have planned on), and each plan
/// is solved on its own micro-batch's load.
#[test]
fn two_micro_batches_split_the_load_and_plan_each_half() {
    let model = builtin();
    let prompts = prompts(model.config().vocab_size, &[40, 25, 31, 18, 22, 35]);
    let run_with = |schedule| {
        let config = EpConfig {
            ep_size: 3,
            schedule,
            verify_plans: true,
            ..EpConfig::default()
        };
        fresh_ep_logits(&model, config, &prompts, 64)
    };
    let (one, two) = (run_with(Schedule::ULTRAEP), run_with(Schedule::TWO_BATCH));
    assert_eq!(two.layers.len(), 2 * one.layers.len());
    for (whole, halves) in one.layers.iter().zip(two.layers.chunks(2)) {
        assert_eq!(
            (halves[0].layer, halves[1].layer),
            (whole.layer, whole.layer)
        );
        assert_eq!((halves[0].micro_batch, halves[1].micro_batch), (0, 1));
        let summed = halves[0].load.sum(&halves[1].load).unwrap();
        assert_eq!(summed, whole.load, "layer {}", whole.layer);
        assert!(
            halves.iter().all(|h| h.load.total() > 0),
            "both halves carry tokens"
        );
    }
    assert_eq!(max_abs_diff(&one.logits, &two.logits), 0.0);
}

/// A step of three micro-batches is refused when the runtime is built.
#[test]
fn three_micro_batches_are_refused() {
    let config = EpConfig {
        schedule: Schedule {
            micro_batches: 3,
            pipelined_experts: false,
        },
        ..EpConfig::default()
    };
    let err = EpRuntime::new(builtin(), config)
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("1 or 2 micro-batches, not 3"), "{err}");
}

/// Plans solved on the device need a device, and a quota balancer for its solver.
#[test]
fn plans_on_the_device_need_a_device() {
    let config = EpConfig {
        plan_on_device: true,
        ..EpConfig::default()
    };
    let err = EpRuntime::new(builtin(), config).err().expect("refused");
    assert!(err.to_string().contains("need the model on one"), "{err}");
}

/// One process per group of ranks: EP 4 split over three runtimes holding ranks {0}, {1, 2} and
/// {3}, each on its own thread over one in-process fabric group, exactly as processes of one MPI
/// job would run. Together they compute the dense logits, and every process reports the layers
/// the single-process runtime reports (same loads, plans and simulated makespans).
#[test]
fn ranks_split_over_processes_match_dense() {
    let model = builtin();
    let prompts = prompts(
        model.config().vocab_size,
        &[70, 5, 33, 64, 1, 48, 90, 17, 25],
    );
    let want = dense_logits(&model, &prompts);
    for (balancer, schedule, slot_memory) in [
        (Algo::Quota, Schedule::ULTRAEP, SlotMemory::Shared),
        (Algo::EplbExact, Schedule::ULTRAEP, SlotMemory::Shared),
        (Algo::Quota, Schedule::TWO_BATCH, SlotMemory::Shared),
        (Algo::Quota, Schedule::TWO_BATCH, SlotMemory::PerLayer),
    ] {
        let config = EpConfig {
            ep_size: 4,
            redundant_slots: 2,
            balancer,
            verify_plans: true,
            schedule,
            slot_memory,
            ..EpConfig::default()
        };
        let reference = fresh_ep_logits(&model, config, &prompts, 24);
        let handles = LocalFabric::group(4, &[0..1, 1..3, 3..4]).unwrap();
        let runs: Vec<EpRun> = std::thread::scope(|scope| {
            let spawned: Vec<_> = handles
                .into_iter()
                .map(|fabric| {
                    let (model, prompts) = (&model, &prompts);
                    scope.spawn(move || {
                        let mut runtime =
                            EpRuntime::with_fabric(Arc::clone(model), config, Box::new(fabric))
                                .unwrap();
                        ep_logits(&mut runtime, model, prompts, 24)
                    })
                })
                .collect();
            spawned.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut got: Vec<Vec<Vec<f32>>> = prompts.iter().map(|_| Vec::new()).collect();
        for run in &runs {
            for (i, logits) in run.logits.iter().enumerate() {
                if !logits.is_empty() {
                    assert!(got[i].is_empty(), "prompt {i} computed twice");
                    got[i] = logits.clone();
                }
            }
            assert_eq!(run.layers.len(), reference.layers.len());
            for (mine, all) in run.layers.iter().zip(&reference.layers) {
                assert_eq!(
                    (&mine.load, &mine.metrics, &mine.slots, mine.simulated),
                    (&all.load, &all.metrics, &all.slots, all.simulated)
                );
            }
        }
        if balancer == Algo::Quota {
            assert!(reference.replicas > 0, "quota made no replicas");
        }
        let diff = max_abs_diff(&got, &want);
        assert!(diff <= TOLERANCE, "{balancer} over three processes: {diff}");
    }
}

/// A model of `source` (the built-in model when `None`, else a fixture family) holding only the
/// routed experts the EP ranks `local` home, as a process serving them loads it.
fn sharded(
    source: Option<&str>,
    config: &EpConfig,
    local: std::ops::Range<usize>,
) -> Arc<MoeModel> {
    let selection = |model: &rackfill_models::ModelConfig| {
        EpRuntime::expert_selection(model, config, local.clone()).unwrap()
    };
    Arc::new(match source {
        None => {
            let full = builtin();
            ModelBundle::builtin_with(&selection(full.config()))
                .unwrap()
                .model
        }
        Some(family) => {
            let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../models/tests/fixtures")
                .join(family);
            let model_config = rackfill_models::ModelConfig::load(&dir).unwrap();
            MoeModel::load_with(&dir, &selection(&model_config)).unwrap()
        }
    })
}

/// One process per group of ranks, each loading only its ranks' home experts: EP 4 over
/// handles holding ranks {0}, {1, 2} and {3}, every thread with its own sharded model, matches
/// the dense path of the full model within [`TOLERANCE`], with replicas (quota) and without
/// (none); the built-in model and a fixture with shared experts and dense layers.
#[test]
fn processes_loading_only_their_home_experts_match_dense() {
    for source in [None, Some("deepseek_v3")] {
        let full = match source {
            None => builtin(),
            Some(family) => fixture(family),
        };
        let prompts = prompts(full.config().vocab_size, &[40, 5, 33, 21, 1, 48, 17]);
        let want = dense_logits(&full, &prompts);
        for balancer in [Algo::Quota, Algo::None] {
            let config = EpConfig {
                ep_size: 4,
                redundant_slots: 2,
                balancer,
                verify_plans: true,
                ..EpConfig::default()
            };
            let handles = LocalFabric::group(4, &[0..1, 1..3, 3..4]).unwrap();
            let runs: Vec<EpRun> = std::thread::scope(|scope| {
                let spawned: Vec<_> = handles
                    .into_iter()
                    .map(|fabric| {
                        let (full, prompts) = (&full, &prompts);
                        scope.spawn(move || {
                            let local = rackfill_engine::fabric::Fabric::local_ranks(&fabric);
                            let mine = sharded(source, &config, local.clone());
                            let homed: Vec<u32> = local
                                .clone()
                                .flat_map(|r| {
                                    let experts = full.config().moe.num_experts as u32;
                                    let per = experts / 4;
                                    r as u32 * per..(r as u32 + 1) * per
                                })
                                .collect();
                            assert_eq!(
                                mine.expert_selection(),
                                &rackfill_models::ExpertSelection::Only(homed),
                                "ranks {local:?}"
                            );
                            let mut runtime =
                                EpRuntime::with_fabric(mine, config, Box::new(fabric)).unwrap();
                            // The full model only makes the caches and checks the replica slots.
                            ep_logits(&mut runtime, full, prompts, 16)
                        })
                    })
                    .collect();
                spawned.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let mut got: Vec<Vec<Vec<f32>>> = prompts.iter().map(|_| Vec::new()).collect();
            for run in &runs {
                for (i, logits) in run.logits.iter().enumerate() {
                    if !logits.is_empty() {
                        got[i] = logits.clone();
                    }
                }
            }
            if balancer == Algo::Quota {
                assert!(
                    runs.iter().any(|r| r.replicas > 0),
                    "quota made no replicas"
                );
            }
            let diff = max_abs_diff(&got, &want);
            assert!(
                diff <= TOLERANCE,
                "{source:?} {balancer} over sharded processes: {diff}"
            );
        }
    }
}

/// A runtime whose model lacks an expert homed on one of its ranks is refused when it is built,
/// naming the rank, the expert and what the model holds; every rank of the group loading the
/// whole model is the [`rackfill_models::ExpertSelection::All`] case.
#[test]
fn a_runtime_without_its_home_experts_is_refused_at_construction() {
    let config = EpConfig {
        ep_size: 4,
        ..EpConfig::default()
    };
    let model = builtin();
    let everything = EpRuntime::expert_selection(model.config(), &config, 0..4).unwrap();
    assert_eq!(everything, rackfill_models::ExpertSelection::All);
    let rank0 = sharded(None, &config, 0..1);
    let handles = LocalFabric::group(4, &[0..1, 1..4]).unwrap();
    let err = EpRuntime::with_fabric(rank0, config, Box::new(handles.into_iter().nth(1).unwrap()))
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains("rank 1 homes expert 8 of layer 0") && err.contains("experts 0-7 of 32"),
        "{err}"
    );
    // The same model on all ranks of one process is refused too.
    let err = EpRuntime::new(sharded(None, &config, 0..1), config)
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("rank 1 homes expert 8"), "{err}");
    // Local ranks outside the group have no selection.
    for bad in [0..0, 3..5] {
        let err = EpRuntime::expert_selection(model.config(), &config, bad.clone())
            .expect_err("refused")
            .to_string();
        assert!(err.contains("EP size 4"), "{bad:?}: {err}");
    }
}

/// Processes that solve different plans for a layer (here: launched with different balancers)
/// all fail that step, naming the rank whose plan differs, instead of exchanging tokens by
/// plans that disagree.
#[test]
fn processes_whose_plans_differ_all_fail_the_step() {
    let model = builtin();
    let prompts = prompts(model.config().vocab_size, &[70, 5, 33, 64]);
    let handles = LocalFabric::group(4, &[0..1, 1..4]).unwrap();
    let errors: Vec<String> = std::thread::scope(|scope| {
        let spawned: Vec<_> = handles
            .into_iter()
            .zip([Algo::Quota, Algo::None])
            .map(|(fabric, balancer)| {
                let (model, prompts) = (&model, &prompts);
                scope.spawn(move || {
                    let config = EpConfig {
                        ep_size: 4,
                        redundant_slots: 2,
                        balancer,
                        ..EpConfig::default()
                    };
                    let mut runtime =
                        EpRuntime::with_fabric(Arc::clone(model), config, Box::new(fabric))
                            .unwrap();
                    match try_ep_logits(&mut runtime, model, prompts, 128) {
                        Ok(_) => "the step succeeded".to_string(),
                        Err(err) => err.to_string(),
                    }
                })
            })
            .collect();
        spawned.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for error in errors {
        assert!(
            error.contains("rank 1 solved a different plan than rank 0"),
            "{error}"
        );
    }
}

/// Max abs logit difference between the EP runtime on a device and the device's own dense path
/// (every expert local, `GpuModel::forward`): both compute in bf16 with f32 accumulation in the
/// same combine order, so only a GEMM's summation order for another group size can differ (on
/// the emulator they are equal bit for bit).
#[cfg(feature = "cuda")]
const DEVICE_TOLERANCE: f32 = 2e-3;

/// A model's checkpoint, left for a device to read (the built-in model when `None`, else a
/// fixture family).
#[cfg(feature = "cuda")]
fn checkpoint(source: Option<&str>) -> rackfill_models::CheckpointModel {
    match source {
        None => ModelBundle::open(None).unwrap().model,
        Some(family) => {
            let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../models/tests/fixtures")
                .join(family);
            rackfill_models::CheckpointModel {
                config: rackfill_models::ModelConfig::load(&dir).unwrap(),
                checkpoint: rackfill_models::Checkpoint::open(&dir).unwrap(),
            }
        }
    }
}

/// The device's dense logits of every position of each prompt.
#[cfg(feature = "cuda")]
fn device_dense_logits(
    exec: &Arc<dyn rackfill_kernels::cuda::exec::Executor>,
    model: &rackfill_models::CheckpointModel,
    prompts: &[Vec<u32>],
) -> Vec<Vec<Vec<f32>>> {
    use rackfill_models::gpu::{ExpertPlacement, GpuInput, GpuModel};
    let vocab = model.config.vocab_size;
    let (gpu, _) = GpuModel::load(
        Arc::clone(exec),
        &model.config,
        &model.checkpoint,
        1024,
        ExpertPlacement::Here,
    )
    .unwrap();
    prompts
        .iter()
        .map(|p| {
            let mut sequence = gpu.new_sequence();
            let step = gpu
                .forward(&mut [GpuInput {
                    tokens: p,
                    sequence: &mut sequence,
                    logits: LogitsFor::AllPositions,
                }])
                .unwrap();
            step.logits.chunks(vocab).map(<[f32]>::to_vec).collect()
        })
        .collect()
}

/// The runtime of `config` on `exec`, its ranks split over `views` (handles of one in-process
/// fabric group, each on its own thread as a process of an MPI job would run, each reading only
/// its home experts from the checkpoint), over `prompts` in chunks of `chunk`: every prompt's
/// logits, and the first handle's run (its layer reports). `full`, the host model, checks the
/// replica slots.
#[cfg(feature = "cuda")]
fn device_run(
    exec: &Arc<dyn rackfill_kernels::cuda::exec::Executor>,
    (model, full): (&rackfill_models::CheckpointModel, &Arc<MoeModel>),
    config: EpConfig,
    views: &[std::ops::Range<usize>],
    (prompts, chunk): (&[Vec<u32>], usize),
) -> (Vec<Vec<Vec<f32>>>, EpRun) {
    let handles = LocalFabric::group(config.ep_size, views).unwrap();
    let runs: Vec<EpRun> = std::thread::scope(|scope| {
        let spawned: Vec<_> = handles
            .into_iter()
            .map(|fabric| {
                let exec = Arc::clone(exec);
                scope.spawn(move || {
                    let mut runtime =
                        EpRuntime::on_device(exec, model, config, Box::new(fabric), 512).unwrap();
                    assert_eq!(runtime.slot_layout(), SlotLayout::DeviceBf16);
                    ep_logits(&mut runtime, full, prompts, chunk)
                })
            })
            .collect();
        spawned.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut got: Vec<Vec<Vec<f32>>> = prompts.iter().map(|_| Vec::new()).collect();
    for run in &runs {
        for (i, logits) in run.logits.iter().enumerate() {
            if !logits.is_empty() {
                assert!(got[i].is_empty(), "prompt {i} computed twice");
                got[i] = logits.clone();
            }
        }
    }
    (got, runs.into_iter().next().unwrap())
}

/// The runtime on a device (the host emulator, and GPU 0 on a GPU host) against the device's
/// dense path, within [`DEVICE_TOLERANCE`]: the built-in model at EP 1, 3 and 8 with every
/// balancer (quota plans solved on the device); at EP 3 every schedule (replicas first, pipelined experts with per-slot waits, two
/// micro-batches on two lanes, both) with shared and per-layer slots; fixtures with shared
/// experts and dense layers; and EP 4 split over three "processes" whose rows, outputs and
/// replicas cross through the fabric. Every replica slot holds its expert's bf16 weights, every
/// MoE layer of every step is reported with its exact load, and on the emulator every
/// configuration gives the same logits bit for bit.
#[cfg(feature = "cuda")]
#[test]
fn the_device_runtime_matches_the_device_dense_path_in_every_configuration() {
    let model = builtin();
    let files = checkpoint(None);
    let prompts = prompts(model.config().vocab_size, &[23, 5, 14, 30, 9, 17]);
    let tokens: usize = prompts.iter().map(Vec::len).sum();
    let moe_layers = model.config().sparse_layers.iter().filter(|&&m| m).count();
    let all = std::slice::from_ref;
    for exec in rackfill_kernels::cuda::exec::available() {
        let emulated = exec.describe().starts_with("host emulator");
        let want = device_dense_logits(&exec, &files, &prompts);
        let mut first: Option<Vec<Vec<Vec<f32>>>> = None;
        let mut cases: Vec<(EpConfig, Vec<std::ops::Range<usize>>)> = Vec::new();
        for ep_size in [1, 3, 8] {
            for balancer in Algo::ALL {
                // The quota balancers' plans solved on the device (the other balancers and
                // the cases below plan on the host and upload).
                let config = EpConfig {
                    ep_size,
                    balancer,
                    schedule: Schedule::PIPELINED,
                    plan_on_device: matches!(balancer, Algo::Quota | Algo::QuotaPaper),
                    ..EpConfig::default()
                };
                cases.push((config, std::iter::once(0..ep_size).collect()));
            }
        }
        for schedule in Schedule::ALL {
            for slot_memory in [SlotMemory::Shared, SlotMemory::PerLayer] {
                let config = EpConfig {
                    ep_size: 3,
                    schedule,
                    slot_memory,
                    ..EpConfig::default()
                };
                cases.push((config, std::iter::once(0..3).collect()));
            }
        }
        for (balancer, schedule) in [
            (Algo::Quota, Schedule::PIPELINED),
            (Algo::EplbExact, Schedule::OVERLAPPED),
        ] {
            let config = EpConfig {
                ep_size: 4,
                balancer,
                schedule,
                ..EpConfig::default()
            };
            cases.push((config, vec![0..1, 1..3, 3..4]));
        }
        for (base, views) in cases {
            let config = EpConfig {
                redundant_slots: 2,
                verify_plans: true,
                ..base
            };
            let what = format!(
                "{} EP {} {} {} {} slots over {views:?}",
                exec.describe(),
                config.ep_size,
                config.balancer,
                config.schedule.name(),
                config.slot_memory.name()
            );
            let (got, run) = device_run(&exec, (&files, &model), config, &views, (&prompts, 8));
            let worst = max_abs_diff(&got, &want);
            assert!(
                worst <= DEVICE_TOLERANCE,
                "{what}: off the dense path by {worst}"
            );
            if config.ep_size > 1 && config.balancer == Algo::Quota {
                assert!(run.replicas > 0, "{what}: no replica was made");
            }
            if views.len() == 1 {
                let routed: u64 = run.layers.iter().map(|l| l.load.total()).sum();
                assert_eq!(
                    routed,
                    (tokens * model.config().moe.top_k * moe_layers) as u64,
                    "{what}: reported load"
                );
            }
            match &first {
                None => first = Some(got),
                Some(first) if emulated => assert!(*first == got, "{what}: logits moved"),
                Some(_) => {}
            }
        }
        // Shared experts, a dense first layer and DeepSeek's sigmoid router; Qwen2-MoE's gated
        // shared expert.
        for family in ["deepseek_v3", "qwen2_moe"] {
            let model = fixture(family);
            let files = checkpoint(Some(family));
            let fixture_prompts = self::prompts(model.config().vocab_size, &[19, 7, 12]);
            let want = device_dense_logits(&exec, &files, &fixture_prompts);
            let config = EpConfig {
                ep_size: 3,
                redundant_slots: 2,
                verify_plans: true,
                schedule: Schedule::OVERLAPPED,
                ..EpConfig::default()
            };
            let (got, _) = device_run(
                &exec,
                (&files, &model),
                config,
                all(&(0..3)),
                (&fixture_prompts, 8),
            );
            let worst = max_abs_diff(&got, &want);
            assert!(
                worst <= DEVICE_TOLERANCE,
                "{family}: off the dense path by {worst}"
            );
        }
    }
}
