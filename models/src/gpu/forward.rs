//! One batched forward on the device, step by step so that an EP runtime can run the MoE layers
//! itself: [`GpuModel::begin`] (blocks and embedding), per layer [`GpuModel::attention`] (its
//! output added into the f32 residual stream) and [`GpuModel::feed_forward`] (dense MLP, or
//! router, every routed expert and the shared experts), then [`GpuModel::finish`] (the final
//! norm and LM head on the rows that need logits only).

use rackfill_kernels::cuda::exec::{
    DType, DeviceBuffer, ExecutorExt, Gemm, MatrixRef, WeightLayout,
};

use rackfill_kernels::paged::{AttentionShape, BlockTable, StepArrays};

use super::ops::{AttentionStep, KvLayout, Ops};
use super::weights::{GpuAttention, GpuFfn, GpuGqa, GpuLayer, GpuLinear, GpuMla, GpuMlp, GpuMoe};
use std::sync::Arc;

use super::{GpuInput, GpuModel, GpuStep, LayerCache};
use crate::config::RouterKind;
use crate::error::{ModelError, Result};
use crate::layers::router::Routing;
use crate::model::LogitsFor;

/// What every layer of one step shares: the rows' positions and KV slots and the batch's block
/// tables, on the device.
struct Step {
    rows: usize,
    positions: DeviceBuffer,
    slots: DeviceBuffer,
    attention: AttentionStep,
}

/// One batch between [`GpuModel::begin`] and [`GpuModel::finish`]: the residual stream of its
/// rows on the device, what its layers share, and what it has routed so far.
pub struct GpuBatch {
    step: Step,
    /// f32 `[rows, H]`.
    x: DeviceBuffer,
    /// The rows that get logits, in batch order.
    logit_rows: Vec<u32>,
    routing: Vec<Routing>,
}

impl GpuBatch {
    /// Rows (new tokens) in the batch.
    pub fn rows(&self) -> usize {
        self.step.rows
    }
}

impl GpuModel {
    /// Starts a batch: takes the KV blocks of every new token (or none: a full cache fails the
    /// step with no sequence changed) and embeds the tokens.
    pub fn begin(&self, batch: &mut [GpuInput<'_>]) -> Result<GpuBatch> {
        let exec = self.exec.clone();
        let ops = Ops {
            exec: exec.as_ref(),
        };
        let (mut ids, mut positions, mut logit_rows) = (vec![], vec![], vec![]);
        for s in batch.iter() {
            crate::model::check_vocabulary(s.tokens, self.config.vocab_size)
                .map_err(|e| ModelError::Input(e.to_string()))?;
            if !Arc::ptr_eq(&s.sequence.pool, &self.pool) {
                return Err(ModelError::Input(
                    "a sequence of another GPU model's cache".into(),
                ));
            }
            let (ctx, n) = (s.sequence.len(), s.tokens.len());
            let start = ids.len() as u32;
            ids.extend_from_slice(s.tokens);
            positions.extend((ctx..ctx + n).map(|p| p as u32));
            match s.logits {
                _ if n == 0 => {}
                LogitsFor::AllPositions => logit_rows.extend(start..start + n as u32),
                LogitsFor::LastPosition => logit_rows.push(start + n as u32 - 1),
            }
        }
        let rows = ids.len();
        let mut tables: Vec<(&mut BlockTable, usize)> = batch
            .iter_mut()
            .map(|s| (&mut s.sequence.table, s.tokens.len()))
            .collect();
        let (arrays, block_size) = {
            let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
            (
                StepArrays::prepare(&mut pool, &mut tables)?,
                pool.block_size(),
            )
        };
        let step = Step {
            rows,
            positions: exec.upload_u32(&positions)?,
            slots: exec.upload_u32(&arrays.slot_mapping)?,
            attention: AttentionStep {
                block_size,
                block_tables: exec.upload_u32(&arrays.block_tables)?,
                q_start: exec.upload_u32(&arrays.q_start)?,
                q_len: exec.upload_u32(&arrays.q_len)?,
                ctx_len: exec.upload_u32(&arrays.ctx_len)?,
                arrays,
            },
        };
        let h = self.config.hidden_size;
        let x = exec.alloc_zeroed(rows * h * 4)?;
        if rows > 0 {
            ops.embed(&self.weights.embed, &exec.upload_u32(&ids)?, rows, h, &x)?;
        }
        Ok(GpuBatch {
            step,
            x,
            logit_rows,
            routing: Vec::new(),
        })
    }

    /// Layer `layer`'s attention half: `x += attention(norm(x))`.
    pub fn attention(&self, layer: usize, batch: &mut GpuBatch) -> Result<()> {
        let ops = Ops {
            exec: self.exec.as_ref(),
        };
        let (rows, h) = (batch.rows(), self.config.hidden_size);
        if rows == 0 {
            return Ok(());
        }
        let (weights, cache) = (&self.weights.layers[layer], &self.caches[layer]);
        let normed = ops.exec.alloc_zeroed(rows * h * 2)?;
        let norm = &weights.input_norm;
        ops.rms_norm_to_bf16(&batch.x, h, &norm.weight, norm.eps, rows, h, &normed, h)?;
        match &weights.attention {
            GpuAttention::Gqa(a) => gqa(ops, a, cache, &batch.step, &normed, &batch.x),
            GpuAttention::Mla(a) => mla(ops, a, cache, &batch.step, &normed, &batch.x),
        }
    }

    /// Layer `layer`'s feed-forward half on the device: `x += ffn(norm(x))` (a dense MLP, or
    /// the MoE block with every routed expert here, which [`GpuModel::upload`] must have been
    /// asked for).
    pub fn feed_forward(&self, layer: usize, batch: &mut GpuBatch) -> Result<()> {
        let ops = Ops {
            exec: self.exec.as_ref(),
        };
        let (rows, h) = (batch.rows(), self.config.hidden_size);
        if rows == 0 {
            return Ok(());
        }
        feed_forward(
            ops,
            &self.weights.layers[layer],
            rows,
            h,
            &batch.x,
            &mut batch.routing,
        )
    }

    /// Layer `layer`'s normalised feed-forward input `[rows, H]` in host memory: what an EP data
    /// plane routes and dispatches (the MoE layers of a model uploaded without its experts).
    pub fn ffn_input(&self, layer: usize, batch: &GpuBatch) -> Result<Vec<f32>> {
        let ops = Ops {
            exec: self.exec.as_ref(),
        };
        let (rows, h) = (batch.rows(), self.config.hidden_size);
        let normed = ops.exec.alloc_zeroed(rows * h * 4)?;
        if rows > 0 {
            ops.copy_rows(&batch.x, 0, h, rows, h, &normed, 0, h)?;
            let norm = &self.weights.layers[layer].post_norm;
            ops.rms_norm_inplace(&normed, 0, h, &norm.weight, norm.eps, rows, h)?;
        }
        Ok(ops.exec.download_f32(&normed)?)
    }

    /// `x += out` for a feed-forward output `[rows, H]` computed elsewhere (the EP data plane).
    pub fn add_to_residual(&self, batch: &mut GpuBatch, out: &[f32]) -> Result<()> {
        let n = batch.rows() * self.config.hidden_size;
        if out.len() != n {
            return Err(ModelError::Input(format!(
                "{} values for a {n}-value residual",
                out.len()
            )));
        }
        if n > 0 {
            let ops = Ops {
                exec: self.exec.as_ref(),
            };
            ops.add(&batch.x, &ops.exec.upload_f32(out)?, n)?;
        }
        Ok(())
    }

    /// The final norm and LM head on the rows that need logits.
    pub fn finish(&self, batch: GpuBatch) -> Result<GpuStep> {
        let exec = self.exec.as_ref();
        let ops = Ops { exec };
        let (h, vocab, n) = (
            self.config.hidden_size,
            self.config.vocab_size,
            batch.logit_rows.len(),
        );
        if n == 0 {
            return Ok(GpuStep {
                logits: Vec::new(),
                routing: batch.routing,
            });
        }
        let picked = exec.alloc_zeroed(n * h * 4)?;
        ops.gather_f32(
            &batch.x,
            h,
            &exec.upload_u32(&batch.logit_rows)?,
            n,
            &picked,
        )?;
        let picked_bf16 = exec.alloc_zeroed(n * h * 2)?;
        let norm = &self.weights.norm;
        ops.rms_norm_to_bf16(&picked, h, &norm.weight, norm.eps, n, h, &picked_bf16, h)?;
        let logits = exec.alloc_zeroed(n * vocab * 4)?;
        linear(ops, &picked_bf16, n, &self.weights.lm_head, &logits, 0.0)?;
        Ok(GpuStep {
            logits: exec.download_f32(&logits)?,
            routing: batch.routing,
        })
    }
}

/// `c = x · W + b (+ beta c)`: `x` bf16 `[m, in]`, `c` f32 `[m, out]`.
fn linear(
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
fn project(ops: Ops<'_>, x: &DeviceBuffer, m: usize, layer: &GpuLinear) -> Result<DeviceBuffer> {
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

fn gqa(
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
    ops.paged_attention(&q, a.heads * d, &layout, &step.attention, scale, &out)?;
    add_output(ops, &out, rows, &a.o, x)
}

/// DeepSeek's multi-head latent attention in the absorbed form: the cache holds the normalised
/// latent and the roped shared key per token; each head's query is carried into latent space
/// through `kv_b`'s key part, attention runs over the latent rows as one KV head (values = the
/// latent's first `kv_lora` columns), and the output is carried back through `kv_b`'s value
/// part.
fn mla(
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
    let kv_b = &a.kv_b.weight;
    let per_head = nope + vd;
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
        // kv_b is stored [lora, heads * (nope + v)]: head h's key part, read as `lora x nope`
        // rows of stride heads * (nope + v), is the `n x k` matrix of the product.
        b: MatrixRef {
            ptr: kv_b.buffer.ptr(),
            dtype: DType::Bf16,
            ld: kv_b.cols,
            batch_stride: per_head,
        },
        b_layout: WeightLayout::OutByIn,
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
    )?;
    // Values: head h's value part of kv_b, `lora x v` rows of stride heads * (nope + v).
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
            ptr: kv_b.buffer.at(nope * 2),
            dtype: DType::Bf16,
            ld: kv_b.cols,
            batch_stride: per_head,
        },
        b_layout: WeightLayout::InByOut,
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

fn feed_forward(
    ops: Ops<'_>,
    layer: &GpuLayer,
    rows: usize,
    h: usize,
    x: &DeviceBuffer,
    routing: &mut Vec<Routing>,
) -> Result<()> {
    let exec = ops.exec;
    // The normalised input, in f32 (the routers) and bf16 (the experts' GEMMs).
    let normed = exec.alloc_zeroed(rows * h * 4)?;
    ops.copy_rows(x, 0, h, rows, h, &normed, 0, h)?;
    let norm = &layer.post_norm;
    ops.rms_norm_inplace(&normed, 0, h, &norm.weight, norm.eps, rows, h)?;
    let normed_bf16 = exec.alloc_zeroed(rows * h * 2)?;
    ops.f32_to_bf16(&normed, 0, h, rows, h, &normed_bf16, h)?;
    match &layer.ffn {
        GpuFfn::Dense(mlp) => mlp_into(ops, mlp, &normed_bf16, rows, x, 1.0),
        GpuFfn::Moe(moe) => {
            // The block's output: the shared experts' (or zeros), then the routed experts'
            // weighted sum added to it, then added to the residual (the CPU path's order).
            let y = exec.alloc_zeroed(rows * h * 4)?;
            if let Some(shared) = &moe.shared {
                mlp_into(ops, shared, &normed_bf16, rows, &y, 0.0)?;
                if let Some(gate) = &moe.shared_gate {
                    let logit = exec.alloc_zeroed(rows * 4)?;
                    ops.linear((&normed, DType::F32), rows, gate, &logit, 0.0)?;
                    ops.scale_by_sigmoid(&y, &logit, rows, h)?;
                }
            }
            routed_experts(ops, moe, &normed, rows, h, &y, routing)?;
            ops.add(x, &y, rows * h)?;
            Ok(())
        }
    }
}

/// `out = mlp(x) + beta out` for bf16 `x` `[rows, H]` and f32 `out`.
fn mlp_into(
    ops: Ops<'_>,
    mlp: &GpuMlp,
    x: &DeviceBuffer,
    rows: usize,
    out: &DeviceBuffer,
    beta: f32,
) -> Result<()> {
    let i = mlp.intermediate();
    let gate_up = ops.exec.alloc_zeroed(rows * 2 * i * 4)?;
    ops.linear((x, DType::Bf16), rows, &mlp.gate_up, &gate_up, 0.0)?;
    let act = ops.exec.alloc_zeroed(rows * i * 2)?;
    ops.silu_mul(&gate_up, rows, i, &act)?;
    ops.linear((&act, DType::Bf16), rows, &mlp.down, out, beta)?;
    Ok(())
}

/// Routes the rows, runs every expert on its rows (grouped so each expert is one GEMM pair) and
/// adds each row's weighted expert outputs into `y`. The router's choices come to the host once
/// (`rows x k` ids) to size the per-expert GEMMs; the rows and weights stay on the device.
fn routed_experts(
    ops: Ops<'_>,
    moe: &GpuMoe,
    normed: &DeviceBuffer,
    rows: usize,
    h: usize,
    y: &DeviceBuffer,
    routing: &mut Vec<Routing>,
) -> Result<()> {
    let exec = ops.exec;
    let (experts, k) = (moe.router.cols, moe.top_k);
    if moe.experts.len() != experts {
        return Err(ModelError::Input(
            "this GPU model was uploaded without its routed experts (they run on an EP data plane)"
                .into(),
        ));
    }
    let logits = exec.alloc_zeroed(rows * experts * 4)?;
    ops.linear((normed, DType::F32), rows, &moe.router, &logits, 0.0)?;
    let ids = exec.alloc_zeroed(rows * k * 4)?;
    let weights = exec.alloc_zeroed(rows * k * 4)?;
    match &moe.kind {
        RouterKind::SoftmaxTopK { norm_topk_prob } => {
            ops.router_softmax(&logits, rows, experts, k, *norm_topk_prob, &ids, &weights)?
        }
        RouterKind::SigmoidGrouped {
            n_group,
            topk_group,
            norm_topk_prob,
            routed_scaling_factor,
        } => ops.router_sigmoid_grouped(
            &logits,
            moe.correction_bias.as_ref(),
            rows,
            experts,
            (*n_group, *topk_group),
            k,
            *norm_topk_prob,
            *routed_scaling_factor,
            &ids,
            &weights,
        )?,
    }
    let chosen = exec.download_u32(&ids)?;
    routing.push(Routing {
        top_k: k,
        experts: chosen.clone(),
        weights: exec.download_f32(&weights)?,
    });
    // Pairs grouped by expert, in token order within an expert (the CPU path's grouping).
    let mut counts = vec![0usize; experts];
    for &e in &chosen {
        counts[e as usize] += 1;
    }
    let mut offsets = vec![0usize; experts + 1];
    for e in 0..experts {
        offsets[e + 1] = offsets[e] + counts[e];
    }
    let mut fill = offsets.clone();
    let pairs = chosen.len();
    let (mut source_rows, mut pair_row) = (vec![0u32; pairs], vec![0u32; pairs]);
    for (pair, &e) in chosen.iter().enumerate() {
        let at = fill[e as usize];
        fill[e as usize] += 1;
        source_rows[at] = (pair / k) as u32;
        pair_row[pair] = at as u32;
    }
    let grouped = exec.alloc_zeroed(pairs * h * 2)?;
    ops.gather_to_bf16(normed, h, &exec.upload_u32(&source_rows)?, pairs, &grouped)?;
    let i = moe.experts.first().map_or(0, GpuMlp::intermediate);
    let gate_up = exec.alloc_zeroed(pairs * 2 * i * 4)?;
    for (e, expert) in moe.experts.iter().enumerate() {
        let (start, n) = (offsets[e], counts[e]);
        if n > 0 {
            let g = rows_gemm(
                &grouped,
                start,
                h,
                DType::Bf16,
                &expert.gate_up,
                &gate_up,
                n,
            );
            ops.gemm(&g)?;
        }
    }
    let act = exec.alloc_zeroed(pairs * i * 2)?;
    ops.silu_mul(&gate_up, pairs, i, &act)?;
    let out = exec.alloc_zeroed(pairs * h * 4)?;
    for (e, expert) in moe.experts.iter().enumerate() {
        let (start, n) = (offsets[e], counts[e]);
        if n > 0 {
            ops.gemm(&rows_gemm(
                &act,
                start,
                i,
                DType::Bf16,
                &expert.down,
                &out,
                n,
            ))?;
        }
    }
    ops.combine(&out, &exec.upload_u32(&pair_row)?, &weights, rows, k, h, y)?;
    Ok(())
}

/// The GEMM of rows `start..start + n` of `a` (`[*, k]`) by weight `w` into the same rows of
/// `c` (f32 `[*, w.cols]`).
fn rows_gemm(
    a: &DeviceBuffer,
    start: usize,
    k: usize,
    dtype: DType,
    w: &super::ops::DeviceWeight,
    c: &DeviceBuffer,
    n: usize,
) -> Gemm {
    let dense = |ptr: u64, dtype, ld| MatrixRef {
        ptr,
        dtype,
        ld,
        batch_stride: 0,
    };
    Gemm {
        m: n,
        n: w.cols,
        k,
        batch: 1,
        a: dense(a.at(start * k * dtype.size()), dtype, k),
        b: dense(w.buffer.ptr(), w.dtype, w.cols),
        b_layout: WeightLayout::InByOut,
        c: dense(c.at(start * w.cols * 4), DType::F32, w.cols),
        alpha: 1.0,
        beta: 0.0,
    }
}

/// A model dimension as the kernels' u32 (every dimension was checked to fit at upload).
fn u32s(v: usize) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}
