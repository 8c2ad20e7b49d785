//! One flag vocabulary: every command that takes an EP size, redundant slots or a balancer spells
//! them `--ep-size`, `--redundant-slots` and `--balancer`, shows only those in its help, and still
//! accepts the older spellings (`--ep`, `--ranks`, `--slots`, `--algo`, `--balancers`) as hidden
//! aliases that mean exactly the same.

mod common;

use common::{json_report, rackfill, TempDir};
use serde_json::Value;

/// Runs a command that must succeed and returns its stdout as JSON.
fn json(args: &[&str]) -> Value {
    let out = rackfill(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{args:?}: {e}"))
}

/// Whether `text` names the flag `--name` (not a longer flag that starts with it).
fn names_flag(text: &str, name: &str) -> bool {
    let flag = format!("--{name}");
    text.match_indices(&flag).any(|(at, _)| {
        let next = text[at + flag.len()..].chars().next();
        !next.is_some_and(|c| c.is_ascii_alphanumeric() || c == '-')
    })
}

const NEW: [&str; 3] = ["ep-size", "redundant-slots", "balancer"];
const OLD: [&str; 5] = ["ep", "ranks", "slots", "algo", "balancers"];

#[test]
fn every_command_shows_the_same_three_flags_and_hides_the_old_ones() {
    for command in [
        &["plan"][..],
        &["bench", "ep"],
        &["bench", "balance"],
        &["simulate"],
        &["serve"],
    ] {
        let mut args = command.to_vec();
        args.push("--help");
        let out = rackfill(&args);
        assert_eq!(out.status.code(), Some(0), "{args:?}");
        let help = String::from_utf8(out.stdout).unwrap();
        for name in NEW {
            assert!(
                help.contains(&format!("--{name} <")),
                "{command:?} lacks --{name}:\n{help}"
            );
        }
        for name in OLD {
            assert!(
                !names_flag(&help, name),
                "{command:?} shows --{name}:\n{help}"
            );
        }
    }
}

#[test]
fn plan_takes_the_old_spellings_for_the_same_plan() {
    let load = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/balancer/tests/data/skewed.json"
    );
    let plan = |flags: &[&str]| {
        let mut args = vec!["plan", "--load", load, "--json"];
        args.extend_from_slice(flags);
        let mut doc = json(&args);
        doc["solve_us"] = Value::Null;
        doc
    };
    let new = plan(&[
        "--ep-size",
        "8",
        "--redundant-slots",
        "1",
        "--balancer",
        "greedy-move",
    ]);
    assert_eq!(new["algo"], "greedy-move");
    assert_eq!(new["slots_per_rank"], 1);
    let old = plan(&["--ranks", "8", "--slots", "1", "--algo", "greedy-move"]);
    assert_eq!(old, new);
    let out = rackfill(&["plan", "--load", load, "--ep-size", "3"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("--ep-size is 3 but the load has 8 rows"),
        "{err}"
    );
}

#[test]
fn bench_balance_takes_the_old_spellings() {
    let dir = TempDir::new("flags-balance");
    let report = |name: &str, flags: &[&str]| {
        let path = dir.file(name);
        let mut args = vec![
            "bench",
            "balance",
            "--synthetic-trace",
            "stationary",
            "--shapes",
            "8/64/2",
            "--tokens",
            "64",
            "--steps",
            "2",
            "--layers",
            "2",
            "--json",
            path.to_str().unwrap(),
        ];
        args.extend_from_slice(flags);
        json_report(&args, &path)
    };
    let summary = |doc: &Value| {
        (
            doc["ranks"].clone(),
            doc["slots_per_rank"].clone(),
            doc["balancers"].clone(),
        )
    };
    let new = report(
        "new.json",
        &[
            "--ep-size",
            "16",
            "--redundant-slots",
            "1",
            "--balancer",
            "quota,none",
        ],
    );
    assert_eq!(
        summary(&new),
        (16.into(), 1.into(), serde_json::json!(["quota", "none"]))
    );
    let old = report(
        "old.json",
        &["--ep", "16", "--slots", "1", "--balancers", "quota,none"],
    );
    assert_eq!(summary(&old), summary(&new));
    let ranks = report("ranks.json", &["--ranks", "16", "--algo", "none"]);
    assert_eq!(ranks["ranks"], 16);
    assert_eq!(ranks["balancers"], serde_json::json!(["none"]));
}

#[test]
fn bench_balance_checks_ep_size_against_a_trace_and_refuses_it_for_the_grid() {
    let dir = TempDir::new("flags-ep-size");
    let path = dir.file("trace.jsonl");
    let line = |step: u64| {
        format!("{{\"step\":{step},\"layer\":0,\"ranks\":2,\"experts\":8,\"load\":[[1,2,3,4,5,6,7,8],[8,7,6,5,4,3,2,1]]}}\n")
    };
    std::fs::write(&path, line(0) + &line(1)).unwrap();
    let trace = path.to_str().unwrap();
    let out = rackfill(&["bench", "balance", "--trace", trace, "--ep-size", "2"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = rackfill(&["bench", "balance", "--trace", trace, "--ep-size", "4"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("--ep-size is 4 but") && err.contains("recorded with 2 ranks"),
        "{err}"
    );
    let out = rackfill(&["bench", "balance", "--synthetic", "--redundant-slots", "1"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("--redundant-slots applies to --trace and --synthetic-trace"),
        "{err}"
    );
}

#[test]
fn simulate_takes_the_old_spellings_for_the_same_report() {
    let simulate = |flags: &[&str]| {
        let mut args = vec![
            "simulate",
            "--model-shape",
            "qwen3-235b",
            "--steps",
            "2",
            "--sample-layers",
            "2",
            "--chunk-tokens",
            "256",
            "--solve-us",
            "1",
            "--json",
        ];
        args.extend_from_slice(flags);
        json(&args)
    };
    let new = simulate(&[
        "--ep-size",
        "16",
        "--redundant-slots",
        "1",
        "--balancer",
        "quota,none",
    ]);
    assert_eq!(new["ep"], 16, "{new}");
    assert_eq!(new["slots"], 1, "{new}");
    let old = simulate(&["--ep", "16", "--slots", "1", "--balancers", "quota,none"]);
    assert_eq!(old, new);
}

#[test]
fn bench_ep_takes_the_old_spellings() {
    let dir = TempDir::new("flags-ep");
    let bench = |name: &str, flags: &[&str]| {
        let path = dir.file(name);
        let mut args = vec![
            "bench",
            "ep",
            "--model",
            "rackfill-tiny-moe",
            "--sequences",
            "2",
            "--tokens",
            "8",
            "--rounds",
            "1",
            "--json",
            path.to_str().unwrap(),
        ];
        args.extend_from_slice(flags);
        let doc = json_report(&args, &path);
        let cases: Vec<(Value, Value)> = doc["results"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| !r["case"].is_null())
            .map(|r| (r["case"]["ep_size"].clone(), r["case"]["balancer"].clone()))
            .collect();
        (doc["redundant_slots"].clone(), cases)
    };
    let new = bench(
        "ep-new.json",
        &[
            "--ep-size",
            "2",
            "--redundant-slots",
            "1",
            "--balancer",
            "greedy-move,none",
        ],
    );
    let want = vec![(2.into(), "greedy-move".into()), (2.into(), "none".into())];
    assert_eq!(new, (1.into(), want));
    let old = bench(
        "ep-old.json",
        &[
            "--ep",
            "2",
            "--slots",
            "1",
            "--balancers",
            "greedy-move,none",
        ],
    );
    assert_eq!(old, new);
}
