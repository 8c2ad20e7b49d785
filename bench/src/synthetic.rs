//! Deterministic synthetic routing loads: a sequence of exact load matrices `load[r][e]`, one per
//! step (one MoE layer per step), shaped like what a top-k router produces under data-parallel
//! attention.
//!
//! Model of one step:
//! 1. a *global popularity* over experts: a [`Popularity`] family of weights (Zipf or lognormal)
//!    sorted from hottest to coldest and laid onto the experts through a random permutation (the
//!    "hot order");
//! 2. *per-rank variation*: source rank `r` routes with `global[e] * exp(sigma_r * N(0, 1))`
//!    (`sigma_r = `[`RANK_SIGMA`] by default), drawn fresh every step, so ranks differ the way
//!    different data-parallel batches do;
//! 3. *tokens*: every rank routes exactly `tokens_per_rank` tokens; each token picks `top_k`
//!    **distinct** experts (alias-table draws, duplicates rejected), so every row sums to
//!    `tokens_per_rank * top_k` and no entry exceeds `tokens_per_rank`;
//! 4. a temporal [`Pattern`] moves the hot order between steps (stationary, drifting, switching).
//!
//! Everything is a pure function of the [`Suite`] and the seed: the same pair always produces the
//! same matrices, whatever the number of generator threads (every rank of every step draws from its
//! own `StdRng` stream, seeded from the suite's master stream).
//!
//! [`multilayer`] builds on the same sampler for traces of many MoE layers per step (per-layer
//! popularity, correlated neighbouring layers, drift and domain switches at random steps).

use rackfill_balancer::{BalanceError, Layout, LoadMatrix};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, RngCore, SeedableRng};
use rand_distr::{Distribution, LogNormal};
use serde::Serialize;
use std::fmt;
use std::str::FromStr;

mod counts;
pub mod multilayer;
mod sample;

use sample::RankJob;
pub use sample::Sampler;

/// Experts per token in every suite of the default grid (DeepSeek-V3, Qwen3-MoE, GLM-4.x all use 8).
pub const TOP_K: usize = 8;

/// Default sigma of the per-rank lognormal perturbation of the global popularity.
pub const RANK_SIGMA: f64 = 0.3;

/// Steps between domain switches in the default grid's `switching` suites.
pub const DEFAULT_SWITCH_EVERY: usize = 5;

/// Most EP ranks a synthetic shape may have: NVL72 racks hold 72 GPUs and the largest EP
/// deployments a few hundred; the bound keeps every per-rank loop and matrix finite.
pub const MAX_RANKS: usize = 1024;

/// Most routed experts a synthetic shape may have (production MoE models route over a few hundred
/// at most); with [`MAX_RANKS`] one load matrix stays within 32 MiB.
pub const MAX_EXPERTS: usize = 4096;

/// Most tokens a rank may route per synthetic step: every token is sampled, so this bounds a
/// step's work (1024 ranks x 2^20 tokens x top-8 is already minutes per step).
pub const MAX_TOKENS_PER_RANK: u64 = 1 << 20;

/// EP shape: ranks `R`, logical experts `E`, redundant slots per rank `n_slot`; written `R/E/n_slot`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Shape {
    pub ranks: usize,
    pub experts: usize,
    pub slots: usize,
}

impl Shape {
    pub const fn new(ranks: usize, experts: usize, slots: usize) -> Self {
        Self {
            ranks,
            experts,
            slots,
        }
    }

    /// Checks the shape can be generated and laid out: `1..=`[`MAX_RANKS`] ranks,
    /// [`TOP_K`]`..=`[`MAX_EXPERTS`] experts, at most one redundant slot per expert (the balancer
    /// refuses more: a rank never holds an expert twice).
    pub fn check(&self) -> Result<(), String> {
        if !(1..=MAX_RANKS).contains(&self.ranks) {
            return Err(format!("needs 1..={MAX_RANKS} ranks"));
        }
        if !(TOP_K..=MAX_EXPERTS).contains(&self.experts) {
            return Err(format!(
                "needs {TOP_K}..={MAX_EXPERTS} experts (top-{TOP_K} routing picks distinct experts)"
            ));
        }
        if self.slots > self.experts {
            return Err(format!(
                "{} redundant slots per rank, at most {} (one per expert)",
                self.slots, self.experts
            ));
        }
        Ok(())
    }
}

/// The shapes the default grid covers.
pub const DEFAULT_SHAPES: [Shape; 6] = [
    Shape::new(8, 64, 2),
    Shape::new(32, 256, 4),
    // GLM-4.7: 160 routed experts.
    Shape::new(40, 160, 4),
    // Qwen3-235B-A22B: 128 experts.
    Shape::new(64, 128, 2),
    Shape::new(64, 256, 2),
    // DeepSeek-V3 (256 experts) on an NVL72 rack.
    Shape::new(72, 256, 2),
];

/// Tokens per rank per step in the default grid.
pub const DEFAULT_TOKENS: [u64; 4] = [256, 1024, 4096, 8192];

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.ranks, self.experts, self.slots)
    }
}

impl FromStr for Shape {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || format!("invalid shape '{s}': expected RANKS/EXPERTS/SLOTS, e.g. 72/256/2");
        let parts: Vec<&str> = s.trim().split('/').collect();
        let [r, e, n] = parts.as_slice() else {
            return Err(bad());
        };
        let num = |p: &str| p.trim().parse::<usize>().map_err(|_| bad());
        let shape = Shape::new(num(r)?, num(e)?, num(n)?);
        shape
            .check()
            .map_err(|why| format!("invalid shape '{s}': {why}"))?;
        Ok(shape)
    }
}

/// Popularity family: the sorted global expert weights before they are laid onto experts (named
/// apart from `rackfill_models::Family`, a model architecture).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Popularity {
    /// The `i`-th hottest expert (1-based) has weight `i^-s`.
    Zipf { s: f64 },
    /// Weights are i.i.d. `exp(sigma * N(0, 1))`, drawn once per suite.
    LogNormal { sigma: f64 },
}

impl Popularity {
    /// Every family of the default grid: Zipf 0.6/0.8/1.0/1.2, lognormal 0.5/0.8/1.2.
    pub const DEFAULT: [Popularity; 7] = [
        Popularity::Zipf { s: 0.6 },
        Popularity::Zipf { s: 0.8 },
        Popularity::Zipf { s: 1.0 },
        Popularity::Zipf { s: 1.2 },
        Popularity::LogNormal { sigma: 0.5 },
        Popularity::LogNormal { sigma: 0.8 },
        Popularity::LogNormal { sigma: 1.2 },
    ];

    /// Short label for names and reports, e.g. `zipf-1.0`, `lognormal-0.8`.
    pub fn label(&self) -> String {
        match self {
            Popularity::Zipf { s } => format!("zipf-{s:.1}"),
            Popularity::LogNormal { sigma } => format!("lognormal-{sigma:.1}"),
        }
    }

    /// The family's `experts` weights, hottest first (lognormal weights drawn from `rng`).
    pub(crate) fn sorted_weights(
        &self,
        experts: usize,
        rng: &mut StdRng,
    ) -> Result<Vec<f64>, String> {
        let mut weights: Vec<f64> = match *self {
            Popularity::Zipf { s } => (1..=experts).map(|i| (i as f64).powf(-s)).collect(),
            Popularity::LogNormal { sigma } => {
                let dist = LogNormal::new(0.0, sigma).map_err(|err| err.to_string())?;
                (0..experts).map(|_| dist.sample(rng)).collect()
            }
        };
        weights.sort_by(|a, b| b.total_cmp(a));
        Ok(weights)
    }

    pub(crate) fn check(&self) -> Result<(), String> {
        let (what, v) = match *self {
            Popularity::Zipf { s } => ("zipf exponent", s),
            Popularity::LogNormal { sigma } => ("lognormal sigma", sigma),
        };
        if !(v.is_finite() && (0.0..=8.0).contains(&v)) {
            return Err(format!("{what} must be in [0, 8], got {v}"));
        }
        Ok(())
    }
}

impl FromStr for Popularity {
    type Err = String;

    /// Parses a [`Popularity::label`]: `zipf-S` or `lognormal-SIGMA`, e.g. `zipf-1.0`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad =
            || format!("invalid family '{s}': expected zipf-S or lognormal-SIGMA, e.g. zipf-1.0");
        let (kind, value) = s.trim().rsplit_once('-').ok_or_else(bad)?;
        let v: f64 = value.parse().map_err(|_| bad())?;
        let family = match kind {
            "zipf" => Popularity::Zipf { s: v },
            "lognormal" => Popularity::LogNormal { sigma: v },
            _ => return Err(bad()),
        };
        family
            .check()
            .map_err(|why| format!("invalid family '{s}': {why}"))?;
        Ok(family)
    }
}

/// How the hot order moves from one step to the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Pattern {
    /// Same global popularity every step; only the per-rank perturbation and the token samples are
    /// fresh.
    Stationary,
    /// Gradual drift: before every step after the first, `max(1, E / 16)` swaps of two popularity
    /// positions at most `max(1, E / 8)` apart, so experts climb or fall a few places per step and
    /// the hot set turns over within tens of steps.
    Drifting,
    /// Domain switch: every `every` steps (at steps `every`, `2 every`, ...) a brand-new random hot
    /// order; stationary in between.
    Switching { every: usize },
}

impl Pattern {
    /// Short label, e.g. `stationary`, `drifting`, `switching-5`.
    pub fn label(&self) -> String {
        match self {
            Pattern::Stationary => "stationary".into(),
            Pattern::Drifting => "drifting".into(),
            Pattern::Switching { every } => format!("switching-{every}"),
        }
    }

    /// The label without parameters, for grouping (`switching-5` and `switching-10` are both
    /// `switching`).
    pub fn kind(&self) -> &'static str {
        match self {
            Pattern::Stationary => "stationary",
            Pattern::Drifting => "drifting",
            Pattern::Switching { .. } => "switching",
        }
    }
}

/// One synthetic workload: a shape, a token count, a popularity family, a temporal pattern and a
/// number of steps.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Suite {
    /// `R/E/n_slot family pattern tTOKENS`, unique within a grid.
    pub name: String,
    pub ranks: usize,
    pub experts: usize,
    pub slots: usize,
    pub tokens_per_rank: u64,
    pub top_k: usize,
    /// Sigma of the per-rank lognormal perturbation.
    pub rank_sigma: f64,
    pub family: Popularity,
    pub pattern: Pattern,
    pub steps: usize,
}

impl Suite {
    /// A suite with top-[`TOP_K`] routing and the default per-rank perturbation.
    pub fn new(
        shape: Shape,
        tokens_per_rank: u64,
        family: Popularity,
        pattern: Pattern,
        steps: usize,
    ) -> Self {
        Self {
            name: format!(
                "{shape} {} {} t{tokens_per_rank}",
                family.label(),
                pattern.label()
            ),
            ranks: shape.ranks,
            experts: shape.experts,
            slots: shape.slots,
            tokens_per_rank,
            top_k: TOP_K,
            rank_sigma: RANK_SIGMA,
            family,
            pattern,
            steps,
        }
    }

    pub fn shape(&self) -> Shape {
        Shape::new(self.ranks, self.experts, self.slots)
    }

    /// The contiguous layout the suite is balanced under.
    pub fn layout(&self) -> Result<Layout, BalanceError> {
        Layout::contiguous(self.ranks, self.experts, self.slots)
    }

    /// Checks that the suite can be generated.
    pub fn check(&self) -> Result<(), InvalidSuite> {
        let fail = |why: String| Err(InvalidSuite(format!("suite '{}': {why}", self.name)));
        if !(1..=MAX_RANKS).contains(&self.ranks) || self.experts > MAX_EXPERTS {
            return fail(format!(
                "needs 1..={MAX_RANKS} ranks and at most {MAX_EXPERTS} experts"
            ));
        }
        if self.top_k == 0 || self.top_k > self.experts {
            return fail(format!(
                "top-k {} must be in 1..={} (the expert count)",
                self.top_k, self.experts
            ));
        }
        if !(1..=MAX_TOKENS_PER_RANK).contains(&self.tokens_per_rank) {
            return fail(format!("needs 1..={MAX_TOKENS_PER_RANK} tokens per rank"));
        }
        if !(self.rank_sigma.is_finite() && (0.0..=8.0).contains(&self.rank_sigma)) {
            return fail(format!(
                "rank sigma must be in [0, 8], got {}",
                self.rank_sigma
            ));
        }
        if let Err(why) = self.family.check() {
            return fail(why);
        }
        if let Pattern::Switching { every: 0 } = self.pattern {
            return fail("switching period must be at least 1 step".into());
        }
        Ok(())
    }
}

/// A suite that cannot be generated, with a one-line reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidSuite(pub String);

/// The default benchmark grid over `shapes x tokens`:
///
/// | family                              | patterns                                   |
/// |-------------------------------------|--------------------------------------------|
/// | zipf 0.6, 0.8, 1.0, 1.2             | stationary                                 |
/// | lognormal 0.5, 0.8, 1.2             | stationary                                 |
/// | zipf 1.0, lognormal 0.8             | drifting, switching every 5 steps          |
///
/// i.e. 11 suites per (shape, tokens) pair. With the six default shapes, four token counts and 20
/// steps that is 264 suites, 5,280 load matrices and 26,400 plans (five balancers); generating the
/// top-8 samples dominates and takes about a minute on two cores in release.
///
/// Suites are ordered shape-major, then tokens, then the rows above.
pub fn default_grid(shapes: &[Shape], tokens: &[u64], steps: usize) -> Vec<Suite> {
    let moving = [
        Popularity::Zipf { s: 1.0 },
        Popularity::LogNormal { sigma: 0.8 },
    ];
    let mut suites = Vec::new();
    for &shape in shapes {
        for &t in tokens {
            for family in Popularity::DEFAULT {
                suites.push(Suite::new(shape, t, family, Pattern::Stationary, steps));
            }
            for pattern in [
                Pattern::Drifting,
                Pattern::Switching {
                    every: DEFAULT_SWITCH_EVERY,
                },
            ] {
                for family in moving {
                    suites.push(Suite::new(shape, t, family, pattern, steps));
                }
            }
        }
    }
    suites
}

/// The load matrices of `suite` under `seed`, one per step, generated lazily.
pub fn generate(suite: &Suite, seed: u64) -> Result<Generator, InvalidSuite> {
    Generator::new(suite, seed)
}

/// Iterator over a suite's load matrices (see the module docs for the model).
#[derive(Debug, Clone)]
pub struct Generator {
    suite: Suite,
    master: StdRng,
    /// Weights by popularity position, hottest first.
    sorted_weights: Vec<f64>,
    /// `hot_order[i]` is the expert at popularity position `i` (0 = hottest).
    hot_order: Vec<u32>,
    step: usize,
    threads: usize,
    /// Scratch: global popularity by expert id.
    popularity: Vec<f64>,
}

impl Generator {
    /// A generator for `suite` with the given seed, using all available cores for large steps.
    pub fn new(suite: &Suite, seed: u64) -> Result<Self, InvalidSuite> {
        suite.check()?;
        let mut master = StdRng::seed_from_u64(seed);
        let e = suite.experts;
        let sorted_weights = suite
            .family
            .sorted_weights(e, &mut master)
            .map_err(|err| InvalidSuite(format!("suite '{}': {err}", suite.name)))?;
        let mut hot_order: Vec<u32> = (0..e as u32).collect();
        hot_order.shuffle(&mut master);
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        Ok(Self {
            suite: suite.clone(),
            master,
            sorted_weights,
            hot_order,
            step: 0,
            threads,
            popularity: vec![0.0; e],
        })
    }

    /// Uses at most `threads` threads per step (1: everything on the calling thread). The output
    /// does not depend on it.
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.threads = threads.max(1);
        self
    }

    /// The suite being generated.
    pub fn suite(&self) -> &Suite {
        &self.suite
    }

    /// Steps generated so far.
    pub fn steps_done(&self) -> usize {
        self.step
    }

    /// The hot order of the most recent step (before the first step: of the first step):
    /// `hot_order()[i]` is the expert at popularity position `i`, hottest first.
    pub fn hot_order(&self) -> &[u32] {
        &self.hot_order
    }

    /// Moves the hot order from the previous step to step `self.step` according to the pattern.
    fn advance_pattern(&mut self) {
        if self.step == 0 {
            return;
        }
        match self.suite.pattern {
            Pattern::Stationary => {}
            Pattern::Drifting => drift(&mut self.hot_order, &mut self.master),
            Pattern::Switching { every } => {
                if self.step.is_multiple_of(every) {
                    self.hot_order.shuffle(&mut self.master);
                }
            }
        }
    }

    fn next_matrix(&mut self) -> LoadMatrix {
        self.advance_pattern();
        for (pos, &expert) in self.hot_order.iter().enumerate() {
            self.popularity[expert as usize] = self.sorted_weights[pos];
        }
        let (ranks, experts) = (self.suite.ranks, self.suite.experts);
        let rank_seeds: Vec<u64> = (0..ranks).map(|_| self.master.next_u64()).collect();
        let job = RankJob {
            popularity: &self.popularity,
            rank_sigma: self.suite.rank_sigma,
            tokens: self.suite.tokens_per_rank,
            top_k: self.suite.top_k,
            // The balancer benchmark's grid keeps the per-token reference its figures were
            // measured with.
            sampler: Sampler::Tokens,
        };
        let counts = job.sample(&rank_seeds, self.threads);
        self.step += 1;
        LoadMatrix::from_flat(ranks, experts, counts)
            .expect("synthetic counts are bounded by ranks * tokens * top_k")
    }
}

/// One step of [`Pattern::Drifting`]: `max(1, E / 16)` swaps of two popularity positions at most
/// `max(1, E / 8)` apart.
pub(crate) fn drift(hot_order: &mut [u32], rng: &mut StdRng) {
    let e = hot_order.len();
    if e < 2 {
        return;
    }
    let swaps = (e / 16).max(1);
    let reach = (e / 8).max(1);
    for _ in 0..swaps {
        let i = rng.gen_range(0..e);
        let d = rng.gen_range(1..=reach);
        let j = if i + d < e {
            i + d
        } else {
            i.saturating_sub(d)
        };
        hot_order.swap(i, j);
    }
}

impl Iterator for Generator {
    type Item = LoadMatrix;

    fn next(&mut self) -> Option<LoadMatrix> {
        (self.step < self.suite.steps).then(|| self.next_matrix())
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.suite.steps - self.step;
        (left, Some(left))
    }
}

impl ExactSizeIterator for Generator {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_parse_and_reject() {
        assert_eq!("72/256/2".parse::<Shape>().unwrap(), Shape::new(72, 256, 2));
        assert_eq!(Shape::new(40, 160, 4).to_string(), "40/160/4");
        for bad in ["72/256", "a/b/c", "0/64/2", "8/4/2", "8/64/2/1", ""] {
            let err = bad.parse::<Shape>().unwrap_err();
            assert!(err.starts_with("invalid shape"), "{err}");
            assert!(!err.contains('\n'));
        }
        // Bounded before anything is laid out (2^64-1 ranks looped for ever, 100000 x 100000
        // allocated 80 GB), and slots the balancer would refuse are refused here, up front.
        for (bad, why) in [
            ("18446744073709551615/32/2", "needs 1..=1024 ranks"),
            ("1025/256/2", "needs 1..=1024 ranks"),
            ("100000/100000/2", "needs 1..=1024 ranks"),
            ("8/4097/2", "needs 8..=4096 experts"),
            ("8/64/65", "65 redundant slots per rank, at most 64"),
        ] {
            let err = bad.parse::<Shape>().unwrap_err();
            assert!(
                err.starts_with(&format!("invalid shape '{bad}': {why}")),
                "{err}"
            );
        }
        assert_eq!("1024/4096/4096".parse::<Shape>().unwrap().ranks, 1024);
    }
}
