//! The printed tables of [`Summary`]s: vLLM's "Serving Benchmark Result" per run and one line
//! per rate for sweeps.

use std::fmt::Write as _;

use super::report::{percentile_label, LatencyStats, Summary};

/// vLLM's "Serving Benchmark Result" table.
pub fn format_table(s: &Summary) -> String {
    const WIDTH: usize = 50;
    let mut out = String::new();
    let _ = writeln!(out, "{:=^WIDTH$}", " Serving Benchmark Result ");
    let mut rows: Vec<(String, String)> = vec![
        (
            "Request rate (req/s)".into(),
            match (&s.request_rate, s.trace_speedup) {
                (Some(rate), _) => rate.to_string(),
                (None, Some(speedup)) => format!("trace x{speedup}"),
                (None, None) => "-".into(),
            },
        ),
        ("Successful requests".into(), s.completed.to_string()),
        ("Failed requests".into(), s.failed.to_string()),
    ];
    if let Some(c) = s.max_concurrency {
        rows.push(("Maximum request concurrency".into(), c.to_string()));
    }
    rows.extend([
        (
            "Benchmark duration (s)".into(),
            format!("{:.2}", s.duration),
        ),
        (
            "Total input tokens".into(),
            s.total_input_tokens.to_string(),
        ),
        (
            "Total generated tokens".into(),
            s.total_output_tokens.to_string(),
        ),
        (
            "Cached prompt tokens".into(),
            if s.cached_tokens_reported {
                s.total_cached_tokens.to_string()
            } else {
                "0 (none reported)".into()
            },
        ),
        (
            "Prefill tokens computed".into(),
            s.total_prefill_tokens_computed.to_string(),
        ),
        (
            "Prefix cache hit rate (%)".into(),
            format!("{:.2}", s.prefix_cache_hit_rate * 100.0),
        ),
        (
            "Request throughput (req/s)".into(),
            format!("{:.2}", s.request_throughput),
        ),
        (
            "Input token throughput (tok/s)".into(),
            format!("{:.2}", s.input_throughput),
        ),
        (
            "Output token throughput (tok/s)".into(),
            format!("{:.2}", s.output_throughput),
        ),
        (
            "Peak output token throughput (tok/s)".into(),
            format!("{:.2}", s.max_output_tokens_per_s),
        ),
        (
            "Peak concurrent requests".into(),
            s.max_concurrent_requests.to_string(),
        ),
        (
            "Total Token throughput (tok/s)".into(),
            format!("{:.2}", s.total_token_throughput),
        ),
    ]);
    let mut text = String::new();
    for (k, v) in rows {
        let _ = writeln!(text, "{:<40} {:<10}", format!("{k}:"), v);
    }
    out.push_str(&text);
    for (title, short, stats) in [
        ("Time to First Token", "TTFT", &s.ttft),
        ("Time per Output Token (excl. 1st token)", "TPOT", &s.tpot),
        ("Inter-token Latency", "ITL", &s.itl),
        ("End-to-end Latency", "E2EL", &s.e2el),
    ] {
        let _ = writeln!(out, "{:-^WIDTH$}", title);
        let mut line = |name: String, v: f64| {
            let _ = writeln!(out, "{:<40} {:<10.2}", format!("{name} {short} (ms):"), v);
        };
        line("Mean".into(), stats.mean);
        line("Median".into(), stats.median);
        for &(p, v) in &stats.percentiles {
            line(format!("P{}", percentile_label(p)), v);
        }
    }
    let _ = writeln!(out, "{}", "=".repeat(WIDTH));
    for sample in &s.error_samples {
        let _ = writeln!(out, "failed x{}: {}", sample.count, sample.message);
    }
    out
}

/// One line per rate, for sweeps.
pub fn format_sweep(summaries: &[Summary]) -> String {
    let top = |s: &LatencyStats| s.highest().map_or(f64::NAN, |(_, v)| v);
    let top_label = summaries
        .first()
        .and_then(|s| s.ttft.highest())
        .map_or("max".to_string(), |(p, _)| {
            format!("p{}", percentile_label(p))
        });
    let mut out = format!(
        "{:>8} {:>9} {:>6} {:>8} {:>10} {:>10} {:>10} {:>10} {:>10}\n",
        "rate",
        "completed",
        "failed",
        "req/s",
        "out tok/s",
        "mean TTFT",
        format!("{top_label} TTFT"),
        "mean TPOT",
        "mean E2EL"
    );
    for s in summaries {
        let rate = s
            .request_rate
            .map_or("trace".to_string(), |r| r.to_string());
        let _ = writeln!(
            out,
            "{:>8} {:>9} {:>6} {:>8.2} {:>10.1} {:>10.2} {:>10.2} {:>10.2} {:>10.2}",
            rate,
            s.completed,
            s.failed,
            s.request_throughput,
            s.output_throughput,
            s.ttft.mean,
            top(&s.ttft),
            s.tpot.mean,
            s.e2el.mean
        );
    }
    out
}
