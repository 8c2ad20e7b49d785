//! The in-process fabric: every rank's buffers in this process's memory, real copies between
//! them.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use rackfill_balancer::relay::TransferSchedule;
use rackfill_balancer::Plan;
use rackfill_kernels::distribute_replicas;

use super::contract::{Fabric, Message, ReplicaBuffers};
use crate::error::{EngineError, Result};

/// The in-process fabric: ranks in host memory, real copies between their buffers. One handle
/// holds every rank ([`Self::new`]) or a group of handles splits them ([`Self::group`]).
#[derive(Debug)]
pub struct LocalFabric {
    local: Range<usize>,
    group: Arc<Group>,
    moved: AtomicU64,
}

/// The state every handle of one group shares.
#[derive(Debug)]
struct Group {
    world: usize,
    /// Handles that must join every collective.
    members: usize,
    state: Mutex<Shared>,
    changed: Condvar,
}

/// Contributions in flight between the handles of a group.
#[derive(Debug, Default)]
struct Shared {
    /// Handles that reached the current rendezvous.
    arrived: usize,
    /// Completed rendezvous so far.
    generation: u64,
    /// Why the group stopped (a failed call); every later call fails with it.
    failed: Option<String>,
    /// All-gather rows, by world rank.
    gathered: Vec<Vec<u64>>,
    /// All-to-all messages, `mail[dst][src]`.
    mail: Vec<Vec<Option<Message>>>,
    /// Replica chunks posted and not yet taken, by schedule index.
    chunks: HashMap<usize, Vec<u8>>,
}

impl LocalFabric {
    /// One handle holding all `ranks` ranks.
    pub fn new(ranks: usize) -> Result<Self> {
        let mut group = Self::group(ranks, std::slice::from_ref(&(0..ranks)))?;
        Ok(group.remove(0))
    }

    /// Handles over one group of `world` ranks, handle `h` holding `views[h]`: the views must
    /// be non-empty and cover `0..world` in order. Each handle is then used from its own thread,
    /// as a separate process holding those ranks would.
    pub fn group(world: usize, views: &[Range<usize>]) -> Result<Vec<Self>> {
        if world == 0 {
            return Err(EngineError::Config(
                "a fabric needs at least one rank".into(),
            ));
        }
        let mut next = 0;
        for view in views {
            if view.start != next || view.is_empty() {
                return Err(EngineError::Config(format!(
                    "fabric views {views:?} do not split ranks 0..{world} in order"
                )));
            }
            next = view.end;
        }
        if next != world {
            return Err(EngineError::Config(format!(
                "fabric views {views:?} do not cover ranks 0..{world}"
            )));
        }
        let group = Arc::new(Group {
            world,
            members: views.len(),
            state: Mutex::new(Shared {
                gathered: vec![Vec::new(); world],
                mail: (0..world).map(|_| vec![None; world]).collect(),
                ..Shared::default()
            }),
            changed: Condvar::new(),
        });
        Ok(views
            .iter()
            .map(|view| Self {
                local: view.clone(),
                group: Arc::clone(&group),
                moved: AtomicU64::new(0),
            })
            .collect())
    }

    fn holds_every_rank(&self) -> bool {
        self.local.len() == self.group.world
    }

    fn count(&self, bytes: u64) {
        self.moved.fetch_add(bytes, Ordering::Relaxed);
    }

    fn lock(&self) -> Result<MutexGuard<'_, Shared>> {
        let state = self
            .group
            .state
            .lock()
            .map_err(|_| EngineError::Fabric("a fabric handle panicked".into()))?;
        match &state.failed {
            Some(why) => Err(EngineError::Fabric(why.clone())),
            None => Ok(state),
        }
    }

    /// Fails the call on every handle of the group: the others stop waiting and return `why`,
    /// and the group is unusable afterwards. A handle alone in its group only fails this call:
    /// nobody waits on it, and the next call starts afresh.
    fn fail(&self, why: String) -> EngineError {
        if self.group.members > 1 {
            if let Ok(mut state) = self.group.state.lock() {
                state.failed.get_or_insert_with(|| why.clone());
            }
            self.group.changed.notify_all();
        }
        EngineError::Fabric(why)
    }

    /// Waits until every handle of the group has reached this point (releasing the lock while
    /// waiting); fails when another handle failed its call.
    fn rendezvous<'g>(
        &'g self,
        mut state: MutexGuard<'g, Shared>,
    ) -> Result<MutexGuard<'g, Shared>> {
        let generation = state.generation;
        state.arrived += 1;
        if state.arrived == self.group.members {
            state.arrived = 0;
            state.generation += 1;
            self.group.changed.notify_all();
            return Ok(state);
        }
        while state.generation == generation && state.failed.is_none() {
            state = self
                .group
                .changed
                .wait(state)
                .map_err(|_| EngineError::Fabric("a fabric handle panicked".into()))?;
        }
        // A rendezvous every handle reached is complete, even if one failed right after it.
        match &state.failed {
            Some(why) if state.generation == generation => Err(EngineError::Fabric(why.clone())),
            _ => Ok(state),
        }
    }

    /// `got` contributions, one per local rank.
    fn check_local(&self, what: &str, got: usize) -> Result<()> {
        if got != self.local.len() {
            return Err(self.fail(format!(
                "{what}: {got} contributions for local ranks {:?}",
                self.local
            )));
        }
        Ok(())
    }

    /// Replica streaming over several handles: every handle walks the schedule in order, posting
    /// the chunks its ranks send and taking those its ranks receive. Sends never wait, and a
    /// chunk is sent only after every earlier copy its sender takes part in, so the earliest
    /// unfinished copy is always ready to complete: no deadlock whatever the handles' speed.
    fn stream_between_handles(
        &self,
        plan: &Plan,
        schedule: &TransferSchedule,
        mut buffers: ReplicaBuffers<'_>,
    ) -> Result<Vec<u64>> {
        let places = buffers
            .check_schedule(plan, schedule, &self.local, self.group.world)
            .map_err(|why| self.fail(why))?;
        let mut received = vec![0u64; self.local.len()];
        let mut homes: HashMap<u32, Vec<u8>> = HashMap::new();
        for (index, (t, place)) in schedule.transfers.iter().zip(&places).enumerate() {
            let (src, dst) = (t.src as usize, t.dst as usize);
            let (offset, len) = (t.offset as usize, t.len as usize);
            if self.local.contains(&src) {
                let bytes = match place.from_slot {
                    None => {
                        let home = homes
                            .entry(t.expert)
                            .or_insert_with(|| (buffers.source)(t.expert).concat());
                        if home.len() != buffers.expert_bytes {
                            return Err(self.fail(format!(
                                "replica stream: expert {} has {} bytes, expected {}",
                                t.expert,
                                home.len(),
                                buffers.expert_bytes
                            )));
                        }
                        home[offset..offset + len].to_vec()
                    }
                    Some(at) => buffers.slots[src - self.local.start][at..at + len].to_vec(),
                };
                self.lock()?.chunks.insert(index, bytes);
                self.group.changed.notify_all();
            }
            if self.local.contains(&dst) {
                let mut state = self
                    .group
                    .state
                    .lock()
                    .map_err(|_| EngineError::Fabric("a fabric handle panicked".into()))?;
                let bytes = loop {
                    // A chunk already posted is taken even if the group failed since.
                    if let Some(bytes) = state.chunks.remove(&index) {
                        break bytes;
                    }
                    if let Some(why) = &state.failed {
                        return Err(EngineError::Fabric(why.clone()));
                    }
                    state = self
                        .group
                        .changed
                        .wait(state)
                        .map_err(|_| EngineError::Fabric("a fabric handle panicked".into()))?;
                };
                drop(state);
                let at = place.to_slot;
                buffers.slots[dst - self.local.start][at..at + len].copy_from_slice(&bytes);
                received[dst - self.local.start] += len as u64;
                self.count(len as u64);
            }
        }
        drop(self.rendezvous(self.lock()?)?);
        Ok(received)
    }
}

impl Drop for LocalFabric {
    /// A handle leaving a group of several (its process done, or its thread unwinding) fails the
    /// group: a handle still waiting for it returns an error instead of waiting for ever.
    fn drop(&mut self) {
        if self.group.members > 1 {
            if let Ok(mut state) = self.group.state.lock() {
                let local = &self.local;
                state
                    .failed
                    .get_or_insert_with(|| format!("the process holding ranks {local:?} left"));
            }
            self.group.changed.notify_all();
        }
    }
}

impl Fabric for LocalFabric {
    fn world_size(&self) -> usize {
        self.group.world
    }

    fn local_ranks(&self) -> Range<usize> {
        self.local.clone()
    }

    fn all_gather(&self, rows: &[Vec<u64>]) -> Result<Vec<Vec<u64>>> {
        self.check_local("all-gather", rows.len())?;
        let mut state = self.lock()?;
        for (rank, row) in self.local.clone().zip(rows) {
            state.gathered[rank] = row.clone();
        }
        let state = self.rendezvous(state)?;
        let gathered = state.gathered.clone();
        // Nobody writes the next call's rows before every handle has read these.
        drop(self.rendezvous(state)?);
        let width = gathered[0].len();
        if let Some(rank) = gathered.iter().position(|row| row.len() != width) {
            return Err(self.fail(format!(
                "all-gather: rank {rank} contributed {} counts, rank 0 {width}",
                gathered[rank].len()
            )));
        }
        let remote = (self.group.world - 1) * width * 8;
        self.count((remote * self.local.len()) as u64);
        Ok(gathered)
    }

    fn all_to_all_v(&self, send: Vec<Vec<Message>>) -> Result<Vec<Vec<Message>>> {
        self.check_local("all-to-all", send.len())?;
        let world = self.group.world;
        if let Some((i, row)) = send.iter().enumerate().find(|(_, row)| row.len() != world) {
            return Err(self.fail(format!(
                "all-to-all: rank {} addressed {} ranks of {world}",
                self.local.start + i,
                row.len()
            )));
        }
        let mut state = self.lock()?;
        for (src, row) in self.local.clone().zip(send) {
            for (dst, message) in row.into_iter().enumerate() {
                state.mail[dst][src] = Some(message);
            }
        }
        let mut state = self.rendezvous(state)?;
        let mut inbox: Vec<Vec<Option<Message>>> = Vec::with_capacity(self.local.len());
        for dst in self.local.clone() {
            inbox.push(state.mail[dst].iter_mut().map(Option::take).collect());
        }
        // Nobody posts the next call's messages before every handle has taken these.
        drop(self.rendezvous(state)?);
        let mut recv = Vec::with_capacity(inbox.len());
        for (dst, messages) in self.local.clone().zip(inbox) {
            let mut row = Vec::with_capacity(world);
            for (src, message) in messages.into_iter().enumerate() {
                let message = message.ok_or_else(|| {
                    EngineError::Fabric(format!("all-to-all: rank {src} sent nothing to {dst}"))
                })?;
                if src == dst {
                    // A rank's message to itself never leaves it.
                    row.push(message);
                    continue;
                }
                // A copy into the receiver's own buffer, as a wire would make.
                self.count(message.bytes());
                row.push(Message {
                    rows: message.rows.as_slice().to_vec(),
                    ids: message.ids.as_slice().to_vec(),
                });
            }
            recv.push(row);
        }
        Ok(recv)
    }

    fn stream_replicas(
        &self,
        plan: &Plan,
        schedule: &TransferSchedule,
        mut buffers: ReplicaBuffers<'_>,
    ) -> Result<Vec<u64>> {
        self.check_local("replica stream", buffers.slots.len())?;
        if !self.holds_every_rank() {
            return self.stream_between_handles(plan, schedule, buffers);
        }
        // Every rank here: the concurrent copy engine, relays forwarding chunk `c` while `c + 1`
        // is still arriving.
        let stats = distribute_replicas(
            plan,
            schedule,
            buffers.expert_bytes,
            buffers.source,
            &mut buffers.slots,
            buffers.slot_bytes,
        )
        .map_err(|e| self.fail(format!("replica stream: {e}")))?;
        self.count(stats.received_bytes.iter().sum());
        Ok(stats.received_bytes)
    }

    fn bytes_moved(&self) -> u64 {
        self.moved.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rackfill_balancer::relay::{plan_transfers, RelayConfig};
    use rackfill_balancer::{Algo, Layout, LoadMatrix, Settings};

    fn msg(v: f32) -> Message {
        Message {
            rows: vec![v],
            ids: vec![v as u32],
        }
    }

    #[test]
    fn all_to_all_transposes_and_copies() {
        let fabric = LocalFabric::new(2).unwrap();
        assert_eq!((fabric.world_size(), fabric.local_ranks()), (2, 0..2));
        let send = vec![vec![msg(0.0), msg(1.0)], vec![msg(10.0), msg(11.0)]];
        let recv = fabric.all_to_all_v(send).unwrap();
        assert_eq!(recv[0], vec![msg(0.0), msg(10.0)]);
        assert_eq!(recv[1], vec![msg(1.0), msg(11.0)]);
        // Only the two messages between different ranks crossed the fabric.
        assert_eq!(fabric.bytes_moved(), 2 * 8);
        let gathered = fabric.all_gather(&[vec![1, 2], vec![3, 4]]).unwrap();
        assert_eq!(gathered, vec![vec![1, 2], vec![3, 4]]);
    }

    #[test]
    fn wrong_rank_counts_are_errors() {
        let fabric = LocalFabric::new(3).unwrap();
        assert!(fabric.all_gather(&[vec![1]]).is_err());
        // Alone in its group, the handle just failed that call.
        assert_eq!(
            fabric
                .all_gather(&[vec![1], vec![2], vec![3]])
                .unwrap()
                .len(),
            3
        );
        assert!(fabric
            .all_to_all_v(vec![vec![Message::default(); 2]; 3])
            .is_err());
        let fabric = LocalFabric::new(2).unwrap();
        assert!(fabric.all_gather(&[vec![1, 2], vec![3]]).is_err());
        assert!(LocalFabric::new(0).is_err());
        assert!(LocalFabric::group(4, &[0..1, 2..4]).is_err());
        assert!(LocalFabric::group(4, &[0..1, 1..3]).is_err());
        assert!(LocalFabric::group(4, &[0..0, 0..4]).is_err());
    }

    /// 4 ranks, 4 experts, one slot each; expert 0 hot enough for quota to replicate it to every
    /// other rank, streamed in 64-byte chunks over a relay tree (threshold 1).
    fn replicated() -> (Plan, TransferSchedule, Vec<Vec<u8>>) {
        let layout = Layout::contiguous(4, 4, 1).unwrap();
        let load = LoadMatrix::from_rows(&vec![vec![60u64, 2, 2, 2]; 4]).unwrap();
        let plan = Algo::Quota
            .build(&Settings::default())
            .plan(&layout, &load)
            .unwrap();
        assert_eq!(plan.replicas(), 3);
        let relay = RelayConfig {
            threshold: 1,
            chunk_bytes: 64,
        };
        let schedule = plan_transfers(&plan, 200, &relay);
        assert!(schedule.transfers.iter().any(|t| t.stage == 2));
        let experts = (0..4u8)
            .map(|e| (0..200u8).map(|b| b ^ e).collect())
            .collect();
        (plan, schedule, experts)
    }

    /// What every collective returns to the ranks `views` hold, each handle on its own thread.
    #[allow(clippy::type_complexity)]
    fn run_views(
        views: &[Range<usize>],
    ) -> Vec<(Vec<Vec<u64>>, Vec<Vec<Message>>, Vec<u64>, Vec<Vec<u8>>)> {
        let (plan, schedule, experts) = replicated();
        let handles = LocalFabric::group(4, views).unwrap();
        std::thread::scope(|scope| {
            let runs: Vec<_> = handles
                .iter()
                .map(|fabric| {
                    let (plan, schedule, experts) = (&plan, &schedule, &experts);
                    scope.spawn(move || {
                        let local = fabric.local_ranks();
                        let rows: Vec<Vec<u64>> = local
                            .clone()
                            .map(|r| vec![r as u64, 10 * r as u64])
                            .collect();
                        let gathered = fabric.all_gather(&rows).unwrap();
                        let send: Vec<Vec<Message>> = local
                            .clone()
                            .map(|src| (0..4).map(|dst| msg((10 * src + dst) as f32)).collect())
                            .collect();
                        let recv = fabric.all_to_all_v(send).unwrap();
                        let mut slots: Vec<Vec<u8>> =
                            local.clone().map(|_| vec![0u8; 200]).collect();
                        let source = |e: u32| -> Vec<&[u8]> {
                            assert!(local.contains(&(e as usize)), "expert {e} read off-rank");
                            let whole = &experts[e as usize];
                            vec![&whole[..50], &whole[50..]]
                        };
                        let received = fabric
                            .stream_replicas(
                                plan,
                                schedule,
                                ReplicaBuffers {
                                    source: &source,
                                    slots: slots.iter_mut().map(|s| s.as_mut_slice()).collect(),
                                    slot_bytes: 200,
                                    expert_bytes: 200,
                                },
                            )
                            .unwrap();
                        (gathered, recv, received, slots)
                    })
                })
                .collect();
            runs.into_iter().map(|run| run.join().unwrap()).collect()
        })
    }

    #[test]
    fn handles_holding_some_ranks_get_what_the_all_ranks_call_gives_them() {
        let all = run_views(std::slice::from_ref(&(0..4))).remove(0);
        let (plan, _, experts) = replicated();
        // The all-ranks call itself: rows in rank order, messages transposed, every slot filled.
        assert_eq!(all.0[3], vec![3, 30]);
        assert_eq!(all.1[2][1], msg(12.0));
        for rank in 1..4 {
            assert_eq!(plan.rank_slots(rank), &[Some(0)]);
            assert_eq!(all.3[rank], experts[0], "rank {rank}'s slot");
        }
        // Three processes: ranks {0}, {1, 2} and {3} of 4, over the same shared state.
        let split = run_views(&[0..1, 1..3, 3..4]);
        let mut at = 0;
        for (gathered, recv, received, slots) in split {
            assert_eq!(gathered, all.0, "every process gets the whole matrix");
            let n = recv.len();
            assert_eq!(recv, all.1[at..at + n]);
            assert_eq!(received, all.2[at..at + n]);
            assert_eq!(slots, all.3[at..at + n]);
            at += n;
        }
        assert_eq!(at, 4);
    }

    #[test]
    fn a_failed_call_releases_the_other_handles() {
        let handles = LocalFabric::group(2, &[0..1, 1..2]).unwrap();
        std::thread::scope(|scope| {
            let waiting = scope.spawn(|| handles[0].all_gather(&[vec![1]]));
            // Two rows for one local rank: refused, and the waiting handle is released.
            assert!(handles[1].all_gather(&[vec![1], vec![2]]).is_err());
            let err = waiting.join().unwrap().unwrap_err().to_string();
            assert!(err.contains("all-gather: 2 contributions"), "{err}");
        });
        // The group is unusable afterwards, as after an MPI error.
        assert!(handles[0].all_gather(&[vec![1]]).is_err());
    }

    #[test]
    fn a_handle_that_leaves_releases_the_others() {
        let mut handles = LocalFabric::group(2, &[0..1, 1..2]).unwrap();
        let leaving = handles.pop().unwrap();
        std::thread::scope(|scope| {
            let waiting = scope.spawn(|| handles[0].all_to_all_v(vec![vec![msg(1.0), msg(2.0)]]));
            // Its peer's thread ends (or unwinds) without joining the collective.
            scope.spawn(move || drop(leaving));
            let err = waiting.join().unwrap().unwrap_err().to_string();
            assert!(err.contains("ranks 1..2 left"), "{err}");
        });
    }
}
