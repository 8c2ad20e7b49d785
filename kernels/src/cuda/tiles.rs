//! Compiles a relay [`TransferSchedule`] into the device task stream of the tile-streaming kernel
//! (`kernels/cuda/replicate.cu`, UltraEP §6.1).
//!
//! Consecutive transfers that copy the same bytes of one chunk from the same source (a home's
//! direct fan-out, or a relay's forwards) form one group: the source bytes are read and staged
//! once and stored to every destination of the group. Each group is cut into tiles of
//! `tile_bytes`; every tile is one [`TileTask`]. A destination that later forwards the chunk (a
//! relay) gets a per-(rank, expert, chunk) ready counter, bumped once per landed tile; the
//! forwarding tasks wait until it equals the chunk's tile count.
//!
//! The schedule is validated in full first with the checks of the CPU executor
//! ([`crate::replicate`]): ranks, experts and byte ranges in bounds, stage-1 copies from the home,
//! stage-2 copies out of a relay that received exactly those bytes in an earlier copy, every
//! destination a slot holding the expert, each slot written once per byte and completely. A task
//! stream that compiles can only write inside the slots the plan names.

use super::CudaError;
use crate::replicate::{check_slot_coverage, SlotWrite, TransferFault};
use crate::KernelError;
use rackfill_balancer::relay::{Transfer, TransferSchedule};
use rackfill_balancer::Plan;
use std::collections::HashMap;

/// Default tile: 16 KiB, double-buffered in 32 KiB of shared memory per block.
pub const DEFAULT_TILE_BYTES: u32 = 16 * 1024;

/// [`TileTask::src_kind`]: the source is the rank's home (main expert) weights.
pub const SRC_HOME: u32 = 0;
/// [`TileTask::src_kind`]: the source is the rank's redundant-slot buffer (a relay).
pub const SRC_SLOT: u32 = 1;

/// One tile of one group; field for field the `TileTask` struct of `replicate.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TileTask {
    /// Byte offset of the tile in the source buffer.
    pub src_offset: u64,
    /// Byte offset of the tile inside its chunk, added to every destination's offset.
    pub tile_offset: u64,
    pub src_rank: u32,
    /// [`SRC_HOME`] or [`SRC_SLOT`].
    pub src_kind: u32,
    pub len: u32,
    /// The group's destinations are `dsts[dst_begin..dst_begin + n_dst]`.
    pub dst_begin: u32,
    pub n_dst: u32,
    /// Ready counter on `src_rank` to wait for (-1: none).
    pub wait_flag: i32,
    /// Value the counter reaches once the chunk has landed (its tile count).
    pub wait_target: u32,
    pub reserved: u32,
}

/// One destination of a group; field for field the `TileDst` struct of `replicate.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TileDst {
    /// Byte offset of the chunk in the destination rank's slot buffer.
    pub offset: u64,
    pub rank: u32,
    /// Ready counter on `rank` to bump after each tile lands (-1: none).
    pub ready_flag: i32,
}

/// Where every byte of a replica distribution comes from and goes to, as device tasks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TileStream {
    /// In stream order: every producer tile precedes the tasks that wait for it.
    pub tasks: Vec<TileTask>,
    pub dsts: Vec<TileDst>,
    /// Ready counters each rank needs (its flag buffer holds at least this many `u32`).
    pub flags_per_rank: Vec<u32>,
    pub tile_bytes: u32,
    /// Bytes stored in total (each tile once per destination).
    pub stored_bytes: u64,
}

impl TileStream {
    /// Checks what the tile-streaming kernel assumes of any stream it runs, compiled here,
    /// downloaded or built by hand: ranks, destinations and ready counters in range, tiles no
    /// longer than `tile_bytes` (a positive multiple of 16, so both halves of the double buffer
    /// stay 16-byte aligned), and every wait met by producer tiles earlier in the stream (what
    /// the kernel's freedom from deadlock rests on).
    pub fn check_runnable(&self, ranks: usize) -> Result<(), CudaError> {
        let fault = |task: usize, reason: String| CudaError::UnrunnableTask { task, reason };
        if self.flags_per_rank.len() != ranks {
            return Err(KernelError::RankCount {
                got: self.flags_per_rank.len(),
                ranks,
            }
            .into());
        }
        let tile = self.tile_bytes;
        if tile == 0 || !tile.is_multiple_of(16) {
            return Err(fault(
                0,
                format!("tile_bytes {tile} is not a positive multiple of 16"),
            ));
        }
        let counter = |rank: u32, flag: i32| -> Result<Option<(u32, u32)>, String> {
            let Ok(flag) = u32::try_from(flag) else {
                return Ok(None);
            };
            match self.flags_per_rank.get(rank as usize) {
                Some(&n) if flag < n => Ok(Some((rank, flag))),
                Some(&n) => Err(format!(
                    "rank {rank} has {n} ready counters, not {}",
                    flag + 1
                )),
                None => Err(format!("rank {rank} is out of range ({ranks} ranks)")),
            }
        };
        // Bumps each (rank, counter) gets from the tasks so far.
        let mut landed: HashMap<(u32, u32), u64> = HashMap::new();
        for (i, t) in self.tasks.iter().enumerate() {
            if t.src_rank as usize >= ranks || t.src_kind > SRC_SLOT {
                return Err(fault(
                    i,
                    format!("source rank {} kind {}", t.src_rank, t.src_kind),
                ));
            }
            if t.len > tile {
                return Err(fault(
                    i,
                    format!("{} bytes exceed the {tile}-byte tile", t.len),
                ));
            }
            let end = t.dst_begin as usize + t.n_dst as usize;
            let Some(dsts) = self.dsts.get(t.dst_begin as usize..end) else {
                return Err(fault(
                    i,
                    format!("destinations end at {end}, past {}", self.dsts.len()),
                ));
            };
            if let Some(key) = counter(t.src_rank, t.wait_flag).map_err(|r| fault(i, r))? {
                let have = landed.get(&key).copied().unwrap_or(0);
                if have < u64::from(t.wait_target) {
                    return Err(fault(
                        i,
                        format!(
                            "waits for counter {} of rank {} to reach {}; earlier tasks bump it \
                             {have} times",
                            key.1, key.0, t.wait_target
                        ),
                    ));
                }
            }
            for d in dsts {
                if d.rank as usize >= ranks {
                    return Err(fault(
                        i,
                        format!("destination rank {} is out of range", d.rank),
                    ));
                }
                if let Some(key) = counter(d.rank, d.ready_flag).map_err(|r| fault(i, r))? {
                    *landed.entry(key).or_insert(0) += 1;
                }
            }
        }
        Ok(())
    }
}

/// How ranks' buffers are addressed: the home weights of expert `e` start at `home_offsets[e]`
/// in its home rank's weight buffer; slot `s` of a rank starts at `s * slot_bytes` in its slot
/// buffer.
#[derive(Debug, Clone, Copy)]
pub struct BufferLayout<'a> {
    pub expert_bytes: u64,
    pub home_offsets: &'a [u64],
    pub slot_bytes: u64,
}

/// A group of transfers before tiling: the same source bytes to several destinations.
struct Group {
    src_rank: u32,
    src_kind: u32,
    src_offset: u64,
    len: u64,
    /// (dst rank, byte offset of the chunk in its slot buffer, (rank, expert, chunk) key).
    dsts: Vec<(u32, u64, (u32, u32, u32))>,
    /// For a relay's forwards: the (relay, expert, chunk) it waits on.
    waits_on: Option<(u32, u32, u32)>,
}

/// Compiles `schedule` (for `plan`) into tile tasks.
pub fn compile(
    plan: &Plan,
    schedule: &TransferSchedule,
    buffers: &BufferLayout<'_>,
    tile_bytes: u32,
) -> Result<TileStream, KernelError> {
    if tile_bytes == 0 || !tile_bytes.is_multiple_of(16) {
        return Err(KernelError::OutOfRange {
            what: "tile_bytes (a positive multiple of 16)",
            value: u64::from(tile_bytes),
            limit: u64::from(u32::MAX),
        });
    }
    if buffers.slot_bytes < buffers.expert_bytes {
        return Err(KernelError::SlotTooSmall {
            slot_bytes: buffers.slot_bytes as usize,
            expert_bytes: buffers.expert_bytes as usize,
        });
    }
    if buffers.home_offsets.len() != plan.experts() {
        return Err(KernelError::Length {
            what: "home_offsets",
            len: buffers.home_offsets.len(),
            expected: plan.experts(),
        });
    }
    let mut checker = Checker::new(plan, buffers);
    let mut groups: Vec<Group> = Vec::new();
    let mut last_key = None;
    for (index, t) in schedule.transfers.iter().enumerate() {
        let (src_kind, src_offset, dst_offset, waits_on) = checker
            .check(t)
            .map_err(|fault| KernelError::Transfer { index, fault })?;
        let key = (t.stage, t.expert, t.chunk, t.src, t.offset, t.len);
        let dst = (t.dst, dst_offset, (t.dst, t.expert, t.chunk));
        match groups.last_mut() {
            Some(g) if last_key == Some(key) => g.dsts.push(dst),
            _ => groups.push(Group {
                src_rank: t.src,
                src_kind,
                src_offset,
                len: t.len,
                dsts: vec![dst],
                waits_on,
            }),
        }
        last_key = Some(key);
    }
    checker.check_coverage()?;
    tile(plan.ranks(), &groups, tile_bytes)
}

/// Cuts groups into tiles and wires the relay counters.
fn tile(ranks: usize, groups: &[Group], tile_bytes: u32) -> Result<TileStream, KernelError> {
    let overflow = |what| KernelError::Overflow { what };
    let tb = u64::from(tile_bytes);
    // Counters for every (relay, expert, chunk) some group forwards from.
    let mut flags_per_rank = vec![0u32; ranks];
    let mut flag_of: HashMap<(u32, u32, u32), (i32, u32)> = HashMap::new();
    for g in groups {
        if let Some(key) = g.waits_on {
            if let std::collections::hash_map::Entry::Vacant(slot) = flag_of.entry(key) {
                let counter = &mut flags_per_rank[key.0 as usize];
                let index = i32::try_from(*counter).map_err(|_| overflow("ready flags"))?;
                *counter += 1;
                let tiles = u32::try_from(g.len.div_ceil(tb)).map_err(|_| overflow("tiles"))?;
                slot.insert((index, tiles));
            }
        }
    }
    let mut out = TileStream {
        flags_per_rank,
        tile_bytes,
        ..TileStream::default()
    };
    for g in groups {
        let dst_begin = u32::try_from(out.dsts.len()).map_err(|_| overflow("destinations"))?;
        out.dsts
            .extend(g.dsts.iter().map(|&(rank, offset, key)| TileDst {
                offset,
                rank,
                ready_flag: flag_of.get(&key).map_or(-1, |&(flag, _)| flag),
            }));
        let n_dst = u32::try_from(g.dsts.len()).map_err(|_| overflow("destinations"))?;
        let (wait_flag, wait_target) = g
            .waits_on
            .and_then(|key| flag_of.get(&key).copied())
            .unwrap_or((-1, 0));
        let mut at = 0;
        while at < g.len {
            let len = (g.len - at).min(tb) as u32;
            out.tasks.push(TileTask {
                src_offset: g.src_offset + at,
                tile_offset: at,
                src_rank: g.src_rank,
                src_kind: g.src_kind,
                len,
                dst_begin,
                n_dst,
                wait_flag,
                wait_target,
                reserved: 0,
            });
            out.stored_bytes = out
                .stored_bytes
                .saturating_add(u64::from(len) * u64::from(n_dst));
            at += u64::from(len);
        }
    }
    u32::try_from(out.tasks.len()).map_err(|_| overflow("tile tasks"))?;
    Ok(out)
}

/// The schedule checks of the CPU executor, resolved into buffer offsets.
struct Checker<'a> {
    plan: &'a Plan,
    buffers: &'a BufferLayout<'a>,
    /// (rank, expert, chunk) -> (offset, len) delivered there by an earlier transfer.
    delivered: HashMap<(u32, u32, u32), (u64, u64)>,
    writes: Vec<SlotWrite>,
}

impl<'a> Checker<'a> {
    fn new(plan: &'a Plan, buffers: &'a BufferLayout<'a>) -> Self {
        Self {
            plan,
            buffers,
            delivered: HashMap::new(),
            writes: Vec::new(),
        }
    }

    fn slot_of(&self, rank: u32, expert: u32) -> Option<usize> {
        self.plan
            .rank_slots(rank as usize)
            .iter()
            .position(|s| *s == Some(expert))
    }

    /// Checks one transfer against everything before it; returns the source kind and offset,
    /// the destination chunk offset, and the relay chunk it waits on.
    #[allow(clippy::type_complexity)]
    fn check(
        &mut self,
        t: &Transfer,
    ) -> Result<(u32, u64, u64, Option<(u32, u32, u32)>), TransferFault> {
        for rank in [t.src, t.dst] {
            if rank as usize >= self.plan.ranks() {
                return Err(TransferFault::Rank { rank });
            }
        }
        if t.expert as usize >= self.plan.experts() {
            return Err(TransferFault::Expert { expert: t.expert });
        }
        let range_fault = TransferFault::Range {
            offset: t.offset,
            len: t.len,
            expert_bytes: self.buffers.expert_bytes as usize,
        };
        let end = t.offset.checked_add(t.len).ok_or(range_fault.clone())?;
        if end > self.buffers.expert_bytes {
            return Err(range_fault);
        }
        let home = self.plan.instances(t.expert as usize)[0].rank;
        let dst_slot = self.slot_of(t.dst, t.expert).ok_or(TransferFault::NoSlot {
            rank: t.dst,
            expert: t.expert,
        })?;
        let expected_wait = match t.stage {
            1 => None,
            2 => Some(t.src),
            stage => return Err(TransferFault::Stage { stage }),
        };
        if t.wait_for_chunk_on != expected_wait {
            return Err(TransferFault::Wait {
                wait: t.wait_for_chunk_on,
                stage: t.stage,
                src: t.src,
                expected: expected_wait,
            });
        }
        let slot_bytes = self.buffers.slot_bytes;
        let (kind, src_offset, waits_on) = if t.stage == 1 {
            if t.src != home {
                return Err(TransferFault::NotFromHome { src: t.src, home });
            }
            let base = self.buffers.home_offsets[t.expert as usize];
            let at = base.checked_add(t.offset).ok_or(range_fault)?;
            (SRC_HOME, at, None)
        } else {
            let key = (t.src, t.expert, t.chunk);
            let not_relayed = TransferFault::NotRelayed {
                src: t.src,
                chunk: t.chunk,
            };
            if self.delivered.get(&key) != Some(&(t.offset, t.len)) {
                return Err(not_relayed);
            }
            let slot = self.slot_of(t.src, t.expert).ok_or(not_relayed)?;
            (SRC_SLOT, slot as u64 * slot_bytes + t.offset, Some(key))
        };
        if self
            .delivered
            .insert((t.dst, t.expert, t.chunk), (t.offset, t.len))
            .is_some()
        {
            return Err(TransferFault::Duplicate {
                dst: t.dst,
                chunk: t.chunk,
            });
        }
        self.writes.push(SlotWrite {
            rank: t.dst as usize,
            slot: dst_slot,
            start: t.offset,
            end,
            index: self.writes.len(),
        });
        Ok((
            kind,
            src_offset,
            dst_slot as u64 * slot_bytes + t.offset,
            waits_on,
        ))
    }

    /// Every slot's writes are disjoint and cover its expert exactly.
    fn check_coverage(mut self) -> Result<(), KernelError> {
        check_slot_coverage(self.plan, &mut self.writes, self.buffers.expert_bytes)
    }
}
