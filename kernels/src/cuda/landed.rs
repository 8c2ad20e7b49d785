//! How many bytes have landed in every rank's every slot during one replication: `tile_stream`
//! adds each tile it stores to its slot's counter (after the bytes are visible, like a relay
//! counter), and `wait_slot` holds a stream until one slot's counter reaches the expert's bytes,
//! so a GEMM reading that replica can start while other replicas still stream.

use super::exec::{DeviceBuffer, Executor, ExecutorExt, KernelArg, Launch, Stream};
use super::{to_u32, CudaError};

/// Every rank's landed-byte counters: this process's ranks' own (`n_slot` u32 each), and a
/// table of every rank's, as the kernel addresses them (other processes' in peer memory).
pub struct LandedBytes {
    /// Per local rank: u32 `[n_slot]`.
    counters: Vec<DeviceBuffer>,
    /// u64 `[world rank]`: each rank's counters.
    table: DeviceBuffer,
    slot_bytes: u64,
    n_slot: u32,
}

impl LandedBytes {
    /// Counters for `ranks` ranks, all of this process, of `n_slot` slots of `slot_bytes` each
    /// (a slot's bytes must fit a `u32` counter).
    pub fn new(
        exec: &dyn Executor,
        ranks: usize,
        n_slot: usize,
        slot_bytes: u64,
    ) -> Result<Self, CudaError> {
        let counters = (0..ranks)
            .map(|_| exec.alloc_zeroed(4 * n_slot))
            .collect::<Result<Vec<_>, _>>()?;
        let table: Vec<u64> = counters.iter().map(DeviceBuffer::ptr).collect();
        Self::over(exec, counters, &table, (n_slot, slot_bytes))
    }

    /// Counters in peer memory: `counters[i]` this process's ranks' (`n_slot` words each, in
    /// windows other processes map), `world[r]` every rank's as this process addresses them.
    pub fn over(
        exec: &dyn Executor,
        counters: Vec<DeviceBuffer>,
        world: &[u64],
        (n_slot, slot_bytes): (usize, u64),
    ) -> Result<Self, CudaError> {
        if slot_bytes > u64::from(u32::MAX) {
            return Err(crate::KernelError::Overflow {
                what: "slot bytes (landed-byte counters are 32-bit)",
            }
            .into());
        }
        if let Some(short) = counters.iter().find(|c| c.bytes() < 4 * n_slot) {
            return Err(crate::KernelError::Length {
                what: "landed-byte counters",
                len: short.bytes(),
                expected: 4 * n_slot,
            }
            .into());
        }
        Ok(Self {
            counters,
            table: exec.upload_u64(world)?,
            slot_bytes,
            n_slot: to_u32(n_slot, "slots per rank")?,
        })
    }

    /// The table of every rank's counters (what `tile_stream` adds to).
    pub(crate) fn table(&self) -> &DeviceBuffer {
        &self.table
    }

    /// Bytes of a slot (what locates a tile's slot from its offset).
    pub(crate) fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }

    /// Queues zeroing this process's counters on `stream` (before each replication).
    pub fn reset(&self, exec: &dyn Executor, stream: Stream) -> Result<(), CudaError> {
        for c in &self.counters {
            exec.zero_on(stream, c, 0, c.bytes())?;
        }
        Ok(())
    }

    /// This process's counters, `[rank * n_slot + slot]`, after the work `stream` queued
    /// (tests, debugging).
    pub fn read(&self, exec: &dyn Executor, stream: Stream) -> Result<Vec<u32>, CudaError> {
        let mut out = Vec::with_capacity(self.counters.len() * self.n_slot as usize);
        for c in &self.counters {
            out.extend(&exec.download_u32_on(stream, c)?[..self.n_slot as usize]);
        }
        Ok(out)
    }

    /// Queues on `stream` a wait until this process's rank `rank` (its index) has `bytes`
    /// landed bytes in slot `slot`; it gives up when the replication's stall word (the second
    /// word of `counter`) is raised, or raises it after the stall limit.
    pub(crate) fn wait(
        &self,
        exec: &dyn Executor,
        stream: Stream,
        (rank, slot): (usize, usize),
        bytes: u64,
        counter: &DeviceBuffer,
    ) -> Result<(), CudaError> {
        let counters = self
            .counters
            .get(rank)
            .filter(|_| slot < self.n_slot as usize)
            .ok_or(crate::KernelError::OutOfRange {
                what: "slot to wait for",
                value: (rank * self.n_slot as usize + slot) as u64,
                limit: self.counters.len() as u64 * u64::from(self.n_slot),
            })?;
        let args = [
            KernelArg::from(counters),
            KernelArg::U32(to_u32(slot, "slot index")?),
            KernelArg::U32(to_u32(bytes as usize, "slot bytes")?),
            KernelArg::Ptr(counter.at(4)),
        ];
        // SAFETY: `wait_slot(landed, index, target, stalled)`; `slot` is inside the rank's
        // counters (checked above) and the stall word is the second `u32` of a live counter
        // pair.
        unsafe { exec.launch_on(stream, "wait_slot", Launch::blocks(1, 32), &args) }
    }
}
