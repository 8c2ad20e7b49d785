//! Test data shared by the kernels tests (CPU and `cuda_*`): a tiny deterministic generator and
//! skewed routed batches, so the CPU reference and the GPU kernels are fed the same way.

#![allow(dead_code)]

use rackfill_balancer::{Layout, LoadMatrix};

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

/// A layout of 1..=`max_ranks` ranks, 1..=`max_experts` experts and 0..=3 slots per rank; one
/// in three puts every expert on a random home rank instead of contiguous blocks.
pub fn random_layout(rng: &mut Rng, max_ranks: u64, max_experts: u64) -> Layout {
    let ranks = 1 + rng.below(max_ranks) as usize;
    let experts = 1 + rng.below(max_experts) as usize;
    let slots = (rng.below(4) as usize).min(experts);
    if rng.below(3) == 0 {
        let home = (0..experts)
            .map(|_| rng.below(ranks as u64) as u32)
            .collect();
        Layout::with_home(ranks, home, slots).unwrap()
    } else {
        Layout::contiguous(ranks, experts, slots).unwrap()
    }
}

/// One source rank's batch: activations, routed experts (distinct per token) and router weights.
pub struct Batch {
    pub x: Vec<f32>,
    pub experts: Vec<u32>,
    pub weights: Vec<f32>,
}

/// Shape of [`skewed_batches`]: rank `r` routes `base_tokens + r * tokens_per_rank + U[0, 20)`
/// tokens, and 8 tokens in 10 pick `hot` first, so the planner must replicate it.
pub struct Routing {
    pub ranks: usize,
    pub experts: usize,
    pub top_k: usize,
    pub hidden: usize,
    pub hot: u32,
    pub base_tokens: usize,
    pub tokens_per_rank: usize,
}

/// Seeded skewed routing with random activations and weights.
pub fn skewed_batches(seed: u64, shape: &Routing) -> Vec<Batch> {
    let mut rng = Rng(seed);
    (0..shape.ranks)
        .map(|r| {
            let tokens = shape.base_tokens + shape.tokens_per_rank * r + rng.below(20) as usize;
            let mut experts = Vec::with_capacity(tokens * shape.top_k);
            for _ in 0..tokens {
                let mut chosen: Vec<u32> = Vec::new();
                if rng.below(10) < 8 {
                    chosen.push(shape.hot);
                }
                while chosen.len() < shape.top_k {
                    let e = rng.below(shape.experts as u64) as u32;
                    if !chosen.contains(&e) {
                        chosen.push(e);
                    }
                }
                experts.extend(chosen);
            }
            Batch {
                x: (0..tokens * shape.hidden).map(|_| rng.unit()).collect(),
                weights: (0..tokens * shape.top_k).map(|_| rng.unit()).collect(),
                experts,
            }
        })
        .collect()
}

/// The load matrix the batches route: `load[r][e]` counts rank r's choices of expert e.
pub fn load_of(batches: &[Batch], experts: usize) -> LoadMatrix {
    let mut load = LoadMatrix::zeros(batches.len(), experts);
    for (r, b) in batches.iter().enumerate() {
        for &e in &b.experts {
            *load.get_mut(r, e as usize) += 1;
        }
    }
    load
}
