//! The GPU quota solver produces exactly the CPU quota planner's plan (slot assignment, quotas,
//! reroute split), for both target rules, several quota floors, explicit and contiguous layouts,
//! loads that need the wide (128-bit) split arithmetic, and the paper's R=64, E=256 shape.
//! GPU only: prints why and passes on machines without one.

#![cfg(feature = "cuda")]

mod cuda_common;

use cuda_common::common::random_layout;
use cuda_common::{gpu_or_skip, packs_keys, skewed_load, Rng};
use rackfill_balancer::quota::{QuotaPlanner, TargetRule};
use rackfill_balancer::{metrics, Balancer, Layout, LoadMatrix};
use rackfill_kernels::cuda::solver::GpuQuotaSolver;
use rackfill_kernels::cuda::Gpu;

fn assert_same_plan(
    gpu: &Gpu,
    layout: &Layout,
    load: &LoadMatrix,
    u_min: u64,
    rule: TargetRule,
    what: &str,
) -> usize {
    let cpu = QuotaPlanner::with_rule(u_min, rule)
        .plan(layout, load)
        .unwrap();
    let mut solver = GpuQuotaSolver::new(gpu, layout, u_min, rule).unwrap();
    let (plan, stats) = solver.plan(load).unwrap();
    assert_eq!(plan, cpu, "{what}: GPU plan differs from the CPU planner's");
    assert_eq!(stats.replicas as usize, cpu.replicas(), "{what}");
    let bound = metrics::lower_bound(layout, &load.expert_totals());
    assert_eq!(stats.lower_bound, bound, "{what}");
    assert_eq!(stats.packed_keys, packs_keys(layout, load), "{what}");
    cpu.replicas()
}

#[test]
fn gpu_plans_equal_cpu_plans_on_random_layers() {
    let Some(gpu) = gpu_or_skip("gpu_plans_equal_cpu_plans_on_random_layers") else {
        return;
    };
    let mut rng = Rng(11);
    let mut replicated = 0;
    for case in 0..200 {
        let layout = random_layout(&mut rng, 40, 160);
        let (ranks, experts, slots) = (layout.ranks(), layout.experts(), layout.slots_per_rank());
        let hot = 1 + rng.below(4) as usize;
        let load = skewed_load(&mut rng, ranks, experts, hot);
        let u_min = [1, 2, 16, 200][rng.below(4) as usize];
        let rule = if rng.below(2) == 0 {
            TargetRule::BestFit
        } else {
            TargetRule::LargestSlack
        };
        let what =
            format!("case {case}: R={ranks} E={experts} n_slot={slots} u_min={u_min} {rule:?}");
        replicated += usize::from(assert_same_plan(&gpu, &layout, &load, u_min, rule, &what) > 0);
    }
    assert!(
        replicated > 100,
        "only {replicated} cases replicated anything"
    );
}

#[test]
fn paper_shape_and_degenerate_loads() {
    let Some(gpu) = gpu_or_skip("paper_shape_and_degenerate_loads") else {
        return;
    };
    let mut rng = Rng(5);
    let layout = Layout::contiguous(64, 256, 2).unwrap();
    for seed in 0..20 {
        let load = skewed_load(&mut rng, 64, 256, 1 + seed % 6);
        let what = format!("R=64 E=256 seed {seed}");
        assert!(assert_same_plan(&gpu, &layout, &load, 1, TargetRule::BestFit, &what) > 0);
    }
    let layout = Layout::contiguous(8, 16, 2).unwrap();
    for (what, value) in [("zeros", 0u64), ("uniform", 9)] {
        let load = LoadMatrix::from_rows(&vec![vec![value; 16]; 8]).unwrap();
        assert_eq!(
            assert_same_plan(&gpu, &layout, &load, 1, TargetRule::BestFit, what),
            0
        );
    }
    // Counts near 2^40 make d * c overflow 64 bits in the split: the 128-bit path.
    let mut rows = vec![vec![1u64 << 20; 16]; 8];
    for (r, row) in rows.iter_mut().enumerate() {
        row[3] = (1 << 40) + r as u64 * 977;
    }
    let load = LoadMatrix::from_rows(&rows).unwrap();
    assert!(assert_same_plan(&gpu, &layout, &load, 1, TargetRule::BestFit, "wide") > 0);
    // No slots: nothing to replicate, every expert on its main instance.
    let bare = Layout::contiguous(8, 16, 0).unwrap();
    assert_eq!(
        assert_same_plan(&gpu, &bare, &load, 1, TargetRule::BestFit, "no slots"),
        0
    );
}

#[test]
fn a_solver_is_reused_across_layers_and_rejects_a_mismatched_load() {
    let Some(gpu) = gpu_or_skip("a_solver_is_reused_across_layers") else {
        return;
    };
    let layout = Layout::contiguous(16, 64, 2).unwrap();
    let mut solver = GpuQuotaSolver::new(&gpu, &layout, 1, TargetRule::BestFit).unwrap();
    let mut cpu = QuotaPlanner::new(1);
    let mut rng = Rng(3);
    for _ in 0..10 {
        let load = skewed_load(&mut rng, 16, 64, 2);
        assert_eq!(
            solver.plan(&load).unwrap().0,
            cpu.plan(&layout, &load).unwrap()
        );
    }
    let wrong = LoadMatrix::zeros(16, 65);
    assert!(solver.plan(&wrong).is_err());
}
