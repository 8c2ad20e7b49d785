//! Turns a checked [`TransferSchedule`] into the chunk copies the copy loops execute: home
//! segments loaded once per expert, ready flags between a relay's incoming copy and the copies
//! that forward it, and the per-rank byte counts.
//!
//! Everything the copy loops (and the concurrent path's `unsafe`) rely on is established by
//! [`check_schedule`] before any byte moves: every destination byte written by exactly one copy,
//! every stage-2 copy reading exactly the bytes one earlier copy delivered to its source.

use rackfill_balancer::relay::TransferSchedule;
use rackfill_balancer::Plan;

use super::outcome::ReplicationStats;
use super::schedule_check::{check_schedule, SlotBuffers};
use crate::KernelError;

/// Where one copy reads its bytes.
pub(super) enum CopySource {
    /// Bytes `offset..offset + len` of the concatenated segments `homes[home]`.
    Home { home: usize, offset: usize },
    /// Bytes `at..at + len` of rank `rank`'s slot buffer (a replica that already holds the chunk).
    Relay { rank: usize, at: usize },
}

/// One validated chunk copy, positions resolved into slot buffers.
pub(super) struct ChunkCopy {
    /// The rank whose worker executes the copy.
    pub sender: usize,
    pub from: CopySource,
    pub dst_rank: usize,
    /// Byte position of the copy in `dst_rank`'s slot buffer.
    pub dst_at: usize,
    pub len: usize,
    /// Ready flag that must be set before reading (copies out of a relay).
    pub wait: Option<usize>,
    /// Ready flag to set once the bytes have landed (copies some relay forwards).
    pub ready: Option<usize>,
}

/// A validated schedule, ready to execute.
pub(super) struct Copies<'w> {
    /// Source segments of every expert that has stage-1 copies.
    pub homes: Vec<Vec<&'w [u8]>>,
    /// In schedule order.
    pub copies: Vec<ChunkCopy>,
    /// Number of ready flags the copies refer to.
    pub flags: usize,
    pub ranks: usize,
    pub stats: ReplicationStats,
}

/// Checks the schedule against the plan and the buffers (`lens[r]` is rank `r`'s slot buffer
/// length, for every rank of the plan) and resolves every transfer into a [`ChunkCopy`].
pub(super) fn prepare<'w>(
    plan: &Plan,
    schedule: &TransferSchedule,
    expert_bytes: usize,
    source: &dyn Fn(u32) -> Vec<&'w [u8]>,
    lens: &[usize],
    slot_bytes: usize,
) -> Result<Copies<'w>, KernelError> {
    let ranks = plan.ranks();
    if lens.len() != ranks {
        return Err(KernelError::RankCount {
            got: lens.len(),
            ranks,
        });
    }
    let buffers = SlotBuffers {
        expert_bytes,
        slot_bytes,
        first_rank: 0,
        lens,
    };
    let places = check_schedule(plan, schedule, buffers)?;
    let mut copies = Copies {
        homes: Vec::new(),
        copies: Vec::with_capacity(places.len()),
        flags: 0,
        ranks,
        stats: ReplicationStats {
            sent_bytes: vec![0; ranks],
            received_bytes: vec![0; ranks],
            ..ReplicationStats::default()
        },
    };
    let mut home_of = vec![None; plan.experts()];
    for (t, place) in schedule.transfers.iter().zip(&places) {
        let (sender, dst_rank) = (t.src as usize, t.dst as usize);
        // The check bounds offset + len by expert_bytes, a usize.
        let (offset, len) = (t.offset as usize, t.len as usize);
        let (from, wait) = match (place.from_slot, place.forwards) {
            (Some(at), Some(producer)) => {
                let flag = copies.ready_flag(producer);
                (CopySource::Relay { rank: sender, at }, Some(flag))
            }
            _ => {
                let home = load_home(
                    &mut copies.homes,
                    &mut home_of,
                    t.expert,
                    expert_bytes,
                    source,
                )?;
                (CopySource::Home { home, offset }, None)
            }
        };
        let stats = &mut copies.stats;
        let sent = &mut stats.sent_bytes[sender];
        *sent = sent.saturating_add(t.len);
        let received = &mut stats.received_bytes[dst_rank];
        *received = received.saturating_add(t.len);
        stats.transfers += 1;
        if wait.is_some() {
            stats.stage2_copies += 1;
        } else {
            stats.stage1_copies += 1;
        }
        copies.copies.push(ChunkCopy {
            sender,
            from,
            dst_rank,
            dst_at: place.to_slot,
            len,
            wait,
            ready: None,
        });
    }
    Ok(copies)
}

impl Copies<'_> {
    /// The ready flag copy `producer` sets, allocated the first time a relay forwards it.
    fn ready_flag(&mut self, producer: usize) -> usize {
        let copy = &mut self.copies[producer];
        match copy.ready {
            Some(flag) => flag,
            None => {
                let flag = self.flags;
                self.flags += 1;
                copy.ready = Some(flag);
                flag
            }
        }
    }
}

/// Index of `expert`'s source segments in `homes`, loading and size-checking them once.
fn load_home<'w>(
    homes: &mut Vec<Vec<&'w [u8]>>,
    home_of: &mut [Option<usize>],
    expert: u32,
    expert_bytes: usize,
    source: &dyn Fn(u32) -> Vec<&'w [u8]>,
) -> Result<usize, KernelError> {
    if let Some(home) = home_of[expert as usize] {
        return Ok(home);
    }
    let segments = source(expert);
    let len = segments
        .iter()
        .try_fold(0usize, |acc, s| acc.checked_add(s.len()))
        .ok_or(KernelError::Overflow {
            what: "source segment lengths",
        })?;
    if len != expert_bytes {
        return Err(KernelError::SourceSize {
            expert,
            len,
            expected: expert_bytes,
        });
    }
    let home = homes.len();
    homes.push(segments);
    home_of[expert as usize] = Some(home);
    Ok(home)
}
