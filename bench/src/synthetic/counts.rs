//! The count sampler: a rank's row of expert counts for `T` tokens drawn at once, in `O(E)`
//! instead of `O(T k)` token draws, with the statistics of [`super::sample`]'s per-token
//! sampler (successive sampling of `k` distinct experts per token):
//!
//! 1. **Inclusion probabilities.** Successive sampling picks expert `e` in a token with
//!    probability `pi[e]`, which has no closed form; Rosén's approximation for successive
//!    (exponential order) sampling gives `pi[e] = 1 - exp(-w[e] tau)`, with `tau` solving
//!    `sum pi = k`. It is within about 1% (relative) of the exact probabilities on the hottest
//!    experts of the simulator's popularities, within 3% on cold ones
//!    (`docs/simulate.md`, "Sampler validation").
//! 2. **Counts.** Tokens are independent, so expert `e`'s count is `Binomial(T, pi[e])`: drawn
//!    exactly when its variance is small, as a rounded normal otherwise.
//! 3. **Exact row sums.** Every token picks exactly `k` experts, so the row must sum to `T k`;
//!    the independent draws miss it by about `sqrt(T sum pi (1 - pi))`, and the difference is
//!    spread over the experts in proportion to their variances (the Gaussian conditioning on
//!    the sum), never taking an expert below 0 or above `T` (distinct experts per token).

use rand::Rng;
use rand_distr::{Distribution, StandardNormal};

/// Expected count (of the rarer outcome) from which a count is drawn as a rounded normal
/// instead of an exact binomial (skewness below 0.3 there).
const NORMAL_FROM_MEAN: f64 = 12.0;

/// Newton steps at most when solving for `tau` (it converges in about six).
const MAX_NEWTON_STEPS: usize = 60;

/// `e^x` (about 1e-308 or less below -708), from IEEE arithmetic alone: the same bits on every
/// machine (a libm's `exp` may differ in the last bit between versions and CPUs) and
/// branch-free, so loops over it vectorise. `x = n ln 2 + r` with `|r| <= ln 2 / 2` (`n`
/// rounded by the 1.5 * 2^52 trick), a degree-11 Taylor polynomial in `r` (error below 1e-15
/// relative), scaled by `2^n` built in the exponent bits.
#[inline]
pub(crate) fn exp(x: f64) -> f64 {
    const LN2_HI: f64 = 6.931_471_803_691_238e-1;
    const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
    const ROUND: f64 = 6_755_399_441_055_744.0; // 1.5 * 2^52
    const INV_FACTORIALS: [f64; 12] = [
        1.0 / 39_916_800.0,
        1.0 / 3_628_800.0,
        1.0 / 362_880.0,
        1.0 / 40_320.0,
        1.0 / 5_040.0,
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        1.0 / 2.0,
        1.0,
        1.0,
    ];
    let x = x.clamp(-708.0, 709.0);
    let shifted = x * std::f64::consts::LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let mut poly = INV_FACTORIALS[0];
    for c in &INV_FACTORIALS[1..] {
        poly = poly * r + c;
    }
    // The low mantissa bits of `shifted` hold n; shifted into the exponent field with the bias.
    poly * f64::from_bits(shifted.to_bits().wrapping_add(1023) << 52)
}

/// Inclusion probabilities of one row (Rosén's approximation), reused row after row.
#[derive(Debug, Clone, Default)]
pub(crate) struct RowCounts {
    /// `pi[e]`: the chance that a token picks expert `e`.
    pi: Vec<f64>,
    /// Scratch: one draw's counts and the variance each expert has room to take.
    drawn: Vec<u64>,
    variance: Vec<f64>,
    /// The previous row's `tau * total weight`: rows of one layer differ by a perturbation, so
    /// it starts the next row's solve close to its root.
    scaled_tau: Option<f64>,
}

impl RowCounts {
    /// Sets the inclusion probabilities of `weights` (positive, any scale) for `top_k` picks.
    pub(crate) fn set_weights(&mut self, weights: &[f64], top_k: usize) {
        let e = weights.len();
        self.pi.resize(e, 0.0);
        if top_k >= e {
            self.pi.fill(1.0);
            return;
        }
        let total: f64 = weights.iter().sum();
        if !(total.is_finite() && total > 0.0) {
            self.pi.fill(top_k as f64 / e as f64);
            return;
        }
        let k = top_k as f64;
        // f(tau) = sum (1 - exp(-w tau)) - k is concave and increasing, and f(k / total) <= 0.
        // Newton's steps from below the root stay below it and converge monotonically; from
        // the previous row's root (usually within a few percent) one step may land below, and
        // a step below k / total is moved back up to it.
        let floor = k / total;
        let mut tau = self.scaled_tau.map_or(floor, |s| (s / total).max(floor));
        for _ in 0..MAX_NEWTON_STEPS {
            // Two passes: the exponentials vectorise, the sums do not.
            for (p, &w) in self.pi.iter_mut().zip(weights) {
                *p = exp(-w * tau);
            }
            let (mut f, mut slope) = (-k, 0.0);
            for (p, &w) in self.pi.iter_mut().zip(weights) {
                slope += w * *p;
                *p = 1.0 - *p;
                f += *p;
            }
            if slope <= 0.0 {
                break;
            }
            let next = (tau - f / slope).max(floor);
            let moved = (next - tau).abs();
            // Converged: pi (at tau) is within 1e-8 relative of the root's (and is scaled to
            // sum to k below).
            if moved <= tau * 1e-8 {
                break;
            }
            tau = next;
        }
        self.scaled_tau = Some(tau * total);
        // Rounding: the probabilities sum to k.
        let scale = k / self.pi.iter().sum::<f64>();
        for p in &mut self.pi {
            *p = (*p * scale).min(1.0);
        }
    }

    /// Adds `tokens` tokens' expert counts (each token `top_k` distinct experts) to `row`.
    pub(crate) fn draw<R: Rng>(&mut self, tokens: u64, top_k: usize, rng: &mut R, row: &mut [u64]) {
        if tokens == 0 {
            return;
        }
        let t = tokens as f64;
        let (drawn, variance) = (&mut self.drawn, &mut self.variance);
        // Pass 1, in expert order (the random stream): exact draws for rare outcomes, a
        // standard normal (kept in `variance` for now) for the rest.
        drawn.clear();
        variance.clear();
        for &p in &self.pi {
            let rare = p.min(1.0 - p);
            if t * rare < NORMAL_FROM_MEAN {
                let x = invert_binomial(tokens, rare, rng);
                drawn.push(if p <= 0.5 { x } else { tokens - x });
                variance.push(f64::NAN);
            } else {
                drawn.push(0);
                variance.push(StandardNormal.sample(rng));
            }
        }
        // Pass 2, branch-light so it vectorises: the normals become counts, the mean plus
        // sqrt(T p (1 - p)) z rounded to nearest and clamped to 0..=T (`as u64` floors
        // non-negative values; negatives become 0). `as i64`: one instruction, unlike `as u64`.
        for ((d, &z), &p) in drawn.iter_mut().zip(variance.iter()).zip(&self.pi) {
            if !z.is_nan() {
                let x = t * p + (t * p * (1.0 - p)).sqrt() * z + 0.5;
                *d = if x <= 0.0 {
                    0
                } else {
                    (x as i64 as u64).min(tokens)
                };
            }
        }
        let target = tokens * top_k as u64;
        let mut sum: u64 = drawn.iter().sum();
        // Spread the difference by variance; clamping may leave a remainder, so repeat (an
        // expert at its bound drops out of the next pass).
        while sum != target {
            let adding = sum < target;
            let gap = sum.abs_diff(target);
            variance.clear();
            variance.extend(drawn.iter().zip(&self.pi).map(|(&d, &p)| {
                let room = if adding { d < tokens } else { d > 0 };
                if room {
                    t * p * (1.0 - p) + 1e-9
                } else {
                    0.0
                }
            }));
            let total: f64 = variance.iter().sum();
            // Systematic allocation: one uniform offset, each expert gets the whole units its
            // share of the gap crosses (`as i64` floors: acc stays non-negative).
            let mut acc: f64 = rng.gen();
            let mut moved = 0;
            let per_variance = gap as f64 / total;
            for e in 0..drawn.len() {
                let share = variance[e] * per_variance;
                let before = acc as i64;
                acc += share;
                let give = (acc as i64 - before) as u64;
                let give = if adding {
                    give.min(tokens - drawn[e])
                } else {
                    give.min(drawn[e])
                }
                .min(gap - moved);
                if adding {
                    drawn[e] += give;
                } else {
                    drawn[e] -= give;
                }
                moved += give;
            }
            sum = if adding { sum + moved } else { sum - moved };
        }
        for (r, &d) in row.iter_mut().zip(drawn.iter()) {
            *r += d;
        }
    }
}

/// `Binomial(n, p)` for `p <= 0.5` and a small mean, by walking the distribution from 0 with
/// one uniform (Kachitvichyanukul and Schmeiser's BINV): about `n p` steps.
fn invert_binomial<R: Rng>(n: u64, p: f64, rng: &mut R) -> u64 {
    if p <= 0.0 {
        return 0;
    }
    let q = 1.0 - p;
    let s = p / q;
    let a = (n as f64 + 1.0) * s;
    let mut r = (n as f64 * (-p).ln_1p()).exp();
    let mut u: f64 = rng.gen();
    let mut x = 0u64;
    while u > r && x < n {
        u -= r;
        x += 1;
        r *= a / x as f64 - s;
    }
    x
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    #[test]
    fn rows_sum_to_tokens_times_k_and_stay_within_tokens() {
        let weights: Vec<f64> = (1..=64).map(|i| (i as f64).powf(-1.2)).collect();
        let mut counts = RowCounts::default();
        counts.set_weights(&weights, 8);
        assert!((counts.pi.iter().sum::<f64>() - 8.0).abs() < 1e-9);
        let mut rng = StdRng::seed_from_u64(4);
        for tokens in [1, 7, 64, 4096] {
            let mut row = vec![0u64; 64];
            counts.draw(tokens, 8, &mut rng, &mut row);
            assert_eq!(row.iter().sum::<u64>(), tokens * 8);
            assert!(row.iter().all(|&c| c <= tokens), "{row:?}");
        }
    }

    #[test]
    fn rosen_is_within_its_known_error_of_exact_enumeration() {
        // 3 of 16 experts, weights spread over e^3: exact inclusion by enumerating every
        // ordered triple. Rosen's approximation is off by at most 0.0122 here (1.2 points; it
        // improves with more experts and picks: about 1% relative at 128 experts and top-8).
        let w: Vec<f64> = (0..16).map(|i| (-1.5 + 0.2 * i as f64).exp()).collect();
        let total: f64 = w.iter().sum();
        let mut exact = [0.0; 16];
        for a in 0..16 {
            for b in (0..16).filter(|&b| b != a) {
                for c in (0..16).filter(|&c| c != a && c != b) {
                    let p = w[a] / total * w[b] / (total - w[a]) * w[c] / (total - w[a] - w[b]);
                    exact[a] += p;
                    exact[b] += p;
                    exact[c] += p;
                }
            }
        }
        let mut counts = RowCounts::default();
        counts.set_weights(&w, 3);
        let worst = counts
            .pi
            .iter()
            .zip(exact)
            .map(|(got, want)| (got - want).abs())
            .fold(0.0, f64::max);
        assert!(
            (0.010..0.0125).contains(&worst),
            "{worst}: {:?} vs {exact:?}",
            counts.pi
        );
    }

    #[test]
    fn counts_have_the_binomial_mean_and_variance() {
        // Expert 0 at probability p beside 63 sharing the rest of 8 picks: its count is
        // Binomial(n, p) through the exact path, the normal path and the flip p > 0.5 (the row
        // sum's correction takes about 1/64 of its variance).
        let mut rng = StdRng::seed_from_u64(9);
        for (n, p) in [
            (2048u64, 0.001),
            (2048, 0.004),
            (64, 0.1),
            (4096, 0.2),
            (100, 0.97),
        ] {
            let mut pi = vec![(8.0 - p) / 63.0; 64];
            pi[0] = p;
            let mut counts = RowCounts {
                pi,
                ..RowCounts::default()
            };
            let draws: Vec<f64> = (0..20_000)
                .map(|_| {
                    let mut row = [0u64; 64];
                    counts.draw(n, 8, &mut rng, &mut row);
                    row[0] as f64
                })
                .collect();
            let mean = draws.iter().sum::<f64>() / draws.len() as f64;
            let var = draws.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / draws.len() as f64;
            let (m, v) = (n as f64 * p, n as f64 * p * (1.0 - p));
            // 5 standard errors of the mean; the variance within 5%.
            assert!(
                (mean - m).abs() < 5.0 * (v / 20_000.0).sqrt(),
                "{n} {p}: {mean} vs {m}"
            );
            assert!((var / v - 1.0).abs() < 0.05, "{n} {p}: {var} vs {v}");
        }
    }

    #[test]
    fn exp_matches_the_library_exp() {
        for i in -6980..=6990 {
            let x = i as f64 * 0.1013;
            let (got, want) = (exp(x), x.exp());
            assert!((got - want).abs() <= 1e-14 * want, "{x}: {got} vs {want}");
        }
        assert!(exp(-800.0) < 1e-300);
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn degenerate_rows() {
        let mut counts = RowCounts::default();
        counts.set_weights(&[1.0, 1.0], 2);
        assert_eq!(counts.pi, vec![1.0, 1.0]);
        counts.set_weights(&[0.0, 0.0, 0.0, 0.0], 2);
        assert_eq!(counts.pi, vec![0.5; 4]);
        let mut row = vec![0; 4];
        counts.draw(10, 2, &mut StdRng::seed_from_u64(0), &mut row);
        assert_eq!(row.iter().sum::<u64>(), 20);
    }
}
