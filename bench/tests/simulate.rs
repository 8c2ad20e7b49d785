//! `rackfill simulate`'s cost model and simulations on a tiny rack and model, checked against
//! values computed by hand.
//!
//! Tiny rack: 1 MFLOP/s peak (so FLOPs read as microseconds), 1000 B/s links at 50% efficiency
//! (a byte costs 2 ms), 10 us phase latency, attention at 50% of peak. Tiny model: hidden 8,
//! expert width 4 (192 FLOPs per token-expert pair, 192-byte experts, 16-byte tokens), 4 experts,
//! top-2, GQA 2 q / 1 kv heads of 4.

use rackfill_balancer::relay::{plan_transfers, RelayConfig};
use rackfill_balancer::{Algo, Layout, LoadMatrix, Plan, Settings};
use rackfill_bench::serve::dataset::load_trace;
use rackfill_bench::simulate::cost::{Segment, StepCost, Terms};
use rackfill_bench::simulate::queue::{run_requests, RequestRun};
use rackfill_bench::simulate::shape::{Attention, ModelShape};
use rackfill_bench::simulate::trace::{even_load, TraceSource};
use rackfill_bench::simulate::{run_throughput, SimError, SimSpec, StepCoster, ThroughputRun};
use rackfill_bench::synthetic::Sampler;
use rackfill_engine::rack_cost::{token_traffic, ReplicaTraffic};
use rackfill_engine::{Rack, Schedule, SlotMemory};
use std::path::PathBuf;

fn tiny_rack() -> Rack {
    Rack {
        name: "tiny".into(),
        gpus: 8,
        scale_up_gbytes_per_s: 1e-6,
        link_efficiency: 0.5,
        link_latency_us: 10.0,
        bf16_tflops: 1e-6,
        hbm_tbytes_per_s: 1e-6,
        attention_efficiency: 0.5,
        overlap_compute_efficiency: 1.0,
        gemm_efficiency: vec![[1.0, 1.0], [1e9, 1.0]],
    }
}

fn tiny_shape(experts: usize) -> ModelShape {
    ModelShape {
        name: "tiny".into(),
        layers: 2,
        dense_layers: 0,
        experts,
        top_k: 2,
        hidden: 8,
        moe_intermediate: 4,
        shared_intermediate: 0,
        dense_intermediate: 0,
        attention: Attention::Gqa {
            q_heads: 2,
            kv_heads: 1,
            head_dim: 4,
        },
    }
}

fn spec(ranks: usize, experts: usize, algos: Vec<Algo>) -> SimSpec {
    SimSpec {
        rack: tiny_rack(),
        shape: tiny_shape(experts),
        ep: ranks,
        slots: 1,
        algos,
        settings: Settings::default(),
        relay: RelayConfig::default(),
        solve_us: Some(0.0),
        sim_layers: 2,
        chunk_tokens: 4,
        seed: 7,
        // The hand-worked terms below add up phase by phase: UltraEP's serial schedule.
        schedule: Schedule::ULTRAEP,
        slot_memory: SlotMemory::Shared,
        reuse_tolerance: None,
        sampler: Sampler::default(),
        threads: 1,
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1.0)
}

/// rank r routes row r; experts 0..4 live on ranks 0..4 (contiguous layout).
fn skewed_load() -> LoadMatrix {
    LoadMatrix::from_rows(&[
        vec![3, 1, 0, 0],
        vec![2, 0, 2, 0],
        vec![1, 1, 1, 1],
        vec![2, 0, 0, 2],
    ])
    .unwrap()
}

#[test]
fn attention_term_by_hand() {
    let (rack, shape) = (tiny_rack(), tiny_shape(4));
    let cost = StepCost {
        rack: &rack,
        shape: &shape,
    };
    // Projections: q 8 + k 4 + v 4 + o 8 columns of width 8, 2 FLOPs each = 384 per token; the
    // router adds 2 * 8 * 4 = 64 on MoE layers. Core: 4 * 2 heads * 4 dims = 32 FLOPs per pair.
    // 3 new tokens after 2 of context: 3 * 2 + 3 * 4 / 2 = 12 pairs.
    let seg = [Segment {
        tokens: 3,
        context: 2,
    }];
    let projections_ms = (384.0 + 64.0) * 3.0 / 1e6 * 1e3;
    let core_ms = 12.0 * 32.0 / (1e6 * 0.5) * 1e3;
    assert!(close(
        cost.rank_attention_ms(&seg, true),
        projections_ms + core_ms
    ));
    assert!(close(
        cost.rank_attention_ms(&seg, false),
        384.0 * 3.0 / 1e3 + core_ms
    ));
    // A step costs every layer its busiest rank: rank 1 has two segments (2 and 1 tokens, no
    // context: 3 + 1 pairs), rank 0 the segment above.
    let batch = vec![
        seg.to_vec(),
        vec![
            Segment {
                tokens: 2,
                context: 0,
            },
            Segment {
                tokens: 1,
                context: 0,
            },
        ],
    ];
    let terms = cost.step_dense_terms(&batch);
    assert!(close(terms.attention, 2.0 * (projections_ms + core_ms)));
    assert_eq!(terms.dense_ffn, 0.0);
}

#[test]
fn dispatch_and_combine_by_hand() {
    let (rack, shape) = (tiny_rack(), tiny_shape(4));
    let cost = StepCost {
        rack: &rack,
        shape: &shape,
    };
    let load = skewed_load();
    let layout = Layout::contiguous(4, 4, 1).unwrap();
    let plan = Plan::main_only(&layout, &load.expert_totals());
    let (send, recv) = token_traffic(&load, &plan);
    // Pairs leaving each rank (local ones stay), and arriving at each expert's home.
    assert_eq!(send, vec![1, 4, 3, 2]);
    assert_eq!(recv, vec![5, 2, 2, 1]);
    // Busiest: rank 0 receives 5 pairs x 16 bytes = 80 bytes at 500 B/s = 160 ms, + 10 us.
    assert!(close(cost.moe().dispatch_ms(&load, &plan), 160.01));
    assert!(close(rack.comm_ms(0), 0.0));
}

#[test]
fn expert_term_through_the_efficiency_curve() {
    let mut rack = tiny_rack();
    let shape = tiny_shape(4);
    let load = skewed_load();
    let layout = Layout::contiguous(4, 4, 1).unwrap();
    let plan = Plan::main_only(&layout, &load.expert_totals());
    // Flat efficiency 1: the busiest rank holds expert 0 with 8 pairs, 8 * 192 FLOPs = 1.536 ms.
    let flat = StepCost {
        rack: &rack,
        shape: &shape,
    }
    .moe()
    .expert_ms(&plan);
    assert!(close(flat, 1.536));
    // Roofline-like curve: efficiency 0.1 per row up to 4 rows, 0.4 above. Expert 0 (8 rows):
    // 1536 / 0.4 = 3.84 ms. Experts 1-3 (2-3 rows) are memory-bound: 192 / 0.1 = 1.92 ms each.
    rack.gemm_efficiency = vec![[1.0, 0.1], [4.0, 0.4], [1e9, 0.4]];
    let cost = StepCost {
        rack: &rack,
        shape: &shape,
    };
    assert!(close(cost.moe().expert_ms(&plan), 3.84));
    let even = Plan::main_only(&layout, &[2, 2, 3, 3]);
    assert!(close(cost.moe().expert_ms(&even), 1.92));
}

/// 8 ranks, one expert each, expert 0 ten times hotter than the rest: `quota` replicates it to
/// all 7 other ranks.
fn hot_plan() -> (Layout, LoadMatrix, Plan) {
    let layout = Layout::contiguous(8, 8, 1).unwrap();
    let rows: Vec<Vec<u64>> = (0..8)
        .map(|_| {
            let mut row = vec![2u64; 8];
            row[0] = 20;
            row
        })
        .collect();
    let load = LoadMatrix::from_rows(&rows).unwrap();
    let plan = Algo::Quota
        .build(&Settings::default())
        .plan(&layout, &load)
        .unwrap();
    assert_eq!(plan.instances(0).len(), 8, "{:?}", plan.instances(0));
    (layout, load, plan)
}

#[test]
fn replica_streaming_direct_versus_relay() {
    let (rack, shape) = (tiny_rack(), tiny_shape(8));
    let cost = StepCost {
        rack: &rack,
        shape: &shape,
    };
    let (_, _, plan) = hot_plan();
    let b = shape.moe_dims().expert_bytes();
    assert_eq!(b, 192);
    // Direct: rank 0 sends 7 copies (1344 bytes at 500 B/s = 2688 ms), one phase latency.
    let direct = RelayConfig {
        threshold: usize::MAX,
        chunk_bytes: 64,
    };
    let traffic = ReplicaTraffic::streamed(&plan_transfers(&plan, b, &direct));
    assert_eq!(traffic.send[0], 7 * b);
    assert!(!traffic.relayed);
    assert!(close(cost.moe().replicate_ms(&traffic, 64), 2688.01));
    // Relay (fan-out 7 > 4): round(sqrt(7)) = 3 relays seeded by rank 0, which forward the 4
    // other leaves (2 + 1 + 1). Busiest: rank 0 with 3 copies = 1152 ms; plus a second stage
    // latency and one 64-byte chunk (128 ms) to fill the relay pipeline.
    let relay = RelayConfig {
        threshold: 4,
        chunk_bytes: 64,
    };
    let traffic = ReplicaTraffic::streamed(&plan_transfers(&plan, b, &relay));
    assert_eq!(traffic.send[0], 3 * b);
    assert_eq!(*traffic.send.iter().max().unwrap(), 3 * b);
    assert!(traffic.recv.iter().all(|&r| r <= b));
    assert!(traffic.relayed);
    assert!(close(
        cost.moe().replicate_ms(&traffic, 64),
        1152.0 + 0.01 + 128.0 + 0.01
    ));
    // The engine plans whole copies (chunk 0): the same volumes and trees, one transfer per copy.
    let whole = RelayConfig {
        chunk_bytes: 0,
        ..relay
    };
    assert_eq!(
        ReplicaTraffic::streamed(&plan_transfers(&plan, b, &whole)),
        traffic
    );
}

#[test]
fn resident_replicas_are_copied_only_when_they_change() {
    let (layout, _, plan) = hot_plan();
    let first = ReplicaTraffic::new_replicas(&layout, &plan, None, 192);
    assert_eq!(first.send[0], 7 * 192);
    assert_eq!(first.recv[1..], [192; 7]);
    let again = ReplicaTraffic::new_replicas(&layout, &plan, Some(plan.slots()), 192);
    assert!(again.send.iter().chain(&again.recv).all(|&b| b == 0));
}

#[test]
fn solve_override_and_none_charge_what_they_say() {
    let mut s = spec(4, 4, vec![Algo::Quota, Algo::None]);
    s.solve_us = Some(250.0);
    let mut coster = StepCoster::new(&s, &s.algos).unwrap();
    let batch = vec![
        vec![Segment {
            tokens: 4,
            context: 0
        }];
        4
    ];
    let loads = vec![skewed_load(), skewed_load()];
    let steps = coster.step(&batch, &loads).unwrap();
    // Two MoE layers at 250 us each; `none` plans nothing.
    assert!(close(steps[0].schedules[0].terms.solve, 0.5));
    assert_eq!(steps[1].schedules[0].terms.solve, 0.0);
    assert!(close(steps[0].solve_us, 250.0));
}

#[test]
fn none_expert_term_is_the_busiest_main_rank() {
    let s = spec(4, 4, vec![Algo::None]);
    let mut coster = StepCoster::new(&s, &s.algos).unwrap();
    let batch = vec![
        vec![Segment {
            tokens: 4,
            context: 0
        }];
        4
    ];
    let steps = coster
        .step(&batch, &[skewed_load(), skewed_load()])
        .unwrap();
    // max L0 = 8 pairs on rank 0: 8 * 192 FLOPs at 1 MFLOP/s = 1.536 ms per layer, two layers.
    let t = steps[0].schedules[0].terms;
    assert!(close(t.expert, 2.0 * 1.536));
    assert!(close(t.dispatch, 2.0 * 160.01));
    assert_eq!(t.dispatch, t.combine);
    assert_eq!(t.replicate, 0.0);
    assert!(close(steps[0].imbalance_before, 8.0 / 4.0));
    assert_eq!(steps[0].imbalance_before, steps[0].imbalance_after);
}

#[test]
fn ideal_equals_the_balanced_case() {
    // (`eplb-exact` is left out: it fills every slot whatever the load, so it would pay for
    // replicas even here.)
    let s = spec(4, 4, vec![Algo::None, Algo::Quota]);
    let mut coster = StepCoster::new(&s, &s.algos).unwrap();
    let batch = vec![
        vec![Segment {
            tokens: 4,
            context: 1
        }];
        4
    ];
    // 4 tokens x top-2 = 8 pairs per rank, 2 per expert: already perfectly even.
    let even = even_load(&[4; 4], 4, 2);
    assert!(even.as_flat().iter().all(|&c| c == 2));
    let ideal = coster.ideal(&batch);
    for step in coster.step(&batch, &[even.clone(), even]).unwrap() {
        assert_eq!(step.schedules[0], ideal.schedules[0]);
        assert_eq!(step.imbalance_after, 1.0);
        assert_eq!(step.replicas, 0.0);
    }
    let ideal = ideal.schedules[0].terms;
    assert!(ideal.expert > 0.0 && ideal.attention > 0.0);
}

fn tiny_run(seed: u64) -> ThroughputRun {
    let mut s = spec(4, 16, vec![Algo::Quota, Algo::EplbHistory, Algo::None]);
    s.seed = seed;
    s.chunk_tokens = 64;
    s.solve_us = Some(12.5);
    ThroughputRun {
        spec: s,
        trace: TraceSource::SYNTHETIC_MIXED,
        steps: 4,
        context_tokens: 0,
    }
}

#[test]
fn throughput_is_deterministic_and_ranks_balancers() {
    let mut calls = 0;
    let a = run_throughput(&tiny_run(1), |done, total| {
        calls += 1;
        assert_eq!((done, total), (calls, 4));
    })
    .unwrap();
    let b = run_throughput(&tiny_run(1), |_, _| {}).unwrap();
    let c = run_throughput(&tiny_run(2), |_, _| {}).unwrap();
    let json = |r| serde_json::to_string(r).unwrap();
    assert_eq!(json(&a), json(&b));
    assert_ne!(json(&a), json(&c));
    assert_eq!(a.steps, 4);
    let names: Vec<&str> = a.balancers.iter().map(|b| b.balancer.as_str()).collect();
    assert_eq!(names, ["quota", "eplb-history", "none"]);
    for r in &a.balancers {
        assert!(close(r.fraction_of_ideal, a.ideal.step_ms / r.step_ms));
        assert!(close(r.step_ms, r.breakdown_ms.total()));
        assert!(close(
            r.tokens_per_s,
            a.ideal.tokens_per_s * r.fraction_of_ideal
        ));
        assert!(r.fraction_of_ideal <= 1.0 + 1e-9, "{r:?}");
        assert!(r.mean_imbalance.after <= r.mean_imbalance.before + 1e-9);
    }
    let (quota, none) = (&a.balancers[0], &a.balancers[2]);
    assert!(quota.mean_imbalance.after < none.mean_imbalance.after);
    assert!(quota.breakdown_ms.expert < none.breakdown_ms.expert);
    // 64 tokens on each of 4 ranks per step.
    assert!(close(a.ideal.tokens_per_s, 256.0 / (a.ideal.step_ms / 1e3)));
}

/// Two micro-batches overlap one half's solve, replica streaming and token exchange with the
/// other half's compute: under the overlapped schedule the ideal and every balancer take less
/// than under UltraEP's, the step is at least its compute, the balancers keep their order, and
/// the report carries every schedule of the ablation with UltraEP's as the baseline.
#[test]
fn overlapping_micro_batches_hides_balancing_behind_compute() {
    let mut run = tiny_run(3);
    run.spec.schedule = Schedule::OVERLAPPED;
    // Links 100x faster than the tiny rack's, so that compute, not communication, bounds the
    // step (as on NVL72); on the tiny rack a second plan's replicas cost more than overlap hides.
    run.spec.rack.scale_up_gbytes_per_s *= 100.0;
    let r = run_throughput(&run, |_, _| {}).unwrap();
    assert_eq!(r.schedule, "overlapped");
    let names: Vec<&str> = r
        .ideal
        .schedules
        .iter()
        .map(|s| s.schedule.as_str())
        .collect();
    assert_eq!(names, ["ultraep", "pipelined", "two-batch", "overlapped"]);
    let (ultraep, overlapped) = (&r.ideal.schedules[0], &r.ideal.schedules[3]);
    assert!(close(r.ideal.step_ms, overlapped.step_ms));
    assert!(
        overlapped.step_ms < ultraep.step_ms,
        "{overlapped:?} vs {ultraep:?}"
    );
    // Compute (attention, FFN, experts) runs on one resource: no schedule beats its work.
    let compute = |t: &Terms| t.attention + t.dense_ffn + t.expert;
    let compute_ms = compute(&r.ideal.breakdown_ms);
    assert!(
        overlapped.step_ms >= compute_ms * (1.0 - 1e-9),
        "{overlapped:?} vs {compute_ms}"
    );
    for b in &r.balancers {
        let (serial, best) = (&b.schedules[0], &b.schedules[3]);
        assert!(close(b.fraction_of_ideal, best.fraction_of_ideal));
        assert!(close(
            b.speedup_over_ultraep,
            best.tokens_per_s / serial.tokens_per_s
        ));
        assert!(
            best.step_ms < serial.step_ms,
            "{}: {best:?} vs {serial:?}",
            b.balancer
        );
        // Overlap hides work, never removes it: the step is shorter than its phases summed.
        assert!(b.step_ms < b.breakdown_ms.total(), "{b:?}");
    }
    // (The tiny shape's attention outweighs its experts, so what balancing buys is hidden too:
    // the ranking is held on a real shape below.)
    let quota = &r.balancers[0];
    // Each micro-batch has its own plan and replicas: the two together move more than one plan.
    assert!(
        quota.schedules[3].replica_mb_busiest_mean > quota.schedules[0].replica_mb_busiest_mean
    );
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(
        json["balancers"][0]["schedules"].as_array().unwrap().len(),
        4
    );
}

/// Qwen3-235B at EP 64 with 2 slots on synthetic-mixed routing (4 of its layers sampled, 3
/// steps, the solve at UltraEP's 111 us): the overlapped schedule takes quota to at least 0.95 of
/// the ideal under the same schedule, faster than under UltraEP's, and keeps quota >
/// eplb-history > none.
#[test]
fn qwen3_at_ep_64_reaches_the_target_under_the_overlapped_schedule() {
    let run = ThroughputRun {
        spec: SimSpec {
            rack: Rack::nvl72(),
            shape: ModelShape::load("qwen3-235b").unwrap(),
            ep: 64,
            slots: 2,
            algos: vec![Algo::Quota, Algo::EplbHistory, Algo::None],
            settings: Settings::default(),
            relay: RelayConfig::default(),
            solve_us: Some(111.0),
            sim_layers: 4,
            chunk_tokens: 4096,
            seed: 0,
            schedule: Schedule::OVERLAPPED,
            slot_memory: SlotMemory::Shared,
            reuse_tolerance: None,
            sampler: Sampler::default(),
            threads: 1,
        },
        trace: TraceSource::SYNTHETIC_MIXED,
        steps: 3,
        context_tokens: 0,
    };
    let r = run_throughput(&run, |_, _| {}).unwrap();
    let f: Vec<f64> = r.balancers.iter().map(|b| b.fraction_of_ideal).collect();
    assert!(f[0] >= 0.95, "quota at {} of the ideal", f[0]);
    assert!(f[0] > f[1] && f[1] > f[2], "{f:?}");
    let quota = &r.balancers[0];
    assert!(quota.speedup_over_ultraep > 1.2, "{quota:?}");
    // Under UltraEP's own schedule quota stays below 0.9 (solve and replicas exposed).
    assert!(
        quota.schedules[0].fraction_of_ideal < 0.9,
        "{:?}",
        quota.schedules[0]
    );
}

/// With per-layer slots a replica still resident from the layer's last plan is not streamed
/// again: the same routing twice streams nothing the second time (shared slots stream it every
/// step), the solve is still charged, and the report gives the memory it costs.
#[test]
fn per_layer_slots_stream_only_new_replicas() {
    let batch = vec![
        vec![Segment {
            tokens: 4,
            context: 0
        }];
        4
    ];
    let loads = vec![skewed_load(), skewed_load()];
    let replicate = |memory: SlotMemory| {
        let mut s = spec(4, 4, vec![Algo::Quota]);
        s.solve_us = Some(5.0);
        s.slot_memory = memory;
        let mut coster = StepCoster::new(&s, &s.algos).unwrap();
        let first = coster.step(&batch, &loads).unwrap()[0].schedules[0];
        let second = coster.step(&batch, &loads).unwrap()[0].schedules[0];
        (first, second)
    };
    let (shared_1, shared_2) = replicate(SlotMemory::Shared);
    let (layer_1, layer_2) = replicate(SlotMemory::PerLayer);
    assert!(
        shared_1.terms.replicate > 0.0,
        "the skewed load is replicated"
    );
    assert_eq!(shared_2.terms.replicate, shared_1.terms.replicate);
    assert!(layer_1.terms.replicate > 0.0);
    assert_eq!(
        layer_2.terms.replicate, 0.0,
        "every replica is still resident"
    );
    assert_eq!(layer_2.replica_mb, 0.0);
    assert!(close(layer_2.terms.solve, shared_2.terms.solve));

    let mut s = spec(4, 4, vec![Algo::Quota]);
    s.slot_memory = SlotMemory::PerLayer;
    // 1 slot x 1 micro-batch x 2 MoE layers x 3 x 8 x 4 x 2 bytes.
    assert!(close(s.slot_gb_per_gpu(), 2.0 * 192.0 / 1e9));
}

fn temp_file(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rackfill-simulate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn bad_rack_and_shape_files_are_one_line_errors() {
    let cases = [
        (
            r#"{"name": "r", "gpus": 4, "scale_up_gbytes_per_s": 0, "bf16_tflops": 1, "hbm_tbytes_per_s": 1}"#,
            "scale_up_gbytes_per_s must be a positive number",
        ),
        (
            r#"{"name": "r", "gpus": 4, "scale_up_gbytes_per_s": 1, "bf16_tflops": 1, "hbm_tbytes_per_s": 1, "attention_efficiency": 0}"#,
            "attention_efficiency must be in (0, 1]",
        ),
        ("not json", "rack file"),
    ];
    for (text, want) in cases {
        let path = temp_file("rack.json", text);
        let err = Rack::load(path.to_str().unwrap()).unwrap_err().to_string();
        assert!(err.contains(want), "{err}");
        assert!(!err.contains('\n'));
    }
    let err = Rack::load("/nonexistent/rack.json")
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("cannot read rack file /nonexistent/rack.json"),
        "{err}"
    );

    let shapes = [
        (
            r#"{"name": "s", "layers": 2, "experts": 4, "top_k": 8, "hidden": 8, "moe_intermediate": 4, "attention": {"kind": "gqa", "q_heads": 2, "kv_heads": 1, "head_dim": 4}}"#,
            "top_k 8 exceeds the 4 experts",
        ),
        (
            r#"{"name": "s", "layers": 2, "experts": 4, "top_k": 2, "hidden": 8, "moe_intermediate": 4, "attention": {"kind": "gqa", "q_heads": 3, "kv_heads": 2, "head_dim": 4}}"#,
            "kv_heads dividing q_heads",
        ),
        (
            r#"{"name": "s", "layers": 2, "dense_layers": 2, "experts": 4, "top_k": 2, "hidden": 8, "moe_intermediate": 4, "dense_intermediate": 8, "attention": {"kind": "gqa", "q_heads": 2, "kv_heads": 1, "head_dim": 4}}"#,
            "leaves no MoE layer",
        ),
        (r#"{"name": "s", "layers": 2}"#, "missing field"),
        (
            r#"{"num_hidden_layers": 2, "model_type": "glm4_moe", "hidden_size": 8}"#,
            "missing field num_attention_heads",
        ),
        ("[1, 2]", "expected a JSON object"),
        // Bounded: 2^62 wrapped an expert's bytes to 0 (free replicas), 2^40 planned 1.2 TB of
        // replica transfers.
        (
            r#"{"name": "s", "layers": 2, "experts": 4, "top_k": 2, "hidden": 4611686018427387904, "moe_intermediate": 4, "attention": {"kind": "gqa", "q_heads": 2, "kv_heads": 1, "head_dim": 4}}"#,
            "hidden must be in 1..=262144, got 4611686018427387904",
        ),
        (
            r#"{"name": "s", "layers": 2, "experts": 4, "top_k": 2, "hidden": 1099511627776, "moe_intermediate": 4, "attention": {"kind": "gqa", "q_heads": 2, "kv_heads": 1, "head_dim": 4}}"#,
            "hidden must be in 1..=262144",
        ),
        (
            r#"{"name": "s", "layers": 2, "experts": 100000, "top_k": 2, "hidden": 8, "moe_intermediate": 4, "attention": {"kind": "gqa", "q_heads": 2, "kv_heads": 1, "head_dim": 4}}"#,
            "experts must be in 1..=4096",
        ),
        (
            r#"{"name": "s", "layers": 2, "experts": 4, "top_k": 2, "hidden": 8, "moe_intermediate": 4, "attention": {"kind": "gqa", "q_heads": 2, "kv_heads": 1, "head_dim": 4294967296}}"#,
            "head_dim must be at most 262144",
        ),
        (
            r#"{"name": "s", "layers": 2, "experts": 4, "top_k": 2, "hidden": 8, "moe_intermediate": 4, "attention": {"kind": "mla", "q_heads": 2, "q_lora_rank": null, "kv_lora_rank": 4, "qk_nope_head_dim": 4, "qk_rope_head_dim": 1099511627776, "v_head_dim": 4}}"#,
            "MLA heads, ranks and head dims must be at most 262144",
        ),
        (
            r#"{"num_hidden_layers": 1000000, "model_type": "glm4_moe", "hidden_size": 8, "num_attention_heads": 2, "moe_intermediate_size": 4, "n_routed_experts": 4, "num_experts_per_tok": 2}"#,
            "layers must be in 1..=4096",
        ),
    ];
    for (text, want) in shapes {
        let path = temp_file("shape.json", text);
        let err = ModelShape::load(path.to_str().unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains(want), "{err} lacks {want}");
        assert!(err.contains("shape.json"), "{err}");
        assert!(!err.contains('\n'));
    }
    let err = ModelShape::load("qwen9").unwrap_err().to_string();
    assert!(err.starts_with("unknown model shape 'qwen9'"), "{err}");
    // A shape or rack built in code is checked by the spec before it runs.
    let mut s = spec(4, 4, vec![Algo::Quota]);
    s.shape.hidden = 1 << 62;
    let err = s.validate().unwrap_err().to_string();
    assert_eq!(
        err,
        "model shape tiny: hidden must be in 1..=262144, got 4611686018427387904"
    );
    let mut s = spec(4, 4, vec![Algo::Quota]);
    s.rack.gemm_efficiency.clear();
    let err = s.validate().unwrap_err().to_string();
    assert!(
        err.starts_with("rack tiny: gemm_efficiency needs at least one"),
        "{err}"
    );
}

#[test]
fn hf_configs_become_shapes() {
    // GLM-4.5/4.7 (glm4_moe, not an architecture rackfill_models runs): the generic reader.
    let glm = r#"{"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
        "hidden_size": 5120, "num_hidden_layers": 92, "first_k_dense_replace": 3,
        "n_routed_experts": 160, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "moe_intermediate_size": 1536, "intermediate_size": 12288, "num_attention_heads": 96,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151552}"#;
    let shape = ModelShape::load(temp_file("glm.json", glm).to_str().unwrap()).unwrap();
    let mut want = ModelShape::glm_4_7();
    want.name = "glm4_moe".into();
    assert_eq!(shape, want);
    // Qwen3-MoE goes through rackfill_models' normalisation.
    let qwen = r#"{"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 4096, "num_hidden_layers": 94, "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 1536, "intermediate_size": 12288, "num_attention_heads": 64,
        "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "mlp_only_layers": [],
        "decoder_sparse_step": 1, "_name_or_path": "qwen3-235b"}"#;
    let shape = ModelShape::load(temp_file("qwen.json", qwen).to_str().unwrap()).unwrap();
    assert_eq!(shape, ModelShape::qwen3_235b());
}

#[test]
fn run_arguments_are_checked() {
    let mut s = spec(4, 4, vec![Algo::Quota]);
    s.ep = 9;
    let err = StepCoster::new(&s, &s.algos).err().unwrap();
    assert_eq!(
        err,
        SimError::Input("--ep-size 9 exceeds the 8 GPUs of rack 'tiny'".into())
    );
    let mut s = spec(4, 4, vec![Algo::Quota]);
    s.sim_layers = 3;
    assert!(s
        .validate()
        .unwrap_err()
        .to_string()
        .contains("--sample-layers must be in 1..=2"));
    // Sizes are bounded before anything runs (--chunk-tokens 2^64-1 or 10^8 never finished a
    // step).
    for chunk in [0, 65537, u64::MAX] {
        let mut s = spec(4, 4, vec![Algo::Quota]);
        s.chunk_tokens = chunk;
        let err = s.validate().unwrap_err().to_string();
        assert_eq!(
            err,
            format!("--chunk-tokens must be in 1..=65536, got {chunk}")
        );
    }
    for steps in [0, 1_000_001] {
        let mut run = tiny_run(0);
        run.steps = steps;
        let err = run_throughput(&run, |_, _| {}).unwrap_err().to_string();
        assert_eq!(err, format!("--steps must be in 1..=1000000, got {steps}"));
    }
    let mut s = spec(8, 4096, vec![Algo::Quota]);
    s.shape.layers = 3000;
    s.sim_layers = 3000;
    let err = StepCoster::new(&s, &s.algos).err().unwrap().to_string();
    assert!(
        err.starts_with("3000 simulated layers x 8 ranks x 4096 experts is 98304000 load counts"),
        "{err}"
    );
    let mut run = tiny_run(0);
    run.trace = TraceSource::File(temp_file(
        "routing.jsonl",
        r#"{"step": 0, "layer": 0, "ranks": 2, "experts": 8, "load": [[1,1,1,1,1,1,1,1],[1,1,1,1,1,1,1,1]]}"#,
    ));
    let err = run_throughput(&run, |_, _| {}).unwrap_err().to_string();
    assert!(
        err.contains("has 8 experts, the model shape has 16"),
        "{err}"
    );
}

#[test]
fn recorded_traces_are_replayed_and_resplit_onto_the_ep_ranks() {
    // Two steps of one layer on 2 ranks; the simulation runs on 4.
    let line = |step: u64| {
        format!(
            r#"{{"step": {step}, "layer": 0, "ranks": 2, "experts": 16, "load": [[8,8,8,8,8,8,8,8,0,0,0,0,0,0,0,0],[8,8,8,8,8,8,8,8,0,0,0,0,0,0,0,0]]}}"#
        )
    };
    let path = temp_file("trace.jsonl", &format!("{}\n{}\n", line(0), line(1)));
    let mut run = tiny_run(0);
    run.trace = TraceSource::File(path);
    run.steps = 10;
    let report = run_throughput(&run, |_, _| {}).unwrap();
    assert_eq!(report.steps, 2);
    // 128 pairs re-split over 4 ranks at top-2: 16 tokens per rank, 64 per step.
    assert!(close(
        report.ideal.tokens_per_s,
        64.0 / (report.ideal.step_ms / 1e3)
    ));
    // What ran: the trace's one layer (standing for both MoE layers) and its tokens, not the
    // spec's 2 sampled layers of 64-token chunks.
    assert_eq!(report.simulated_layers, 1);
    assert_eq!(report.chunk_tokens, None);
    assert!(close(report.tokens_per_rank_mean, 16.0));
    let header = rackfill_bench::simulate::report::throughput_table(&report);
    assert!(
        header.contains("(1 simulated), tokens/rank/step from the trace (mean 16.0)"),
        "{header}"
    );
    // Experts 0-7 hold everything: ranks 0-1 (4 experts each of 16) carry it all without balancing.
    let none = &report.balancers[2];
    assert!(close(none.mean_imbalance.before, 2.0));
}

#[test]
fn a_lone_request_waits_for_exactly_its_steps() {
    // One request of 6 tokens on an idle rack with 4-token chunks: two steps on one rank, the
    // second attending to the first 4 tokens.
    let path = temp_file(
        "requests.jsonl",
        "{\"timestamp\": 0, \"input_length\": 6, \"output_length\": 1}\n",
    );
    let mut s = spec(4, 4, vec![Algo::Quota]);
    s.solve_us = Some(0.0);
    let run = RequestRun {
        requests: load_trace(&path, 1, None).unwrap(),
        rates: vec![],
        spec: s.clone(),
    };
    let results = run_requests(&run, |_| {}).unwrap();
    assert_eq!(results.len(), 2);
    assert_eq!(results[0].balancer, "ideal");
    let coster = StepCoster::new(&s, &[]).unwrap();
    let idle = Vec::new;
    let first = vec![
        vec![Segment {
            tokens: 4,
            context: 0,
        }],
        idle(),
        idle(),
        idle(),
    ];
    let second = vec![
        vec![Segment {
            tokens: 2,
            context: 4,
        }],
        idle(),
        idle(),
        idle(),
    ];
    let want: Terms =
        coster.ideal(&first).schedules[0].terms + coster.ideal(&second).schedules[0].terms;
    assert!(
        close(results[0].mean_ttft_ms, want.total()),
        "{:?} vs {want:?}",
        results[0]
    );
    assert_eq!(results[0].steps, 2);
    assert_eq!(results[1].balancer, "quota");
    assert_eq!(results[1].completed, 1);
    assert!(results[1].mean_ttft_ms >= results[0].mean_ttft_ms * (1.0 - 1e-9));
}

/// A trace line of `step`/`layer` on 2 ranks x 16 experts, every row 64 pairs (32 tokens at top-2):
/// spread evenly, or all on experts 0-7 (which ranks 0-1 home at EP 4).
fn trace_line(step: u64, layer: usize, skewed: bool) -> String {
    let row: Vec<u64> = (0..16)
        .map(|e| match (skewed, e < 8) {
            (false, _) => 4,
            (true, true) => 8,
            (true, false) => 0,
        })
        .collect();
    format!(
        "{{\"step\": {step}, \"layer\": {layer}, \"ranks\": 2, \"experts\": 16, \"load\": {}}}\n",
        serde_json::to_string(&[&row, &row]).unwrap()
    )
}

#[test]
fn a_trace_with_more_layers_than_the_model_uses_every_layer_once() {
    // 4 trace layers for a 2-MoE-layer model (sim_layers 2 in the spec): skew in the first two
    // layers or in the last two must cost the same, each layer standing for half a model layer.
    // (The first 2 were used and the rest silently dropped.)
    let trace = |skewed_head: bool| {
        let mut text = String::new();
        for step in 0..2 {
            for layer in 0..4 {
                text += &trace_line(step, layer, (layer < 2) == skewed_head);
            }
        }
        text
    };
    let run_on = |name: &str, text: &str| {
        let mut run = tiny_run(0);
        run.trace = TraceSource::File(temp_file(name, text));
        run_throughput(&run, |_, _| {}).unwrap()
    };
    let head = run_on("skew-head.jsonl", &trace(true));
    let tail = run_on("skew-tail.jsonl", &trace(false));
    assert_eq!(head.simulated_layers, 4);
    assert!(close(head.ideal.step_ms, tail.ideal.step_ms));
    for (h, t) in head.balancers.iter().zip(&tail.balancers) {
        // Equal up to the order the layers' terms were summed in.
        for (a, b) in h.breakdown_ms.values().iter().zip(t.breakdown_ms.values()) {
            assert!(close(*a, b), "{h:?} vs {t:?}");
        }
        assert_eq!(h.mean_imbalance, t.mean_imbalance);
    }
    // Half the layers skewed onto 2 of 4 ranks: `none` sees imbalance 2 there and 1 elsewhere.
    let none = &head.balancers[2];
    assert!(close(none.mean_imbalance.before, 1.5), "{none:?}");
    // Scaled by moe_layers / trace layers = 1/2: a uniform-only trace of 4 layers costs what 2
    // uniform layers cost.
    let uniform4: String = (0..2)
        .flat_map(|s| (0..4).map(move |l| trace_line(s, l, false)))
        .collect();
    let uniform2: String = (0..2)
        .flat_map(|s| (0..2).map(move |l| trace_line(s, l, false)))
        .collect();
    let four = run_on("uniform4.jsonl", &uniform4);
    let two = run_on("uniform2.jsonl", &uniform2);
    for (a, b) in four.balancers.iter().zip(&two.balancers) {
        assert!(close(a.step_ms, b.step_ms), "{a:?} vs {b:?}");
    }
}

#[test]
fn an_error_anywhere_in_a_trace_names_the_file() {
    let text = trace_line(0, 0, false) + &trace_line(1, 0, false) + "[1, 2]\n";
    let path = temp_file("broken.jsonl", &text);
    let mut run = tiny_run(0);
    run.trace = TraceSource::File(path.clone());
    let err = run_throughput(&run, |_, _| {}).unwrap_err().to_string();
    assert_eq!(
        err,
        format!(
            "routing trace {}: line 3: not a routing-trace line: expected a JSON object \
             {{\"step\", \"layer\", \"ranks\", \"experts\", \"load\"}}",
            path.display()
        )
    );
}

#[test]
fn request_traces_that_could_not_finish_are_refused() {
    let run_on = |text: &str, rates: Vec<f64>| {
        let path = temp_file("requests-bad.jsonl", text);
        let run = RequestRun {
            requests: load_trace(&path, 1, None).unwrap(),
            rates,
            spec: spec(4, 4, vec![Algo::Quota]),
        };
        run_requests(&run, |_| {}).unwrap_err().to_string()
    };
    let ok = "{\"timestamp\": 0, \"input_length\": 6, \"output_length\": 1}\n\
              {\"timestamp\": 10, \"input_length\": 6, \"output_length\": 1}\n";
    // 1e-18 req/s panicked converting the arrival times; a rate whose arrivals fit a Duration but
    // not the simulated clock's precision is refused too.
    for rate in [1e-18, 1e-30] {
        let err = run_on(ok, vec![rate]);
        assert!(
            err.starts_with(&format!("--rates {rate:?}: request 1 ")),
            "{err}"
        );
        assert!(!err.contains('\n'), "{err}");
    }
    // An input length of 2^64-1 stepped for ever.
    let huge = "{\"timestamp\": 0, \"input_length\": 18446744073709551615, \"output_length\": 1}\n";
    assert_eq!(
        run_on(huge, vec![]),
        "request 0 has 18446744073709551615 prompt tokens, more than 16777216 (longer than any \
         model's context)"
    );
    // A prompt that fits a context but not a simulation's steps at 4-token chunks.
    let long = "{\"timestamp\": 0, \"input_length\": 16000000, \"output_length\": 1}\n";
    assert_eq!(
        run_on(long, vec![]),
        "request 0 has 16000000 prompt tokens: at least 4000000 steps of --chunk-tokens 4, more \
         than the 1000000 a simulation runs"
    );
    // Many requests that each fit but together need more steps than a simulation runs.
    let line = "{\"timestamp\": 0, \"input_length\": 3000000, \"output_length\": 1}\n";
    let err = run_on(&line.repeat(8), vec![]);
    assert!(
        err.starts_with("the request trace holds 24000000 prompt tokens: at least 1500000 steps"),
        "{err}"
    );
}

#[test]
fn measured_solve_times_are_reported_in_whole_nanoseconds() {
    let mut run = tiny_run(0);
    run.spec.solve_us = None;
    let report = run_throughput(&run, |_, _| {}).unwrap();
    for b in &report.balancers {
        let text = serde_json::to_string(&b.solve_us_mean).unwrap();
        let decimals = text.split('.').nth(1).map_or(0, str::len);
        assert!(decimals <= 3, "{}: {text}", b.balancer);
    }
}

/// The engine's per-layer simulated makespan and `rackfill simulate` are one cost model: the
/// routing the EP runtime records, simulated on the same rack with the same balancer, gives the
/// same MoE terms per layer (`replicate + dispatch + expert + combine` of `layer_ms`) as the
/// engine's `LayerReport::simulated` (with the plan for `quota`, without balancing for `none`).
#[test]
fn recorded_engine_routing_costs_what_the_engine_reported() {
    use rackfill_engine::{EpConfig, EpRuntime};
    use rackfill_models::{LogitsFor, ModelBundle, SequenceInput};
    let model = std::sync::Arc::new(ModelBundle::builtin().unwrap().model);
    let config = EpConfig {
        ep_size: 4,
        ..EpConfig::default()
    };
    let mut runtime = EpRuntime::new(std::sync::Arc::clone(&model), config).unwrap();
    let vocab = model.config().vocab_size as u32;
    let prompts: Vec<Vec<u32>> = (0..8u32)
        .map(|i| {
            (0..40 + 9 * i)
                .map(|j| (i * 131 + j * j * 17) % vocab)
                .collect()
        })
        .collect();
    let mut caches: Vec<_> = prompts.iter().map(|_| model.new_cache()).collect();
    let mut batches: Vec<Vec<SequenceInput<'_>>> = (0..4).map(|_| Vec::new()).collect();
    for (i, (tokens, cache)) in prompts.iter().zip(caches.iter_mut()).enumerate() {
        batches[i % 4].push(SequenceInput { tokens, cache });
    }
    let which: Vec<Vec<LogitsFor>> = batches
        .iter()
        .map(|b| vec![LogitsFor::LastPosition; b.len()])
        .collect();
    let layers = runtime.forward(&mut batches, &which).unwrap().layers;
    assert_eq!(layers.len(), 4);
    assert!(
        layers.iter().any(|l| l.metrics.replicas > 0),
        "quota made no replicas"
    );

    // The recorded routing (`--record-routing`'s format) and the model's own config.json.
    let lines: String = layers
        .iter()
        .map(|l| {
            let load: Vec<&[u64]> = (0..4).map(|r| l.load.row(r)).collect();
            let line = serde_json::json!({"step": 0, "layer": l.layer, "ranks": 4,
                "experts": l.load.experts(), "load": load});
            format!("{line}\n")
        })
        .collect();
    let trace = temp_file("engine-routing.jsonl", &lines);
    let config = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/builtin/config.json");
    let shape = ModelShape::load(config.to_str().unwrap()).unwrap();
    let run = ThroughputRun {
        spec: SimSpec {
            rack: runtime.rack().clone(),
            shape,
            ep: 4,
            slots: runtime.config().redundant_slots,
            algos: vec![Algo::Quota, Algo::None],
            settings: runtime.config().settings,
            relay: runtime.config().relay,
            solve_us: Some(0.0),
            sim_layers: 4,
            chunk_tokens: 4096,
            seed: 0,
            schedule: Schedule::ULTRAEP,
            slot_memory: SlotMemory::Shared,
            reuse_tolerance: None,
            sampler: Sampler::default(),
            threads: 1,
        },
        trace: TraceSource::File(trace),
        steps: 1,
        context_tokens: 0,
    };
    let report = run_throughput(&run, |_, _| {}).unwrap();
    let moe_ms = |t: &Terms| t.replicate + t.dispatch + t.expert + t.combine;
    let mean_us = |f: fn(&rackfill_engine::LayerReport) -> f64| {
        layers.iter().map(f).sum::<f64>() / layers.len() as f64
    };
    let (quota, none) = (&report.balancers[0], &report.balancers[1]);
    let engine_balanced = mean_us(|l| l.simulated.balanced_us);
    let engine_unbalanced = mean_us(|l| l.simulated.unbalanced_us);
    // (On NVL72 this tiny model's layer is latency-bound: streaming replicas costs more than the
    // imbalance it removes, which the figures show as they are.)
    assert!(engine_balanced > 0.0 && engine_unbalanced > 0.0);
    assert!(close(moe_ms(&quota.layer_ms) * 1e3, engine_balanced));
    assert!(close(moe_ms(&none.layer_ms) * 1e3, engine_unbalanced));
}

/// On a routing trace recorded from the built-in model serving 120 requests at EP 8
/// (`bench/data/builtin-ep8-routing.jsonl`, `rackfill serve --record-routing`), under UltraEP's
/// schedule: per-layer slots stream fewer replica bytes than shared ones, preferring resident
/// replicas within 2% of the peak streams fewer still, and the imbalance after balancing rises by
/// at most those 2%.
#[test]
fn preferring_resident_replicas_streams_less_on_a_recorded_trace() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let shape =
        ModelShape::load(root.join("../models/builtin/config.json").to_str().unwrap()).unwrap();
    let run_with = |slot_memory: SlotMemory, reuse_tolerance: Option<f64>| {
        let run = ThroughputRun {
            spec: SimSpec {
                rack: Rack::nvl72(),
                sim_layers: shape.moe_layers(),
                shape: shape.clone(),
                ep: 8,
                slots: 2,
                algos: vec![Algo::Quota],
                settings: Settings::default(),
                relay: RelayConfig::default(),
                solve_us: Some(111.0),
                chunk_tokens: 4096,
                seed: 0,
                schedule: Schedule::ULTRAEP,
                slot_memory,
                reuse_tolerance,
                sampler: Sampler::default(),
                threads: 1,
            },
            trace: TraceSource::File(root.join("data/builtin-ep8-routing.jsonl")),
            steps: 100,
            context_tokens: 0,
        };
        let report = run_throughput(&run, |_, _| {}).unwrap();
        let quota = &report.balancers[0];
        (quota.replica_mb_busiest_mean, quota.mean_imbalance.after)
    };
    let (shared_mb, shared_imbalance) = run_with(SlotMemory::Shared, None);
    let (kept_mb, kept_imbalance) = run_with(SlotMemory::PerLayer, None);
    let (preferred_mb, preferred_imbalance) = run_with(SlotMemory::PerLayer, Some(0.02));
    assert!(
        preferred_mb < kept_mb && kept_mb < shared_mb,
        "{preferred_mb} < {kept_mb} < {shared_mb}"
    );
    assert_eq!(
        kept_imbalance, shared_imbalance,
        "reuse alone keeps the plans"
    );
    assert!(preferred_imbalance <= kept_imbalance * 1.02 + 1e-9);
    assert!(preferred_imbalance > 1.0);
}

/// A coster of the chosen schedule only (request mode) plans only that schedule's micro-batch
/// count, and costs it exactly as the full ablation does; the other count stays zero.
#[test]
fn costing_the_chosen_schedule_only_gives_the_same_step() {
    let batch = vec![
        vec![Segment {
            tokens: 4,
            context: 0
        }];
        4
    ];
    let loads = vec![skewed_load(), skewed_load()];
    for schedule in [Schedule::ULTRAEP, Schedule::OVERLAPPED] {
        let mut s = spec(4, 4, vec![Algo::Quota, Algo::EplbHistory]);
        s.schedule = schedule;
        let mut full = StepCoster::new(&s, &s.algos).unwrap();
        let mut chosen = StepCoster::chosen_schedule_only(&s, &s.algos).unwrap();
        for _ in 0..3 {
            let (all, only) = (
                full.step(&batch, &loads).unwrap(),
                chosen.step(&batch, &loads).unwrap(),
            );
            for (a, o) in all.iter().zip(&only) {
                for (i, sched) in Schedule::ALL.iter().enumerate() {
                    if sched.micro_batches == schedule.micro_batches {
                        assert_eq!(a.schedules[i], o.schedules[i], "{}", sched.name());
                    } else {
                        assert_eq!(o.schedules[i].step_ms, 0.0, "{} not planned", sched.name());
                    }
                }
                assert_eq!(a.imbalance_after, o.imbalance_after);
            }
        }
    }
}
