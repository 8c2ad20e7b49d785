//! Turning a row of logits into the next token, and reporting log-probabilities the way the
//! OpenAI API does.
//!
//! Two things are kept apart on purpose:
//! - the *reported* logprobs are always `log_softmax(logits)` at temperature 1, whatever the
//!   sampling settings (this is what OpenAI and vLLM return, and what evaluation harnesses that
//!   score prompts with `echo` + `logprobs` expect);
//! - the *sampling* distribution is `softmax(logits' / T)` restricted by top-k, then min-p, then
//!   top-p, and renormalised, where `logits'` are the logits after the request's penalties and
//!   `logit_bias` ([`penalties`]).
//!
//! Every function here takes untrusted numbers (logits straight out of a forward pass, parameters
//! straight out of a request) and reports problems as [`SamplingError`] rather than panicking.

use std::cmp::Ordering;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use penalties::LogitAdjuster;

mod params;
pub mod penalties;

pub use params::{
    SamplingError, SamplingParams, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY, MAX_STOP_STRINGS,
    MAX_TEMPERATURE, REPETITION_PENALTY_RANGE,
};

/// One token with its logprob and the most likely alternatives at the same position, all as
/// `log_softmax(logits)` at temperature 1.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// `(token, logprob)`, most likely first; equal logprobs list the lower id first.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// A sampled token is reported exactly like a scored prompt token.
pub type SampledToken = TokenLogprob;

/// The logprob of `token` under `logits`, plus the `top_n` most likely tokens: prompt logprobs
/// for OpenAI `echo`. `top_n` larger than the vocabulary returns the whole vocabulary.
pub fn token_logprob(
    logits: &[f32],
    token: u32,
    top_n: usize,
) -> Result<TokenLogprob, SamplingError> {
    let stats = LogitStats::of(logits)?;
    let logit = logits
        .get(token as usize)
        .ok_or(SamplingError::TokenOutOfRange {
            token,
            vocab_size: logits.len(),
        })?;
    Ok(TokenLogprob {
        token,
        logprob: stats.logprob(*logit),
        top_logprobs: top_logprobs(logits, &stats, top_n),
    })
}

/// Draws tokens for one sequence.
///
/// Each sequence owns its RNG, so a seeded request is reproducible no matter which other
/// requests share its batches or in which order the scheduler samples them.
#[derive(Debug, Clone)]
pub struct Sampler {
    temperature: f64,
    top_p: f64,
    /// 0 = off.
    top_k: usize,
    /// 0 = off.
    min_p: f64,
    /// Penalties and bias, when the request asked for any.
    adjuster: Option<LogitAdjuster>,
    /// Alternatives to report per token (0 when logprobs were not requested).
    top_logprobs: usize,
    rng: StdRng,
    /// Reused across steps so sampling a 150k vocabulary does not allocate every token.
    candidates: Vec<Candidate>,
    /// The row with excluded tokens masked ([`Sampler::sample_excluding`]), reused likewise.
    masked: Vec<f32>,
}

impl Sampler {
    /// A sampler for `params` on a sequence that starts with `prompt` (what the repetition
    /// penalty looks at), seeded with `params.seed`, or with `fallback_seed` when the request
    /// gave none (the scheduler should draw it per request so unseeded requests differ).
    ///
    /// Fails on the parameters that sampling itself depends on (temperature, top_p, min_p,
    /// penalties, bias values, logprobs).
    pub fn new(
        params: &SamplingParams,
        prompt: &[u32],
        fallback_seed: u64,
    ) -> Result<Self, SamplingError> {
        params.validate_sampling()?;
        Ok(Self::from_checked(params, prompt, fallback_seed))
    }

    /// [`Sampler::new`] for parameters already checked: the engine builds its sequences only
    /// from a [`crate::ValidatedRequest`], whose parameters passed [`SamplingParams::validate`].
    pub(crate) fn from_checked(
        params: &SamplingParams,
        prompt: &[u32],
        fallback_seed: u64,
    ) -> Self {
        Self {
            temperature: f64::from(params.temperature),
            top_p: f64::from(params.top_p),
            top_k: params.top_k as usize,
            min_p: f64::from(params.min_p),
            adjuster: LogitAdjuster::new(params, prompt),
            top_logprobs: params.logprobs.unwrap_or(0) as usize,
            rng: StdRng::seed_from_u64(params.seed.unwrap_or(fallback_seed)),
            candidates: Vec::new(),
            masked: Vec::new(),
        }
    }

    /// Picks the next token from one row of logits (one entry per vocabulary id); its logprob
    /// and the alternatives are those of the row as given.
    pub fn sample(&mut self, logits: &[f32]) -> Result<SampledToken, SamplingError> {
        self.sample_excluding(logits, &[])
    }

    /// [`Sampler::sample`], except that no id of `excluded` is drawn (vLLM's `min_tokens`
    /// keeps end-of-sequence away this way); the logprobs are still those of the row as given.
    /// Ids outside the row are ignored.
    pub fn sample_excluding(
        &mut self,
        logits: &[f32],
        excluded: &[u32],
    ) -> Result<SampledToken, SamplingError> {
        let stats = LogitStats::of(logits)?;
        let mut adjuster = self.adjuster.take();
        let adjusted = match adjuster.as_mut() {
            Some(adjuster) => adjuster.apply(logits),
            None => logits,
        };
        let picked = if excluded.is_empty() {
            LogitStats::of(adjusted).map(|s| self.pick(adjusted, &s))
        } else {
            // The lowest finite logit: its weight is 0 at any temperature, and the row stays
            // finite, as `LogitStats` requires.
            let mut masked = std::mem::take(&mut self.masked);
            masked.clear();
            masked.extend_from_slice(adjusted);
            for &id in excluded {
                if let Some(l) = masked.get_mut(id as usize) {
                    *l = f32::MIN;
                }
            }
            let picked = LogitStats::of(&masked).map(|s| self.pick(&masked, &s));
            self.masked = masked;
            picked
        };
        if let (Some(adjuster), Ok(token)) = (adjuster.as_mut(), &picked) {
            adjuster.record(*token);
        }
        self.adjuster = adjuster;
        let token = picked?;
        Ok(TokenLogprob {
            token,
            logprob: stats.logprob(logits[token as usize]),
            top_logprobs: top_logprobs(logits, &stats, self.top_logprobs),
        })
    }

    /// The argmax at temperature 0, else a draw.
    fn pick(&mut self, logits: &[f32], stats: &LogitStats) -> u32 {
        if self.temperature == 0.0 {
            stats.argmax
        } else {
            self.draw(logits, stats).0
        }
    }

    /// Draws from `softmax(logits / T)` after top-k, min-p and top-p; returns `(token, logit)`.
    fn draw(&mut self, logits: &[f32], stats: &LogitStats) -> (u32, f32) {
        let cands = &mut self.candidates;
        cands.clear();
        // Ids fit in u32: `LogitStats::of` rejected longer rows.
        cands.extend(logits.iter().enumerate().map(|(i, &logit)| Candidate {
            token: i as u32,
            logit,
            weight: 0.0,
        }));
        let top_k_active = self.top_k != 0 && self.top_k < cands.len();
        if top_k_active {
            // Linear-time partial selection: no full sort of the vocabulary for small k.
            cands.select_nth_unstable_by(self.top_k - 1, Candidate::rank);
            cands.truncate(self.top_k);
        }
        // Weights relative to the row maximum (always a candidate), so the largest is exactly 1
        // and nothing overflows however small T is.
        let max = f64::from(stats.max);
        let inv_t = 1.0 / self.temperature;
        let mut total = 0.0;
        for c in cands.iter_mut() {
            // The exponent in f64 (1/T may exceed f32's range), the exponential in f32: it is the
            // costly part, and weights below f32's range are negligible next to the maximum's 1.
            c.weight = f64::from((((f64::from(c.logit) - max) * inv_t) as f32).exp());
            total += c.weight;
        }
        if self.min_p > 0.0 {
            // The most likely token weighs exactly 1, so `min_p` is the weight floor.
            let floor = self.min_p;
            cands.retain(|c| c.weight >= floor);
            total = cands.iter().map(|c| c.weight).sum();
        }
        if self.top_p < 1.0 {
            if !top_k_active {
                // Tokens lighter than this floor together weigh less than (1 - top_p) of the
                // mass, so the nucleus never reaches them: dropping them before sorting is exact
                // and leaves only a handful of tokens for peaked distributions.
                let floor = (1.0 - self.top_p) * total / cands.len() as f64;
                cands.retain(|c| c.weight >= floor);
            }
            cands.sort_unstable_by(Candidate::rank);
            let target = self.top_p * total;
            let mut mass = 0.0;
            let keep = cands
                .iter()
                .position(|c| {
                    mass += c.weight;
                    mass >= target
                })
                .map_or(cands.len(), |i| i + 1);
            cands.truncate(keep);
            total = cands.iter().map(|c| c.weight).sum();
        }
        let mut u = self.rng.gen::<f64>() * total;
        for c in cands.iter() {
            if u < c.weight {
                return (c.token, c.logit);
            }
            u -= c.weight;
        }
        // Rounding left `u` just above the summed weights: the last candidate that can be drawn
        // at all is the right pick (never one of weight 0, such as an excluded token).
        cands
            .iter()
            .rev()
            .find(|c| c.weight > 0.0)
            .map_or((stats.argmax, stats.max), |c| (c.token, c.logit))
    }
}

/// A vocabulary entry during sampling.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    token: u32,
    logit: f32,
    /// Unnormalised probability `exp((logit - max) / T)`.
    weight: f64,
}

impl Candidate {
    fn rank(a: &Self, b: &Self) -> Ordering {
        rank((a.token, a.logit), (b.token, b.logit))
    }
}

/// Most likely first, ties broken by the lower id, so selections are deterministic. Sorting on
/// logits rather than weights keeps tokens whose weights both underflowed to 0 in true order.
fn rank(a: (u32, f32), b: (u32, f32)) -> Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// One pass over a row of logits: validity, argmax and the log-partition function.
struct LogitStats {
    argmax: u32,
    max: f32,
    log_sum_exp: f64,
}

impl LogitStats {
    fn of(logits: &[f32]) -> Result<Self, SamplingError> {
        let Some(&first) = logits.first() else {
            return Err(SamplingError::EmptyLogits);
        };
        if u32::try_from(logits.len() - 1).is_err() {
            return Err(SamplingError::TooManyLogits { len: logits.len() });
        }
        let (mut argmax, mut max) = (0, first);
        for (index, &value) in logits.iter().enumerate() {
            if !value.is_finite() {
                return Err(SamplingError::NonFiniteLogit { index, value });
            }
            // Strict `>`: the first (lowest) id wins ties.
            if value > max {
                (argmax, max) = (index as u32, value);
            }
        }
        // Max-subtracted, so no term exceeds 1 and nothing overflows; f32 exponentials (the costly
        // part) summed in f64, so no precision is lost over 150k terms.
        let sum: f64 = logits.iter().map(|&x| f64::from((x - max).exp())).sum();
        Ok(Self {
            argmax,
            max,
            log_sum_exp: f64::from(max) + sum.ln(),
        })
    }

    fn logprob(&self, logit: f32) -> f32 {
        (f64::from(logit) - self.log_sum_exp) as f32
    }
}

/// The `n` most likely tokens as `(token, logprob)`, most likely first.
fn top_logprobs(logits: &[f32], stats: &LogitStats, n: usize) -> Vec<(u32, f32)> {
    let n = n.min(logits.len());
    if n == 0 {
        return Vec::new();
    }
    let top = if n <= MAX_LOGPROBS as usize {
        top_n_small(logits, n)
    } else {
        top_n_large(logits, n)
    };
    top.into_iter()
        .map(|(token, logit)| (token, stats.logprob(logit)))
        .collect()
}

/// One pass keeping a sorted buffer of `n` entries: almost every logit fails the comparison with
/// the current n-th best, so this is linear in practice and allocation-free beyond `n`.
fn top_n_small(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    for (i, &logit) in logits.iter().enumerate() {
        // Ids arrive in ascending order, so an equal logit never displaces an earlier entry.
        if top.len() == n && top.last().is_some_and(|&(_, worst)| logit <= worst) {
            continue;
        }
        let at = top.partition_point(|&(_, l)| l >= logit);
        top.insert(at, (i as u32, logit));
        top.truncate(n);
    }
    top
}

/// Partial selection then a sort of the selected entries: linear plus `n log n`, for large `n`
/// where the insertion buffer of [`top_n_small`] would be quadratic.
fn top_n_large(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut all: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &logit)| (i as u32, logit))
        .collect();
    if n < all.len() {
        all.select_nth_unstable_by(n - 1, |a, b| rank(*a, *b));
        all.truncate(n);
    }
    all.sort_unstable_by(|a, b| rank(*a, *b));
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            ..SamplingParams::default()
        }
    }

    fn softmax(logits: &[f32], t: f64) -> Vec<f64> {
        let w: Vec<f64> = logits.iter().map(|&x| (f64::from(x) / t).exp()).collect();
        let s: f64 = w.iter().sum();
        w.iter().map(|x| x / s).collect()
    }

    /// Pseudo-random logits in [-8, 8) without touching the sampler's RNG.
    fn random_logits(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..n).map(|_| rng.gen_range(-8.0..8.0)).collect()
    }

    const FIVE: [f32; 5] = [1.0, 2.0, 0.5, -1.0, 3.0];

    #[test]
    fn greedy_picks_argmax_and_lowest_id_on_ties() {
        let mut s = Sampler::new(&params(0.0), &[], 7).unwrap();
        assert_eq!(s.sample(&FIVE).unwrap().token, 4);
        assert_eq!(s.sample(&[0.0, 5.0, 1.0, 5.0]).unwrap().token, 1);
        let logits = random_logits(50_000, 3);
        let best = (0..logits.len())
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
            .unwrap();
        assert_eq!(s.sample(&logits).unwrap().token as usize, best);
    }

    #[test]
    fn logprobs_are_log_softmax_and_sum_to_one() {
        let logits = random_logits(2000, 9);
        let total: f64 = (0..logits.len() as u32)
            .map(|t| f64::from(token_logprob(&logits, t, 0).unwrap().logprob).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-4, "sum of probabilities {total}");
        // Reported logprobs ignore temperature.
        let p = SamplingParams {
            logprobs: Some(3),
            ..params(0.0)
        };
        let got = Sampler::new(&p, &[], 0).unwrap().sample(&FIVE).unwrap();
        let expected = softmax(&FIVE, 1.0)[4].ln() as f32;
        assert!((got.logprob - expected).abs() < 1e-6);
        let ids: Vec<u32> = got.top_logprobs.iter().map(|&(t, _)| t).collect();
        assert_eq!(ids, [4, 1, 0]);
        assert_eq!(got.top_logprobs[0].1, got.logprob);
    }

    #[test]
    fn top_alternatives_sorted_with_ties_by_id_on_both_paths() {
        let logits = [1.0, 3.0, 3.0, 2.0, 3.0, 0.0];
        let ids = |n| -> Vec<u32> {
            let r = token_logprob(&logits, 5, n).unwrap();
            r.top_logprobs.iter().map(|&(t, _)| t).collect()
        };
        assert_eq!(ids(4), [1, 2, 4, 3]);
        assert_eq!(ids(100), [1, 2, 4, 3, 0, 5]);
        let big = random_logits(5000, 4);
        let small = token_logprob(&big, 0, MAX_LOGPROBS as usize).unwrap();
        let large = token_logprob(&big, 0, 64).unwrap();
        assert_eq!(small.top_logprobs[..], large.top_logprobs[..20]);
        assert!(large.top_logprobs.windows(2).all(|w| w[0].1 >= w[1].1));
    }

    #[test]
    fn bad_logits_are_errors() {
        let mut s = Sampler::new(&params(1.0), &[], 0).unwrap();
        let nan = s.sample(&[0.0, f32::NAN]).unwrap_err();
        assert!(matches!(
            nan,
            SamplingError::NonFiniteLogit { index: 1, .. }
        ));
        let inf = s.sample(&[f32::NEG_INFINITY, 0.0]).unwrap_err();
        assert!(matches!(
            inf,
            SamplingError::NonFiniteLogit { index: 0, .. }
        ));
        assert_eq!(s.sample(&[]).unwrap_err(), SamplingError::EmptyLogits);
        assert_eq!(
            token_logprob(&FIVE, 5, 0).unwrap_err(),
            SamplingError::TokenOutOfRange {
                token: 5,
                vocab_size: 5
            }
        );
        assert!(token_logprob(&[f32::INFINITY], 0, 1).is_err());
    }

    #[test]
    fn samplers_refuse_parameters_out_of_range() {
        assert!(Sampler::new(&params(3.0), &[], 0).is_err());
        let top_p = SamplingParams {
            top_p: 0.0,
            ..SamplingParams::default()
        };
        assert_eq!(
            Sampler::new(&top_p, &[], 0).unwrap_err().param(),
            Some("top_p")
        );
    }

    #[test]
    fn excluded_tokens_are_never_drawn_but_keep_their_logprobs() {
        // Greedy: the best token excluded, the next best is picked; the reported logprob is
        // the row's own.
        let mut s = Sampler::new(&params(0.0), &[], 7).unwrap();
        let got = s.sample_excluding(&FIVE, &[4, 99]).unwrap();
        assert_eq!(got.token, 1);
        assert_eq!(got.logprob, token_logprob(&FIVE, 1, 0).unwrap().logprob);
        // Sampling at any temperature, with penalties and bias on: never an excluded id, even
        // one the bias favours.
        for t in [0.05, 1.0, 2.0] {
            let p = SamplingParams {
                temperature: t,
                presence_penalty: 1.0,
                repetition_penalty: 1.5,
                logit_bias: vec![(3, 100.0)],
                ..SamplingParams::default()
            };
            let mut s = Sampler::new(&p, &[0, 3], 11).unwrap();
            let logits = random_logits(64, 5);
            for _ in 0..500 {
                let token = s.sample_excluding(&logits, &[3, 10, 20]).unwrap().token;
                assert!(![3, 10, 20].contains(&token), "T={t}: drew {token}");
            }
        }
    }
}
