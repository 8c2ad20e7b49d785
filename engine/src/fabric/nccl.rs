//! The NCCL fabric: one process per EP rank, one GPU per process, rank-to-rank bytes moved by
//! NCCL between the processes' GPUs (NVLink, or the network across hosts).
//!
//! The [`Fabric`] trait hands host buffers today, so every call stages through the device: the
//! bytes a rank sends are copied to its GPU, NCCL moves them, and what it received is copied
//! back. That costs two host-device copies per call, which the whole-model-on-GPU work removes
//! by handing device buffers to [`rackfill_kernels::cuda::nccl::Comm`] directly.
//!
//! Every call starts with a header all-gather (each rank's status and sizes), so a rank whose
//! own contribution is refused (wrong shape, a bad schedule) still joins the call: every rank
//! then fails it with the same verdict, and the fabric refuses every later call, as the
//! [`Fabric`] contract asks of a group of several processes.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use mpi::topology::SimpleCommunicator;
use mpi::traits::{Communicator, CommunicatorCollectives, Root};
use rackfill_balancer::relay::TransferSchedule;
use rackfill_balancer::Plan;
use rackfill_kernels::cuda::nccl::{Comm, PeerOp, UniqueId};
use rackfill_kernels::TransferPlace;

use super::contract::{Fabric, Message, ReplicaBuffers};
use super::nccl_probe::probe_nccl;
use crate::error::{EngineError, Result};

/// One EP rank's NCCL fabric: world rank = EP rank = NCCL rank, one local rank.
///
/// `Send + Sync`: the communicator (a raw NCCL handle, `Send` only) lives behind a mutex that
/// every call holds from its first NCCL operation to its last, so calls from several threads
/// are serialised, as NCCL requires of one communicator, and each call binds the device's
/// context to its own thread before touching it.
#[derive(Debug)]
pub struct NcclFabric {
    rank: usize,
    world: usize,
    state: Mutex<State>,
    moved: AtomicU64,
}

#[derive(Debug)]
struct State {
    comm: Comm,
    /// Why the group stopped (a refused or failed call); every later call fails with it.
    failed: Option<String>,
}

/// What a rank contributes to a call's header: `Ok` with its sizes, or why its own
/// contribution was refused.
type Contribution<T> = std::result::Result<T, String>;

impl NcclFabric {
    /// Joins every rank of `comm` (world rank = EP rank) into one NCCL communicator on CUDA
    /// device `device` (the process's local rank on its host, chosen by the caller), the
    /// standard way: every rank checks that it can run NCCL and agrees on it over MPI, rank 0
    /// creates the unique id and broadcasts its 128 bytes, and every rank calls
    /// `ncclCommInitRank`. Collective over `comm`: every rank calls it, and every rank fails,
    /// naming the ranks that cannot run NCCL, when one cannot (none is left waiting).
    pub fn new(comm: SimpleCommunicator, device: usize) -> Result<Self> {
        let rank = comm.rank() as usize;
        let world = comm.size() as usize;
        let ready = preflight(device);
        let mut verdicts = vec![0u8; world];
        comm.all_gather_into(&u8::from(ready.is_ok()), &mut verdicts[..]);
        if let Some(why) = refusals(&verdicts, &ready, "cannot run NCCL") {
            return Err(EngineError::Fabric(why));
        }
        // Rank 0's id, or a zero first byte when it could not make one.
        let mut packet = [0u8; 1 + UniqueId::BYTES];
        let made = if rank == 0 {
            Some(UniqueId::new())
        } else {
            None
        };
        if let Some(Ok(id)) = &made {
            packet[0] = 1;
            packet[1..].copy_from_slice(&id.to_bytes());
        }
        comm.process_at_rank(0).broadcast_into(&mut packet[..]);
        if packet[0] == 0 {
            let why = match made {
                Some(Err(e)) => e.to_string(),
                _ => "see rank 0's log".to_string(),
            };
            return Err(EngineError::Fabric(format!(
                "rank 0 could not create the NCCL unique id: {why}"
            )));
        }
        let mut id = [0u8; UniqueId::BYTES];
        id.copy_from_slice(&packet[1..]);
        let nccl = Comm::init_rank(device, rank, world, UniqueId::from_bytes(id))
            .map_err(|e| EngineError::Fabric(format!("rank {rank} (device {device}): {e}")))?;
        Ok(Self {
            rank,
            world,
            state: Mutex::new(State {
                comm: nccl,
                failed: None,
            }),
            moved: AtomicU64::new(0),
        })
    }

    /// The communicator, unless an earlier call stopped the group.
    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        let state = self
            .state
            .lock()
            .map_err(|_| EngineError::Fabric("an NCCL fabric call panicked".into()))?;
        match &state.failed {
            Some(why) => Err(EngineError::Fabric(why.clone())),
            None => Ok(state),
        }
    }

    /// Exchanges every rank's header: `mine` is this rank's sizes (`width` of them), or why its
    /// contribution was refused. Returns every rank's sizes in rank order, or fails the call on
    /// every rank when one refused its contribution.
    fn headers(
        &self,
        state: &mut State,
        what: &str,
        width: usize,
        mine: Contribution<Vec<u64>>,
    ) -> Result<Vec<Vec<u64>>> {
        let mut row = vec![0u64; 1 + width];
        match &mine {
            Ok(sizes) if sizes.len() == width => {
                row[0] = 1;
                row[1..].copy_from_slice(sizes);
            }
            _ => {}
        }
        let bytes = nccl(state, |c| c.all_gather_host(bytemuck::cast_slice(&row)))?;
        let rows: Vec<Vec<u64>> = bytes.chunks_exact(8 * (1 + width)).map(words).collect();
        let verdicts: Vec<u8> = rows.iter().map(|r| r[0] as u8).collect();
        if let Some(why) = refusals(&verdicts, &mine, &format!("refused its {what}")) {
            return Err(stop(state, why));
        }
        Ok(rows.into_iter().map(|r| r[1..].to_vec()).collect())
    }

    fn count(&self, bytes: u64) {
        self.moved.fetch_add(bytes, Ordering::Relaxed);
    }

    /// This rank's one contribution of `got`, or why there is not exactly one.
    fn one<T>(&self, what: &str, got: Vec<T>) -> Contribution<T> {
        let n = got.len();
        match <[T; 1]>::try_from(got) {
            Ok([only]) => Ok(only),
            Err(_) => Err(format!(
                "{what}: {n} contributions for local ranks {:?}",
                self.local_ranks()
            )),
        }
    }
}

/// Can this process run NCCL on `device`? The library loads and the device exists.
fn preflight(device: usize) -> std::result::Result<(), String> {
    probe_nccl()?;
    let gpu =
        rackfill_kernels::cuda::probe().map_err(|e| format!("no usable GPU for NCCL ({e})"))?;
    if device >= gpu.devices {
        return Err(format!(
            "device {device} does not exist ({} visible)",
            gpu.devices
        ));
    }
    Ok(())
}

/// `None` when every verdict is 1; else the group's error: this rank's own reason when it
/// refused, and the ranks that refused.
fn refusals<T>(
    verdicts: &[u8],
    mine: &std::result::Result<T, String>,
    what: &str,
) -> Option<String> {
    let refused: Vec<usize> = (0..verdicts.len()).filter(|&r| verdicts[r] != 1).collect();
    if refused.is_empty() {
        return None;
    }
    let list = refused
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    let ranks = if refused.len() == 1 {
        format!("rank {list}")
    } else {
        format!("ranks {list}")
    };
    Some(match mine {
        Err(why) => format!("{why} ({ranks} {what})"),
        Ok(_) => format!("{ranks} {what}"),
    })
}

/// Runs an NCCL step; an error stops the group (its peers may have moved on without it).
fn nccl<T>(
    state: &mut State,
    step: impl FnOnce(&Comm) -> std::result::Result<T, rackfill_kernels::cuda::nccl::NcclError>,
) -> Result<T> {
    step(&state.comm).map_err(|e| stop(state, format!("NCCL: {e}")))
}

/// Marks the group stopped with `why` and returns it as the call's error.
fn stop(state: &mut State, why: String) -> EngineError {
    state.failed.get_or_insert_with(|| why.clone());
    EngineError::Fabric(why)
}

/// The home experts `me` seeds (stage-1 sources), each read once and concatenated: where each
/// starts in the result, and the bytes.
#[allow(clippy::type_complexity)]
fn stage_homes<'a>(
    schedule: &TransferSchedule,
    source: &'a dyn Fn(u32) -> Vec<&'a [u8]>,
    expert_bytes: usize,
    me: usize,
) -> std::result::Result<(HashMap<u32, usize>, Vec<u8>), String> {
    let mut homes: HashMap<u32, usize> = HashMap::new();
    let mut staged = Vec::new();
    for t in &schedule.transfers {
        if t.stage != 1 || t.src as usize != me || homes.contains_key(&t.expert) {
            continue;
        }
        let home = source(t.expert).concat();
        if home.len() != expert_bytes {
            return Err(format!(
                "replica stream: expert {} has {} bytes, expected {expert_bytes}",
                t.expert,
                home.len()
            ));
        }
        homes.insert(t.expert, staged.len());
        staged.extend_from_slice(&home);
    }
    Ok((homes, staged))
}

/// Each transfer's chunk wave: a stage-1 copy of chunk `c` goes in wave `c`, a stage-2 copy at
/// least one wave after the copy that delivered its bytes to the relay. Relays thus forward
/// chunk `c` while `c + 1` arrives, and only what has landed. Every rank computes the same
/// waves from the same (checked) schedule.
fn chunk_waves(schedule: &TransferSchedule) -> Vec<u64> {
    let mut delivered_in: HashMap<(u32, u32, u64, u64), u64> = HashMap::new();
    let mut waves = Vec::with_capacity(schedule.transfers.len());
    for t in &schedule.transfers {
        let chunk = u64::from(t.chunk);
        let wave = match delivered_in.get(&(t.src, t.expert, t.offset, t.len)) {
            Some(&producer) if t.stage == 2 => chunk.max(producer + 1),
            _ => chunk,
        };
        delivered_in.insert((t.dst, t.expert, t.offset, t.len), wave);
        waves.push(wave);
    }
    waves
}

/// One rank's side of a replica stream as NCCL operations on one host buffer: the staged home
/// experts, then the rank's slots from `slots_at`.
#[derive(Debug)]
struct ReplicaOps {
    /// Operations per chunk wave, keyed by the wave (the same numbering on every rank), each in
    /// schedule order, so two ranks list the copies between them in the same order.
    waves: BTreeMap<u64, Vec<PeerOp>>,
    /// Slot bytes this rank receives.
    landed: Vec<Range<usize>>,
    received: u64,
}

fn replica_ops(
    schedule: &TransferSchedule,
    places: &[TransferPlace],
    homes: &HashMap<u32, usize>,
    slots_at: usize,
    me: usize,
) -> ReplicaOps {
    let mut ops = ReplicaOps {
        waves: BTreeMap::new(),
        landed: Vec::new(),
        received: 0,
    };
    let transfers = schedule.transfers.iter().zip(places);
    for ((t, place), wave) in transfers.zip(chunk_waves(schedule)) {
        let (src, dst, len) = (t.src as usize, t.dst as usize, t.len as usize);
        if src == me {
            let from = match place.from_slot {
                None => homes[&t.expert] + t.offset as usize,
                Some(at) => slots_at + at,
            };
            ops.waves.entry(wave).or_default().push(PeerOp::Send {
                peer: dst,
                range: from..from + len,
            });
        }
        if dst == me {
            let to = slots_at + place.to_slot;
            ops.waves.entry(wave).or_default().push(PeerOp::Recv {
                peer: src,
                range: to..to + len,
            });
            ops.landed.push(place.to_slot..place.to_slot + len);
            ops.received += len as u64;
        }
    }
    ops
}

/// Native-endian values from bytes that may not be aligned for them.
fn words<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
    bytes
        .chunks_exact(std::mem::size_of::<T>())
        .map(bytemuck::pod_read_unaligned)
        .collect()
}

/// Host bytes of a message: its rows, then its ids.
fn pack(message: &Message, out: &mut Vec<u8>) {
    out.extend_from_slice(bytemuck::cast_slice(&message.rows));
    out.extend_from_slice(bytemuck::cast_slice(&message.ids));
}

impl Fabric for NcclFabric {
    fn world_size(&self) -> usize {
        self.world
    }

    fn local_ranks(&self) -> Range<usize> {
        self.rank..self.rank + 1
    }

    fn all_gather(&self, rows: &[Vec<u64>]) -> Result<Vec<Vec<u64>>> {
        let mut state = self.lock()?;
        let mine = self.one("all-gather", rows.to_vec());
        let sizes = mine
            .as_ref()
            .map(|row| vec![row.len() as u64])
            .map_err(Clone::clone);
        let widths = self.headers(&mut state, "all-gather rows", 1, sizes)?;
        let width = widths[0][0] as usize;
        if let Some(rank) = widths.iter().position(|w| w[0] as usize != width) {
            return Err(stop(
                &mut state,
                format!(
                    "all-gather: rank {rank} contributed {} counts, rank 0 {width}",
                    widths[rank][0]
                ),
            ));
        }
        let row = mine.map_err(EngineError::Fabric)?;
        let bytes = nccl(&mut state, |c| {
            c.all_gather_host(bytemuck::cast_slice(&row))
        })?;
        self.count(((self.world - 1) * width * 8) as u64);
        Ok(if width == 0 {
            vec![Vec::new(); self.world]
        } else {
            bytes.chunks_exact(width * 8).map(words).collect()
        })
    }

    fn all_to_all_v(&self, send: Vec<Vec<Message>>) -> Result<Vec<Vec<Message>>> {
        let (world, me) = (self.world, self.rank);
        let mut state = self.lock()?;
        let mine = self.one("all-to-all", send).and_then(|row| {
            if row.len() == world {
                Ok(row)
            } else {
                Err(format!(
                    "all-to-all: rank {me} addressed {} ranks of {world}",
                    row.len()
                ))
            }
        });
        // Header: rows then ids this rank sends to each rank.
        let sizes = mine.as_ref().map_err(Clone::clone).map(|row| {
            let rows = row.iter().map(|m| m.rows.len() as u64);
            rows.chain(row.iter().map(|m| m.ids.len() as u64)).collect()
        });
        let headers = self.headers(&mut state, "all-to-all messages", 2 * world, sizes)?;
        let mut outgoing = mine.map_err(EngineError::Fabric)?;
        // One buffer: what this rank sends (by destination), then what it receives (by source).
        let mut buffer = Vec::new();
        let mut ops = Vec::with_capacity(2 * world);
        let mut sent_at = vec![0..0; world];
        for (dst, message) in outgoing.iter().enumerate().filter(|&(dst, _)| dst != me) {
            let start = buffer.len();
            pack(message, &mut buffer);
            sent_at[dst] = start..buffer.len();
        }
        let mut incoming: Vec<(usize, usize, Range<usize>)> = Vec::with_capacity(world);
        let mut at = buffer.len();
        for (src, header) in headers.iter().enumerate() {
            let (rows, ids) = match src == me {
                true => (0, 0),
                false => (header[me] as usize, header[world + me] as usize),
            };
            incoming.push((rows, ids, at..at + 4 * (rows + ids)));
            at += 4 * (rows + ids);
        }
        buffer.resize(at, 0);
        for peer in (0..world).filter(|&p| p != me) {
            ops.push(PeerOp::Send {
                peer,
                range: sent_at[peer].clone(),
            });
            ops.push(PeerOp::Recv {
                peer,
                range: incoming[peer].2.clone(),
            });
        }
        nccl(&mut state, |c| {
            c.send_recv_host(&mut buffer, std::slice::from_ref(&ops))
        })?;
        let mut row = Vec::with_capacity(world);
        for (src, (rows, ids, range)) in incoming.into_iter().enumerate() {
            if src == me {
                // A rank's message to itself never leaves it.
                row.push(std::mem::take(&mut outgoing[me]));
                continue;
            }
            let bytes = &buffer[range];
            self.count(bytes.len() as u64);
            row.push(Message {
                rows: words(&bytes[..4 * rows]),
                ids: words(&bytes[4 * rows..4 * (rows + ids)]),
            });
        }
        Ok(vec![row])
    }

    fn stream_replicas(
        &self,
        plan: &Plan,
        schedule: &TransferSchedule,
        mut buffers: ReplicaBuffers<'_>,
    ) -> Result<Vec<u64>> {
        let me = self.rank;
        let mut state = self.lock()?;
        let expert_bytes = buffers.expert_bytes;
        // This rank's side, checked before anyone moves a byte: the schedule and its slots,
        // and the home experts it seeds (each staged once).
        let mine = self
            .one("replica stream", std::mem::take(&mut buffers.slots))
            .and_then(|slots| {
                buffers.slots = vec![slots];
                buffers.check_schedule(plan, schedule, &self.local_ranks(), self.world)
            })
            .and_then(|places| {
                let (homes, staged) = stage_homes(schedule, buffers.source, expert_bytes, me)?;
                Ok((places, homes, staged))
            });
        let verdict = mine.as_ref().map(|_| Vec::new()).map_err(Clone::clone);
        self.headers(&mut state, "replica stream", 0, verdict)?;
        let (places, homes, mut buffer) = mine.map_err(EngineError::Fabric)?;
        // One buffer: the staged home experts, then this rank's slots.
        let slots_at = buffer.len();
        let slot_len = buffers.slots[0].len();
        buffer.resize(slots_at + slot_len, 0);
        let ReplicaOps {
            waves,
            landed,
            received,
        } = replica_ops(schedule, &places, &homes, slots_at, me);
        let waves: Vec<Vec<PeerOp>> = waves.into_values().collect();
        nccl(&mut state, |c| c.send_recv_host(&mut buffer, &waves))?;
        // Only the received bytes are written into the slots.
        let slots = &mut buffers.slots[0];
        for range in landed {
            slots[range.clone()]
                .copy_from_slice(&buffer[slots_at + range.start..slots_at + range.end]);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::LocalFabric;
    use rackfill_balancer::relay::{plan_transfers, RelayConfig};
    use rackfill_balancer::{Algo, Layout, LoadMatrix, Settings};

    const RANKS: usize = 4;
    const EXPERT_BYTES: usize = 200;

    /// Expert 0 hot enough to be replicated on the 3 other ranks, over a relay tree
    /// (threshold 1), in 64-byte chunks.
    fn relayed() -> (Plan, TransferSchedule, Vec<Vec<u8>>) {
        let layout = Layout::contiguous(RANKS, RANKS, 1).unwrap();
        let load = LoadMatrix::from_rows(&vec![vec![60u64, 2, 2, 2]; RANKS]).unwrap();
        let plan = Algo::Quota
            .build(&Settings::default())
            .plan(&layout, &load)
            .unwrap();
        let relay = RelayConfig {
            threshold: 1,
            chunk_bytes: 64,
        };
        let schedule = plan_transfers(&plan, EXPERT_BYTES as u64, &relay);
        assert!(schedule.transfers.iter().any(|t| t.stage == 2));
        let experts = (0..RANKS)
            .map(|e| (0..EXPERT_BYTES).map(|b| (b ^ (e * 37)) as u8).collect())
            .collect();
        (plan, schedule, experts)
    }

    #[test]
    fn relays_forward_a_chunk_only_in_a_later_wave_than_it_landed() {
        let (_, schedule, _) = relayed();
        let waves = chunk_waves(&schedule);
        for (t, &wave) in schedule.transfers.iter().zip(&waves) {
            if t.stage == 1 {
                assert_eq!(wave, u64::from(t.chunk));
                continue;
            }
            let producer = schedule
                .transfers
                .iter()
                .position(|p| (p.dst, p.expert, p.offset) == (t.src, t.expert, t.offset))
                .unwrap();
            assert!(wave > waves[producer], "{t:?} in wave {wave}");
        }
    }

    /// Every rank's operations, run the way NCCL matches them (per wave, in order, the sends of
    /// `a` to `b` with the receives of `b` from `a` in the order both listed them), give every
    /// slot the bytes the in-process fabric gives it.
    #[test]
    fn every_ranks_operations_deliver_what_the_local_fabric_delivers() {
        let (plan, schedule, experts) = relayed();
        let slot_len = plan.slots_per_rank() * EXPERT_BYTES;
        let source = |e: u32| -> Vec<&[u8]> { vec![&experts[e as usize][..]] };
        let mut buffers = Vec::new();
        let mut sides = Vec::new();
        for me in 0..RANKS {
            let mut slot = vec![0u8; slot_len];
            let source = |e: u32| -> Vec<&[u8]> { vec![&experts[e as usize][..]] };
            let mine = ReplicaBuffers {
                source: &source,
                slots: vec![&mut slot[..]],
                slot_bytes: EXPERT_BYTES,
                expert_bytes: EXPERT_BYTES,
            };
            let places = mine
                .check_schedule(&plan, &schedule, &(me..me + 1), RANKS)
                .unwrap();
            let (homes, mut buffer) = stage_homes(&schedule, &source, EXPERT_BYTES, me).unwrap();
            let slots_at = buffer.len();
            buffer.resize(slots_at + slot_len, 0);
            sides.push((
                slots_at,
                replica_ops(&schedule, &places, &homes, slots_at, me),
            ));
            buffers.push(buffer);
        }
        let all_waves: std::collections::BTreeSet<u64> = sides
            .iter()
            .flat_map(|(_, ops)| ops.waves.keys().copied())
            .collect();
        assert!(all_waves.len() > 2, "chunks pipeline over several waves");
        let mut landing = Vec::new();
        for wave in all_waves {
            for (a, b) in (0..RANKS).flat_map(|a| (0..RANKS).map(move |b| (a, b))) {
                let listed = |rank: usize, send: bool, peer: usize| -> Vec<Range<usize>> {
                    let ops = sides[rank].1.waves.get(&wave).map_or(&[][..], |v| &v[..]);
                    ops.iter()
                        .filter_map(|op| match op {
                            PeerOp::Send { peer: p, range } if send && *p == peer => {
                                Some(range.clone())
                            }
                            PeerOp::Recv { peer: p, range } if !send && *p == peer => {
                                Some(range.clone())
                            }
                            _ => None,
                        })
                        .collect()
                };
                let (sends, recvs) = (listed(a, true, b), listed(b, false, a));
                assert_eq!(sends.len(), recvs.len(), "wave {wave}: {a} -> {b}");
                for (from, to) in sends.into_iter().zip(recvs) {
                    assert_eq!(from.len(), to.len());
                    landing.push((b, to, buffers[a][from].to_vec()));
                }
            }
            // A group's operations run concurrently: what a wave sends is read before anything
            // it receives lands.
            for (b, to, bytes) in landing.drain(..) {
                buffers[b][to].copy_from_slice(&bytes);
            }
        }
        let mut want: Vec<Vec<u8>> = vec![vec![0u8; slot_len]; RANKS];
        let local = LocalFabric::new(RANKS).unwrap();
        let want_received = local
            .stream_replicas(
                &plan,
                &schedule,
                ReplicaBuffers {
                    source: &source,
                    slots: want.iter_mut().map(|s| s.as_mut_slice()).collect(),
                    slot_bytes: EXPERT_BYTES,
                    expert_bytes: EXPERT_BYTES,
                },
            )
            .unwrap();
        for (me, (slots_at, ops)) in sides.iter().enumerate() {
            let mut slots = vec![0u8; slot_len];
            for range in &ops.landed {
                slots[range.clone()]
                    .copy_from_slice(&buffers[me][slots_at + range.start..slots_at + range.end]);
            }
            assert_eq!(slots, want[me], "rank {me}'s slots");
            assert_eq!(ops.received, want_received[me], "rank {me}'s bytes");
        }
        assert_eq!(want[1][..EXPERT_BYTES], experts[0][..]);
    }
}
