//! The fabric contract's types: the [`Fabric`] trait every implementation keeps (see the module
//! documentation of `fabric`), the all-to-all [`Message`] and the replica stream's
//! [`ReplicaBuffers`], with the schedule check every fabric runs on them.

use std::ops::Range;

use rackfill_balancer::relay::TransferSchedule;
use rackfill_balancer::Plan;
use rackfill_kernels::{check_schedule, SlotBuffers, TransferPlace};

use crate::error::Result;

/// One rank-to-rank message of the all-to-all: `rows` of f32 activations and per-row integer
/// metadata (`ids`, a fixed number per row chosen by the caller).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Message {
    pub rows: Vec<f32>,
    pub ids: Vec<u32>,
}

impl Message {
    /// Bytes on the wire.
    pub fn bytes(&self) -> u64 {
        ((self.rows.len() + self.ids.len()) * 4) as u64
    }
}

/// What a replica stream reads and writes on this process: the weights of the experts its ranks
/// home, and its ranks' redundant slots.
pub struct ReplicaBuffers<'a> {
    /// Home expert `e`'s weights as ordered byte segments whose concatenation is the expert;
    /// called only for experts homed on a local rank.
    pub source: &'a dyn Fn(u32) -> Vec<&'a [u8]>,
    /// Per local rank: its redundant-slot buffer (`n_slot` slots of `slot_bytes`).
    pub slots: Vec<&'a mut [u8]>,
    pub slot_bytes: usize,
    pub expert_bytes: usize,
}

impl ReplicaBuffers<'_> {
    /// Checks `schedule` against `plan` and the slot buffers of the `local` ranks of a group of
    /// `world` before any chunk moves, with the rules every replica stream follows
    /// ([`rackfill_kernels::check_schedule`]: every process holding some ranks reaches the same
    /// verdict on the shared parts), and resolves where every transfer reads and writes in slot
    /// buffers. The error is one line naming the transfer or buffer at fault.
    pub(crate) fn check_schedule(
        &self,
        plan: &Plan,
        schedule: &TransferSchedule,
        local: &Range<usize>,
        world: usize,
    ) -> std::result::Result<Vec<TransferPlace>, String> {
        if plan.ranks() != world {
            return Err(format!(
                "replica stream: the plan has {} ranks, the group {world}",
                plan.ranks()
            ));
        }
        if self.slots.len() != local.len() {
            return Err(format!(
                "replica stream: {} slot buffers for local ranks {local:?}",
                self.slots.len()
            ));
        }
        let lens: Vec<usize> = self.slots.iter().map(|s| s.len()).collect();
        let buffers = SlotBuffers {
            expert_bytes: self.expert_bytes,
            slot_bytes: self.slot_bytes,
            first_rank: local.start,
            lens: &lens,
        };
        check_schedule(plan, schedule, buffers).map_err(|e| format!("replica stream: {e}"))
    }
}

/// Rank-to-rank movement for the local ranks of a group of `world_size()` ranks (see the module
/// documentation for the contract every implementation keeps).
pub trait Fabric: Send + Sync {
    /// Ranks in the whole EP group.
    fn world_size(&self) -> usize;

    /// The ranks this process holds: contiguous, non-empty, within `0..world_size()`.
    fn local_ranks(&self) -> Range<usize>;

    /// Every rank contributes one row of counts, all rows the same length; `rows[i]` is local
    /// rank `i`'s. Returns every rank's row, in rank order (`world_size()` rows).
    fn all_gather(&self, rows: &[Vec<u64>]) -> Result<Vec<Vec<u64>>>;

    /// `send[i][dst]` is local rank `i`'s message to world rank `dst` (`world_size()` per local
    /// rank). Returns `recv[i][src]`: what local rank `i` received from world rank `src`, in
    /// source order.
    fn all_to_all_v(&self, send: Vec<Vec<Message>>) -> Result<Vec<Vec<Message>>>;

    /// One-sided puts of replica weights, chunk by chunk in `schedule` order (stage-2 copies
    /// forward a relay's chunk once it has landed). Writes only the local ranks' slots and reads
    /// only the local ranks' home experts; returns the bytes each local rank received.
    fn stream_replicas(
        &self,
        plan: &Plan,
        schedule: &TransferSchedule,
        buffers: ReplicaBuffers<'_>,
    ) -> Result<Vec<u64>>;

    /// Bytes delivered to this process's ranks from other ranks so far (all operations).
    fn bytes_moved(&self) -> u64;

    /// Whether the other ranks run in other OS processes, each with its own device context, so
    /// that their device memory can be mapped here (peer memory). False for the handles of one
    /// in-process group, which share this process's executor and streams.
    fn spans_processes(&self) -> bool {
        false
    }
}
