//! Executes validated copies: concurrently, one worker per sending rank, or sequentially.

use super::copies::{ChunkCopy, Copies, CopySource};
use crate::KernelError;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;

/// Busy-wait iterations before a waiting relay starts yielding its core. A chunk normally lands
/// within microseconds, so a short spin avoids a scheduler round trip; yielding after that keeps
/// an oversubscribed machine (more senders than cores) making progress.
const SPINS_BEFORE_YIELD: u32 = 256;

/// Runs every copy on a scoped worker thread per sending rank, each in schedule order.
///
/// Returns [`KernelError::Spawn`] if a worker cannot be started; the workers already running are
/// released (they stop waiting) and the slot contents are then unspecified.
pub(super) fn run_concurrent(
    copies: &Copies<'_>,
    slots: &mut [&mut [u8]],
) -> Result<(), KernelError> {
    let mut per_sender: Vec<Vec<&ChunkCopy>> = vec![Vec::new(); copies.ranks];
    for copy in &copies.copies {
        per_sender[copy.sender].push(copy);
    }
    let flags: Vec<AtomicBool> = (0..copies.flags).map(|_| AtomicBool::new(false)).collect();
    let abort = AtomicBool::new(false);
    let arena = SlotArena::new(slots);
    let worker = Worker {
        homes: &copies.homes,
        arena: &arena,
        flags: &flags,
        abort: &abort,
    };
    thread::scope(|scope| {
        for (rank, list) in per_sender.iter().enumerate() {
            if list.is_empty() {
                continue;
            }
            let spawned = thread::Builder::new()
                .name(format!("replicate-{rank}"))
                .spawn_scoped(scope, move || worker.run(list));
            if let Err(err) = spawned {
                // Started workers may wait on flags only this sender would set: release them.
                abort.store(true, Ordering::Release);
                return Err(KernelError::Spawn(err.to_string()));
            }
        }
        Ok(())
    })
}

/// Runs the copies one by one in schedule order with safe slice copies.
pub(super) fn run_sequential(copies: &Copies<'_>, slots: &mut [&mut [u8]]) {
    for copy in &copies.copies {
        match copy.from {
            CopySource::Home { home, offset } => {
                let dst = &mut slots[copy.dst_rank][copy.dst_at..copy.dst_at + copy.len];
                for_each_piece(&copies.homes[home], offset, copy.len, |at, piece| {
                    dst[at..at + piece.len()].copy_from_slice(piece);
                });
            }
            CopySource::Relay { rank, at } => {
                copy_between(slots, rank, at, copy.dst_rank, copy.dst_at, copy.len);
            }
        }
    }
}

/// Copies `len` bytes from `slots[src]` at `src_at` to `slots[dst]` at `dst_at`.
fn copy_between(
    slots: &mut [&mut [u8]],
    src: usize,
    src_at: usize,
    dst: usize,
    dst_at: usize,
    len: usize,
) {
    let src_range = src_at..src_at + len;
    let dst_range = dst_at..dst_at + len;
    if src == dst {
        slots[src].copy_within(src_range, dst_at);
    } else if src < dst {
        let (low, high) = slots.split_at_mut(dst);
        high[0][dst_range].copy_from_slice(&low[src][src_range]);
    } else {
        let (low, high) = slots.split_at_mut(src);
        low[dst][dst_range].copy_from_slice(&high[0][src_range]);
    }
}

/// Calls `f(position in the range, piece)` for the parts of the concatenated `segments` that
/// cover bytes `offset..offset + len`, in order.
fn for_each_piece(segments: &[&[u8]], offset: usize, len: usize, mut f: impl FnMut(usize, &[u8])) {
    let end = offset + len;
    let mut seg_start = 0;
    for segment in segments {
        let seg_end = seg_start + segment.len();
        let lo = offset.max(seg_start);
        let hi = end.min(seg_end);
        if lo < hi {
            f(lo - offset, &segment[lo - seg_start..hi - seg_start]);
        }
        if seg_end >= end {
            break;
        }
        seg_start = seg_end;
    }
}

/// What every worker shares: the home weights, the slot buffers, the ready flags.
#[derive(Clone, Copy)]
struct Worker<'a, 'w, 's> {
    homes: &'a [Vec<&'w [u8]>],
    arena: &'a SlotArena<'s>,
    flags: &'a [AtomicBool],
    abort: &'a AtomicBool,
}

impl Worker<'_, '_, '_> {
    /// Executes one sender's copies in schedule order; returns early only on abort.
    fn run(self, list: &[&ChunkCopy]) {
        for copy in list {
            if let Some(flag) = copy.wait {
                if !self.wait(&self.flags[flag]) {
                    return;
                }
            }
            match copy.from {
                CopySource::Home { home, offset } => {
                    for_each_piece(&self.homes[home], offset, copy.len, |at, piece| {
                        // SAFETY: validation put `dst_at..dst_at + len` inside the destination
                        // slot and made it disjoint from every other copy's destination, so no
                        // other thread touches these bytes; `piece` is borrowed source memory that
                        // cannot alias the exclusively borrowed slot buffers.
                        unsafe { self.arena.write(copy.dst_rank, copy.dst_at + at, piece) }
                    });
                }
                CopySource::Relay { rank, at } => {
                    // SAFETY: both ranges were validated in bounds. The source bytes are exactly
                    // those an earlier copy delivered to the relay; it set `copy.wait` with
                    // Release after writing them and we observed it with Acquire, and no copy
                    // writes them again (destinations are disjoint). The destination is written by
                    // this copy only, and differs from the source range for the same reason.
                    unsafe {
                        self.arena
                            .copy(rank, at, copy.dst_rank, copy.dst_at, copy.len)
                    }
                }
            }
            if let Some(flag) = copy.ready {
                self.flags[flag].store(true, Ordering::Release);
            }
        }
    }

    /// Spins, then yields, until `flag` is set (true) or the run is aborted (false).
    fn wait(&self, flag: &AtomicBool) -> bool {
        let mut spins = 0;
        loop {
            if flag.load(Ordering::Acquire) {
                return true;
            }
            if self.abort.load(Ordering::Acquire) {
                return false;
            }
            if spins < SPINS_BEFORE_YIELD {
                spins += 1;
                std::hint::spin_loop();
            } else {
                thread::yield_now();
            }
        }
    }
}

/// Every rank's slot buffer as a raw pointer, shared by the workers.
///
/// Raw because workers write disjoint ranges of the same buffer at the same time (a relay's slot
/// receives chunk `c + 1` while chunk `c` is read out of it), which `&mut [u8]` cannot express.
/// The arena borrows the buffers mutably for `'s`, so nothing else can touch them meanwhile; the
/// only access is through the two `unsafe` methods, whose contracts validation establishes.
struct SlotArena<'s> {
    bufs: Vec<(*mut u8, usize)>,
    _borrow: PhantomData<&'s mut [u8]>,
}

// SAFETY: the arena is a set of pointers into buffers it exclusively borrows; sharing it between
// threads only allows the `unsafe` accesses below, whose callers guarantee race freedom.
unsafe impl Sync for SlotArena<'_> {}

impl<'s> SlotArena<'s> {
    fn new(slots: &'s mut [&mut [u8]]) -> Self {
        Self {
            bufs: slots
                .iter_mut()
                .map(|s| (s.as_mut_ptr(), s.len()))
                .collect(),
            _borrow: PhantomData,
        }
    }

    /// Writes `bytes` at byte `at` of rank `rank`'s buffer.
    ///
    /// # Safety
    /// `at + bytes.len()` is within the buffer, and no other thread reads or writes those bytes
    /// during the call.
    unsafe fn write(&self, rank: usize, at: usize, bytes: &[u8]) {
        let (base, len) = self.bufs[rank];
        debug_assert!(at + bytes.len() <= len);
        // SAFETY: in bounds and unshared per the contract; `bytes` is not part of any slot buffer
        // (those are exclusively borrowed by the arena), so the ranges do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), base.add(at), bytes.len()) }
    }

    /// Copies `len` bytes from `src_at` of rank `src`'s buffer to `dst_at` of rank `dst`'s.
    ///
    /// # Safety
    /// Both ranges are within their buffers and do not overlap; the source bytes were fully
    /// written and made visible to this thread (Release/Acquire) before the call and nobody writes
    /// them during it; nobody else reads or writes the destination bytes during the call.
    unsafe fn copy(&self, src: usize, src_at: usize, dst: usize, dst_at: usize, len: usize) {
        let (src_base, src_len) = self.bufs[src];
        let (dst_base, dst_len) = self.bufs[dst];
        debug_assert!(src_at + len <= src_len && dst_at + len <= dst_len);
        // SAFETY: in bounds, non-overlapping and race-free per the contract.
        unsafe { std::ptr::copy_nonoverlapping(src_base.add(src_at), dst_base.add(dst_at), len) }
    }
}
