//! Shared by the `cuda_*` tests: the GPU (or the printed reason there is none) and test data.

#![allow(dead_code)]

#[path = "../common/mod.rs"]
pub mod common;

pub use common::Rng;
use rackfill_balancer::{Layout, LoadMatrix, Plan};
use rackfill_kernels::cuda::{CudaError, CudaUnavailable, Gpu};

/// Set to 1 on GPU hosts: a missing GPU then fails the tests instead of skipping them.
pub const REQUIRE_GPU: &str = "RACKFILL_REQUIRE_GPU";

/// Device 0 with every kernel compiled, or `None` after printing why the GPU part of a test is
/// skipped. Only "no driver" and "no device" skip; any other failure (a kernel that does not
/// compile or load, a broken driver) fails the test.
pub fn gpu_or_skip(test: &str) -> Option<Gpu> {
    match Gpu::open(0) {
        Ok(gpu) => Some(gpu),
        Err(CudaError::Unavailable(
            why @ (CudaUnavailable::NoDriver { .. } | CudaUnavailable::NoDevice),
        )) => {
            assert!(
                std::env::var(REQUIRE_GPU).map_or(true, |v| v != "1"),
                "{test}: {REQUIRE_GPU}=1 but no GPU: {why}"
            );
            eprintln!("{test}: skipped on this machine, no CUDA GPU ({why})");
            None
        }
        Err(other) => panic!("{test}: the GPU exists but cannot be used: {other}"),
    }
}

/// A load with a few hot experts over a noisy background.
pub fn skewed_load(rng: &mut Rng, ranks: usize, experts: usize, hot: usize) -> LoadMatrix {
    let hot: Vec<usize> = (0..hot)
        .map(|_| rng.below(experts as u64) as usize)
        .collect();
    let rows: Vec<Vec<u64>> = (0..ranks)
        .map(|_| {
            (0..experts)
                .map(|e| {
                    if hot.contains(&e) {
                        300 + rng.below(900)
                    } else {
                        rng.below(40)
                    }
                })
                .collect()
        })
        .collect();
    LoadMatrix::from_rows(&rows).unwrap()
}

/// Replicas in a plan, to assert a test exercises replication at all.
pub fn replicas(plan: &Plan) -> usize {
    plan.replicas()
}

/// Whether the quota solver may pick targets by packed 32-bit keys for this layer
/// (`SolveStats::packed_keys`): a rank index takes `ceil(log2 R)` bits, and every slack (below
/// the largest rank load before balancing) must fit in the rest.
pub fn packs_keys(layout: &Layout, load: &LoadMatrix) -> bool {
    let totals = load.expert_totals();
    let max_rank_load = (0..layout.ranks())
        .map(|r| {
            layout
                .main_experts(r)
                .iter()
                .map(|&e| totals[e as usize])
                .sum::<u64>()
        })
        .max()
        .unwrap_or(0);
    let rank_bits = layout.ranks().next_power_of_two().trailing_zeros();
    rank_bits < 32 && max_rank_load < 1u64 << (32 - rank_bits)
}
