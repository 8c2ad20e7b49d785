//! What a request may do to a row of logits before a token is picked: OpenAI's `logit_bias`,
//! `presence_penalty` and `frequency_penalty` (over the tokens generated so far), and the
//! `repetition_penalty` of transformers and vLLM (over the prompt and the generated tokens).
//!
//! They change which token is drawn, never the reported logprobs (see [`super`]).
//! Their ranges are checked with the other sampling parameters ([`SamplingParams::validate`]).
//! In order, for a token `t` with logit `l`:
//! 1. repetition, if `t` is in the prompt or was generated: `l / r` when `l > 0`, else `l * r`;
//! 2. `l -= frequency * count(t) + presence * (count(t) > 0)`, `count` over generated tokens;
//! 3. `l += logit_bias[t]`.

use std::collections::HashMap;

use super::params::SamplingParams;

/// One sequence's adjustments, with the counts they depend on.
#[derive(Debug, Clone)]
pub(crate) struct LogitAdjuster {
    presence: f32,
    frequency: f32,
    repetition: f32,
    /// `(token, bias)`.
    bias: Vec<(u32, f32)>,
    /// Distinct prompt tokens, sorted; empty unless the repetition penalty is on.
    prompt: Vec<u32>,
    /// How often each token was generated.
    generated: HashMap<u32, u32>,
    /// The adjusted row, reused from step to step.
    row: Vec<f32>,
}

impl LogitAdjuster {
    /// The adjustments `params` ask for on a sequence with `prompt`; `None` when they leave
    /// every logit as it is (the common case: the sampler then reads the logits in place).
    pub(crate) fn new(params: &SamplingParams, prompt: &[u32]) -> Option<Self> {
        let repetition = params.repetition_penalty;
        let active = params.presence_penalty != 0.0
            || params.frequency_penalty != 0.0
            || repetition != 1.0
            || params.logit_bias.iter().any(|&(_, b)| b != 0.0);
        if !active {
            return None;
        }
        let mut distinct = Vec::new();
        if repetition != 1.0 {
            distinct = prompt.to_vec();
            distinct.sort_unstable();
            distinct.dedup();
        }
        Some(Self {
            presence: params.presence_penalty,
            frequency: params.frequency_penalty,
            repetition,
            bias: params.logit_bias.clone(),
            prompt: distinct,
            generated: HashMap::new(),
            row: Vec::new(),
        })
    }

    /// `logits` with every adjustment applied (ids outside the row are skipped: a request's ids
    /// were checked against the vocabulary when it was admitted).
    pub(crate) fn apply(&mut self, logits: &[f32]) -> &[f32] {
        self.row.clear();
        self.row.extend_from_slice(logits);
        let row = &mut self.row;
        if self.repetition != 1.0 {
            let prompt = &self.prompt;
            let from_output = self
                .generated
                .keys()
                .filter(|t| prompt.binary_search(t).is_err());
            for &token in prompt.iter().chain(from_output) {
                if let Some(l) = row.get_mut(token as usize) {
                    *l = if *l > 0.0 {
                        *l / self.repetition
                    } else {
                        *l * self.repetition
                    };
                }
            }
        }
        if self.frequency != 0.0 || self.presence != 0.0 {
            for (&token, &count) in &self.generated {
                if let Some(l) = row.get_mut(token as usize) {
                    *l -= self.frequency * count as f32 + self.presence;
                }
            }
        }
        for &(token, bias) in &self.bias {
            if let Some(l) = row.get_mut(token as usize) {
                *l += bias;
            }
        }
        &self.row
    }

    /// Counts `token` as generated.
    pub(crate) fn record(&mut self, token: u32) {
        *self.generated.entry(token).or_insert(0) += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::Sampler;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams::default();
        f(&mut p);
        p
    }

    #[test]
    fn default_parameters_adjust_nothing() {
        assert!(LogitAdjuster::new(&SamplingParams::default(), &[1, 2]).is_none());
        let zero_bias = params(|p| p.logit_bias = vec![(3, 0.0)]);
        assert!(LogitAdjuster::new(&zero_bias, &[1, 2]).is_none());
    }

    #[test]
    fn presence_and_frequency_count_generated_tokens_only() {
        let p = params(|p| {
            p.presence_penalty = 0.5;
            p.frequency_penalty = 0.25;
        });
        // Token 0 is in the prompt but was never generated: untouched.
        let mut a = LogitAdjuster::new(&p, &[0]).unwrap();
        a.record(1);
        a.record(1);
        a.record(2);
        let row = a.apply(&[1.0, 1.0, 1.0, 1.0]);
        assert_eq!(row, [1.0, 1.0 - 0.5 - 0.5, 1.0 - 0.5 - 0.25, 1.0]);
    }

    #[test]
    fn repetition_divides_positive_and_multiplies_negative_logits_once_per_token() {
        let p = params(|p| p.repetition_penalty = 2.0);
        // Token 1 is in the prompt twice and generated twice: still penalised once.
        let mut a = LogitAdjuster::new(&p, &[1, 1, 3]).unwrap();
        a.record(1);
        a.record(1);
        a.record(2);
        let row = a.apply(&[4.0, 4.0, -4.0, 0.0, 4.0]);
        assert_eq!(row, [4.0, 2.0, -8.0, 0.0, 4.0]);
    }

    #[test]
    fn bias_is_added_after_penalties_and_skips_ids_outside_the_row() {
        let p = params(|p| {
            p.frequency_penalty = 1.0;
            p.logit_bias = vec![(0, -100.0), (1, 2.5), (99, 1.0)];
        });
        let mut a = LogitAdjuster::new(&p, &[]).unwrap();
        a.record(1);
        assert_eq!(a.apply(&[0.5, 0.5, 0.5]), [-99.5, 2.0, 0.5]);
        // The input row is not modified and each call starts from it.
        assert_eq!(a.apply(&[0.0, 0.0, 0.0]), [-100.0, 1.5, 0.0]);
    }

    #[test]
    fn greedy_follows_the_adjusted_logits_but_reports_the_models_logprobs() {
        let logits = [1.0, 0.9, -3.0];
        let p = params(|p| {
            p.temperature = 0.0;
            p.frequency_penalty = 0.5;
        });
        let mut s = Sampler::new(&p, &[], 0).unwrap();
        let picks: Vec<u32> = (0..4).map(|_| s.sample(&logits).unwrap().token).collect();
        // 1.0 > 0.9; then 0.5 < 0.9; then 0.5 > 0.4; then 0.0 < 0.4.
        assert_eq!(picks, [0, 1, 0, 1]);

        let p = params(|p| {
            p.temperature = 0.0;
            p.logit_bias = vec![(2, 10.0)];
        });
        let got = Sampler::new(&p, &[], 0).unwrap().sample(&logits).unwrap();
        let raw = crate::sampling::token_logprob(&logits, 2, 0).unwrap();
        assert_eq!((got.token, got.logprob), (2, raw.logprob));
    }

    #[test]
    fn repetition_penalty_steers_away_from_prompt_tokens() {
        let p = params(|p| {
            p.temperature = 0.0;
            p.repetition_penalty = 1.5;
        });
        let mut s = Sampler::new(&p, &[0, 7], 0).unwrap();
        // 3.0 / 1.5 = 2.0 < 2.5.
        assert_eq!(s.sample(&[3.0, 2.5]).unwrap().token, 1);
    }

    #[test]
    fn min_p_never_draws_below_its_floor() {
        // Weights relative to the best: 1, e^-1 = 0.37, e^-3 = 0.05, e^-5 = 0.007.
        let logits = [5.0, 4.0, 2.0, 0.0];
        let p = params(|p| {
            p.min_p = 0.1;
            p.seed = Some(3);
        });
        let mut s = Sampler::new(&p, &[], 0).unwrap();
        let mut seen = [0u32; 4];
        for _ in 0..2000 {
            seen[s.sample(&logits).unwrap().token as usize] += 1;
        }
        assert_eq!(seen[2] + seen[3], 0, "{seen:?}");
        // Renormalised over the two kept: 1 / (1 + e^-1) = 0.73 for token 0.
        let share = f64::from(seen[0]) / 2000.0;
        assert!((share - 0.731).abs() < 0.04, "{share}");
    }
}
