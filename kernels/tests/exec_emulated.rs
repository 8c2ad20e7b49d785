//! The host emulator as an executor: it builds from the whole-model sources, refuses launches it
//! cannot run, keeps copies inside their buffers, and its reference GEMM computes what cuBLAS's
//! strided batched GEMM is asked for (bf16 and f32 operands, both weight layouts, alpha, beta,
//! leading dimensions wider than the rows). Needs a C++ compiler; without one it says so and
//! passes.

#![cfg(feature = "cuda")]

use rackfill_kernels::cuda::exec::{
    round_bf16, DType, Emulator, Executor, ExecutorExt, Gemm, Launch, MatrixRef, WeightLayout,
};

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8;
            (x % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}

#[test]
fn unknown_kernels_and_bad_launches_are_errors() {
    let Some(emu) = Emulator::shared() else {
        return;
    };
    // SAFETY: nothing runs: the launches are refused before any kernel is called.
    let unknown = unsafe { emu.launch("no_such_kernel", Launch::blocks(1, 32), &[]) };
    assert!(unknown.unwrap_err().to_string().contains("no_such_kernel"));
    let buffer = emu.alloc_zeroed(8).unwrap();
    assert!(emu.write(&buffer, 4, &[0; 8]).is_err());
    let mut out = [0u8; 9];
    assert!(emu.read(&buffer, 0, &mut out).is_err());
    assert!(emu.describe().starts_with("host emulator"));
}

#[test]
fn uploads_round_trip_and_bf16_rounds_to_nearest_even() {
    let Some(emu) = Emulator::shared() else {
        return;
    };
    let xs = values(37, 1);
    assert_eq!(emu.download_f32(&emu.upload_f32(&xs).unwrap()).unwrap(), xs);
    let rounded: Vec<f32> = xs.iter().map(|&x| round_bf16(x)).collect();
    assert_eq!(
        emu.download_bf16(&emu.upload_bf16(&xs).unwrap()).unwrap(),
        rounded
    );
    let ids = [0u32, 7, u32::MAX];
    assert_eq!(
        emu.download_u32(&emu.upload_u32(&ids).unwrap()).unwrap(),
        ids
    );
}

/// `c = alpha a op(b) + beta c0` on the host, f64, from values already rounded as stored.
#[allow(clippy::too_many_arguments)]
fn expected(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    b: &[f32],
    layout: WeightLayout,
    c0: &[f32],
    alpha: f32,
    beta: f32,
) -> Vec<f32> {
    let mut c = vec![0f32; m * n];
    for r in 0..m {
        for col in 0..n {
            let dot: f64 = (0..k)
                .map(|i| {
                    let w = match layout {
                        WeightLayout::OutByIn => b[col * k + i],
                        WeightLayout::InByOut => b[i * n + col],
                    };
                    f64::from(a[r * k + i]) * f64::from(w)
                })
                .sum();
            c[r * n + col] =
                (f64::from(alpha) * dot + f64::from(beta) * f64::from(c0[r * n + col])) as f32;
        }
    }
    c
}

#[test]
fn the_reference_gemm_computes_the_described_product() {
    let Some(emu) = Emulator::shared() else {
        return;
    };
    let (m, n, k) = (5, 7, 12);
    for layout in [WeightLayout::OutByIn, WeightLayout::InByOut] {
        for dtype in [DType::Bf16, DType::F32] {
            let round = |v: Vec<f32>| -> Vec<f32> {
                if dtype == DType::Bf16 {
                    v.into_iter().map(round_bf16).collect()
                } else {
                    v
                }
            };
            let (a, b, c0) = (
                round(values(m * k, 3)),
                round(values(n * k, 4)),
                values(m * n, 5),
            );
            let upload = |v: &[f32]| match dtype {
                DType::Bf16 => emu.upload_bf16(v).unwrap(),
                DType::F32 => emu.upload_f32(v).unwrap(),
            };
            let (da, db, dc) = (upload(&a), upload(&b), emu.upload_f32(&c0).unwrap());
            let mut g = Gemm::linear(
                m,
                n,
                k,
                (da.ptr(), dtype),
                (db.ptr(), dtype),
                (dc.ptr(), DType::F32),
            );
            g.b_layout = layout;
            if layout == WeightLayout::InByOut {
                g.b.ld = n;
            }
            g.alpha = 0.5;
            g.beta = 2.0;
            // SAFETY: every operand is a buffer of exactly the described size.
            unsafe { emu.gemm(&g) }.unwrap();
            let got = emu.download_f32(&dc).unwrap();
            let want = expected(m, n, k, &a, &b, layout, &c0, 0.5, 2.0);
            for (x, y) in got.iter().zip(&want) {
                assert!(
                    (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                    "{layout:?} {dtype:?}: {x} vs {y}"
                );
            }
        }
    }
}

#[test]
fn a_batched_gemm_reads_each_head_through_its_strides() {
    let Some(emu) = Emulator::shared() else {
        return;
    };
    // Two heads interleaved in each row of `a` (row stride 2k) and of `c` (row stride 2n): the
    // per-head products DeepSeek's absorbed attention runs.
    let (m, n, k, heads) = (3, 4, 6, 2);
    let a = values(m * heads * k, 9);
    let b = values(heads * n * k, 10);
    let (da, db) = (emu.upload_f32(&a).unwrap(), emu.upload_f32(&b).unwrap());
    let dc = emu.alloc_zeroed(m * heads * n * 4).unwrap();
    let g = Gemm {
        m,
        n,
        k,
        batch: heads,
        a: MatrixRef {
            ptr: da.ptr(),
            dtype: DType::F32,
            ld: heads * k,
            batch_stride: k,
        },
        b: MatrixRef {
            ptr: db.ptr(),
            dtype: DType::F32,
            ld: k,
            batch_stride: n * k,
        },
        b_layout: WeightLayout::OutByIn,
        c: MatrixRef {
            ptr: dc.ptr(),
            dtype: DType::F32,
            ld: heads * n,
            batch_stride: n,
        },
        alpha: 1.0,
        beta: 0.0,
    };
    // SAFETY: the strides stay inside the three buffers.
    unsafe { emu.gemm(&g) }.unwrap();
    let got = emu.download_f32(&dc).unwrap();
    for h in 0..heads {
        let ah: Vec<f32> = (0..m)
            .flat_map(|r| a[r * heads * k + h * k..][..k].to_vec())
            .collect();
        let want = expected(
            m,
            n,
            k,
            &ah,
            &b[h * n * k..][..n * k],
            WeightLayout::OutByIn,
            &vec![0.0; m * n],
            1.0,
            0.0,
        );
        for r in 0..m {
            for c in 0..n {
                let (x, y) = (got[r * heads * n + h * n + c], want[r * n + c]);
                assert!(
                    (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                    "head {h} ({r},{c}): {x} vs {y}"
                );
            }
        }
    }
}
