//! Row sampling for the synthetic generators: every source rank perturbs the global popularity
//! (lognormal, per expert) and routes its tokens over it, `top_k` distinct experts per token.
//! Rows are drawn by one of two [`Sampler`]s: per token (alias-table draws, duplicates
//! rejected: the reference) or per row ([`super::counts`]: the counts drawn at once, in
//! `O(experts)`). Either way every row sums to `tokens * top_k`.

use super::counts::{exp, RowCounts};
use crate::parallel::map_dynamic;
use rand::rngs::{SmallRng, StdRng};
use rand::{RngCore, SeedableRng};
use rand_distr::{Distribution, StandardNormal};
use serde::Serialize;
use std::fmt;
use std::str::FromStr;

/// Estimated work (token-expert draws, or about 20 per expert of a counted row) below which a
/// matrix is sampled on the calling thread.
const PARALLEL_WORK: u64 = 1 << 17;

/// How a rank's row of expert counts is drawn.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Sampler {
    /// Each row's counts at once from the tokens' inclusion probabilities: `O(experts)` per
    /// row, the same statistics within the bounds `docs/simulate.md` gives.
    #[default]
    Counts,
    /// Every token's experts one by one: `O(tokens * top_k)` per row; the reference.
    Tokens,
}

impl Sampler {
    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Sampler::Counts => "counts",
            Sampler::Tokens => "tokens",
        }
    }
}

impl fmt::Display for Sampler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Sampler {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "counts" => Ok(Sampler::Counts),
            "tokens" => Ok(Sampler::Tokens),
            _ => Err(format!("unknown sampler '{s}' (expected counts or tokens)")),
        }
    }
}

/// Everything one rank needs to sample its row of one step.
pub(crate) struct RankJob<'a> {
    /// Global popularity by expert id (any positive scale).
    pub popularity: &'a [f64],
    pub rank_sigma: f64,
    pub tokens: u64,
    pub top_k: usize,
    pub sampler: Sampler,
}

impl RankJob<'_> {
    /// Samples one matrix, row `r` from `rank_seeds[r]`, on up to `threads` threads (large steps
    /// only); the counts do not depend on the thread count.
    pub(crate) fn sample(&self, rank_seeds: &[u64], threads: usize) -> Vec<u64> {
        let [whole, _] = self.sample_halves(rank_seeds, threads, self.tokens);
        whole
    }

    /// Samples one matrix cut in two: every rank's first `first` tokens (clamped to the rank's
    /// tokens), then the rest. The halves add up to what [`RankJob::sample`] draws from the same
    /// seeds; the second is empty when `first` covers every token.
    pub(crate) fn sample_halves(
        &self,
        rank_seeds: &[u64],
        threads: usize,
        first: u64,
    ) -> [Vec<u64>; 2] {
        let (ranks, experts) = (rank_seeds.len(), self.popularity.len());
        let first = first.min(self.tokens);
        let split = first < self.tokens;
        let mut halves = [
            vec![0u64; ranks * experts],
            vec![0u64; if split { ranks * experts } else { 0 }],
        ];
        let per_row = match self.sampler {
            Sampler::Tokens => self.tokens * self.top_k as u64,
            Sampler::Counts => 20 * experts as u64,
        };
        let threads = if ranks as u64 * per_row < PARALLEL_WORK {
            1
        } else {
            threads.min(ranks).max(1)
        };
        let per = ranks.div_ceil(threads);
        let [a, b] = &mut halves;
        let b_chunks: Vec<&mut [u64]> = if split {
            b.chunks_mut(per * experts).collect()
        } else {
            (0..ranks.div_ceil(per)).map(|_| &mut [][..]).collect()
        };
        let jobs = rank_seeds
            .chunks(per)
            .zip(a.chunks_mut(per * experts))
            .zip(b_chunks);
        map_dynamic(jobs, threads, |((seeds, a), b)| {
            self.run(seeds, first, a, b)
        });
        halves
    }

    /// Samples the rows of the ranks whose seeds are given: the first `first` tokens into `a`,
    /// the rest into `b` (empty when there is no rest).
    fn run(&self, seeds: &[u64], first: u64, a: &mut [u64], b: &mut [u64]) {
        let e = self.popularity.len();
        let mut scratch = Scratch::new(e, self.top_k);
        let mut counts = RowCounts::default();
        for (r, &seed) in seeds.iter().enumerate() {
            let row_a = &mut a[r * e..(r + 1) * e];
            let row_b = if b.is_empty() {
                None
            } else {
                Some(&mut b[r * e..(r + 1) * e])
            };
            let mut rng = StdRng::seed_from_u64(seed);
            for w in scratch.weights.iter_mut() {
                *w = StandardNormal.sample(&mut rng);
            }
            for (w, &p) in scratch.weights.iter_mut().zip(self.popularity) {
                *w = p * exp(self.rank_sigma * *w);
            }
            match self.sampler {
                Sampler::Tokens => self.sample_tokens(&mut rng, first, row_a, row_b, &mut scratch),
                Sampler::Counts => {
                    // The counts draw from a fast generator seeded by the row's stream (the
                    // perturbation above is the per-token sampler's, draw for draw).
                    let mut rng = SmallRng::seed_from_u64(rng.next_u64());
                    counts.set_weights(&scratch.weights, self.top_k);
                    counts.draw(first, self.top_k, &mut rng, row_a);
                    if let Some(row_b) = row_b {
                        counts.draw(self.tokens - first, self.top_k, &mut rng, row_b);
                    }
                }
            }
        }
    }

    /// Every token's experts one by one; tokens before `first` count into `a`, the rest into `b`.
    fn sample_tokens(
        &self,
        rng: &mut StdRng,
        first: u64,
        a: &mut [u64],
        mut b: Option<&mut [u64]>,
        s: &mut Scratch,
    ) {
        s.build_alias();
        let n = a.len() as u64;
        // Rejections before falling back to the heaviest unpicked expert: only reachable when a
        // handful of experts hold nearly all the mass.
        let max_rejects = 64 * self.top_k;
        for token in 0..self.tokens {
            let mut picked = 0;
            let mut rejects = 0;
            while picked < self.top_k {
                let x = rng.next_u64();
                let col = (((x >> 32) * n) >> 32) as usize;
                let expert = if (x & 0xffff_ffff) < s.prob[col] {
                    col
                } else {
                    s.alias[col] as usize
                };
                let (word, bit) = (expert >> 6, 1u64 << (expert & 63));
                if s.seen[word] & bit == 0 {
                    s.seen[word] |= bit;
                    s.chosen[picked] = expert as u32;
                    picked += 1;
                } else {
                    rejects += 1;
                    if rejects > max_rejects {
                        let expert = s.heaviest_unseen();
                        s.seen[expert >> 6] |= 1 << (expert & 63);
                        s.chosen[picked] = expert as u32;
                        picked += 1;
                        rejects = 0;
                    }
                }
            }
            let row = match (&mut b, token < first) {
                (Some(b), false) => &mut **b,
                _ => &mut *a,
            };
            for &expert in &s.chosen {
                let expert = expert as usize;
                row[expert] += 1;
                s.seen[expert >> 6] &= !(1u64 << (expert & 63));
            }
        }
    }
}

/// Per-thread buffers: rank weights, alias table, duplicate bitset.
struct Scratch {
    weights: Vec<f64>,
    scaled: Vec<f64>,
    /// Column `i` yields `i` when the low 32 random bits are below `prob[i]` (2^32 = always).
    prob: Vec<u64>,
    alias: Vec<u32>,
    small: Vec<u32>,
    large: Vec<u32>,
    seen: Vec<u64>,
    chosen: Vec<u32>,
}

impl Scratch {
    fn new(experts: usize, top_k: usize) -> Self {
        Self {
            weights: vec![0.0; experts],
            scaled: vec![0.0; experts],
            prob: vec![0; experts],
            alias: vec![0; experts],
            small: Vec::with_capacity(experts),
            large: Vec::with_capacity(experts),
            seen: vec![0; experts.div_ceil(64)],
            chosen: vec![0; top_k],
        }
    }

    /// Vose's alias method over `weights` (uniform if they are degenerate).
    fn build_alias(&mut self) {
        const ONE: u64 = 1 << 32;
        let n = self.weights.len();
        let sum: f64 = self.weights.iter().sum();
        let uniform = !(sum.is_finite() && sum > 0.0);
        for (s, &w) in self.scaled.iter_mut().zip(&self.weights) {
            *s = if uniform { 1.0 } else { w * n as f64 / sum };
        }
        self.small.clear();
        self.large.clear();
        for (i, &s) in self.scaled.iter().enumerate() {
            if s < 1.0 {
                self.small.push(i as u32);
            } else {
                self.large.push(i as u32);
            }
        }
        while let (Some(&s), Some(&l)) = (self.small.last(), self.large.last()) {
            self.small.pop();
            let (s, l) = (s as usize, l as usize);
            self.prob[s] = (self.scaled[s] * ONE as f64) as u64;
            self.alias[s] = l as u32;
            self.scaled[l] -= 1.0 - self.scaled[s];
            if self.scaled[l] < 1.0 {
                self.large.pop();
                self.small.push(l as u32);
            }
        }
        // Leftovers are 1 up to rounding.
        for &i in self.small.iter().chain(&self.large) {
            self.prob[i as usize] = ONE;
            self.alias[i as usize] = i;
        }
    }

    fn heaviest_unseen(&self) -> usize {
        let mut best = None;
        for (e, &w) in self.weights.iter().enumerate() {
            if self.seen[e >> 6] & (1 << (e & 63)) != 0 {
                continue;
            }
            if best.is_none_or(|(_, bw)| w > bw) {
                best = Some((e, w));
            }
        }
        best.expect("top_k <= experts leaves an unpicked expert").0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alias_table_reproduces_weights() {
        let mut s = Scratch::new(4, 1);
        s.weights.copy_from_slice(&[1.0, 2.0, 3.0, 4.0]);
        s.build_alias();
        // Exact column masses: prob[i]/2^32 of column i plus the alias shares.
        let mut mass = [0.0f64; 4];
        for i in 0..4 {
            let p = s.prob[i] as f64 / (1u64 << 32) as f64;
            mass[i] += p / 4.0;
            mass[s.alias[i] as usize] += (1.0 - p) / 4.0;
        }
        for (i, m) in mass.iter().enumerate() {
            assert!((m - (i + 1) as f64 / 10.0).abs() < 1e-9, "{mass:?}");
        }
    }
}
