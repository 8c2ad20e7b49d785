//! Property tests: every planner produces valid, deterministic plans on random and adversarial
//! loads, and the quota planner is never worse than no balancing.

use proptest::prelude::*;
use rackfill_balancer::metrics::{evaluate, lower_bound};
use rackfill_balancer::{Algo, BalanceError, Layout, LoadMatrix, Plan, Settings, TokenAssignment};

/// Load shapes that stress different parts of the planners.
#[derive(Debug, Clone, Copy)]
enum Pattern {
    Random,
    Zeros,
    OneExpertTakesAll,
    Uniform,
    OneRankAllHot,
    Skewed,
}

fn pattern() -> impl Strategy<Value = Pattern> {
    prop_oneof![
        Just(Pattern::Random),
        Just(Pattern::Zeros),
        Just(Pattern::OneExpertTakesAll),
        Just(Pattern::Uniform),
        Just(Pattern::OneRankAllHot),
        Just(Pattern::Skewed),
    ]
}

/// Builds a load matrix from a pattern and a seed (a small LCG keeps cases reproducible).
fn make_load(layout: &Layout, pattern: Pattern, seed: u64, scale: u64) -> LoadMatrix {
    let (ranks, experts) = (layout.ranks(), layout.experts());
    let mut state = seed | 1;
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        state >> 33
    };
    let hot_rank = (seed as usize) % ranks;
    let hot_expert = (seed as usize / 7) % experts;
    let mut load = LoadMatrix::zeros(ranks, experts);
    for r in 0..ranks {
        for e in 0..experts {
            *load.get_mut(r, e) = match pattern {
                Pattern::Random => next() % (scale + 1),
                Pattern::Zeros => 0,
                Pattern::OneExpertTakesAll => u64::from(e == hot_expert) * scale * 8,
                Pattern::Uniform => scale,
                Pattern::OneRankAllHot => {
                    if layout.home(e) == hot_rank {
                        scale * 4 + next() % (scale + 1)
                    } else {
                        next() % (scale / 8 + 1)
                    }
                }
                // Zipf-like: weight 1 / (rank of popularity + 1).
                Pattern::Skewed => {
                    let p = (e * 7919 + seed as usize) % experts;
                    scale * 8 / (p as u64 + 1) + next() % 3
                }
            };
        }
    }
    load
}

fn max_load(plan: &Plan) -> u64 {
    plan.rank_loads().into_iter().max().unwrap_or(0)
}

/// Every tokens' instance from the cumulative lookup reproduces the plan's split exactly.
fn check_token_assignment(load: &LoadMatrix, plan: &Plan) {
    let assignment = TokenAssignment::new(plan);
    for e in 0..plan.experts() {
        let n = plan.instances(e).len();
        for r in 0..load.ranks() {
            let tokens = load.get(r, e);
            if tokens > 4096 {
                continue; // keep the exhaustive walk cheap
            }
            let mut counts = vec![0u64; n];
            for j in 0..tokens {
                counts[assignment.instance_of(r, e, j)] += 1;
            }
            match plan.split(r, e) {
                Some(row) => assert_eq!(counts, row, "expert {e} source {r}"),
                None => assert_eq!(counts[0], tokens),
            }
        }
    }
}

fn check_all_planners(layout: &Layout, load: &LoadMatrix) {
    let settings = Settings::default();
    let none = Algo::None.build(&settings).plan(layout, load).unwrap();
    let bound = lower_bound(layout, &load.expert_totals());
    for algo in Algo::ALL {
        let mut planner = algo.build(&settings);
        let plan = planner.plan(layout, load).unwrap();
        if let Err(v) = plan.validate(layout, load, planner.u_min()) {
            panic!("{algo}: {v}");
        }
        // Deterministic: a fresh planner and a reused one agree.
        let again = algo.build(&settings).plan(layout, load).unwrap();
        assert_eq!(plan, again, "{algo} is not deterministic");
        assert!(max_load(&plan) >= bound, "{algo} beat the lower bound");
        check_token_assignment(load, &plan);
        if matches!(algo, Algo::Quota | Algo::QuotaPaper) {
            assert!(
                max_load(&plan) <= max_load(&none),
                "quota made the busiest rank busier"
            );
            let reused = planner.plan(layout, load).unwrap();
            assert_eq!(plan, reused, "quota planner scratch leaks between calls");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn planners_hold_invariants(
        ranks in 1usize..12,
        experts in 1usize..40,
        slots in 0usize..4,
        pattern in pattern(),
        seed in any::<u64>(),
        scale in prop_oneof![1u64..300, (1u64 << 28)..(1u64 << 40)],
        scatter_home in any::<bool>(),
    ) {
        let slots = slots.min(experts);
        let layout = if scatter_home {
            let home = (0..experts).map(|e| ((e * 5 + seed as usize) % ranks) as u32).collect();
            Layout::with_home(ranks, home, slots).unwrap()
        } else {
            Layout::contiguous(ranks, experts, slots).unwrap()
        };
        let load = make_load(&layout, pattern, seed, scale);
        check_all_planners(&layout, &load);
    }

    #[test]
    fn history_planner_is_valid_over_a_sequence(
        ranks in 1usize..9,
        experts in 1usize..33,
        slots in 0usize..3,
        seed in any::<u64>(),
    ) {
        let layout = Layout::contiguous(ranks, experts, slots.min(experts)).unwrap();
        let settings = Settings { history_window: 3, rebalance_interval: 2, ..Settings::default() };
        let mut a = Algo::EplbHistory.build(&settings);
        let mut b = Algo::EplbHistory.build(&settings);
        for step in 0..7u64 {
            let load = make_load(&layout, Pattern::Skewed, seed.wrapping_add(step), 50);
            let plan = a.plan(&layout, &load).unwrap();
            prop_assert!(plan.validate(&layout, &load, 0).is_ok());
            prop_assert_eq!(plan, b.plan(&layout, &load).unwrap());
        }
    }
}

#[test]
fn rack_scale_shapes() {
    // NVL72-class and beyond: 144 ranks, 512 experts, E not a multiple of R.
    for (ranks, experts, slots) in [(144, 512, 2), (72, 256, 2), (40, 160, 4), (7, 30, 1)] {
        let layout = Layout::contiguous(ranks, experts, slots).unwrap();
        for (i, pattern) in [Pattern::Skewed, Pattern::OneRankAllHot, Pattern::Random]
            .into_iter()
            .enumerate()
        {
            let load = make_load(&layout, pattern, 42 + i as u64, 400);
            check_all_planners(&layout, &load);
        }
    }
}

#[test]
fn single_rank_and_no_slots_leave_mains_alone() {
    let layout = Layout::contiguous(1, 8, 4).unwrap();
    let load = make_load(&layout, Pattern::Skewed, 3, 100);
    check_all_planners(&layout, &load);
    for algo in Algo::ALL {
        assert_eq!(
            algo.build(&Settings::default())
                .plan(&layout, &load)
                .unwrap()
                .replicas(),
            0
        );
    }
    let layout = Layout::contiguous(8, 64, 0).unwrap();
    let load = make_load(&layout, Pattern::OneRankAllHot, 3, 100);
    for algo in Algo::ALL {
        let plan = algo
            .build(&Settings::default())
            .plan(&layout, &load)
            .unwrap();
        assert_eq!(plan.replicas(), 0, "{algo} used slots that do not exist");
    }
}

#[test]
fn quota_reaches_the_lower_bound_on_a_skewed_layer() {
    let layout = Layout::contiguous(8, 64, 2).unwrap();
    let load = make_load(&layout, Pattern::Skewed, 11, 500);
    let plan = Algo::Quota
        .build(&Settings::default())
        .plan(&layout, &load)
        .unwrap();
    let m = evaluate(&layout, &load, &plan);
    assert!(
        m.imbalance_before > 1.3,
        "fixture is not skewed: {}",
        m.imbalance_before
    );
    assert!(m.gap <= 1.001, "gap to lower bound {}", m.gap);
}

#[test]
fn shape_mismatch_is_an_error_not_a_panic() {
    let layout = Layout::contiguous(4, 8, 1).unwrap();
    let load = LoadMatrix::zeros(3, 8);
    for algo in Algo::ALL {
        let err = algo
            .build(&Settings::default())
            .plan(&layout, &load)
            .unwrap_err();
        assert!(err.to_string().contains("3 x 8"), "{algo}: {err}");
    }
}

#[test]
fn more_slots_than_experts_are_refused() {
    // A rank never holds an expert twice: a slot beyond the expert count could never be filled.
    for (ranks, experts, slots) in [(2, 4, 5), (1, 0, 2), (3, 3, usize::MAX)] {
        let err = Layout::contiguous(ranks, experts, slots).unwrap_err();
        assert_eq!(err, BalanceError::TooManySlots { slots, experts });
        assert!(err.to_string().contains("at most"), "{err}");
    }
    assert_eq!(Layout::contiguous(2, 4, 4).unwrap().slots_per_rank(), 4);
    assert_eq!(Layout::contiguous(2, 0, 1).unwrap().slots_per_rank(), 1);
}
