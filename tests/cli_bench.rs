//! The `rackfill` binary's bench and simulate commands on bad input: exit 2 with one `error:`
//! line before any work (clap's own usage errors add its "For more information" hint), and
//! reports that say what ran.

mod common;

use common::{json_report, rackfill};
use serde_json::Value;
use std::ffi::OsStr;
use std::fmt::Debug;
use std::path::{Path, PathBuf};

/// Exit 2 and a first stderr line `error: ...` containing `want`; one line unless clap parsed it.
fn refused<S: AsRef<OsStr> + Debug>(args: &[S], want: &str) {
    let out = rackfill(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    let first = err.lines().next().unwrap_or_default();
    assert!(first.starts_with("error: "), "{args:?}: {err}");
    assert!(first.contains(want), "{args:?}: {first} lacks {want}");
    if !first.starts_with("error: invalid value") {
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
    }
}

fn temp_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rackfill-cli-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_string()
}

/// 4 MoE layers of 32 experts, top-8: small enough for a debug binary.
const SHAPE: &str = r#"{"name": "m32", "layers": 4, "experts": 32, "top_k": 8, "hidden": 64,
    "moe_intermediate": 32, "attention": {"kind": "gqa", "q_heads": 2, "kv_heads": 1, "head_dim": 32}}"#;

/// A routing trace of `steps` steps x `layers` layers on 2 ranks x 32 experts, 64 tokens per rank.
fn trace(steps: u64, layers: usize) -> String {
    let row = serde_json::to_string(&[[16u64; 32], [16u64; 32]]).unwrap();
    let mut text = String::new();
    for step in 0..steps {
        for layer in 0..layers {
            text += &format!(
                "{{\"step\": {step}, \"layer\": {layer}, \"ranks\": 2, \"experts\": 32, \"load\": {row}}}\n"
            );
        }
    }
    text
}

#[test]
fn simulate_reports_the_trace_layers_and_tokens_that_ran() {
    let dir = temp_dir();
    let shape = write(&dir, "shape.json", SHAPE);
    let tr = write(&dir, "trace8.jsonl", &trace(2, 8));
    let base = [
        "simulate",
        "--model-shape",
        &shape,
        "--ep",
        "4",
        "--trace",
        &tr,
    ];
    let mut args = base.to_vec();
    args.extend(["--balancer", "quota,none", "--solve-us", "1", "--json"]);
    let out = rackfill(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["simulated_layers"], 8, "{doc}");
    assert_eq!(doc["moe_layers"], 4);
    assert_eq!(doc["chunk_tokens"], Value::Null);
    // 2 x 512 pairs re-split over 4 ranks at top-8: 32 tokens per rank.
    assert_eq!(doc["tokens_per_rank_mean"], 32.0);
    // The default schedule, and the ablation beside it.
    assert_eq!(doc["schedule"], "overlapped");
    assert_eq!(doc["balancers"][0]["schedules"][0]["schedule"], "ultraep");
    args.extend(["--schedule", "ultraep"]);
    let doc: Value = serde_json::from_slice(&rackfill(&args).stdout).unwrap();
    assert_eq!(doc["schedule"], "ultraep");
    assert_eq!(doc["balancers"][0]["speedup_over_ultraep"], 1.0);
    // Per-layer slots report the tolerance resident replicas are preferred within.
    assert_eq!(doc["reuse_tolerance"], Value::Null);
    args.extend(["--slot-memory", "per-layer", "--reuse-tolerance", "0.05"]);
    let doc: Value = serde_json::from_slice(&rackfill(&args).stdout).unwrap();
    assert_eq!(doc["reuse_tolerance"], 0.05, "{doc}");
    for flag in [
        ["--sample-layers", "2"],
        ["--chunk-tokens", "64"],
        ["--sampler", "tokens"],
    ] {
        let mut args = base.to_vec();
        args.extend(flag);
        refused(&args, &format!("{} applies to synthetic routing", flag[0]));
    }
}

#[test]
fn simulate_refuses_what_it_cannot_run() {
    let dir = temp_dir();
    let shape = write(&dir, "shape.json", SHAPE);
    let base = [
        "simulate",
        "--model-shape",
        &shape,
        "--ep",
        "4",
        "--steps",
        "1",
    ];
    let with = |extra: &[&str]| -> Vec<String> {
        base.iter().chain(extra).map(|s| s.to_string()).collect()
    };
    refused(
        &with(&["--chunk-tokens", "18446744073709551615"]),
        "--chunk-tokens must be in 1..=65536",
    );
    refused(
        &with(&["--schedule", "three-batch"]),
        "unknown schedule 'three-batch'",
    );
    for bad in [
        "--reuse-tolerance=-0.1",
        "--reuse-tolerance=inf",
        "--reuse-tolerance=some",
    ] {
        refused(&with(&[bad]), "expected off or a non-negative fraction");
    }
    refused(
        &with(&["--balancer", "eplb-history", "--history-window", "0"]),
        "expected a positive integer",
    );
    refused(
        &with(&["--balancer", "eplb-history", "--rebalance-interval", "0"]),
        "expected a positive integer",
    );
    let rack = write(
        &dir,
        "rack.json",
        r#"{"name": "r", "gpus": 8, "scale_up_gbytes_per_s": 900, "bf16_tflops": 2250,
            "hbm_tbytes_per_s": 8, "gemm_efficiency": []}"#,
    );
    refused(
        &with(&["--rack", &rack]),
        "gemm_efficiency needs at least one [tokens, efficiency] point",
    );
    let huge = write(
        &dir,
        "huge.json",
        &SHAPE.replace("\"hidden\": 64", "\"hidden\": 4611686018427387904"),
    );
    refused(
        &["simulate", "--model-shape", &huge, "--ep", "4"],
        "hidden must be in 1..=262144",
    );
    let requests = write(
        &dir,
        "requests.jsonl",
        "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1}\n\
         {\"timestamp\": 5, \"input_length\": 10, \"output_length\": 1}\n",
    );
    refused(
        &with(&["--requests", &requests, "--rates", "1e-18"]),
        "--rates 1e-18: request 1 ",
    );
}

#[test]
fn benches_refuse_sizes_they_cannot_run() {
    let builtin = concat!(env!("CARGO_MANIFEST_DIR"), "/models/builtin");
    refused(
        &[
            "bench",
            "forward",
            "--model",
            builtin,
            "--tokens",
            "18446744073709551615",
        ],
        "prompt length 18446744073709551615 exceeds the model's context",
    );
    refused(
        &[
            "bench",
            "ep",
            "--model",
            "rackfill-tiny-moe",
            "--ep",
            "18446744073709551615",
        ],
        "EP size 18446744073709551615 must be in 1..=",
    );
    refused(
        &[
            "bench",
            "balance",
            "--synthetic",
            "--steps",
            "1",
            "--shapes",
            "18446744073709551615/32/2",
        ],
        "needs 1..=1024 ranks",
    );
    refused(
        &[
            "bench",
            "balance",
            "--synthetic-trace",
            "mixed",
            "--shapes",
            "8/64/65",
        ],
        "65 redundant slots per rank, at most 64",
    );
    refused(
        &[
            "bench",
            "balance",
            "--synthetic-trace",
            "mixed",
            "--shapes",
            "8/64/2",
            "--layers",
            "100000000",
        ],
        "at most 67108864 load counts per step",
    );
}

#[test]
fn help_lists_every_balancer() {
    let out = rackfill(&["bench", "balance", "--help"]);
    let help = String::from_utf8(out.stdout).unwrap();
    assert!(help.contains("quota-paper"), "{help}");
}

/// `bench ep --rack` costs the simulated makespans on the rack it names, as `simulate` does; a
/// rack file that cannot be read is one line before any work.
#[test]
fn bench_ep_costs_on_the_rack_it_is_given() {
    let dir = temp_dir();
    let rack = write(
        &dir,
        "slow-rack.json",
        r#"{"name": "slow-rack", "gpus": 8, "scale_up_gbytes_per_s": 1.0, "link_efficiency": 0.5,
            "link_latency_us": 10.0, "bf16_tflops": 1.0, "hbm_tbytes_per_s": 0.1,
            "attention_efficiency": 0.5, "gemm_efficiency": [[1, 0.5], [4096, 0.8]]}"#,
    );
    let run = |rack: &str, json: &Path| {
        let args = [
            "bench",
            "ep",
            "--model",
            "rackfill-tiny-moe",
            "--sequences",
            "2",
            "--tokens",
            "16",
            "--ep-size",
            "2",
            "--balancer",
            "quota",
            "--rounds",
            "1",
            "--rack",
            rack,
            "--json",
            json.to_str().unwrap(),
        ];
        json_report(&args, json)
    };
    let slow = run(&rack, &dir.join("slow.json"));
    let nvl72 = run("nvl72", &dir.join("nvl72.json"));
    assert_eq!(slow["rack"], "slow-rack");
    assert_eq!(nvl72["rack"], "nvl72");
    let makespan = |r: &Value| r["results"][1]["simulated_moe_us"].as_f64().unwrap();
    assert!(
        makespan(&slow) > 5.0 * makespan(&nvl72),
        "{slow} vs {nvl72}"
    );
    refused(
        &[
            "bench",
            "ep",
            "--model",
            "rackfill-tiny-moe",
            "--rack",
            dir.join("missing.json").to_str().unwrap(),
        ],
        "cannot read rack file",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `bench ep --schedule ultraep,pipelined,two-batch --slot-memory shared,per-layer` runs every
/// configuration each way, side by side: two micro-batches report both micro-batches' replicas,
/// pipelining moves the same replica bytes, resident replicas are not streamed again; a schedule
/// it does not know, and the replaced flags, are one-line errors.
#[test]
fn bench_ep_runs_every_schedule_side_by_side() {
    // Its own directory: other tests remove the shared one when they finish.
    let dir = std::env::temp_dir().join(format!("rackfill-cli-micro-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("micro.json");
    let args = [
        "bench",
        "ep",
        "--model",
        "rackfill-tiny-moe",
        "--sequences",
        "8",
        "--tokens",
        "24",
        "--ep-size",
        "4",
        "--balancer",
        "quota",
        "--schedule",
        "ultraep,pipelined,two-batch",
        "--slot-memory",
        "shared,per-layer",
        "--rounds",
        "1",
        "--json",
        json.to_str().unwrap(),
    ];
    let report = json_report(&args, &json);
    let results = report["results"].as_array().unwrap();
    let cases: Vec<(&str, &str)> = results[1..]
        .iter()
        .map(|r| {
            let case = &r["case"];
            (
                case["schedule"].as_str().unwrap(),
                case["slot_memory"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        cases,
        [
            ("ultraep", "shared"),
            ("ultraep", "per-layer"),
            ("pipelined", "shared"),
            ("pipelined", "per-layer"),
            ("two-batch", "shared"),
            ("two-batch", "per-layer")
        ],
        "{report}"
    );
    let replicas = |i: usize| results[i]["replicas"].as_u64().unwrap();
    assert!(replicas(1) > 0 && replicas(5) > replicas(1), "{report}");
    // Every round repeats the prompts: per-layer slots still hold the replicas from the warm-up.
    let streamed = |i: usize| results[i]["replica_bytes"].as_u64().unwrap();
    assert!(streamed(1) > 0 && streamed(5) > 0, "{report}");
    assert_eq!(streamed(1), streamed(3), "pipelining moves the same bytes");
    assert_eq!(
        (streamed(2), streamed(4), streamed(6)),
        (0, 0, 0),
        "{report}"
    );
    refused(
        &["bench", "ep", "--schedule", "three-batch"],
        "unknown schedule 'three-batch'",
    );
    refused(
        &["serve", "--pipelined-experts", "on"],
        "replaced by --schedule",
    );
    refused(&["serve", "--data-plane", "gpu"], "replaced by --device");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `bench attention` on the host emulator (where a C++ compiler is): every flash tile shape
/// asked for and the GEMM + softmax + GEMM baseline agree on every case, which the JSON report
/// lists; `--device cpu`, uneven heads, an unknown tile shape and a device this build lacks are
/// one-line errors.
#[test]
fn bench_attention_compares_the_kernel_with_its_baseline() {
    refused(&["bench", "attention", "--device", "cpu"], "GPU path");
    refused(
        &[
            "bench",
            "attention",
            "--device",
            "emulator",
            "--heads",
            "6",
            "--kv-heads",
            "4",
        ],
        "not a multiple of --kv-heads 4",
    );
    refused(&["bench", "attention", "--chunk", "0"], "invalid value");
    #[cfg(feature = "cuda")]
    if rackfill_kernels::cuda::exec::Emulator::shared().is_some() {
        let dir = common::TempDir::new("bench-attention");
        let report = dir.file("attention.json");
        let args = [
            "bench",
            "attention",
            "--device",
            "emulator",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "16",
            "--context",
            "0,21",
            "--chunk",
            "9",
            "--tiles",
            "k64_v64,k32_v128",
            "--repeats",
            "1",
            "--json",
            report.to_str().unwrap(),
        ];
        let report = json_report(&args, &report);
        let timings = report["timings"].as_array().unwrap();
        assert_eq!(timings.len(), 2, "one case per --context value");
        for (t, context) in timings.iter().zip([0, 21]) {
            assert_eq!(
                (t["case"]["context"].as_u64(), t["case"]["chunk"].as_u64()),
                (Some(context), Some(9))
            );
            let flash = t["flash"].as_array().unwrap();
            let tiles: Vec<&str> = flash.iter().map(|f| f["tiles"].as_str().unwrap()).collect();
            assert_eq!(tiles, ["k64_v64", "k32_v128"], "the tile shapes asked for");
            for f in flash {
                let rel = f["rel_l2"].as_f64().unwrap();
                assert!(rel < 1e-2, "context {context}: flash vs baseline {rel}");
                assert!(f["ms"].as_f64().unwrap() > 0.0 && f["tflops"].as_f64().unwrap() > 0.0);
            }
            assert!(t["flops"].as_f64().unwrap() > 0.0);
        }
        refused(
            &[
                "bench",
                "attention",
                "--device",
                "emulator",
                "--tiles",
                "k7_v7",
            ],
            "unknown tile shape 'k7_v7'",
        );
    }
}

/// `bench forward --model-shape` on the host emulator (where a C++ compiler is): the built-in
/// model's config.json, its first layer, weights generated on the device, one prefill timed (the
/// real shapes' tensor lists and sizes are checked in rackfill-bench's tests; their widths are
/// hours on the emulator); the report names the shape, counts model FLOPs and splits a profiled
/// prefill into the five phases. A shape it does not know, `--layers` without a shape and a shape
/// beside `--model` are one-line errors.
#[test]
fn bench_forward_runs_a_real_model_shape_with_phases() {
    refused(
        &["bench", "forward", "--model-shape", "llama-70b"],
        "unknown model shape 'llama-70b' (one of qwen3-30b-a3b, deepseek-v3, or a config.json)",
    );
    refused(&["bench", "forward", "--layers", "2"], "--model-shape");
    refused(
        &[
            "bench",
            "forward",
            "--model",
            "rackfill-tiny-moe",
            "--model-shape",
            "deepseek-v3",
        ],
        "cannot be used with",
    );
    #[cfg(feature = "cuda")]
    if rackfill_kernels::cuda::exec::Emulator::shared().is_some() {
        let dir = common::TempDir::new("bench-forward-shape");
        let report = dir.file("forward.json");
        let builtin_config = concat!(env!("CARGO_MANIFEST_DIR"), "/models/builtin/config.json");
        let args = [
            "bench",
            "forward",
            "--device",
            "emulator",
            "--model-shape",
            builtin_config,
            "--layers",
            "1",
            "--tokens",
            "12",
            "--repeats",
            "1",
            "--peak-tflops",
            "1000",
            "--json",
            report.to_str().unwrap(),
        ];
        let report = json_report(&args, &report);
        assert_eq!(report["model"], format!("{builtin_config} (1 layers)"));
        assert_eq!(report["config"]["num_hidden_layers"], 1);
        assert_eq!(report["peak_tflops"], 1000.0);
        let result = &report["results"][0];
        assert_eq!(result["tokens"], 12);
        assert!(result["model_tflops"].as_f64().unwrap() > 0.0);
        assert!(result["mfu"].as_f64().unwrap() > 0.0);
        let phases = result["phases_ms"].as_object().unwrap();
        for phase in [
            "attention",
            "expert GEMMs",
            "dense GEMMs",
            "norms and elementwise",
            "routing and balancing",
        ] {
            assert!(phases[phase].as_f64().unwrap() > 0.0, "{phase}: {phases:?}");
        }
        // The per-expert cuBLAS baseline runs the same shape.
        let baseline = dir.file("baseline.json");
        let mut args = args.to_vec();
        let at = args.len() - 1;
        args[at] = baseline.to_str().unwrap();
        args.extend(["--expert-gemms", "per-expert"]);
        let report = json_report(&args, &baseline);
        assert_eq!(
            report["model"],
            format!("{builtin_config} (1 layers), per-expert GEMMs")
        );
    }
    refused(
        &["bench", "forward", "--expert-gemms", "per-expert"],
        "--expert-gemms chooses the GPU path's expert kernels",
    );
}

/// A successful run's standard output as JSON.
fn stdout_json(out: std::process::Output) -> Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `simulate` on synthetic routing, small enough for the test profile.
fn small_simulation(shape: &str, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "simulate",
        "--model-shape",
        shape,
        "--ep",
        "4",
        "--steps",
        "4",
        "--chunk-tokens",
        "128",
        "--json",
    ];
    args.extend(extra);
    rackfill(&args)
}

#[test]
fn simulate_charges_a_modelled_solve_time_and_is_the_same_run_after_run() {
    let dir = temp_dir();
    let shape = write(&dir, "shape.json", SHAPE);
    let a = small_simulation(&shape, &[]);
    assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
    // Nothing measured on this host by default: the same command gives the same bytes.
    assert_eq!(a.stdout, small_simulation(&shape, &[]).stdout);
    let doc: Value = serde_json::from_slice(&a.stdout).unwrap();
    assert_eq!(doc["solve_us_override"], 111.0, "{doc}");
    assert_eq!(doc["solve_time"], "modelled: UltraEP's planner on a GB200");
    assert_eq!(doc["sampler"], "counts");
    assert_eq!(doc["balancers"][0]["balancer"], "quota");
    assert_eq!(
        doc["balancers"][0]["solve_us_mean"], 222.0,
        "two micro-batches"
    );
    // The per-token reference and the host's own solve time on request.
    let doc = stdout_json(small_simulation(
        &shape,
        &["--sampler", "tokens", "--host-solve-time"],
    ));
    assert_eq!(doc["sampler"], "tokens");
    assert_eq!(doc["solve_us_override"], Value::Null);
    assert_eq!(doc["solve_time"], "measured on this host");
    refused(
        &[
            "simulate",
            "--model-shape",
            &shape,
            "--solve-us",
            "5",
            "--host-solve-time",
        ],
        "cannot be used with",
    );
    refused(
        &["simulate", "--model-shape", &shape, "--sampler", "alias"],
        "invalid value 'alias'",
    );
}

#[test]
fn simulate_calibrates_the_rack_with_a_gpu_session_report() {
    let dir = temp_dir();
    let shape = write(&dir, "shape.json", SHAPE);
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/tests/fixtures/calibration");
    let session = fixtures.join("h200-2026-11-28");
    let out = small_simulation(&shape, &["--calibration", session.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    let calibration = &doc["calibration"];
    assert_eq!(calibration["card"], "NVIDIA H200", "{calibration}");
    let term = |name: &str| {
        calibration["terms"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["term"] == name)
            .unwrap_or_else(|| panic!("no {name} in {calibration}"))
            .clone()
    };
    assert_eq!(term("attention_efficiency")["measured"], true);
    assert_eq!(term("link_efficiency")["measured"], false);
    // rackfill's measured attention (about 9% of the peak) is slower than the paper's 60%.
    let plain = stdout_json(small_simulation(&shape, &[]));
    let tokens = |d: &Value| d["ideal"]["tokens_per_s"].as_f64().unwrap();
    assert!(
        tokens(&doc) < tokens(&plain),
        "{} vs {}",
        tokens(&doc),
        tokens(&plain)
    );
    // The H100 session measured the device planner: its solve time is charged.
    let kernels = fixtures.join("h100-2026-11-28");
    let doc = stdout_json(small_simulation(
        &shape,
        &["--calibration", kernels.to_str().unwrap()],
    ));
    assert_eq!(doc["solve_time"], "calibrated: the report's device solver");
    assert!(
        (doc["solve_us_override"].as_f64().unwrap() - 278.2).abs() < 0.1,
        "{doc}"
    );
    let missing = dir.join("no-such-session");
    refused(
        &[
            "simulate",
            "--model-shape",
            &shape,
            "--calibration",
            missing.to_str().unwrap(),
        ],
        "calibration",
    );
}
