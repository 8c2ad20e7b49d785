//! `rackfill bench serve` on bad input: exit 2 with one `error:` line before anything is sent,
//! so a flag that cannot work is reported at once rather than after a warm-up request or a run
//! that may take hours. Every case names an endpoint nobody listens on: the flag's own error
//! must come before the connection's. Then the prefix-caching workloads against a real
//! `rackfill serve` on the built-in model: a generated shared-prefix trace, multi-turn
//! conversations and evaluation-harness scoring, each kept to a few hundred prompt tokens (the
//! test binary is a debug build).

mod common;

use common::{json_report, rackfill, Server, TempDir};
use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;

/// A fresh directory for one test (`name`), under the system's temporary directory.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "rackfill-cli-bench-serve-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Exit 2 and exactly one stderr line, `error: ...` containing `want`.
fn refused(args: &[&str], want: &str) {
    let mut all = vec!["bench", "serve", "--base-url", "http://127.0.0.1:9"];
    all.extend_from_slice(args);
    let out = rackfill(&all);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert!(out.stdout.is_empty(), "{args:?}: printed a report");
    assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
    assert!(err.starts_with("error: "), "{args:?}: {err}");
    assert!(err.contains(want), "{args:?}: {err} lacks {want}");
}

#[test]
fn arrival_settings_are_checked_before_connecting() {
    refused(
        &["--burstiness", "0"],
        "--burstiness must be a positive number",
    );
    refused(
        &["--burstiness", "nan", "--request-rate", "1,2"],
        "--burstiness must be a positive number",
    );
    refused(
        &["--request-rate", "1e-30", "--num-prompts", "3"],
        "too late to schedule",
    );
}

#[test]
fn huge_times_are_refused_not_a_panic() {
    for flag in ["--request-timeout", "--duration"] {
        for value in ["1e300", "1.5e19", "2e9"] {
            refused(&[flag, value], "must be at most");
        }
    }
}

#[test]
fn trace_speedup_is_checked_and_only_taken_by_a_replay() {
    let dir = temp_dir("trace");
    let trace = dir.join("t.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 4, \"output_length\": 1}\n\
         {\"timestamp\": 10, \"input_length\": 4, \"output_length\": 1}\n",
    )
    .unwrap();
    let trace = trace.to_str().unwrap();
    let replay = ["--dataset", "trace", "--dataset-path", trace];
    for bad in ["0", "inf"] {
        let mut args = replay.to_vec();
        args.extend(["--trace-speedup", bad]);
        refused(&args, "--trace-speedup must be a positive number");
    }
    let mut retimed = replay.to_vec();
    retimed.extend(["--retime", "--trace-speedup", "2"]);
    refused(&retimed, "--trace-speedup applies to a trace replayed");
    refused(
        &["--trace-speedup", "2"],
        "--trace-speedup applies to a trace replayed",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn output_paths_are_checked_before_the_run() {
    let dir = temp_dir("output");
    let missing = dir.join("no-such-dir");
    let output = missing.join("out.json");
    refused(&["--output", output.to_str().unwrap()], "does not exist");
    refused(&["--output", dir.to_str().unwrap()], "is a directory");
    let prefix = missing.join("sweep");
    refused(
        &["--plot-prefix", prefix.to_str().unwrap()],
        "does not exist",
    );
    // Good paths get as far as the connection.
    let good = dir.join("out.json");
    let out = rackfill(&[
        "bench",
        "serve",
        "--base-url",
        "http://127.0.0.1:9",
        "--output",
        good.to_str().unwrap(),
        "--plot-prefix",
        dir.join("sweep").to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("error: cannot reach"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A tiny OpenAI-like endpoint on a loopback port: `GET /v1/models` lists `m`, and every
/// completion streams 40 chunks of text 50 ms apart (2 s) with a final `[DONE]`.
fn slow_endpoint() -> String {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut request_line = String::new();
                let _ = reader.read_line(&mut request_line);
                let mut length = 0usize;
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                        break;
                    }
                    let lower = line.to_ascii_lowercase();
                    if let Some(v) = lower.strip_prefix("content-length:") {
                        length = v.trim().parse().unwrap_or(0);
                    }
                }
                let mut body = vec![0u8; length];
                let _ = reader.read_exact(&mut body);
                let mut out = stream;
                if request_line.starts_with("GET") {
                    let json = r#"{"object": "list", "data": [{"id": "m"}]}"#;
                    let _ = write!(
                        out,
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
                         content-length: {}\r\nconnection: close\r\n\r\n{json}",
                        json.len()
                    );
                    return;
                }
                let _ = write!(
                    out,
                    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
                );
                for _ in 0..40 {
                    let event = "data: {\"choices\": [{\"index\": 0, \"text\": \" x\"}]}\n\n";
                    if out.write_all(event.as_bytes()).is_err() {
                        return;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                let _ = out.write_all(b"data: [DONE]\n\n");
            });
        }
    });
    base
}

#[test]
fn the_first_ctrl_c_keeps_the_results_so_far() {
    let base = slow_endpoint();
    let dir = temp_dir("ctrl-c");
    let output = dir.join("out.json");
    let mut child = Command::new(env!("CARGO_BIN_EXE_rackfill"))
        .args([
            "bench",
            "serve",
            "--base-url",
            &base,
            "--no-warmup",
            "--num-prompts",
            "100",
            "--random-input-len",
            "4",
            "--request-rate",
            "10,20",
            "--output",
            output.to_str().unwrap(),
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Interrupt once the run has started (the note before it is on stderr) and sent a little.
    let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    while !seen.contains("bench serve: 100 requests") {
        let mut line = String::new();
        use std::io::BufRead as _;
        assert!(stderr.read_line(&mut line).unwrap() > 0, "{seen}");
        seen += &line;
    }
    let rest = std::thread::spawn(move || {
        let mut text = String::new();
        use std::io::Read as _;
        let _ = stderr.read_to_string(&mut text);
        text
    });
    std::thread::sleep(std::time::Duration::from_millis(700));
    let killed = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = seen + &rest.join().unwrap();
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("interrupted"), "{stderr}");
    // One table (the second rate never started), covering what was sent.
    assert_eq!(
        stdout.matches("Serving Benchmark Result").count(),
        1,
        "{stdout}"
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&output).unwrap()).unwrap();
    let sent = report["num_prompts"].as_u64().unwrap();
    assert!((1..100).contains(&sent), "{report}");
    assert_eq!(report["completed"].as_u64(), Some(sent), "{report}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn prefix_workload_flags_are_checked_before_connecting() {
    for dataset in ["multi-turn", "eval"] {
        refused(
            &["--dataset", dataset, "--endpoint", "/v1/chat/completions"],
            "chat endpoints are not supported",
        );
        refused(
            &["--dataset", dataset, "--dataset-path", "x.jsonl"],
            "--dataset-path is for --dataset sharegpt or trace",
        );
    }
    refused(
        &["--dataset", "multi-turn", "--multi-turn-turns", "0"],
        "must be at least 1",
    );
    refused(
        &["--dataset", "eval", "--eval-continuations", "0"],
        "must be at least 1",
    );
    let dir = TempDir::new("bench-serve-trace-flags");
    let out = dir.file("t.jsonl");
    for (flag, value, want) in [
        (
            "--shared-fraction",
            "1.5",
            "--shared-fraction must be in [0, 1]",
        ),
        ("--rate", "0", "--rate must be a positive number"),
        ("--zipf", "nan", "--zipf must be a non-negative number"),
        ("--requests", "0", "must be at least 1"),
    ] {
        let run = rackfill(&[
            "bench",
            "serve-trace",
            "--out",
            out.to_str().unwrap(),
            flag,
            value,
        ]);
        let err = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(2), "{flag} {value}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.starts_with("error: ") && err.contains(want), "{err}");
        assert!(!out.exists());
    }
}

/// The prefix-cache fields of a report: present, and the computed tokens are the prompt tokens
/// the cache did not supply (whether or not the server reports cached tokens).
fn check_cache_fields(report: &Value) {
    let field = |key: &str| {
        report[key]
            .as_u64()
            .unwrap_or_else(|| panic!("{key} missing: {report}"))
    };
    let (prompt, cached) = (field("total_input_tokens"), field("total_cached_tokens"));
    assert_eq!(field("total_prefill_tokens_computed"), prompt - cached);
    let rate = report["prefix_cache_hit_rate"].as_f64().unwrap();
    assert!(
        (rate - cached as f64 / prompt as f64).abs() < 1e-12,
        "{report}"
    );
}

/// `bench serve` with `args` against `server`, which must succeed; its JSON report.
fn bench(server: &Server, dir: &TempDir, args: &[&str]) -> Value {
    let report = dir.file("report.json");
    let base = format!("http://{}", server.addr());
    let mut all = vec!["bench", "serve", "--base-url", &base, "--no-progress"];
    all.extend_from_slice(args);
    all.extend(["--output", report.to_str().unwrap()]);
    let value = json_report(&all, &report);
    check_cache_fields(&value);
    value
}

fn numbers(report: &Value, key: &str) -> Vec<f64> {
    let list = report[key]
        .as_array()
        .unwrap_or_else(|| panic!("{key}: {report}"));
    list.iter().map(|v| v.as_f64().unwrap()).collect()
}

#[test]
fn a_generated_prefix_trace_shares_prefixes_follows_its_seed_and_replays() {
    let dir = TempDir::new("bench-serve-prefix-trace");
    let generate = |name: &str, seed: &str| {
        let path = dir.file(name);
        let out = rackfill(&[
            "bench",
            "serve-trace",
            "--out",
            path.to_str().unwrap(),
            "--requests",
            "30",
            "--block-size",
            "4",
            "--input-len",
            "20",
            "--output-len",
            "2",
            "--prefixes",
            "3",
            "--rate",
            "100",
            "--seed",
            seed,
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        assert!(err.contains("replay with: rackfill bench serve"), "{err}");
        std::fs::read_to_string(path).unwrap()
    };
    let trace = generate("a.jsonl", "3");
    assert_eq!(trace, generate("b.jsonl", "3"), "one seed, one trace");
    assert_ne!(trace, generate("c.jsonl", "4"));
    let lines: Vec<Value> = trace
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 30);
    let ids = |l: &Value| -> Vec<u64> {
        let list = l["hash_ids"].as_array().unwrap();
        list.iter().map(|v| v.as_u64().unwrap()).collect()
    };
    let mut tails = std::collections::HashSet::new();
    let mut opening = std::collections::HashMap::<u64, usize>::new();
    let mut last_timestamp = 0;
    for line in &lines {
        let input = line["input_length"].as_u64().unwrap();
        let ids = ids(line);
        // One hash id per 4-token block, the last one the request's own.
        assert_eq!(ids.len() as u64, input.div_ceil(4), "{line}");
        assert!(tails.insert(*ids.last().unwrap()), "{line}");
        *opening.entry(ids[0]).or_default() += 1;
        let timestamp = line["timestamp"].as_u64().unwrap();
        assert!(timestamp >= last_timestamp);
        last_timestamp = timestamp;
    }
    // Three shared prefixes open (nearly) every request, the most popular most of them.
    let shared: Vec<usize> = opening.values().copied().filter(|&n| n > 1).collect();
    assert!(
        shared.len() <= 3 && shared.iter().sum::<usize>() >= 25,
        "{opening:?}"
    );
    assert!(*shared.iter().max().unwrap() >= 12, "{opening:?}");

    let server = Server::start(&[]);
    let path = dir.file("a.jsonl");
    let report = bench(
        &server,
        &dir,
        &[
            "--dataset",
            "trace",
            "--dataset-path",
            path.to_str().unwrap(),
            "--block-size",
            "4",
        ],
    );
    assert_eq!(report["dataset"], "trace");
    assert_eq!(
        (report["completed"].as_u64(), report["failed"].as_u64()),
        (Some(30), Some(0))
    );
    let prompt: u64 = lines
        .iter()
        .map(|l| l["input_length"].as_u64().unwrap())
        .sum();
    assert_eq!(report["total_input_tokens"].as_u64(), Some(prompt));
}

#[test]
fn multi_turn_prompts_resend_the_conversation_turn_after_turn() {
    let server = Server::start(&[]);
    let dir = TempDir::new("bench-serve-multi-turn");
    let report = bench(
        &server,
        &dir,
        &[
            "--dataset",
            "multi-turn",
            "--num-prompts",
            "2",
            "--multi-turn-turns",
            "3",
            "--multi-turn-system-len",
            "16",
            "--multi-turn-user-len",
            "4",
            "--multi-turn-output-len",
            "3",
            "--ignore-eos",
            "--save-detailed",
        ],
    );
    assert_eq!(report["dataset"], "multi-turn");
    assert_eq!(
        (report["completed"].as_u64(), report["failed"].as_u64()),
        (Some(6), Some(0))
    );
    let inputs = numbers(&report, "input_lens");
    let sends = numbers(&report, "send_times");
    let ends: Vec<f64> = sends
        .iter()
        .zip(numbers(&report, "e2els"))
        .map(|(s, e)| s + e)
        .collect();
    for conversation in inputs.chunks(3).zip(sends.chunks(3)).zip(ends.chunks(3)) {
        let ((inputs, sends), ends) = conversation;
        // System prompt and first user message, then each turn adds the reply and 4 tokens.
        assert_eq!(inputs[0], 20.0, "{report}");
        for k in 1..3 {
            assert!(inputs[k] > inputs[k - 1] + 4.0, "{inputs:?}");
            assert!(
                sends[k] >= ends[k - 1],
                "turn {k} sent before turn {} ended",
                k - 1
            );
        }
    }
}

#[test]
fn eval_requests_score_every_continuation_of_a_context() {
    let server = Server::start(&[]);
    let dir = TempDir::new("bench-serve-eval");
    // A response without the echoed prompt's logprobs fails its request, so none failing
    // means every request got them.
    let report = bench(
        &server,
        &dir,
        &[
            "--dataset",
            "eval",
            "--num-prompts",
            "2",
            "--eval-context-len",
            "16",
            "--eval-continuation-len",
            "4",
            "--save-detailed",
        ],
    );
    assert_eq!(report["dataset"], "eval");
    assert_eq!(
        (report["completed"].as_u64(), report["failed"].as_u64()),
        (Some(8), Some(0))
    );
    assert!(
        numbers(&report, "input_lens").iter().all(|&n| n == 20.0),
        "{report}"
    );
    assert_eq!(report["total_output_tokens"].as_u64(), Some(0));
}
