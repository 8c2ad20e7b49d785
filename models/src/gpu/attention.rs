//! The attention half of a decoder layer on the device: grouped-query attention and DeepSeek's
//! latent attention in the absorbed form, each writing its new keys into the paged cache and
//! adding `o_proj(attention)` into the f32 residual stream.

use rackfill_kernels::cuda::exec::{DType, DeviceBuffer, Gemm, MatrixRef, WeightLayout};
use rackfill_kernels::flash::AttentionShape;

use super::model::LayerCache;
use super::ops::{AttentionStep, KvLayout, Ops};
use super::weights::{GpuGqa, GpuLinear, GpuMla};
use crate::error::Result;

/// What every layer of one step shares: the rows' positions and KV slots and the batch's block
/// tables, on the device.
pub(super) struct Step {
    pub rows: usize,
    pub positions: DeviceBuffer,
    pub slots: DeviceBuffer,
    pub attention: AttentionStep,
}

/// `c = x · W + b (+ beta c)`: `x` bf16 `[m, in]`, `c` f32 `[m, out]`.
pub(super) fn linear(
    ops: Ops<'_>,
    x: &DeviceBuffer,
    m: usize,
    layer: &GpuLinear,
    c: &DeviceBuffer,
    beta: f32,
) -> Result<()> {
    ops.linear((x, DType::Bf16), m, &layer.weight, c, beta)?;
    if let Some(bias) = &layer.bias {
        ops.add_bias(c, layer.out_dim(), bias, m, layer.out_dim())?;
    }
    Ok(())
}

/// A fresh f32 `[m, layer.out]` buffer holding `x · W + b`.
pub(super) fn project(
    ops: Ops<'_>,
    x: &DeviceBuffer,
    m: usize,
    layer: &GpuLinear,
) -> Result<DeviceBuffer> {
    let c = ops.exec.alloc_zeroed(m * layer.out_dim() * 4)?;
    linear(ops, x, m, layer, &c, 0.0)?;
    Ok(c)
}

/// Adds `o_proj(attention)` for bf16 attention output `out` `[rows, in]` into `x`.
fn add_output(
    ops: Ops<'_>,
    out: &DeviceBuffer,
    rows: usize,
    o: &GpuLinear,
    x: &DeviceBuffer,
) -> Result<()> {
    // The bias (Qwen3-MoE's attention_bias on o_proj) is added to the residual directly.
    linear(ops, out, rows, o, x, 1.0)
}

pub(super) fn gqa(
    ops: Ops<'_>,
    a: &GpuGqa,
    cache: &LayerCache,
    step: &Step,
    normed: &DeviceBuffer,
    x: &DeviceBuffer,
) -> Result<()> {
    let (rows, d) = (step.rows, a.head_dim);
    let q = project(ops, normed, rows, &a.q)?;
    let k = project(ops, normed, rows, &a.k)?;
    let v = project(ops, normed, rows, &a.v)?;
    if let (Some(qn), Some(kn)) = (&a.q_norm, &a.k_norm) {
        ops.rms_norm_inplace(&q, 0, d, &qn.weight, qn.eps, rows * a.heads, d)?;
        ops.rms_norm_inplace(&k, 0, d, &kn.weight, kn.eps, rows * a.kv_heads, d)?;
    }
    ops.rope(
        &q,
        a.heads * d,
        a.heads,
        d,
        0,
        &a.rope,
        &step.positions,
        rows,
    )?;
    ops.rope(
        &k,
        a.kv_heads * d,
        a.kv_heads,
        d,
        0,
        &a.rope,
        &step.positions,
        rows,
    )?;
    let values = cache.values.as_ref().map_or(0, DeviceBuffer::ptr);
    let layout = KvLayout {
        shape: AttentionShape {
            q_heads: u32s(a.heads),
            kv_heads: u32s(a.kv_heads),
            qk_dim: u32s(d),
            v_dim: u32s(d),
        },
        keys: &cache.keys,
        values,
        value_token_stride: a.kv_heads * d,
    };
    ops.kv_write(
        (&k, a.kv_heads * d),
        Some((&v, a.kv_heads * d)),
        rows,
        &step.slots,
        &layout,
    )?;
    let out = ops.exec.alloc_zeroed(rows * a.heads * d * 2)?;
    let scale = 1.0 / (d as f32).sqrt();
    ops.paged_attention(&q, a.heads * d, &layout, &step.attention, scale, &out, None)?;
    add_output(ops, &out, rows, &a.o, x)
}

/// DeepSeek's multi-head latent attention in the absorbed form: the cache holds the normalised
/// latent and the roped shared key per token; each head's query is carried into latent space
/// through `kv_b`'s key part, attention runs over the latent rows as one KV head (values = the
/// latent's first `kv_lora` columns), and the output is carried back through `kv_b`'s value
/// part.
pub(super) fn mla(
    ops: Ops<'_>,
    a: &GpuMla,
    cache: &LayerCache,
    step: &Step,
    normed: &DeviceBuffer,
    x: &DeviceBuffer,
) -> Result<()> {
    let exec = ops.exec;
    let rows = step.rows;
    let (heads, nope, rot, lora, vd) = (a.heads, a.nope, a.rot, a.kv_lora, a.v_dim);
    let qk = nope + rot;
    let latent_row = lora + rot;
    let q = match (&a.q_direct, &a.q_low_rank) {
        (Some(direct), _) => project(ops, normed, rows, direct)?,
        (None, Some((qa, norm, qb))) => {
            let low = project(ops, normed, rows, qa)?;
            let rank = qa.out_dim();
            let low_bf16 = exec.alloc_zeroed(rows * rank * 2)?;
            ops.rms_norm_to_bf16(
                &low,
                rank,
                &norm.weight,
                norm.eps,
                rows,
                rank,
                &low_bf16,
                rank,
            )?;
            project(ops, &low_bf16, rows, qb)?
        }
        (None, None) => unreachable!("a latent attention has a query projection"),
    };
    // The latent and the shared rotary key: [rows, lora + rot].
    let kv = project(ops, normed, rows, &a.kv_a)?;
    ops.rms_norm_inplace(
        &kv,
        0,
        latent_row,
        &a.kv_norm.weight,
        a.kv_norm.eps,
        rows,
        lora,
    )?;
    ops.rope(
        &kv,
        latent_row,
        1,
        latent_row,
        lora,
        &a.rope,
        &step.positions,
        rows,
    )?;
    ops.rope(
        &q,
        heads * qk,
        heads,
        qk,
        nope,
        &a.rope,
        &step.positions,
        rows,
    )?;
    let layout = KvLayout {
        shape: AttentionShape {
            q_heads: u32s(heads),
            kv_heads: 1,
            qk_dim: u32s(latent_row),
            v_dim: u32s(lora),
        },
        keys: &cache.keys,
        values: cache.keys.ptr(),
        value_token_stride: latent_row,
    };
    ops.kv_write((&kv, latent_row), None, rows, &step.slots, &layout)?;
    // Query in latent space: [rows, heads, lora + rot], the key-absorbed nope part then the
    // roped part.
    let q_nope = exec.alloc_zeroed(rows * heads * nope * 2)?;
    ops.f32_to_bf16(&q, 0, qk, rows * heads, nope, &q_nope, nope)?;
    let q_latent = exec.alloc_zeroed(rows * heads * latent_row * 4)?;
    // kv_b is stored [heads * (nope + v), lora] (out x in): head h's rows are its key part
    // (nope rows) then its value part (v rows), each a row of the latent's width.
    let kv_b = &a.kv_b.weight;
    let head_stride = (nope + vd) * lora;
    ops.gemm(&Gemm {
        m: rows,
        n: lora,
        k: nope,
        batch: heads,
        a: MatrixRef {
            ptr: q_nope.ptr(),
            dtype: DType::Bf16,
            ld: heads * nope,
            batch_stride: nope,
        },
        // Head h's key part, `nope x lora`, is the `k x n` matrix of the product.
        b: MatrixRef {
            ptr: kv_b.buffer.ptr(),
            dtype: DType::Bf16,
            ld: lora,
            batch_stride: head_stride,
        },
        b_layout: WeightLayout::InByOut,
        c: MatrixRef {
            ptr: q_latent.ptr(),
            dtype: DType::F32,
            ld: heads * latent_row,
            batch_stride: latent_row,
        },
        alpha: 1.0,
        beta: 0.0,
    })?;
    ops.copy_rows(&q, nope, qk, rows * heads, rot, &q_latent, lora, latent_row)?;
    let out_latent = exec.alloc_zeroed(rows * heads * lora * 2)?;
    ops.paged_attention(
        &q_latent,
        heads * latent_row,
        &layout,
        &step.attention,
        a.scale,
        &out_latent,
        None,
    )?;
    // Values: head h's value part of kv_b, `v x lora`, is the `n x k` matrix of the product.
    let out = exec.alloc_zeroed(rows * heads * vd * 4)?;
    ops.gemm(&Gemm {
        m: rows,
        n: vd,
        k: lora,
        batch: heads,
        a: MatrixRef {
            ptr: out_latent.ptr(),
            dtype: DType::Bf16,
            ld: heads * lora,
            batch_stride: lora,
        },
        b: MatrixRef {
            ptr: kv_b.buffer.at(nope * lora * 2),
            dtype: DType::Bf16,
            ld: lora,
            batch_stride: head_stride,
        },
        b_layout: WeightLayout::OutByIn,
        c: MatrixRef {
            ptr: out.ptr(),
            dtype: DType::F32,
            ld: heads * vd,
            batch_stride: vd,
        },
        alpha: 1.0,
        beta: 0.0,
    })?;
    let out_bf16 = exec.alloc_zeroed(rows * heads * vd * 2)?;
    ops.f32_to_bf16(&out, 0, heads * vd, rows, heads * vd, &out_bf16, heads * vd)?;
    add_output(ops, &out_bf16, rows, &a.o, x)
}

/// A model dimension as the kernels' u32 (every dimension was checked to fit at upload).
fn u32s(v: usize) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}
