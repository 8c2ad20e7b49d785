//! Launching the tile-streaming replica distribution (`kernels/cuda/replicate.cu`).
//!
//! Ranks are reached through a [`PeerTable`]: for every rank, the device addresses of its home
//! (main expert) weights, its redundant-slot buffer and its ready-counter array. With peer memory
//! those are other GPUs' buffers (unified addressing makes them plain pointers);
//! [`RankBuffers`] instead keeps every rank's buffers on one device, which runs the same kernel
//! over the same task stream: how the data plane runs ranks that share a device, and how it is
//! tested on the host emulator.
//!
//! `tile_stream` writes the slots and counters through the table's raw pointers: whatever reads
//! a slot after streaming (the expert GEMMs, [`RankBuffers::slot`] downloads) must be ordered
//! after the kernel, on the stream that streamed it or behind an event of that stream.

use super::exec::{DeviceBuffer, Executor, ExecutorExt, KernelArg, Launch, Stream};
pub use super::landed::LandedBytes;
use super::tiles::{TileDst, TileStream, TileTask};
use super::{to_u32, CudaError};
use std::ops::Range;
use std::sync::Arc;

/// Device pointers of every rank's buffers, indexed by rank, and the ranks whose buffers the
/// launching process holds (its launches run the tasks those ranks send).
pub struct PeerTable {
    home: DeviceBuffer,
    slots: DeviceBuffer,
    flags: DeviceBuffer,
    ranks: usize,
    sources: Range<usize>,
}

impl PeerTable {
    /// A table from raw device addresses (`home[r]`, `slots[r]`, `flags[r]` for rank `r`).
    ///
    /// # Safety
    /// Every address must stay valid, and be accessible from the launching device, for as long
    /// as kernels use the table; each buffer must be at least as large as the task streams
    /// launched with it address (the home weights up to the largest home offset plus
    /// `expert_bytes`, the slot buffer `n_slot * slot_bytes`, the flag array the stream's
    /// `flags_per_rank[r]` counters).
    pub unsafe fn from_raw(
        exec: &dyn Executor,
        home: &[u64],
        slots: &[u64],
        flags: &[u64],
    ) -> Result<Self, CudaError> {
        let ranks = home.len();
        if slots.len() != ranks || flags.len() != ranks || ranks == 0 {
            return Err(crate::KernelError::RankCount {
                got: slots.len().min(flags.len()),
                ranks,
            }
            .into());
        }
        Ok(Self {
            home: exec.upload_u64(home)?,
            slots: exec.upload_u64(slots)?,
            flags: exec.upload_u64(flags)?,
            ranks,
            sources: 0..ranks,
        })
    }

    /// The table with launches running only the tasks of source ranks `sources` (the ranks
    /// whose home weights and slots this process holds; the others' tasks run in theirs).
    pub fn with_sources(mut self, sources: Range<usize>) -> Self {
        self.sources = sources;
        self
    }

    /// Number of ranks in the table.
    pub fn ranks(&self) -> usize {
        self.ranks
    }
}

/// Every rank's home weights, slot buffer and ready counters on one device, with the peer tables
/// that address them (built once: the buffers are never reallocated). A slot buffer holds one
/// or several slot *sets* of `set_bytes` each (one per MoE layer when every layer keeps its own
/// replicas); a stream fills one set, addressed by that set's table.
pub struct RankBuffers {
    /// Shared with every [`Self::sharing_homes`] of these buffers.
    homes: Arc<[DeviceBuffer]>,
    slots: Vec<DeviceBuffer>,
    flags: Vec<DeviceBuffer>,
    set_bytes: usize,
    /// One per slot set, over every rank of the group.
    tables: Vec<PeerTable>,
    /// The world ranks these buffers belong to (all of the group's when one process holds
    /// them all).
    ranks: Range<usize>,
}

impl RankBuffers {
    /// Takes each rank's home weights and allocates zeroed slot buffers of `sets` sets of
    /// `set_bytes` and `flags[r]` ready counters per rank.
    pub fn new(
        exec: &dyn Executor,
        homes: Arc<[DeviceBuffer]>,
        (set_bytes, sets): (usize, usize),
        flags: &[u32],
    ) -> Result<Self, CudaError> {
        if flags.len() != homes.len() {
            return Err(crate::KernelError::RankCount {
                got: flags.len(),
                ranks: homes.len(),
            }
            .into());
        }
        let total = set_bytes
            .checked_mul(sets.max(1))
            .ok_or(crate::KernelError::Overflow {
                what: "slot buffer bytes",
            })?;
        let (mut slots, mut flag_buffers) = (Vec::new(), Vec::new());
        for &n in flags {
            slots.push(exec.alloc_zeroed(total)?);
            flag_buffers.push(exec.alloc_zeroed(n as usize * 4)?);
        }
        let addresses = |buffers: &[DeviceBuffer], offset: usize| -> Vec<u64> {
            buffers.iter().map(|b| b.at(offset)).collect()
        };
        let tables = (0..sets.max(1))
            .map(|set| {
                let (h, s, f) = (
                    addresses(&homes, 0),
                    addresses(&slots, set * set_bytes),
                    addresses(&flag_buffers, 0),
                );
                // SAFETY: the buffers belong to the `RankBuffers` that keeps the tables next to
                // them and never replaces them; set `set` lies inside every slot buffer;
                // launches check their sizes first ([`Self::check`]).
                unsafe { PeerTable::from_raw(exec, &h, &s, &f) }
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            ranks: 0..homes.len(),
            homes,
            slots,
            flags: flag_buffers,
            set_bytes,
            tables,
        })
    }

    /// Buffers of world ranks `ranks` of a group of `world` ranks whose slots and ready
    /// counters are in peer memory: `slots[i]` and `flags[i]` this process's ranks' (in windows
    /// other processes map), `world_slots[r]` and `world_flags[r]` every rank's as this process
    /// addresses them. Launches over them run the tasks of this process's ranks, pushing into
    /// the others' slots and counters directly.
    ///
    /// # Safety
    /// Every address in `world_slots` and `world_flags` must stay mapped while the buffers are
    /// used, each rank's slot buffer as large as `slots[0]` and flag array as `flags[0]`.
    pub unsafe fn over_peers(
        exec: &dyn Executor,
        homes: Arc<[DeviceBuffer]>,
        (slots, flags): (Vec<DeviceBuffer>, Vec<DeviceBuffer>),
        (world_slots, world_flags): (&[u64], &[u64]),
        (set_bytes, sets): (usize, usize),
        ranks: Range<usize>,
    ) -> Result<Self, CudaError> {
        let world = world_slots.len();
        if homes.len() != ranks.len()
            || slots.len() != ranks.len()
            || flags.len() != ranks.len()
            || world_flags.len() != world
            || ranks.end > world
        {
            return Err(crate::KernelError::RankCount {
                got: slots.len(),
                ranks: ranks.len(),
            }
            .into());
        }
        let home: Vec<u64> = (0..world)
            .map(|r| match r.checked_sub(ranks.start) {
                Some(i) if ranks.contains(&r) => homes[i].ptr(),
                _ => 0,
            })
            .collect();
        let tables = (0..sets.max(1))
            .map(|set| {
                let s: Vec<u64> = world_slots
                    .iter()
                    .map(|&a| a + (set * set_bytes) as u64)
                    .collect();
                // SAFETY: the caller's contract; homes of other ranks are never read (their
                // tasks run in their own processes).
                unsafe { PeerTable::from_raw(exec, &home, &s, world_flags) }
                    .map(|t| t.with_sources(ranks.clone()))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            homes,
            slots,
            flags,
            set_bytes,
            tables,
            ranks,
        })
    }

    /// Buffers of their own (slots and ready counters, as [`Self::new`] makes them) that read
    /// these buffers' home weights: another lane's slots streamed from the same experts.
    pub fn sharing_homes(
        &self,
        exec: &dyn Executor,
        (set_bytes, sets): (usize, usize),
        flags: &[u32],
    ) -> Result<Self, CudaError> {
        Self::new(exec, Arc::clone(&self.homes), (set_bytes, sets), flags)
    }

    /// The home weights, shared (what buffers of another lane, or in peer memory, read).
    pub fn shared_homes(&self) -> Arc<[DeviceBuffer]> {
        Arc::clone(&self.homes)
    }

    /// Bytes of one slot set.
    pub fn set_bytes(&self) -> usize {
        self.set_bytes
    }

    /// Queues zeroing every ready counter on `stream` (before each distribution).
    pub fn reset_flags(&self, exec: &dyn Executor, stream: Stream) -> Result<(), CudaError> {
        for f in &self.flags {
            exec.zero_on(stream, f, 0, f.bytes())?;
        }
        Ok(())
    }

    /// Rank `r`'s home weights.
    pub fn home(&self, rank: usize) -> Option<&DeviceBuffer> {
        self.homes.get(rank)
    }

    /// Rank `r`'s slot buffer (every set).
    pub fn slots(&self, rank: usize) -> Option<&DeviceBuffer> {
        self.slots.get(rank)
    }

    /// Number of ranks the tables address (the whole group's).
    pub fn ranks(&self) -> usize {
        self.tables
            .first()
            .map_or(self.homes.len(), PeerTable::ranks)
    }

    /// The table addressing these buffers with slot set `set`.
    pub(crate) fn table(&self, set: usize) -> Result<&PeerTable, CudaError> {
        self.tables.get(set).ok_or_else(|| {
            crate::KernelError::OutOfRange {
                what: "slot set",
                value: set as u64,
                limit: self.tables.len() as u64,
            }
            .into()
        })
    }

    /// Whether every buffer is large enough for `needs` (slots within one set).
    pub(crate) fn check(&self, needs: &[RankNeeds]) -> Result<(), CudaError> {
        if needs.len() != self.ranks() {
            return Err(crate::KernelError::RankCount {
                got: self.ranks(),
                ranks: needs.len(),
            }
            .into());
        }
        // Another process's rank: its home is checked there, its slot set and flag array are as
        // large as this process's (every window alike).
        let symmetric_flags = self.flags.first().map_or(0, DeviceBuffer::bytes) as u64;
        for (rank, need) in needs.iter().enumerate() {
            let (home, flags) = match rank.checked_sub(self.ranks.start) {
                Some(i) if self.ranks.contains(&rank) => {
                    (self.homes[i].bytes() as u64, self.flags[i].bytes() as u64)
                }
                _ => (need.home, symmetric_flags),
            };
            let checks = [
                ("home weights", home, need.home),
                ("slot set", self.set_bytes as u64, need.slots),
                ("ready counters", flags, u64::from(need.flags) * 4),
            ];
            for (what, len, needed) in checks {
                if len < needed {
                    return Err(CudaError::BufferTooSmall {
                        what,
                        rank,
                        len,
                        needed,
                    });
                }
            }
        }
        Ok(())
    }
}

/// How much of each rank's buffers a task stream touches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct RankNeeds {
    pub home: u64,
    pub slots: u64,
    pub flags: u32,
}

fn rank_needs(stream: &TileStream, ranks: usize) -> Vec<RankNeeds> {
    let mut needs = vec![RankNeeds::default(); ranks];
    for t in &stream.tasks {
        let end = t.src_offset + u64::from(t.len);
        let need = &mut needs[t.src_rank as usize];
        if t.src_kind == super::tiles::SRC_HOME {
            need.home = need.home.max(end);
        } else {
            need.slots = need.slots.max(end);
        }
        for d in &stream.dsts[t.dst_begin as usize..(t.dst_begin + t.n_dst) as usize] {
            let end = d.offset + t.tile_offset + u64::from(t.len);
            needs[d.rank as usize].slots = needs[d.rank as usize].slots.max(end);
        }
    }
    for (need, &flags) in needs.iter_mut().zip(&stream.flags_per_rank) {
        need.flags = flags;
    }
    needs
}

/// The bytes of task structs as the kernels read and write them (`replicate.cu`, 48 bytes a
/// task): what a host-built stream uploads and a test launching the kernels by hand passes.
pub fn task_bytes(tasks: &[TileTask]) -> Vec<u8> {
    tasks
        .iter()
        .flat_map(|t| {
            let words = [
                t.src_rank,
                t.src_kind,
                t.len,
                t.dst_begin,
                t.n_dst,
                t.wait_flag as u32,
                t.wait_target,
                t.reserved,
            ];
            [t.src_offset, t.tile_offset]
                .into_iter()
                .flat_map(u64::to_le_bytes)
                .chain(words.into_iter().flat_map(u32::to_le_bytes))
                .collect::<Vec<u8>>()
        })
        .collect()
}

/// The bytes of destination structs as the kernels read and write them (16 bytes each).
pub fn dst_bytes(dsts: &[TileDst]) -> Vec<u8> {
    dsts.iter()
        .flat_map(|d| {
            d.offset
                .to_le_bytes()
                .into_iter()
                .chain(d.rank.to_le_bytes())
                .chain(d.ready_flag.to_le_bytes())
        })
        .collect()
}

/// Task structs from the bytes a kernel wrote (`plan_tiles`): the inverse of [`task_bytes`].
pub fn tasks_from_bytes(bytes: &[u8]) -> Vec<TileTask> {
    bytes
        .chunks_exact(std::mem::size_of::<TileTask>())
        .map(|b| {
            let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
            let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
            TileTask {
                src_offset: u64_at(0),
                tile_offset: u64_at(8),
                src_rank: u32_at(16),
                src_kind: u32_at(20),
                len: u32_at(24),
                dst_begin: u32_at(28),
                n_dst: u32_at(32),
                wait_flag: u32_at(36) as i32,
                wait_target: u32_at(40),
                reserved: u32_at(44),
            }
        })
        .collect()
}

/// Destination structs from the bytes a kernel wrote: the inverse of [`dst_bytes`].
pub fn dsts_from_bytes(bytes: &[u8]) -> Vec<TileDst> {
    bytes
        .chunks_exact(std::mem::size_of::<TileDst>())
        .map(|b| TileDst {
            offset: u64::from_le_bytes(b[0..8].try_into().expect("8 bytes")),
            rank: u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")),
            ready_flag: i32::from_le_bytes(b[12..16].try_into().expect("4 bytes")),
        })
        .collect()
}

/// A compiled (host-built) tile stream on the device, ready to launch.
pub struct DeviceTileStream {
    tasks: DeviceBuffer,
    dsts: DeviceBuffer,
    /// The task count, on the device (the kernel reads it there, as it does after `plan_tiles`).
    count: DeviceBuffer,
    /// The claim counter, then the stall word.
    counter: DeviceBuffer,
    n_tasks: u32,
    tile_bytes: u32,
    needs: Vec<RankNeeds>,
}

impl DeviceTileStream {
    /// Uploads a task stream for `ranks` ranks in `stream`'s order, after
    /// [`TileStream::check_runnable`]: a stream the kernel would misread or wait on forever is
    /// refused here.
    pub fn upload(
        exec: &dyn Executor,
        stream: Stream,
        tiles: &TileStream,
        ranks: usize,
    ) -> Result<Self, CudaError> {
        tiles.check_runnable(ranks)?;
        let n_tasks = to_u32(tiles.tasks.len(), "tile tasks")?;
        Ok(Self {
            tasks: exec.upload_on(stream, &task_bytes(&tiles.tasks))?,
            dsts: exec.upload_on(stream, &dst_bytes(&tiles.dsts))?,
            count: exec.upload_on(stream, &n_tasks.to_le_bytes())?,
            counter: exec.alloc_zeroed_on(stream, 8)?,
            n_tasks,
            tile_bytes: tiles.tile_bytes,
            needs: rank_needs(tiles, ranks),
        })
    }

    /// Number of tile tasks.
    pub fn len(&self) -> usize {
        self.n_tasks as usize
    }

    /// Whether there is nothing to copy.
    pub fn is_empty(&self) -> bool {
        self.n_tasks == 0
    }

    /// Waits for the last launch (queued on `stream`); fails if a relay chunk never became ready
    /// (the kernel gave up instead of spinning: the stream was broken).
    pub fn finish(&self, exec: &dyn Executor, stream: Stream) -> Result<(), CudaError> {
        check_not_stalled(exec, stream, &self.counter)
    }

    /// The claim counter and stall word (a slot wait reads the stall word).
    pub(crate) fn counter(&self) -> &DeviceBuffer {
        &self.counter
    }

    /// Queues the stream on `stream` over ranks that all live on this device, into their slot
    /// set `set`, after checking every buffer is large enough; the ready counters are zeroed
    /// first. With `landed`, every stored tile is also counted per slot.
    pub fn launch(
        &self,
        exec: &dyn Executor,
        stream: Stream,
        (buffers, set): (&RankBuffers, usize),
        grid: (u32, u32),
        landed: Option<&LandedBytes>,
    ) -> Result<(), CudaError> {
        buffers.reset_flags(exec, stream)?;
        self.launch_armed(exec, stream, (buffers, set), grid, landed)
    }

    /// [`Self::launch`] over buffers whose ready counters the caller zeroed earlier on `stream`
    /// (before telling the ranks of other processes that they may push into them).
    pub(crate) fn launch_armed(
        &self,
        exec: &dyn Executor,
        stream: Stream,
        (buffers, set): (&RankBuffers, usize),
        grid: (u32, u32),
        landed: Option<&LandedBytes>,
    ) -> Result<(), CudaError> {
        buffers.check(&self.needs)?;
        let table = buffers.table(set)?;
        // SAFETY: the table addresses `buffers`, just checked against what the tasks touch.
        unsafe { self.launch_peers(exec, stream, table, grid, landed) }
    }

    /// Queues the stream through any peer table (e.g. NVLink peers), `grid.0` persistent blocks
    /// of `grid.1` threads.
    ///
    /// # Safety
    /// The table's buffers must be as large as this stream touches (see [`PeerTable::from_raw`])
    /// and their ready counters zero.
    pub unsafe fn launch_peers(
        &self,
        exec: &dyn Executor,
        stream: Stream,
        peers: &PeerTable,
        (blocks, threads): (u32, u32),
        landed: Option<&LandedBytes>,
    ) -> Result<(), CudaError> {
        if peers.ranks() != self.needs.len() {
            return Err(crate::KernelError::RankCount {
                got: peers.ranks(),
                ranks: self.needs.len(),
            }
            .into());
        }
        let tasks = TaskBuffers {
            tasks: &self.tasks,
            count: self.count.ptr(),
            dsts: &self.dsts,
            counter: &self.counter,
            tile_bytes: self.tile_bytes,
            landed,
        };
        let blocks = blocks.clamp(1, self.n_tasks.max(1));
        // SAFETY: the tasks were validated against the plan and buffer layout when compiled, and
        // the caller vouches for the peer table.
        unsafe { launch_tile_stream(exec, stream, tasks, peers, (blocks, threads)) }
    }
}

/// A task stream in device memory, wherever it was built.
pub(crate) struct TaskBuffers<'a> {
    pub tasks: &'a DeviceBuffer,
    /// The address of one `u32`: how many of `tasks` to run.
    pub count: u64,
    pub dsts: &'a DeviceBuffer,
    /// Two `u32`s, zeroed here: the persistent grid's claim counter and the stall word
    /// ([`check_not_stalled`]).
    pub counter: &'a DeviceBuffer,
    pub tile_bytes: u32,
    /// Per (rank, slot) byte counters the kernel adds every landed tile to (`None`: not kept).
    pub landed: Option<&'a LandedBytes>,
}

/// Waits for the stream that used `counter` ([`TaskBuffers::counter`]) and fails if its stall
/// word is raised.
pub(crate) fn check_not_stalled(
    exec: &dyn Executor,
    stream: Stream,
    counter: &DeviceBuffer,
) -> Result<(), CudaError> {
    let words = exec.download_u32_on(stream, counter)?;
    match words.get(1) {
        Some(0) => Ok(()),
        _ => Err(CudaError::TileStreamStalled),
    }
}

/// Queues `tile_stream` on `stream` with `blocks` persistent blocks of `threads` threads
/// (blocks beyond the task count exit at once); zeroes the claim counter and stall word first.
///
/// # Safety
/// Every task must stay inside the buffers `peers` addresses and the ready counters be zero.
pub(crate) unsafe fn launch_tile_stream(
    exec: &dyn Executor,
    stream: Stream,
    tasks: TaskBuffers<'_>,
    peers: &PeerTable,
    (blocks, threads): (u32, u32),
) -> Result<(), CudaError> {
    // Two stages of one tile each (double buffering).
    let shared = 2 * tasks.tile_bytes as usize;
    let limit = exec.shared_limit("tile_stream")?;
    if shared > limit {
        return Err(CudaError::SharedMemory {
            what: "tile_stream",
            needed: shared,
            limit,
        });
    }
    exec.zero_on(stream, tasks.counter, 0, 8)?;
    let (landed, slot_bytes) = match tasks.landed {
        Some(l) => (l.table().ptr(), l.slot_bytes()),
        None => (0, 0),
    };
    let args = [
        KernelArg::from(tasks.tasks),
        KernelArg::Ptr(tasks.count),
        KernelArg::from(tasks.dsts),
        KernelArg::from(tasks.counter),
        KernelArg::from(&peers.home),
        KernelArg::from(&peers.slots),
        KernelArg::from(&peers.flags),
        KernelArg::U32(tasks.tile_bytes),
        KernelArg::Ptr(landed),
        KernelArg::U64(slot_bytes),
        KernelArg::U32(to_u32(peers.sources.start, "first source rank")?),
        KernelArg::U32(to_u32(peers.sources.end, "source ranks")?),
    ];
    let launch = Launch {
        grid: [blocks.max(1), 1, 1],
        block: threads.clamp(32, 1024) / 32 * 32,
        shared_bytes: shared as u32,
    };
    // SAFETY: `tile_stream(tasks, task_count, dsts, next_task[2], home_base, slot_base,
    // flag_base, tile_bytes, landed_base, slot_bytes, src_lo, src_hi)`; the caller vouches for
    // the tasks and the table (and the landed table holds every rank's counters).
    unsafe { exec.launch_on(stream, "tile_stream", launch, &args) }
}
