//! The layer loop's operations with the model and the MoE data plane on a device (feature
//! `cuda`: a GPU, or the host emulator): every local rank's sequences of a micro-batch run as one
//! device batch of [`GpuModel`] (attention is per sequence, so ranks sharing a device batch
//! together), and each MoE layer runs on the micro-batch's lane of the device data plane
//! ([`DeviceMoe`]) from the router's output where it is. The load counts are the one host copy
//! before the plan; ranks of other processes are reached through the fabric.

use std::ops::Range;
use std::sync::Arc;

use candle_core::{Device, Tensor};
use rackfill_balancer::{Layout, LoadMatrix, Plan};
use rackfill_kernels::cuda::exec::{Emulator, Executor, GpuExecutor};
use rackfill_kernels::cuda::moe::{
    Counted, DeviceMoe, HostExchange, LayerInFlight, LayerTiming, MoeLane, RoutedRows,
};
use rackfill_models::gpu::{ExpertPlacement, GpuBatch, GpuInput, GpuModel, GpuSequence};
use rackfill_models::{CheckpointModel, LogitsFor, ModelError, SequenceInput};

use crate::error::{EngineError, Result};
use crate::fabric::Fabric;
use crate::model_device::ModelDevice;
use crate::plane::device::{gpu_error, open_device_plane, FabricExchange};
use crate::plane::{received_bytes, PhaseTimes, PlaneConfig};

/// KV blocks beyond `tokens / BLOCK_TOKENS`: room for the partly filled last block of as many
/// sequences (the scheduler budgets tokens, the device cache hands out whole blocks).
const SPARE_BLOCKS_TOKENS: usize = 256 * rackfill_models::gpu::BLOCK_TOKENS;

/// The runtime's model and MoE data plane on one device.
pub(super) struct OnDevice {
    model: GpuModel,
    moe: DeviceMoe,
    /// Per model layer: its index among the MoE layers.
    moe_ordinal: Vec<Option<usize>>,
    local: Range<usize>,
    /// Bytes written from the host while loading, and bytes of the home experts.
    weight_bytes: (u64, u64),
}

/// The device model as the micro-batches of a step share it.
#[derive(Clone, Copy)]
pub(super) struct DeviceModel<'m> {
    pub model: &'m GpuModel,
    moe_ordinal: &'m [Option<usize>],
    local: &'m Range<usize>,
}

/// The executor `device` names, for a process of local rank `local_rank` under a launcher.
pub(super) fn open_executor(
    device: ModelDevice,
    local_rank: Option<usize>,
) -> Result<Arc<dyn Executor>> {
    match device {
        ModelDevice::Emulator => Ok(Emulator::shared().ok_or_else(|| {
            EngineError::Config("--device emulator needs a C++ compiler (CXX)".into())
        })?),
        ModelDevice::Cuda { ordinal } => {
            // Under a launcher, local ranks take the visible GPUs in turn: more processes than
            // GPUs share them (through peer memory, which NCCL cannot do).
            let ordinal = match (ordinal, local_rank) {
                (None, Some(local)) => rackfill_kernels::cuda::probe()
                    .map_or(local, |info| local % info.devices.max(1)),
                _ => device.gpu_ordinal(local_rank).unwrap_or(0),
            };
            let exec = GpuExecutor::open(ordinal)
                .map_err(|e| EngineError::Config(format!("--device cuda:{ordinal}: {e}")))?;
            Ok(Arc::new(exec))
        }
        ModelDevice::Cpu => Err(EngineError::Config("--device cpu has no executor".into())),
    }
}

impl OnDevice {
    /// `model`'s dense parts and the `local` ranks' home experts of `layout` on `exec`, read
    /// straight from its checkpoint and uploaded once, a paged KV cache for `kv_tokens_per_rank`
    /// tokens per local rank, and the data plane for `plane`.
    pub(super) fn open(
        exec: Arc<dyn Executor>,
        model: &CheckpointModel,
        (layout, local): (&Layout, Range<usize>),
        kv_tokens_per_rank: usize,
        plane: &PlaneConfig,
    ) -> Result<Self> {
        let mc = &model.config;
        let dims = (mc.hidden_size, mc.moe.intermediate_size);
        let tokens = kv_tokens_per_rank
            .saturating_mul(local.len())
            .saturating_add(SPARE_BLOCKS_TOKENS);
        let placement = ExpertPlacement::Homes {
            layout,
            local: local.clone(),
        };
        let before = exec.bytes_uploaded();
        let (gpu, homes) =
            GpuModel::load(Arc::clone(&exec), mc, &model.checkpoint, tokens, placement)?;
        let homes = homes
            .ok_or_else(|| EngineError::Config("the device model loaded no home experts".into()))?;
        let weight_bytes = (
            exec.bytes_uploaded() - before,
            homes.buffers.iter().map(|b| b.bytes() as u64).sum(),
        );
        let moe = open_device_plane(exec, (layout, local.clone()), dims, homes, plane)?;
        let mut next = 0;
        let moe_ordinal = mc
            .sparse_layers
            .iter()
            .map(|&moe| {
                moe.then(|| {
                    next += 1;
                    next - 1
                })
            })
            .collect();
        Ok(Self {
            model: gpu,
            moe,
            moe_ordinal,
            local,
            weight_bytes,
        })
    }

    /// The model, shared, and every lane, each micro-batch's own.
    pub(super) fn split(&mut self) -> (DeviceModel<'_>, &mut [MoeLane]) {
        (
            DeviceModel {
                model: &self.model,
                moe_ordinal: &self.moe_ordinal,
                local: &self.local,
            },
            self.moe.lanes_mut(),
        )
    }

    /// Bytes written from the host while loading (each tensor once), and bytes of the home
    /// experts.
    pub(super) fn weight_bytes(&self) -> (u64, u64) {
        self.weight_bytes
    }

    /// A new sequence's blocks in the device KV cache.
    pub(super) fn new_sequence(&self) -> GpuSequence {
        self.model.new_sequence()
    }

    /// With ranks in other processes: maps every rank's receive side into every process through
    /// peer memory when `peer` asks for it (every process calls this together; a process that
    /// cannot map its peers takes every process to the host path, which it logs), and logs the
    /// MoE data path this rank takes.
    pub(super) fn connect(&mut self, fabric: &dyn Fabric, peer: bool) -> Result<()> {
        let ranks = format!("ranks {:?} of {}", self.local, fabric.world_size());
        if !peer {
            tracing::info!(
                "MoE data path ({ranks}): host (--moe-transport host: rows, outputs and \
                 replicas to other processes through host buffers and the fabric)"
            );
            return Ok(());
        }
        match self.moe.connect(&FabricExchange { fabric }) {
            Ok(mechanism) => tracing::info!(
                "MoE data path ({ranks}): peer memory ({mechanism}): rows, outputs and replicas \
                 cross processes device to device"
            ),
            Err(err) => tracing::warn!(
                "MoE data path ({ranks}): host, peer memory unavailable ({err}): rows, outputs \
                 and replicas to other processes through host buffers and the fabric"
            ),
        }
        Ok(())
    }

    /// The peer memory MoE rows cross processes through, if any.
    pub(super) fn peer_memory(&self) -> Option<&'static str> {
        self.moe.peer_memory()
    }

    /// Local rank `rank`'s slot `slot` in micro-batch `micro_batch`'s lane, in the slots model
    /// layer `layer` uses, widened to f32.
    pub(super) fn slot_contents(
        &self,
        (micro_batch, layer): (usize, usize),
        rank: usize,
        slot: usize,
    ) -> Option<Vec<f32>> {
        let ordinal = self.moe_ordinal.get(layer).copied().flatten()?;
        self.moe
            .lane(micro_batch)?
            .slot_contents(ordinal, rank, slot)
            .ok()
    }
}

/// One micro-batch's rows on the device.
pub(super) struct DeviceMicro {
    batch: GpuBatch,
    /// Rows (new tokens) of each local rank, in batch order.
    rank_rows: Vec<usize>,
    /// Logit rows of each local rank.
    rank_logits: Vec<usize>,
}

/// A device MoE layer between its route and its combine.
pub(super) struct DeviceFlight {
    /// Its index among the MoE layers.
    ordinal: usize,
    routed: Option<(RoutedRows, Counted)>,
    flight: Option<LayerInFlight>,
}

impl DeviceModel<'_> {
    fn ordinal(&self, layer: usize) -> Result<usize> {
        self.moe_ordinal
            .get(layer)
            .copied()
            .flatten()
            .ok_or_else(|| EngineError::Config(format!("layer {layer} is not an MoE layer")))
    }

    /// Whether every rank of the group is in this process.
    fn all_local(&self, fabric: &dyn Fabric) -> bool {
        self.local.len() == fabric.world_size()
    }

    /// The micro-batch's sequences as one device batch: their KV blocks taken, tokens embedded.
    pub(super) fn begin(
        &self,
        seqs: &mut [&mut [SequenceInput<'_>]],
        which: &[&[LogitsFor]],
    ) -> Result<DeviceMicro> {
        let mut rank_rows = Vec::with_capacity(seqs.len());
        let mut rank_logits = Vec::with_capacity(seqs.len());
        let mut inputs = Vec::new();
        for (batch, which) in seqs.iter_mut().zip(which) {
            let (mut rows, mut logit_rows) = (0, 0);
            for (s, &w) in batch.iter_mut().zip(which.iter()) {
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
                            "a sequence whose KV cache is not on the runtime's device".into(),
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
        Ok(DeviceMicro {
            batch: self.model.begin(&mut inputs)?,
            rank_rows,
            rank_logits,
        })
    }

    /// A dense layer: attention and MLP, into the residual.
    pub(super) fn dense_layer(&self, layer: usize, micro: &mut DeviceMicro) -> Result<()> {
        self.model.attention(layer, &mut micro.batch)?;
        self.model.feed_forward(layer, &mut micro.batch)?;
        Ok(())
    }

    /// An MoE layer's attention, FFN norm, router and shared experts, then the load counted on
    /// the lane: the layer in flight and every local rank's expert counts.
    pub(super) fn route_layer(
        &self,
        lane: &MoeLane,
        layer: usize,
        micro: &mut DeviceMicro,
    ) -> Result<(DeviceFlight, Vec<Vec<u64>>)> {
        let ordinal = self.ordinal(layer)?;
        self.model.attention(layer, &mut micro.batch)?;
        let rows = self
            .model
            .route(layer, &micro.batch, micro.rank_rows.clone())?;
        let counted = lane.count(&rows).map_err(gpu_error)?;
        let counts = counted.counts.clone();
        Ok((
            DeviceFlight {
                ordinal,
                routed: Some((rows, counted)),
                flight: None,
            },
            counts,
        ))
    }

    /// Solves `load` for model layer `layer` on the lane's device solver (the replication
    /// queued behind it), or `None` when the lane has none.
    pub(super) fn solve(
        &self,
        lane: &mut MoeLane,
        layer: usize,
        load: &LoadMatrix,
    ) -> Result<Option<Plan>> {
        let ordinal = self.ordinal(layer)?;
        lane.solve(ordinal, load).map_err(|e| layer_error(layer, e))
    }

    /// Every rank's slots as model layer `layer`'s last stream left them in the lane's
    /// per-layer set (`None` with shared slots).
    pub(super) fn resident(&self, lane: &MoeLane, layer: usize) -> Option<Vec<Option<u32>>> {
        let ordinal = self.ordinal(layer).ok()?;
        lane.resident(ordinal).map(<[_]>::to_vec)
    }

    /// Replicas (unless the solve already queued them) and dispatch.
    pub(super) fn send(
        &self,
        (lane, fabric): (&mut MoeLane, &dyn Fabric),
        (layer, plan, load): (usize, &Plan, &LoadMatrix),
        flight: &mut DeviceFlight,
    ) -> Result<()> {
        let (rows, counted) = flight
            .routed
            .take()
            .ok_or_else(|| EngineError::Config(format!("layer {layer} was sent twice")))?;
        let exchange = FabricExchange { fabric };
        let remote = (!self.all_local(fabric)).then_some(&exchange as &dyn HostExchange);
        let sent = lane
            .send((flight.ordinal, plan, load), rows, counted, remote)
            .map_err(|e| layer_error(layer, e))?;
        flight.flight = Some(sent);
        Ok(())
    }

    /// Main and replica experts on the received rows (queued on the lane).
    pub(super) fn experts(
        &self,
        lane: &MoeLane,
        layer: usize,
        flight: &mut DeviceFlight,
    ) -> Result<()> {
        let in_flight = flight.flight.as_mut().ok_or_else(|| {
            EngineError::Config(format!("layer {layer}'s experts before its send"))
        })?;
        lane.experts(in_flight).map_err(|e| layer_error(layer, e))
    }

    /// The combine, then the block's output into the residual: what the layer moved, and the
    /// events that time its phases.
    pub(super) fn combine(
        &self,
        (lane, fabric): (&mut MoeLane, &dyn Fabric),
        layer: usize,
        flight: DeviceFlight,
        micro: &mut DeviceMicro,
    ) -> Result<((u64, Vec<u64>), LayerTiming)> {
        let in_flight = flight.flight.ok_or_else(|| {
            EngineError::Config(format!("layer {layer}'s combine before its send"))
        })?;
        let exchange = FabricExchange { fabric };
        let remote = (!self.all_local(fabric)).then_some(&exchange as &dyn HostExchange);
        let (run, rows) = lane
            .combine(in_flight, remote)
            .map_err(|e| layer_error(layer, e))?;
        self.model.add_routed(&mut micro.batch, &rows)?;
        let recv = received_bytes(&run.token_recv_bytes, &run.replica_recv_bytes);
        Ok(((run.replica_recv_bytes.iter().sum(), recv), run.timing))
    }

    /// Per local rank: the logits of the rows the micro-batch asked for (`None` without any).
    pub(super) fn logits(&self, micro: DeviceMicro) -> Result<Vec<Option<Tensor>>> {
        let vocab = self.model.config().vocab_size;
        let finished = self.model.finish(micro.batch)?;
        split_rows(&finished.logits, &micro.rank_logits, vocab)
    }

    /// A layer's phases from its events (once the step's work has run).
    pub(super) fn phases(&self, timing: &LayerTiming, phases: PhaseTimes) -> Result<PhaseTimes> {
        let device = timing.resolve(self.model.executor()).map_err(gpu_error)?;
        Ok(PhaseTimes {
            replicate: device.replicate,
            dispatch: device.dispatch,
            experts: device.experts,
            combine: device.combine,
            ..phases
        })
    }
}

/// A device error of model layer `layer`.
fn layer_error(layer: usize, err: rackfill_kernels::cuda::CudaError) -> EngineError {
    EngineError::Gpu(format!("layer {layer}: {err}"))
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
