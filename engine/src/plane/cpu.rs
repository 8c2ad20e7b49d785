//! The MoE data plane on the CPU: the local ranks' redundant slots in host memory, real bytes
//! moved between ranks by the [`Fabric`], experts computed with the model's own gated MLP.
//!
//! Per layer, under the plan: replica weights streamed over the relay schedule into the slot
//! buffers -> token assignment by cumulative quotas -> dispatch (all-to-all) -> grouped expert
//! compute over main and replica experts -> combine (all-to-all back, weighted sum in top-k
//! order). Every step touches only the fabric's local ranks; the other ranks' shares arrive and
//! leave through the fabric.

use std::ops::Range;
use std::time::Instant;

use candle_core::{Device, Tensor};
use rayon::prelude::*;

use rackfill_balancer::relay::RelayConfig;
use rackfill_balancer::reuse::{replica_stream, ReplicaStream};
use rackfill_balancer::Layout;
use rackfill_kernels::{
    combine, group_by_instance, permute_tokens, remote_recv_bytes, scatter_pairs, weight_source,
    DispatchBuffers, ExpertBatches, InstanceRouter, KernelError, WeightSource,
};
use rackfill_models::layers::gated_mlp_rows;

use super::slots::SlotSets;
use super::work::{LayerWork, PhaseTimes, PlaneConfig, PlaneOutput};
use crate::error::{EngineError, Result};
use crate::fabric::{Fabric, Message, ReplicaBuffers};

/// The local ranks' redundant slots in host memory, one set (or one per MoE layer) per
/// micro-batch: two micro-batches' layers are in flight together, so each has its own.
pub(crate) struct CpuPlane {
    shape: Shape,
    /// Per micro-batch.
    slots: Vec<SlotSets>,
}

/// What every micro-batch's share of the plane has in common.
struct Shape {
    layout: Layout,
    /// The ranks whose slots live here (the fabric's local ranks).
    local: Range<usize>,
    relay: RelayConfig,
    inter: usize,
    /// Floats of one expert: `[H, 2I]` gate-up then `[I, H]` down.
    expert_floats: usize,
    gate_up_floats: usize,
}

/// One micro-batch's share of the CPU plane: the plane's shape and that micro-batch's own slots
/// (the CPU side of `plane::MicroPlane`). A layer runs through it in three steps,
/// [`MicroPlane::send`] (replicas and dispatch, over the fabric), [`MicroPlane::compute`]
/// (expert compute, local) and [`MicroPlane::combine`] (over the fabric).
pub(crate) struct MicroPlane<'p> {
    shape: &'p Shape,
    slots: &'p mut SlotSets,
}

/// A layer whose rows are dispatched (and its replicas streamed, unless they stream under its
/// main experts: [`MicroPlane::compute_streaming`]), before its experts run.
pub(crate) struct Sent {
    router: InstanceRouter,
    /// `[i][src]`: the rows local rank `i` received from world rank `src`.
    received: Vec<Vec<Message>>,
    exchanged: Exchanged,
    phases: PhaseTimes,
}

/// A layer whose experts ran, before its combine.
pub(crate) struct Computed {
    /// `[i][src]`: local rank `i`'s outputs for the rows it received from `src`.
    replies: Vec<Vec<Message>>,
    exchanged: Exchanged,
    phases: PhaseTimes,
}

/// What a layer's dispatch moved, kept for the combine and the byte accounting.
struct Exchanged {
    /// `[i][src]`: how many rows local rank `i` received from `src`.
    received_rows: Vec<Vec<usize>>,
    /// `[i][dst]`: the pair indices local rank `i` sent to `dst`, in send order.
    sent_pairs: Vec<Vec<Vec<u32>>>,
    /// Per local rank: replica weight bytes received.
    replica_recv: Vec<u64>,
}

/// A dispatch's result per local rank: the rows received from each source, how many, and the
/// pairs sent to each destination.
type Dispatch = (Vec<Vec<Message>>, Vec<Vec<usize>>, Vec<Vec<Vec<u32>>>);

/// One local rank's received rows grouped by expert instance, and each group's output once it
/// is computed: main instances and replica instances can be computed in separate passes.
struct RankGroups {
    /// World rank.
    rank: usize,
    batches: ExpertBatches,
    /// Per group of `batches`: its `rows x hidden` output, `None` until computed.
    outputs: Vec<Option<Vec<f32>>>,
}

impl CpuPlane {
    /// Slots for the `local` ranks of `layout`, each holding experts of `hidden x inter`, for
    /// each of `config.micro_batches`, shared by the MoE layers `moe_layers` marks or one set
    /// each (`config.slot_memory`).
    pub(crate) fn new(
        layout: &Layout,
        local: Range<usize>,
        (hidden, inter): (usize, usize),
        moe_layers: &[bool],
        config: &PlaneConfig,
    ) -> Self {
        let gate_up_floats = hidden * 2 * inter;
        let expert_floats = gate_up_floats + inter * hidden;
        let relay = config.relay;
        Self {
            slots: (0..config.micro_batches.max(1))
                .map(|_| {
                    SlotSets::new(
                        config.slot_memory,
                        moe_layers,
                        (local.clone(), layout.ranks()),
                        layout.slots_per_rank(),
                        expert_floats,
                    )
                })
                .collect(),
            shape: Shape {
                layout: layout.clone(),
                local,
                relay,
                inter,
                expert_floats,
                gate_up_floats,
            },
        }
    }

    /// The contents of local rank `rank`'s redundant slot `slot` of micro-batch `micro_batch`,
    /// in the set model layer `layer` uses.
    pub(crate) fn slot_contents(
        &self,
        (micro_batch, layer): (usize, usize),
        rank: usize,
        slot: usize,
    ) -> Option<Vec<f32>> {
        self.slots.get(micro_batch)?.contents(
            layer,
            rank.checked_sub(self.shape.local.start)?,
            slot,
        )
    }

    /// Each micro-batch's share, in order.
    pub(crate) fn micro_planes(&mut self) -> Vec<MicroPlane<'_>> {
        self.slots
            .iter_mut()
            .map(|slots| MicroPlane {
                shape: &self.shape,
                slots,
            })
            .collect()
    }
}

impl MicroPlane<'_> {
    /// Every rank's slots as model layer `layer`'s last stream left them in this micro-batch's
    /// per-layer set (all `None` before the first); `None` with shared slots.
    pub(crate) fn resident(&self, layer: usize) -> Option<&[Option<u32>]> {
        self.slots.resident(layer)
    }

    /// Streams the layer's replicas into this micro-batch's slots (unless `replicas` is false:
    /// then [`Self::compute_streaming`] streams them under the main experts), assigns every
    /// local source's tokens to instances by cumulative quotas and dispatches them.
    pub(crate) fn send(
        &mut self,
        fabric: &dyn Fabric,
        work: &LayerWork<'_>,
        replicas: bool,
    ) -> Result<Sent> {
        let mut phases = PhaseTimes::default();
        let started = Instant::now();
        let replica_recv = if replicas {
            self.stream_replicas(fabric, work)?
        } else {
            Vec::new()
        };
        phases.replicate = started.elapsed();

        let started = Instant::now();
        let router = InstanceRouter::new(work.plan);
        let (received, received_rows, sent_pairs) = self.dispatch(fabric, work, &router)?;
        phases.dispatch = started.elapsed();
        Ok(Sent {
            router,
            received,
            exchanged: Exchanged {
                received_rows,
                sent_pairs,
                replica_recv,
            },
            phases,
        })
    }

    /// Grouped expert compute on every local rank, main and replica instances; nothing crosses
    /// the fabric.
    pub(crate) fn compute(&self, work: &LayerWork<'_>, sent: Sent) -> Result<Computed> {
        let Sent {
            router,
            received,
            exchanged,
            mut phases,
        } = sent;
        let started = Instant::now();
        let mut groups = self.group_received(work, &router, received)?;
        compute_groups(self.shape, Some(self.slots), work, &mut groups)?;
        let replies = return_outputs(groups)?;
        phases.experts = started.elapsed();
        Ok(Computed {
            replies,
            exchanged,
            phases,
        })
    }

    /// Pipelined experts: every local rank's main-expert GEMMs run on their own thread while
    /// this one (the only thread that calls the fabric) streams the replicas of a layer [`Self::send`]
    /// dispatched without them; the replica instances' GEMMs run once the stream is in. The
    /// stream is one fabric call, so a replica waits for all of them rather than for its own
    /// slot only.
    pub(crate) fn compute_streaming(
        &mut self,
        fabric: &dyn Fabric,
        work: &LayerWork<'_>,
        sent: Sent,
    ) -> Result<Computed> {
        let Sent {
            router,
            received,
            mut exchanged,
            mut phases,
        } = sent;
        let mut groups = self.group_received(work, &router, received)?;
        let shape = self.shape;
        let (mains, streamed) = std::thread::scope(|scope| {
            let mains = scope.spawn(|| {
                let started = Instant::now();
                compute_groups(shape, None, work, &mut groups).map(|()| started.elapsed())
            });
            let streaming = Instant::now();
            let streamed = self.stream_replicas(fabric, work);
            phases.replicate = streaming.elapsed();
            let mains = mains.join().unwrap_or_else(|_| {
                Err(EngineError::Config(
                    "a layer's main-expert compute panicked".into(),
                ))
            });
            (mains, streamed)
        });
        let main_time = mains?;
        exchanged.replica_recv = streamed?;
        let replicas = Instant::now();
        compute_groups(shape, Some(self.slots), work, &mut groups)?;
        let replies = return_outputs(groups)?;
        phases.experts = main_time + replicas.elapsed();
        Ok(Computed {
            replies,
            exchanged,
            phases,
        })
    }

    /// Returns every output to its source and sums each token's outputs in top-k order.
    pub(crate) fn combine(
        &self,
        fabric: &dyn Fabric,
        work: &LayerWork<'_>,
        computed: Computed,
    ) -> Result<PlaneOutput> {
        let Computed {
            replies,
            exchanged,
            mut phases,
        } = computed;
        let started = Instant::now();
        let returned = fabric.all_to_all_v(replies)?;
        let routed = combine_on_sources(work, &returned, &exchanged.sent_pairs)?;
        phases.combine = started.elapsed();

        let recv_bytes = self
            .shape
            .local
            .clone()
            .zip(exchanged.received_rows.iter().zip(&exchanged.sent_pairs))
            .zip(&exchanged.replica_recv)
            .map(|((rank, (rows_from, pairs_to)), replicas)| {
                let rows_to: Vec<usize> = pairs_to.iter().map(Vec::len).collect();
                remote_recv_bytes(rank, rows_from, &rows_to, work.hidden) + replicas
            })
            .collect();
        Ok(PlaneOutput {
            routed,
            recv_bytes,
            replica_bytes: exchanged.replica_recv.iter().sum(),
            phases,
        })
    }

    /// Streams every replica's weights from its home expert into its slot; returns the bytes
    /// each local rank received.
    fn stream_replicas(&mut self, fabric: &dyn Fabric, work: &LayerWork<'_>) -> Result<Vec<u64>> {
        let (block, plan, layer) = (work.block, work.plan, work.layer);
        let expert_bytes = (self.shape.expert_floats * 4) as u64;
        // With per-layer slots, what this layer's last plan left stays: resident replicas move
        // to their new slot numbers on their rank, and only the others are streamed (or the
        // whole plan over its relay trees, when that loads the busiest rank less).
        let ReplicaStream {
            plan: stream_plan,
            schedule,
        } = replica_stream(
            plan,
            self.slots.resident(layer),
            expert_bytes,
            &self.shape.relay,
        );
        self.slots.keep_resident(layer, plan, &self.shape.local);
        if schedule.transfers.is_empty() {
            // The same on every process: the plan and what was resident agree everywhere.
            self.slots.mark_streamed(layer, plan);
            return Ok(vec![0; self.shape.local.len()]);
        }
        // The fabric reads only the local ranks' home experts; each one replicated is resolved
        // here first, so one this process did not load is an error, not an empty source.
        for expert in 0..plan.experts() {
            if let [main, _, ..] = plan.instances(expert) {
                if self.shape.local.contains(&(main.rank as usize)) {
                    block.experts.get(expert as u32)?;
                }
            }
        }
        let source = |e: u32| -> Vec<&[u8]> {
            block.experts.get(e).map_or_else(
                |_| Vec::new(),
                |mlp| {
                    mlp.weights()
                        .iter()
                        .map(|w| bytemuck::cast_slice(w))
                        .collect()
                },
            )
        };
        let slot_bytes = self.shape.expert_floats * 4;
        let received = fabric.stream_replicas(
            &stream_plan,
            &schedule,
            ReplicaBuffers {
                source: &source,
                slots: self
                    .slots
                    .buffers_mut(layer)?
                    .iter_mut()
                    .map(|s| bytemuck::cast_slice_mut(s))
                    .collect(),
                slot_bytes,
                expert_bytes: slot_bytes,
            },
        )?;
        self.slots.mark_streamed(layer, plan);
        Ok(received)
    }

    /// Token assignment by cumulative quotas on every local source, and the all-to-all that
    /// carries each row with its (pair, expert, instance) to the rank computing its instance.
    fn dispatch(
        &self,
        fabric: &dyn Fabric,
        work: &LayerWork<'_>,
        router: &InstanceRouter,
    ) -> Result<Dispatch> {
        let permuted: Vec<Vec<DispatchBuffers>> = self
            .shape
            .local
            .clone()
            .into_par_iter()
            .zip(work.routed.par_iter())
            .map(|(rank, (xs, routing))| {
                permute_tokens(rank, xs, work.hidden, work.top_k, &routing.experts, router)
            })
            .collect::<Result<_, KernelError>>()?;
        // A source keeps which pairs it sent where; the rows travel with their ids.
        let mut sent_pairs = Vec::with_capacity(permuted.len());
        let mut send = Vec::with_capacity(permuted.len());
        for buffers in permuted {
            sent_pairs.push(buffers.iter().map(|b| b.pairs.clone()).collect());
            send.push(
                buffers
                    .into_iter()
                    .map(|b| {
                        let (rows, ids) = b.into_wire();
                        Message { rows, ids }
                    })
                    .collect(),
            );
        }
        let received = fabric.all_to_all_v(send)?;
        let received_rows = received
            .iter()
            .map(|row| {
                row.iter()
                    .map(|m| m.rows.len() / work.hidden.max(1))
                    .collect()
            })
            .collect();
        Ok((received, received_rows, sent_pairs))
    }

    /// Every local rank's received rows, regrouped by expert instance (one GEMM each).
    fn group_received(
        &self,
        work: &LayerWork<'_>,
        router: &InstanceRouter,
        received: Vec<Vec<Message>>,
    ) -> Result<Vec<RankGroups>> {
        self.shape
            .local
            .clone()
            .into_par_iter()
            .zip(received.into_par_iter())
            .map(|(rank, messages)| {
                let received: Vec<DispatchBuffers> = messages
                    .into_iter()
                    .map(|m| DispatchBuffers::from_wire(m.rows, &m.ids))
                    .collect::<Result<_, KernelError>>()?;
                let batches = group_by_instance(rank, &received, work.hidden, router)?;
                let outputs = vec![None; batches.groups().len()];
                Ok(RankGroups {
                    rank,
                    batches,
                    outputs,
                })
            })
            .collect()
    }
}

/// Computes every group not computed yet whose weights are at hand: main instances always (home
/// weights), replica instances when `slots` is given (their stream is in).
fn compute_groups(
    shape: &Shape,
    slots: Option<&SlotSets>,
    work: &LayerWork<'_>,
    ranks: &mut [RankGroups],
) -> Result<()> {
    ranks.par_iter_mut().try_for_each(|groups| {
        let RankGroups {
            rank,
            batches,
            outputs,
        } = groups;
        batches
            .groups()
            .par_iter()
            .zip(outputs.par_iter_mut())
            .filter(|(_, output)| output.is_none())
            .try_for_each(|(group, output)| {
                let source = weight_source(
                    &shape.layout,
                    work.plan,
                    *rank,
                    group.expert,
                    group.instance,
                );
                let weights = match (source, slots) {
                    (Some(WeightSource::Home { .. }), _) => {
                        work.block.experts.get(group.expert)?.weights()
                    }
                    (Some(WeightSource::Slot { slot }), Some(slots)) => {
                        let buffer = &slots.buffers(work.layer)?[*rank - shape.local.start];
                        let floats =
                            &buffer[slot * shape.expert_floats..(slot + 1) * shape.expert_floats];
                        let (gate_up, down) = floats.split_at(shape.gate_up_floats);
                        [gate_up, down]
                    }
                    (Some(WeightSource::Slot { .. }), None) => return Ok(()),
                    (None, _) => {
                        return Err(EngineError::Fabric(format!(
                            "rank {rank} received tokens for instance {} of expert {}, which \
                             the plan does not put there",
                            group.instance, group.expert
                        )))
                    }
                };
                let input = batches.block(group).unwrap_or_default();
                *output = Some(gated_mlp_rows(
                    weights,
                    work.hidden,
                    shape.inter,
                    input,
                    group.rows.len(),
                ));
                Ok(())
            })
    })
}

/// Every local rank's outputs addressed back to their sources (the combine's all-to-all send
/// side); every group must have been computed.
fn return_outputs(ranks: Vec<RankGroups>) -> Result<Vec<Vec<Message>>> {
    ranks
        .into_par_iter()
        .map(|groups| {
            let outputs: Vec<f32> = groups
                .outputs
                .into_iter()
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    EngineError::Fabric(format!(
                        "rank {} has an expert instance left uncomputed",
                        groups.rank
                    ))
                })?
                .concat();
            let back = groups.batches.return_outputs(&outputs)?;
            Ok(back
                .into_iter()
                .map(|rows| Message {
                    rows,
                    ids: Vec::new(),
                })
                .collect())
        })
        .collect()
}

/// The combine on every local source: returned rows placed by pair, each token's outputs summed
/// with its router weights in top-k order (exactly as the dense path sums them).
fn combine_on_sources(
    work: &LayerWork<'_>,
    returned: &[Vec<Message>],
    sent_pairs: &[Vec<Vec<u32>>],
) -> Result<Vec<Option<Tensor>>> {
    let hidden = work.hidden;
    work.routed
        .par_iter()
        .zip(returned.par_iter().zip(sent_pairs.par_iter()))
        .map(|((xs, routing), (messages, pairs))| {
            if xs.is_empty() {
                return Ok(None);
            }
            let tokens = routing.num_tokens();
            let mut pair_outputs = vec![0f32; routing.experts.len() * hidden];
            for (message, pairs) in messages.iter().zip(pairs) {
                scatter_pairs(&mut pair_outputs, hidden, pairs, &message.rows)?;
            }
            let acc = combine(&pair_outputs, &routing.weights, tokens, work.top_k, hidden)?;
            Tensor::from_vec(acc, (tokens, hidden), &Device::Cpu)
                .map(Some)
                .map_err(|e| rackfill_models::ModelError::from(e).into())
        })
        .collect()
}
