//! Routing-trace replay end to end: a trace recorded by the engine on the built-in model replayed
//! through every balancer, synthetic multi-layer traces through the writer and reader,
//! `eplb-history`'s rebalance interval and history window, and malformed traces.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use rackfill_balancer::{main_rank_loads, metrics, Algo, Layout, LoadMatrix, Settings};
use rackfill_bench::replay::{replay, ReplayConfig, ReplayEvent, ReplayReport};
use rackfill_bench::synthetic::multilayer::{TraceGenerator, TracePattern, TraceSpec};
use rackfill_engine::routing_trace::{RoutingTrace, RoutingTraceConfig, TraceReader, TraceWriter};
use rackfill_engine::{
    EngineConfig, EngineHandle, EpConfig, Event, GenerateRequest, SamplingParams, SchedulerConfig,
};
use rackfill_models::ModelBundle;

/// Runs the built-in model at EP 4 with routing recorded to `path` on a few batched requests.
fn record_trace(path: &Path) {
    let bundle = ModelBundle::builtin().unwrap();
    let prompts: Vec<Vec<u32>> = [
        "The quick brown fox jumps over the lazy dog because it wants to see what is there.",
        "Once upon a time the rack balanced every layer on its exact load.",
        "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
        "Hello",
    ]
    .iter()
    .map(|p| bundle.tokenizer.encode(p, false).unwrap())
    .collect();
    let config = EngineConfig {
        ep: EpConfig {
            ep_size: 4,
            ..EpConfig::default()
        },
        scheduler: SchedulerConfig {
            chunk_tokens: 16,
            kv_tokens_per_rank: 4096,
            ..SchedulerConfig::default()
        },
        max_waiting: 64,
        record_routing: Some(RoutingTraceConfig::new(path)),
        ..EngineConfig::default()
    };
    let engine = EngineHandle::spawn(
        Arc::new(bundle.model),
        Arc::new(bundle.tokenizer),
        bundle.stop_token_ids,
        config,
    )
    .unwrap();
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: 3,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let streams: Vec<_> = prompts
        .into_iter()
        .map(|prompt| {
            engine
                .submit(GenerateRequest {
                    prompt,
                    params: params.clone(),
                })
                .unwrap()
        })
        .collect();
    for mut stream in streams {
        while let Some(event) = stream.events.blocking_recv() {
            match event {
                Event::Finished(_) => break,
                Event::Error(e) => panic!("request failed: {e}"),
                _ => {}
            }
        }
    }
    engine.shutdown();
}

fn config(layout: Layout, algos: Vec<Algo>, settings: Settings) -> ReplayConfig {
    ReplayConfig {
        layout,
        settings,
        algos,
        expert_bytes: Some(1000),
    }
}

fn replay_trace(trace: &RoutingTrace, config: &ReplayConfig) -> ReplayReport {
    let source = trace
        .steps
        .iter()
        .cloned()
        .map(Ok::<_, std::convert::Infallible>);
    replay(source, "test", &trace.layers, config, |_| {}).unwrap()
}

/// Slot contents of every plan, by (step index, layer index).
fn placements(
    trace: &RoutingTrace,
    config: &ReplayConfig,
) -> HashMap<(usize, usize), Vec<Option<u32>>> {
    let mut slots = HashMap::new();
    let source = trace
        .steps
        .iter()
        .cloned()
        .map(Ok::<_, std::convert::Infallible>);
    let report = replay(source, "test", &trace.layers, config, |event| {
        if let ReplayEvent::Plan {
            step_index,
            layer_index,
            plan,
            ..
        } = event
        {
            slots.insert((step_index, layer_index), plan.slots().to_vec());
        }
    })
    .unwrap();
    assert_eq!(report.validation_failures, 0, "{:?}", report.failures);
    slots
}

fn synthetic(pattern: TracePattern, layers: usize, steps: usize, seed: u64) -> RoutingTrace {
    let spec = TraceSpec::new(pattern, 8, 64, layers, steps, 64);
    RoutingTrace {
        ranks: 8,
        experts: 64,
        layers: spec.layer_ids(),
        steps: TraceGenerator::new(&spec, seed).unwrap().collect(),
    }
}

#[test]
fn recorded_engine_trace_replays_through_every_balancer() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("routing.jsonl");
    record_trace(&path);

    let trace = RoutingTrace::read(&path).unwrap();
    assert_eq!((trace.ranks, trace.experts), (4, 32));
    assert_eq!(trace.layers, vec![0, 1, 2, 3]);
    assert!(trace.steps.len() >= 3, "{} steps", trace.steps.len());
    let lines = std::fs::read_to_string(&path).unwrap().lines().count();
    assert_eq!(lines, trace.steps.len() * trace.layers.len());

    let layout = Layout::contiguous(4, 32, 2).unwrap();
    let cfg = config(layout.clone(), Algo::ALL.to_vec(), Settings::default());
    let mut plan_events = 0;
    let mut step_events = 0;
    let reader = TraceReader::open(&path).unwrap();
    let report = replay(
        reader,
        "recorded",
        &trace.layers,
        &cfg,
        |event| match event {
            ReplayEvent::Plan { .. } => plan_events += 1,
            ReplayEvent::Step { steps_done, .. } => {
                step_events += 1;
                assert_eq!(steps_done, step_events);
            }
        },
    )
    .unwrap();
    let plans = trace.steps.len() * trace.layers.len();
    assert_eq!(report.steps, trace.steps.len());
    assert_eq!(plan_events, plans * Algo::ALL.len());
    assert_eq!(step_events, trace.steps.len());
    assert_eq!(report.validation_failures, 0, "{:?}", report.failures);
    let step_ids: Vec<u64> = trace.steps.iter().map(|s| s.step).collect();
    assert_eq!(report.step_ids, step_ids);
    for stats in &report.stats {
        assert_eq!(stats.plans, plans, "{}", stats.balancer);
        assert_eq!(stats.series.imbalance_mean.len(), trace.steps.len());
        assert_eq!(stats.layer_imbalance_mean.len(), 4);
        assert!(stats.imbalance_p50 <= stats.imbalance_p99);
        assert!(stats.imbalance_p99 <= stats.imbalance_max);
        assert!(stats.gap_mean >= 1.0 - 1e-12);
    }

    // `none` reports exactly the imbalance of the main experts, computed here from the loads.
    let mut direct = Vec::new();
    for step in &trace.steps {
        for load in &step.loads {
            direct.push(metrics::imbalance(&main_rank_loads(
                &layout,
                &load.expert_totals(),
            )));
        }
    }
    let direct_mean = direct.iter().sum::<f64>() / direct.len() as f64;
    let none = report.balancer("none").unwrap();
    let quota = report.balancer("quota").unwrap();
    assert!((none.imbalance_mean - direct_mean).abs() < 1e-12);
    assert!((none.imbalance_before_mean - direct_mean).abs() < 1e-12);
    assert!((quota.imbalance_before_mean - direct_mean).abs() < 1e-12);
    assert_eq!(none.replicas_total, 0);
    assert_eq!(none.replica_bytes_per_step, Some(0.0));
    assert!(quota.imbalance_mean <= none.imbalance_mean);
    assert!(quota.replicas_total > 0, "the built-in model is skewed");
    let streamed = quota.replicas_total as f64 * 1000.0 / trace.steps.len() as f64;
    assert_eq!(quota.replica_bytes_per_step, Some(streamed));

    // Table, JSON and chart carry every balancer.
    let table = report.to_table();
    for algo in Algo::ALL {
        assert!(table.contains(&format!("| {}", algo.name())), "{table}");
    }
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(
        json["stats"][1]["series"]["imbalance_mean"]
            .as_array()
            .unwrap()
            .len(),
        trace.steps.len()
    );
    let chart = report.imbalance_chart();
    assert_eq!(chart.series.len(), Algo::ALL.len());
    assert_eq!(chart.series[0].label, "none");
    assert_eq!(chart.series[0].points.len(), trace.steps.len());
    let svg = dir.path().join("imbalance.svg");
    rackfill_bench::plot::write_chart(&svg, &chart).unwrap();
    assert!(std::fs::read_to_string(&svg).unwrap().contains("quota"));
}

#[test]
fn synthetic_multi_layer_trace_round_trips_exactly() {
    let trace = synthetic(TracePattern::Mixed, 3, 12, 7);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("synthetic.jsonl");
    trace.write(&path).unwrap();
    let back = RoutingTrace::read(&path).unwrap();
    assert_eq!(back, trace);

    // Replaying the file and the generator gives the same report apart from timings.
    let cfg = config(
        Layout::contiguous(8, 64, 2).unwrap(),
        Algo::ALL.to_vec(),
        Settings::default(),
    );
    let strip = |mut r: ReplayReport| {
        r.wall_ms = 0.0;
        r.source.clear();
        for s in &mut r.stats {
            s.solve_us_mean = 0.0;
            s.solve_us_p99 = 0.0;
            s.series.solve_us_mean.clear();
        }
        r
    };
    let from_file = replay(
        TraceReader::open(&path).unwrap(),
        "file",
        &back.layers,
        &cfg,
        |_| {},
    )
    .unwrap();
    assert_eq!(strip(from_file), strip(replay_trace(&trace, &cfg)));
}

#[test]
fn solve_times_are_reported_in_whole_nanoseconds() {
    assert_eq!(rackfill_bench::stats::round_us(0.39499999999999996), 0.395);
    let trace = synthetic(TracePattern::Mixed, 3, 12, 7);
    let cfg = config(
        Layout::contiguous(8, 64, 2).unwrap(),
        Algo::ALL.to_vec(),
        Settings::default(),
    );
    let report = replay_trace(&trace, &cfg);
    // Means of nanosecond samples printed float noise (7.594999999999999) in the JSON report.
    let three_decimals = |v: f64| {
        let text = serde_json::to_string(&v).unwrap();
        text.split('.').nth(1).is_none_or(|frac| frac.len() <= 3)
    };
    for s in &report.stats {
        assert!(three_decimals(s.solve_us_mean), "{}", s.solve_us_mean);
        for &v in &s.series.solve_us_mean {
            assert!(three_decimals(v), "{v}");
        }
    }
}

#[test]
fn eplb_history_changes_placement_only_every_interval() {
    let interval = 4;
    let trace = synthetic(TracePattern::Drifting, 2, 26, 3);
    let settings = Settings {
        history_window: 8,
        rebalance_interval: interval,
        ..Settings::default()
    };
    let cfg = config(
        Layout::contiguous(8, 64, 2).unwrap(),
        vec![Algo::EplbHistory],
        settings,
    );
    let slots = placements(&trace, &cfg);
    let mut changed_at = Vec::new();
    for layer in 0..2 {
        // Step 0 has no history: main experts only.
        assert!(slots[&(0, layer)].iter().all(Option::is_none));
        for s in 1..trace.steps.len() {
            if slots[&(s, layer)] != slots[&(s - 1, layer)] {
                assert!(
                    s == 1 || s % interval == 0,
                    "layer {layer} changed placement at step {s}"
                );
                changed_at.push(s);
            }
        }
    }
    // Drift moves the hot set, so the re-plans do change something.
    assert!(changed_at.contains(&1));
    assert!(
        changed_at.iter().filter(|&&s| s > 1).count() >= 3,
        "{changed_at:?}"
    );

    // Placements never see the step they serve: a wildly different load at a re-plan step leaves
    // every placement up to and including that step unchanged, and shows up at the next re-plan.
    let at = 2 * interval;
    let mut spiked = trace.clone();
    let mut rows = vec![vec![0u64; 64]; 8];
    for row in &mut rows {
        row[63] = 1_000_000;
    }
    spiked.steps[at].loads[0] = LoadMatrix::from_rows(&rows).unwrap();
    let spiked_slots = placements(&spiked, &cfg);
    for s in 0..=at {
        assert_eq!(spiked_slots[&(s, 0)], slots[&(s, 0)], "step {s}");
        assert_eq!(spiked_slots[&(s, 1)], slots[&(s, 1)], "step {s}");
    }
    let next = at + interval;
    assert_ne!(spiked_slots[&(next, 0)], slots[&(next, 0)]);
    assert!(spiked_slots[&(next, 0)].contains(&Some(63)));
    // Layers keep separate windows: layer 1 never saw the spike.
    assert_eq!(spiked_slots[&(next, 1)], slots[&(next, 1)]);
}

/// Rewrites a recorded trace's lines with `edit` and returns the replay error.
fn replay_error(lines: &[String], edit: impl FnOnce(&mut Vec<String>)) -> String {
    let mut lines = lines.to_vec();
    edit(&mut lines);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.jsonl");
    std::fs::write(
        &path,
        lines.iter().map(|l| format!("{l}\n")).collect::<String>(),
    )
    .unwrap();
    let cfg = config(
        Layout::contiguous(8, 64, 2).unwrap(),
        Algo::ALL.to_vec(),
        Settings::default(),
    );
    let reader = match TraceReader::open(&path) {
        Ok(reader) => reader,
        Err(e) => return e.to_string(),
    };
    let layers = reader.layers().to_vec();
    replay(reader, "bad", &layers, &cfg, |_| {})
        .expect_err("a bad trace must fail")
        .to_string()
}

#[test]
fn bad_traces_fail_with_the_line_number() {
    let trace = synthetic(TracePattern::Stationary, 3, 4, 1);
    let mut text = Vec::new();
    let mut writer = TraceWriter::new(&mut text, trace.layers.clone());
    for step in &trace.steps {
        writer.write_step(step).unwrap();
    }
    writer.finish().unwrap();
    let lines: Vec<String> = String::from_utf8(text)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(lines.len(), 12);

    type Edit = Box<dyn FnOnce(&mut Vec<String>)>;
    let cases: Vec<(Edit, &str)> = vec![
        (Box::new(|l| l.clear()), "line 1: routing trace is empty"),
        (
            Box::new(|l| l[7].truncate(40)),
            "line 8: not a routing-trace line",
        ),
        (
            Box::new(|l| l[4] = l[4].replace("\"ranks\":8", "\"ranks\":9")),
            "line 5: load is 9 ranks x 64 experts, but the first line has 8 x 64",
        ),
        (
            Box::new(|l| l[10] = l[10].replacen("],[", ",7],[", 1)),
            "line 11: load row 0 has 65 counts",
        ),
        (
            Box::new(|l| l[9] = l[9].replace("]]}", "],[1]]}")),
            "line 10: \"load\" has 9 rows, \"ranks\" is 8",
        ),
        (
            Box::new(|l| l.swap(3, 6)),
            "line 5: step 1 after step 2: steps out of order",
        ),
        (
            Box::new(|l| drop(l.remove(4))),
            "line 5: step 1 has layer 2 where layer 1 was expected",
        ),
        (Box::new(|l| drop(l.remove(3))), "missing layer 0"),
        (
            Box::new(|l| drop(l.remove(11))),
            "line 11: step 3 ends without layer 2",
        ),
        (
            Box::new(|l| l[5] = l[5].replace("\"layer\":2", "\"layer\":5")),
            "line 6: step 1 has layer 5, which step 0 does not have",
        ),
        (
            Box::new(|l| l[1] = l[1].replace("\"layer\":1", "\"layer\":0")),
            "line 2: step 0 lists layer 0 after layer 0",
        ),
    ];
    for (edit, want) in cases {
        let err = replay_error(&lines, edit);
        assert!(err.contains(want), "got '{err}', want '{want}'");
        assert!(!err.contains('\n'), "{err}");
    }
}
