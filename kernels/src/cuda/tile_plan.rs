//! Relay trees and tile tasks built on the device (`kernels/cuda/tile_plan.cu`, UltraEP §6.2).
//!
//! With this, the plan goes from the quota solver to the weight streaming without visiting the
//! host: `plan_tiles` reads the plan where the solver left it, builds the load-aware relay trees
//! and writes the tile tasks, and `tile_stream` reads the task count from device memory. The
//! host reference is [`super::tiles::compile`] over
//! [`rackfill_balancer::relay::plan_transfers`]: `plan_tiles` produces the same tasks, the same
//! destinations and the same ready counters, entry for entry (tests/device_kernels/tiles.rs
//! compares them on random plans, on the host emulator and on a GPU where there is one).
//!
//! The device cannot allocate for the plan at hand, so [`TilePlanner::new`] sizes every buffer
//! for the worst plan the layout allows (every slot filled); the kernel still checks each
//! capacity and plans nothing, with a [`TilePlanFault`], rather than write past one.

use super::exec::{DeviceBuffer, Executor, ExecutorExt, KernelArg, KernelParams, Launch, Stream};
use super::replicate::{
    check_not_stalled, dsts_from_bytes, launch_tile_stream, tasks_from_bytes, LandedBytes,
    RankBuffers, RankNeeds, TaskBuffers,
};
use super::tiles::{TileDst, TileStream, TileTask};
use super::{to_u32, CudaError, DevicePlan, TilePlanFault};
use crate::KernelError;
use rackfill_balancer::relay::{chunk_geometry, RelayConfig};
use rackfill_balancer::Layout;
use std::sync::Arc;

/// Ranks and experts are packed into 21-bit fields of the kernel's edge keys.
const MAX_IDS: usize = 1 << 21;
/// Threads of the one `plan_tiles` block.
const THREADS: u32 = 512;

/// Field for field the `TilePlanParams` struct of `tile_plan.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TilePlanParams {
    pub expert_bytes: u64,
    pub slot_bytes: u64,
    /// The chunk in effect ([`chunk_geometry`]).
    pub chunk_bytes: u64,
    pub n_chunks: u32,
    pub tile_bytes: u32,
    pub ranks: u32,
    pub experts: u32,
    pub n_slot: u32,
    /// [`RelayConfig::threshold`].
    pub threshold: u32,
    pub task_capacity: u32,
    pub dst_capacity: u32,
    /// Ready counters per rank.
    pub flag_capacity: u32,
    /// Replicas a plan can have: `ranks * n_slot`.
    pub edge_capacity: u32,
    /// 1: the kernel's arena is dynamic shared memory; 0: a global buffer.
    pub arena_in_shared: u32,
    pub reserved: u32,
}

// SAFETY: plain `repr(C)` integers without padding (three u64s then 14 u32s: 80 bytes), the
// CUDA struct's layout.
unsafe impl KernelParams for TilePlanParams {}

/// What one replica distribution looks like: the expert and slot sizes, the tile, the relay
/// settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TileGeometry {
    pub expert_bytes: u64,
    /// Bytes between consecutive slots of a rank (at least `expert_bytes`).
    pub slot_bytes: u64,
    /// A positive multiple of 16.
    pub tile_bytes: u32,
    pub relay: RelayConfig,
}

impl TilePlanParams {
    /// The kernel's parameters for every plan of `layout`, capacities sized for the worst one.
    pub fn new(layout: &Layout, geometry: &TileGeometry) -> Result<Self, KernelError> {
        let g = geometry;
        if g.expert_bytes == 0 {
            return Err(KernelError::ZeroDimension {
                what: "expert_bytes",
            });
        }
        if g.tile_bytes == 0 || !g.tile_bytes.is_multiple_of(16) {
            return Err(KernelError::OutOfRange {
                what: "tile_bytes (a positive multiple of 16)",
                value: u64::from(g.tile_bytes),
                limit: u64::from(u32::MAX),
            });
        }
        if g.slot_bytes < g.expert_bytes {
            return Err(KernelError::SlotTooSmall {
                slot_bytes: g.slot_bytes as usize,
                expert_bytes: g.expert_bytes as usize,
            });
        }
        for (what, n) in [("ranks", layout.ranks()), ("experts", layout.experts())] {
            if n >= MAX_IDS {
                return Err(KernelError::OutOfRange {
                    what,
                    value: n as u64,
                    limit: MAX_IDS as u64,
                });
            }
        }
        let overflow = |what| KernelError::Overflow { what };
        let (chunk, n_chunks) = chunk_geometry(g.expert_bytes, g.relay.chunk_bytes);
        let tile = u64::from(g.tile_bytes);
        let last = g.expert_bytes - (n_chunks - 1) * chunk;
        let tiles_per_expert = (n_chunks - 1)
            .checked_mul(chunk.div_ceil(tile))
            .and_then(|t| t.checked_add(last.div_ceil(tile)))
            .ok_or(overflow("tiles per expert"))?;
        let edges = layout.ranks() as u64 * layout.slots_per_rank() as u64;
        let capacity =
            |n: Option<u64>, what| n.and_then(|n| u32::try_from(n).ok()).ok_or(overflow(what));
        let flag_capacity = capacity(
            (layout.slots_per_rank() as u64).checked_mul(n_chunks),
            "ready counters",
        )?;
        i32::try_from(flag_capacity).map_err(|_| overflow("ready counters"))?;
        // The kernel sums send volumes without saturating: at most every replica sent and
        // forwarded once.
        g.expert_bytes
            .checked_mul(2 * edges + 1)
            .ok_or(overflow("send volumes"))?;
        Ok(Self {
            expert_bytes: g.expert_bytes,
            slot_bytes: g.slot_bytes,
            chunk_bytes: chunk,
            n_chunks: capacity(Some(n_chunks), "chunks")?,
            tile_bytes: g.tile_bytes,
            ranks: to_u32(layout.ranks(), "ranks")?,
            experts: to_u32(layout.experts(), "experts")?,
            n_slot: to_u32(layout.slots_per_rank(), "slots per rank")?,
            threshold: u32::try_from(g.relay.threshold).unwrap_or(u32::MAX),
            task_capacity: capacity(edges.checked_mul(tiles_per_expert), "tile tasks")?,
            dst_capacity: capacity(edges.checked_mul(n_chunks), "tile destinations")?,
            flag_capacity,
            edge_capacity: capacity(Some(edges), "replicas")?,
            arena_in_shared: 0,
            reserved: 0,
        })
    }

    /// Bytes of the kernel's arena (the staged plan and its scratch), as `tile_plan.cu` carves
    /// it: `R + 4C` `u64`s, then `2E + 3I + 7C + 2` `u32`s, with `I = E + C` instances.
    pub fn arena_bytes(&self) -> usize {
        let (r, e, c) = (
            self.ranks as usize,
            self.experts as usize,
            self.edge_capacity as usize,
        );
        8 * (r + 4 * c) + 4 * (2 * e + 3 * (e + c) + 7 * c + 2)
    }
}

/// What a built task stream holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TilePlanCounts {
    pub tasks: u32,
    pub destinations: u32,
    pub groups: u32,
}

/// The device relay planner and its task buffers, sized once for a layout and geometry.
pub struct TilePlanner {
    exec: Arc<dyn Executor>,
    params: TilePlanParams,
    /// u64 `[moe layer][expert]` home offsets, flat.
    home_offsets: DeviceBuffer,
    layers: usize,
    /// A zero status word, the guard for plans that did not come from the solver.
    no_fault: DeviceBuffer,
    /// The arena when it does not fit in shared memory (one byte otherwise).
    global_arena: DeviceBuffer,
    tasks: DeviceBuffer,
    dsts: DeviceBuffer,
    /// u32: status, tasks, destinations, groups.
    header: DeviceBuffer,
    flags_per_rank: DeviceBuffer,
    /// The streaming kernel's claim counter, then its stall word.
    counter: DeviceBuffer,
    /// What any plan can touch per rank: every home range, every slot, the counter capacity.
    needs: Vec<RankNeeds>,
}

impl TilePlanner {
    /// A planner for `layout` whose expert `e` of MoE layer `l` starts at `home_offsets[l][e]` in
    /// its home rank's weight buffer. Allocates for the worst plan.
    pub fn new(
        exec: Arc<dyn Executor>,
        layout: &Layout,
        geometry: &TileGeometry,
        home_offsets: &[Vec<u64>],
    ) -> Result<Self, CudaError> {
        let mut params = TilePlanParams::new(layout, geometry)?;
        // Shared memory when the arena fits beside the kernel's own (the sequential steps then
        // never wait on global loads); a global buffer otherwise.
        let arena = params.arena_bytes();
        if arena <= exec.shared_limit("plan_tiles")? {
            params.arena_in_shared = 1;
        }
        for offsets in home_offsets {
            crate::permute::check_len("home offsets of a layer", offsets.len(), layout.experts())?;
        }
        let mut needs = vec![
            RankNeeds {
                home: 0,
                slots: u64::from(params.n_slot) * params.slot_bytes,
                flags: params.flag_capacity,
            };
            layout.ranks()
        ];
        for offsets in home_offsets {
            for (e, &offset) in offsets.iter().enumerate() {
                let need = &mut needs[layout.home(e)].home;
                *need = (*need).max(offset.saturating_add(params.expert_bytes));
            }
        }
        let flat: Vec<u64> = home_offsets.iter().flatten().copied().collect();
        let global = if params.arena_in_shared == 1 {
            1
        } else {
            arena
        };
        let task_bytes = std::mem::size_of::<TileTask>() * params.task_capacity as usize;
        let dst_bytes = std::mem::size_of::<TileDst>() * params.dst_capacity as usize;
        Ok(Self {
            home_offsets: exec.upload_u64(&flat)?,
            layers: home_offsets.len(),
            no_fault: exec.alloc_zeroed(8)?,
            global_arena: exec.alloc_zeroed(global)?,
            tasks: exec.alloc_zeroed(task_bytes)?,
            dsts: exec.alloc_zeroed(dst_bytes)?,
            header: exec.alloc_zeroed(16)?,
            flags_per_rank: exec.alloc_zeroed(4 * layout.ranks())?,
            counter: exec.alloc_zeroed(8)?,
            needs,
            params,
            exec,
        })
    }

    /// The kernel's parameters.
    pub fn params(&self) -> &TilePlanParams {
        &self.params
    }

    /// Ready counters every rank's flag buffer must hold for any plan.
    pub fn flag_capacity(&self) -> u32 {
        self.params.flag_capacity
    }

    /// The streaming kernel's claim counter and stall word (what a slot wait reads).
    pub(crate) fn counter(&self) -> &DeviceBuffer {
        &self.counter
    }

    /// Queues `plan_tiles` on `stream` for MoE layer `layer` over `plan`. With `guard` (the
    /// solver's status words), a solver failure plans nothing instead of reading a half-written
    /// plan.
    pub fn plan(
        &self,
        stream: Stream,
        plan: &DevicePlan,
        guard: Option<&DeviceBuffer>,
        layer: usize,
    ) -> Result<(), CudaError> {
        if layer >= self.layers {
            return Err(KernelError::OutOfRange {
                what: "MoE layer",
                value: layer as u64,
                limit: self.layers as u64,
            }
            .into());
        }
        if (plan.ranks(), plan.experts())
            != (self.params.ranks as usize, self.params.experts as usize)
        {
            return Err(rackfill_balancer::PlanViolation::Shape.into());
        }
        let e = self.params.experts as usize;
        let args = [
            KernelArg::params(&self.params),
            KernelArg::from(guard.unwrap_or(&self.no_fault)),
            KernelArg::from(&plan.slots),
            KernelArg::from(&plan.inst_offsets),
            KernelArg::from(&plan.inst_rank),
            KernelArg::Ptr(self.home_offsets.at(layer * e * 8)),
            KernelArg::from(&self.global_arena),
            KernelArg::from(&self.tasks),
            KernelArg::from(&self.dsts),
            KernelArg::from(&self.header),
            KernelArg::from(&self.flags_per_rank),
        ];
        let shared = if self.params.arena_in_shared == 1 {
            self.params.arena_bytes() as u32
        } else {
            0
        };
        let launch = Launch {
            grid: [1, 1, 1],
            block: THREADS,
            shared_bytes: shared,
        };
        // SAFETY: arguments match `plan_tiles`; the arena (shared or global) and the output
        // buffers have the sizes the parameters promise (allocated from them), and the plan
        // buffers belong to a DevicePlan of the same layout (checked above), which the kernel
        // bounds-checks.
        unsafe { self.exec.launch_on(stream, "plan_tiles", launch, &args) }
    }

    /// Queues `tile_stream` on `stream` over the tasks the last [`Self::plan`] wrote (`blocks`
    /// persistent blocks of `threads`) into the buffers' slot set `set`; the ready counters are
    /// zeroed first. Nothing moves if planning failed. With `landed`, the kernel also counts
    /// every slot's landed bytes there (zeroed by the caller, who waits on them with
    /// [`Self::wait_for_slot`]).
    pub fn stream(
        &self,
        stream: Stream,
        (buffers, set): (&RankBuffers, usize),
        (blocks, threads): (u32, u32),
        landed: Option<&LandedBytes>,
    ) -> Result<(), CudaError> {
        buffers.check(&self.needs)?;
        let table = buffers.table(set)?;
        buffers.reset_flags(self.exec.as_ref(), stream)?;
        let tasks = TaskBuffers {
            tasks: &self.tasks,
            count: self.header.at(4),
            dsts: &self.dsts,
            counter: &self.counter,
            tile_bytes: self.params.tile_bytes,
            landed,
        };
        // SAFETY: `plan_tiles` writes only tasks inside the slots and home ranges of the layout
        // (or none), and `buffers` was just checked to be that large with enough counters.
        unsafe { launch_tile_stream(self.exec.as_ref(), stream, tasks, table, (blocks, threads)) }
    }

    /// Queues lowering the stall word on `stream`: before a replication whose slots other
    /// streams will wait on, so a wait queued there never reads the last layer's word.
    pub fn clear_stall(&self, stream: Stream) -> Result<(), CudaError> {
        self.exec.zero_on(stream, &self.counter, 0, 8)
    }

    /// Queues on `stream` a wait until `rank`'s slot `slot` holds `bytes` bytes landed by the
    /// last [`Self::stream`] given `landed`; a stalled stream ends the wait (and the host's
    /// [`Self::finish`] reports it).
    pub fn wait_for_slot(
        &self,
        stream: Stream,
        landed: &LandedBytes,
        (rank, slot): (usize, usize),
        bytes: u64,
    ) -> Result<(), CudaError> {
        landed.wait(
            self.exec.as_ref(),
            stream,
            (rank, slot),
            bytes,
            &self.counter,
        )
    }

    /// Waits for the last [`Self::plan`] (queued on `stream`, or before it) and returns what it
    /// built, or why it built nothing.
    pub fn counts(&self, stream: Stream) -> Result<TilePlanCounts, CudaError> {
        let h = self.exec.download_u32_on(stream, &self.header)?;
        if h[0] != 0 {
            return Err(CudaError::TilePlan(TilePlanFault::from_status(h[0])));
        }
        Ok(TilePlanCounts {
            tasks: h[1],
            destinations: h[2],
            groups: h[3],
        })
    }

    /// Waits for the last [`Self::stream`] and returns what the planner built; fails if the
    /// planner built nothing or the stream stalled on a relay chunk.
    pub fn finish(&self, stream: Stream) -> Result<TilePlanCounts, CudaError> {
        let counts = self.counts(stream)?;
        check_not_stalled(self.exec.as_ref(), stream, &self.counter)?;
        Ok(counts)
    }

    /// Downloads the last built stream (verification against the host compiler; debugging).
    pub fn download(&self, stream: Stream) -> Result<TileStream, CudaError> {
        let counts = self.counts(stream)?;
        let exec = self.exec.as_ref();
        let read = |buffer: &DeviceBuffer, bytes: usize| {
            let mut out = vec![0u8; bytes];
            exec.read_on(stream, buffer, 0, &mut out).map(|()| out)
        };
        let tasks = read(
            &self.tasks,
            counts.tasks as usize * std::mem::size_of::<TileTask>(),
        )?;
        let dsts = read(
            &self.dsts,
            counts.destinations as usize * std::mem::size_of::<TileDst>(),
        )?;
        let mut flags = exec.download_u32_on(stream, &self.flags_per_rank)?;
        flags.truncate(self.params.ranks as usize);
        Ok(TileStream {
            tasks: tasks_from_bytes(&tasks),
            dsts: dsts_from_bytes(&dsts),
            flags_per_rank: flags,
            tile_bytes: self.params.tile_bytes,
            stored_bytes: self.params.expert_bytes * u64::from(counts.destinations)
                / u64::from(self.params.n_chunks),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry(expert_bytes: u64, tile_bytes: u32, chunk_bytes: u64) -> TileGeometry {
        TileGeometry {
            expert_bytes,
            slot_bytes: expert_bytes,
            tile_bytes,
            relay: RelayConfig {
                threshold: 4,
                chunk_bytes,
            },
        }
    }

    #[test]
    fn capacities_cover_every_slot_filled_with_every_tile_of_every_chunk() {
        let layout = Layout::contiguous(64, 256, 2).unwrap();
        // 8 MiB experts, 1 MiB chunks, 16 KiB tiles: 64 tiles a chunk, 512 an expert.
        let p = TilePlanParams::new(&layout, &geometry(8 << 20, 16 << 10, 1 << 20)).unwrap();
        assert_eq!((p.chunk_bytes, p.n_chunks), (1 << 20, 8));
        assert_eq!(p.edge_capacity, 128);
        assert_eq!(p.task_capacity, 128 * 512);
        assert_eq!(p.dst_capacity, 128 * 8);
        assert_eq!(p.flag_capacity, 2 * 8);
        // A short last chunk and a short last tile: 1000 bytes in 300-byte chunks, 128-byte
        // tiles: three chunks of 3 tiles and one of 100 bytes in 1 tile.
        let p = TilePlanParams::new(&layout, &geometry(1000, 128, 300)).unwrap();
        assert_eq!((p.chunk_bytes, p.n_chunks), (300, 4));
        assert_eq!(p.task_capacity, 128 * 10);
        // Chunk 0: the whole expert in one chunk.
        let p = TilePlanParams::new(&layout, &geometry(1000, 128, 0)).unwrap();
        assert_eq!(
            (p.chunk_bytes, p.n_chunks, p.task_capacity),
            (1000, 1, 128 * 8)
        );
        // R=64, C=128 u64s; 2E + 3I + 7C + 2 u32s with I = E + C = 384.
        assert_eq!(p.arena_bytes(), 8 * 576 + 4 * (512 + 1152 + 896 + 2));
    }

    #[test]
    fn impossible_geometries_are_refused() {
        let layout = Layout::contiguous(4, 8, 1).unwrap();
        let refused = |g: TileGeometry| TilePlanParams::new(&layout, &g).is_err();
        assert!(refused(geometry(0, 128, 0)));
        assert!(refused(geometry(1000, 100, 0)));
        assert!(refused(geometry(1000, 0, 0)));
        assert!(refused(TileGeometry {
            slot_bytes: 999,
            ..geometry(1000, 128, 0)
        }));
        // More tile tasks than 32-bit indices reach.
        let wide = Layout::contiguous(64, 64, 64).unwrap();
        assert!(TilePlanParams::new(&wide, &geometry(1 << 40, 16, 0)).is_err());
        assert_eq!(TilePlanFault::from_status(4), TilePlanFault::Destinations);
        assert_eq!(TilePlanFault::from_status(9), TilePlanFault::Unknown(9));
    }
}
