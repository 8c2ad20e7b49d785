//! Peer memory between the processes of a group ([`PeerWindows`]): every rank's receive side
//! of the MoE data plane, allocated once per lane as one window of shared device memory
//! ([`Executor::alloc_shared`]) and mapped into every other process of the group
//! ([`Executor::open_shared`]), the handles exchanged over the group's transport. With the
//! windows in place a source copies its rows straight into its destinations' receive buffers,
//! a destination its outputs straight back into its sources' return buffers, and ready flags
//! in the same windows order them ([`kernels/cuda/peer.cu`]): bytes move device to device, the
//! host only sizes the copies from the gathered counts.
//!
//! A window holds, for its rank: `[signal][source]` ready flags, the rows it receives
//! (bf16 `[rows, H]`, then u32 expert and instance ids `[rows]`), and the outputs of the pairs
//! it sent away (f32 `[pairs, H]`). Capacities follow the largest layer seen so far; a layer
//! that needs more grows every rank's window together (each rank derives the same sizes from
//! the same counts), after the device has finished with the old ones.
//!
//! Ordering across layers needs no extra barrier: a source writes layer `l + 1`'s rows only
//! after its combine of layer `l` waited for every destination's outputs, which each sent only
//! after its experts had read layer `l`'s rows; and a destination writes layer `l + 1`'s
//! outputs only after every source signalled its layer `l + 1` dispatch, queued behind that
//! source's combine of layer `l`.

use std::sync::Arc;
use std::time::Duration;

use super::super::exec::{
    DeviceBuffer, Executor, ExecutorExt, KernelArg, Launch, SharedHandle, Stream,
};
use super::super::CudaError;
use super::remote::HostExchange;
use super::routes::Routes;

/// The signals of a layer, each one word per source rank in every rank's flag array.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Signal {
    /// A source's rows are in every destination's window.
    Dispatch = 0,
    /// A destination's outputs are in every source's window.
    Combine = 1,
    /// A rank's replica slots are free and its ready counters zeroed: replicas may stream in.
    Armed = 2,
}

impl Signal {
    const COUNT: usize = 3;

    /// What a rank waits for on this signal.
    fn awaited(index: usize) -> &'static str {
        match index {
            0 => "dispatched rows",
            1 => "expert outputs",
            _ => "replica slots",
        }
    }
}

/// Environment variable bounding every wait on a peer's flag, in milliseconds.
pub const PEER_WAIT_ENV: &str = "RACKFILL_PEER_WAIT_MS";

/// The default bound: under the group watchdog's default (30 s), so a stalled peer is named by
/// the rank and layer that waited for it.
const DEFAULT_PEER_WAIT: Duration = Duration::from_secs(20);

/// The bound on a wait for a peer: [`PEER_WAIT_ENV`] when it holds whole milliseconds from 1,
/// else [`DEFAULT_PEER_WAIT`].
pub fn peer_wait_limit() -> Duration {
    std::env::var(PEER_WAIT_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|&ms| ms > 0)
        .map_or(DEFAULT_PEER_WAIT, Duration::from_millis)
}

/// Byte alignment of every part of a window.
const ALIGN: usize = 256;

fn aligned(bytes: usize) -> usize {
    bytes.div_ceil(ALIGN) * ALIGN
}

/// Where each part of a rank's window lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct WindowLayout {
    ranks: usize,
    hidden: usize,
    /// Rows a rank can receive.
    rows: usize,
    /// Pairs whose outputs a rank can get back.
    pairs: usize,
}

impl WindowLayout {
    fn rows_at(&self) -> usize {
        aligned(Signal::COUNT * self.ranks * 4)
    }

    fn experts_at(&self) -> usize {
        self.rows_at() + aligned(self.rows * self.hidden * 2)
    }

    fn instances_at(&self) -> usize {
        self.experts_at() + aligned(self.rows * 4)
    }

    fn returned_at(&self) -> usize {
        self.instances_at() + aligned(self.rows * 4)
    }

    fn bytes(&self) -> usize {
        self.returned_at() + aligned(self.pairs * self.hidden * 4)
    }
}

/// Where each part of a rank's replica window lies: its slot sets, its ready counters (one per
/// relay chunk it may forward), its landed-byte counters (one per slot).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ReplicaLayout {
    /// Bytes of every slot set.
    pub slots: usize,
    /// Ready counters.
    pub flags: usize,
    /// Slots per rank.
    pub n_slot: usize,
}

impl ReplicaLayout {
    pub fn flags_at(&self) -> usize {
        aligned(self.slots)
    }

    pub fn landed_at(&self) -> usize {
        self.flags_at() + aligned(self.flags * 4)
    }

    pub fn bytes(&self) -> usize {
        self.landed_at() + aligned(self.n_slot * 4)
    }
}

/// Every rank's window of one lane, as this process addresses them, and the lane's ready-flag
/// epoch.
pub(super) struct PeerWindows {
    layout: WindowLayout,
    /// World ranks this process holds.
    local: std::ops::Range<usize>,
    /// Per world rank: its window (this process's own for its ranks, mapped for the others').
    windows: Vec<Arc<DeviceBuffer>>,
    /// u64 `[ranks]`: every rank's flag array, as this process addresses it.
    flag_table: DeviceBuffer,
    /// u32: the first late source + 1 of a wait that gave up (0: none).
    stalled: DeviceBuffer,
    /// Per world rank: its replica window (slots, ready counters, landed bytes), mapped for as
    /// long as the lane's replica buffers address it.
    replicas: Vec<Arc<DeviceBuffer>>,
    /// The epoch the next layer signals with (every rank counts layers alike).
    epoch: u32,
    timeout: Duration,
}

impl PeerWindows {
    /// Windows for `ranks` ranks (this process holds `local`) of `hidden`-wide rows, mapped
    /// into every process of the group through `exchange` (every process calls this together);
    /// they grow to the first layer's rows ([`Self::ensure`]).
    /// Each rank also gets a replica window of `replica_bytes` ([`Self::replica_windows`]).
    pub fn open(
        exec: &dyn Executor,
        (ranks, local): (usize, std::ops::Range<usize>),
        hidden: usize,
        replica_bytes: usize,
        exchange: &dyn HostExchange,
    ) -> Result<Self, CudaError> {
        let layout = WindowLayout {
            ranks,
            hidden,
            rows: 1,
            pairs: 1,
        };
        let replicas = map_windows(exec, (ranks, local.clone()), replica_bytes, exchange)?;
        let windows = map_windows(exec, (ranks, local.clone()), layout.bytes(), exchange)?;
        let flag_table = exec.upload_u64(&windows.iter().map(|w| w.ptr()).collect::<Vec<_>>())?;
        Ok(Self {
            layout,
            local,
            windows,
            flag_table,
            stalled: exec.alloc_zeroed(4)?,
            replicas,
            epoch: 0,
            timeout: peer_wait_limit(),
        })
    }

    /// Grows every rank's window when `routes` needs more than they hold: the device finishes
    /// first (nothing may still read or write the old windows), and every process calls this
    /// for the same layer and decides alike from the same routes.
    pub fn ensure(
        &mut self,
        exec: &dyn Executor,
        routes: &Routes,
        exchange: &dyn HostExchange,
    ) -> Result<(), CudaError> {
        let ranks = self.layout.ranks;
        let (rows, pairs) = (needed_rows(routes, ranks), needed_pairs(routes, ranks));
        if rows <= self.layout.rows && pairs <= self.layout.pairs {
            return Ok(());
        }
        exec.synchronize()?;
        let layout = WindowLayout {
            rows: rows.max(self.layout.rows).next_power_of_two(),
            pairs: pairs.max(self.layout.pairs).next_power_of_two(),
            ..self.layout
        };
        // The exchange is a barrier too: every process has synchronised before any drops the
        // old windows it mapped.
        let windows = map_windows(exec, (ranks, self.local.clone()), layout.bytes(), exchange)?;
        let table: Vec<u64> = windows.iter().map(|w| w.ptr()).collect();
        self.flag_table = exec.upload_u64(&table)?;
        self.windows = windows;
        self.layout = layout;
        Ok(())
    }

    /// Every rank's replica window, as this process addresses it.
    pub fn replica_windows(&self) -> &[Arc<DeviceBuffer>] {
        &self.replicas
    }

    /// The epoch of the next layer's signals.
    pub fn next_epoch(&mut self) -> u32 {
        self.epoch = self.epoch.wrapping_add(1);
        self.epoch
    }

    /// Rank `rank`'s receive buffers, as this process addresses them: bf16 rows `[rows, H]`,
    /// expert ids and instance ids `[rows]`, each the whole capacity.
    pub fn receive(&self, rank: usize) -> Result<[DeviceBuffer; 3], CudaError> {
        let l = &self.layout;
        let w = &self.windows[rank];
        Ok([
            DeviceBuffer::view(w, l.rows_at(), l.rows * l.hidden * 2)?,
            DeviceBuffer::view(w, l.experts_at(), l.rows * 4)?,
            DeviceBuffer::view(w, l.instances_at(), l.rows * 4)?,
        ])
    }

    /// Rank `rank`'s return buffer (f32 `[pairs, H]`), as this process addresses it.
    pub fn returned(&self, rank: usize) -> Result<DeviceBuffer, CudaError> {
        let l = &self.layout;
        DeviceBuffer::view(&self.windows[rank], l.returned_at(), l.pairs * l.hidden * 4)
    }

    /// Queues, on `stream`, world rank `source`'s `signal` at `epoch` in every rank's flags.
    pub fn signal(
        &self,
        exec: &dyn Executor,
        stream: Stream,
        (signal, source): (Signal, usize),
        epoch: u32,
    ) -> Result<(), CudaError> {
        let ranks = self.layout.ranks;
        let word = (signal as usize * ranks + source) as u32;
        let args = [
            KernelArg::Ptr(self.flag_table.ptr()),
            KernelArg::U32(ranks as u32),
            KernelArg::U32(word),
            KernelArg::U32(epoch),
        ];
        // SAFETY: `peer_signal(flags[ranks], ranks, word, value)`: the table holds every rank's
        // window, whose flag array has `Signal::COUNT * ranks` words.
        unsafe { exec.launch_on(stream, "peer_signal", threads(ranks), &args) }
    }

    /// Queues, on `stream`, a bounded wait until every rank raised `signal` at `epoch` in local
    /// rank `rank`'s flags.
    pub fn wait(
        &self,
        exec: &dyn Executor,
        stream: Stream,
        (signal, rank): (Signal, usize),
        epoch: u32,
    ) -> Result<(), CudaError> {
        let ranks = self.layout.ranks;
        let args = [
            KernelArg::Ptr(self.windows[rank].ptr()),
            KernelArg::U32((signal as usize * ranks) as u32),
            KernelArg::U32(ranks as u32),
            KernelArg::U32(epoch),
            KernelArg::U64(self.timeout.as_nanos() as u64),
            KernelArg::Ptr(self.stalled.ptr()),
        ];
        // SAFETY: `peer_wait(flags, first, count, value, timeout_ns, stalled)` over rank
        // `rank`'s flag array (`Signal::COUNT * ranks` words) and this lane's stall word.
        unsafe { exec.launch_on(stream, "peer_wait", threads(ranks), &args) }
    }

    /// Fails when a wait queued on `stream` so far gave up (reads the stall word: waits for
    /// the stream), naming this process's first rank, what it waited for, and the source that
    /// never signalled.
    pub fn check(&self, exec: &dyn Executor, stream: Stream) -> Result<(), CudaError> {
        let stalled = exec.download_u32_on(stream, &self.stalled)?;
        match stalled.first().copied().unwrap_or(0) {
            0 => Ok(()),
            late => {
                let word = late as usize - 1;
                Err(CudaError::PeerStalled {
                    rank: self.local.start,
                    peer: word % self.layout.ranks,
                    stage: Signal::awaited(word / self.layout.ranks),
                    waited_ms: self.timeout.as_millis() as u64,
                })
            }
        }
    }
}

/// The most rows any rank receives under `routes`.
fn needed_rows(routes: &Routes, ranks: usize) -> usize {
    (0..ranks)
        .map(|r| routes.received(r))
        .max()
        .unwrap_or(0)
        .max(1)
}

/// The most pairs any rank sends under `routes` (and gets outputs back for).
fn needed_pairs(routes: &Routes, ranks: usize) -> usize {
    (0..ranks)
        .map(|r| routes.sent_total(r))
        .max()
        .unwrap_or(0)
        .max(1)
}

/// One window of `bytes` per local rank, allocated shared, and every other rank's mapped:
/// handles go to every rank through `exchange`, then every process reports whether it mapped
/// them all, so that either every process has peer memory or none uses it.
fn map_windows(
    exec: &dyn Executor,
    (ranks, local): (usize, std::ops::Range<usize>),
    bytes: usize,
    exchange: &dyn HostExchange,
) -> Result<Vec<Arc<DeviceBuffer>>, CudaError> {
    let mut own = Vec::with_capacity(local.len());
    let mut send = Vec::with_capacity(local.len());
    let mut failure = None;
    for rank in local.clone() {
        // A process that cannot allocate still joins the exchange (with an empty handle), so
        // that no other process waits for it.
        match exec.alloc_shared(bytes) {
            Ok((buffer, handle)) => {
                send.push(vec![handle.as_bytes().to_vec(); ranks]);
                own.push(Arc::new(buffer));
            }
            Err(err) => {
                failure.get_or_insert(format!("rank {rank}'s window: {err}"));
                send.push(vec![Vec::new(); ranks]);
            }
        }
    }
    let received = exchange.all_to_all(send).map_err(CudaError::Exec)?;
    let handles = received.into_iter().next().unwrap_or_default();
    let mut own = own.into_iter();
    let mut windows = Vec::with_capacity(ranks);
    for (rank, handle) in handles.into_iter().enumerate() {
        if local.contains(&rank) {
            if let Some(window) = own.next() {
                windows.push(window);
            }
            continue;
        }
        if failure.is_some() {
            continue;
        }
        match exec.open_shared(&SharedHandle::from_bytes(handle)) {
            Ok(buffer) => windows.push(Arc::new(buffer)),
            Err(err) => {
                failure.get_or_insert(format!("rank {rank}'s window: {err}"));
            }
        }
    }
    // Every process learns whether every other mapped every window.
    let verdict = vec![u8::from(failure.is_none())];
    let verdicts = exchange
        .all_to_all(vec![vec![verdict; ranks]; local.len()])
        .map_err(CudaError::Exec)?;
    let refused: Vec<usize> = verdicts
        .first()
        .map(|v| {
            v.iter()
                .enumerate()
                .filter(|(_, ok)| ok.first() != Some(&1))
                .map(|(rank, _)| rank)
                .collect()
        })
        .unwrap_or_default();
    if let Some(err) = failure {
        return Err(CudaError::Exec(format!("peer memory: {err}")));
    }
    if !refused.is_empty() {
        return Err(CudaError::Exec(format!(
            "peer memory: ranks {refused:?} could not map every window"
        )));
    }
    Ok(windows)
}

/// One thread per rank, in blocks of 128.
fn threads(ranks: usize) -> Launch {
    Launch::blocks(ranks.div_ceil(128).max(1) as u32, 128)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::exec::available;
    use rackfill_balancer::relay::TransferSchedule;
    use rackfill_balancer::Plan;
    use std::collections::BTreeMap;

    /// Every rank in this process: each message goes to its destination, as a group would.
    struct Loopback;

    impl HostExchange for Loopback {
        fn all_to_all(&self, send: Vec<Vec<Vec<u8>>>) -> Result<Vec<Vec<Vec<u8>>>, String> {
            let ranks = send.len();
            Ok((0..ranks)
                .map(|dst| (0..ranks).map(|src| send[src][dst].clone()).collect())
                .collect())
        }

        fn stream_replicas(
            &self,
            _: &Plan,
            _: &TransferSchedule,
            _: &BTreeMap<u32, Vec<u8>>,
            _: Vec<&mut [u8]>,
            _: usize,
        ) -> Result<Vec<u64>, String> {
            Err("not used".into())
        }
    }

    /// A wait ends once every rank signalled its epoch; a rank that never signals makes the
    /// wait give up within its bound, and the check names that rank and what was awaited.
    #[test]
    fn waits_end_on_every_signal_and_a_silent_rank_is_named_within_the_bound() {
        for exec in available() {
            let exec = exec.as_ref();
            let mut peers = PeerWindows::open(exec, (3, 0..3), 8, 256, &Loopback).unwrap();
            peers.timeout = Duration::from_millis(200);
            let stream = Stream::MAIN;
            let epoch = peers.next_epoch();
            for source in 0..3 {
                peers
                    .signal(exec, stream, (Signal::Dispatch, source), epoch)
                    .unwrap();
            }
            peers
                .wait(exec, stream, (Signal::Dispatch, 1), epoch)
                .unwrap();
            peers.check(exec, stream).unwrap();

            let epoch = peers.next_epoch();
            for source in [0, 2] {
                peers
                    .signal(exec, stream, (Signal::Combine, source), epoch)
                    .unwrap();
            }
            let started = std::time::Instant::now();
            peers
                .wait(exec, stream, (Signal::Combine, 2), epoch)
                .unwrap();
            let err = peers.check(exec, stream).unwrap_err();
            assert!(started.elapsed() < Duration::from_secs(10));
            assert_eq!(
                err,
                CudaError::PeerStalled {
                    rank: 0,
                    peer: 1,
                    stage: "expert outputs",
                    waited_ms: 200,
                },
                "{}",
                exec.describe()
            );
            assert!(err.to_string().contains("rank 1 stalled or died"), "{err}");
        }
    }

    /// Every part of a window has room for its capacity, aligned, apart from the others.
    #[test]
    fn window_parts_do_not_overlap() {
        let layout = WindowLayout {
            ranks: 4,
            hidden: 64,
            rows: 100,
            pairs: 300,
        };
        assert!(layout.rows_at() >= Signal::COUNT * 4 * 4);
        assert!(layout.experts_at() >= layout.rows_at() + 100 * 64 * 2);
        assert!(layout.instances_at() >= layout.experts_at() + 400);
        assert!(layout.returned_at() >= layout.instances_at() + 400);
        assert!(layout.bytes() >= layout.returned_at() + 300 * 64 * 4);
        assert_eq!(layout.returned_at() % ALIGN, 0);
        let replica = ReplicaLayout {
            slots: 1000,
            flags: 6,
            n_slot: 2,
        };
        assert!(replica.flags_at() >= 1000 && replica.landed_at() >= replica.flags_at() + 24);
        assert!(replica.bytes() >= replica.landed_at() + 8);
    }
}
