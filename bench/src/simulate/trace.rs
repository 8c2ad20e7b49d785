//! Where a simulation's routing comes from, and the force-balanced routing it is measured against.
//!
//! - `synthetic-mixed`: the multi-layer synthetic generator of [`crate::synthetic::multilayer`]
//!   with its `mixed` pattern (every layer its own skew and hot order, neighbouring layers
//!   correlated, hot orders drifting every step, random domain switches that reshuffle every
//!   layer, a per-rank lognormal perturbation, distinct top-k experts per token, each rank's row
//!   drawn by the spec's [`crate::synthetic::Sampler`]), with the
//!   popularity skew of [`MIXED_FAMILY`] and [`MIXED_LAYER_SKEW_SIGMA`] (calibration in
//!   `docs/simulate.md`).
//! - a recorded routing trace (`--record-routing` JSONL, read with
//!   [`TraceReader`]): its expert count must match the model shape; when
//!   its rank count differs from `--ep-size`, every expert's total is re-split evenly over the EP ranks
//!   (the trace's per-source split is dropped, its per-expert load kept).

use super::error::SimError;
use super::spec::SimSpec;
use crate::synthetic::multilayer::{TraceGenerator, TracePattern, TraceSpec};
use crate::synthetic::Popularity;
use rackfill_balancer::LoadMatrix;
use rackfill_engine::routing_trace::{TraceError, TraceReader};
use rand::rngs::StdRng;
use rand_distr::{Binomial, Distribution};
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

/// Popularity family of `synthetic-mixed`: lognormal expert weights with sigma 0.5 (per layer,
/// jittered by [`MIXED_LAYER_SKEW_SIGMA`]).
pub const MIXED_FAMILY: Popularity = Popularity::LogNormal { sigma: 0.5 };

/// Sigma of the per-layer multiplicative jitter of [`MIXED_FAMILY`]'s sigma: a few layers far
/// more skewed than the typical one (the hottest expert of the most skewed layers reaches about
/// 11x the mean expert load, the peak UltraEP §8.4 reports for serving without balancing).
pub const MIXED_LAYER_SKEW_SIGMA: f64 = 0.5;

/// The `--trace` argument.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TraceSource {
    /// `synthetic-stationary`, `-drifting`, `-switching` or `-mixed`: the multi-layer generator
    /// with that pattern's dynamics and `synthetic-mixed`'s popularity calibration.
    Synthetic(TracePattern),
    File(PathBuf),
}

impl TraceSource {
    /// The default routing, `synthetic-mixed`.
    pub const SYNTHETIC_MIXED: Self = Self::Synthetic(TracePattern::Mixed);

    /// `synthetic-PATTERN` or a file path.
    pub fn parse(s: &str) -> Self {
        s.strip_prefix("synthetic-")
            .and_then(|name| TracePattern::ALL.into_iter().find(|p| p.name() == name))
            .map_or_else(|| Self::File(PathBuf::from(s)), Self::Synthetic)
    }

    /// The name used in reports.
    pub fn label(&self) -> String {
        match self {
            Self::Synthetic(pattern) => format!("synthetic-{}", pattern.name()),
            Self::File(path) => path.display().to_string(),
        }
    }
}

/// A stream of steps, each one load matrix per simulated MoE layer.
pub enum LoadStream {
    Synthetic(Box<TraceGenerator>),
    Recorded {
        reader: Box<TraceReader<BufReader<File>>>,
        /// The file, named in every error (a problem may be found at any step).
        path: PathBuf,
        ep: usize,
    },
}

impl LoadStream {
    /// Synthetic routing with `pattern`'s dynamics for `spec`'s EP ranks, experts, top-k and
    /// simulated layers: `spec.chunk_tokens` tokens per rank and step, `steps` steps.
    pub fn synthetic(
        pattern: TracePattern,
        spec: &SimSpec,
        steps: usize,
    ) -> Result<Self, SimError> {
        let (ranks, experts, top_k) = (spec.ep, spec.shape.experts, spec.shape.top_k);
        let (layers, tokens_per_rank, seed) = (spec.sim_layers, spec.chunk_tokens, spec.seed);
        let (sampler, threads) = (spec.sampler, spec.threads);
        let mut spec = TraceSpec::new(pattern, ranks, experts, layers, steps, tokens_per_rank);
        spec.top_k = top_k;
        spec.family = MIXED_FAMILY;
        spec.layer_skew_sigma = MIXED_LAYER_SKEW_SIGMA;
        spec.sampler = sampler;
        let generator = TraceGenerator::new(&spec, seed)
            .map_err(|e| SimError::Input(e.to_string()))?
            .with_threads(threads);
        Ok(Self::Synthetic(Box::new(generator)))
    }

    /// A recorded trace whose expert count must be `experts`; re-split onto `ep` ranks when its
    /// own rank count differs.
    pub fn recorded(path: &Path, ep: usize, experts: usize) -> Result<Self, SimError> {
        let reader = TraceReader::open(path).map_err(|e| trace_error(path, e))?;
        if reader.experts() != experts {
            return Err(SimError::Input(format!(
                "routing trace {} has {} experts, the model shape has {experts}",
                path.display(),
                reader.experts()
            )));
        }
        Ok(Self::Recorded {
            reader: Box::new(reader),
            path: path.to_path_buf(),
            ep,
        })
    }

    /// Load matrices per step.
    pub fn layers(&self) -> usize {
        match self {
            Self::Synthetic(g) => g.spec().layers,
            Self::Recorded { reader, .. } => reader.layers().len(),
        }
    }

    /// The next step's matrices and, on synthetic routing, the two micro-batches' (every rank's
    /// first `first` tokens, then the rest) drawn with them; `None` at the end.
    #[allow(clippy::type_complexity)]
    pub fn next_split_step(
        &mut self,
        first: u64,
    ) -> Option<Result<(Vec<LoadMatrix>, Option<[Vec<LoadMatrix>; 2]>), SimError>> {
        match self {
            Self::Synthetic(g) => g
                .next_split(first)
                .map(|step| Ok((step.loads, Some(step.halves)))),
            Self::Recorded { .. } => self.next_step().map(|r| r.map(|loads| (loads, None))),
        }
    }

    /// The next step's matrices (already on the EP ranks), or `None` at the end.
    pub fn next_step(&mut self) -> Option<Result<Vec<LoadMatrix>, SimError>> {
        match self {
            Self::Synthetic(g) => g.next().map(|step| Ok(step.loads)),
            Self::Recorded { reader, path, ep } => {
                let ep = *ep;
                reader.next().map(|step| {
                    let step = step.map_err(|e| trace_error(path, e))?;
                    Ok(step
                        .loads
                        .into_iter()
                        .map(|load| {
                            if load.ranks() == ep {
                                load
                            } else {
                                resplit(&load.expert_totals(), ep)
                            }
                        })
                        .collect())
                })
            }
        }
    }
}

/// A trace error naming the file (an open error already does).
fn trace_error(path: &Path, e: TraceError) -> SimError {
    match e {
        TraceError::Open { .. } => SimError::Input(e.to_string()),
        _ => SimError::Input(format!("routing trace {}: {e}", path.display())),
    }
}

/// Every expert's total split evenly over `ranks` source ranks; the remainder of expert `e` goes
/// to ranks `e, e + 1, ...` (mod `ranks`) so row sums differ by little.
pub fn resplit(totals: &[u64], ranks: usize) -> LoadMatrix {
    let experts = totals.len();
    let mut counts = vec![0u64; ranks * experts];
    for (e, &total) in totals.iter().enumerate() {
        let (base, rem) = (total / ranks as u64, (total % ranks as u64) as usize);
        for r in 0..ranks {
            let extra = u64::from((r + ranks - e % ranks) % ranks < rem);
            counts[r * experts + e] = base + extra;
        }
    }
    LoadMatrix::from_flat(ranks, experts, counts).expect("a re-split keeps the trace's total")
}

/// Force-balanced routing (UltraEP's "ideal": the router sends tokens evenly over experts):
/// rank `r`'s `tokens[r] * top_k` pairs spread evenly over all experts, the remainder rotated by
/// rank so expert totals differ by at most a few pairs.
pub fn even_load(tokens: &[u64], experts: usize, top_k: usize) -> LoadMatrix {
    let ranks = tokens.len();
    let mut counts = vec![0u64; ranks * experts];
    let mut offset = 0usize;
    for (r, &n) in tokens.iter().enumerate() {
        let pairs = n * top_k as u64;
        let (base, rem) = (pairs / experts as u64, (pairs % experts as u64) as usize);
        for e in 0..experts {
            let extra = u64::from((e + experts - offset % experts) % experts < rem);
            counts[r * experts + e] = base + extra;
        }
        offset += rem;
    }
    LoadMatrix::from_flat(ranks, experts, counts).expect("even loads are bounded by the tokens")
}

/// Rows of `load`, which routed `full` tokens per rank, cut down to `keep[r]` tokens each: row
/// `r` keeps `keep[r] * k` of its `full * k` pairs, drawn expert by expert as a binomial share of
/// what is left (`Binomial(draws left, count / pairs left)`, the usual approximation of the
/// multivariate hypergeometric), clamped so that the row never keeps more of an expert than it
/// had and always keeps exactly its quota in total. Every expert keeps its expected share. Rows
/// with `keep >= full` are kept whole. Used when a request-driven step fills a rank only partly.
pub fn thin_rows(
    load: &LoadMatrix,
    full: u64,
    keep: &[u64],
    top_k: usize,
    rng: &mut StdRng,
) -> LoadMatrix {
    let (ranks, experts) = (load.ranks(), load.experts());
    let mut counts = Vec::with_capacity(ranks * experts);
    for (r, &n) in keep.iter().enumerate().take(ranks) {
        let row = load.row(r);
        if n >= full {
            counts.extend_from_slice(row);
            continue;
        }
        let mut population: u64 = row.iter().sum();
        let mut draws = (n * top_k as u64).min(population);
        for &c in row {
            let take = if draws == 0 || c == 0 {
                0
            } else {
                let share =
                    Binomial::new(draws, c as f64 / population as f64).map_or(0, |b| b.sample(rng));
                // Leave enough for the experts still to come, and take no more than there is.
                share
                    .max(draws.saturating_sub(population - c))
                    .min(c.min(draws))
            };
            counts.push(take);
            population -= c;
            draws -= take;
        }
    }
    LoadMatrix::from_flat(ranks, experts, counts).expect("thinning only removes pairs")
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn synthetic_patterns_parse_by_name_and_anything_else_is_a_file() {
        for pattern in TracePattern::ALL {
            let name = format!("synthetic-{}", pattern.name());
            assert_eq!(TraceSource::parse(&name), TraceSource::Synthetic(pattern));
            assert_eq!(TraceSource::parse(&name).label(), name);
        }
        assert_eq!(TraceSource::SYNTHETIC_MIXED.label(), "synthetic-mixed");
        assert_eq!(
            TraceSource::parse("synthetic-bursty"),
            TraceSource::File(PathBuf::from("synthetic-bursty"))
        );
    }

    #[test]
    fn even_load_is_even_and_keeps_every_pair() {
        let load = even_load(&[5, 5, 3], 4, 2);
        assert_eq!(load.row(0).iter().sum::<u64>(), 10);
        assert_eq!(load.row(2).iter().sum::<u64>(), 6);
        let totals = load.expert_totals();
        assert_eq!(totals.iter().sum::<u64>(), 26);
        let (lo, hi) = (totals.iter().min().unwrap(), totals.iter().max().unwrap());
        assert!(hi - lo <= 1, "{totals:?}");
    }

    #[test]
    fn resplit_keeps_expert_totals_on_new_ranks() {
        let load = LoadMatrix::from_rows(&[vec![7, 0, 3], vec![0, 5, 1]]).unwrap();
        let moved = resplit(&load.expert_totals(), 3);
        assert_eq!(moved.ranks(), 3);
        assert_eq!(moved.expert_totals(), vec![7, 5, 4]);
        let rows: Vec<u64> = (0..3).map(|r| moved.row(r).iter().sum()).collect();
        assert!(
            rows.iter().max().unwrap() - rows.iter().min().unwrap() <= 2,
            "{rows:?}"
        );
    }

    #[test]
    fn thinning_keeps_the_requested_pairs_and_never_adds() {
        let load = LoadMatrix::from_rows(&[vec![40, 30, 20, 10], vec![25, 25, 25, 25]]).unwrap();
        let mut rng = StdRng::seed_from_u64(3);
        let thin = thin_rows(&load, 50, &[10, 50], 2, &mut rng);
        assert_eq!(thin.row(0).iter().sum::<u64>(), 20);
        assert_eq!(thin.row(1), load.row(1));
        for e in 0..4 {
            assert!(thin.get(0, e) <= load.get(0, e));
        }
        assert_eq!(thin_rows(&load, 50, &[0, 0], 2, &mut rng).total(), 0);
        // Shares follow the row: half the tokens keep about half of every expert's pairs.
        let big = LoadMatrix::from_rows(&[vec![6000, 3000, 1000]]).unwrap();
        let half = thin_rows(&big, 5000, &[2500], 2, &mut rng);
        assert_eq!(half.total(), 5000);
        for (got, want) in half.row(0).iter().zip([3000, 1500, 500]) {
            assert!(got.abs_diff(want) < 150, "{:?}", half.row(0));
        }
    }
}
