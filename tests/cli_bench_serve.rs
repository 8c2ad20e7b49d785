//! `rackfill bench serve` on bad input: exit 2 with one `error:` line before anything is sent,
//! so a flag that cannot work is reported at once rather than after a warm-up request or a run
//! that may take hours. Every case names an endpoint nobody listens on: the flag's own error
//! must come before the connection's.

mod common;

use common::rackfill;
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
