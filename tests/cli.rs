//! The `rackfill` binary end to end: `plan` (its exact JSON document and exit codes) and `bench balance`.

use serde_json::Value;
use std::io::Write as _;
use std::process::{Command, Output, Stdio};

fn plan(args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_rackfill"))
        .arg("plan")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("rackfill runs");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

fn plan_json(args: &[&str], stdin: &str) -> Value {
    let mut all = vec!["--load", "-", "--json"];
    all.extend_from_slice(args);
    let out = plan(&all, stdin);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("stdout is one JSON document")
}

const SKEWED: &str = r#"{"load": [[90, 10, 5, 5], [80, 20, 0, 10]]}"#;

#[test]
fn json_has_exactly_the_documented_keys() {
    let doc = plan_json(&["--slots", "1"], SKEWED);
    let mut keys: Vec<&str> = doc
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    let mut expected = vec![
        "algo",
        "ranks",
        "experts",
        "slots_per_rank",
        "slots",
        "quotas",
        "rank_load_before",
        "rank_load_after",
        "imbalance_before",
        "imbalance_after",
        "lower_bound",
        "replicas",
        "max_fanout",
        "solve_us",
    ];
    expected.sort_unstable();
    assert_eq!(keys, expected);
}

#[test]
fn quota_plan_balances_and_quotas_add_up() {
    let doc = plan_json(&["--slots", "1"], SKEWED);
    assert_eq!(doc["algo"], "quota");
    assert_eq!(doc["ranks"], 2);
    assert_eq!(doc["experts"], 4);
    assert_eq!(doc["rank_load_before"], serde_json::json!([200, 20]));
    assert_eq!(doc["rank_load_after"], serde_json::json!([110, 110]));
    assert_eq!(doc["lower_bound"], 110);
    assert_eq!(doc["imbalance_after"], 1.0);
    assert_eq!(doc["slots"], serde_json::json!([[null], [0]]));
    // Expert 0: main on rank 0 first, the replica on rank 1; quotas sum to its 170 pairs.
    let q0 = doc["quotas"][0].as_array().unwrap();
    assert_eq!(q0[0][0], 0);
    assert_eq!(q0[1][0], 1);
    assert_eq!(q0[0][1].as_u64().unwrap() + q0[1][1].as_u64().unwrap(), 170);
}

#[test]
fn every_stateless_algo_and_an_explicit_home_map() {
    let input = r#"{"load": [[9, 1, 1], [9, 1, 1]], "home": [1, 0, 0]}"#;
    for algo in ["none", "quota", "eplb-exact", "greedy-move"] {
        let doc = plan_json(&["--algo", algo, "--slots", "1"], input);
        assert_eq!(doc["algo"], algo);
        assert_eq!(
            doc["quotas"][0][0][0], 1,
            "{algo}: expert 0 lives on rank 1"
        );
        let after: u64 = doc["rank_load_after"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .sum();
        assert_eq!(after, 22, "{algo} lost or invented tokens");
    }
}

#[test]
fn human_summary_without_json() {
    let out = plan(&["--load", "-", "--slots", "1"], SKEWED);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("imbalance 1.8182 -> 1.0000"), "{text}");
}

#[test]
fn bad_input_exits_2_with_one_line() {
    let cases = [
        ("not json", "not JSON"),
        (r#"{"load": [[1, 2], [3]]}"#, "ragged"),
        (r#"{"load": [[1, -2]]}"#, "negative"),
        (r#"{"load": [[1, 2.5]]}"#, "fractional"),
        (r#"{"load": [[1, 2]], "home": [0, 3]}"#, "home out of range"),
        (
            r#"{"load": [[1, 2]], "home": [0]}"#,
            "home of the wrong length",
        ),
        (r#"{"load": []}"#, "no ranks"),
        (r#"{"loads": [[1]]}"#, "missing load"),
        // A repeated field must not silently replace the first.
        (
            r#"{"load": [[1, 2], [3, 4]], "load": [[1]]}"#,
            "duplicate load",
        ),
        (r#"[[[1, 2]]]"#, "an array, not an object"),
        (r#"{"load": [[18446744073709551616]]}"#, "beyond 2^64-1"),
        (r#"{"load": [[1, 2]], "slots": 1}"#, "unknown field"),
    ];
    for (input, what) in cases {
        let out = plan(&["--load", "-"], input);
        assert_eq!(out.status.code(), Some(2), "{what}: exit code");
        let err = String::from_utf8(out.stderr).unwrap();
        assert_eq!(err.lines().count(), 1, "{what}: {err}");
        assert!(err.starts_with("error: "), "{what}: {err}");
    }
    let out = plan(&["--load", "/nonexistent/load.json"], "");
    assert_eq!(out.status.code(), Some(2));
    let out = plan(&["--load", "-", "--algo", "eplb-history"], SKEWED);
    assert_eq!(out.status.code(), Some(2));
    let out = plan(&["--load", "-", "--ranks", "3"], SKEWED);
    assert_eq!(out.status.code(), Some(2), "--ranks must match the rows");
    // More slots than experts can never be used: refused before anything is allocated.
    let out = plan(&["--load", "-", "--slots", "18446744073709551615"], SKEWED);
    assert_eq!(out.status.code(), Some(2), "huge --slots");
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("at most"), "{err}");
}

#[test]
fn a_closed_stdout_ends_quietly() {
    use std::io::{Read, Write};
    use std::process::Stdio;
    // `rackfill plan ... | head -c 1` on a plan whose JSON is far larger than a pipe's buffer:
    // the reader goes away after one byte, and the writer must end without a panic.
    let rows: Vec<Vec<u64>> = (0..8)
        .map(|r| (0..20_000).map(|e| (e * 7 + r) % 13).collect())
        .collect();
    let input = serde_json::json!({ "load": rows }).to_string();
    let mut child = Command::new(env!("CARGO_BIN_EXE_rackfill"))
        .args(["plan", "--load", "-", "--json"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 1];
    stdout.read_exact(&mut first).unwrap();
    drop(stdout);
    writer.join().unwrap().unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(out.status.code(), Some(141), "{err}");
}

fn bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rackfill"))
        .args(["bench", "balance"])
        .args(args)
        .output()
        .expect("rackfill runs")
}

#[test]
fn bench_balance_reports_every_balancer() {
    let dir = std::env::temp_dir().join(format!("rackfill-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("report.json");
    let out = bench(&[
        "--synthetic",
        "--steps",
        "2",
        "--shapes",
        "8/64/2",
        "--tokens",
        "256",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8(out.stdout).unwrap();
    for name in [
        "none",
        "quota",
        "quota-paper",
        "eplb-exact",
        "eplb-history",
        "greedy-move",
    ] {
        assert!(
            table.contains(&format!("| {name} ")),
            "{name} missing:\n{table}"
        );
    }
    let report: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(report["validation_failures"], 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bench_balance_rejects_bad_flags() {
    for args in [
        &["--steps", "2"][..],
        &["--synthetic", "--shapes", "8/64"][..],
        &["--synthetic", "--tokens", "0"][..],
        &["--synthetic", "--json", "/nonexistent/dir/report.json"][..],
    ] {
        let out = bench(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(err.starts_with("error: "), "{args:?}: {err}");
    }
}

#[test]
fn readme_example_file_plans() {
    let file = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/balancer/tests/data/skewed.json"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_rackfill"))
        .args(["plan", "--load", file, "--slots", "2", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["ranks"], 8);
    assert_eq!(doc["experts"], 64);
    let before = doc["imbalance_before"].as_f64().unwrap();
    let after = doc["imbalance_after"].as_f64().unwrap();
    assert!(before > 2.0 && after < 1.01, "{before} -> {after}");
}

#[test]
fn bad_flags_get_one_line_and_help_still_works() {
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_rackfill"))
            .args(args)
            .output()
            .expect("rackfill runs")
    };
    for args in [
        &["plan", "--load", "x", "--slots", "-1"][..],
        &["plan"],
        &["nope"],
        &["bench", "balance", "--synthetic", "--history-window", "0"],
        &["serve", "--balancer", "nope"],
    ] {
        let out = run(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.starts_with("error: "), "{args:?}: {err}");
    }
    let out = run(&["plan", "--load", "x", "--redundant-slots"]);
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("--redundant-slots"),
        "the flag is named: {err}"
    );
    let out = run(&["plan", "--help"]);
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8(out.stdout)
        .unwrap()
        .contains("--redundant-slots"));
}

#[test]
fn oversized_inputs_are_refused_with_one_line() {
    let refused = |args: &[&str], stdin: &str, needle: &str| {
        let out = plan(args, stdin);
        assert_eq!(out.status.code(), Some(2), "{needle}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.contains(needle), "{err} lacks {needle:?}");
    };
    // 16384 ranks of two experts (a 100 kB file): the plan's reroute split alone would be
    // 16384 x 16384 counts (the quota planner took 6 GB and half a minute).
    let rows = vec!["[3, 1]"; 16384].join(",");
    refused(
        &["--load", "-", "--slots", "1"],
        &format!("{{\"load\": [{rows}]}}"),
        "use fewer ranks or slots",
    );
    // One row of 2^23 + 1 counts: refused at the limit instead of read (as JSON values it took
    // gigabytes).
    let row = "0,".repeat(1 << 23);
    refused(
        &["--load", "-"],
        &format!("{{\"load\": [[{row}0]]}}"),
        "the load has more than 8388608 counts",
    );
    refused(
        &["--load", env!("CARGO_MANIFEST_DIR")],
        "",
        "is a directory",
    );
}
