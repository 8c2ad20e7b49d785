//! Statistical and reproducibility properties of `rackfill_engine::sampling`, through the public
//! API only: the sampled distribution must be exactly softmax(logits / T) restricted by top-k and
//! top-p, and a seed must fully determine the tokens.

use rackfill_engine::sampling::{Sampler, SamplingParams};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

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

fn frequencies(sampler: &mut Sampler, logits: &[f32], draws: usize) -> Vec<f64> {
    let mut counts = vec![0usize; logits.len()];
    for _ in 0..draws {
        counts[sampler.sample(logits).unwrap().token as usize] += 1;
    }
    counts.iter().map(|&c| c as f64 / draws as f64).collect()
}

const FIVE: [f32; 5] = [1.0, 2.0, 0.5, -1.0, 3.0];

#[test]
fn seeded_sampling_is_reproducible_and_seed_dependent() {
    let logits = random_logits(1000, 1);
    let run = |seed: Option<u64>, fallback: u64| {
        let p = SamplingParams {
            seed,
            ..params(1.5)
        };
        let mut s = Sampler::new(&p, &[], fallback).unwrap();
        (0..64)
            .map(|_| s.sample(&logits).unwrap().token)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        run(Some(42), 1),
        run(Some(42), 2),
        "seed overrides fallback"
    );
    assert_ne!(run(Some(42), 1), run(Some(43), 1));
    assert_eq!(run(None, 9), run(None, 9));
    assert_ne!(run(None, 9), run(None, 10));
}

#[test]
fn top_k_one_and_tiny_top_p_equal_greedy() {
    for seed in 0..20 {
        let logits = random_logits(5000, seed);
        let greedy = Sampler::new(&params(0.0), &[], 0)
            .unwrap()
            .sample(&logits)
            .unwrap();
        let top_k = SamplingParams {
            top_k: 1,
            ..params(2.0)
        };
        let top_p = SamplingParams {
            top_p: 1e-6,
            ..params(2.0)
        };
        for p in [top_k, top_p] {
            let got = Sampler::new(&p, &[], seed)
                .unwrap()
                .sample(&logits)
                .unwrap();
            assert_eq!(got, greedy);
        }
    }
}

#[test]
fn frequencies_match_softmax_at_temperature_one() {
    let mut s = Sampler::new(&params(1.0), &[], 11).unwrap();
    let freq = frequencies(&mut s, &FIVE, 20_000);
    for (f, p) in freq.iter().zip(softmax(&FIVE, 1.0)) {
        assert!((f - p).abs() < 0.015, "frequency {f} vs probability {p}");
    }
}

#[test]
fn temperature_scaling_sharpens_and_flattens() {
    let mut cold = Sampler::new(&params(0.5), &[], 5).unwrap();
    let mut hot = Sampler::new(&params(2.0), &[], 5).unwrap();
    let f_cold = frequencies(&mut cold, &FIVE, 20_000);
    let f_hot = frequencies(&mut hot, &FIVE, 20_000);
    for (f, p) in f_cold.iter().zip(softmax(&FIVE, 0.5)) {
        assert!((f - p).abs() < 0.015, "T=0.5: frequency {f} vs {p}");
    }
    for (f, p) in f_hot.iter().zip(softmax(&FIVE, 2.0)) {
        assert!((f - p).abs() < 0.015, "T=2: frequency {f} vs {p}");
    }
    let p_best = softmax(&FIVE, 1.0)[4];
    assert!(f_cold[4] > p_best + 0.1 && f_hot[4] < p_best - 0.1);
}

#[test]
fn top_k_restricts_and_renormalises() {
    let p = SamplingParams {
        top_k: 2,
        ..params(1.0)
    };
    let mut s = Sampler::new(&p, &[], 3).unwrap();
    let freq = frequencies(&mut s, &FIVE, 20_000);
    let (a, b) = (FIVE[4].exp() as f64, FIVE[1].exp() as f64);
    assert!((freq[4] - a / (a + b)).abs() < 0.015);
    assert!((freq[1] - b / (a + b)).abs() < 0.015);
    assert_eq!(freq[0] + freq[2] + freq[3], 0.0);
}

#[test]
fn top_p_keeps_the_nucleus_and_renormalises() {
    // Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps the first two.
    let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
    let p = SamplingParams {
        top_p: 0.7,
        ..params(1.0)
    };
    let mut s = Sampler::new(&p, &[], 8).unwrap();
    let freq = frequencies(&mut s, &logits, 20_000);
    assert!((freq[0] - 0.625).abs() < 0.015 && (freq[1] - 0.375).abs() < 0.015);
    assert_eq!(freq[2] + freq[3], 0.0);
}

#[test]
fn top_p_pruning_matches_a_full_sort() {
    for seed in 0..5 {
        let logits = random_logits(4000, 100 + seed);
        let probs = softmax(&logits, 1.0);
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
        let mut mass = 0.0;
        let nucleus_len = order
            .iter()
            .position(|&i| {
                mass += probs[i];
                mass >= 0.9
            })
            .unwrap()
            + 1;
        let nucleus: std::collections::HashSet<usize> =
            order[..nucleus_len].iter().copied().collect();
        let p = SamplingParams {
            top_p: 0.9,
            ..params(1.0)
        };
        let mut s = Sampler::new(&p, &[], seed).unwrap();
        let mut seen = std::collections::HashSet::new();
        for _ in 0..500 {
            let t = s.sample(&logits).unwrap().token as usize;
            assert!(nucleus.contains(&t), "token {t} outside the nucleus");
            seen.insert(t);
        }
        assert!(seen.len() > 10, "sampling covers the nucleus");
    }
}
