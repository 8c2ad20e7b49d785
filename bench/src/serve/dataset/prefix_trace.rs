//! A synthetic request trace with the prefix-sharing structure of Mooncake's production trace
//! (Kimi's, published with the Mooncake paper), written in the JSONL format
//! [`load_trace`](super::load_trace) replays: `{"timestamp": ms, "input_length": n,
//! "output_length": m, "hash_ids": [...]}`, one hash id per prompt block.
//!
//! The structure, as in the Mooncake trace: a request's prompt begins with the leading blocks of
//! one of a few shared prefixes (system prompts, documents), picked with a Zipf popularity skew,
//! and ends with blocks no other request has; arrivals are a Poisson process. Two requests on
//! the same prefix share the shorter one's part of it, so an unbounded prefix cache hits on about
//! `shared_fraction` of all blocks, less each prefix block's first use. Every statistic is
//! a parameter, so the defaults (scaled down for a small model, see `docs/bench-serve.md`) can be
//! set back to the production trace's.

use std::collections::HashSet;
use std::io::Write;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Exp};
use serde::Serialize;

use super::DatasetError;

/// What to generate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefixTraceParams {
    pub requests: usize,
    /// Tokens per hash id (the `--block-size` the trace must be replayed with).
    pub block_size: usize,
    /// Mean prompt tokens; prompts are uniform in `[len * (1 - r), len * (1 + r)]`.
    pub input_len: usize,
    pub input_range_ratio: f64,
    /// Mean `max_tokens`, uniform likewise.
    pub output_len: usize,
    pub output_range_ratio: f64,
    /// The share of each prompt's blocks, in `[0, 1]`, that are the leading blocks of a shared
    /// prefix (rounded to whole blocks; at least one token of each prompt is its own).
    pub shared_fraction: f64,
    /// Distinct shared prefixes.
    pub prefixes: usize,
    /// Zipf exponent of the prefixes' popularity: prefix `k` (from 0) is picked with weight
    /// `1 / (k + 1)^zipf`; 0 is uniform.
    pub zipf: f64,
    /// Mean requests per second of the Poisson arrivals.
    pub rate: f64,
}

/// One line of the trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TraceLine {
    /// Milliseconds from the first request.
    pub timestamp: u64,
    pub input_length: usize,
    pub output_length: usize,
    pub hash_ids: Vec<u64>,
}

/// What a trace holds, in the terms the Mooncake paper describes its trace by.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TraceStats {
    pub requests: usize,
    pub mean_input_len: f64,
    pub mean_output_len: f64,
    /// Hash ids over all requests.
    pub blocks: usize,
    /// Share of `blocks` whose hash id an earlier request already named: the block hit rate of
    /// an unbounded prefix cache.
    pub reusable_fraction: f64,
    /// Timestamp of the last request, seconds.
    pub span_s: f64,
}

/// The trace of `params`, deterministic in `seed`.
pub fn generate(params: &PrefixTraceParams, seed: u64) -> Result<Vec<TraceLine>, DatasetError> {
    check(params)?;
    let mut rng = StdRng::seed_from_u64(seed);
    let block = params.block_size;
    // Prefix k's blocks get hash ids as requests first reach them; tails take fresh ids.
    let prefix_count = if params.shared_fraction > 0.0 {
        params.prefixes
    } else {
        0
    };
    let mut prefixes: Vec<Vec<u64>> = vec![Vec::new(); prefix_count];
    let mut next_id = 0u64;
    let popularity: Vec<f64> = (0..prefix_count)
        .scan(0.0, |total, k| {
            *total += 1.0 / ((k + 1) as f64).powf(params.zipf);
            Some(*total)
        })
        .collect();
    let gaps = Exp::new(params.rate / 1000.0)
        .map_err(|_| DatasetError::Invalid(format!("bad --rate {}", params.rate)))?;
    let mut t_ms = 0.0f64;
    let mut lines = Vec::with_capacity(params.requests);
    for i in 0..params.requests {
        if i > 0 {
            t_ms += gaps.sample(&mut rng);
        }
        let input_length = uniform(&mut rng, params.input_len, params.input_range_ratio);
        let output_length = uniform(&mut rng, params.output_len, params.output_range_ratio);
        let blocks = input_length.div_ceil(block);
        let mut hash_ids = match popularity.last() {
            Some(&total) => {
                let u = rng.gen_range(0.0..total);
                let k = popularity
                    .partition_point(|&c| c <= u)
                    .min(prefix_count - 1);
                // The leading blocks of the prefix, leaving at least one token of the request's
                // own.
                let shared = ((params.shared_fraction * blocks as f64).round() as usize)
                    .min((input_length - 1) / block);
                let prefix = &mut prefixes[k];
                while prefix.len() < shared {
                    prefix.push(next_id);
                    next_id += 1;
                }
                prefix[..shared].to_vec()
            }
            None => Vec::new(),
        };
        while hash_ids.len() < blocks {
            hash_ids.push(next_id);
            next_id += 1;
        }
        lines.push(TraceLine {
            timestamp: t_ms.round() as u64,
            input_length,
            output_length,
            hash_ids,
        });
    }
    Ok(lines)
}

/// Longest mean prompt or output, tokens.
const MAX_LEN: usize = 10_000_000;

fn check(p: &PrefixTraceParams) -> Result<(), DatasetError> {
    let bad = |message: String| Err(DatasetError::Invalid(message));
    if p.requests == 0 || p.block_size == 0 || p.input_len == 0 || p.output_len == 0 {
        return bad(
            "--requests, --block-size, --input-len and --output-len must be at least 1".into(),
        );
    }
    if p.input_len.max(p.output_len) > MAX_LEN {
        return bad(format!(
            "--input-len and --output-len must be at most {MAX_LEN} (longer than any model's \
             context)"
        ));
    }
    for (flag, r) in [
        ("--input-range-ratio", p.input_range_ratio),
        ("--output-range-ratio", p.output_range_ratio),
    ] {
        if !(0.0..1.0).contains(&r) {
            return bad(format!("{flag} must be in [0, 1), got {r}"));
        }
    }
    if !(0.0..=1.0).contains(&p.shared_fraction) {
        return bad(format!(
            "--shared-fraction must be in [0, 1], got {}",
            p.shared_fraction
        ));
    }
    if p.prefixes == 0 && p.shared_fraction > 0.0 {
        return bad("--prefixes must be at least 1 when --shared-fraction is above 0".into());
    }
    if !(p.zipf.is_finite() && p.zipf >= 0.0) {
        return bad(format!(
            "--zipf must be a non-negative number, got {}",
            p.zipf
        ));
    }
    // The last timestamp, about requests / rate seconds, must stay a representable count of ms.
    if !(p.rate.is_finite() && p.rate > 0.0 && p.requests as f64 / p.rate < 1e12) {
        return bad(format!(
            "--rate must be a positive number of requests/s (and not so small that the trace \
             lasts beyond 1e12 s), got {}",
            p.rate
        ));
    }
    Ok(())
}

/// A uniform integer in `[len * (1 - r), len * (1 + r)]`, at least 1.
fn uniform(rng: &mut StdRng, len: usize, r: f64) -> usize {
    let lo = ((len as f64 * (1.0 - r)) as usize).max(1);
    let hi = ((len as f64 * (1.0 + r)) as usize).max(lo);
    rng.gen_range(lo..=hi)
}

/// The statistics of `lines`.
pub fn stats(lines: &[TraceLine]) -> TraceStats {
    let mut seen = HashSet::new();
    let (mut blocks, mut reused) = (0usize, 0usize);
    for line in lines {
        for &id in &line.hash_ids {
            blocks += 1;
            if !seen.insert(id) {
                reused += 1;
            }
        }
    }
    let n = lines.len().max(1) as f64;
    TraceStats {
        requests: lines.len(),
        mean_input_len: lines.iter().map(|l| l.input_length as f64).sum::<f64>() / n,
        mean_output_len: lines.iter().map(|l| l.output_length as f64).sum::<f64>() / n,
        blocks,
        reusable_fraction: reused as f64 / blocks.max(1) as f64,
        span_s: lines.last().map_or(0.0, |l| l.timestamp as f64 / 1000.0),
    }
}

/// Writes `lines` as JSONL.
pub fn write_jsonl(lines: &[TraceLine], mut out: impl Write) -> std::io::Result<()> {
    for line in lines {
        serde_json::to_writer(&mut out, line)?;
        out.write_all(b"\n")?;
    }
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::dataset::parse_trace;

    fn params() -> PrefixTraceParams {
        PrefixTraceParams {
            requests: 400,
            block_size: 16,
            input_len: 384,
            input_range_ratio: 0.5,
            output_len: 9,
            output_range_ratio: 0.5,
            shared_fraction: 0.5,
            prefixes: 16,
            zipf: 1.0,
            rate: 10.0,
        }
    }

    #[test]
    fn requests_share_popular_prefixes_and_end_in_their_own_blocks() {
        let lines = generate(&params(), 3).unwrap();
        assert_eq!(lines, generate(&params(), 3).unwrap());
        assert_ne!(lines, generate(&params(), 4).unwrap());
        let s = stats(&lines);
        assert!((0.40..0.55).contains(&s.reusable_fraction), "{s:?}");
        assert!((340.0..430.0).contains(&s.mean_input_len), "{s:?}");
        // 400 requests at 10/s: about 40 s.
        assert!((30.0..50.0).contains(&s.span_s), "{s:?}");
        assert!(lines.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
        // Every block named once, the last one unique to its request.
        let mut last_ids = HashSet::new();
        for l in &lines {
            assert_eq!(l.hash_ids.len(), l.input_length.div_ceil(16));
            assert!(last_ids.insert(*l.hash_ids.last().unwrap()));
        }
        // Zipf: the most popular first block opens far more requests than the least.
        let opens = |id: u64| lines.iter().filter(|l| l.hash_ids[0] == id).count();
        let firsts: HashSet<u64> = lines.iter().map(|l| l.hash_ids[0]).collect();
        let most = firsts.iter().map(|&id| opens(id)).max().unwrap();
        assert!(most > 60, "{most}");
        // The JSONL replays.
        let mut text = Vec::new();
        write_jsonl(&lines, &mut text).unwrap();
        let specs = parse_trace(text.as_slice(), "t", 16, None).unwrap();
        assert_eq!(specs.len(), 400);
        assert_eq!(specs[7].input_len, lines[7].input_length);
    }

    #[test]
    fn no_sharing_and_bad_parameters() {
        let none = PrefixTraceParams {
            shared_fraction: 0.0,
            prefixes: 0,
            ..params()
        };
        assert_eq!(stats(&generate(&none, 0).unwrap()).reusable_fraction, 0.0);
        let p = params();
        for bad in [
            PrefixTraceParams { requests: 0, ..p },
            PrefixTraceParams { block_size: 0, ..p },
            PrefixTraceParams {
                shared_fraction: 1.5,
                ..p
            },
            PrefixTraceParams { prefixes: 0, ..p },
            PrefixTraceParams { zipf: -1.0, ..p },
            PrefixTraceParams { rate: 0.0, ..p },
            PrefixTraceParams { rate: 1e-300, ..p },
            PrefixTraceParams {
                input_len: usize::MAX,
                ..p
            },
            PrefixTraceParams {
                input_range_ratio: 1.0,
                ..p
            },
        ] {
            assert!(generate(&bad, 0).is_err(), "{bad:?}");
        }
    }
}
