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

/// Interleaved partial sums of the row loops: independent additions that vectorise.
const LANES: usize = 4;

/// Newton steps at most when solving for `tau` (from the previous row's root it converges in
/// two or three).
const MAX_NEWTON_STEPS: usize = 60;

/// Taylor coefficients of `e^r`, highest degree (11) first.
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

/// `e^x` (about 1e-308 or less below -708), from IEEE arithmetic alone: the same bits on every
/// machine (a libm's `exp` may differ in the last bit between versions and CPUs) and
/// branch-free, so loops over it vectorise. A degree-11 polynomial: error below 1e-15 relative.
#[inline]
pub(crate) fn exp(x: f64) -> f64 {
    exp_taylor(x, &INV_FACTORIALS)
}

/// [`exp`] to about 2e-10 relative (degree 8, three fewer multiply-adds): for the inclusion
/// probabilities, whose own approximation is off by about 1%.
#[inline]
fn exp_coarse(x: f64) -> f64 {
    exp_taylor(x, &INV_FACTORIALS[3..])
}

/// `x = n ln 2 + r` with `|r| <= ln 2 / 2` (`n` rounded by the 1.5 * 2^52 trick), the Taylor
/// polynomial with `coefficients` (highest degree first) in `r`, scaled by `2^n` built in the
/// exponent bits.
#[inline]
fn exp_taylor(x: f64, coefficients: &[f64]) -> f64 {
    const LN2_HI: f64 = 6.931_471_803_691_238e-1;
    const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
    const ROUND: f64 = 6_755_399_441_055_744.0; // 1.5 * 2^52
    let x = x.clamp(-708.0, 709.0);
    let shifted = x * std::f64::consts::LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let mut poly = coefficients[0];
    for c in &coefficients[1..] {
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
    /// Scratch: one draw's counts (whole numbers), each expert's variance, and the units each
    /// reaches in the row sum's correction.
    count: Vec<f64>,
    spread: Vec<f64>,
    reached: Vec<f64>,
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
            let (f, slope) = self.inclusion_at(weights, tau, k);
            if slope <= 0.0 {
                break;
            }
            let next = (tau - f / slope).max(floor);
            // Converged: pi (at tau) is within 1e-6 relative of the root's, far inside
            // Rosen's own error, and is scaled to sum to k below.
            if (next - tau).abs() <= tau * 1e-6 {
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

    /// Sets `pi = 1 - exp(-w tau)` and returns `f(tau) = sum pi - k` and its slope
    /// `sum w exp(-w tau)`. Two passes, so both vectorise: the exponentials, then the sums in
    /// [`LANES`] interleaved partial sums.
    fn inclusion_at(&mut self, weights: &[f64], tau: f64, k: f64) -> (f64, f64) {
        for (p, &w) in self.pi.iter_mut().zip(weights) {
            *p = exp_coarse(-w * tau);
        }
        let (mut f, mut slope) = ([0.0; LANES], [0.0; LANES]);
        let mut pi = self.pi.chunks_exact_mut(LANES);
        let mut w = weights.chunks_exact(LANES);
        for (p, w) in (&mut pi).zip(&mut w) {
            for j in 0..LANES {
                slope[j] += w[j] * p[j];
                p[j] = 1.0 - p[j];
                f[j] += p[j];
            }
        }
        for (p, &w) in pi.into_remainder().iter_mut().zip(w.remainder()) {
            slope[0] += w * *p;
            *p = 1.0 - *p;
            f[0] += *p;
        }
        (f.iter().sum::<f64>() - k, slope.iter().sum())
    }

    /// Adds `tokens` tokens' expert counts (each token `top_k` distinct experts) to `row`.
    ///
    /// Counts are held as whole `f64`s (exact below 2^53) until the end: x86-64 before AVX-512
    /// has no packed float-to-integer conversion, so conversions in the loops would keep them
    /// scalar.
    pub(crate) fn draw<R: Rng>(&mut self, tokens: u64, top_k: usize, rng: &mut R, row: &mut [u64]) {
        if tokens == 0 {
            return;
        }
        let t = tokens as f64;
        let experts = self.pi.len();
        let (count, spread, reached) = (&mut self.count, &mut self.spread, &mut self.reached);
        count.resize(experts, 0.0);
        spread.resize(experts, 0.0);
        reached.resize(experts, 0.0);
        // Pass 1, in expert order (the random stream): exact draws for rare outcomes (their
        // normal a NaN), a standard normal (kept in `spread` for now) for the rest.
        for ((c, z), &p) in count.iter_mut().zip(spread.iter_mut()).zip(&self.pi) {
            let rare = p.min(1.0 - p);
            if t * rare < NORMAL_FROM_MEAN {
                let x = invert_binomial(tokens, rare, rng) as f64;
                *c = if p <= 0.5 { x } else { t - x };
                *z = f64::NAN;
            } else {
                *z = StandardNormal.sample(rng);
            }
        }
        // Pass 2, branch-free: the normals become counts, the mean plus sqrt(T p (1 - p)) z
        // clamped to 0..=T and rounded to nearest, and `spread` becomes each expert's variance
        // `T p (1 - p)`, over which the row sum's miss is spread below.
        for ((c, s), &p) in count.iter_mut().zip(spread.iter_mut()).zip(&self.pi) {
            let (z, variance) = (*s, t * p * (1.0 - p));
            let normal = round((t * p + variance.sqrt() * z).max(0.0).min(t));
            *c = if z.is_nan() { *c } else { normal };
            *s = variance + 1e-9;
        }
        let target = (tokens * top_k as u64) as f64;
        let mut sum = lane_sum(count.iter().copied());
        // Clamping may leave a remainder, so repeat (an expert at its bound has no room and
        // drops out of the next pass).
        while sum != target {
            let adding = sum < target;
            let gap = (sum - target).abs();
            let room = |c: f64| if adding { t - c } else { c };
            // Each expert's share of the gap, in proportion to its variance where there is room.
            // Systematic allocation: one uniform offset, each expert gets the whole units its
            // share crosses (`reached` holds the running offset: the only serial pass).
            for (r, (&c, &v)) in reached.iter_mut().zip(count.iter().zip(spread.iter())) {
                *r = if room(c) > 0.0 { v } else { 0.0 };
            }
            let per_variance = gap / lane_sum(reached.iter().copied());
            let mut acc: f64 = rng.gen();
            let start = floor(acc);
            for r in reached.iter_mut() {
                acc += *r * per_variance;
                *r = floor(acc);
            }
            let mut moved = 0.0;
            let mut before = start;
            for (c, r) in count.iter_mut().zip(reached.iter_mut()) {
                let give = min(*r - before, room(*c));
                before = *r;
                *r = give;
                *c += if adding { give } else { -give };
                moved += give;
            }
            // Rounding can carry the units a little past the gap: the last ones go back.
            for (c, &give) in count.iter_mut().zip(reached.iter()).rev() {
                if moved <= gap {
                    break;
                }
                let back = min(moved - gap, give);
                *c -= if adding { back } else { -back };
                moved -= back;
            }
            sum += if adding { moved } else { -moved };
        }
        for (r, &c) in row.iter_mut().zip(count.iter()) {
            *r += whole(c);
        }
    }
}

/// 2^52: adding it to a non-negative `f64` below 2^52 leaves the value rounded to an integer
/// in the low mantissa bits.
const TWO_52: f64 = 4_503_599_627_370_496.0;

/// `x` (in `0..2^52`) rounded to the nearest integer, ties to even.
#[inline]
fn round(x: f64) -> f64 {
    (x + TWO_52) - TWO_52
}

/// `x` (in `0..2^52`) rounded down, without a libm call (`f64::floor` is one on baseline
/// x86-64).
#[inline]
fn floor(x: f64) -> f64 {
    let r = round(x);
    if r > x {
        r - 1.0
    } else {
        r
    }
}

/// The smaller of two numbers (neither a NaN: no NaN handling, so one instruction).
#[inline]
fn min(a: f64, b: f64) -> f64 {
    if a < b {
        a
    } else {
        b
    }
}

/// A whole `f64` in `0..2^52` as an integer, by its bits.
#[inline]
fn whole(x: f64) -> u64 {
    (x + TWO_52).to_bits() - TWO_52.to_bits()
}

/// Sum of `values` in [`LANES`] interleaved partial sums (they vectorise; whole numbers below
/// 2^53 sum exactly in any order).
fn lane_sum(values: impl IntoIterator<Item = f64>) -> f64 {
    let mut lanes = [0.0; LANES];
    for (i, v) in values.into_iter().enumerate() {
        lanes[i % LANES] += v;
    }
    lanes.iter().sum()
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
    let mut r = exp(n as f64 * (-p).ln_1p());
    let mut u: f64 = rng.gen();
    let mut x = 0u64;
    while u > r && x < n {
        u -= r;
        x += 1;
        // P(x) / P(x - 1) = a / x - s; a table's reciprocal instead of a division.
        let inverse = RECIPROCALS
            .get(x as usize)
            .copied()
            .unwrap_or_else(|| 1.0 / x as f64);
        r *= a * inverse - s;
    }
    x
}

/// `1 / x` for the first counts [`invert_binomial`] walks through (its means stay below
/// [`NORMAL_FROM_MEAN`]).
const RECIPROCALS: [f64; 64] = {
    let mut table = [0.0; 64];
    let mut x = 1;
    while x < 64 {
        table[x] = 1.0 / x as f64;
        x += 1;
    }
    table
};

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
        for i in -7000..=0 {
            let x = i as f64 * 0.01;
            assert!((exp_coarse(x) - x.exp()).abs() <= 3e-10 * x.exp(), "{x}");
        }
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
