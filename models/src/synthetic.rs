//! Synthetic weights: a tensor's values generated from a seed where they are used, the same bf16
//! values on the host ([`Synthetic::value`]) and on the device (`fill_synthetic`, convert.cu),
//! so a model of any size runs without a file ([`crate::Checkpoint::synthetic`]).

/// The values of a tensor of a synthetic checkpoint, generated where they are used (on the
/// host by [`RawTensor::to_f32`], on the device by the GPU loader's `fill_synthetic` kernel,
/// the same bf16 values on both): a model of any size without a file or host memory.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Synthetic {
    /// Every element this value (norm weights 1, biases 0).
    Constant(f32),
    /// Element `i` uniform in `[-bound, bound)` from a hash of `(seed, first + i)`, rounded to
    /// bf16.
    Uniform { seed: u64, bound: f32, first: u64 },
}

impl Synthetic {
    /// Element `i` (bf16-exact).
    pub fn value(&self, i: u64) -> f32 {
        match *self {
            Self::Constant(v) => half::bf16::from_f32(v).to_f32(),
            Self::Uniform { seed, bound, first } => {
                let mut z = seed.wrapping_add((first + i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                z ^= z >> 31;
                let unit = (z >> 40) as f32 * (1.0 / 16_777_216.0);
                half::bf16::from_f32((2.0 * unit - 1.0) * bound).to_f32()
            }
        }
    }

    /// The values of elements `offset..` (a slice along a tensor's first dimension).
    pub(crate) fn skip(self, offset: u64) -> Self {
        match self {
            Self::Uniform { seed, bound, first } => Self::Uniform {
                seed,
                bound,
                first: first + offset,
            },
            constant => constant,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_values_have_the_asked_spread_and_slices_continue_the_stream() {
        let values = Synthetic::Uniform {
            seed: 3,
            bound: 0.5,
            first: 0,
        };
        let n = 100_000u64;
        let all: Vec<f32> = (0..n).map(|i| values.value(i)).collect();
        assert!(all.iter().all(|v| (-0.5..=0.5).contains(v)));
        let mean = all.iter().map(|&v| f64::from(v)).sum::<f64>() / n as f64;
        let var = all.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / n as f64;
        // Uniform on [-b, b): mean 0, variance b^2 / 3.
        assert!(mean.abs() < 5e-3, "{mean}");
        assert!((var - 0.25 / 3.0).abs() < 2e-3, "{var}");
        assert!(all.iter().all(|&v| half::bf16::from_f32(v).to_f32() == v));
        let tail = values.skip(40);
        assert_eq!(tail.value(0), values.value(40));
        assert_eq!(Synthetic::Constant(1.0).value(7), 1.0);
    }
}
