//! Criterion benches of one layer's solve, steady state (planner scratch and load matrix warm),
//! on synthetic Zipf-1.0 loads with 2048 tokens per rank, top-8.
//!
//! `cargo bench -p rackfill-bench --bench solver`; docs/balancer.md records the figures.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use rackfill_balancer::{Algo, LoadMatrix, Settings};
use rackfill_bench::synthetic::{generate, Pattern, Popularity, Shape, Suite};

const SHAPES: [Shape; 3] = [
    Shape::new(64, 256, 2),
    Shape::new(72, 256, 2),
    Shape::new(32, 256, 4),
];

/// Stateless planners: every iteration solves the same layer from scratch.
const ALGOS: [Algo; 5] = [
    Algo::None,
    Algo::Quota,
    Algo::QuotaPaper,
    Algo::EplbExact,
    Algo::GreedyMove,
];

/// A few layers of one suite, so the figure is not one lucky matrix.
fn layers(shape: Shape) -> Vec<LoadMatrix> {
    let suite = Suite::new(
        shape,
        2048,
        Popularity::Zipf { s: 1.0 },
        Pattern::Drifting,
        4,
    );
    generate(&suite, 7)
        .expect("the bench suite is valid")
        .collect()
}

fn solve(c: &mut Criterion) {
    let settings = Settings::default();
    for shape in SHAPES {
        let layout = rackfill_balancer::Layout::contiguous(shape.ranks, shape.experts, shape.slots)
            .expect("the bench shapes are valid");
        let loads = layers(shape);
        let mut group = c.benchmark_group(format!("solve/{shape}"));
        for algo in ALGOS {
            let mut planner = algo.build(&settings);
            group.bench_function(BenchmarkId::from_parameter(algo.name()), |b| {
                let mut next = 0;
                b.iter(|| {
                    next = (next + 1) % loads.len();
                    planner.plan(&layout, &loads[next]).expect("plan")
                })
            });
        }
        group.finish();
    }
}

criterion_group!(benches, solve);
criterion_main!(benches);
