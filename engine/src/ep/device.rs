//! The EP runtime with its ranks' dense parts on a GPU: every local rank's sequences run through
//! one [`GpuModel`] batch (attention is per sequence, so ranks sharing a GPU batch together).
//! Each MoE layer then runs one of three ways:
//!
//! - one rank holding every expert: the whole block on the device, nothing to balance (the
//!   router's choices come to the host for the layer's report only);
//! - every rank in this process: the router and shared experts on the device, then the bf16
//!   device data plane ([`DeviceMoe`]) from the router's output where it is; the load counts
//!   are the one host copy, for the planner;
//! - ranks in other processes too: the normalised input comes to the host, is split by rank and
//!   goes through the runtime's own MoE layer on its data plane and fabric, whose output is
//!   added back into the residual on the device.

use std::sync::Arc;
use std::time::Instant;

use candle_core::{Device, Tensor};
use rackfill_kernels::cuda::device_moe::{DeviceMoe, RoutedRows};
use rackfill_kernels::cuda::exec::{Executor, GpuExecutor};
use rackfill_kernels::cuda::{CudaError, Gpu};
use rackfill_models::gpu::{Experts, GpuBatch, GpuInput, GpuModel, GpuSequence};
use rackfill_models::layers::moe::rows_of;
use rackfill_models::{FeedForward, LogitsFor, ModelError, SequenceInput};

use rackfill_models::{ExpertSelection, Routing};

use super::on_device::OnDevice;
use super::{EpRuntime, Finished, LayerReport, Solved, StepOutput};
use crate::error::{EngineError, Result};
use crate::plane::{expert_weights, received_bytes, PhaseTimes};

/// KV blocks beyond `tokens / BLOCK_TOKENS`: room for the partly filled last block of as many
/// sequences (the scheduler budgets tokens, the device cache hands out whole blocks).
const SPARE_BLOCKS_TOKENS: usize = 256 * rackfill_models::gpu::BLOCK_TOKENS;

impl EpRuntime {
    /// Opens GPU `ordinal` as an executor.
    pub(super) fn open_gpu(ordinal: usize) -> Result<Arc<dyn Executor>> {
        let gpu_error = |e: rackfill_kernels::cuda::CudaError| {
            EngineError::Config(format!("--device cuda:{ordinal}: {e}"))
        };
        let gpu = Gpu::open(ordinal).map_err(gpu_error)?;
        Ok(Arc::new(GpuExecutor::new(gpu).map_err(gpu_error)?))
    }

    /// Moves the local ranks' dense parts to `exec` (a GPU, or the host emulator that checks
    /// this path without one), with a paged KV cache for `kv_tokens_per_rank` tokens per local
    /// rank; see [`EpRuntime::open_device`].
    pub fn open_device_with(
        &mut self,
        exec: Arc<dyn Executor>,
        kv_tokens_per_rank: usize,
    ) -> Result<()> {
        if self.config.micro_batches > 1 {
            return Err(EngineError::Config(
                "two micro-batches run with the model on the CPU (either data plane), not the \
                 device runtime: --micro-batches 1 with --device"
                    .into(),
            ));
        }
        if self.config.slot_memory != crate::rack_cost::SlotMemory::Shared {
            return Err(EngineError::Config(
                "per-layer replica slots live on the CPU path only: --slot-memory shared with \
                 --device"
                    .into(),
            ));
        }
        let ranks = self.fabric.local_ranks().len();
        let tokens = kv_tokens_per_rank
            .saturating_mul(ranks)
            .saturating_add(SPARE_BLOCKS_TOKENS);
        // One rank holding every expert: the MoE layers run on the device too, with no host
        // round trip (nothing to balance); otherwise on an EP data plane.
        let experts =
            if self.config.ep_size == 1 && *self.model.expert_selection() == ExpertSelection::All {
                Experts::Here
            } else {
                Experts::Elsewhere
            };
        // Every rank here: the MoE layers on this device's data plane, which holds every
        // expert (the model does too, in one process).
        let (moe, moe_ordinal) = if experts == Experts::Elsewhere && ranks == self.layout.ranks() {
            let (moe_ordinal, layers) = expert_weights(&self.model)?;
            let mc = self.model.config();
            let moe = DeviceMoe::new(
                Arc::clone(&exec),
                &self.layout,
                mc.hidden_size,
                mc.moe.intermediate_size,
                &layers,
                self.config.relay,
            )
            .map_err(gpu_error)?;
            (Some(moe), moe_ordinal)
        } else {
            (None, Vec::new())
        };
        let model = GpuModel::upload(exec, &self.model, tokens, experts)?;
        self.device = Some(OnDevice {
            model,
            moe,
            moe_ordinal,
        });
        Ok(())
    }

    /// [`EpRuntime::forward`] with the dense parts on the device.
    pub(super) fn forward_on_device(
        &mut self,
        batches: &mut [Vec<SequenceInput<'_>>],
        which: &[Vec<LogitsFor>],
    ) -> Result<StepOutput> {
        // Taken out for the step so the MoE layers can borrow the runtime; put back whatever
        // happens.
        let device = self.device.take().expect("called with a device");
        let result = self.step_on(&device, batches, which);
        self.device = Some(device);
        result
    }

    fn step_on(
        &mut self,
        device: &OnDevice,
        batches: &mut [Vec<SequenceInput<'_>>],
        which: &[Vec<LogitsFor>],
    ) -> Result<StepOutput> {
        let hidden = self.model.config().hidden_size;
        let vocab = self.model.config().vocab_size;
        // Rows and logit rows per local rank, in batch order.
        let mut rank_rows = Vec::with_capacity(batches.len());
        let mut rank_logits = Vec::with_capacity(batches.len());
        let mut inputs = Vec::new();
        for (batch, which) in batches.iter_mut().zip(which) {
            let (mut rows, mut logit_rows) = (0, 0);
            for (s, &w) in batch.iter_mut().zip(which) {
                let n = s.tokens.len();
                rows += n;
                logit_rows += match w {
                    LogitsFor::AllPositions => n,
                    LogitsFor::LastPosition => usize::from(n > 0),
                };
                let sequence = s
                    .cache
                    .device
                    .as_mut()
                    .and_then(|d| d.as_any_mut().downcast_mut::<GpuSequence>())
                    .ok_or_else(|| {
                        EngineError::InvalidRequest(
                            "a sequence whose KV cache is not on the runtime's GPU".into(),
                        )
                    })?;
                inputs.push(GpuInput {
                    tokens: s.tokens,
                    sequence,
                    logits: w,
                });
            }
            rank_rows.push(rows);
            rank_logits.push(logit_rows);
        }
        let gpu = &device.model;
        let mut step = gpu.begin(&mut inputs)?;
        let mut reports = Vec::new();
        let mut on_device = Vec::new();
        let model = Arc::clone(&self.model);
        for (index, layer) in model.layers().iter().enumerate() {
            gpu.attention(index, &mut step)?;
            let FeedForward::Moe(block) = layer.ffn() else {
                gpu.feed_forward(index, &mut step)?;
                continue;
            };
            if gpu.experts() == Experts::Here {
                gpu.feed_forward(index, &mut step)?;
                on_device.push(index);
                continue;
            }
            if let (Some(moe), Some(Some(ordinal))) =
                (&device.moe, device.moe_ordinal.get(index).copied())
            {
                let at = DeviceLayer {
                    layer: index,
                    ordinal,
                    rank_rows: &rank_rows,
                };
                reports.push(self.moe_layer_on_device(gpu, moe, &at, &mut step)?);
                continue;
            }
            let input = gpu.ffn_input(index, &step)?;
            let per_rank = split_rows(&input, &rank_rows, hidden)?;
            let (outs, report) = self.moe_layer(index, block, &per_rank)?;
            reports.push(report);
            let mut flat = Vec::with_capacity(input.len());
            for out in outs.iter().flatten() {
                flat.extend(rows_of(out)?);
            }
            gpu.add_to_residual(&mut step, &flat)?;
        }
        let finished = gpu.finish(step)?;
        for (layer, routing) in on_device.into_iter().zip(&finished.routing) {
            reports.push(self.report_routed_on_device(layer, routing)?);
        }
        Ok(StepOutput {
            logits: split_rows(&finished.logits, &rank_logits, vocab)?,
            layers: reports,
        })
    }

    /// One MoE layer with every rank on the device: router and shared experts
    /// ([`GpuModel::route`]), the load counted where the router left its choices, the plan
    /// solved on the host from those counts, then replicas, dispatch, experts and combine on the
    /// device data plane, and the block's output added into the residual.
    fn moe_layer_on_device(
        &mut self,
        gpu: &GpuModel,
        moe: &DeviceMoe,
        at: &DeviceLayer<'_>,
        step: &mut GpuBatch,
    ) -> Result<LayerReport> {
        let layer = at.layer;
        let started = Instant::now();
        let routed = gpu.route(layer, step)?;
        let rows = RoutedRows {
            x: routed.rows_bf16(),
            experts: routed.experts(),
            weights: routed.weights(),
            rank_rows: at.rank_rows,
            top_k: routed.top_k(),
        };
        let counted = moe.count(&rows).map_err(gpu_error)?;
        let route = started.elapsed();

        let started = Instant::now();
        let gathered = self.fabric.all_gather(&counted.counts)?;
        let Solved { plan, load, took } = self.solve(layer, gathered)?;
        super::check_plans_agree(&*self.fabric, layer, &plan)?;
        let solve = started.elapsed();

        let run = moe
            .run_layer(at.ordinal, &plan, &rows, &counted, routed.output())
            .map_err(|e| EngineError::Gpu(format!("layer {layer}: {e}")))?;
        gpu.add_routed(step, &routed)?;
        let recv_bytes = received_bytes(&run.token_recv_bytes, &run.replica_recv_bytes);
        let phases = PhaseTimes {
            route,
            solve,
            replicate: run.replicate,
            dispatch: run.dispatch,
            experts: run.experts,
            combine: run.combine,
        };
        let replica_bytes = run.replica_recv_bytes.iter().sum();
        let solved = Solved { plan, load, took };
        Ok(self.layer_report(
            Finished {
                layer,
                solved,
                bytes: (replica_bytes, recv_bytes),
                phases,
            },
            0,
        ))
    }

    /// The report of an MoE layer the device ran whole (one rank, every expert there): its exact
    /// load and the plan the balancer solves for it, as the data plane would have reported;
    /// nothing was streamed or dispatched.
    fn report_routed_on_device(&mut self, layer: usize, routing: &Routing) -> Result<LayerReport> {
        let counts = routing.expert_counts(self.layout.experts());
        let gathered = self.fabric.all_gather(&[counts])?;
        let solved = self.solve(layer, gathered)?;
        let received = vec![0; self.fabric.local_ranks().len()];
        Ok(self.layer_report(
            Finished {
                layer,
                solved,
                bytes: (0, received),
                phases: PhaseTimes::default(),
            },
            0,
        ))
    }
}

/// Where an MoE layer sits: its model layer, its index among the MoE layers, the rows of each
/// local rank in the device batch.
struct DeviceLayer<'a> {
    layer: usize,
    ordinal: usize,
    rank_rows: &'a [usize],
}

fn gpu_error(err: CudaError) -> EngineError {
    EngineError::Gpu(err.to_string())
}

/// Consecutive `[counts[r], width]` blocks of row-major `values`, as tensors (`None` for none).
fn split_rows(values: &[f32], counts: &[usize], width: usize) -> Result<Vec<Option<Tensor>>> {
    let mut start = 0;
    counts
        .iter()
        .map(|&n| {
            let part = values
                .get(start * width..(start + n) * width)
                .ok_or_else(|| {
                    EngineError::InvalidRequest(format!(
                        "{} values for {counts:?} rows",
                        values.len()
                    ))
                })?;
            start += n;
            (n > 0)
                .then(|| Tensor::from_slice(part, (n, width), &Device::Cpu))
                .transpose()
                .map_err(|e| ModelError::from(e).into())
        })
        .collect()
}
