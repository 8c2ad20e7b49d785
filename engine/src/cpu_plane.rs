//! The MoE data plane on the CPU: every rank's redundant slots in host memory, real bytes moved
//! between ranks by the [`Fabric`], experts computed with the model's own gated MLP.
//!
//! Per layer, under the plan: replica weights streamed over the relay schedule into the slot
//! buffers -> token assignment by cumulative quotas -> dispatch (all-to-all) -> grouped expert
//! compute over main and replica experts -> combine (all-to-all back, weighted sum in top-k
//! order).

use candle_core::{Device, Tensor};
use rayon::prelude::*;

use rackfill_balancer::relay::{plan_transfers, RelayConfig};
use rackfill_balancer::Plan;
use rackfill_kernels::{
    combine, group_by_instance, permute_tokens, scatter_pairs, DispatchBuffers, InstanceRouter,
    KernelError,
};
use rackfill_models::layers::gated_mlp_rows;
use rackfill_models::layers::moe::MoeBlock;
use rackfill_models::Routing;

use crate::ep::{PhaseTimes, PlaneOutput, IDS_PER_ROW};
use crate::error::{EngineError, Result};
use crate::fabric::{Fabric, Message, ReplicaBuffers};

/// The shape of one MoE layer's work on the CPU plane.
pub(crate) struct LayerWork<'a> {
    pub block: &'a MoeBlock,
    pub plan: &'a Plan,
    /// Per rank: the FFN input rows and their routing.
    pub routed: &'a [(Vec<f32>, Routing)],
    pub hidden: usize,
    pub inter: usize,
    pub top_k: usize,
}

/// Every rank's redundant slots in host memory.
pub(crate) struct CpuPlane {
    /// Per rank: `n_slot` slots of `expert_floats` f32s, reused by every layer.
    slots: Vec<Vec<f32>>,
    /// Floats of one expert: `[H, 2I]` gate-up then `[I, H]` down.
    expert_floats: usize,
    gate_up_floats: usize,
}

impl CpuPlane {
    /// Slots for `ranks` ranks of `slots_per_rank` experts of `hidden x inter`.
    pub(crate) fn new(ranks: usize, slots_per_rank: usize, hidden: usize, inter: usize) -> Self {
        let gate_up_floats = hidden * 2 * inter;
        let expert_floats = gate_up_floats + inter * hidden;
        Self {
            slots: (0..ranks)
                .map(|_| vec![0f32; slots_per_rank * expert_floats])
                .collect(),
            expert_floats,
            gate_up_floats,
        }
    }

    /// The contents of rank `rank`'s redundant slot `slot`.
    pub(crate) fn slot_contents(&self, rank: usize, slot: usize) -> Option<Vec<f32>> {
        let start = slot.checked_mul(self.expert_floats)?;
        self.slots
            .get(rank)?
            .get(start..start.checked_add(self.expert_floats)?)
            .map(<[f32]>::to_vec)
    }

    /// Replication, dispatch, expert compute and combine of one layer.
    pub(crate) fn run_layer(
        &mut self,
        fabric: &dyn Fabric,
        relay: &RelayConfig,
        work: &LayerWork<'_>,
        phases: &mut PhaseTimes,
    ) -> Result<PlaneOutput> {
        let LayerWork {
            block,
            plan,
            routed,
            hidden,
            inter,
            top_k,
        } = *work;

        // Replica weights into the slot buffers.
        let started = std::time::Instant::now();
        let replica_recv = self.stream_replicas(fabric, relay, block, plan)?;
        phases.replicate = started.elapsed();

        // Token assignment by cumulative quotas, and dispatch.
        let started = std::time::Instant::now();
        let router = InstanceRouter::new(plan);
        let permuted: Vec<Vec<DispatchBuffers>> = routed
            .par_iter()
            .enumerate()
            .map(|(rank, (xs, routing))| {
                permute_tokens(rank, xs, hidden, top_k, &routing.experts, &router)
            })
            .collect::<Result<_, KernelError>>()?;
        // A source keeps which pairs it sent where; the rows travel with (pair, expert, instance).
        let mut sent_pairs: Vec<Vec<Vec<u32>>> = Vec::with_capacity(permuted.len());
        let mut send: Vec<Vec<Message>> = Vec::with_capacity(permuted.len());
        for buffers in permuted {
            sent_pairs.push(buffers.iter().map(|b| b.pairs.clone()).collect());
            send.push(buffers.into_iter().map(to_message).collect());
        }
        let received = fabric.all_to_all_v(send)?;
        let mut recv_bytes = remote_bytes(&received);
        phases.dispatch = started.elapsed();

        // Grouped expert compute on every rank, main and replica instances.
        let started = std::time::Instant::now();
        let slots = &*self;
        let replies: Vec<Vec<Message>> = received
            .into_par_iter()
            .enumerate()
            .map(|(rank, messages)| {
                let received: Vec<DispatchBuffers> =
                    messages.into_iter().map(from_message).collect();
                let batches = group_by_instance(rank, &received, hidden, &router)?;
                let outputs: Vec<Vec<f32>> = batches
                    .groups()
                    .par_iter()
                    .map(|group| {
                        let weights = slots.instance_weights(
                            block,
                            plan,
                            rank,
                            group.expert,
                            group.instance,
                        )?;
                        let input = batches.block(group).unwrap_or_default();
                        Ok(gated_mlp_rows(
                            weights,
                            hidden,
                            inter,
                            input,
                            group.rows.len(),
                        ))
                    })
                    .collect::<Result<_>>()?;
                let back = batches.return_outputs(&outputs.concat())?;
                Ok(back
                    .into_iter()
                    .map(|rows| Message {
                        rows,
                        ids: Vec::new(),
                    })
                    .collect())
            })
            .collect::<Result<_>>()?;
        phases.experts = started.elapsed();

        // Combine back on the source ranks, weighted sum in top-k order.
        let started = std::time::Instant::now();
        let returned = fabric.all_to_all_v(replies)?;
        for ((total, combined), replica) in recv_bytes
            .iter_mut()
            .zip(remote_bytes(&returned))
            .zip(&replica_recv)
        {
            *total += combined + replica;
        }
        let routed_out = routed
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
                let acc = combine(&pair_outputs, &routing.weights, tokens, top_k, hidden)?;
                Tensor::from_vec(acc, (tokens, hidden), &Device::Cpu)
                    .map(Some)
                    .map_err(|e| rackfill_models::ModelError::from(e).into())
            })
            .collect::<Result<_>>()?;
        phases.combine = started.elapsed();
        Ok(PlaneOutput {
            routed: routed_out,
            recv_bytes,
            replica_bytes: replica_recv.iter().sum(),
        })
    }

    /// Streams every replica's weights from its home expert into its slot; returns the bytes
    /// each rank received.
    fn stream_replicas(
        &mut self,
        fabric: &dyn Fabric,
        relay: &RelayConfig,
        block: &MoeBlock,
        plan: &Plan,
    ) -> Result<Vec<u64>> {
        if plan.replicas() == 0 {
            return Ok(vec![0; plan.ranks()]);
        }
        let expert_bytes = (self.expert_floats * 4) as u64;
        let schedule = plan_transfers(plan, expert_bytes, relay);
        let source = |e: u32| -> Vec<&[u8]> {
            block.experts[e as usize]
                .weights()
                .iter()
                .map(|w| f32_bytes(w))
                .collect()
        };
        let slot_bytes = self.expert_floats * 4;
        let slots: Vec<&mut [u8]> = self.slots.iter_mut().map(|s| f32_bytes_mut(s)).collect();
        let stats = fabric.stream_replicas(
            plan,
            &schedule,
            ReplicaBuffers {
                source: &source,
                slots,
                slot_bytes,
                expert_bytes: slot_bytes,
            },
        )?;
        Ok(stats.received_bytes)
    }

    /// The weights of `expert`'s `instance` as held by `rank`: the main expert on its home rank,
    /// or the redundant slot the plan streamed it into.
    fn instance_weights<'b>(
        &'b self,
        block: &'b MoeBlock,
        plan: &Plan,
        rank: usize,
        expert: u32,
        instance: u32,
    ) -> Result<[&'b [f32]; 2]> {
        let on = plan
            .instances(expert as usize)
            .get(instance as usize)
            .map(|i| i.rank as usize);
        if on != Some(rank) {
            return Err(EngineError::Fabric(format!(
                "rank {rank} received tokens for instance {instance} of expert {expert}, which lives on {on:?}"
            )));
        }
        if instance == 0 {
            return Ok(block.experts[expert as usize].weights());
        }
        let slot = plan
            .rank_slots(rank)
            .iter()
            .position(|&s| s == Some(expert))
            .ok_or_else(|| {
                EngineError::Fabric(format!("rank {rank} has no slot for expert {expert}"))
            })?;
        let floats = &self.slots[rank][slot * self.expert_floats..(slot + 1) * self.expert_floats];
        let (gate_up, down) = floats.split_at(self.gate_up_floats);
        Ok([gate_up, down])
    }
}

/// Per receiving rank: bytes of the messages that came from other ranks (`recv[dst][src]`).
fn remote_bytes(recv: &[Vec<Message>]) -> Vec<u64> {
    recv.iter()
        .enumerate()
        .map(|(dst, row)| {
            row.iter()
                .enumerate()
                .filter(|&(src, _)| src != dst)
                .map(|(_, m)| m.bytes())
                .sum()
        })
        .collect()
}

/// Dispatch rows on the wire: the activations, and (pair, expert, instance) per row.
fn to_message(buffers: DispatchBuffers) -> Message {
    let mut ids = Vec::with_capacity(buffers.len() * IDS_PER_ROW);
    for ((&p, &e), &i) in buffers
        .pairs
        .iter()
        .zip(&buffers.experts)
        .zip(&buffers.instances)
    {
        ids.extend_from_slice(&[p, e, i]);
    }
    Message {
        rows: buffers.rows,
        ids,
    }
}

/// The receiving side of [`to_message`].
fn from_message(message: Message) -> DispatchBuffers {
    let column = |c: usize| -> Vec<u32> {
        message
            .ids
            .chunks_exact(IDS_PER_ROW)
            .map(|ids| ids[c])
            .collect()
    };
    DispatchBuffers {
        pairs: column(0),
        experts: column(1),
        instances: column(2),
        rows: message.rows,
    }
}

/// The bytes of an f32 slice (what the fabric moves).
fn f32_bytes(xs: &[f32]) -> &[u8] {
    bytemuck::cast_slice(xs)
}

/// The bytes of a mutable f32 slice.
fn f32_bytes_mut(xs: &mut [f32]) -> &mut [u8] {
    bytemuck::cast_slice_mut(xs)
}
