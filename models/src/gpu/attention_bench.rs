//! `rackfill bench attention`: the flash attention kernels (every tile shape asked for) against
//! the unfused baseline a framework without one runs (per KV head a cuBLAS GEMM for the scores,
//! a softmax kernel, a second GEMM for the values), on one GQA layer's prefill chunk over its
//! cached context, on any executor.
//!
//! Both read bf16 keys and values (the kernel from the paged cache, the baseline from dense
//! `[tokens, kv_heads, d]` matrices: the easier layout) and the same queries; every kernel's
//! output is compared with the baseline's, so a run is also a check of the kernels on that
//! shape, and the baseline stays a checked fallback.

use std::time::{Duration, Instant};

use rackfill_kernels::cuda::exec::{
    DType, DeviceBuffer, Executor, ExecutorExt, Gemm, KernelArg, Launch, MatrixRef, WeightLayout,
};
use rackfill_kernels::flash::{AttentionShape, FlashTiles};
use rackfill_kernels::kv_blocks::{BlockPool, BlockTable, StepArrays};
use serde::Serialize;

use super::model::BLOCK_TOKENS;
use super::ops::{AttentionStep, KvLayout, Ops};
use crate::error::{ModelError, Result};

/// One attention layer's shape and the chunk to time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct AttentionCase {
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Tokens already in the cache.
    pub context: usize,
    /// New tokens: the queries.
    pub chunk: usize,
}

/// One flash kernel on one case (medians over the repeats).
#[derive(Debug, Clone, Serialize)]
pub struct FlashTiming {
    /// The tile shape, `k{keys}_v{value columns}`.
    pub tiles: String,
    pub ms: f64,
    /// Causal attention FLOPs ([`AttentionTiming::flops`]) per second, in TFLOP/s.
    pub tflops: f64,
    /// `baseline_ms / ms`.
    pub speedup: f64,
    /// Relative L2 difference of its output from the baseline's.
    pub rel_l2: f64,
}

/// What [`bench_attention`] measured on one case.
#[derive(Debug, Clone, Serialize)]
pub struct AttentionTiming {
    pub case: AttentionCase,
    /// FLOPs of causal attention over the case (scores and values of the seen keys only, the
    /// count FlashAttention's figures use).
    pub flops: f64,
    pub baseline_ms: f64,
    pub baseline_tflops: f64,
    /// Every tile shape that fits the device's shared memory, in the order asked.
    pub flash: Vec<FlashTiming>,
}

impl AttentionTiming {
    /// The fastest flash kernel of the case.
    pub fn best(&self) -> Option<&FlashTiming> {
        self.flash.iter().min_by(|a, b| a.ms.total_cmp(&b.ms))
    }
}

/// Times each flash kernel of `tiles` (those whose shared memory fits the device) and the
/// baseline (GEMM, softmax, GEMM) on `case`, `repeats` times each (at least once), and compares
/// every kernel's output with the baseline's.
pub fn bench_attention(
    exec: &dyn Executor,
    case: AttentionCase,
    tiles: &[FlashTiles],
    repeats: usize,
) -> Result<AttentionTiming> {
    let AttentionCase {
        q_heads,
        kv_heads,
        head_dim: d,
        context,
        chunk,
    } = case;
    if q_heads == 0 || kv_heads == 0 || d == 0 || chunk == 0 || q_heads % kv_heads != 0 {
        return Err(ModelError::Input(format!(
            "attention case {case:?}: heads, head_dim and chunk must be positive, q_heads a \
             multiple of kv_heads"
        )));
    }
    let ops = Ops { exec };
    let tokens = context + chunk;
    let (q_width, kv_width) = (q_heads * d, kv_heads * d);
    let q = exec.upload_f32(&values(chunk * q_width, 1))?;
    let k = exec.upload_f32(&values(tokens * kv_width, 2))?;
    let v = exec.upload_f32(&values(tokens * kv_width, 3))?;
    let scale = 1.0 / (d as f32).sqrt();

    // The fused path: the context's keys and values, then the chunk's, into the paged cache.
    let shape = AttentionShape {
        q_heads: u32s(q_heads)?,
        kv_heads: u32s(kv_heads)?,
        qk_dim: u32s(d)?,
        v_dim: u32s(d)?,
    };
    shape.check()?;
    let blocks = tokens.div_ceil(BLOCK_TOKENS);
    let mut pool = BlockPool::new(u32s(blocks)?, BLOCK_TOKENS as u32)?;
    let cache_bytes = blocks * BLOCK_TOKENS * kv_width * 2;
    let (keys, vals) = (
        exec.alloc_zeroed(cache_bytes)?,
        exec.alloc_zeroed(cache_bytes)?,
    );
    let layout = KvLayout {
        shape,
        keys: &keys,
        values: vals.ptr(),
        value_token_stride: kv_width,
    };
    let mut table = BlockTable::new();
    let mut step = None;
    for (first, n) in [(0, context), (context, chunk)] {
        let arrays = StepArrays::prepare(&mut pool, &mut [(&mut table, n)])?;
        if n > 0 {
            let slots = exec.upload_u32(&arrays.slot_mapping)?;
            let (k_rows, v_rows) = (
                rows_from(exec, &k, first, n, kv_width)?,
                rows_from(exec, &v, first, n, kv_width)?,
            );
            ops.kv_write(
                (&k_rows, kv_width),
                Some((&v_rows, kv_width)),
                n,
                &slots,
                &layout,
            )?;
        }
        step = Some(AttentionStep {
            block_size: BLOCK_TOKENS as u32,
            block_tables: exec.upload_u32(&arrays.block_tables)?,
            q_start: exec.upload_u32(&arrays.q_start)?,
            q_len: exec.upload_u32(&arrays.q_len)?,
            ctx_len: exec.upload_u32(&arrays.ctx_len)?,
            arrays,
        });
    }
    let step = step.expect("two steps prepared");
    let limit = exec.shared_limit(&FlashTiles::ALL[0].kernel())?;
    let mut flash_runs = Vec::new();
    for &t in tiles {
        if shape.shared_bytes(t) as usize > limit {
            continue;
        }
        let out = exec.alloc_zeroed(chunk * q_width * 2)?;
        let ms = median_ms(exec, repeats, || {
            Ok(ops.paged_attention(&q, q_width, &layout, &step, scale, &out, Some(t))?)
        })?;
        flash_runs.push((t, ms, out));
    }

    // The baseline: bf16 operands, per KV head one batched GEMM over its group of query heads.
    let group = q_heads / kv_heads;
    let to_bf16 = |x: &DeviceBuffer, rows: usize, width: usize| -> Result<DeviceBuffer> {
        let out = exec.alloc_zeroed(rows * width * 2)?;
        ops.f32_to_bf16(x, 0, width, rows, width, &out, width)?;
        Ok(out)
    };
    let (q16, k16, v16) = (
        to_bf16(&q, chunk, q_width)?,
        to_bf16(&k, tokens, kv_width)?,
        to_bf16(&v, tokens, kv_width)?,
    );
    // One KV head's group at a time: the score and probability buffers of `group` heads.
    let scores = exec.alloc_zeroed(group * chunk * tokens * 4)?;
    let probs = exec.alloc_zeroed(group * chunk * tokens * 2)?;
    let baseline = exec.alloc_zeroed(chunk * q_width * 4)?;
    let baseline_ms = median_ms(exec, repeats, || {
        for j in 0..kv_heads {
            let heads = j * group;
            let score = Gemm {
                m: chunk,
                n: tokens,
                k: d,
                batch: group,
                a: matrix(q16.at(heads * d * 2), DType::Bf16, q_width, d),
                b: matrix(k16.at(j * d * 2), DType::Bf16, kv_width, 0),
                b_layout: WeightLayout::OutByIn,
                c: matrix(scores.ptr(), DType::F32, tokens, chunk * tokens),
                alpha: 1.0,
                beta: 0.0,
            };
            // SAFETY: `group` query heads of `chunk x d` (row stride q_width) against the KV
            // head's `tokens x d` keys, into `group` score matrices of `chunk x tokens`.
            unsafe { exec.gemm(&score) }?;
            let rows = group * chunk;
            let args = [
                KernelArg::Ptr(scores.ptr()),
                KernelArg::U32(u32s(rows)?),
                KernelArg::U32(u32s(chunk)?),
                KernelArg::U32(u32s(tokens)?),
                KernelArg::U32(u32s(context)?),
                KernelArg::F32(scale),
                KernelArg::Ptr(probs.ptr()),
            ];
            // SAFETY: `causal_softmax_to_bf16(scores[rows, keys], rows, q_len, keys, ctx,
            // scale, out[rows, keys])`, the group's score matrices back to back, each `chunk`
            // rows.
            unsafe {
                exec.launch(
                    "causal_softmax_to_bf16",
                    Launch::blocks(u32s(rows.min(65_535))?, 256),
                    &args,
                )
            }?;
            let apply = Gemm {
                m: chunk,
                n: d,
                k: tokens,
                batch: group,
                a: matrix(probs.ptr(), DType::Bf16, tokens, chunk * tokens),
                b: matrix(v16.at(j * d * 2), DType::Bf16, kv_width, 0),
                b_layout: WeightLayout::InByOut,
                c: matrix(baseline.at(heads * d * 4), DType::F32, q_width, d),
                alpha: 1.0,
                beta: 0.0,
            };
            // SAFETY: `group` probability matrices `chunk x tokens` times the KV head's
            // `tokens x d` values, into the group's columns of the `chunk x q_width` output.
            unsafe { exec.gemm(&apply) }?;
        }
        Ok(())
    })?;

    let flops = shape.causal_flops(&step.arrays);
    let tflops = |ms: f64| flops / (ms.max(1e-9) * 1e-3) / 1e12;
    let reference = exec.download_f32(&baseline)?;
    let mut flash = Vec::with_capacity(flash_runs.len());
    for (t, ms, out) in flash_runs {
        flash.push(FlashTiming {
            tiles: t.to_string(),
            ms,
            tflops: tflops(ms),
            speedup: baseline_ms / ms.max(1e-9),
            rel_l2: rel_l2(&exec.download_bf16(&out)?, &reference),
        });
    }
    Ok(AttentionTiming {
        case,
        flops,
        baseline_ms,
        baseline_tflops: tflops(baseline_ms),
        flash,
    })
}

/// Relative L2 difference of `a` from `b`.
fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let (diff, norm) = a.iter().zip(b).fold((0f64, 0f64), |(d2, n2), (&x, &y)| {
        let e = f64::from(x - y);
        (d2 + e * e, n2 + f64::from(y) * f64::from(y))
    });
    (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
}
/// Runs `work` once to warm up, then `repeats` times, synchronised; the median in ms.
fn median_ms(
    exec: &dyn Executor,
    repeats: usize,
    mut work: impl FnMut() -> Result<()>,
) -> Result<f64> {
    work()?;
    exec.synchronize()?;
    let mut times: Vec<Duration> = Vec::with_capacity(repeats.max(1));
    for _ in 0..repeats.max(1) {
        let started = Instant::now();
        work()?;
        exec.synchronize()?;
        times.push(started.elapsed());
    }
    times.sort();
    Ok(times[times.len() / 2].as_secs_f64() * 1e3)
}

/// Rows `first..first + n` of an f32 `[*, width]` buffer, as a new buffer.
fn rows_from(
    exec: &dyn Executor,
    x: &DeviceBuffer,
    first: usize,
    n: usize,
    width: usize,
) -> Result<DeviceBuffer> {
    let out = exec.alloc_zeroed(n * width * 4)?;
    exec.copy(x, first * width * 4, &out, 0, n * width * 4)?;
    Ok(out)
}

fn matrix(ptr: u64, dtype: DType, ld: usize, batch_stride: usize) -> MatrixRef {
    MatrixRef {
        ptr,
        dtype,
        ld,
        batch_stride,
    }
}

fn u32s(v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| ModelError::Input(format!("{v} does not fit in 32 bits")))
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}
