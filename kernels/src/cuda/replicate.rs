//! Launching the tile-streaming replica distribution (`kernels/cuda/replicate.cu`).
//!
//! Ranks are reached through a [`PeerTable`]: for every rank, the device addresses of its home
//! (main expert) weights, its redundant-slot buffer and its ready-counter array. With NVLink peer
//! access enabled those are other GPUs' buffers (unified addressing makes them plain pointers;
//! peer access covers `cuMemAlloc` memory, while buffers from a stream-ordered pool, as cudarc
//! allocates them, also need `cuMemPoolSetAccess` for the reading device);
//! [`RankBuffers`] instead keeps every rank's buffers on one GPU, which runs the same kernel
//! over the same task stream: how the data plane is tested on a single device.

use super::tiles::{TileDst, TileStream, TileTask};
use super::{to_u32, CudaError, Gpu};
use cudarc::driver::{CudaSlice, CudaView, DevicePtr, LaunchConfig, PushKernelArg};
use std::sync::Arc;

/// Device pointers of every rank's buffers, indexed by rank.
pub struct PeerTable {
    home: CudaSlice<u64>,
    slots: CudaSlice<u64>,
    flags: CudaSlice<u64>,
    ranks: usize,
}

impl PeerTable {
    /// A table from raw device addresses (`home[r]`, `slots[r]`, `flags[r]` for rank `r`).
    ///
    /// # Safety
    /// Every address must stay valid, and be accessible from the launching device (peer access
    /// enabled; for memory-pool allocations, pool access granted), for as long as
    /// kernels use the table; each buffer must be at least as large as the task streams launched
    /// with it address (the home weights up to the largest home offset plus `expert_bytes`, the
    /// slot buffer `n_slot * slot_bytes`, the flag array the stream's `flags_per_rank[r]`
    /// counters).
    pub unsafe fn from_raw(
        gpu: &Gpu,
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
        let stream = gpu.stream();
        Ok(Self {
            home: stream.clone_htod(home)?,
            slots: stream.clone_htod(slots)?,
            flags: stream.clone_htod(flags)?,
            ranks,
        })
    }

    /// Number of ranks in the table.
    pub fn ranks(&self) -> usize {
        self.ranks
    }
}

/// Every rank's home weights, slot buffer and ready counters on one GPU, with the peer table
/// that addresses them (built once: the buffers are never reallocated).
///
/// `tile_stream` reaches these buffers through the table's raw pointers, so cudarc records no
/// read or write of them for that kernel: whatever reads a slot after streaming (the expert
/// GEMMs, `GpuMoe::slot_contents`) must run on the [`Gpu::stream`] that streamed it, which
/// orders it after the kernel. A consumer on another stream would need an explicit event wait.
pub struct RankBuffers {
    /// Shared with every [`Self::sharing_homes`] of these buffers.
    homes: Arc<[CudaSlice<u8>]>,
    slots: Vec<CudaSlice<u8>>,
    flags: Vec<CudaSlice<u32>>,
    table: PeerTable,
}

impl RankBuffers {
    /// Uploads each rank's home weights and allocates a zeroed slot buffer of
    /// `slot_buffer_bytes` and `flags[r]` ready counters per rank.
    pub fn new(
        gpu: &Gpu,
        homes: &[Vec<u8>],
        slot_buffer_bytes: usize,
        flags: &[u32],
    ) -> Result<Self, CudaError> {
        let stream = gpu.stream();
        let home_bufs = homes
            .iter()
            .map(|h| stream.clone_htod(if h.is_empty() { &[0u8][..] } else { h }))
            .collect::<Result<Vec<_>, _>>()?;
        Self::with_homes(gpu, home_bufs.into(), slot_buffer_bytes, flags)
    }

    /// Like [`Self::new`] with zero-filled home weights of `home_bytes[r]` bytes (benchmarks).
    pub fn zeroed(
        gpu: &Gpu,
        home_bytes: &[usize],
        slot_buffer_bytes: usize,
        flags: &[u32],
    ) -> Result<Self, CudaError> {
        let stream = gpu.stream();
        let home_bufs = home_bytes
            .iter()
            .map(|&n| stream.alloc_zeros::<u8>(n.max(1)))
            .collect::<Result<Vec<_>, _>>()?;
        Self::with_homes(gpu, home_bufs.into(), slot_buffer_bytes, flags)
    }

    /// Buffers of their own (slots and ready counters, as [`Self::new`] makes them) that read
    /// these buffers' home weights: a second set of slots streamed from the same experts.
    pub fn sharing_homes(
        &self,
        gpu: &Gpu,
        slot_buffer_bytes: usize,
        flags: &[u32],
    ) -> Result<Self, CudaError> {
        Self::with_homes(gpu, Arc::clone(&self.homes), slot_buffer_bytes, flags)
    }

    fn with_homes(
        gpu: &Gpu,
        homes: Arc<[CudaSlice<u8>]>,
        slot_buffer_bytes: usize,
        flags: &[u32],
    ) -> Result<Self, CudaError> {
        if flags.len() != homes.len() {
            return Err(crate::KernelError::RankCount {
                got: flags.len(),
                ranks: homes.len(),
            }
            .into());
        }
        let stream = gpu.stream();
        let (mut slot_bufs, mut flag_bufs) = (Vec::new(), Vec::new());
        for &n in flags {
            slot_bufs.push(stream.alloc_zeros::<u8>(slot_buffer_bytes.max(1))?);
            flag_bufs.push(stream.alloc_zeros::<u32>((n as usize).max(1))?);
        }
        let table = peer_table(gpu, &homes, &slot_bufs, &flag_bufs)?;
        Ok(Self {
            homes,
            slots: slot_bufs,
            flags: flag_bufs,
            table,
        })
    }

    /// Zeroes every ready counter (before each distribution).
    pub fn reset_flags(&mut self, gpu: &Gpu) -> Result<(), CudaError> {
        for f in &mut self.flags {
            gpu.stream().memset_zeros(f)?;
        }
        Ok(())
    }

    /// Rank `r`'s home weights.
    pub fn home(&self, rank: usize) -> Option<&CudaSlice<u8>> {
        self.homes.get(rank)
    }

    /// Rank `r`'s slot buffer.
    pub fn slots(&self, rank: usize) -> Option<&CudaSlice<u8>> {
        self.slots.get(rank)
    }

    /// Number of ranks.
    pub fn ranks(&self) -> usize {
        self.homes.len()
    }

    /// The table addressing these buffers.
    pub(crate) fn table(&self) -> &PeerTable {
        &self.table
    }

    /// Whether every buffer is large enough for `needs`.
    pub(crate) fn check(&self, needs: &[RankNeeds]) -> Result<(), CudaError> {
        if needs.len() != self.ranks() {
            return Err(crate::KernelError::RankCount {
                got: self.ranks(),
                ranks: needs.len(),
            }
            .into());
        }
        for (rank, need) in needs.iter().enumerate() {
            let checks = [
                ("home weights", self.homes[rank].len() as u64, need.home),
                ("slot buffer", self.slots[rank].len() as u64, need.slots),
                (
                    "ready counters",
                    self.flags[rank].len() as u64 * 4,
                    u64::from(need.flags) * 4,
                ),
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

/// The table addressing buffers that all live on `gpu`.
fn peer_table(
    gpu: &Gpu,
    homes: &[CudaSlice<u8>],
    slots: &[CudaSlice<u8>],
    flags: &[CudaSlice<u32>],
) -> Result<PeerTable, CudaError> {
    let stream = gpu.stream();
    let ptrs = |bufs: &[CudaSlice<u8>]| -> Vec<u64> {
        bufs.iter().map(|b| b.device_ptr(stream).0).collect()
    };
    let flag_ptrs: Vec<u64> = flags.iter().map(|b| b.device_ptr(stream).0).collect();
    // SAFETY: the buffers belong to the `RankBuffers` that keeps the table next to them and
    // rebuilds it whenever one is replaced; launches through `DeviceTileStream::launch` check
    // their sizes first.
    unsafe { PeerTable::from_raw(gpu, &ptrs(homes), &ptrs(slots), &flag_ptrs) }
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

/// A compiled tile stream on the device, ready to launch.
pub struct DeviceTileStream {
    tasks: CudaSlice<TileTask>,
    dsts: CudaSlice<TileDst>,
    /// The task count, on the device (the kernel reads it there, as it does after `plan_tiles`).
    count: CudaSlice<u32>,
    counter: CudaSlice<u32>,
    n_tasks: u32,
    tile_bytes: u32,
    needs: Vec<RankNeeds>,
}

impl DeviceTileStream {
    /// Uploads a task stream for `ranks` ranks, after [`TileStream::check_runnable`]: a stream
    /// the kernel would misread or wait on forever is refused here.
    pub fn upload(gpu: &Gpu, stream: &TileStream, ranks: usize) -> Result<Self, CudaError> {
        stream.check_runnable(ranks)?;
        let s = gpu.stream();
        let tasks: &[TileTask] = if stream.tasks.is_empty() {
            &[TileTask::default()]
        } else {
            &stream.tasks
        };
        let dsts: &[TileDst] = if stream.dsts.is_empty() {
            &[TileDst::default()]
        } else {
            &stream.dsts
        };
        let n_tasks = to_u32(stream.tasks.len(), "tile tasks")?;
        Ok(Self {
            tasks: s.clone_htod(tasks)?,
            dsts: s.clone_htod(dsts)?,
            count: s.clone_htod(&[n_tasks])?,
            counter: s.alloc_zeros(2)?,
            n_tasks,
            tile_bytes: stream.tile_bytes,
            needs: rank_needs(stream, ranks),
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

    /// Waits for the last launch; fails if a relay chunk never became ready (the kernel gave
    /// up instead of spinning: the stream was broken).
    pub fn finish(&self, gpu: &Gpu) -> Result<(), CudaError> {
        check_not_stalled(gpu, &self.counter)
    }

    /// Runs the stream over ranks that all live on this GPU, after checking every buffer is
    /// large enough. The ready counters must be zero ([`RankBuffers::reset_flags`]); the call
    /// only enqueues on the GPU's stream.
    pub fn launch(
        &mut self,
        gpu: &Gpu,
        buffers: &RankBuffers,
        blocks: u32,
        threads: u32,
    ) -> Result<(), CudaError> {
        buffers.check(&self.needs)?;
        // SAFETY: the table addresses `buffers`, just checked against what the tasks touch.
        unsafe { self.launch_peers(gpu, &buffers.table, blocks, threads) }
    }

    /// Runs the stream through any peer table (e.g. NVLink peers), `blocks` persistent blocks of
    /// `threads` threads.
    ///
    /// # Safety
    /// The table's buffers must be as large as this stream touches (see [`PeerTable::from_raw`])
    /// and their ready counters zero.
    pub unsafe fn launch_peers(
        &mut self,
        gpu: &Gpu,
        peers: &PeerTable,
        blocks: u32,
        threads: u32,
    ) -> Result<(), CudaError> {
        if peers.ranks() != self.needs.len() {
            return Err(crate::KernelError::RankCount {
                got: peers.ranks(),
                ranks: self.needs.len(),
            }
            .into());
        }
        if self.n_tasks == 0 {
            return Ok(());
        }
        let grid = blocks.clamp(1, self.n_tasks);
        let buffers = TaskBuffers {
            tasks: &self.tasks,
            count: self.count.slice(..),
            dsts: &self.dsts,
            counter: &mut self.counter,
            tile_bytes: self.tile_bytes,
            landed: None,
        };
        // SAFETY: the tasks were validated against the plan and buffer layout when compiled, and
        // the caller vouches for the peer table.
        unsafe { launch_tile_stream(gpu, buffers, peers, grid, threads) }
    }
}

/// A task stream in device memory, wherever it was built.
pub(crate) struct TaskBuffers<'a> {
    pub tasks: &'a CudaSlice<TileTask>,
    /// One `u32`: how many of `tasks` to run.
    pub count: CudaView<'a, u32>,
    pub dsts: &'a CudaSlice<TileDst>,
    /// Two `u32`s, zeroed here: the persistent grid's claim counter and the stall word
    /// ([`check_not_stalled`]).
    pub counter: &'a mut CudaSlice<u32>,
    pub tile_bytes: u32,
    /// Per (rank, slot) byte counters the kernel adds every landed tile to (`None`: not kept).
    pub landed: Option<&'a LandedBytes>,
}

/// How many bytes have landed in every rank's every slot during one replication: `tile_stream`
/// adds each tile it stores to its slot's counter (after the bytes are visible, like a relay
/// counter), and `wait_slot` holds a stream until one slot's counter reaches the expert's bytes,
/// so a GEMM reading that replica can start while other replicas still stream.
pub struct LandedBytes {
    /// `[rank * n_slot + slot]`.
    counters: CudaSlice<u32>,
    slot_bytes: u64,
    n_slot: u32,
}

impl LandedBytes {
    /// Counters for `ranks` ranks of `n_slot` slots of `slot_bytes` each (a slot's bytes must
    /// fit a `u32` counter).
    pub fn new(gpu: &Gpu, ranks: usize, n_slot: usize, slot_bytes: u64) -> Result<Self, CudaError> {
        if slot_bytes > u64::from(u32::MAX) {
            return Err(crate::KernelError::Overflow {
                what: "slot bytes (landed-byte counters are 32-bit)",
            }
            .into());
        }
        Ok(Self {
            counters: gpu.stream().alloc_zeros((ranks * n_slot).max(1))?,
            slot_bytes,
            n_slot: to_u32(n_slot, "slots per rank")?,
        })
    }

    /// Zeroes every counter on `gpu`'s stream (before each replication).
    pub fn reset(&mut self, gpu: &Gpu) -> Result<(), CudaError> {
        Ok(gpu.stream().memset_zeros(&mut self.counters)?)
    }

    /// Queues on `gpu`'s stream a wait until `rank`'s slot `slot` holds `bytes` landed bytes;
    /// it gives up when the stream's stall word (`counter[1]` of the replication's
    /// [`TaskBuffers`]) is raised, or raises it after the stall limit.
    pub(crate) fn wait(
        &self,
        gpu: &Gpu,
        (rank, slot): (usize, usize),
        bytes: u64,
        stall_word: &CudaSlice<u32>,
    ) -> Result<(), CudaError> {
        let index = rank * self.n_slot as usize + slot;
        if slot >= self.n_slot as usize || index >= self.counters.len() {
            return Err(crate::KernelError::OutOfRange {
                what: "slot to wait for",
                value: index as u64,
                limit: self.counters.len() as u64,
            }
            .into());
        }
        let (index, target) = (
            to_u32(index, "slot index")?,
            to_u32(bytes as usize, "slot bytes")?,
        );
        let stalled = stall_word.slice(1..2);
        let mut launch = gpu.stream().launch_builder(gpu.function("wait_slot"));
        launch
            .arg(&self.counters)
            .arg(&index)
            .arg(&target)
            .arg(&stalled);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: arguments match `wait_slot`; `index` is inside the counters (checked above) and
        // the stall word is one `u32` of a live buffer.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }
}

/// Waits for the stream that used `counter` ([`TaskBuffers::counter`]) and fails if its stall
/// word is raised.
pub(crate) fn check_not_stalled(gpu: &Gpu, counter: &CudaSlice<u32>) -> Result<(), CudaError> {
    let words = gpu.stream().clone_dtoh(counter)?;
    match words.get(1) {
        Some(0) => Ok(()),
        _ => Err(CudaError::TileStreamStalled),
    }
}

/// Enqueues `tile_stream` with `blocks` persistent blocks of `threads` threads (blocks beyond
/// the task count exit at once).
///
/// # Safety
/// Every task must stay inside the buffers `peers` addresses and the ready counters be zero.
pub(crate) unsafe fn launch_tile_stream(
    gpu: &Gpu,
    stream: TaskBuffers<'_>,
    peers: &PeerTable,
    blocks: u32,
    threads: u32,
) -> Result<(), CudaError> {
    let s = gpu.stream();
    // Two stages of one tile each (double buffering).
    let shared = 2 * stream.tile_bytes as usize;
    gpu.check_dynamic_shared("tile_stream", shared)?;
    s.memset_zeros(stream.counter)?;
    let cfg = LaunchConfig {
        grid_dim: (blocks.max(1), 1, 1),
        block_dim: (threads.clamp(32, 1024) / 32 * 32, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    let (landed, slot_bytes, n_slot) = match stream.landed {
        Some(l) => (Some(&l.counters), l.slot_bytes, l.n_slot),
        None => (None, 0u64, 0u32),
    };
    let no_counters = 0u64;
    let mut launch = s.launch_builder(gpu.function("tile_stream"));
    launch
        .arg(stream.tasks)
        .arg(&stream.count)
        .arg(stream.dsts)
        .arg(stream.counter)
        .arg(&peers.home)
        .arg(&peers.slots)
        .arg(&peers.flags)
        .arg(&stream.tile_bytes);
    match landed {
        Some(counters) => launch.arg(counters),
        None => launch.arg(&no_counters),
    };
    launch.arg(&slot_bytes).arg(&n_slot);
    // SAFETY: arguments match `tile_stream`; the caller vouches for the tasks and the table.
    unsafe { launch.launch(cfg) }?;
    Ok(())
}
