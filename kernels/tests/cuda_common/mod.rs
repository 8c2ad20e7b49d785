//! Shared by the `cuda_*` tests: the GPU (or the printed reason there is none) and test data.

#![allow(dead_code)]

use rackfill_balancer::{LoadMatrix, Plan};
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

/// splitmix64: a tiny deterministic generator, enough for test data.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// In [-1, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
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
