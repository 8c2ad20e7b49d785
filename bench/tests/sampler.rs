//! The count sampler against the per-token reference, on every synthetic pattern the simulator
//! offers (its popularity calibration: `synthetic-mixed`'s lognormal with per-layer skew).
//!
//! With the same seed both samplers see the same hot orders, per-layer skews and per-rank
//! perturbed weights (each row's generator draws the perturbation first), so they differ only in
//! how a row's tokens are drawn: the per-token sampler picks every token's experts, the count
//! sampler draws the row's counts from Rosén's inclusion probabilities. Each statistic is
//! compared with a bound derived from the sampling error of this run's size; the per-expert
//! means also allow Rosén's known bias (at most 2% of the mean; see `docs/simulate.md`).

use rackfill_balancer::LoadMatrix;
use rackfill_bench::simulate::trace::{MIXED_FAMILY, MIXED_LAYER_SKEW_SIGMA};
use rackfill_bench::synthetic::multilayer::{TraceGenerator, TracePattern, TraceSpec};
use rackfill_bench::synthetic::Sampler;

const RANKS: usize = 8;
const EXPERTS: usize = 64;
const LAYERS: usize = 4;
const STEPS: usize = 40;
const TOKENS: u64 = 512;
const TOP_K: usize = 8;

/// `[step][layer]` matrices of `pattern` drawn by `sampler`.
fn trace(pattern: TracePattern, sampler: Sampler, seed: u64) -> Vec<Vec<LoadMatrix>> {
    let mut spec = TraceSpec::new(pattern, RANKS, EXPERTS, LAYERS, STEPS, TOKENS);
    spec.family = MIXED_FAMILY;
    spec.layer_skew_sigma = MIXED_LAYER_SKEW_SIGMA;
    spec.top_k = TOP_K;
    spec.sampler = sampler;
    TraceGenerator::new(&spec, seed)
        .unwrap()
        .map(|step| step.loads)
        .collect()
}

/// Mean and variance of `xs`.
fn moments(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, var)
}

/// Max over mean of the expert totals (summed over source ranks).
fn expert_imbalance(load: &LoadMatrix) -> f64 {
    let totals = load.expert_totals();
    let max = *totals.iter().max().unwrap() as f64;
    max / (totals.iter().sum::<u64>() as f64 / totals.len() as f64)
}

#[test]
fn count_sampler_keeps_the_per_token_statistics_on_every_pattern() {
    for pattern in TracePattern::ALL {
        let tokens = trace(pattern, Sampler::Tokens, 5);
        let counts = trace(pattern, Sampler::Counts, 5);
        // Top-k distinctness: every row routes exactly k experts per token, none twice.
        for load in counts.iter().chain(&tokens).flatten() {
            for r in 0..RANKS {
                let row = load.row(r);
                assert_eq!(row.iter().sum::<u64>(), TOKENS * TOP_K as u64);
                assert!(row.iter().all(|&c| c <= TOKENS), "{pattern}: {row:?}");
            }
        }
        let (mut worst_z, mut var_ratios, mut rows_compared) = (0.0f64, Vec::new(), 0);
        let mut hot_bias = Vec::new();
        for l in 0..LAYERS {
            for e in 0..EXPERTS {
                // Every (step, rank) row's count of expert e in layer l, paired by row.
                let cell = |t: &[Vec<LoadMatrix>]| -> Vec<f64> {
                    t.iter()
                        .flat_map(|step| (0..RANKS).map(move |r| step[l].get(r, e) as f64))
                        .collect()
                };
                let (a, b) = (cell(&tokens), cell(&counts));
                let diffs: Vec<f64> = a.iter().zip(&b).map(|(x, y)| y - x).collect();
                let (d_mean, d_var) = moments(&diffs);
                let ((m_a, v_a), (_, v_b)) = (moments(&a), moments(&b));
                let se = (d_var / diffs.len() as f64).sqrt();
                // Means: within 4 standard errors of the paired difference plus Rosen's bias.
                let bound = 4.0 * se + 0.02 * m_a;
                assert!(
                    d_mean.abs() <= bound,
                    "{pattern} layer {l} expert {e}: per-token mean {m_a:.2}, counts {:.2} \
                     (bound {bound:.2})",
                    m_a + d_mean
                );
                worst_z = worst_z.max(d_mean.abs() / se.max(1e-9));
                if m_a >= 2.0 * (TOKENS * TOP_K as u64) as f64 / EXPERTS as f64 {
                    hot_bias.push(d_mean / m_a);
                }
                if m_a >= 5.0 {
                    var_ratios.push(v_b / v_a);
                    rows_compared += 1;
                }
            }
        }
        // Variances across rows (the perturbation's spread plus the binomial draw): their ratio
        // averaged over the experts, whose sampling error is about sqrt(2 / 160 / 200) per ratio
        // averaged down; within 6%.
        let (ratio, _) = moments(&var_ratios);
        assert!(
            (ratio - 1.0).abs() < 0.06,
            "{pattern}: variance ratio counts / tokens {ratio:.3} over {rows_compared} experts"
        );
        // The max/mean imbalance of every layer, averaged over the steps: within 3%.
        for l in 0..LAYERS {
            let imbalance = |t: &[Vec<LoadMatrix>]| {
                moments(
                    &t.iter()
                        .map(|s| expert_imbalance(&s[l]))
                        .collect::<Vec<_>>(),
                )
            };
            let ((i_a, v_a), (i_b, v_b)) = (imbalance(&tokens), imbalance(&counts));
            let se = ((v_a + v_b) / STEPS as f64).sqrt();
            assert!(
                (i_b - i_a).abs() <= 4.0 * se + 0.01 * i_a,
                "{pattern} layer {l}: imbalance per token {i_a:.3}, counts {i_b:.3}"
            );
        }
        let (bias, _) = moments(&hot_bias);
        eprintln!(
            "{pattern}: worst per-expert mean difference {worst_z:.1} standard errors; experts \
             at twice the mean load or more ({}): counts {:+.2}% on average; variance ratio \
             {ratio:.3}",
            hot_bias.len(),
            100.0 * bias
        );
    }
}

#[test]
fn micro_batch_halves_add_up_to_the_step_and_split_the_tokens() {
    for sampler in [Sampler::Counts, Sampler::Tokens] {
        let mut spec = TraceSpec::new(TracePattern::Mixed, RANKS, EXPERTS, LAYERS, 3, TOKENS);
        spec.sampler = sampler;
        let whole: Vec<_> = TraceGenerator::new(&spec, 2).unwrap().collect();
        let mut split = TraceGenerator::new(&spec, 2).unwrap();
        for step in &whole {
            let cut = split.next_split(200).unwrap();
            for (l, load) in cut.loads.iter().enumerate() {
                let [a, b] = [&cut.halves[0][l], &cut.halves[1][l]];
                for r in 0..RANKS {
                    assert_eq!(a.row(r).iter().sum::<u64>(), 200 * TOP_K as u64);
                    assert_eq!(b.row(r).iter().sum::<u64>(), 312 * TOP_K as u64);
                    for e in 0..EXPERTS {
                        assert_eq!(a.get(r, e) + b.get(r, e), load.get(r, e));
                    }
                }
            }
            // The per-token sampler's halves are the same tokens as the whole step.
            if sampler == Sampler::Tokens {
                assert_eq!(&cut.loads, &step.loads);
            }
        }
    }
}

/// The simulator's headline on the same routing parameters with either sampler: Qwen3-235B's
/// shape on 16 ranks, 8 simulated layers, 20 steps of synthetic-mixed routing.
fn headline(sampler: Sampler) -> Vec<(String, f64)> {
    use rackfill_balancer::relay::RelayConfig;
    use rackfill_balancer::{Algo, Settings};
    use rackfill_bench::simulate::shape::ModelShape;
    use rackfill_bench::simulate::trace::TraceSource;
    use rackfill_bench::simulate::{run_throughput, SimSpec, ThroughputRun};
    use rackfill_engine::{Rack, Schedule, SlotMemory};
    let run = ThroughputRun {
        spec: SimSpec {
            rack: Rack::nvl72(),
            shape: ModelShape::load("qwen3-235b").unwrap(),
            ep: 16,
            slots: 2,
            algos: vec![Algo::Quota, Algo::EplbHistory, Algo::None],
            settings: Settings::default(),
            relay: RelayConfig::default(),
            solve_us: Some(111.0),
            sim_layers: 8,
            chunk_tokens: 2048,
            seed: 3,
            schedule: Schedule::OVERLAPPED,
            slot_memory: SlotMemory::Shared,
            reuse_tolerance: None,
            sampler,
            threads: 2,
        },
        trace: TraceSource::SYNTHETIC_MIXED,
        steps: 20,
        context_tokens: 0,
    };
    let report = run_throughput(&run, |_, _| {}).unwrap();
    assert_eq!(report.sampler, sampler.name());
    report
        .balancers
        .iter()
        .map(|b| (b.balancer.clone(), b.fraction_of_ideal))
        .collect()
}

#[test]
fn fraction_of_ideal_moves_by_at_most_a_hundredth_with_the_count_sampler() {
    let (tokens, counts) = (headline(Sampler::Tokens), headline(Sampler::Counts));
    for ((name, a), (_, b)) in tokens.iter().zip(&counts) {
        eprintln!("{name}: per token {a:.4}, counts {b:.4}");
        assert!(
            (a - b).abs() <= 0.01,
            "{name}: per token {a:.4}, counts {b:.4}"
        );
    }
    // The balancers still rank as they do: quota above none.
    assert!(counts[0].1 > counts[2].1 + 0.05, "{counts:?}");
}
