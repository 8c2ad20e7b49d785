//! `rackfill serve --record-routing` bounded and hardened, end to end on the real binary: a byte
//! cap stops recording with whole steps on disk, a failed write (a full device) stops it too, both
//! flip the `rackfill:routing_trace_recording` gauge to 0, and `rackfill bench balance --trace`
//! replays a trace whose last line was cut short, saying so once.

mod common;

use common::{rackfill, Server, TempDir};
use std::path::Path;

const RECORDING: &str = "rackfill:routing_trace_recording";
const BYTES: &str = "rackfill:routing_trace_bytes_total";

/// Replays `trace` with `bench balance`; returns its stderr.
fn replays(trace: &Path) -> String {
    let out = rackfill(&[
        "bench",
        "balance",
        "--trace",
        trace.to_str().unwrap(),
        "--balancer",
        "quota",
    ]);
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(out.status.success(), "{err}");
    err
}

#[test]
fn a_byte_cap_stops_recording_with_whole_steps_on_disk() {
    let dir = TempDir::new("routing-trace-cap");
    let trace = dir.file("routing.jsonl");
    let server = Server::start(&[
        "--ep-size",
        "2",
        "--record-routing",
        trace.to_str().unwrap(),
        "--record-routing-max-bytes",
        "8K",
    ]);
    server.complete("Hello");
    assert_eq!(server.metric_when(RECORDING, |_| true), 1.0);
    // A few kilobytes per request at EP 2: the cap is hit within a few more.
    for _ in 0..20 {
        server.complete("Once upon a time the rack balanced every layer");
    }
    assert_eq!(server.metric_when(RECORDING, |v| v == 0.0), 0.0);
    let written = server.metric_when(BYTES, |v| v > 0.0);
    let size = std::fs::metadata(&trace).unwrap().len();
    assert!(size <= 8192, "{size} bytes");
    assert_eq!(written, size as f64);
    let text = std::fs::read_to_string(&trace).unwrap();
    assert!(text.ends_with('\n'));
    assert!(!replays(&trace).contains("warning"));
}

#[cfg(target_os = "linux")]
#[test]
fn a_failed_write_stops_recording_and_flips_the_gauge() {
    let server = Server::start(&["--ep-size", "2", "--record-routing", "/dev/full"]);
    server.complete("Hello");
    assert_eq!(server.metric_when(RECORDING, |v| v == 0.0), 0.0);
    // The server keeps serving.
    server.complete("Hello again");
}

#[test]
fn a_trace_cut_short_mid_line_replays_with_one_warning() {
    let dir = TempDir::new("routing-trace-cut");
    let trace = dir.file("cut.jsonl");
    let line = |step: u64, layer: usize| {
        format!(
            "{{\"step\":{step},\"layer\":{layer},\"ranks\":2,\"experts\":8,\
             \"load\":[[1,2,3,4,5,6,7,8],[8,7,6,5,4,3,2,1]]}}\n"
        )
    };
    let cut = line(2, 1);
    let text = [line(0, 0), line(0, 1), line(1, 0), line(1, 1), line(2, 0)].concat()
        + &cut[..cut.len() / 2];
    std::fs::write(&trace, text).unwrap();
    let out = rackfill(&["bench", "balance", "--trace", trace.to_str().unwrap()]);
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(out.status.success(), "{err}");
    let warnings: Vec<&str> = err.lines().filter(|l| l.starts_with("warning:")).collect();
    assert_eq!(warnings.len(), 1, "{err}");
    assert!(
        warnings[0].contains("line 6 is cut short") && warnings[0].contains("step 2"),
        "{err}"
    );
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(table.contains("2 steps x 2 layers"), "{table}");
}
