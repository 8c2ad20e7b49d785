//! `Plan::from_parts` (how device-side solvers hand plans back) rebuilds exactly the plan whose
//! arrays it is given, and refuses arrays that break any plan invariant instead of trusting them.

use rackfill_balancer::quota::QuotaPlanner;
use rackfill_balancer::{Balancer, Instance, Layout, LoadMatrix, Plan, PlanParts, PlanViolation};

fn parts_of(plan: &Plan) -> PlanParts {
    let mut parts = PlanParts {
        slots: plan.slots().to_vec(),
        ..PlanParts::default()
    };
    for e in 0..plan.experts() {
        parts.instance_offsets.push(parts.instances.len() as u32);
        parts.split_offsets.push(parts.split.len() as u32);
        parts.instances.extend_from_slice(plan.instances(e));
        for r in 0..plan.ranks() {
            parts
                .split
                .extend_from_slice(plan.split(r, e).unwrap_or(&[]));
        }
    }
    parts.instance_offsets.push(parts.instances.len() as u32);
    parts.split_offsets.push(parts.split.len() as u32);
    parts
}

fn skewed() -> (Layout, LoadMatrix, Plan) {
    let layout = Layout::contiguous(4, 8, 2).unwrap();
    let rows: Vec<Vec<u64>> = (0..4)
        .map(|r| {
            (0..8)
                .map(|e| if e == 1 { 90 + r } else { 3 + e })
                .collect()
        })
        .collect();
    let load = LoadMatrix::from_rows(&rows).unwrap();
    let plan = QuotaPlanner::new(1).plan(&layout, &load).unwrap();
    assert!(plan.replicas() > 0);
    (layout, load, plan)
}

#[test]
fn a_plan_round_trips_through_its_parts() {
    let (layout, load, plan) = skewed();
    let rebuilt = Plan::from_parts(&layout, &load, 1, parts_of(&plan)).unwrap();
    assert_eq!(rebuilt, plan);
}

#[test]
fn broken_parts_are_rejected() {
    let (layout, load, plan) = skewed();
    let good = parts_of(&plan);
    let check = |parts: PlanParts| Plan::from_parts(&layout, &load, 1, parts);

    let mut p = good.clone();
    p.instance_offsets[1] = u32::MAX;
    assert_eq!(check(p), Err(PlanViolation::Shape));
    let mut p = good.clone();
    p.split.pop();
    assert_eq!(check(p), Err(PlanViolation::Shape));
    let mut p = good.clone();
    p.slots.pop();
    assert_eq!(check(p), Err(PlanViolation::Shape));
    let mut p = good.clone();
    let replica = p.instance_offsets[1] as usize + 1;
    p.instances[replica] = Instance {
        quota: p.instances[replica].quota + 1,
        ..p.instances[replica]
    };
    assert!(matches!(check(p), Err(PlanViolation::QuotaSum { .. })));
    let mut p = good.clone();
    let free = p.slots.iter().position(Option::is_none).unwrap();
    p.slots[free] = Some(7);
    assert!(check(p).is_err());
    // A floor the replicas do not meet.
    assert!(matches!(
        Plan::from_parts(&layout, &load, u64::MAX, good),
        Err(PlanViolation::BelowFloor { .. })
    ));
}
