//! Invariants of the synthetic load generator.

use rackfill_balancer::LoadMatrix;
use rackfill_bench::synthetic::{
    default_grid, generate, Pattern, Popularity, Shape, Suite, DEFAULT_SHAPES, DEFAULT_TOKENS,
    TOP_K,
};

fn suite(family: Popularity, pattern: Pattern, tokens: u64, steps: usize) -> Suite {
    Suite::new(Shape::new(8, 64, 2), tokens, family, pattern, steps)
}

fn loads(suite: &Suite, seed: u64) -> Vec<LoadMatrix> {
    generate(suite, seed).unwrap().collect()
}

/// The `n` experts with the largest totals, sorted by id.
fn hot_set(load: &LoadMatrix, n: usize) -> Vec<usize> {
    let totals = load.expert_totals();
    let mut order: Vec<usize> = (0..totals.len()).collect();
    order.sort_by_key(|&e| (std::cmp::Reverse(totals[e]), e));
    let mut hot = order[..n].to_vec();
    hot.sort_unstable();
    hot
}

#[test]
fn rows_sum_to_tokens_times_k_and_entries_are_bounded() {
    for family in Popularity::DEFAULT {
        for tokens in [1, 7, 256] {
            let s = suite(family, Pattern::Stationary, tokens, 3);
            let all = loads(&s, 11);
            assert_eq!(all.len(), 3);
            for load in &all {
                assert_eq!((load.ranks(), load.experts()), (8, 64));
                for r in 0..load.ranks() {
                    let row = load.row(r);
                    assert_eq!(row.iter().sum::<u64>(), tokens * TOP_K as u64, "{}", s.name);
                    assert!(row.iter().all(|&c| c <= tokens), "{}: {row:?}", s.name);
                }
            }
        }
    }
}

#[test]
fn top_k_equal_to_expert_count_routes_every_token_everywhere() {
    let mut s = Suite::new(
        Shape::new(3, 8, 1),
        50,
        Popularity::Zipf { s: 1.2 },
        Pattern::Stationary,
        2,
    );
    s.top_k = 8;
    for load in loads(&s, 3) {
        assert!(load.as_flat().iter().all(|&c| c == 50));
    }
}

#[test]
fn same_seed_same_loads_different_seed_different_loads() {
    let s = suite(
        Popularity::LogNormal { sigma: 0.8 },
        Pattern::Drifting,
        512,
        4,
    );
    assert_eq!(loads(&s, 7), loads(&s, 7));
    assert_ne!(loads(&s, 7), loads(&s, 8));
    // Steps differ from each other even when stationary (fresh samples).
    let st = loads(
        &suite(Popularity::Zipf { s: 1.0 }, Pattern::Stationary, 512, 2),
        7,
    );
    assert_ne!(st[0], st[1]);
}

#[test]
fn output_does_not_depend_on_generator_threads() {
    // Large enough to take the parallel path.
    let s = Suite::new(
        Shape::new(8, 64, 2),
        2048,
        Popularity::Zipf { s: 0.8 },
        Pattern::Switching { every: 1 },
        2,
    );
    let one: Vec<_> = generate(&s, 5).unwrap().with_threads(1).collect();
    let four: Vec<_> = generate(&s, 5).unwrap().with_threads(4).collect();
    assert_eq!(one, four);
}

#[test]
fn skew_follows_the_family() {
    // Higher Zipf exponent -> hotter hottest expert.
    let share = |family| {
        let load = &loads(&suite(family, Pattern::Stationary, 2048, 1), 1)[0];
        let totals = load.expert_totals();
        *totals.iter().max().unwrap() as f64 / load.total() as f64
    };
    let flat = share(Popularity::Zipf { s: 0.6 });
    let steep = share(Popularity::Zipf { s: 1.2 });
    assert!(steep > flat * 1.5, "{flat} vs {steep}");
    // Ranks differ (per-rank perturbation), but agree on which experts are hot.
    let load = &loads(
        &suite(Popularity::Zipf { s: 1.0 }, Pattern::Stationary, 4096, 1),
        2,
    )[0];
    assert_ne!(load.row(0), load.row(1));
}

#[test]
fn stationary_keeps_the_hot_order() {
    let s = suite(Popularity::Zipf { s: 1.0 }, Pattern::Stationary, 64, 6);
    let mut g = generate(&s, 9).unwrap();
    let first = {
        g.next().unwrap();
        g.hot_order().to_vec()
    };
    for _ in g.by_ref() {}
    assert_eq!(g.hot_order(), first.as_slice());
    assert_eq!(g.steps_done(), 6);
}

#[test]
fn drifting_changes_the_hot_set_gradually() {
    let s = suite(Popularity::Zipf { s: 1.2 }, Pattern::Drifting, 512, 21);
    let mut g = generate(&s, 4).unwrap();
    let mut orders = Vec::new();
    let mut all = Vec::new();
    while let Some(load) = g.next() {
        orders.push(g.hot_order().to_vec());
        all.push(load);
    }
    // Gradual: consecutive steps differ in a few positions only.
    for w in orders.windows(2) {
        let moved = w[0].iter().zip(&w[1]).filter(|(a, b)| a != b).count();
        assert!(moved > 0 && moved <= 2 * (64 / 16), "{moved}");
    }
    // ...but the hot set turns over: the top-8 popularity positions of step 0 and step 20 differ,
    // and so do the measured hot sets.
    let top = |o: &Vec<u32>| {
        let mut t = o[..8].to_vec();
        t.sort_unstable();
        t
    };
    assert_ne!(top(&orders[0]), top(&orders[20]));
    assert_ne!(hot_set(&all[0], 8), hot_set(&all[20], 8));
}

#[test]
fn switching_changes_the_hot_order_exactly_at_k() {
    let k = 4;
    let s = suite(
        Popularity::Zipf { s: 1.2 },
        Pattern::Switching { every: k },
        512,
        9,
    );
    let mut g = generate(&s, 12).unwrap();
    let mut orders = Vec::new();
    let mut all = Vec::new();
    while let Some(load) = g.next() {
        orders.push(g.hot_order().to_vec());
        all.push(load);
    }
    for step in 1..9 {
        if step % k == 0 {
            assert_ne!(orders[step - 1], orders[step], "step {step}");
        } else {
            assert_eq!(orders[step - 1], orders[step], "step {step}");
        }
    }
    // The measured hottest expert is the one the hot order says, and it moves at the switch.
    let hottest = |load: &LoadMatrix| {
        let t = load.expert_totals();
        (0..t.len())
            .max_by_key(|&e| (t[e], std::cmp::Reverse(e)))
            .unwrap() as u32
    };
    assert_eq!(hottest(&all[3]), orders[3][0]);
    assert_eq!(hottest(&all[4]), orders[4][0]);
    assert_ne!(hot_set(&all[3], 4), hot_set(&all[4], 4));
}

#[test]
fn invalid_suites_are_rejected_with_a_reason() {
    let mut s = suite(
        Popularity::Zipf { s: 1.0 },
        Pattern::Switching { every: 0 },
        16,
        2,
    );
    let err = generate(&s, 0).unwrap_err().to_string();
    assert!(err.contains("switching period"), "{err}");
    s.pattern = Pattern::Stationary;
    s.top_k = 65;
    assert!(generate(&s, 0).unwrap_err().to_string().contains("top-k"));
    s.top_k = 8;
    s.tokens_per_rank = 0;
    assert!(generate(&s, 0).is_err());
}

#[test]
fn default_grid_has_eleven_suites_per_shape_and_token_count() {
    let grid = default_grid(&DEFAULT_SHAPES, &DEFAULT_TOKENS, 20);
    assert_eq!(grid.len(), 6 * 4 * 11);
    let mut names: Vec<&str> = grid.iter().map(|s| s.name.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), grid.len(), "suite names are unique");
    assert!(grid.iter().all(|s| s.check().is_ok() && s.steps == 20));
    assert!(names.contains(&"72/256/2 zipf-1.0 switching-5 t8192"));
}
