//! The rules a relay [`TransferSchedule`] must follow against its [`Plan`], checked in one place
//! for every executor of a replica stream: this crate's copy engines and the engine's fabrics
//! (in-process, MPI, NCCL), which hold some of the ranks only.
//!
//! Checked before any byte moves: ranks, experts and byte ranges in bounds; every stage-1 copy
//! sent by the expert's home and waiting on nothing, every stage-2 copy waiting on its relay and
//! reading exactly the bytes an earlier copy delivered to it; every destination a slot that holds
//! the expert, each chunk delivered once, the writes into one slot pairwise disjoint and covering
//! the whole expert; the slot buffers of the ranks the caller holds long enough for their slots.

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use rackfill_balancer::relay::{Transfer, TransferSchedule};
use rackfill_balancer::Plan;

use super::outcome::TransferFault;
use crate::KernelError;

/// What a schedule is checked against besides the plan: the sizes of an expert and of a slot,
/// and the slot buffers of the ranks the caller holds.
#[derive(Debug, Clone, Copy)]
pub struct SlotBuffers<'a> {
    /// Bytes of one expert's weights.
    pub expert_bytes: usize,
    /// Bytes of one redundant slot: slot `s` of a rank starts at `s * slot_bytes`.
    pub slot_bytes: usize,
    /// The first rank the caller holds (0 when it holds every rank).
    pub first_rank: usize,
    /// `lens[i]`: the slot-buffer length of rank `first_rank + i`.
    pub lens: &'a [usize],
}

/// Where one transfer of a checked schedule reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferPlace {
    /// Stage 2: the byte position in the sender's (the relay's) slot buffer that it forwards;
    /// `None` for stage 1, which reads the home weights at the transfer's `offset`.
    pub from_slot: Option<usize>,
    /// The byte position in the receiver's slot buffer where the bytes land.
    pub to_slot: usize,
    /// Stage 2: the index of the earlier transfer that delivered those bytes to the relay.
    pub forwards: Option<usize>,
}

/// Checks `schedule` against `plan` and `buffers` and resolves every transfer's byte positions
/// (one [`TransferPlace`] per transfer, in schedule order). Only the slot buffers the caller
/// holds are measured; everything else depends on the plan and schedule alone, so every holder
/// of a part of the ranks reaches the same verdict on it.
pub fn check_schedule(
    plan: &Plan,
    schedule: &TransferSchedule,
    buffers: SlotBuffers<'_>,
) -> Result<Vec<TransferPlace>, KernelError> {
    let SlotBuffers {
        expert_bytes,
        slot_bytes,
        first_rank,
        lens,
    } = buffers;
    if first_rank
        .checked_add(lens.len())
        .is_none_or(|end| end > plan.ranks())
    {
        return Err(KernelError::RankRange {
            first: first_rank,
            count: lens.len(),
            ranks: plan.ranks(),
        });
    }
    if slot_bytes < expert_bytes {
        return Err(KernelError::SlotTooSmall {
            slot_bytes,
            expert_bytes,
        });
    }
    let needed = plan
        .slots_per_rank()
        .checked_mul(slot_bytes)
        .ok_or(KernelError::Overflow {
            what: "n_slot * slot_bytes",
        })?;
    if let Some((i, &len)) = lens.iter().enumerate().find(|(_, &len)| len < needed) {
        return Err(KernelError::SlotBufferTooShort {
            rank: first_rank + i,
            len,
            needed,
        });
    }
    let mut checker = Checker {
        plan,
        expert_bytes,
        slot_bytes,
        delivered: HashMap::new(),
        writes: Vec::with_capacity(schedule.transfers.len()),
        places: Vec::with_capacity(schedule.transfers.len()),
    };
    for (index, transfer) in schedule.transfers.iter().enumerate() {
        checker
            .add(index, transfer)
            .map_err(|fault| KernelError::Transfer { index, fault })?;
    }
    check_slot_coverage(plan, &mut checker.writes, expert_bytes as u64)?;
    Ok(checker.places)
}

/// One copy's byte range in a destination slot (`index`: the copy's position in the schedule).
pub(crate) struct SlotWrite {
    pub rank: usize,
    pub slot: usize,
    pub start: u64,
    pub end: u64,
    pub index: usize,
}

/// Checks that the writes into each slot are disjoint and that every slot the plan fills is
/// covered exactly (`expert_bytes` bytes): the last step of checking a replica schedule, for
/// [`check_schedule`] and for the GPU tile compiler alike.
pub(crate) fn check_slot_coverage(
    plan: &Plan,
    writes: &mut [SlotWrite],
    expert_bytes: u64,
) -> Result<(), KernelError> {
    let n_slot = plan.slots_per_rank();
    let mut covered = vec![0u64; plan.ranks() * n_slot];
    writes.sort_unstable_by_key(|w| (w.rank, w.slot, w.start, w.end, w.index));
    let mut last: Option<&SlotWrite> = None;
    for w in writes.iter().filter(|w| w.end > w.start) {
        if let Some(prev) = last {
            if (prev.rank, prev.slot) == (w.rank, w.slot) && prev.end > w.start {
                return Err(KernelError::Transfer {
                    index: w.index.max(prev.index),
                    fault: TransferFault::Overlap { dst: w.rank as u32 },
                });
            }
        }
        covered[w.rank * n_slot + w.slot] += w.end - w.start;
        last = Some(w);
    }
    for (i, (slot, &bytes)) in plan.slots().iter().zip(&covered).enumerate() {
        if let Some(expert) = *slot {
            if bytes != expert_bytes {
                return Err(KernelError::IncompleteReplica {
                    rank: i / n_slot.max(1),
                    expert,
                    covered: bytes,
                    expected: expert_bytes,
                });
            }
        }
    }
    Ok(())
}

/// The bytes of one (rank, expert, chunk) an accepted transfer delivers.
struct Delivery {
    transfer: usize,
    offset: usize,
    len: usize,
}

struct Checker<'p> {
    plan: &'p Plan,
    expert_bytes: usize,
    slot_bytes: usize,
    /// (rank, expert, chunk) -> the transfer that delivers it.
    delivered: HashMap<(u32, u32, u32), Delivery>,
    writes: Vec<SlotWrite>,
    places: Vec<TransferPlace>,
}

impl Checker<'_> {
    /// Checks transfer `index` against everything accepted before it and records its place.
    fn add(&mut self, index: usize, t: &Transfer) -> Result<(), TransferFault> {
        for rank in [t.src, t.dst] {
            if rank as usize >= self.plan.ranks() {
                return Err(TransferFault::Rank { rank });
            }
        }
        let expert = t.expert;
        let known = (expert as usize) < self.plan.experts();
        let home = match known.then(|| self.plan.instances(expert as usize).first()) {
            Some(Some(main)) => main.rank,
            _ => return Err(TransferFault::Expert { expert }),
        };
        let (offset, len) = self.byte_range(t).ok_or(TransferFault::Range {
            offset: t.offset,
            len: t.len,
            expert_bytes: self.expert_bytes,
        })?;
        let dst_slot = self.slot_of(t.dst, expert).ok_or(TransferFault::NoSlot {
            rank: t.dst,
            expert,
        })?;
        let (from_slot, forwards) = match t.stage {
            1 => {
                if t.src != home {
                    return Err(TransferFault::NotFromHome { src: t.src, home });
                }
                check_wait(t, None)?;
                (None, None)
            }
            2 => {
                check_wait(t, Some(t.src))?;
                let not_relayed = TransferFault::NotRelayed {
                    src: t.src,
                    chunk: t.chunk,
                };
                let producer = match self.delivered.get(&(t.src, expert, t.chunk)) {
                    Some(d) if d.offset == offset && d.len == len => d.transfer,
                    _ => return Err(not_relayed),
                };
                let src_slot = self.slot_of(t.src, expert).ok_or(not_relayed)?;
                (Some(src_slot * self.slot_bytes + offset), Some(producer))
            }
            stage => return Err(TransferFault::Stage { stage }),
        };
        match self.delivered.entry((t.dst, expert, t.chunk)) {
            Entry::Occupied(_) => {
                return Err(TransferFault::Duplicate {
                    dst: t.dst,
                    chunk: t.chunk,
                })
            }
            Entry::Vacant(v) => {
                v.insert(Delivery {
                    transfer: index,
                    offset,
                    len,
                });
            }
        }
        self.writes.push(SlotWrite {
            rank: t.dst as usize,
            slot: dst_slot,
            start: offset as u64,
            end: (offset + len) as u64,
            index,
        });
        self.places.push(TransferPlace {
            from_slot,
            to_slot: dst_slot * self.slot_bytes + offset,
            forwards,
        });
        Ok(())
    }

    /// `(offset, len)` as `usize` when `offset + len` lies within the expert.
    fn byte_range(&self, t: &Transfer) -> Option<(usize, usize)> {
        let offset = usize::try_from(t.offset).ok()?;
        let len = usize::try_from(t.len).ok()?;
        (offset.checked_add(len)? <= self.expert_bytes).then_some((offset, len))
    }

    /// Slot index of `expert` on `rank`, if the plan puts it there.
    fn slot_of(&self, rank: u32, expert: u32) -> Option<usize> {
        self.plan
            .rank_slots(rank as usize)
            .iter()
            .position(|s| *s == Some(expert))
    }
}

/// Stage 1 must not wait; stage 2 must wait on its source (the relay), as the schedule says.
fn check_wait(t: &Transfer, expected: Option<u32>) -> Result<(), TransferFault> {
    if t.wait_for_chunk_on == expected {
        Ok(())
    } else {
        Err(TransferFault::Wait {
            wait: t.wait_for_chunk_on,
            stage: t.stage,
            src: t.src,
            expected,
        })
    }
}
