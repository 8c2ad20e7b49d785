//! A per-rank cost model of one MoE layer.
//!
//! On this host all ranks share a couple of cores, so wall time cannot show what balancing buys
//! on a rack, where ranks run concurrently and a layer lasts as long as its busiest rank. The
//! model charges every rank for the expert work it computes (token-expert pairs times the FLOPs
//! of one expert MLP row) and for the bytes it receives (dispatched activations and replica
//! weights), and takes the maximum over ranks: the simulated MoE makespan. The same layer is
//! also costed without balancing (every pair on its main expert's rank, no replicas), so one run
//! reports both.

use serde::Serialize;

/// Throughput figures of one rank.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CostModel {
    /// Sustained expert-GEMM FLOP/s of one rank.
    pub flops_per_s: f64,
    /// Bytes per second one rank can receive.
    pub bytes_per_s: f64,
}

impl Default for CostModel {
    /// One core of the development VM: its measured f32 GEMM peak (83 GFLOP/s per core, half
    /// of the 166 GFLOP/s measured on two) and a memcpy-class 10 GB/s.
    fn default() -> Self {
        Self {
            flops_per_s: 83e9,
            bytes_per_s: 10e9,
        }
    }
}

/// Simulated makespan of one MoE layer, with the plan and without balancing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct SimulatedMakespan {
    /// `max_t` over ranks of compute plus receive time with the plan, microseconds.
    pub balanced_us: f64,
    /// The same for the main-experts-only layout (no replicas, no replica bytes).
    pub unbalanced_us: f64,
}

impl CostModel {
    /// Costs one layer: `pairs_after[t]` / `pairs_before[t]` token-expert pairs computed on rank
    /// `t` with and without the plan, `recv_bytes[t]` bytes rank `t` receives with the plan
    /// (activations and replica weights), `recv_bytes_unbalanced[t]` without.
    pub fn layer(
        &self,
        flops_per_pair: f64,
        pairs_after: &[u64],
        recv_bytes: &[u64],
        pairs_before: &[u64],
        recv_bytes_unbalanced: &[u64],
    ) -> SimulatedMakespan {
        let busiest = |pairs: &[u64], bytes: &[u64]| -> f64 {
            pairs
                .iter()
                .zip(bytes)
                .map(|(&p, &b)| {
                    p as f64 * flops_per_pair / self.flops_per_s + b as f64 / self.bytes_per_s
                })
                .fold(0.0, f64::max)
                * 1e6
        };
        SimulatedMakespan {
            balanced_us: busiest(pairs_after, recv_bytes),
            unbalanced_us: busiest(pairs_before, recv_bytes_unbalanced),
        }
    }
}

/// FLOPs of one token through one gated expert MLP: three `H x I` products, two FLOPs each.
pub fn flops_per_pair(hidden: usize, intermediate: usize) -> f64 {
    6.0 * hidden as f64 * intermediate as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn makespan_is_the_busiest_rank() {
        let model = CostModel {
            flops_per_s: 1e6,
            bytes_per_s: 1e3,
        };
        // Rank 1: 2 pairs x 1e6 FLOPs = 2 s compute + 1000 bytes = 1 s -> 3 s; rank 0: 1 s.
        let got = model.layer(1e6, &[1, 2], &[0, 1000], &[3, 0], &[0, 0]);
        assert!((got.balanced_us - 3e6).abs() < 1e-6);
        assert!((got.unbalanced_us - 3e6).abs() < 1e-6);
        assert_eq!(flops_per_pair(2, 3), 36.0);
    }
}
