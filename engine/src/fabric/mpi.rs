//! The MPI fabric: one process per EP rank over a communicator of the system MPI. The counts
//! all-gather and the all-to-all-v are MPI collectives; replica chunks travel as point-to-point
//! messages in schedule order.
//!
//! Before any payload moves, every rank learns every other rank's view of the call (its shape, or
//! its verdict on the schedule) through one small all-gather, so a call that cannot proceed fails
//! on every rank with the same message instead of leaving the others waiting in a collective; the
//! group stays usable afterwards. Errors of MPI itself abort the job (MPI's default handler).

use std::borrow::Cow;
use std::collections::hash_map::{DefaultHasher, Entry};
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use ::mpi::collective::CommunicatorCollectives;
use ::mpi::datatype::{Partition, PartitionMut};
use ::mpi::environment::Threading;
use ::mpi::point_to_point::{Destination, Source};
use ::mpi::topology::{Communicator, SimpleCommunicator};
use ::mpi::traits::Equivalence;
use ::mpi::Count;
use rackfill_balancer::relay::TransferSchedule;
use rackfill_balancer::Plan;
use rackfill_kernels::TransferPlace;

use super::contract::{Fabric, Message, ReplicaBuffers};
use crate::error::{EngineError, Result};

/// Tags of replica chunks are schedule indices modulo this: the standard guarantees tags up to
/// 32767 (`MPI_TAG_UB` is at least that). Messages match correctly whatever the tag, because
/// each receiver posts its receives from a sender in the order that sender posts its sends (the
/// schedule's) and MPI never lets a message overtake an earlier one on the same pair and
/// communicator; the tag and the received length check that order.
const TAG_SPAN: usize = 32_768;

/// The most elements one MPI call counts or displaces (a C `int`).
const COUNT_LIMIT: u64 = i32::MAX as u64;

/// Bytes of a rank's reason for refusing a call that the other ranks get (the rest is cut).
const REASON_LIMIT: u64 = 4096;

/// The fabric of one process holding one rank of an MPI communicator: world size is the
/// communicator's size, the local rank its rank in it. Drop it before MPI is finalised (before
/// the `Universe`): dropping it frees its communicator.
pub struct MpiFabric {
    /// Every call takes the lock for its whole duration: one collective at a time, in the order
    /// the runtime issues them.
    comm: Mutex<Comm>,
    rank: usize,
    world: usize,
    moved: AtomicU64,
}

/// The communicator, movable to the thread that uses the fabric.
struct Comm(SimpleCommunicator);

// SAFETY: a `SimpleCommunicator` is an MPI handle with no thread affinity; MPI forbids only
// concurrent unsynchronised use of it below `MPI_THREAD_MULTIPLE`. `MpiFabric::new` refuses a
// process that did not get `MPI_THREAD_MULTIPLE`, so any thread may call MPI at all, and the
// fabric uses its communicator only under its mutex, so calls on it never overlap: operations
// of a collective are issued in one order on every process, from whichever thread holds the lock.
unsafe impl Send for Comm {}

impl MpiFabric {
    /// The fabric over `comm` (a communicator of its own, e.g. a duplicate of the world's, so
    /// that its messages never meet the control plane's). MPI must run at
    /// `MPI_THREAD_MULTIPLE`: the runtime calls the fabric from its engine thread while other
    /// threads use MPI.
    pub fn new(comm: SimpleCommunicator) -> Result<Self> {
        let level = ::mpi::environment::threading_support();
        if level != Threading::Multiple {
            return Err(EngineError::Fabric(format!(
                "MPI runs at threading level {level:?}; the MPI fabric needs Multiple \
                 (MPI_THREAD_MULTIPLE)"
            )));
        }
        let (rank, world) = (comm.rank() as usize, comm.size() as usize);
        Ok(Self {
            comm: Mutex::new(Comm(comm)),
            rank,
            world,
            moved: AtomicU64::new(0),
        })
    }

    fn comm(&self) -> Result<MutexGuard<'_, Comm>> {
        self.comm.lock().map_err(|_| {
            EngineError::Fabric("an MPI fabric call panicked; the group is unusable".into())
        })
    }

    fn count(&self, bytes: u64) {
        self.moved.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Checks a replica stream on this rank (the schedule, its buffers, its home experts) and
    /// resolves where every transfer reads and writes: what every rank then agrees on.
    fn prepare_stream<'a>(
        &self,
        plan: &Plan,
        schedule: &TransferSchedule,
        buffers: &ReplicaBuffers<'a>,
    ) -> std::result::Result<Prepared<'a>, String> {
        if buffers.slots.len() != 1 {
            return Err(format!(
                "replica stream: {} slot buffers for the one local rank {}",
                buffers.slots.len(),
                self.rank
            ));
        }
        let places = buffers.check_schedule(plan, schedule, &self.local_ranks(), self.world)?;
        let me = self.rank as u32;
        let mut homes: HashMap<u32, Vec<&'a [u8]>> = HashMap::new();
        let mut sends = Vec::with_capacity(places.len());
        for (index, (t, place)) in schedule.transfers.iter().zip(&places).enumerate() {
            if t.len > COUNT_LIMIT {
                return Err(format!(
                    "replica stream: transfer {index} moves {} bytes, more than one MPI message \
                     carries",
                    t.len
                ));
            }
            if t.src != me {
                sends.push(None);
                continue;
            }
            if let Some(at) = place.from_slot {
                sends.push(Some(Outgoing::Relay { at }));
                continue;
            }
            let segments = match homes.entry(t.expert) {
                Entry::Occupied(home) => home.into_mut(),
                Entry::Vacant(home) => {
                    let segments = (buffers.source)(t.expert);
                    let bytes: usize = segments.iter().map(|s| s.len()).sum();
                    if bytes != buffers.expert_bytes {
                        return Err(format!(
                            "replica stream: expert {} has {bytes} bytes, expected {}",
                            t.expert, buffers.expert_bytes
                        ));
                    }
                    home.insert(segments)
                }
            };
            let chunk = chunk_of(segments, t.offset as usize, t.len as usize);
            sends.push(Some(Outgoing::Home(chunk)));
        }
        Ok(Prepared { places, sends })
    }
}

/// A replica stream checked on this rank.
struct Prepared<'a> {
    places: Vec<TransferPlace>,
    /// Per transfer: what this rank sends, `None` where it does not send.
    sends: Vec<Option<Outgoing<'a>>>,
}

/// What a rank sends for one transfer.
enum Outgoing<'a> {
    /// Stage 1: a chunk of its home expert.
    Home(Cow<'a, [u8]>),
    /// Stage 2: the chunk at this byte of its own slot buffer, forwarded once it has landed.
    Relay { at: usize },
}

/// Bytes `offset..offset + len` of an expert given as consecutive segments: borrowed when one
/// segment holds them all, else copied together.
fn chunk_of<'a>(segments: &[&'a [u8]], offset: usize, len: usize) -> Cow<'a, [u8]> {
    let end = offset + len;
    let mut start = 0;
    for &segment in segments {
        let stop = start + segment.len();
        if start <= offset && end <= stop {
            return Cow::Borrowed(&segment[offset - start..end - start]);
        }
        start = stop;
    }
    let mut bytes = Vec::with_capacity(len);
    let mut start = 0;
    for &segment in segments {
        let stop = start + segment.len();
        let (from, to) = (offset.max(start), end.min(stop));
        if from < to {
            bytes.extend_from_slice(&segment[from - start..to - start]);
        }
        start = stop;
    }
    Cow::Owned(bytes)
}

/// What every rank must hold identical for a replica stream to match up: the plan's slots and
/// homes, the transfers and the buffer geometry.
fn stream_digest(plan: &Plan, schedule: &TransferSchedule, buffers: &ReplicaBuffers<'_>) -> u64 {
    // SipHash with fixed keys: the same value in every process of one build (a group whose
    // processes run different builds may see a false mismatch: a clean failure, never a hang).
    let mut hasher = DefaultHasher::new();
    (buffers.slot_bytes, buffers.expert_bytes).hash(&mut hasher);
    for rank in 0..plan.ranks() {
        plan.rank_slots(rank).hash(&mut hasher);
    }
    for expert in 0..plan.experts() {
        plan.instances(expert)[0].rank.hash(&mut hasher);
    }
    for t in &schedule.transfers {
        (t.expert, t.chunk, t.offset, t.len, t.src, t.dst, t.stage).hash(&mut hasher);
    }
    hasher.finish()
}

/// Every rank's verdict and digest, gathered: `verdict` if every rank accepted the call with the
/// same digest, else the same error on every rank (the lowest failing rank's reason).
fn agree<T>(
    comm: &SimpleCommunicator,
    verdict: std::result::Result<T, String>,
    digest: u64,
) -> Result<T> {
    let world = comm.size() as usize;
    let why: &[u8] = match &verdict {
        Ok(_) => &[],
        Err(why) => why.as_bytes(),
    };
    let mut heads = vec![0u64; 2 * world];
    comm.all_gather_into(&[why.len() as u64, digest][..], &mut heads[..]);
    let lens: Vec<Count> = heads
        .chunks_exact(2)
        .map(|head| head[0].min(REASON_LIMIT) as Count)
        .collect();
    if let Some(first) = lens.iter().position(|&len| len > 0) {
        let displs = offsets(&lens);
        let total = displs[world - 1] + lens[world - 1];
        let mut all = vec![0u8; total as usize];
        let mine = &why[..lens[comm.rank() as usize] as usize];
        comm.all_gather_varcount_into(
            mine,
            &mut PartitionMut::new(&mut all[..], &lens[..], &displs[..]),
        );
        let at = displs[first] as usize;
        let text = String::from_utf8_lossy(&all[at..at + lens[first] as usize]);
        return Err(EngineError::Fabric(format!("{text} (rank {first})")));
    }
    let digests: Vec<u64> = heads.chunks_exact(2).map(|head| head[1]).collect();
    if let Some(rank) = digests.iter().position(|&d| d != digests[0]) {
        return Err(EngineError::Fabric(format!(
            "replica stream: rank {rank}'s plan or schedule differs from rank 0's; nothing moved"
        )));
    }
    verdict.map_err(EngineError::Fabric)
}

/// Displacements of consecutive blocks of `counts` elements.
fn offsets(counts: &[Count]) -> Vec<Count> {
    counts
        .iter()
        .scan(0, |at, &n| {
            let start = *at;
            *at += n;
            Some(start)
        })
        .collect()
}

impl Fabric for MpiFabric {
    fn world_size(&self) -> usize {
        self.world
    }

    fn local_ranks(&self) -> Range<usize> {
        self.rank..self.rank + 1
    }

    /// Two all-gathers: every rank's shape (rows given, row width), checked alike on every rank,
    /// then the rows.
    fn all_gather(&self, rows: &[Vec<u64>]) -> Result<Vec<Vec<u64>>> {
        let comm = self.comm()?;
        let world = self.world;
        let mut shapes = vec![0u64; 2 * world];
        let width = rows.first().map_or(0, Vec::len) as u64;
        comm.0
            .all_gather_into(&[rows.len() as u64, width][..], &mut shapes[..]);
        let shapes: Vec<&[u64]> = shapes.chunks_exact(2).collect();
        if let Some(rank) = shapes.iter().position(|shape| shape[0] != 1) {
            return Err(EngineError::Fabric(format!(
                "all-gather: rank {rank} gave {} rows for its one rank",
                shapes[rank][0]
            )));
        }
        let width = shapes[0][1];
        if let Some(rank) = shapes.iter().position(|shape| shape[1] != width) {
            return Err(EngineError::Fabric(format!(
                "all-gather: rank {rank} contributed {} counts, rank 0 {width}",
                shapes[rank][1]
            )));
        }
        if width.saturating_mul(world as u64) > COUNT_LIMIT {
            return Err(EngineError::Fabric(format!(
                "all-gather: {world} rows of {width} counts exceed what one MPI call carries"
            )));
        }
        let width = width as usize;
        let mut flat = vec![0u64; width * world];
        comm.0.all_gather_into(&rows[0][..], &mut flat[..]);
        self.count(((world - 1) * width * 8) as u64);
        Ok(if width == 0 {
            vec![Vec::new(); world]
        } else {
            flat.chunks_exact(width).map(<[u64]>::to_vec).collect()
        })
    }

    /// An all-gather of every rank's word counts per destination (so every rank checks every
    /// send and receive total alike), then one all-to-all-v of the packed messages: per
    /// destination, its rows' f32 bits then its ids. The rank's message to itself stays here.
    fn all_to_all_v(&self, send: Vec<Vec<Message>>) -> Result<Vec<Vec<Message>>> {
        let comm = self.comm()?;
        let (world, me) = (self.world, self.rank);
        // [messages given, ranks addressed, then (rows, ids) words per destination].
        let stride = 2 + 2 * world;
        let mut mine = vec![0u64; stride];
        mine[0] = send.len() as u64;
        mine[1] = send.first().map_or(0, Vec::len) as u64;
        if let [row] = &send[..] {
            if row.len() == world {
                for (dst, message) in row.iter().enumerate().filter(|&(dst, _)| dst != me) {
                    mine[2 + 2 * dst] = message.rows.len() as u64;
                    mine[3 + 2 * dst] = message.ids.len() as u64;
                }
            }
        }
        let mut matrix = vec![0u64; world * stride];
        comm.0.all_gather_into(&mine[..], &mut matrix[..]);
        let words = |src: usize, dst: usize| -> (u64, u64) {
            let at = src * stride + 2 + 2 * dst;
            (matrix[at], matrix[at + 1])
        };
        for rank in 0..world {
            let (given, addressed) = (matrix[rank * stride], matrix[rank * stride + 1]);
            if given != 1 {
                return Err(EngineError::Fabric(format!(
                    "all-to-all: rank {rank} gave {given} message rows for its one rank"
                )));
            }
            if addressed != world as u64 {
                return Err(EngineError::Fabric(format!(
                    "all-to-all: rank {rank} addressed {addressed} ranks of {world}"
                )));
            }
        }
        for rank in 0..world {
            let total = |pair: fn(usize, usize) -> (usize, usize)| -> u64 {
                (0..world)
                    .map(|other| {
                        let (src, dst) = pair(rank, other);
                        let (rows, ids) = words(src, dst);
                        rows.saturating_add(ids)
                    })
                    .fold(0u64, u64::saturating_add)
            };
            let (sent, received) = (total(|r, o| (r, o)), total(|r, o| (o, r)));
            if sent.max(received) > COUNT_LIMIT {
                return Err(EngineError::Fabric(format!(
                    "all-to-all: rank {rank} would send {sent} and receive {received} words, \
                     more than one MPI call carries ({COUNT_LIMIT})"
                )));
            }
        }

        let send_counts: Vec<Count> = (0..world)
            .map(|dst| {
                let (rows, ids) = words(me, dst);
                (rows + ids) as Count
            })
            .collect();
        let recv_counts: Vec<Count> = (0..world)
            .map(|src| {
                let (rows, ids) = words(src, me);
                (rows + ids) as Count
            })
            .collect();
        let (send_displs, recv_displs) = (offsets(&send_counts), offsets(&recv_counts));
        let mut packed: Vec<u32> = Vec::with_capacity(send_counts.iter().sum::<Count>() as usize);
        let mut own = Message::default();
        for (dst, message) in send.into_iter().flatten().enumerate() {
            if dst == me {
                own = message;
            } else {
                packed.extend_from_slice(bytemuck::cast_slice(&message.rows));
                packed.extend_from_slice(&message.ids);
            }
        }
        let mut arrived = vec![0u32; recv_counts.iter().sum::<Count>() as usize];
        comm.0.all_to_all_varcount_into(
            &Partition::new(&packed[..], &send_counts[..], &send_displs[..]),
            &mut PartitionMut::new(&mut arrived[..], &recv_counts[..], &recv_displs[..]),
        );
        drop(packed);

        let mut own = Some(own);
        let mut recv = Vec::with_capacity(world);
        for src in 0..world {
            if src == me {
                recv.push(own.take().unwrap_or_default());
                continue;
            }
            let at = recv_displs[src] as usize;
            let rows = words(src, me).0 as usize;
            let end = at + recv_counts[src] as usize;
            let message = Message {
                rows: bytemuck::cast_slice(&arrived[at..at + rows]).to_vec(),
                ids: arrived[at + rows..end].to_vec(),
            };
            self.count(message.bytes());
            recv.push(message);
        }
        Ok(vec![recv])
    }

    /// Every rank walks the schedule in order: it posts a nonblocking send for each transfer it
    /// sends (stage 1 from its home expert, stage 2 from its own slot, whose chunk has landed by
    /// then) and receives each transfer addressed to it before going on. No deadlock: the
    /// earliest unfinished transfer always has its receiver at it (every earlier receive of that
    /// rank is done and sends never wait) and its sender past it (every earlier receive of the
    /// sender is done), so it completes. Every slot byte ends as the schedule writes it, whatever
    /// the timing: the bytes [`super::LocalFabric`] writes.
    fn stream_replicas(
        &self,
        plan: &Plan,
        schedule: &TransferSchedule,
        mut buffers: ReplicaBuffers<'_>,
    ) -> Result<Vec<u64>> {
        let comm = self.comm()?;
        let verdict = self.prepare_stream(plan, schedule, &buffers);
        let digest = stream_digest(plan, schedule, &buffers);
        let Prepared { places, sends } = agree(&comm.0, verdict, digest)?;

        let me = self.rank as u32;
        // A buffer per forwarded chunk, alive until its send completes.
        let mut forwards: Vec<Vec<u8>> = schedule
            .transfers
            .iter()
            .zip(&sends)
            .map(|(t, send)| match send {
                Some(Outgoing::Relay { .. }) => Vec::with_capacity(t.len as usize),
                _ => Vec::new(),
            })
            .collect();
        let slot: &mut [u8] = buffers.slots[0];
        let mut received = 0u64;
        let mut short = None;
        ::mpi::request::scope(|scope| {
            let mut requests = Vec::new();
            let steps = schedule.transfers.iter().zip(&places).zip(&sends);
            for (index, (((t, place), send), forward)) in steps.zip(forwards.iter_mut()).enumerate()
            {
                let tag = (index % TAG_SPAN) as i32;
                let len = t.len as usize;
                if let Some(send) = send {
                    let bytes: &[u8] = match send {
                        Outgoing::Home(chunk) => chunk,
                        Outgoing::Relay { at } => {
                            forward.extend_from_slice(&slot[*at..*at + len]);
                            forward
                        }
                    };
                    let dst = comm.0.process_at_rank(t.dst as i32);
                    requests.push(dst.immediate_send_with_tag(scope, bytes, tag));
                }
                if t.dst == me {
                    let at = place.to_slot;
                    let src = comm.0.process_at_rank(t.src as i32);
                    let status = src.receive_into_with_tag(&mut slot[at..at + len], tag);
                    let got = status.count(u8::equivalent_datatype());
                    if got as usize != len && short.is_none() {
                        short = Some(format!(
                            "replica stream: transfer {index} delivered {got} of its {len} bytes"
                        ));
                    }
                    received += len as u64;
                }
            }
            for request in requests {
                request.wait();
            }
        });
        if let Some(why) = short {
            return Err(EngineError::Fabric(why));
        }
        self.count(received);
        Ok(vec![received])
    }

    fn spans_processes(&self) -> bool {
        true
    }

    fn bytes_moved(&self) -> u64 {
        self.moved.load(Ordering::Relaxed)
    }
}
