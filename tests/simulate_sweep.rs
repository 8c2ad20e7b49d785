//! `rackfill simulate --sweep`: the cross product of the list flags, one row per point and
//! balancer, the same rows whatever the thread count, plots, failed points as rows, and the list
//! flags refused without `--sweep`. Tiny configurations (2 sampled layers, 3 steps, 256-token
//! chunks, the solve time fixed) keep it fast in a debug build.

mod common;

use common::{rackfill, TempDir};
use serde_json::Value;
use std::ffi::OsStr;
use std::fmt::Debug;
use std::path::Path;

/// `simulate --sweep` on small steps with the solve time fixed (reproducible), plus `extra`.
fn sweep_args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "simulate",
        "--sweep",
        "--sample-layers",
        "2",
        "--steps",
        "3",
        "--chunk-tokens",
        "256",
        "--solve-us",
        "111",
        "--json",
    ];
    args.extend_from_slice(extra);
    args
}

/// Runs a sweep that must succeed; its JSON report.
fn sweep(extra: &[&str]) -> Value {
    let args = sweep_args(extra);
    let out = rackfill(&args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{args:?}: {e}"))
}

/// Exit 2 and one stderr line `error: ...` containing `want`.
fn refused<S: AsRef<OsStr> + Debug>(args: &[S], want: &str) {
    let out = rackfill(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "{args:?}: {err}");
    assert!(lines[0].starts_with("error: "), "{args:?}: {err}");
    assert!(lines[0].contains(want), "{args:?}: {err} lacks {want}");
}

fn without_elapsed(mut doc: Value) -> Value {
    assert!(doc["elapsed_s"].as_f64().is_some_and(|s| s >= 0.0), "{doc}");
    doc["elapsed_s"] = Value::Null;
    doc
}

fn key(v: &Value) -> (String, u64, u64, String, String) {
    (
        v["model"].as_str().unwrap().into(),
        v["ep"].as_u64().unwrap(),
        v["slots"].as_u64().unwrap(),
        v["schedule"].as_str().unwrap().into(),
        v["trace"].as_str().unwrap().into(),
    )
}

const GRID: [&str; 8] = [
    "--model-shape",
    "qwen3-235b",
    "--ep-size",
    "16,8",
    "--redundant-slots",
    "2,0",
    "--balancer",
    "quota,eplb-history,none",
];

#[test]
fn sweep_reports_every_point_and_balancer_the_same_on_any_thread_count() {
    let mut grid = GRID.to_vec();
    grid.extend(["--jobs", "2"]);
    let doc = sweep(&grid);
    assert_eq!(doc["models"], serde_json::json!(["qwen3-235b"]), "{doc}");
    // Lists as run: EP sizes and slot counts ascending.
    assert_eq!(doc["ep_sizes"], serde_json::json!([8, 16]));
    assert_eq!(doc["redundant_slots"], serde_json::json!([0, 2]));
    assert_eq!(
        doc["balancers"],
        serde_json::json!(["quota", "eplb-history", "none"])
    );
    assert_eq!(doc["schedules"], serde_json::json!(["overlapped"]));
    assert_eq!(doc["traces"], serde_json::json!(["synthetic-mixed"]));
    assert_eq!(
        (doc["steps"].as_u64(), doc["seed"].as_u64()),
        (Some(3), Some(0))
    );
    let points = doc["points"].as_array().unwrap();
    let rows = doc["rows"].as_array().unwrap();
    assert_eq!(points.len(), 4, "{doc}");
    assert_eq!(rows.len(), 4 * 3, "{doc}");
    let order: Vec<(u64, u64)> = points
        .iter()
        .map(|p| (p["ep"].as_u64().unwrap(), p["slots"].as_u64().unwrap()))
        .collect();
    assert_eq!(order, [(8, 0), (8, 2), (16, 0), (16, 2)]);
    for (i, p) in points.iter().enumerate() {
        assert_eq!(p["error"], Value::Null, "{p}");
        assert_eq!(p["steps"], 3, "{p}");
        let ideal = p["ideal_tokens_per_s_per_gpu"].as_f64().unwrap();
        assert!(ideal > 0.0, "{p}");
        let mine = &rows[i * 3..i * 3 + 3];
        let names: Vec<&str> = mine
            .iter()
            .map(|r| r["balancer"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["quota", "eplb-history", "none"]);
        for row in mine {
            assert_eq!(key(row), key(p), "{row}");
            assert_eq!(row["error"], Value::Null, "{row}");
            let tokens = row["tokens_per_s_per_gpu"].as_f64().unwrap();
            let fraction = row["fraction_of_ideal"].as_f64().unwrap();
            assert!(
                tokens > 0.0 && tokens <= ideal * (1.0 + 1e-9),
                "{row} vs {p}"
            );
            assert!(fraction > 0.0 && fraction <= 1.0 + 1e-9, "{row}");
            assert!(row["speedup_over_ultraep"].as_f64().unwrap() > 0.0, "{row}");
            assert!(row["step_ms"].as_f64().unwrap() > 0.0, "{row}");
            let imbalance = &row["mean_imbalance"];
            assert!(imbalance["before"].as_f64().unwrap() >= 1.0, "{row}");
            assert!(imbalance["after"].as_f64().unwrap() >= 1.0, "{row}");
            let slots = row["slots"].as_u64().unwrap() as f64;
            // Two micro-batches of one 37.7 MB Qwen3-235B expert per slot.
            let gb = row["slot_gb_per_gpu"].as_f64().unwrap();
            assert!((gb - slots * 2.0 * 0.0377).abs() < 0.001, "{row}");
            let mb = row["replica_mb_busiest_mean"].as_f64().unwrap();
            assert!(mb >= 0.0 && (slots > 0.0 || mb == 0.0), "{row}");
        }
        // Without balancing nothing moves.
        assert_eq!(mine[2]["replica_mb_busiest_mean"], 0.0, "{}", mine[2]);
    }
    // Deterministic: the same command again, and on one thread, gives the same report.
    let doc = without_elapsed(doc);
    assert_eq!(without_elapsed(sweep(&grid)), doc);
    let mut one = GRID.to_vec();
    one.extend(["--jobs", "1"]);
    let mut serial = without_elapsed(sweep(&one));
    assert_eq!(serial["jobs"], 1);
    serial["jobs"] = doc["jobs"].clone();
    assert_eq!(serial, doc);
}

#[test]
fn sweep_writes_its_plots_and_a_table() {
    let dir = TempDir::new("sweep-plots");
    let prefix = dir.file("s");
    let prefix = prefix.to_str().unwrap();
    let mut args = sweep_args(&[
        "--model-shape",
        "qwen3-235b,deepseek-v3",
        "--ep-size",
        "8,16",
        "--redundant-slots",
        "0,1",
        "--balancer",
        "quota,none",
        "--plot-prefix",
        prefix,
    ]);
    args.retain(|a| *a != "--json");
    let out = rackfill(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    for model in ["qwen3-235b", "deepseek-v3"] {
        for plot in ["fraction-vs-ep", "tokens-vs-slots"] {
            let path = format!("{prefix}-{plot}-{model}.svg");
            assert!(err.contains(&format!("wrote {path}")), "{err}");
            let svg = std::fs::read_to_string(&path).unwrap();
            assert!(svg.starts_with("<svg") && svg.contains("quota"), "{path}");
        }
    }
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(
        table.starts_with("sweep on nvl72: 2 models x 2 EP sizes x 2 slot counts"),
        "{table}"
    );
    // 8 points, each an ideal line and one per balancer.
    let lines = table
        .lines()
        .filter(|l| l.starts_with("deepseek-v3 "))
        .count();
    assert_eq!(lines, 4 * 3, "{table}");
    assert!(
        table.contains("tok/s/GPU") && table.contains("slot GB"),
        "{table}"
    );
}

/// A routing trace of 2 steps x 2 layers on 2 ranks x 32 experts.
fn write_trace(path: &Path) {
    let row = serde_json::to_string(&[[16u64; 32], [16u64; 32]]).unwrap();
    let mut text = String::new();
    for step in 0..2 {
        for layer in 0..2 {
            text += &format!(
                "{{\"step\": {step}, \"layer\": {layer}, \"ranks\": 2, \"experts\": 32, \"load\": {row}}}\n"
            );
        }
    }
    std::fs::write(path, text).unwrap();
}

#[test]
fn a_point_that_cannot_run_is_a_row_with_its_error() {
    // EP 80 on the 72 GPUs of an NVL72: a row with its error, the other point runs.
    let doc = sweep(&[
        "--model-shape",
        "qwen3-235b",
        "--ep-size",
        "16,80",
        "--redundant-slots",
        "1",
        "--balancer",
        "quota,none",
    ]);
    let points = doc["points"].as_array().unwrap();
    assert_eq!(points.len(), 2, "{doc}");
    assert_eq!(points[0]["error"], Value::Null, "{doc}");
    let error = points[1]["error"].as_str().unwrap();
    assert!(
        error.contains("--ep-size 80 exceeds the 72 GPUs"),
        "{error}"
    );
    assert_eq!(points[1]["ideal_tokens_per_s_per_gpu"], Value::Null);
    let rows = doc["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 4, "{doc}");
    for row in &rows[2..] {
        assert_eq!(row["ep"], 80);
        assert_eq!(row["error"].as_str(), Some(error), "{row}");
        assert_eq!(row["tokens_per_s_per_gpu"], Value::Null, "{row}");
    }
    assert!(rows[0]["tokens_per_s_per_gpu"].as_f64().unwrap() > 0.0);

    // A recorded trace is a --trace entry beside synthetic routing; its experts must match the
    // shape's, so on Qwen3-235B's 128 experts its point fails while the synthetic one runs.
    let dir = TempDir::new("sweep-trace");
    let trace = dir.file("routing.jsonl");
    write_trace(&trace);
    let traces = format!("synthetic-mixed,{}", trace.display());
    let doc = sweep(&[
        "--model-shape",
        "qwen3-235b",
        "--ep-size",
        "4",
        "--trace",
        &traces,
        "--balancer",
        "none",
    ]);
    let points = doc["points"].as_array().unwrap();
    assert_eq!(points.len(), 2, "{doc}");
    assert_eq!(points[0]["error"], Value::Null, "{doc}");
    let error = points[1]["error"].as_str().unwrap();
    assert!(
        error.contains("has 32 experts, the model shape has 128"),
        "{error}"
    );

    // When no point runs the command fails: refused up front when every point is invalid...
    refused(
        &sweep_args(&["--model-shape", "qwen3-235b", "--ep-size", "80,96"]),
        "--ep-size 80 exceeds the 72 GPUs of rack 'nvl72'",
    );
    // ...and after the report when every point failed while running.
    let out = rackfill(&[
        "simulate",
        "--sweep",
        "--model-shape",
        "qwen3-235b",
        "--ep-size",
        "4",
        "--trace",
        trace.to_str().unwrap(),
        "--json",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("error: no point of the sweep ran"), "{err}");
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(doc["points"][0]["error"].is_string(), "{doc}");
}

#[test]
fn list_flags_need_sweep_and_sweep_refuses_request_mode() {
    let one = |flag: &str, values: &str| {
        let mut args = vec!["simulate", "--model-shape"];
        if flag != "--model-shape" {
            args.extend(["qwen3-235b", flag]);
        }
        args.push(values);
        args.into_iter().map(String::from).collect::<Vec<_>>()
    };
    for (flag, values) in [
        ("--model-shape", "qwen3-235b,deepseek-v3"),
        ("--ep-size", "32,64"),
        ("--redundant-slots", "0,2"),
        ("--schedule", "ultraep,overlapped"),
        ("--trace", "synthetic-mixed,synthetic-drifting"),
    ] {
        refused(
            &one(flag, values),
            &format!(
                "{flag} takes one value without --sweep, got 2: --sweep runs the cross product"
            ),
        );
    }
    // The old spellings are lists too.
    refused(
        &one("--ep", "32,64"),
        "--ep-size takes one value without --sweep",
    );
    refused(&one("--jobs", "2"), "--jobs applies to --sweep");
    refused(&one("--jobs", "0"), "expected a positive integer");
    let dir = TempDir::new("sweep-refused");
    let requests = dir.file("requests.jsonl");
    std::fs::write(
        &requests,
        "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1}\n",
    )
    .unwrap();
    refused(
        &sweep_args(&[
            "--model-shape",
            "qwen3-235b",
            "--requests",
            requests.to_str().unwrap(),
        ]),
        "--requests simulates serving a request trace; --sweep runs throughput mode only",
    );
    refused(
        &sweep_args(&["--model-shape", "qwen3-235b", "--rates", "1,2"]),
        "--rates simulates serving a request trace",
    );
    // Found before the sweep runs, not after.
    let missing = dir.file("no/such/dir/p");
    refused(
        &sweep_args(&[
            "--model-shape",
            "qwen3-235b",
            "--plot-prefix",
            missing.to_str().unwrap(),
        ]),
        "does not exist",
    );
}
