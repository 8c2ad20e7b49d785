//! The fabric contract's types: the [`Fabric`] trait every implementation keeps (see the module
//! documentation of `fabric`), the all-to-all [`Message`] and the replica stream's
//! [`ReplicaBuffers`].

use std::ops::Range;

use rackfill_balancer::relay::TransferSchedule;
use rackfill_balancer::Plan;

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
}
