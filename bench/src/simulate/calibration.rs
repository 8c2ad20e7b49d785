//! `rackfill simulate --calibration FILE`: the cost model's kernel rates from rackfill's own GPU
//! runs instead of the papers' figures.
//!
//! Read from a `scripts/gpu_session.sh` output folder or one report of it: `rackfill bench
//! attention --json` (flash attention TFLOP/s per chunk), `rackfill bench forward --json` (device
//! time per phase: grouped expert GEMMs and attention per prompt length; also as wrapped by
//! `scripts/bench_forward_hf.py`) and `kernels-bench.txt` (`rackfill kernels bench`: the device
//! solver's latency, replica-stream and copy bandwidth). Each rate becomes a fraction of the peak
//! of the card that measured it (the report's `peak_tflops`) and is applied to the rack's own
//! peak: an H200 run calibrates a GB200 rack's kernel efficiency, not its peak. What one card
//! cannot show (NVLink across GPUs, communication beside compute) stays assumed, and
//! [`Calibration::report`] says so term by term.

use super::error::SimError;
use super::shape::{Attention, ModelShape};
use rackfill_engine::rack_cost::rack::{MAX_CURVE_TOKENS, MAX_FIGURE, MIN_FIGURE};
use rackfill_engine::Rack;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// Chunk the attention efficiency is read at: `rackfill simulate`'s default `--chunk-tokens`
/// (the cost model has one attention efficiency; the measured chunk nearest this stands for it).
const ATTENTION_CHUNK_TOKENS: f64 = 4096.0;

/// A measured figure and where it came from.
#[derive(Debug, Clone)]
struct Figure<T> {
    value: T,
    basis: String,
}

/// Measured rates of one card, ready to replace the rack's assumed efficiencies.
#[derive(Debug, Clone)]
pub struct Calibration {
    source: String,
    card: String,
    /// The card's dense bf16 peak the efficiencies are fractions of (none: no efficiency).
    peak: Option<f64>,
    attention: Option<Figure<f64>>,
    gemm: Option<Curve>,
    solve_us: Option<Figure<f64>>,
    /// Replica-stream and device-copy GB/s: one card's memory, not links, so they calibrate
    /// nothing and are shown beside the terms they cannot calibrate.
    streams: Option<(f64, f64)>,
}

/// What was measured and what is still assumed: one row per rack term, plus the solve.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CalibrationReport {
    pub source: String,
    pub card: String,
    pub terms: Vec<CalibratedTerm>,
}

/// One term of the calibrated rack: its value, whether the run measured it, and from what.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CalibratedTerm {
    pub term: String,
    pub value: f64,
    pub unit: String,
    pub measured: bool,
    pub basis: String,
}

/// `rackfill bench attention --json` (the fields read).
#[derive(Deserialize)]
struct AttentionJson {
    device: String,
    peak_tflops: Option<f64>,
    timings: Vec<TimingJson>,
}

#[derive(Deserialize)]
struct TimingJson {
    case: BTreeMap<String, u64>,
    flash: Vec<FlashJson>,
}

#[derive(Deserialize)]
struct FlashJson {
    ms: f64,
    tflops: f64,
    tiles: String,
}

/// `rackfill bench forward --json` (the fields read).
#[derive(Deserialize)]
struct ForwardJson {
    device: String,
    model: String,
    peak_tflops: Option<f64>,
    config: Option<Value>,
    results: Vec<ResultJson>,
}

#[derive(Deserialize)]
struct ResultJson {
    tokens: u64,
    #[serde(default)]
    phases_ms: BTreeMap<String, f64>,
}

/// An efficiency (fraction of the card's peak) at a chunk or row count, and what it was.
#[derive(Debug, Clone)]
struct Point {
    at: f64,
    value: f64,
    what: String,
}

/// A GEMM efficiency curve (`[rows, efficiency]` points) and where it came from.
type Curve = Figure<Vec<[f64; 2]>>;

/// Everything usable found so far, and why the rest was not.
#[derive(Default)]
struct Gathered {
    /// (card, file) of every report with a usable peak or solver line.
    cards: Vec<(String, String)>,
    peak: Option<f64>,
    attention: Vec<Point>,
    /// Attention phases of forwards (GQA models): used only without a bench attention.
    forward_attention: Vec<Point>,
    /// Expert GEMM curves: (row counts, expert matrix size, curve); the widest is used.
    gemm: Vec<(usize, usize, Curve)>,
    solve: Option<Figure<f64>>,
    streams: Option<(f64, f64)>,
    skipped: Vec<String>,
}

/// The card's name without the driver's details: "NVIDIA H200 (sm_90)" -> "NVIDIA H200".
fn card_name(device: &str) -> String {
    device.split(" (").next().unwrap_or(device).trim().into()
}

/// A positive, finite rate or time no larger than a rack figure may be.
fn positive(what: &str, v: f64) -> Result<f64, String> {
    match v.is_finite() && v > 0.0 && v <= MAX_FIGURE {
        true => Ok(v),
        false => Err(format!(
            "{what} is {v:?}, not a positive number up to {MAX_FIGURE:e}"
        )),
    }
}

/// `tflops` as a fraction of `peak`: refused above the peak (a timing or FLOP count is wrong) and
/// below the smallest efficiency a rack accepts.
fn fraction(what: &str, tflops: f64, peak: f64) -> Result<f64, String> {
    let eff = positive(what, tflops)? / peak;
    match (MIN_FIGURE..=1.0).contains(&eff) {
        true => Ok(eff),
        false => Err(format!(
            "{what} is {tflops} TFLOP/s, {eff:.3e} of the card's {peak} TFLOP/s peak"
        )),
    }
}

/// The number right after `key` in `line` ("gpu median 245.4 us" -> 245.4).
fn after(line: &str, key: &str) -> Option<f64> {
    let rest = &line[line.find(key)? + key.len()..];
    let end = rest
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

impl Gathered {
    /// The peak of the card `device` names: `None` (the reason kept) for the CPU, the host
    /// emulator, or a card of unknown peak, which give no fraction of a peak.
    fn peak(&mut self, file: &str, device: &str, peak: Option<f64>) -> Result<Option<f64>, String> {
        match peak {
            Some(p) if device != "cpu" && !device.contains("emulator") => {
                let p = positive("peak_tflops", p)?;
                self.cards.push((card_name(device), file.into()));
                self.peak.get_or_insert(p);
                Ok(Some(p))
            }
            _ => {
                self.skipped
                    .push(format!("{file}: {device} has no dense bf16 peak"));
                Ok(None)
            }
        }
    }

    /// Each case's fastest tile shape (what `--tiles auto` runs for 128-wide heads).
    fn attention_report(&mut self, file: &str, r: AttentionJson) -> Result<(), String> {
        let Some(peak) = self.peak(file, &r.device, r.peak_tflops)? else {
            return Ok(());
        };
        for t in &r.timings {
            let (chunk, context) = (t.case.get("chunk"), t.case.get("context").unwrap_or(&0));
            let chunk = *chunk.ok_or("a timing has no chunk")?;
            for f in &t.flash {
                positive("a flash time (ms)", f.ms)?;
            }
            if let Some(best) = t.flash.iter().min_by(|a, b| a.ms.total_cmp(&b.ms)) {
                let what = format!(
                    "flash attention {}, {chunk}-token chunk after {context} cached",
                    best.tiles
                );
                let value = fraction(&what, best.tflops, peak)?;
                let what = format!("{what}: {:.1} TFLOP/s of {peak} peak ({file})", best.tflops);
                self.attention.push(Point {
                    at: chunk as f64,
                    value,
                    what,
                });
            }
        }
        Ok(())
    }

    /// The expert GEMM phase per prompt length as a curve over rows per expert, and the
    /// attention phase of GQA models; per-expert runs are skipped (their cuBLAS expert GEMMs are
    /// filed under dense GEMMs).
    fn forward_report(&mut self, file: &str, r: ForwardJson) -> Result<(), String> {
        let config = match (&r.config, r.model.as_str()) {
            _ if r.model.contains("per-expert") => None,
            (Some(config), _) => Some(config.clone()),
            (None, "bench-shape") => Some(crate::forward::bench_shape_config()),
            (None, _) => None,
        };
        let Some(config) = config else {
            self.skipped.push(format!(
                "{file}: {}: no grouped expert GEMMs of a known shape",
                r.model
            ));
            return Ok(());
        };
        let Some(peak) = self.peak(file, &r.device, r.peak_tflops)? else {
            return Ok(());
        };
        let shape = ModelShape::from_json(&config.to_string(), file).map_err(|e| e.to_string())?;
        let (h, i, k) = (shape.hidden, shape.moe_intermediate, shape.top_k as f64);
        let label = format!("{} ({file})", r.model);
        let mut curve: Vec<Point> = Vec::new();
        for res in &r.results {
            let n = positive("tokens", res.tokens as f64)?;
            if let Some(&ms) = res.phases_ms.get("expert GEMMs") {
                let ms = positive(&format!("expert GEMMs at {n} tokens (ms)"), ms)?;
                // Each (token, expert) pair is 6 H I FLOPs (gate, up, down), as in the cost model.
                let pairs = n * k * shape.moe_layers() as f64;
                let tflops = pairs * 6.0 * (h * i) as f64 / (ms * 1e9);
                let rows = n * k / shape.experts as f64;
                if rows <= MAX_CURVE_TOKENS && !curve.iter().any(|p| p.at == rows) {
                    let value = fraction(&format!("expert GEMMs at {n} tokens"), tflops, peak)?;
                    let what = format!("{rows} rows {value:.3}");
                    curve.push(Point {
                        at: rows,
                        value,
                        what,
                    });
                }
            }
            if let (Some(&ms), Attention::Gqa { .. }) =
                (res.phases_ms.get("attention"), &shape.attention)
            {
                let ms = positive(&format!("attention at {n} tokens (ms)"), ms)?;
                let flops = n * (n + 1.0) / 2.0 * shape.attention_flops_per_pair();
                let tflops = flops * shape.layers as f64 / (ms * 1e9);
                let value = fraction(&format!("attention at {n} tokens"), tflops, peak)?;
                let what = format!(
                    "attention phase of bench forward {label}, {n}-token prompt: {tflops:.1} \
                     TFLOP/s of {peak} peak"
                );
                self.forward_attention.push(Point { at: n, value, what });
            }
        }
        curve.sort_by(|a, b| a.at.total_cmp(&b.at));
        if !curve.is_empty() {
            let points: Vec<&str> = curve.iter().map(|p| p.what.as_str()).collect();
            let basis = format!(
                "grouped expert GEMMs (rows = tokens x top-k / experts) of bench forward \
                 {label}: {} of the {peak} TFLOP/s peak",
                points.join(", ")
            );
            let value = curve.iter().map(|p| [p.at, p.value]).collect();
            self.gemm
                .push((curve.len(), h * i, Figure { value, basis }));
        }
        Ok(())
    }

    /// `rackfill kernels bench`'s text: the device solver's latency, replica-stream and copy
    /// bandwidth (its fan-out lines time the tile pipeline on one GPU, not links: not read).
    fn kernels_bench(&mut self, file: &str, text: &str) -> Result<(), String> {
        let line = |start: &str| text.lines().find(|l| l.starts_with(start));
        let (Some(device), Some(solver)) = (line("device: "), line("solver ")) else {
            self.skipped
                .push(format!("{file}: no device or solver line"));
            return Ok(());
        };
        let card = card_name(&device["device: ".len()..]);
        self.cards.push((card.clone(), file.into()));
        let gpu = after(solver, "gpu median ").ok_or("the solver line has no gpu median")?;
        let setup = solver.split(':').next().unwrap_or_default();
        let mut basis = format!("device quota {setup}, median on {card} ({file})");
        if let Some(cpu) = after(solver, "cpu median ") {
            basis += &format!("; CPU planner {cpu} us");
        }
        if let Some(relay) = line("relay planning").and_then(|l| after(l, "gpu median ")) {
            basis += &format!("; relay planning adds {relay} us on the device, outside the term");
        }
        let value = positive("the solver's gpu median (us)", gpu)?;
        self.solve = Some(Figure { value, basis });
        if let Some(l) = line("replica distribution:") {
            let (stream, copy) = (
                after(l, "us = "),
                l.rfind("us = ").and_then(|i| after(&l[i..], "us = ")),
            );
            if let (Some(stream), Some(copy)) = (stream, copy) {
                let stream = positive("the replica stream's GB/s", stream)?;
                self.streams = Some((stream, positive("the device copy's GB/s", copy)?));
            }
        }
        Ok(())
    }

    /// One report, by its kind: a kernels bench (`.txt`) or a bench JSON.
    fn file(&mut self, path: &Path) -> Result<(), SimError> {
        let file = path
            .file_name()
            .map_or(String::new(), |n| n.to_string_lossy().into());
        let bad = |why: String| SimError::Input(format!("calibration {}: {why}", path.display()));
        let text =
            std::fs::read_to_string(path).map_err(|e| bad(format!("cannot read it: {e}")))?;
        if path.extension().is_some_and(|e| e == "txt") {
            return self.kernels_bench(&file, &text).map_err(bad);
        }
        let value: Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not a JSON report: {e}")))?;
        let mut forwards = vec![];
        if value.get("timings").is_some() {
            let r = serde_json::from_value(value).map_err(|e| bad(e.to_string()))?;
            return self.attention_report(&file, r).map_err(bad);
        } else if value.get("results").is_some() {
            forwards.push(value);
        } else if let Some(Value::Array(rounds)) = value.get("rounds") {
            // scripts/bench_forward_hf.py: rackfill's own report beside transformers'.
            forwards.extend(rounds.iter().filter_map(|r| r.get("rackfill")).cloned());
        } else {
            return Err(bad(
                "not a bench attention, bench forward or kernels bench report".into(),
            ));
        }
        for r in forwards {
            let r = serde_json::from_value(r).map_err(|e| bad(e.to_string()))?;
            self.forward_report(&file, r).map_err(bad)?;
        }
        Ok(())
    }
}

impl Calibration {
    /// A GPU session output folder (scripts/gpu_session.sh's OUT) or one bench JSON file.
    ///
    /// In a folder, `bench-attention*.json`, `bench-forward-*.json` and `kernels-bench.txt` are
    /// read; reports of the CPU, the host emulator or a card of unknown peak are skipped. Errors
    /// are one line naming the file: missing, not JSON, a negative, non-finite or above-peak
    /// rate, figures of two different cards, or nothing usable at all.
    pub fn load(path: &Path) -> Result<Calibration, SimError> {
        let source = path.display().to_string();
        let bad = |why: String| SimError::Input(format!("calibration {source}: {why}"));
        let mut g = Gathered::default();
        if path.is_dir() {
            let entries =
                std::fs::read_dir(path).map_err(|e| bad(format!("cannot read it: {e}")))?;
            let mut files: Vec<_> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
            files.sort();
            for f in files {
                let name = f.file_name().unwrap_or_default().to_string_lossy();
                let json =
                    name.starts_with("bench-attention") || name.starts_with("bench-forward-");
                if (json && name.ends_with(".json")) || name == "kernels-bench.txt" {
                    g.file(&f)?;
                }
            }
        } else if path.exists() {
            g.file(path)?;
        } else {
            return Err(bad("no such file or folder".into()));
        }
        let figures = g.attention.len() + g.forward_attention.len() + g.gemm.len();
        let Some((card, first)) = g.cards.first().filter(|_| figures > 0 || g.solve.is_some())
        else {
            let why = match g.skipped.is_empty() {
                true => "no bench attention, bench forward or kernels bench timing".into(),
                false => format!("no usable figure ({})", g.skipped.join("; ")),
            };
            return Err(bad(why));
        };
        if let Some((other, file)) = g.cards.iter().find(|(c, _)| c != card) {
            return Err(bad(format!(
                "figures of different cards: {card} ({first}) and {other} ({file})"
            )));
        }
        // The measured chunk nearest the simulator's; forwards' attention phases only where no
        // bench attention ran.
        let nearest = |points: &[Point]| {
            let off = |p: &Point| (p.at / ATTENTION_CHUNK_TOKENS).ln().abs();
            points
                .iter()
                .min_by(|a, b| off(a).total_cmp(&off(b)))
                .cloned()
        };
        let attention = nearest(&g.attention).or_else(|| nearest(&g.forward_attention));
        // The forward whose expert GEMMs span the most row counts; then the largest experts.
        let gemm = g.gemm.into_iter().max_by_key(|(n, size, _)| (*n, *size));
        Ok(Calibration {
            attention: attention.map(|p| Figure {
                value: p.value,
                basis: format!("{} on {card}", p.what),
            }),
            gemm: gemm.map(|(_, _, f)| Figure {
                basis: format!("{} on {card}", f.basis),
                ..f
            }),
            source: source.clone(),
            card: card.clone(),
            peak: g.peak,
            solve_us: g.solve,
            streams: g.streams,
        })
    }

    /// The rack with measured terms replaced: efficiencies measured on the card (fraction of that
    /// card's peak) applied to the rack's own peak, so an H200 run calibrates a GB200 rack's
    /// kernel efficiency, not its peak. Every other figure is the rack's. (The cost model has one
    /// GEMM curve: attention projections and the dense FFN are costed on the expert GEMMs' too.)
    pub fn apply(&self, rack: &Rack) -> Rack {
        let mut out = rack.clone();
        if let Some(a) = &self.attention {
            out.attention_efficiency = a.value;
        }
        if let Some(g) = &self.gemm {
            out.gemm_efficiency = g.value.clone();
        }
        debug_assert_eq!(out.validate(), Ok(()));
        out
    }

    /// The device planner's measured solve time per layer, if the report has one (without it
    /// the simulator times the CPU planner on this host, or takes `--solve-us`).
    pub fn solve_us(&self) -> Option<f64> {
        self.solve_us.as_ref().map(|s| s.value)
    }

    /// What was measured and what is still assumed, for the report and the table: every term of
    /// the calibrated `rack` (measured ones with their basis, the rest with why a one-card run
    /// leaves them and where `nvl72`'s figure comes from), then the solve time if measured.
    pub fn report(&self, rack: &Rack) -> CalibrationReport {
        let (r, nvl, card) = (self.apply(rack), Rack::nvl72(), &self.card);
        let mut terms: Vec<CalibratedTerm> = TERMS
            .iter()
            .map(|&(term, unit, why, nvl72)| {
                let figure = match term {
                    "attention_efficiency" => self.attention.as_ref().map(|f| f.basis.clone()),
                    "gemm_efficiency" => self.gemm.as_ref().map(|f| f.basis.clone()),
                    _ => None,
                };
                let seen = match (term, self.streams, self.peak) {
                    ("link_efficiency", Some((s, c)), _) => format!(
                        "; this run: the replica stream's {s} GB/s on {card} is {:.1}% of a \
                         device copy (one card's memory, not a link)",
                        100.0 * s / c
                    ),
                    ("hbm_tbytes_per_s", Some((_, c)), _) => {
                        format!("; this run: {card}'s device-to-device copy moved {c} GB/s")
                    }
                    ("bf16_tflops", _, Some(p)) => {
                        format!("; this run's efficiencies are fractions of {card}'s {p} TFLOP/s")
                    }
                    _ => String::new(),
                };
                CalibratedTerm {
                    term: term.into(),
                    value: term_value(&r, term),
                    unit: unit.into(),
                    measured: figure.is_some(),
                    basis: figure.unwrap_or_else(|| {
                        let same = term_value(&r, term) == term_value(&nvl, term)
                            && (term != "gemm_efficiency"
                                || r.gemm_efficiency == nvl.gemm_efficiency);
                        let given = match same {
                            true => format!("assumed (nvl72): {nvl72}"),
                            false => "the rack file's figure".into(),
                        };
                        format!("{why}; {given}{seen}")
                    }),
                }
            })
            .collect();
        if let Some(s) = &self.solve_us {
            terms.push(CalibratedTerm {
                term: "solve_us".into(),
                value: s.value,
                unit: "us per layer".into(),
                measured: true,
                basis: s.basis.clone(),
            });
        }
        CalibrationReport {
            source: self.source.clone(),
            card: card.clone(),
            terms,
        }
    }
}

const NVLINK: &str = "not measurable on one card: NVLink across GPUs";
const PEAK: &str = "the rack's own peak, which measured efficiencies apply to";
const UNTIMED: &str = "no timing of it on a card of known peak";
const OVERLAP: &str = "not measurable on one card: communication across GPUs beside compute";
const TABLE2: &str = "UltraEP Table 2";

/// Every term of a [`Rack`] in report order: its unit, why a run leaves it as the rack has it,
/// and where `nvl72`'s figure comes from (the constants' doc comments in `rack_cost::rack`).
#[rustfmt::skip]
const TERMS: [(&str, &str, &str, &str); 9] = [
    ("gpus", "GPUs", "one card cannot show a rack's size", "one NVLink domain of 72"),
    ("scale_up_gbytes_per_s", "GB/s", NVLINK, TABLE2),
    ("link_efficiency", "fraction", NVLINK, "DeepEP intranode: 0.77-0.79 of H800 NVLink"),
    ("link_latency_us", "us", "not measurable on one card: hops across NVLink", "a few us"),
    ("bf16_tflops", "TFLOP/s", PEAK, TABLE2),
    ("hbm_tbytes_per_s", "TB/s", "the rack's own peak (the roofline of an omitted curve)", TABLE2),
    ("attention_efficiency", "of peak", UNTIMED, "FlashAttention-3: 0.75 of H100 peak"),
    ("overlap_compute_efficiency", "fraction", OVERLAP, "DeepEP holds ~20 of 132 SMs"),
    ("gemm_efficiency", "of peak, most rows", UNTIMED, "roofline, DeepGEMM's 0.70 ceiling"),
];

/// The rack's figure for a term of [`TERMS`] (a curve by its last, highest-row efficiency).
fn term_value(r: &Rack, term: &str) -> f64 {
    match term {
        "gpus" => r.gpus as f64,
        "scale_up_gbytes_per_s" => r.scale_up_gbytes_per_s,
        "link_efficiency" => r.link_efficiency,
        "link_latency_us" => r.link_latency_us,
        "bf16_tflops" => r.bf16_tflops,
        "hbm_tbytes_per_s" => r.hbm_tbytes_per_s,
        "attention_efficiency" => r.attention_efficiency,
        "overlap_compute_efficiency" => r.overlap_compute_efficiency,
        _ => r.gemm_efficiency.last().map_or(0.0, |p| p[1]),
    }
}

/// The report as an aligned text table: one row per term (term, value, unit, measured, basis).
pub fn calibration_table(report: &CalibrationReport) -> String {
    let value = |v: f64| match v.abs() {
        x if x >= 100.0 || x == x.trunc() => format!("{v:.1}"),
        x if x >= 1.0 => format!("{v:.3}"),
        _ => format!("{v:.4}"),
    };
    let head = ["term", "value", "unit", "measured", "basis"].map(String::from);
    let rows = report.terms.iter().map(|t| {
        let measured = if t.measured { "yes" } else { "no" };
        [
            t.term.clone(),
            value(t.value),
            t.unit.clone(),
            measured.into(),
            t.basis.clone(),
        ]
    });
    let rows: Vec<[String; 5]> = std::iter::once(head).chain(rows).collect();
    let w: Vec<usize> = (0..4)
        .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    let mut out = format!("calibration from {} ({})\n", report.source, report.card);
    for r in &rows {
        let (t, v, u, m, b) = (&r[0], &r[1], &r[2], &r[3], &r[4]);
        out += &format!(
            "{t:<0$}  {v:>1$}  {u:<2$}  {m:<3$}  {b}\n",
            w[0], w[1], w[2], w[3]
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/calibration")
            .join(name)
    }

    fn measured(report: &CalibrationReport) -> Vec<&str> {
        let terms = report.terms.iter().filter(|t| t.measured);
        terms.map(|t| t.term.as_str()).collect()
    }

    /// The message of a load that must fail: one line naming `file`.
    fn load_error(path: &Path, file: &str, want: &str) {
        let err = Calibration::load(path).unwrap_err().to_string();
        assert!(
            err.starts_with("calibration ") && err.contains(file),
            "{err}"
        );
        assert!(
            err.contains(want) && !err.contains('\n'),
            "{err} lacks {want}"
        );
    }

    #[test]
    fn an_h200_session_calibrates_attention_and_the_expert_gemm_curve() {
        let cal = Calibration::load(&fixture("h200-2026-11-28")).unwrap();
        let nvl = Rack::nvl72();
        let rack = cal.apply(&nvl);
        rack.validate().unwrap();
        // bench-attention.json, 4096-token chunk, fastest tiles k32_v128: 89.36 of 989 TFLOP/s.
        assert!((rack.attention_efficiency - 89.35983327255649 / 989.0).abs() < 1e-12);
        // bench-forward-qwen3.json (4 token counts, more than DeepSeek's 2 or the bench shape's
        // 3): 8 MoE layers, top-8 of 128, H 2048, I 768; 2048 tokens in 7.56832 ms.
        let rows: Vec<f64> = rack.gemm_efficiency.iter().map(|p| p[0]).collect();
        assert_eq!(rows, [128.0, 256.0, 512.0, 1024.0]);
        let first = 2048.0 * 8.0 * 8.0 * 6.0 * 2048.0 * 768.0 / 7.56832e-3 / 989e12;
        assert!(
            (rack.gemm_efficiency[0][1] - first).abs() < 1e-12,
            "{rack:?}"
        );
        // Nothing else moves: the peaks and the link terms are the rack's.
        let mut rest = rack.clone();
        rest.attention_efficiency = nvl.attention_efficiency;
        rest.gemm_efficiency = nvl.gemm_efficiency.clone();
        assert_eq!(rest, nvl);
        assert_eq!(cal.solve_us(), None);
        let report = cal.report(&nvl);
        assert_eq!(report.card, "NVIDIA H200");
        assert_eq!(
            measured(&report),
            ["attention_efficiency", "gemm_efficiency"]
        );
        assert_eq!(report.terms.len(), 9);
        let basis = |term: &str| &report.terms.iter().find(|t| t.term == term).unwrap().basis;
        assert!(basis("link_efficiency").starts_with("not measurable on one card: NVLink"));
        assert!(basis("attention_efficiency").contains("k32_v128, 4096-token chunk"));
        assert!(basis("gemm_efficiency").contains("qwen3-30b-a3b (8 layers)"));
        // Another rack keeps its own peaks; its figures are named as its own, not nvl72's.
        let text = r#"{"name": "h100-rack", "gpus": 8, "scale_up_gbytes_per_s": 450,
                       "bf16_tflops": 989, "hbm_tbytes_per_s": 3.35}"#;
        let h100 = Rack::from_json(text, "h100.json").unwrap();
        let calibrated = cal.apply(&h100);
        assert_eq!((calibrated.bf16_tflops, calibrated.gpus), (989.0, 8));
        assert_eq!(calibrated.gemm_efficiency, rack.gemm_efficiency);
        let report = cal.report(&h100);
        assert!(report.terms[1].basis.ends_with("; the rack file's figure"));
        assert!(report.terms[2].basis.contains("assumed (nvl72)"));
    }

    #[test]
    fn a_single_forward_report_calibrates_attention_from_its_phase() {
        let cal = Calibration::load(&fixture("h200-2026-11-28/bench-forward-qwen3.json")).unwrap();
        let rack = cal.apply(&Rack::nvl72());
        // 8 layers x 4096 x 4097 / 2 pairs x 4 x 32 x 128 FLOPs in 16.03 ms.
        let flops = 8.0 * 4096.0 * 4097.0 / 2.0 * 4.0 * 32.0 * 128.0;
        let ms = 16.032544;
        assert!((rack.attention_efficiency - flops / (ms * 1e-3) / 989e12).abs() < 1e-12);
        assert_eq!(rack.gemm_efficiency.len(), 4);
        assert!(cal.report(&rack).terms[6]
            .basis
            .contains("attention phase of bench forward"));
    }

    #[test]
    fn the_kernels_bench_gives_the_solve_time_and_keeps_the_rack() {
        let cal = Calibration::load(&fixture("h100-2026-11-28")).unwrap();
        assert_eq!(cal.solve_us(), Some(278.2));
        let nvl = Rack::nvl72();
        assert_eq!(cal.apply(&nvl), nvl);
        let report = cal.report(&nvl);
        assert_eq!(report.card, "NVIDIA H100 80GB HBM3");
        assert_eq!(measured(&report), ["solve_us"]);
        let link = &report.terms[2].basis;
        assert!(
            link.contains("1749.4 GB/s") && link.contains("118.5%"),
            "{link}"
        );
        let table = calibration_table(&report);
        assert_eq!(table.lines().count(), 2 + report.terms.len(), "{table}");
        assert!(
            table.contains("solve_us") && table.contains("278.2"),
            "{table}"
        );
    }

    #[test]
    fn bad_inputs_are_one_line_errors_naming_the_file() {
        let missing = fixture("no-such-run");
        load_error(&missing, "no-such-run", "no such file or folder");
        // The host emulator's report (a real one) has no peak to take a fraction of.
        let emulator = fixture("emulator-bench-forward.json");
        load_error(&emulator, "emulator-bench-forward.json", "no usable figure");
        let dir = tempfile::tempdir().unwrap();
        let text = dir.path().join("bench-forward-x.json");
        std::fs::write(&text, "bench forward: not json").unwrap();
        load_error(&text, "bench-forward-x.json", "not a JSON report");
        load_error(dir.path(), "bench-forward-x.json", "not a JSON report");
        let original =
            std::fs::read_to_string(fixture("h200-2026-11-28/bench-attention.json")).unwrap();
        let negative = dir.path().join("negative.json");
        let edited = original.replace("89.35983327255649", "-89.35983327255649");
        std::fs::write(&negative, edited).unwrap();
        load_error(
            &negative,
            "negative.json",
            "is -89.35983327255649, not a positive",
        );
        let above = dir.path().join("above.json");
        std::fs::write(&above, original.replace("89.35983327255649", "8935.9")).unwrap();
        load_error(&above, "above.json", "of the card's 989 TFLOP/s peak");
        let other = dir.path().join("other.json");
        std::fs::write(&other, r#"{"name": "nvl72"}"#).unwrap();
        load_error(
            &other,
            "other.json",
            "not a bench attention, bench forward or kernels",
        );
        // An H200 report beside an H100 kernels bench: whose rates are these?
        let mixed = tempfile::tempdir().unwrap();
        let h100 = fixture("h100-2026-11-28/kernels-bench.txt");
        std::fs::copy(h100, mixed.path().join("kernels-bench.txt")).unwrap();
        std::fs::write(mixed.path().join("bench-attention.json"), &original).unwrap();
        let want = "different cards: NVIDIA H200 (bench-attention.json) and NVIDIA H100 80GB HBM3";
        load_error(mixed.path(), "", want);
        let empty = tempfile::tempdir().unwrap();
        load_error(
            empty.path(),
            "",
            "no bench attention, bench forward or kernels bench",
        );
    }
}
