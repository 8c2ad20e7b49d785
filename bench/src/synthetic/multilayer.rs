//! Synthetic multi-layer routing traces: steps x MoE layers of load matrices, non-stationary the
//! ways real prefill routing is, for `rackfill bench balance --synthetic-trace` and the simulator.
//!
//! Every layer has its own popularity: the trace's [`Popularity`] with a per-layer parameter (the
//! Zipf exponent or lognormal sigma times `exp(layer_skew_sigma * N(0, 1))`, fixed for the whole
//! trace) laid onto the experts by the layer's own hot order. Hot orders are correlated between
//! neighbouring layers: layer 0's is a random permutation and layer `l`'s is layer `l - 1`'s with
//! about a `layer_mix` fraction of its positions swapped at random, so adjacent layers share most
//! of their hot experts and distant layers little. Over time:
//! - *drift* (patterns `drifting`, `mixed`): every step, every layer's hot order takes the gradual
//!   swaps of [`Pattern::Drifting`](super::Pattern::Drifting), independently per layer;
//! - *domain switches* (patterns `switching`, `mixed`): before every step after the first, with
//!   probability `switch_probability`, the request mix changes and every layer gets a brand-new
//!   hot order (layer 0 reshuffled, the others derived from it again as above).
//!
//! Tokens are sampled as in the single-layer generator (per-rank lognormal perturbation, exact
//! distinct top-k per token), so every row of every matrix sums to `tokens_per_rank * top_k`. The
//! trace is a pure function of the spec and the seed.

use super::{
    drift, InvalidSuite, Popularity, RankJob, Sampler, MAX_EXPERTS, MAX_RANKS, MAX_TOKENS_PER_RANK,
    RANK_SIGMA, TOP_K,
};
use crate::parallel::map_dynamic;
use rackfill_balancer::LoadMatrix;
use rackfill_engine::routing_trace::TraceStep;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, RngCore, SeedableRng};
use rand_distr::{Distribution, StandardNormal};
use serde::Serialize;
use std::fmt;
use std::str::FromStr;

/// Probability of a domain switch before each step in the `switching` and `mixed` patterns (one
/// switch every 20 steps on average).
pub const DEFAULT_SWITCH_PROBABILITY: f64 = 0.05;

/// Default fraction of popularity positions re-drawn from one layer to the next.
pub const DEFAULT_LAYER_MIX: f64 = 0.25;

/// Default sigma of the per-layer jitter of the popularity family's parameter.
pub const DEFAULT_LAYER_SKEW_SIGMA: f64 = 0.2;

/// Most load counts one step of a trace may hold (layers x ranks x experts, 8 bytes each: 512 MiB):
/// a step is generated, and replayed, whole. The simulator's presets need about a million.
pub const MAX_STEP_COUNTS: usize = 1 << 26;

/// The temporal behaviour of a synthetic trace (layer-to-layer variation is always on).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TracePattern {
    /// Fixed hot orders; only the per-rank perturbation and the token samples change.
    Stationary,
    /// Gradual drift of every layer's hot order.
    Drifting,
    /// Domain switches at random steps, stationary in between.
    Switching,
    /// Drift and domain switches.
    Mixed,
}

impl TracePattern {
    /// Every pattern, in the order the CLI lists them.
    pub const ALL: [TracePattern; 4] = [
        TracePattern::Stationary,
        TracePattern::Drifting,
        TracePattern::Switching,
        TracePattern::Mixed,
    ];

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            TracePattern::Stationary => "stationary",
            TracePattern::Drifting => "drifting",
            TracePattern::Switching => "switching",
            TracePattern::Mixed => "mixed",
        }
    }
}

impl fmt::Display for TracePattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for TracePattern {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == s.trim())
            .ok_or_else(|| {
                format!("unknown trace pattern '{s}' (expected stationary, drifting, switching or mixed)")
            })
    }
}

/// Everything that defines a synthetic multi-layer trace (see the module docs).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TraceSpec {
    pub pattern: TracePattern,
    pub ranks: usize,
    pub experts: usize,
    pub layers: usize,
    pub steps: usize,
    pub tokens_per_rank: u64,
    pub top_k: usize,
    /// Sigma of the per-rank lognormal perturbation.
    pub rank_sigma: f64,
    pub family: Popularity,
    /// Sigma of the per-layer jitter of the family's parameter.
    pub layer_skew_sigma: f64,
    /// Fraction of popularity positions swapped between neighbouring layers, in `[0, 1]`.
    pub layer_mix: f64,
    /// Drift every layer's hot order every step.
    pub drift: bool,
    /// Probability of a domain switch before each step after the first, in `[0, 1]`.
    pub switch_probability: f64,
    /// How rows are drawn (per row by default; per token is the reference).
    pub sampler: Sampler,
}

impl TraceSpec {
    /// A trace of `pattern` with top-[`TOP_K`] routing, Zipf 1.0 popularity and the default
    /// per-rank, per-layer and switching parameters.
    pub fn new(
        pattern: TracePattern,
        ranks: usize,
        experts: usize,
        layers: usize,
        steps: usize,
        tokens_per_rank: u64,
    ) -> Self {
        let moving = matches!(pattern, TracePattern::Switching | TracePattern::Mixed);
        Self {
            pattern,
            ranks,
            experts,
            layers,
            steps,
            tokens_per_rank,
            top_k: TOP_K,
            rank_sigma: RANK_SIGMA,
            family: Popularity::Zipf { s: 1.0 },
            layer_skew_sigma: DEFAULT_LAYER_SKEW_SIGMA,
            layer_mix: DEFAULT_LAYER_MIX,
            drift: matches!(pattern, TracePattern::Drifting | TracePattern::Mixed),
            switch_probability: if moving {
                DEFAULT_SWITCH_PROBABILITY
            } else {
                0.0
            },
            sampler: Sampler::default(),
        }
    }

    /// Checks that the trace can be generated.
    pub fn check(&self) -> Result<(), InvalidSuite> {
        let fail = |why: String| Err(InvalidSuite(format!("synthetic trace: {why}")));
        if !(1..=MAX_RANKS).contains(&self.ranks) || self.experts > MAX_EXPERTS {
            return fail(format!(
                "needs 1..={MAX_RANKS} ranks and at most {MAX_EXPERTS} experts, got {} x {}",
                self.ranks, self.experts
            ));
        }
        if !(1..=MAX_TOKENS_PER_RANK).contains(&self.tokens_per_rank) {
            return fail(format!(
                "needs 1..={MAX_TOKENS_PER_RANK} tokens per rank, got {}",
                self.tokens_per_rank
            ));
        }
        let counts = self.layers.saturating_mul(self.ranks * self.experts);
        if self.layers == 0 || counts > MAX_STEP_COUNTS {
            return fail(format!(
                "{} layers x {} ranks x {} experts per step: needs at least one layer and at most \
                 {MAX_STEP_COUNTS} load counts per step",
                self.layers, self.ranks, self.experts
            ));
        }
        if self.top_k == 0 || self.top_k > self.experts {
            return fail(format!(
                "top-k {} must be in 1..={} (the expert count)",
                self.top_k, self.experts
            ));
        }
        for (what, v, max) in [
            ("rank sigma", self.rank_sigma, 8.0),
            ("layer skew sigma", self.layer_skew_sigma, 2.0),
            ("layer mix", self.layer_mix, 1.0),
            ("switch probability", self.switch_probability, 1.0),
        ] {
            if !(v.is_finite() && (0.0..=max).contains(&v)) {
                return fail(format!("{what} must be in [0, {max}], got {v}"));
            }
        }
        self.family.check().or_else(fail)
    }

    /// The layer ids of the generated trace: `0..layers`.
    pub fn layer_ids(&self) -> Vec<usize> {
        (0..self.layers).collect()
    }
}

/// One layer's popularity: weights by position (hottest first) and the expert at each position.
#[derive(Debug, Clone)]
struct LayerState {
    sorted_weights: Vec<f64>,
    hot_order: Vec<u32>,
}

/// Iterator over the steps of a synthetic trace, each with one matrix per layer.
#[derive(Debug, Clone)]
pub struct TraceGenerator {
    spec: TraceSpec,
    master: StdRng,
    layers: Vec<LayerState>,
    step: usize,
    threads: usize,
    /// Steps that began with a domain switch.
    switches: Vec<u64>,
}

impl TraceGenerator {
    /// A generator for `spec` under `seed`, using all available cores for large steps.
    pub fn new(spec: &TraceSpec, seed: u64) -> Result<Self, InvalidSuite> {
        spec.check()?;
        let mut master = StdRng::seed_from_u64(seed);
        let mut layers = Vec::with_capacity(spec.layers);
        for _ in 0..spec.layers {
            let z: f64 = StandardNormal.sample(&mut master);
            let jitter = (spec.layer_skew_sigma * z).exp();
            let family = match spec.family {
                Popularity::Zipf { s } => Popularity::Zipf {
                    s: (s * jitter).min(8.0),
                },
                Popularity::LogNormal { sigma } => Popularity::LogNormal {
                    sigma: (sigma * jitter).min(8.0),
                },
            };
            let sorted_weights = family
                .sorted_weights(spec.experts, &mut master)
                .map_err(|why| InvalidSuite(format!("synthetic trace: {why}")))?;
            layers.push(LayerState {
                sorted_weights,
                hot_order: Vec::new(),
            });
        }
        let mut generator = Self {
            spec: spec.clone(),
            master,
            layers,
            step: 0,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            switches: Vec::new(),
        };
        generator.new_domain();
        Ok(generator)
    }

    /// Uses at most `threads` threads per matrix (1: the calling thread). The output does not
    /// depend on it.
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.threads = threads.max(1);
        self
    }

    /// The spec being generated.
    pub fn spec(&self) -> &TraceSpec {
        &self.spec
    }

    /// The hot order layer `layer` had in the most recent step (before the first: in the first),
    /// hottest expert first.
    pub fn hot_order(&self, layer: usize) -> &[u32] {
        &self.layers[layer].hot_order
    }

    /// The steps generated so far that began with a domain switch.
    pub fn switch_steps(&self) -> &[u64] {
        &self.switches
    }

    /// A fresh random hot order for layer 0 and neighbour-correlated ones for the rest.
    fn new_domain(&mut self) {
        let e = self.spec.experts;
        let mut order: Vec<u32> = (0..e as u32).collect();
        order.shuffle(&mut self.master);
        // Each swap moves two positions: ceil(mix * E / 2) swaps touch about a `mix` fraction.
        let swaps = (self.spec.layer_mix * e as f64 / 2.0).ceil() as usize;
        for (l, layer) in self.layers.iter_mut().enumerate() {
            if l > 0 && e > 1 {
                for _ in 0..swaps {
                    let i = self.master.gen_range(0..e);
                    let j = self.master.gen_range(0..e);
                    order.swap(i, j);
                }
            }
            layer.hot_order.clone_from(&order);
        }
    }

    fn next_step(&mut self) -> TraceStep {
        let (step, layers) = self.next_layers(None);
        let loads = layers.into_iter().map(|l| l.whole).collect();
        TraceStep { step, loads }
    }

    /// The next step cut in two micro-batches: every rank's first `first` tokens, then the rest
    /// (the two add up to the step [`Iterator::next`] would give from the same state), or `None`
    /// after the last step.
    pub fn next_split(&mut self, first: u64) -> Option<SplitStep> {
        (self.step < self.spec.steps).then(|| {
            let (step, layers) = self.next_layers(Some(first));
            let mut loads = Vec::with_capacity(layers.len());
            let mut halves = [
                Vec::with_capacity(layers.len()),
                Vec::with_capacity(layers.len()),
            ];
            for layer in layers {
                let [a, b] = layer.halves.expect("a cut step samples both micro-batches");
                loads.push(layer.whole);
                halves[0].push(a);
                halves[1].push(b);
            }
            SplitStep {
                step,
                loads,
                halves,
            }
        })
    }

    /// Moves the hot orders to the next step and samples every layer: whole (`first: None`) or
    /// cut after `first` tokens per rank. Layers are sampled in parallel, each from the seeds
    /// the master stream gives it in layer order, so the result does not depend on the threads.
    fn next_layers(&mut self, first: Option<u64>) -> (u64, Vec<SampledLayer>) {
        if self.step > 0 {
            let p = self.spec.switch_probability;
            if p > 0.0 && self.master.gen::<f64>() < p {
                self.new_domain();
                self.switches.push(self.step as u64);
            } else if self.spec.drift {
                for layer in &mut self.layers {
                    drift(&mut layer.hot_order, &mut self.master);
                }
            }
        }
        let (ranks, experts) = (self.spec.ranks, self.spec.experts);
        let jobs: Vec<(Vec<f64>, Vec<u64>)> = self
            .layers
            .iter()
            .map(|layer| {
                let mut popularity = vec![0.0; experts];
                for (pos, &expert) in layer.hot_order.iter().enumerate() {
                    popularity[expert as usize] = layer.sorted_weights[pos];
                }
                let seeds = (0..ranks).map(|_| self.master.next_u64()).collect();
                (popularity, seeds)
            })
            .collect();
        let spec = &self.spec;
        // One layer: its ranks in parallel; several: the layers.
        let (per_layer, across) = if jobs.len() == 1 {
            (self.threads, 1)
        } else {
            (1, self.threads)
        };
        let sample = |(popularity, seeds): &(Vec<f64>, Vec<u64>)| {
            let job = RankJob {
                popularity,
                rank_sigma: spec.rank_sigma,
                tokens: spec.tokens_per_rank,
                top_k: spec.top_k,
                sampler: spec.sampler,
            };
            let [a, b] = job.sample_halves(seeds, per_layer, first.unwrap_or(spec.tokens_per_rank));
            if first.is_none() {
                return SampledLayer {
                    whole: matrix(ranks, experts, a),
                    halves: None,
                };
            }
            // Every token in the first micro-batch: the second routes nothing.
            let b = if b.is_empty() { vec![0; a.len()] } else { b };
            let whole = a.iter().zip(&b).map(|(x, y)| x + y).collect();
            SampledLayer {
                whole: matrix(ranks, experts, whole),
                halves: Some([matrix(ranks, experts, a), matrix(ranks, experts, b)]),
            }
        };
        let layers = map_dynamic(jobs.iter(), across, sample);
        let step = self.step as u64;
        self.step += 1;
        (step, layers)
    }
}

/// One layer of a sampled step: the whole step and, for a cut step, its two micro-batches.
struct SampledLayer {
    whole: LoadMatrix,
    halves: Option<[LoadMatrix; 2]>,
}

/// One step cut in two micro-batches ([`TraceGenerator::next_split`]).
#[derive(Debug, Clone, PartialEq)]
pub struct SplitStep {
    pub step: u64,
    /// One matrix per layer: the whole step.
    pub loads: Vec<LoadMatrix>,
    /// Per micro-batch, one matrix per layer.
    pub halves: [Vec<LoadMatrix>; 2],
}

fn matrix(ranks: usize, experts: usize, counts: Vec<u64>) -> LoadMatrix {
    LoadMatrix::from_flat(ranks, experts, counts)
        .expect("synthetic counts are bounded by ranks * tokens * top_k")
}

impl Iterator for TraceGenerator {
    type Item = TraceStep;

    fn next(&mut self) -> Option<TraceStep> {
        (self.step < self.spec.steps).then(|| self.next_step())
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.spec.steps - self.step;
        (left, Some(left))
    }
}

impl ExactSizeIterator for TraceGenerator {}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shared experts among the `n` hottest of two hot orders.
    fn overlap(a: &[u32], b: &[u32], n: usize) -> usize {
        a[..n].iter().filter(|e| b[..n].contains(e)).count()
    }

    fn spec(pattern: TracePattern) -> TraceSpec {
        TraceSpec::new(pattern, 4, 64, 6, 30, 64)
    }

    #[test]
    fn rows_sum_to_tokens_times_k_in_every_layer() {
        for pattern in TracePattern::ALL {
            let steps: Vec<TraceStep> = TraceGenerator::new(&spec(pattern), 1).unwrap().collect();
            assert_eq!(steps.len(), 30);
            for (i, step) in steps.iter().enumerate() {
                assert_eq!(step.step, i as u64);
                assert_eq!(step.loads.len(), 6);
                for load in &step.loads {
                    assert_eq!((load.ranks(), load.experts()), (4, 64));
                    for r in 0..4 {
                        assert_eq!(load.row(r).iter().sum::<u64>(), 64 * TOP_K as u64);
                    }
                }
            }
        }
    }

    #[test]
    fn same_seed_same_trace_any_thread_count() {
        let s = spec(TracePattern::Mixed);
        let a: Vec<_> = TraceGenerator::new(&s, 9)
            .unwrap()
            .with_threads(1)
            .collect();
        let b: Vec<_> = TraceGenerator::new(&s, 9)
            .unwrap()
            .with_threads(4)
            .collect();
        let c: Vec<_> = TraceGenerator::new(&s, 10).unwrap().collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn neighbouring_layers_share_more_hot_experts_than_distant_ones() {
        let (mut near, mut far) = (0, 0);
        for seed in 0..20 {
            let g = TraceGenerator::new(&spec(TracePattern::Stationary), seed).unwrap();
            near += overlap(g.hot_order(0), g.hot_order(1), 8);
            far += overlap(g.hot_order(0), g.hot_order(5), 8);
            assert_ne!(g.hot_order(0), g.hot_order(1));
        }
        assert!(near > far + 20, "near {near}, far {far}");
    }

    #[test]
    fn switches_happen_at_random_steps_and_move_the_hot_set() {
        let mut s = spec(TracePattern::Switching);
        s.steps = 200;
        let mut g = TraceGenerator::new(&s, 3).unwrap();
        let mut moved_at_switch = 0;
        let mut previous = g.hot_order(2).to_vec();
        while g.next().is_some() {
            let now = g.hot_order(2).to_vec();
            let switched = g.switch_steps().last() == Some(&(g.step as u64 - 1));
            if switched {
                moved_at_switch += usize::from(overlap(&previous, &now, 8) < 8);
            } else {
                // Switching without drift: nothing moves between switches.
                assert_eq!(previous, now);
            }
            previous = now;
        }
        let switches = g.switch_steps().to_vec();
        assert!((3..=25).contains(&switches.len()), "{switches:?}");
        assert_eq!(moved_at_switch, switches.len());
        let gaps: Vec<u64> = switches.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps.iter().any(|&g| g != gaps[0]), "periodic: {switches:?}");
    }

    #[test]
    fn drift_moves_hot_orders_a_little_every_step() {
        let mut g = TraceGenerator::new(&spec(TracePattern::Drifting), 5).unwrap();
        g.next();
        let before = g.hot_order(0).to_vec();
        g.next();
        assert_ne!(before, g.hot_order(0));
        assert!(overlap(&before, g.hot_order(0), 16) >= 12);
        assert!(g.switch_steps().is_empty());
    }

    #[test]
    fn bad_specs_are_rejected() {
        let mut s = spec(TracePattern::Mixed);
        s.layer_mix = 1.5;
        assert!(TraceGenerator::new(&s, 0)
            .unwrap_err()
            .0
            .contains("layer mix"));
        let mut s = spec(TracePattern::Mixed);
        s.top_k = 65;
        assert!(TraceGenerator::new(&s, 0).unwrap_err().0.contains("top-k"));
        let mut s = spec(TracePattern::Mixed);
        s.layers = 0;
        assert!(TraceGenerator::new(&s, 0).is_err());
        // Sizes are bounded before anything is allocated (100000 x 100000 asked for 80 GB, 10^8
        // layers ran out of memory, 2^64-1 ranks never finished).
        for (ranks, experts, layers, tokens, why) in [
            (
                100_000,
                100_000,
                8,
                64,
                "needs 1..=1024 ranks and at most 4096 experts",
            ),
            (usize::MAX, 32, 8, 64, "needs 1..=1024 ranks"),
            (
                8,
                64,
                100_000_000,
                64,
                "at most 67108864 load counts per step",
            ),
            (1024, 4096, 17, 64, "at most 67108864 load counts per step"),
            (8, 64, 8, (1 << 20) + 1, "needs 1..=1048576 tokens per rank"),
        ] {
            let s = TraceSpec::new(TracePattern::Mixed, ranks, experts, layers, 1, tokens);
            let err = TraceGenerator::new(&s, 0).unwrap_err().0;
            assert!(
                err.starts_with("synthetic trace: ") && err.contains(why),
                "{err}"
            );
        }
        let s = TraceSpec::new(TracePattern::Mixed, 1024, 4096, 16, 1, 64);
        assert!(s.check().is_ok());
        assert_eq!("mixed".parse::<TracePattern>(), Ok(TracePattern::Mixed));
        assert!("wavy".parse::<TracePattern>().is_err());
    }
}
