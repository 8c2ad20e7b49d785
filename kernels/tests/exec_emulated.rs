//! The host emulator as an executor: it builds from the whole-model sources, refuses launches it
//! cannot run, keeps copies inside their buffers, and its reference GEMM computes what cuBLAS's
//! strided batched GEMM is asked for (bf16 and f32 operands, both weight layouts, alpha, beta,
//! leading dimensions wider than the rows), the load-time conversions (`convert.cu`) give what
//! the host's rounding gives, and each emulator counts the bytes the host wrote into it. Needs a
//! C++ compiler; without one it says so and passes.

#![cfg(feature = "cuda")]

use rackfill_kernels::cuda::exec::{
    f32_to_bf16, round_bf16, DType, Emulator, EmulatorSettings, Executor, ExecutorExt, Gemm,
    KernelArg, Launch, MatrixRef, WeightLayout,
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

#[test]
fn each_emulator_counts_the_bytes_the_host_wrote_into_it() {
    let Some(shared) = Emulator::shared() else {
        return;
    };
    let (a, b) = (
        shared.with_settings(EmulatorSettings::default()),
        shared.with_settings(EmulatorSettings::default()),
    );
    let buffer = a.alloc_zeroed(64).unwrap();
    assert_eq!(a.bytes_uploaded(), 0, "allocating writes nothing");
    a.write(&buffer, 8, &[1; 24]).unwrap();
    a.upload_f32(&[1.0; 5]).unwrap();
    assert!(a.write(&buffer, 60, &[0; 8]).is_err(), "out of range");
    let copy = a.alloc_zeroed(64).unwrap();
    a.copy(&buffer, 0, &copy, 0, 64).unwrap();
    a.zero_on(rackfill_kernels::cuda::exec::Stream::MAIN, &copy, 0, 64)
        .unwrap();
    assert_eq!(
        a.bytes_uploaded(),
        24 + 20,
        "host writes only, refused ones not"
    );
    assert_eq!(b.bytes_uploaded(), 0, "another emulator's count");
}

/// Launches `convert_elements` on `n` elements of `src_dtype` (0 f32, 1 bf16, 2 f16) into
/// `dst_dtype` (0 f32, 1 bf16); returns the destination's bytes.
fn convert(emu: &Emulator, src: &[u8], src_dtype: u32, n: usize, dst_dtype: u32) -> Vec<u8> {
    let input = emu.upload(src).unwrap();
    let size = if dst_dtype == 0 { 4 } else { 2 };
    let out = emu.alloc_zeroed(n * size).unwrap();
    // SAFETY: `input` holds n elements of `src_dtype`, `out` n of `dst_dtype`.
    unsafe {
        emu.launch(
            "convert_elements",
            Launch::blocks(3, 64),
            &[
                KernelArg::from(&input),
                KernelArg::U32(src_dtype),
                KernelArg::U64(n as u64),
                KernelArg::from(&out),
                KernelArg::U32(dst_dtype),
            ],
        )
    }
    .unwrap();
    let mut bytes = vec![0u8; n * size];
    emu.read(&out, 0, &mut bytes).unwrap();
    bytes
}

fn u16s(bytes: &[u8]) -> Vec<u16> {
    bytes
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// IEEE binary16 bits as f64, from the definition.
fn f16_value(h: u16) -> f64 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (i32::from((h >> 10) & 31), f64::from(h & 1023));
    sign * match e {
        0 => m * 2f64.powi(-24),
        31 if m == 0.0 => f64::INFINITY,
        31 => f64::NAN,
        _ => (1024.0 + m) * 2f64.powi(e - 25),
    }
}

/// float8_e4m3fn bits as f64, from the definition (no infinities; S.1111.111 is NaN).
fn e4m3_value(v: u8) -> f64 {
    let sign = if v & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (i32::from((v >> 3) & 15), f64::from(v & 7));
    sign * match e {
        15 if m == 7.0 => f64::NAN,
        0 => m * 2f64.powi(-9),
        _ => (8.0 + m) * 2f64.powi(e - 10),
    }
}

fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

#[test]
fn load_conversions_round_once_as_the_host_does() {
    let Some(emu) = Emulator::shared() else {
        return;
    };
    // f32 to bf16: ties to even, NaN kept, infinities, subnormals; and f32 to f32 unchanged.
    let mut xs = values(301, 7);
    xs.extend([
        1.0 + 2f32.powi(-8),
        1.0 + 3.0 * 2f32.powi(-8),
        f32::NAN,
        f32::INFINITY,
        -f32::INFINITY,
        1e-40,
        -0.0,
        f32::MAX,
    ]);
    let bytes: Vec<u8> = xs.iter().flat_map(|v| v.to_le_bytes()).collect();
    let want: Vec<u16> = xs.iter().map(|&v| f32_to_bf16(v)).collect();
    assert_eq!(u16s(&convert(&emu, &bytes, 0, xs.len(), 1)), want);
    assert_eq!(convert(&emu, &bytes, 0, xs.len(), 0), bytes);
    // bf16 to f32 exactly.
    let halves: Vec<u8> = want.iter().flat_map(|v| v.to_le_bytes()).collect();
    let widened = f32s(&convert(&emu, &halves, 1, want.len(), 0));
    for (&h, &w) in want.iter().zip(&widened) {
        assert!(same(f32::from_bits(u32::from(h) << 16), w), "{h:#x}");
    }
    // Every f16 to f32 exactly, and to bf16 rounded once.
    let all: Vec<u16> = (0..=u16::MAX).collect();
    let bytes: Vec<u8> = all.iter().flat_map(|v| v.to_le_bytes()).collect();
    let to_f32 = f32s(&convert(&emu, &bytes, 2, all.len(), 0));
    let to_bf16 = u16s(&convert(&emu, &bytes, 2, all.len(), 1));
    for (i, &h) in all.iter().enumerate() {
        let v = f16_value(h) as f32;
        assert!(same(to_f32[i], v), "f16 {h:#06x}: {} vs {v}", to_f32[i]);
        assert_eq!(to_bf16[i] & 0x7fff > 0x7f80, v.is_nan(), "f16 {h:#06x}");
        if !v.is_nan() {
            assert_eq!(to_bf16[i], f32_to_bf16(v), "f16 {h:#06x}");
        }
    }
}

#[test]
fn fp8_blocks_dequantize_with_their_own_scales() {
    let Some(emu) = Emulator::shared() else {
        return;
    };
    // A 5 x 7 matrix holding every e4m3 value in turn, blocks of 2 x 3: scales [3, 3], the
    // last block row and column partial.
    let (rows, cols, br, bc) = (5usize, 7usize, 2usize, 3usize);
    let (srows, scols) = (rows.div_ceil(br), cols.div_ceil(bc));
    let scales: Vec<f32> = (0..srows * scols)
        .map(|i| 0.75f32.powi(i as i32) * if i % 2 == 0 { 1.0 } else { -0.01 })
        .collect();
    for start in (0..256).step_by(rows * cols) {
        let q: Vec<u8> = (0..rows * cols)
            .map(|i| ((start + i) % 256) as u8)
            .collect();
        let (dq, ds) = (emu.upload(&q).unwrap(), emu.upload_f32(&scales).unwrap());
        for dst_dtype in [0u32, 1] {
            let size = if dst_dtype == 0 { 4 } else { 2 };
            let out = emu.alloc_zeroed(rows * cols * size).unwrap();
            // SAFETY: `dq` holds rows x cols bytes, `ds` the [srows, scols] scales, `out` rows x
            // cols elements of the destination type.
            unsafe {
                emu.launch(
                    "dequant_fp8_e4m3",
                    Launch::blocks(2, 32),
                    &[
                        KernelArg::from(&dq),
                        KernelArg::from(&ds),
                        KernelArg::U32(rows as u32),
                        KernelArg::U32(cols as u32),
                        KernelArg::U32(br as u32),
                        KernelArg::U32(bc as u32),
                        KernelArg::from(&out),
                        KernelArg::U32(dst_dtype),
                    ],
                )
            }
            .unwrap();
            let mut bytes = vec![0u8; rows * cols * size];
            emu.read(&out, 0, &mut bytes).unwrap();
            for r in 0..rows {
                for c in 0..cols {
                    let i = r * cols + c;
                    let want = e4m3_value(q[i]) as f32 * scales[(r / br) * scols + c / bc];
                    let got = if dst_dtype == 0 {
                        f32s(&bytes)[i]
                    } else {
                        f32::from_bits(u32::from(u16s(&bytes)[i]) << 16)
                    };
                    let want = if dst_dtype == 0 {
                        want
                    } else {
                        round_bf16(want)
                    };
                    assert!(
                        same(got, want),
                        "{:#04x} at ({r},{c}): {got} vs {want}",
                        q[i]
                    );
                }
            }
        }
    }
}
