//! Token sampling for the synthetic generators: every token of a source rank picks `top_k`
//! distinct experts from the rank's perturbed popularity, by alias-table draws with duplicates
//! rejected, so rows are exact router outputs (each sums to `tokens * top_k`).

use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};
use rand_distr::{Distribution, StandardNormal};

/// Work (token-expert draws) below which a step is generated on the calling thread.
const PARALLEL_DRAWS: u64 = 1 << 17;

/// Everything one rank needs to sample its row of one step.
pub(crate) struct RankJob<'a> {
    /// Global popularity by expert id (any positive scale).
    pub popularity: &'a [f64],
    pub rank_sigma: f64,
    pub tokens: u64,
    pub top_k: usize,
}

impl RankJob<'_> {
    /// Samples one matrix, row `r` from `rank_seeds[r]`, on up to `threads` threads (large steps
    /// only); the counts do not depend on the thread count.
    pub(crate) fn sample(&self, rank_seeds: &[u64], threads: usize) -> Vec<u64> {
        let (ranks, experts) = (rank_seeds.len(), self.popularity.len());
        let mut counts = vec![0u64; ranks * experts];
        let draws = ranks as u64 * self.tokens * self.top_k as u64;
        let threads = if draws < PARALLEL_DRAWS {
            1
        } else {
            threads.min(ranks)
        };
        if threads <= 1 {
            self.run(rank_seeds, &mut counts);
        } else {
            let per = ranks.div_ceil(threads);
            std::thread::scope(|scope| {
                for (seeds, out) in rank_seeds.chunks(per).zip(counts.chunks_mut(per * experts)) {
                    scope.spawn(move || self.run(seeds, out));
                }
            });
        }
        counts
    }

    /// Samples the rows of the ranks whose seeds are given into `out` (`seeds.len()` rows).
    fn run(&self, seeds: &[u64], out: &mut [u64]) {
        let e = self.popularity.len();
        let mut scratch = Scratch::new(e, self.top_k);
        for (&seed, row) in seeds.iter().zip(out.chunks_mut(e)) {
            self.sample_row(seed, row, &mut scratch);
        }
    }

    fn sample_row(&self, seed: u64, row: &mut [u64], s: &mut Scratch) {
        let mut rng = StdRng::seed_from_u64(seed);
        for (w, &p) in s.weights.iter_mut().zip(self.popularity) {
            let z: f64 = StandardNormal.sample(&mut rng);
            *w = p * (self.rank_sigma * z).exp();
        }
        s.build_alias();
        let n = row.len() as u64;
        // Rejections before falling back to the heaviest unpicked expert: only reachable when a
        // handful of experts hold nearly all the mass.
        let max_rejects = 64 * self.top_k;
        for _ in 0..self.tokens {
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
