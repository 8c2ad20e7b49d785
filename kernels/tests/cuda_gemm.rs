//! Grouped expert GEMM with cuBLAS: every group's rows times its own weight matrix, main experts
//! and replicas alike, stored either way round, matches a CPU matmul; malformed groups are
//! refused. GPU only.

#![cfg(feature = "cuda")]

mod cuda_common;

use cuda_common::{gpu_or_skip, Rng};
use rackfill_kernels::cuda::gemm::{GemmGroup, GroupedGemm, WeightOrder};

#[test]
fn grouped_gemm_matches_a_cpu_matmul() {
    let Some(gpu) = gpu_or_skip("grouped_gemm_matches_a_cpu_matmul") else {
        return;
    };
    let s = gpu.stream();
    let (k, n) = (96, 72);
    let groups_rows = [5usize, 0, 17, 1, 33];
    let total: usize = groups_rows.iter().sum();
    let mut rng = Rng(4);
    let x: Vec<f32> = (0..total * k).map(|_| rng.unit()).collect();
    let weights: Vec<Vec<f32>> = groups_rows
        .iter()
        .map(|_| (0..n * k).map(|_| rng.unit()).collect())
        .collect();
    // The same matrices stored `k x n` (pre-transposed, the engine's expert layout).
    let transposed: Vec<Vec<f32>> = weights
        .iter()
        .map(|w| {
            let mut t = vec![0f32; n * k];
            for j in 0..n {
                for i in 0..k {
                    t[i * n + j] = w[j * k + i];
                }
            }
            t
        })
        .collect();
    let d_x = s.clone_htod(&x).unwrap();
    let gemm = GroupedGemm::new(&gpu).unwrap();
    for (order, stored) in [
        (WeightOrder::OutByIn, &weights),
        (WeightOrder::InByOut, &transposed),
    ] {
        let mut d_y = s.alloc_zeros::<f32>(total * n).unwrap();
        let d_w: Vec<_> = stored.iter().map(|w| s.clone_htod(w).unwrap()).collect();
        let mut start = 0;
        let groups: Vec<GemmGroup> = groups_rows
            .iter()
            .zip(&d_w)
            .map(|(&rows, w)| {
                let g = GemmGroup {
                    rows: start..start + rows,
                    weight: w.slice(..),
                };
                start += rows;
                g
            })
            .collect();
        gemm.run(&gpu, &d_x, &mut d_y, k, n, order, &groups)
            .unwrap();
        let y = s.clone_dtoh(&d_y).unwrap();
        let mut row = 0;
        for (g, &rows) in groups_rows.iter().enumerate() {
            for _ in 0..rows {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|i| f64::from(x[row * k + i]) * f64::from(weights[g][j * k + i]))
                        .sum();
                    let got = f64::from(y[row * n + j]);
                    assert!(
                        (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "{order:?} group {g} row {row} col {j}: {got} vs {want}"
                    );
                }
                row += 1;
            }
        }
    }
    let d_w: Vec<_> = weights.iter().map(|w| s.clone_htod(w).unwrap()).collect();
    let mut d_y = s.alloc_zeros::<f32>(total * n).unwrap();
    let bad = [GemmGroup {
        rows: 0..total + 1,
        weight: d_w[0].slice(..),
    }];
    assert!(gemm
        .run(&gpu, &d_x, &mut d_y, k, n, WeightOrder::OutByIn, &bad)
        .is_err());
    let short = [GemmGroup {
        rows: 0..1,
        weight: d_w[0].slice(..n * k - 1),
    }];
    assert!(gemm
        .run(&gpu, &d_x, &mut d_y, k, n, WeightOrder::OutByIn, &short)
        .is_err());
}
