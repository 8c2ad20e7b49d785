//! From a run's records to the summary vLLM's `benchmark_serving.py` reports (same field names,
//! same definitions), and to the "Serving Benchmark Result" table.
//!
//! Definitions (over completed requests): TTFT; TPOT = (e2el - ttft) / (output_tokens - 1) for
//! requests with more than one output token; ITL = every gap between chunks carrying text,
//! pooled over requests; e2el. Token counts come from the server's `usage` (the dataset's
//! estimate or the number of text chunks when it sent none). Throughputs divide by the run's
//! duration, first send to last response. Percentiles interpolate linearly (numpy's default);
//! `std` is the population standard deviation. Prefix caching: `total_cached_tokens` sums
//! OpenAI's `usage.prompt_tokens_details.cached_tokens` (0 where a server sends none), the
//! prompt tokens the server computed are the rest of `total_input_tokens`, and the hit rate is
//! the cached share of them.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

use super::arrivals::{Arrivals, RequestRate};
use super::runner::{RequestRecord, RunResult};

/// What a run was, for the summary.
#[derive(Debug, Clone)]
pub struct RunMeta {
    /// `openai` or `openai-chat`.
    pub backend: String,
    pub base_url: String,
    pub endpoint: String,
    pub model_id: String,
    pub tokenizer_id: Option<String>,
    /// `random`, `sharegpt`, `trace`, `multi-turn` or `eval`.
    pub dataset: String,
    pub arrivals: Arrivals,
    pub max_concurrency: Option<usize>,
}

/// Summary settings.
#[derive(Debug, Clone)]
pub struct ReportOptions {
    /// Percentiles (0, 100] reported besides the median (`p90_ttft_ms`, `p99.9_ttft_ms`, ...).
    pub percentiles: Vec<f64>,
    /// Adds the per-request arrays (`ttfts`, `itls`, ...).
    pub detailed: bool,
}

impl Default for ReportOptions {
    fn default() -> Self {
        Self {
            percentiles: vec![90.0, 99.0],
            detailed: false,
        }
    }
}

/// Mean, median, standard deviation and percentiles of one latency, milliseconds; NaN (null
/// in JSON) when there is nothing to measure.
#[derive(Debug, Clone, PartialEq)]
pub struct LatencyStats {
    pub mean: f64,
    pub median: f64,
    pub std: f64,
    /// `(percentile, value)` in the order asked for.
    pub percentiles: Vec<(f64, f64)>,
}

/// A distinct failure message and how many requests failed with it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ErrorSample {
    pub message: String,
    pub count: usize,
}

/// Per-request arrays (`--save-detailed`), in dataset order, over every sent request. Times
/// are seconds, as in vLLM's files; failed requests have a null TTFT and a non-empty error.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Detailed {
    pub input_lens: Vec<usize>,
    pub output_lens: Vec<usize>,
    /// Cached prompt tokens of each request (0 when failed or not reported).
    pub cached_tokens: Vec<usize>,
    pub ttfts: Vec<Option<f64>>,
    pub itls: Vec<Vec<f64>>,
    pub e2els: Vec<f64>,
    pub scheduled_times: Vec<f64>,
    pub send_times: Vec<f64>,
    pub errors: Vec<String>,
}

/// The result of one run (one request rate), as written to `--output`.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub backend: String,
    pub base_url: String,
    pub endpoint: String,
    pub model_id: String,
    pub tokenizer_id: Option<String>,
    pub dataset: String,
    /// Requests sent (fewer than the dataset when `--duration` cut the run short).
    pub num_prompts: usize,
    /// `null` for a trace replayed at its timestamps.
    pub request_rate: Option<RequestRate>,
    pub burstiness: Option<f64>,
    pub trace_speedup: Option<f64>,
    pub max_concurrency: Option<usize>,
    /// Seconds, first send to last response.
    pub duration: f64,
    pub completed: usize,
    pub failed: usize,
    pub total_input_tokens: usize,
    pub total_output_tokens: usize,
    /// Prompt tokens whose KV came from the server's prefix cache, over completed requests.
    pub total_cached_tokens: usize,
    /// `total_input_tokens - total_cached_tokens`: the prompt tokens the server computed.
    pub total_prefill_tokens_computed: usize,
    /// `total_cached_tokens / total_input_tokens`; NaN (null) without input tokens.
    pub prefix_cache_hit_rate: f64,
    /// Whether any response reported cached tokens (the table says when none did).
    #[serde(skip)]
    pub cached_tokens_reported: bool,
    pub request_throughput: f64,
    pub input_throughput: f64,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    /// Most output chunks received within one wall-clock second of the run.
    pub max_output_tokens_per_s: f64,
    /// Most requests in flight at once.
    pub max_concurrent_requests: usize,
    #[serde(skip)]
    pub ttft: LatencyStats,
    #[serde(skip)]
    pub tpot: LatencyStats,
    #[serde(skip)]
    pub itl: LatencyStats,
    #[serde(skip)]
    pub e2el: LatencyStats,
    /// `mean_ttft_ms`, `median_ttft_ms`, `std_ttft_ms`, `p99_ttft_ms`, ... for ttft, tpot, itl
    /// and e2el (the same numbers as the typed fields above).
    #[serde(flatten)]
    pub latency_fields: BTreeMap<String, f64>,
    /// Up to five distinct failure messages, most frequent first.
    pub error_samples: Vec<ErrorSample>,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub detailed: Option<Detailed>,
}

const MAX_ERROR_SAMPLES: usize = 5;

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

impl Summary {
    /// Summarizes `run`.
    pub fn new(run: &RunResult, meta: &RunMeta, options: &ReportOptions) -> Self {
        let ok: Vec<&RequestRecord> = run
            .records
            .iter()
            .filter(|r| r.outcome.error.is_none())
            .collect();
        let input_tokens = |r: &RequestRecord| r.outcome.prompt_tokens.unwrap_or(r.input_len);
        let output_tokens =
            |r: &RequestRecord| r.outcome.completion_tokens.unwrap_or(r.outcome.text_chunks);
        let cached_tokens = |r: &RequestRecord| {
            let cached = r.outcome.cached_tokens.unwrap_or(0).min(input_tokens(r));
            if r.outcome.error.is_none() {
                cached
            } else {
                0
            }
        };
        let ttfts: Vec<f64> = ok.iter().map(|r| ms(ttft_of(r))).collect();
        let e2els: Vec<f64> = ok.iter().map(|r| ms(r.outcome.e2el)).collect();
        let tpots: Vec<f64> = ok
            .iter()
            .filter(|r| output_tokens(r) > 1)
            .map(|r| ms(r.outcome.e2el.saturating_sub(ttft_of(r))) / (output_tokens(r) - 1) as f64)
            .collect();
        let itls: Vec<f64> = ok
            .iter()
            .flat_map(|r| r.outcome.itls.iter().map(|&d| ms(d)))
            .collect();
        let stats = |values: &[f64]| LatencyStats::of(values, &options.percentiles);
        let (ttft, tpot, itl, e2el) = (stats(&ttfts), stats(&tpots), stats(&itls), stats(&e2els));
        let mut latency_fields = BTreeMap::new();
        for (name, s) in [
            ("ttft", &ttft),
            ("tpot", &tpot),
            ("itl", &itl),
            ("e2el", &e2el),
        ] {
            latency_fields.insert(format!("mean_{name}_ms"), s.mean);
            latency_fields.insert(format!("median_{name}_ms"), s.median);
            latency_fields.insert(format!("std_{name}_ms"), s.std);
            for &(p, v) in &s.percentiles {
                latency_fields.insert(format!("p{}_{name}_ms", percentile_label(p)), v);
            }
        }
        let total_input_tokens: usize = ok.iter().map(|r| input_tokens(r)).sum();
        let total_output_tokens: usize = ok.iter().map(|r| output_tokens(r)).sum();
        let total_cached_tokens: usize = ok.iter().map(|r| cached_tokens(r)).sum();
        let seconds = run.duration.as_secs_f64().max(f64::MIN_POSITIVE);
        let (request_rate, burstiness, trace_speedup) = match meta.arrivals {
            Arrivals::Rate { rate, burstiness } => (Some(rate), Some(burstiness), None),
            Arrivals::Replay { speedup } => (None, None, Some(speedup)),
        };
        let detailed = options.detailed.then(|| Detailed {
            input_lens: run.records.iter().map(input_tokens).collect(),
            output_lens: run
                .records
                .iter()
                .map(|r| {
                    if r.outcome.error.is_none() {
                        output_tokens(r)
                    } else {
                        0
                    }
                })
                .collect(),
            cached_tokens: run.records.iter().map(cached_tokens).collect(),
            ttfts: run
                .records
                .iter()
                .map(|r| r.outcome.error.is_none().then(|| ttft_of(r).as_secs_f64()))
                .collect(),
            itls: run
                .records
                .iter()
                .map(|r| r.outcome.itls.iter().map(Duration::as_secs_f64).collect())
                .collect(),
            e2els: run
                .records
                .iter()
                .map(|r| r.outcome.e2el.as_secs_f64())
                .collect(),
            scheduled_times: run
                .records
                .iter()
                .map(|r| r.scheduled.as_secs_f64())
                .collect(),
            send_times: run.records.iter().map(|r| r.sent.as_secs_f64()).collect(),
            errors: run
                .records
                .iter()
                .map(|r| r.outcome.error.clone().unwrap_or_default())
                .collect(),
        });
        Self {
            backend: meta.backend.clone(),
            base_url: meta.base_url.clone(),
            endpoint: meta.endpoint.clone(),
            model_id: meta.model_id.clone(),
            tokenizer_id: meta.tokenizer_id.clone(),
            dataset: meta.dataset.clone(),
            num_prompts: run.records.len(),
            request_rate,
            burstiness,
            trace_speedup,
            max_concurrency: meta.max_concurrency,
            duration: run.duration.as_secs_f64(),
            completed: ok.len(),
            failed: run.records.len() - ok.len(),
            total_input_tokens,
            total_output_tokens,
            total_cached_tokens,
            total_prefill_tokens_computed: total_input_tokens - total_cached_tokens,
            prefix_cache_hit_rate: total_cached_tokens as f64 / total_input_tokens as f64,
            cached_tokens_reported: ok.iter().any(|r| r.outcome.cached_tokens.is_some()),
            request_throughput: ok.len() as f64 / seconds,
            input_throughput: total_input_tokens as f64 / seconds,
            output_throughput: total_output_tokens as f64 / seconds,
            total_token_throughput: (total_input_tokens + total_output_tokens) as f64 / seconds,
            max_output_tokens_per_s: peak_chunks_per_second(&ok),
            max_concurrent_requests: peak_in_flight(&run.records),
            ttft,
            tpot,
            itl,
            e2el,
            latency_fields,
            error_samples: error_samples(&run.records),
            detailed,
        }
    }
}

/// TTFT of a completed request (its end when no chunk carried text).
fn ttft_of(r: &RequestRecord) -> Duration {
    r.outcome.ttft.unwrap_or(r.outcome.e2el)
}

/// `99` for 99.0, `99.9` for 99.9 (vLLM's field names).
pub fn percentile_label(p: f64) -> String {
    if p.fract() == 0.0 {
        format!("{}", p as u64)
    } else {
        format!("{p}")
    }
}

impl LatencyStats {
    /// The highest percentile asked for and its value (whatever order they were asked in).
    pub fn highest(&self) -> Option<(f64, f64)> {
        self.percentiles
            .iter()
            .copied()
            .max_by(|a, b| a.0.total_cmp(&b.0))
    }

    /// Statistics of `values` (milliseconds).
    pub fn of(values: &[f64], percentiles: &[f64]) -> Self {
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len() as f64;
        let mean = sorted.iter().sum::<f64>() / n;
        let std = (sorted.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n).sqrt();
        Self {
            mean,
            median: percentile(&sorted, 50.0),
            std,
            percentiles: percentiles
                .iter()
                .map(|&p| (p, percentile(&sorted, p)))
                .collect(),
        }
    }
}

/// numpy's linear percentile of sorted values; NaN when empty.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    match sorted.len() {
        0 => f64::NAN,
        n => {
            let rank = (p / 100.0).clamp(0.0, 1.0) * (n - 1) as f64;
            let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
            sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
        }
    }
}

fn peak_chunks_per_second(ok: &[&RequestRecord]) -> f64 {
    let mut per_second: BTreeMap<u64, usize> = BTreeMap::new();
    for r in ok {
        let Some(ttft) = r.outcome.ttft else { continue };
        let mut t = r.sent + ttft;
        *per_second.entry(t.as_secs()).or_default() += 1;
        for &gap in &r.outcome.itls {
            t += gap;
            *per_second.entry(t.as_secs()).or_default() += 1;
        }
    }
    per_second.values().copied().max().unwrap_or(0) as f64
}

fn peak_in_flight(records: &[RequestRecord]) -> usize {
    let mut events: Vec<(Duration, i64)> = records
        .iter()
        .flat_map(|r| [(r.sent, 1), (r.sent + r.outcome.e2el, -1)])
        .collect();
    // Ends before starts at the same instant.
    events.sort_by_key(|&(t, delta)| (t, delta));
    let (mut now, mut peak) = (0i64, 0i64);
    for (_, delta) in events {
        now += delta;
        peak = peak.max(now);
    }
    peak as usize
}

fn error_samples(records: &[RequestRecord]) -> Vec<ErrorSample> {
    let mut samples: Vec<ErrorSample> = Vec::new();
    for message in records.iter().filter_map(|r| r.outcome.error.as_ref()) {
        match samples.iter_mut().find(|s| &s.message == message) {
            Some(sample) => sample.count += 1,
            None => samples.push(ErrorSample {
                message: message.clone(),
                count: 1,
            }),
        }
    }
    samples.sort_by_key(|s| std::cmp::Reverse(s.count));
    samples.truncate(MAX_ERROR_SAMPLES);
    samples
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::client::Outcome;
    use crate::serve::table::{format_sweep, format_table};

    #[test]
    fn percentiles_match_numpy() {
        let v = [1.0, 2.0, 3.0, 4.0, 10.0];
        assert_eq!(percentile(&v, 50.0), 3.0);
        assert!((percentile(&v, 90.0) - 7.6).abs() < 1e-12);
        assert_eq!(percentile(&v, 100.0), 10.0);
        assert!(percentile(&[], 50.0).is_nan());
        let s = LatencyStats::of(&[4.0, 2.0], &[99.0]);
        assert_eq!((s.mean, s.median, s.std), (3.0, 3.0, 1.0));
        assert_eq!(percentile_label(99.9), "99.9");
        assert_eq!(percentile_label(90.0), "90");
        // The highest percentile, not the last one asked for.
        let s = LatencyStats::of(&[1.0, 2.0, 3.0], &[99.0, 50.0]);
        assert_eq!(s.highest().map(|(p, _)| p), Some(99.0));
    }

    /// A random-dataset run at an infinite rate against a stand-in URL.
    fn meta(max_concurrency: Option<usize>) -> RunMeta {
        RunMeta {
            backend: "openai".into(),
            base_url: "http://x".into(),
            endpoint: "/v1/completions".into(),
            model_id: "m".into(),
            tokenizer_id: None,
            dataset: "random".into(),
            arrivals: Arrivals::Rate {
                rate: RequestRate::Infinite,
                burstiness: 1.0,
            },
            max_concurrency,
        }
    }

    #[test]
    fn the_sweep_shows_the_highest_percentile_asked_for() {
        let meta = meta(None);
        let options = ReportOptions {
            percentiles: vec![99.0, 50.0],
            detailed: false,
        };
        let run = RunResult {
            records: vec![record(0, 0, 100, &[], None), record(1, 0, 300, &[], None)],
            duration: Duration::from_secs(1),
        };
        let s = Summary::new(&run, &meta, &options);
        let sweep = format_sweep(&[s]);
        let header = sweep.lines().next().unwrap();
        assert!(header.contains("p99 TTFT"), "{sweep}");
        // p99 of 100 and 300 ms, not the median (200).
        assert!(sweep.lines().nth(1).unwrap().contains("298.00"), "{sweep}");
    }

    fn record(
        index: usize,
        sent_ms: u64,
        ttft_ms: u64,
        itls_ms: &[u64],
        error: Option<&str>,
    ) -> RequestRecord {
        let itls: Vec<Duration> = itls_ms.iter().map(|&m| Duration::from_millis(m)).collect();
        let e2el = Duration::from_millis(ttft_ms + itls_ms.iter().sum::<u64>());
        RequestRecord {
            index,
            scheduled: Duration::from_millis(sent_ms),
            sent: Duration::from_millis(sent_ms),
            input_len: 10,
            output_len: 3,
            outcome: Outcome {
                ttft: Some(Duration::from_millis(ttft_ms)),
                text_chunks: itls.len() + 1,
                prompt_tokens: error.is_none().then_some(12),
                completion_tokens: None,
                cached_tokens: error.is_none().then_some(5),
                logprob_positions: 0,
                text: None,
                itls,
                e2el,
                kv_transfer_params: None,
                error: error.map(String::from),
            },
        }
    }

    #[test]
    fn summary_follows_the_vllm_definitions() {
        let run = RunResult {
            records: vec![
                record(0, 0, 100, &[10, 30], None),
                record(1, 50, 200, &[20], None),
                record(2, 60, 5, &[], Some("HTTP 400: too long")),
                record(3, 61, 5, &[], Some("HTTP 400: too long")),
            ],
            duration: Duration::from_secs(2),
        };
        let meta = meta(Some(2));
        let options = ReportOptions {
            percentiles: vec![50.0, 99.0],
            detailed: true,
        };
        let s = Summary::new(&run, &meta, &options);
        assert_eq!((s.completed, s.failed, s.num_prompts), (2, 2, 4));
        assert_eq!((s.total_input_tokens, s.total_output_tokens), (24, 5));
        assert_eq!(
            (s.total_cached_tokens, s.total_prefill_tokens_computed),
            (10, 14)
        );
        assert_eq!(s.prefix_cache_hit_rate, 10.0 / 24.0);
        assert_eq!(s.request_throughput, 1.0);
        assert_eq!(s.total_token_throughput, 14.5);
        assert_eq!(s.ttft.mean, 150.0);
        // TPOT: (140 - 100) / 2 and (220 - 200) / 1.
        assert_eq!(s.tpot.mean, 20.0);
        assert_eq!(s.itl.mean, 20.0);
        assert_eq!(s.e2el.mean, 180.0);
        assert_eq!(s.max_concurrent_requests, 4);
        assert_eq!(s.max_output_tokens_per_s, 5.0);
        assert_eq!(
            s.error_samples,
            [ErrorSample {
                message: "HTTP 400: too long".into(),
                count: 2
            }]
        );
        let json = serde_json::to_value(&s).unwrap();
        for key in [
            "completed",
            "failed",
            "duration",
            "request_throughput",
            "input_throughput",
            "output_throughput",
            "total_token_throughput",
            "total_cached_tokens",
            "total_prefill_tokens_computed",
            "prefix_cache_hit_rate",
            "cached_tokens",
            "mean_ttft_ms",
            "median_ttft_ms",
            "std_ttft_ms",
            "p50_ttft_ms",
            "p99_ttft_ms",
            "mean_tpot_ms",
            "p99_itl_ms",
            "median_e2el_ms",
            "ttfts",
            "itls",
            "input_lens",
            "output_lens",
            "errors",
        ] {
            assert!(json.get(key).is_some(), "{key} missing: {json}");
        }
        assert_eq!(json["request_rate"], "inf");
        assert_eq!(json["ttfts"][2], serde_json::Value::Null);
        assert_eq!(json["errors"][3], "HTTP 400: too long");
        let table = format_table(&s);
        assert!(table.contains("Successful requests:"), "{table}");
        assert!(table.contains("P99 TTFT (ms):"), "{table}");
        assert!(
            table.contains("Cached prompt tokens:                    10"),
            "{table}"
        );
        assert!(
            table.contains("Prefix cache hit rate (%):               41.67"),
            "{table}"
        );
        assert!(table.contains("failed x2: HTTP 400: too long"), "{table}");
        let empty = Summary::new(
            &RunResult {
                records: vec![],
                duration: Duration::ZERO,
            },
            &meta,
            &options,
        );
        assert!(empty.ttft.mean.is_nan());
        assert!(format_table(&empty).contains("0 (none reported)"));
        assert_eq!(
            serde_json::to_value(&empty).unwrap()["mean_ttft_ms"],
            serde_json::Value::Null
        );
        assert!(format_sweep(&[s, empty]).lines().count() == 3);
    }
}
