//! Rank-to-rank movement: count exchange (all-gather), token dispatch and combine (all-to-all-v)
//! and one-sided puts of replica weight chunks, for a process that holds one or several ranks of
//! the EP group.
//!
//! # Contract
//!
//! A [`Fabric`] is one process's handle on a group of [`Fabric::world_size`] ranks; the process
//! holds the contiguous ranks [`Fabric::local_ranks`] (all of them for [`LocalFabric::new`], one
//! for a process per GPU). Every collective takes only the local ranks' contributions, local rank
//! `i` being world rank `local_ranks().start + i`, and returns what those ranks hold afterwards.
//!
//! - **Every process calls every collective, in the same order**, once per collective the runtime
//!   issues, even when its ranks have no tokens (they contribute zero counts, empty messages, no
//!   slot writes): a collective completes only when every process of the group has joined it.
//! - **Deterministic**: the results depend only on the contributions, never on timing. The
//!   all-gather returns rows in rank order; the all-to-all-v returns messages in source-rank
//!   order; replica chunks land in schedule order, so every process sees the same bytes.
//! - **No aliasing**: what a rank receives from another rank is a copy in a buffer it owns.
//! - A call that fails (contributions of the wrong shape, a bad schedule) fails on every process
//!   of the group, and a group of several processes is unusable afterwards (as after an MPI
//!   error); a process holding every rank just fails that call.
//!
//! The EP runtime iterates over its fabric's local ranks and nothing else, so a fabric of one
//! process per GPU (MPI or NCCL) plugs in without changing it. [`LocalFabric`] is the in-process
//! implementation: by default one process holding every rank; [`LocalFabric::group`] splits the
//! ranks over several handles, each used from its own thread as a separate process would, over
//! the same shared state, which is how the contract above is tested.

use std::collections::HashSet;
use std::ops::Range;

use rackfill_balancer::relay::{Transfer, TransferSchedule};
use rackfill_balancer::Plan;

use crate::error::Result;

mod kind;
mod local;
#[cfg(all(feature = "cuda", feature = "mpi"))]
mod nccl;
#[cfg(feature = "cuda")]
mod nccl_probe;

pub use kind::{FabricKind, UnknownFabric};
pub use local::LocalFabric;
#[cfg(all(feature = "cuda", feature = "mpi"))]
pub use nccl::NcclFabric;
#[cfg(feature = "cuda")]
pub use nccl_probe::{probe_nccl, NcclInfo};

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
/// Where one transfer reads and writes in slot buffers.
pub(crate) struct Place {
    /// Byte position in the sender's slot buffer (stage 2: a relay forwards its copy), or `None`
    /// when the sender reads its home weights.
    pub(crate) from_slot: Option<usize>,
    /// Byte position in the receiver's slot buffer.
    pub(crate) to_slot: usize,
}

/// Checks the schedule against the plan and the local buffers before any chunk moves (every
/// handle reaches the same verdict on the shared parts) and resolves every transfer's slot
/// positions.
pub(crate) fn check_schedule(
    plan: &Plan,
    schedule: &TransferSchedule,
    buffers: &ReplicaBuffers<'_>,
    local: &Range<usize>,
    world: usize,
) -> std::result::Result<Vec<Place>, String> {
    let n_slot = plan.slots_per_rank();
    if buffers.slot_bytes < buffers.expert_bytes {
        return Err(format!(
            "replica stream: slots of {} bytes cannot hold experts of {}",
            buffers.slot_bytes, buffers.expert_bytes
        ));
    }
    for (rank, slots) in local.clone().zip(&buffers.slots) {
        if slots.len() < n_slot * buffers.slot_bytes {
            return Err(format!(
                "replica stream: rank {rank}'s slot buffer has {} bytes, its slots need {}",
                slots.len(),
                n_slot * buffers.slot_bytes
            ));
        }
    }
    let slot_at = |rank: u32, expert: u32| -> Option<usize> {
        plan.rank_slots(rank as usize)
            .iter()
            .position(|&s| s == Some(expert))
            .map(|slot| slot * buffers.slot_bytes)
    };
    let mut delivered: HashSet<(u32, u32, u64, u64)> = HashSet::new();
    let mut places = Vec::with_capacity(schedule.transfers.len());
    for (index, t) in schedule.transfers.iter().enumerate() {
        let bad = |why: String| format!("replica stream: transfer {index}: {why}");
        let Transfer {
            expert,
            offset,
            len,
            src,
            dst,
            stage,
            ..
        } = *t;
        if src as usize >= world || dst as usize >= world || src == dst {
            return Err(bad(format!("ranks {src} -> {dst} of {world}")));
        }
        if expert as usize >= plan.experts() {
            return Err(bad(format!("expert {expert} is out of range")));
        }
        if offset
            .checked_add(len)
            .is_none_or(|end| end > buffers.expert_bytes as u64)
        {
            return Err(bad(format!(
                "bytes {offset}..+{len} lie outside the expert's {}",
                buffers.expert_bytes
            )));
        }
        let to_slot = slot_at(dst, expert)
            .ok_or_else(|| bad(format!("rank {dst} has no slot holding expert {expert}")))?;
        let from_slot = match stage {
            1 if plan.instances(expert as usize)[0].rank == src => None,
            1 => return Err(bad(format!("rank {src} is not expert {expert}'s home"))),
            2 if delivered.contains(&(src, expert, offset, len)) => {
                slot_at(src, expert).map(|at| at + offset as usize)
            }
            2 => {
                return Err(bad(format!(
                    "rank {src} forwards bytes it has not received"
                )))
            }
            other => return Err(bad(format!("stage {other} is neither 1 nor 2"))),
        };
        if !delivered.insert((dst, expert, offset, len)) {
            return Err(bad(format!("rank {dst} receives these bytes twice")));
        }
        places.push(Place {
            from_slot,
            to_slot: to_slot + offset as usize,
        });
    }
    Ok(places)
}
