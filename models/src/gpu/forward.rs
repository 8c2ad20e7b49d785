//! One batched forward on the device, step by step so that an EP runtime can run the MoE layers
//! itself: [`GpuModel::begin`] (blocks and embedding), per layer [`GpuModel::attention`] (its
//! output added into the f32 residual stream) and [`GpuModel::feed_forward`] (dense MLP, or
//! router, every routed expert and the shared experts), then [`GpuModel::finish`] (the final
//! norm and LM head on the rows that need logits only).

use rackfill_kernels::cuda::exec::{DType, DeviceBuffer, Executor, ExecutorExt, Stream};
use rackfill_kernels::cuda::grouped_gemm::ExpertGemms;
use rackfill_kernels::cuda::moe::RoutedRows;

use rackfill_kernels::kv_blocks::{BlockTable, StepArrays};

use super::attention::{gqa, mla, Step};
use super::ops::{AttentionStep, Ops};
use super::weights::{GpuAttention, GpuFfn, GpuLayer, GpuMlp, GpuMoe};
use std::sync::Arc;

use super::model::{GpuInput, GpuModel, GpuStep};
use crate::config::RouterKind;
use crate::error::{ModelError, Result};
use crate::layers::router::Routing;
use crate::model::LogitsFor;

/// One batch between [`GpuModel::begin`] and [`GpuModel::finish`]: the residual stream of its
/// rows on the device, what its layers share, and what it has routed so far.
pub struct GpuBatch {
    step: Step,
    /// f32 `[rows, H]`.
    x: DeviceBuffer,
    /// The rows that get logits, in batch order.
    logit_rows: Vec<u32>,
    /// Every MoE layer's router choices and weights so far, left on the device until
    /// [`GpuModel::finish`] copies them back with the logits (no wait inside a layer).
    routing: Vec<DeviceRouting>,
}

/// One MoE layer's routing of the batch, on the device.
struct DeviceRouting {
    /// u32 `[rows, k]`.
    experts: DeviceBuffer,
    /// f32 `[rows, k]`.
    weights: DeviceBuffer,
    top_k: usize,
}

impl DeviceRouting {
    fn download(&self, exec: &dyn Executor) -> Result<Routing> {
        Ok(Routing {
            top_k: self.top_k,
            experts: exec.download_u32(&self.experts)?,
            weights: exec.download_f32(&self.weights)?,
        })
    }
}

/// One MoE layer's routed rows on the device: the router's input and choices and the block's
/// output so far (the shared experts').
struct GpuRouted {
    /// bf16 `[rows, H]`, what the experts multiply.
    normed_bf16: DeviceBuffer,
    /// u32 `[rows, k]`: expert ids, best first.
    experts: DeviceBuffer,
    /// f32 `[rows, k]`: their weights.
    weights: DeviceBuffer,
    /// f32 `[rows, H]`: the shared experts' output (zeros without), the routed sum goes on top.
    output: DeviceBuffer,
    top_k: usize,
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
            let ids = exec.upload_u32(&ids)?;
            ops.embed(&self.weights.embed.buffer, &ids, rows, h, &x)?;
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
        let (weights, cache) = (&self.weights.layers[layer], &self.caches.layers[layer]);
        let normed = ops.exec.alloc_zeroed(rows * h * 2)?;
        let norm = &weights.input_norm;
        ops.rms_norm_to_bf16(&batch.x, h, &norm.weight, norm.eps, rows, h, &normed, h)?;
        match &weights.attention {
            GpuAttention::Gqa(a) => gqa(ops, a, cache, &batch.step, &normed, &batch.x),
            GpuAttention::Mla(a) => mla(ops, a, cache, &batch.step, &normed, &batch.x),
        }
    }

    /// Layer `layer`'s feed-forward half on the device: `x += ffn(norm(x))` (a dense MLP, or
    /// the MoE block with every routed expert here, which [`GpuModel::load`] must have been
    /// asked for: [`super::ExpertPlacement::Here`]).
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
            (rows, h),
            &batch.x,
            self.expert_gemms,
            &mut batch.routing,
        )
    }

    /// Layer `layer`'s MoE block up to its routed experts, on the device: the normalised input
    /// (bf16), the router's choices and weights and the shared experts' output, left where they
    /// are for the EP data plane to dispatch from, `rank_rows` rows of each local rank in batch
    /// order ([`GpuModel::add_routed`] finishes the block).
    pub fn route(
        &self,
        layer: usize,
        batch: &GpuBatch,
        rank_rows: Vec<usize>,
    ) -> Result<RoutedRows> {
        let ops = Ops {
            exec: self.exec.as_ref(),
        };
        let weights = &self.weights.layers[layer];
        let GpuFfn::Moe(moe) = &weights.ffn else {
            return Err(ModelError::Input(format!(
                "layer {layer} is not an MoE layer"
            )));
        };
        let (rows, h) = (batch.rows(), self.config.hidden_size);
        if rank_rows.iter().sum::<usize>() != rows {
            return Err(ModelError::Input(format!(
                "rows {rank_rows:?} of the local ranks do not add up to the batch's {rows}"
            )));
        }
        if rows == 0 {
            // Nothing to route, but the layer's collectives still run with no rows.
            let exec = ops.exec;
            return Ok(RoutedRows {
                x: exec.alloc_zeroed(0)?,
                experts: exec.alloc_zeroed(0)?,
                weights: exec.alloc_zeroed(0)?,
                output: exec.alloc_zeroed(0)?,
                rank_rows,
                top_k: moe.top_k,
                stream: Stream::MAIN,
            });
        }
        let routed = route(ops, weights, moe, rows, h, &batch.x)?;
        Ok(RoutedRows {
            x: routed.normed_bf16,
            experts: routed.experts,
            weights: routed.weights,
            output: routed.output,
            rank_rows,
            top_k: routed.top_k,
            stream: Stream::MAIN,
        })
    }

    /// `x += rows.output`: the MoE block's output (shared experts, plus the routed experts'
    /// weighted sum the data plane added into it) into the residual stream.
    pub fn add_routed(&self, batch: &mut GpuBatch, rows: &RoutedRows) -> Result<()> {
        let n = batch.rows() * self.config.hidden_size;
        if n > 0 {
            let ops = Ops {
                exec: self.exec.as_ref(),
            };
            ops.add(&batch.x, &rows.output, n)?;
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
        let routing = |batch: &GpuBatch| -> Result<Vec<Routing>> {
            batch.routing.iter().map(|r| r.download(exec)).collect()
        };
        if n == 0 {
            return Ok(GpuStep {
                logits: Vec::new(),
                routing: routing(&batch)?,
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
        let head = self.weights.lm_head();
        ops.linear((&picked_bf16, DType::Bf16), n, head, &logits, 0.0)?;
        Ok(GpuStep {
            logits: exec.download_f32(&logits)?,
            routing: routing(&batch)?,
        })
    }
}

fn feed_forward(
    ops: Ops<'_>,
    layer: &GpuLayer,
    (rows, h): (usize, usize),
    x: &DeviceBuffer,
    gemms: ExpertGemms,
    routing: &mut Vec<DeviceRouting>,
) -> Result<()> {
    match &layer.ffn {
        GpuFfn::Dense(mlp) => {
            let (_, normed_bf16) = normed_input(ops, layer, rows, h, x)?;
            mlp_into(ops, mlp, &normed_bf16, rows, x, 1.0)
        }
        GpuFfn::Moe(moe) => {
            let routed = route(ops, layer, moe, rows, h, x)?;
            routed_experts(ops, moe, &routed, (rows, h), gemms)?;
            ops.add(x, &routed.output, rows * h)?;
            routing.push(DeviceRouting {
                experts: routed.experts,
                weights: routed.weights,
                top_k: routed.top_k,
            });
            Ok(())
        }
    }
}

/// Layer `layer`'s normalised feed-forward input `[rows, H]`, in f32 (the routers) and bf16
/// (the experts' GEMMs).
fn normed_input(
    ops: Ops<'_>,
    layer: &GpuLayer,
    rows: usize,
    h: usize,
    x: &DeviceBuffer,
) -> Result<(DeviceBuffer, DeviceBuffer)> {
    let exec = ops.exec;
    let normed = exec.alloc_zeroed(rows * h * 4)?;
    ops.copy_rows(x, 0, h, rows, h, &normed, 0, h)?;
    let norm = &layer.post_norm;
    ops.rms_norm_inplace(&normed, 0, h, &norm.weight, norm.eps, rows, h)?;
    let normed_bf16 = exec.alloc_zeroed(rows * h * 2)?;
    ops.f32_to_bf16(&normed, 0, h, rows, h, &normed_bf16, h)?;
    Ok((normed, normed_bf16))
}

/// The first half of an MoE block on the device: the normalised input, the router's choices
/// and the shared experts' output (or zeros), where the routed experts' weighted sum is added
/// next (the CPU path's order).
fn route(
    ops: Ops<'_>,
    layer: &GpuLayer,
    moe: &GpuMoe,
    rows: usize,
    h: usize,
    x: &DeviceBuffer,
) -> Result<GpuRouted> {
    let exec = ops.exec;
    let (normed, normed_bf16) = normed_input(ops, layer, rows, h, x)?;
    let output = exec.alloc_zeroed(rows * h * 4)?;
    if let Some(shared) = &moe.shared {
        mlp_into(ops, shared, &normed_bf16, rows, &output, 0.0)?;
        if let Some(gate) = &moe.shared_gate {
            let logit = exec.alloc_zeroed(rows * 4)?;
            ops.linear((&normed, DType::F32), rows, gate, &logit, 0.0)?;
            ops.scale_by_sigmoid(&output, &logit, rows, h)?;
        }
    }
    let (experts, k) = (moe.router.out_dim, moe.top_k);
    let logits = exec.alloc_zeroed(rows * experts * 4)?;
    ops.linear((&normed, DType::F32), rows, &moe.router, &logits, 0.0)?;
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
    Ok(GpuRouted {
        normed_bf16,
        experts: ids,
        weights,
        output,
        top_k: k,
    })
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

/// Runs every expert on its rows and adds each row's weighted expert outputs into
/// `routed.output`: the rows grouped by expert on the device, then one grouped launch of each
/// half of the MLP for all experts (or the groups as `gemms` says; [`LocalExperts::run`]).
fn routed_experts(
    ops: Ops<'_>,
    moe: &GpuMoe,
    routed: &GpuRouted,
    (rows, h): (usize, usize),
    gemms: ExpertGemms,
) -> Result<()> {
    let local = moe.local.as_ref().ok_or_else(|| {
        ModelError::Input(
            "this GPU model was uploaded without its routed experts (they run on an EP data plane)"
                .into(),
        )
    })?;
    let k = moe.top_k;
    let done = local.run(
        ops.exec,
        &routed.normed_bf16,
        (rows, k),
        &routed.experts,
        gemms,
    )?;
    ops.combine(
        &done.out,
        &done.row_of,
        &routed.weights,
        rows,
        k,
        h,
        &routed.output,
    )?;
    Ok(())
}
