//! Turns a [`TransferSchedule`] into validated chunk copies with resolved byte positions.
//!
//! Everything the copy loops (and the concurrent path's `unsafe`) rely on is checked here, once,
//! before any byte moves: ranks, experts and byte ranges in bounds; every destination is a slot
//! that holds the expert; destination ranges of one slot pairwise disjoint and covering the whole
//! expert; every stage-2 copy reads exactly the bytes an earlier copy delivered to its source.

use super::outcome::{ReplicationStats, TransferFault};
use crate::KernelError;
use rackfill_balancer::relay::{Transfer, TransferSchedule};
use rackfill_balancer::Plan;
use std::collections::hash_map::Entry;
use std::collections::HashMap;

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

/// Validates the schedule against the plan and the buffers (`lens[r]` is rank `r`'s slot buffer
/// length) and resolves every transfer into a [`ChunkCopy`].
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
    if let Some((rank, &len)) = lens.iter().enumerate().find(|(_, &len)| len < needed) {
        return Err(KernelError::SlotBufferTooShort { rank, len, needed });
    }
    let mut builder = Builder {
        plan,
        expert_bytes,
        slot_bytes,
        source,
        home_of: vec![None; plan.experts()],
        homes: Vec::new(),
        delivered: HashMap::new(),
        writes: Vec::with_capacity(schedule.transfers.len()),
        copies: Vec::with_capacity(schedule.transfers.len()),
        flags: 0,
        stats: ReplicationStats {
            sent_bytes: vec![0; ranks],
            received_bytes: vec![0; ranks],
            ..ReplicationStats::default()
        },
    };
    for (index, transfer) in schedule.transfers.iter().enumerate() {
        builder.add(index, transfer)?;
    }
    builder.finish()
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
/// covered exactly (`expert_bytes` bytes): the last step of validating a replica schedule, for
/// the CPU executor and for the GPU tile compiler alike.
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

/// The bytes of one (rank, expert, chunk) an accepted copy delivers.
struct Delivery {
    copy: usize,
    offset: usize,
    len: usize,
}

struct Builder<'p, 'w> {
    plan: &'p Plan,
    expert_bytes: usize,
    slot_bytes: usize,
    source: &'p dyn Fn(u32) -> Vec<&'w [u8]>,
    /// Per expert: its index in `homes` once loaded.
    home_of: Vec<Option<usize>>,
    homes: Vec<Vec<&'w [u8]>>,
    /// (rank, expert, chunk) -> the copy that delivers it.
    delivered: HashMap<(u32, u32, u32), Delivery>,
    writes: Vec<SlotWrite>,
    copies: Vec<ChunkCopy>,
    flags: usize,
    stats: ReplicationStats,
}

impl<'w> Builder<'_, 'w> {
    /// Validates transfer `index` against everything accepted before it and records its copy.
    fn add(&mut self, index: usize, t: &Transfer) -> Result<(), KernelError> {
        let fault = |fault| KernelError::Transfer { index, fault };
        for rank in [t.src, t.dst] {
            if rank as usize >= self.plan.ranks() {
                return Err(fault(TransferFault::Rank { rank }));
            }
        }
        let expert = t.expert;
        let known = (expert as usize) < self.plan.experts();
        let home = match known.then(|| self.plan.instances(expert as usize).first()) {
            Some(Some(main)) => main.rank,
            _ => return Err(fault(TransferFault::Expert { expert })),
        };
        let (offset, len) = self
            .byte_range(t)
            .ok_or_else(|| fault(self.range_fault(t)))?;
        let dst_slot = self.slot_of(t.dst, expert).ok_or_else(|| {
            fault(TransferFault::NoSlot {
                rank: t.dst,
                expert,
            })
        })?;
        let (from, wait) = match t.stage {
            1 => {
                if t.src != home {
                    return Err(fault(TransferFault::NotFromHome { src: t.src, home }));
                }
                self.check_wait(t, None).map_err(fault)?;
                let home = self.load_home(expert)?;
                (CopySource::Home { home, offset }, None)
            }
            2 => {
                self.check_wait(t, Some(t.src)).map_err(fault)?;
                let not_relayed = TransferFault::NotRelayed {
                    src: t.src,
                    chunk: t.chunk,
                };
                let producer = match self.delivered.get(&(t.src, expert, t.chunk)) {
                    Some(d) if d.offset == offset && d.len == len => d.copy,
                    _ => return Err(fault(not_relayed)),
                };
                let src_slot = self.slot_of(t.src, expert).ok_or(fault(not_relayed))?;
                let flag = self.ready_flag(producer);
                let at = src_slot * self.slot_bytes + offset;
                let from = CopySource::Relay {
                    rank: t.src as usize,
                    at,
                };
                (from, Some(flag))
            }
            stage => return Err(fault(TransferFault::Stage { stage })),
        };
        match self.delivered.entry((t.dst, expert, t.chunk)) {
            Entry::Occupied(_) => {
                return Err(fault(TransferFault::Duplicate {
                    dst: t.dst,
                    chunk: t.chunk,
                }))
            }
            Entry::Vacant(v) => {
                v.insert(Delivery {
                    copy: self.copies.len(),
                    offset,
                    len,
                });
            }
        }
        let dst_rank = t.dst as usize;
        self.writes.push(SlotWrite {
            rank: dst_rank,
            slot: dst_slot,
            start: offset as u64,
            end: (offset + len) as u64,
            index,
        });
        let sent = &mut self.stats.sent_bytes[t.src as usize];
        *sent = sent.saturating_add(t.len);
        let received = &mut self.stats.received_bytes[dst_rank];
        *received = received.saturating_add(t.len);
        self.stats.transfers += 1;
        if t.stage == 1 {
            self.stats.stage1_copies += 1;
        } else {
            self.stats.stage2_copies += 1;
        }
        self.copies.push(ChunkCopy {
            sender: t.src as usize,
            from,
            dst_rank,
            dst_at: dst_slot * self.slot_bytes + offset,
            len,
            wait,
            ready: None,
        });
        Ok(())
    }

    /// `(offset, len)` as `usize` when `offset + len` lies within the expert.
    fn byte_range(&self, t: &Transfer) -> Option<(usize, usize)> {
        let offset = usize::try_from(t.offset).ok()?;
        let len = usize::try_from(t.len).ok()?;
        (offset.checked_add(len)? <= self.expert_bytes).then_some((offset, len))
    }

    fn range_fault(&self, t: &Transfer) -> TransferFault {
        TransferFault::Range {
            offset: t.offset,
            len: t.len,
            expert_bytes: self.expert_bytes,
        }
    }

    /// Slot index of `expert` on `rank`, if the plan puts it there.
    fn slot_of(&self, rank: u32, expert: u32) -> Option<usize> {
        self.plan
            .rank_slots(rank as usize)
            .iter()
            .position(|s| *s == Some(expert))
    }

    /// Stage 1 must not wait; stage 2 must wait on its source (the relay), as the schedule says.
    fn check_wait(&self, t: &Transfer, expected: Option<u32>) -> Result<(), TransferFault> {
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

    /// Index of `expert`'s source segments in `homes`, loading and size-checking them once.
    fn load_home(&mut self, expert: u32) -> Result<usize, KernelError> {
        if let Some(home) = self.home_of[expert as usize] {
            return Ok(home);
        }
        let segments = (self.source)(expert);
        let len = segments
            .iter()
            .try_fold(0usize, |acc, s| acc.checked_add(s.len()))
            .ok_or(KernelError::Overflow {
                what: "source segment lengths",
            })?;
        if len != self.expert_bytes {
            return Err(KernelError::SourceSize {
                expert,
                len,
                expected: self.expert_bytes,
            });
        }
        let home = self.homes.len();
        self.homes.push(segments);
        self.home_of[expert as usize] = Some(home);
        Ok(home)
    }

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

    /// Checks that the copies into each slot are disjoint and cover the whole expert.
    fn finish(mut self) -> Result<Copies<'w>, KernelError> {
        check_slot_coverage(self.plan, &mut self.writes, self.expert_bytes as u64)?;
        Ok(Copies {
            homes: self.homes,
            copies: self.copies,
            flags: self.flags,
            ranks: self.plan.ranks(),
            stats: self.stats,
        })
    }
}
