//! Rotary position embeddings with transformers' frequency schedules (default, linear, YaRN),
//! in the half-split (Llama/Qwen) or pairwise-interleaved (DeepSeek) layout.

use candle_core::{Device, Tensor};

use crate::config::{RopeConfig, RopeScaling};
use crate::error::Result;

/// Precomputed inverse frequencies and the YaRN magnitude correction.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
    /// Multiplies cos and sin (YaRN's `attention_factor`; 1 otherwise).
    attention_factor: f32,
    interleaved: bool,
}

impl Rope {
    /// Frequencies for `dim` rotary dimensions, computed in f32 the way transformers does so
    /// logits agree to the last bits.
    pub fn new(config: &RopeConfig, dim: usize, interleaved: bool) -> Self {
        let base = config.theta as f32;
        let pos_freqs: Vec<f32> = (0..dim / 2)
            .map(|i| base.powf((2 * i) as f32 / dim as f32))
            .collect();
        let (inv_freq, attention_factor) = match &config.scaling {
            RopeScaling::None => (pos_freqs.iter().map(|p| 1.0 / p).collect(), 1.0),
            RopeScaling::Linear { factor } => (
                pos_freqs.iter().map(|p| 1.0 / p / *factor as f32).collect(),
                1.0,
            ),
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
                attention_factor,
                truncate,
            } => {
                let (low, high) = yarn_correction_range(
                    (*beta_fast, *beta_slow),
                    dim,
                    config.theta,
                    *original_max_position_embeddings,
                    *truncate,
                );
                let inv: Vec<f32> = pos_freqs
                    .iter()
                    .enumerate()
                    .map(|(i, p)| {
                        let extrapolation = 1.0 / p;
                        let interpolation = 1.0 / (*factor as f32 * p);
                        let span = if low == high { 0.001 } else { high - low };
                        let ramp = ((i as f32 - low) / span).clamp(0.0, 1.0);
                        let extrapolation_factor = 1.0 - ramp;
                        interpolation * (1.0 - extrapolation_factor)
                            + extrapolation * extrapolation_factor
                    })
                    .collect();
                let attention_factor = match attention_factor {
                    Some(explicit) => *explicit,
                    None if *mscale != 0.0 && *mscale_all_dim != 0.0 => {
                        yarn_mscale(*factor, *mscale) / yarn_mscale(*factor, *mscale_all_dim)
                    }
                    None => yarn_mscale(*factor, 1.0),
                };
                (inv, attention_factor as f32)
            }
        };
        Self {
            inv_freq,
            attention_factor,
            interleaved,
        }
    }

    /// The inverse frequencies, `[dim/2]`, as the CPU computes them: the GPU rotary kernel is
    /// handed this table so both paths rotate by the same angles.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// The factor cos and sin are multiplied by (YaRN's magnitude correction; 1 otherwise).
    pub fn attention_factor(&self) -> f32 {
        self.attention_factor
    }

    /// Whether pairs are adjacent dimensions (DeepSeek) rather than the two halves.
    pub fn interleaved(&self) -> bool {
        self.interleaved
    }

    /// `cos` and `sin` tables, `[n, dim/2]`, for positions `start..start + n`.
    pub fn tables(&self, start: usize, n: usize) -> Result<(Tensor, Tensor)> {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(n * half);
        let mut sin = Vec::with_capacity(n * half);
        for pos in start..start + n {
            for &f in &self.inv_freq {
                let angle = (pos as f32 * f) as f64;
                cos.push((angle.cos() as f32) * self.attention_factor);
                sin.push((angle.sin() as f32) * self.attention_factor);
            }
        }
        Ok((
            Tensor::from_vec(cos, (n, half), &Device::Cpu)?,
            Tensor::from_vec(sin, (n, half), &Device::Cpu)?,
        ))
    }

    /// Rotates `x` of shape `[heads, n, dim]` holding positions `start..start + n`.
    pub fn apply(&self, x: &Tensor, start: usize) -> Result<Tensor> {
        let (heads, n, dim) = x.dims3()?;
        let (cos, sin) = self.tables(start, n)?;
        let x = x.contiguous()?.reshape((1, heads, n, dim))?;
        let rotated = if self.interleaved {
            candle_nn::rotary_emb::rope_i(&x, &cos, &sin)?
        } else {
            candle_nn::rotary_emb::rope(&x, &cos, &sin)?
        };
        Ok(rotated.reshape((heads, n, dim))?)
    }
}

/// YaRN's magnitude scale `0.1 * m * ln(s) + 1` (1 for s <= 1).
pub fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// The dimension range over which YaRN blends from extrapolation to interpolation.
fn yarn_correction_range(
    (beta_fast, beta_slow): (f64, f64),
    dim: usize,
    base: f64,
    original_max: usize,
    truncate: bool,
) -> (f32, f32) {
    let correction_dim = |rotations: f64| {
        (dim as f64 * (original_max as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln())
            / (2.0 * base.ln())
    };
    let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
    if truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, high) = (low.max(0.0), high.min(dim as f64 - 1.0));
    (low as f32, high as f32)
}
