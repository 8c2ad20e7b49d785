//! The rack a layer is costed on: GPUs, scale-up fabric and per-GPU compute, plus the efficiency
//! curves that turn peak figures into achieved ones. The one description of the hardware that
//! both the EP runtime's per-layer simulated makespan ([`super::moe_layer`]) and `rackfill simulate`
//! cost with, so their figures compare.
//!
//! Built-in: [`Rack::nvl72`], the GB200-class figures of UltraEP's Table 2 on a 72-GPU NVLink
//! domain. `--rack FILE.json` describes any other rack in the same fields (see
//! `docs/simulate.md`); every number is validated before anything is costed on it.

use serde::{Deserialize, Serialize};

/// Why a rack cannot be used: one line naming the file and field at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct RackError(String);

/// Most GPUs a rack may have (the largest EP group rackfill plans for).
pub const MAX_RACK_GPUS: usize = 1024;

/// Smallest bandwidth, peak or efficiency a rack file may give (in its field's unit).
/// Together with [`MAX_FIGURE`] this keeps every step time finite: figures like 1e-300 TFLOP/s
/// or a latency of 1e300 us made the times overflow to infinity (printed `inf`, and `null` in
/// the JSON report).
pub const MIN_FIGURE: f64 = 1e-9;

/// Largest bandwidth, peak or latency a rack file may give (in its field's unit).
pub const MAX_FIGURE: f64 = 1e9;

/// Largest `tokens` of a `gemm_efficiency` point.
pub const MAX_CURVE_TOKENS: f64 = 1e12;

/// Fraction of the BF16 peak a large grouped GEMM sustains (the flat top of the default curve).
///
/// Assumption, from published kernel figures: DeepGEMM reports up to 1550 of the H800's 1979 dense
/// FP8 TFLOP/s (0.78) on its best shapes and less on grouped MoE layouts; 0.70 sits just below.
pub const GEMM_PEAK_EFFICIENCY: f64 = 0.70;

/// Fraction of the BF16 peak attention kernels sustain. Assumption: FlashAttention-3 reports 75%
/// of the H100's BF16 peak on long sequences in the forward pass; prefill chunks of a few thousand
/// tokens run below that, so 0.60.
pub const ATTENTION_EFFICIENCY: f64 = 0.60;

/// Fraction of the per-direction link bandwidth transfers achieve. Assumption: DeepEP's intranode
/// kernels reach about 153-158 GB/s of the H800's ~200 GB/s per-direction NVLink (0.77-0.79).
pub const LINK_EFFICIENCY: f64 = 0.80;

/// Fixed time every communication phase pays (hop latency plus the kernel's synchronisation).
/// Assumption: a few microseconds on NVLink; small next to the millisecond terms it is added to.
pub const LINK_LATENCY_US: f64 = 5.0;

/// Fraction of the compute rate left to GEMMs and attention while communication kernels run
/// beside them (overlapped schedules). Assumption: DeepEP's normal kernels, what two-batch
/// overlap runs dispatch and combine with, hold about 20 of an H800's 132 SMs (0.85 left).
pub const OVERLAP_COMPUTE_EFFICIENCY: f64 = 0.85;

/// A rack's hardware figures; the JSON form of `--rack FILE.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rack {
    /// Name used in reports.
    pub name: String,
    /// GPUs on one scale-up fabric: the largest EP group it can host.
    pub gpus: usize,
    /// Scale-up bandwidth of one GPU, per direction, GB/s (1e9 bytes per second).
    pub scale_up_gbytes_per_s: f64,
    /// Fraction of that bandwidth transfers achieve, in (0, 1].
    #[serde(default = "default_link_efficiency")]
    pub link_efficiency: f64,
    /// Fixed latency of one communication phase, microseconds.
    #[serde(default = "default_link_latency")]
    pub link_latency_us: f64,
    /// Dense BF16 peak of one GPU, TFLOP/s.
    pub bf16_tflops: f64,
    /// HBM bandwidth of one GPU, TB/s.
    pub hbm_tbytes_per_s: f64,
    /// Fraction of the BF16 peak attention kernels achieve, in (0, 1].
    #[serde(default = "default_attention_efficiency")]
    pub attention_efficiency: f64,
    /// Fraction of the compute rate left while communication kernels overlap compute (a
    /// schedule with two micro-batches), in (0, 1].
    #[serde(default = "default_overlap_compute_efficiency")]
    pub overlap_compute_efficiency: f64,
    /// GEMM efficiency versus rows (tokens per expert instance): `[tokens, efficiency]` points,
    /// tokens strictly increasing. Omitted: the roofline curve of [`roofline_curve`]; given, at
    /// least one point (an empty list used to be taken for an omitted one).
    #[serde(default, deserialize_with = "curve_points")]
    pub gemm_efficiency: Vec<[f64; 2]>,
}

/// A `gemm_efficiency` that is present: one point or more. (Serde calls this only for a field in
/// the file, so an omitted curve still defaults to empty and becomes the roofline.)
fn curve_points<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<[f64; 2]>, D::Error> {
    let points = Vec::<[f64; 2]>::deserialize(d)?;
    if points.is_empty() {
        return Err(serde::de::Error::custom(
            "gemm_efficiency needs at least one [tokens, efficiency] point (omit the field for the \
             roofline)",
        ));
    }
    Ok(points)
}

fn default_link_efficiency() -> f64 {
    LINK_EFFICIENCY
}

fn default_link_latency() -> f64 {
    LINK_LATENCY_US
}

fn default_attention_efficiency() -> f64 {
    ATTENTION_EFFICIENCY
}

fn default_overlap_compute_efficiency() -> f64 {
    OVERLAP_COMPUTE_EFFICIENCY
}

impl Rack {
    /// NVL72: 72 GB200-class GPUs on one NVLink domain, with UltraEP Table 2's per-GPU figures
    /// (2250 TFLOP/s BF16, 8 TB/s HBM, 900 GB/s scale-up per direction).
    pub fn nvl72() -> Self {
        let mut rack = Self {
            name: "nvl72".into(),
            gpus: 72,
            scale_up_gbytes_per_s: 900.0,
            link_efficiency: LINK_EFFICIENCY,
            link_latency_us: LINK_LATENCY_US,
            bf16_tflops: 2250.0,
            hbm_tbytes_per_s: 8.0,
            attention_efficiency: ATTENTION_EFFICIENCY,
            overlap_compute_efficiency: OVERLAP_COMPUTE_EFFICIENCY,
            gemm_efficiency: Vec::new(),
        };
        rack.gemm_efficiency = roofline_curve(rack.bf16_tflops, rack.hbm_tbytes_per_s);
        rack
    }

    /// `nvl72` or a rack JSON file.
    pub fn load(spec: &str) -> Result<Self, RackError> {
        if spec == "nvl72" {
            return Ok(Self::nvl72());
        }
        let text = std::fs::read_to_string(spec)
            .map_err(|e| RackError(format!("cannot read rack file {spec}: {e}")))?;
        Self::from_json(&text, spec)
    }

    /// Parses and validates a rack file's contents; `origin` names it in errors.
    pub fn from_json(text: &str, origin: &str) -> Result<Self, RackError> {
        let mut rack: Rack = serde_json::from_str(text)
            .map_err(|e| RackError(format!("rack file {origin}: {e}")))?;
        if rack.gemm_efficiency.is_empty() && rack.bf16_tflops > 0.0 && rack.hbm_tbytes_per_s > 0.0
        {
            rack.gemm_efficiency = roofline_curve(rack.bf16_tflops, rack.hbm_tbytes_per_s);
        }
        rack.validate()
            .map_err(|why| RackError(format!("rack file {origin}: {why}")))?;
        Ok(rack)
    }

    /// Checks every figure; the reason names the field.
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=MAX_RACK_GPUS).contains(&self.gpus) {
            return Err(format!(
                "gpus must be in 1..={MAX_RACK_GPUS}, got {}",
                self.gpus
            ));
        }
        let positive = [
            ("scale_up_gbytes_per_s", self.scale_up_gbytes_per_s),
            ("bf16_tflops", self.bf16_tflops),
            ("hbm_tbytes_per_s", self.hbm_tbytes_per_s),
        ];
        for (name, v) in positive {
            if !(MIN_FIGURE..=MAX_FIGURE).contains(&v) {
                return Err(format!(
                    "{name} must be a positive number from {MIN_FIGURE:e} to {MAX_FIGURE:e}, got {v:?}"
                ));
            }
        }
        if !(0.0..=MAX_FIGURE).contains(&self.link_latency_us) {
            return Err(format!(
                "link_latency_us must be a non-negative number up to {MAX_FIGURE:e}, got {:?}",
                self.link_latency_us
            ));
        }
        for (name, v) in [
            ("link_efficiency", self.link_efficiency),
            ("attention_efficiency", self.attention_efficiency),
            (
                "overlap_compute_efficiency",
                self.overlap_compute_efficiency,
            ),
        ] {
            check_fraction(name, v)?;
        }
        if self.gemm_efficiency.is_empty() {
            return Err("gemm_efficiency needs at least one [tokens, efficiency] point".into());
        }
        let mut last = 0.0;
        for (i, &[tokens, eff]) in self.gemm_efficiency.iter().enumerate() {
            if !(tokens > last && tokens <= MAX_CURVE_TOKENS) {
                return Err(format!(
                    "gemm_efficiency point {i}: tokens must be positive, strictly increasing and \
                     at most {MAX_CURVE_TOKENS:e}, got {tokens:?}"
                ));
            }
            check_fraction(&format!("gemm_efficiency point {i}"), eff)?;
            last = tokens;
        }
        Ok(())
    }

    /// Peak BF16 FLOP/s of one GPU.
    pub fn peak_flops(&self) -> f64 {
        self.bf16_tflops * 1e12
    }

    /// Bytes per second one GPU moves in one direction, after [`Self::link_efficiency`].
    pub fn link_bytes_per_s(&self) -> f64 {
        self.scale_up_gbytes_per_s * 1e9 * self.link_efficiency
    }

    /// Milliseconds of a GEMM of `flops` FLOPs over `rows` rows (tokens), at the curve's
    /// efficiency for that many rows; nothing for no rows or no FLOPs.
    pub fn gemm_ms(&self, flops: f64, rows: f64) -> f64 {
        if rows <= 0.0 || flops <= 0.0 {
            return 0.0;
        }
        flops / (self.peak_flops() * self.gemm_efficiency_at(rows)) * 1e3
    }

    /// One communication phase in which the busiest GPU sends or receives `bytes` (links are full
    /// duplex, so it is the larger of its two directions): bytes over the achieved bandwidth plus
    /// the phase latency; nothing when nothing moves.
    pub fn comm_ms(&self, bytes: u64) -> f64 {
        if bytes == 0 {
            return 0.0;
        }
        bytes as f64 / self.link_bytes_per_s() * 1e3 + self.link_latency_us * 1e-3
    }

    /// GEMM efficiency at `tokens` rows, interpolated linearly in log-log space between the
    /// curve's points (exact for the roofline's power-law piece). Below the first point the time
    /// stays that of the first point (memory-bound: the weights are read whatever the rows);
    /// above the last, the last efficiency holds.
    pub fn gemm_efficiency_at(&self, tokens: f64) -> f64 {
        let curve = &self.gemm_efficiency;
        let Some(&[t0, e0]) = curve.first() else {
            return GEMM_PEAK_EFFICIENCY;
        };
        if tokens <= t0 {
            return e0 * tokens / t0;
        }
        for pair in curve.windows(2) {
            let ([ta, ea], [tb, eb]) = (pair[0], pair[1]);
            if tokens <= tb {
                let x = (tokens / ta).ln() / (tb / ta).ln();
                return ea * (x * (eb / ea).ln()).exp();
            }
        }
        curve[curve.len() - 1][1]
    }
}

fn check_fraction(name: &str, v: f64) -> Result<(), String> {
    if (MIN_FIGURE..=1.0).contains(&v) {
        Ok(())
    } else {
        Err(format!(
            "{name} must be in (0, 1] (at least {MIN_FIGURE:e}), got {v:?}"
        ))
    }
}

/// The default GEMM curve: a roofline. An expert GEMM with `m` rows reads its `H x I` BF16 weights
/// once (2 bytes per weight) and does `2 m` FLOPs per weight, so it is memory-bound below
/// `m = peak / hbm` rows, where its efficiency is `m * hbm / peak`, and compute-bound above, where
/// it sustains [`GEMM_PEAK_EFFICIENCY`]. Activation traffic and tile padding are ignored.
///
/// As points: `(1, hbm / peak)`, the knee `(GEMM_PEAK_EFFICIENCY * peak / hbm, GEMM_PEAK_EFFICIENCY)`
/// and a far point on the flat top; log-log interpolation reproduces the formula exactly.
pub fn roofline_curve(bf16_tflops: f64, hbm_tbytes_per_s: f64) -> Vec<[f64; 2]> {
    let ridge = bf16_tflops / hbm_tbytes_per_s;
    let knee = GEMM_PEAK_EFFICIENCY * ridge;
    if knee <= 1.0 {
        return vec![[1.0, GEMM_PEAK_EFFICIENCY], [1e9, GEMM_PEAK_EFFICIENCY]];
    }
    vec![
        [1.0, 1.0 / ridge],
        [knee, GEMM_PEAK_EFFICIENCY],
        [1e9, GEMM_PEAK_EFFICIENCY],
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvl72_roofline_knee_and_plateau() {
        let rack = Rack::nvl72();
        rack.validate().unwrap();
        // Ridge 2250 / 8 = 281.25 rows; memory-bound below 0.7 * 281.25 = 196.9 rows.
        assert!((rack.gemm_efficiency_at(1.0) - 1.0 / 281.25).abs() < 1e-12);
        assert!((rack.gemm_efficiency_at(100.0) - 100.0 / 281.25).abs() < 1e-9);
        assert!((rack.gemm_efficiency_at(4096.0) - 0.70).abs() < 1e-12);
        // Below the first point the time is the first point's: efficiency proportional to rows.
        assert!((rack.gemm_efficiency_at(0.5) - 0.5 / 281.25).abs() < 1e-12);
    }

    #[test]
    fn rack_files_are_validated_field_by_field() {
        let good = r#"{"name": "mine", "gpus": 8, "scale_up_gbytes_per_s": 450,
                       "bf16_tflops": 990, "hbm_tbytes_per_s": 3.35}"#;
        let rack = Rack::from_json(good, "mine.json").unwrap();
        assert_eq!(rack.link_efficiency, LINK_EFFICIENCY);
        assert_eq!(rack.gemm_efficiency.len(), 3);
        let cases = [
            (
                r#"{"name": "x", "gpus": 0, "scale_up_gbytes_per_s": 1, "bf16_tflops": 1, "hbm_tbytes_per_s": 1}"#,
                "gpus must be in 1..=1024, got 0",
            ),
            (
                r#"{"name": "x", "gpus": 1000000000, "scale_up_gbytes_per_s": 1, "bf16_tflops": 1, "hbm_tbytes_per_s": 1}"#,
                "gpus must be in 1..=1024, got 1000000000",
            ),
            // Given but empty: refused, not taken for the roofline of an omitted curve.
            (
                r#"{"name": "x", "gpus": 8, "scale_up_gbytes_per_s": 1, "bf16_tflops": 1, "hbm_tbytes_per_s": 1, "gemm_efficiency": []}"#,
                "gemm_efficiency needs at least one [tokens, efficiency] point (omit the field",
            ),
            (
                r#"{"name": "x", "gpus": 8, "scale_up_gbytes_per_s": -1, "bf16_tflops": 1, "hbm_tbytes_per_s": 1}"#,
                "scale_up_gbytes_per_s must be a positive number",
            ),
            (
                r#"{"name": "x", "gpus": 8, "scale_up_gbytes_per_s": 1, "bf16_tflops": 1, "hbm_tbytes_per_s": 1, "link_efficiency": 1.5}"#,
                "link_efficiency must be in (0, 1]",
            ),
            (
                r#"{"name": "x", "gpus": 8, "scale_up_gbytes_per_s": 1, "bf16_tflops": 1, "hbm_tbytes_per_s": 1, "gemm_efficiency": [[10, 0.5], [5, 0.6]]}"#,
                "strictly increasing",
            ),
            (
                r#"{"name": "x", "gpus": 8, "scale_up_gbytes_per_s": 1, "bf16_tflops": 1, "hbm_tbytes_per_s": 1, "typo": 1}"#,
                "unknown field `typo`",
            ),
            (
                r#"{"name": "x", "gpus": 8}"#,
                "missing field `scale_up_gbytes_per_s`",
            ),
            // Finite but absurd figures made every time infinite (`inf`, `null` in JSON).
            (
                r#"{"name": "x", "gpus": 8, "scale_up_gbytes_per_s": 1, "bf16_tflops": 1e-300, "hbm_tbytes_per_s": 1}"#,
                "bf16_tflops must be a positive number from 1e-9 to 1e9, got 1e-300",
            ),
            (
                r#"{"name": "x", "gpus": 8, "scale_up_gbytes_per_s": 1e300, "bf16_tflops": 1, "hbm_tbytes_per_s": 1}"#,
                "scale_up_gbytes_per_s must be a positive number from 1e-9 to 1e9",
            ),
            (
                r#"{"name": "x", "gpus": 8, "scale_up_gbytes_per_s": 1, "bf16_tflops": 1, "hbm_tbytes_per_s": 1, "link_latency_us": 1e300}"#,
                "link_latency_us must be a non-negative number up to 1e9",
            ),
            (
                r#"{"name": "x", "gpus": 8, "scale_up_gbytes_per_s": 1, "bf16_tflops": 1, "hbm_tbytes_per_s": 1, "attention_efficiency": 1e-300}"#,
                "attention_efficiency must be in (0, 1] (at least 1e-9)",
            ),
            (
                r#"{"name": "x", "gpus": 8, "scale_up_gbytes_per_s": 1, "bf16_tflops": 1, "hbm_tbytes_per_s": 1, "gemm_efficiency": [[1, 0.5], [1e300, 0.6]]}"#,
                "at most 1e12",
            ),
        ];
        for (text, want) in cases {
            let err = Rack::from_json(text, "r.json").unwrap_err().to_string();
            assert!(err.contains(want), "{err} lacks {want}");
            assert!(err.starts_with("rack file r.json: "), "{err}");
            assert!(!err.contains('\n'), "{err}");
        }
    }

    #[test]
    fn explicit_curves_interpolate_in_log_log() {
        let mut rack = Rack::nvl72();
        rack.gemm_efficiency = vec![[16.0, 0.1], [256.0, 0.4], [4096.0, 0.8]];
        // Halfway between 16 and 256 in log space (64 rows): geometric mean of 0.1 and 0.4.
        assert!((rack.gemm_efficiency_at(64.0) - 0.2).abs() < 1e-12);
        assert!((rack.gemm_efficiency_at(1e6) - 0.8).abs() < 1e-12);
        assert!((rack.gemm_efficiency_at(8.0) - 0.05).abs() < 1e-12);
    }
}
