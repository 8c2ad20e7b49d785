//! Liveness of an EP group: one watchdog thread per process, apart from the engine thread, on
//! its own communicator.
//!
//! - **Workers** send the leader a heartbeat ([`Beat`]) twice a second, saying how their engine
//!   thread fares, and wait for the leader's word. A worker blocked in a collective decides
//!   nothing on its own clock: it stops the group only when the leader itself goes silent, or
//!   when the leader's verdict is not carried out (bounds far past the leader's).
//! - **The leader** reads those heartbeats and, for ranks on its host, the processes' states
//!   ([`GroupView`]). It answers `/health` 503 naming a suspected rank while the group may
//!   still recover, and once a rank is found dead or stuck (or a step failed) it fails the
//!   group: every open request gets an error naming the rank ([`EngineHealth::fail`]), the
//!   workers get the verdict, `/health` answers 503 with it for `health_grace`, and then
//!   `MPI_Abort` ends every process, so the launcher exits non-zero and the orchestrator can
//!   restart the group.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use metrics::gauge;
use mpi::point_to_point::{Destination, Source};
use mpi::request::{Request, StaticScope};
use mpi::topology::{Communicator, SimpleCommunicator};

use super::heartbeat::{Beat, GroupView, Verdict};
use super::progress::{drain_requested, Progress};
use super::wire::LEADER;
use crate::health::EngineHealth;

/// How the group watches itself.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupConfig {
    /// A rank that makes no progress (or sends no heartbeat) for this long stops the group.
    /// Must exceed the longest step.
    pub watchdog_timeout: Duration,
    /// Rewritten about every second while this process's rank makes progress: what a liveness
    /// probe checks the age of.
    pub heartbeat_file: Option<PathBuf>,
    /// How long the leader answers `/health` 503 with the reason before a failing group's
    /// processes end (after every open request got its error).
    pub health_grace: Duration,
}

impl Default for GroupConfig {
    fn default() -> Self {
        Self {
            watchdog_timeout: Duration::from_secs(30),
            heartbeat_file: None,
            health_grace: Duration::from_secs(5),
        }
    }
}

/// How often the watchdog looks (a dead process on the leader's host is seen this fast).
const TICK: Duration = Duration::from_millis(100);

/// Heartbeat period.
const BEAT: Duration = Duration::from_millis(500);

/// Tags of the watchdog's messages: a worker's heartbeat, the leader's, the leader's verdict.
const WORKER_BEAT: i32 = 2;
const LEADER_BEAT: i32 = 3;
const VERDICT: i32 = 4;

/// A watchdog that slept this much longer than a tick was itself not running.
const FROZEN: Duration = Duration::from_secs(1);

/// How long past its own bounds a worker waits for a verdict to be carried out.
const VERDICT_SLACK: Duration = Duration::from_secs(10);

/// Starts the watchdog thread of this process. `pids[r]` is rank `r`'s process where the leader
/// can read its state (see [`GroupView::new`]).
pub fn spawn(
    heart: SimpleCommunicator,
    progress: Arc<Progress>,
    health: Arc<EngineHealth>,
    pids: Vec<Option<u32>>,
    config: GroupConfig,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let rank = usize::try_from(heart.rank()).unwrap_or_default();
    let size = usize::try_from(heart.size()).unwrap_or(1);
    let peers = match rank == LEADER {
        true => (1..size).collect(),
        false => vec![LEADER],
    };
    let watch = Watch {
        rank,
        mailboxes: peers.into_iter().map(Mailbox::new).collect(),
        heart,
        progress,
        health,
        view: (rank == LEADER)
            .then(|| GroupView::new(pids, config.watchdog_timeout, Instant::now())),
        config,
    };
    std::thread::Builder::new()
        .name("rackfill-watchdog".into())
        .spawn(move || watch.run())
}

struct Watch {
    heart: SimpleCommunicator,
    rank: usize,
    /// Where this watchdog sends: every worker (the leader's), or the leader (a worker's).
    mailboxes: Vec<Mailbox>,
    progress: Arc<Progress>,
    health: Arc<EngineHealth>,
    /// The leader's view of the group; `None` on workers.
    view: Option<GroupView>,
    config: GroupConfig,
}

// SAFETY: MPI runs at MPI_THREAD_MULTIPLE and only the watchdog thread uses `heart`.
unsafe impl Send for Watch {}

/// What a worker heard from the leader.
struct LeaderWord {
    heard: Instant,
    verdict: Option<Instant>,
}

impl Watch {
    /// Sends `bytes` to every mailbox; a heartbeat (`beat`) skips a rank that has not taken
    /// the previous one yet.
    fn post(&mut self, bytes: &[u8], tag: i32, beat: bool) {
        for mailbox in &mut self.mailboxes {
            mailbox.post(&self.heart, bytes, tag, beat);
        }
    }

    fn run(mut self) {
        let mut next_beat = Instant::now();
        let mut leader = LeaderWord {
            heard: Instant::now(),
            verdict: None,
        };
        let mut failed_at = None;
        let mut last_tick = Instant::now();
        loop {
            std::thread::sleep(TICK);
            let now = Instant::now();
            // This process itself did not run (stopped, then continued, as a launcher does before
            // it kills a group): the others' silence meanwhile says nothing about them.
            let frozen = now - last_tick;
            last_tick = now;
            if frozen > FROZEN {
                tracing::warn!(
                    "rank {}: this process did not run for {:.1} s (stopped?)",
                    self.rank,
                    frozen.as_secs_f64()
                );
                leader.heard = now;
                if let Some(view) = &mut self.view {
                    view.restart_clocks(now);
                }
            }
            if let Some(why) = self.health.failure() {
                if self.view.is_some() {
                    self.stop_group(&why);
                }
                // A worker's own failure: the leader learns it from the round's report.
                let since = *failed_at.get_or_insert(now);
                if leader.verdict.is_none()
                    && now - since > self.config.watchdog_timeout + self.config.health_grace
                {
                    self.abort(&why);
                }
            }
            if self.progress.is_finished() {
                return;
            }
            let beat = now >= next_beat;
            if beat {
                next_beat = now + BEAT;
                self.write_heartbeat_file();
            }
            match self.view.take() {
                Some(mut view) => {
                    self.watch_group(&mut view, now, beat);
                    self.view = Some(view);
                }
                None => self.watch_leader(&mut leader, now, beat),
            }
        }
    }

    /// The leader's round: takes the heartbeats, looks at the processes, judges.
    fn watch_group(&mut self, view: &mut GroupView, now: Instant, beat: bool) {
        while let Some(status) = self
            .heart
            .any_process()
            .immediate_probe_with_tag(WORKER_BEAT)
        {
            let (bytes, _) = self
                .heart
                .process_at_rank(status.source_rank())
                .receive_vec_with_tag::<u8>(WORKER_BEAT);
            if let Ok(beat) = bincode::deserialize::<Beat>(&bytes) {
                view.heard(beat, now);
            }
        }
        view.heard(Beat::of(LEADER, &self.progress, drain_requested()), now);
        view.poll_processes();
        if beat {
            self.post(&[0], LEADER_BEAT, true);
            for (rank, age) in view.heartbeat_ages(now).skip(1) {
                gauge!(crate::metrics::RANK_HEARTBEAT_AGE, "rank" => rank.to_string())
                    .set(age.as_secs_f64());
            }
        }
        if let Some(rank) = view.drain_requested_by() {
            if self.health.request_stop() {
                tracing::info!(
                    "rank {rank} received a termination signal: the group drains its requests \
                     and stops"
                );
            }
        }
        match view.assess(now) {
            Verdict::Failed(why) => {
                self.health.fail(&why);
                let why = self.health.failure().unwrap_or(why);
                self.stop_group(&why);
            }
            Verdict::Suspect(why) => {
                if self.health.set_suspect(Some(why.clone())) {
                    tracing::warn!("{why}; /health answers 503");
                }
            }
            Verdict::Healthy => {
                if self.health.set_suspect(None) {
                    tracing::info!("every rank is heard from again; /health answers 200");
                }
            }
        }
    }

    /// A worker's round: beats, takes the leader's word, and stops the group only when the
    /// leader went silent or its verdict was not carried out.
    fn watch_leader(&mut self, leader: &mut LeaderWord, now: Instant, beat: bool) {
        if beat {
            let mine = Beat::of(self.rank, &self.progress, drain_requested());
            if let Ok(bytes) = bincode::serialize(&mine) {
                self.post(&bytes, WORKER_BEAT, true);
            }
        }
        let from_leader = self.heart.process_at_rank(LEADER as i32);
        while let Some(status) = from_leader.immediate_probe() {
            let (bytes, _) = from_leader.receive_vec_with_tag::<u8>(status.tag());
            leader.heard = now;
            if status.tag() == VERDICT && leader.verdict.is_none() {
                tracing::error!(
                    "rank {}: the leader stops the group: {}",
                    self.rank,
                    String::from_utf8_lossy(&bytes)
                );
                leader.verdict = Some(now);
            }
        }
        let config = &self.config;
        match leader.verdict {
            Some(at) if now - at > config.health_grace + VERDICT_SLACK => {
                self.abort("the leader's verdict was not carried out")
            }
            Some(_) => {}
            None => {
                let silent = now - leader.heard;
                if silent > config.watchdog_timeout {
                    self.abort(&format!(
                        "rank 0 (the leader) stopped: no heartbeat for {:.1} s (killed, \
                         stopped, or its host is down)",
                        silent.as_secs_f64()
                    ));
                }
                let stalled = self.progress.stalled_for();
                if stalled > 2 * config.watchdog_timeout + config.health_grace {
                    self.abort(&format!(
                        "rank {}: no progress for {:.0} s while {}, and no verdict from the \
                         leader",
                        self.rank,
                        stalled.as_secs_f64(),
                        self.progress.doing()
                    ));
                }
            }
        }
    }

    /// The leader fails the group: the workers get the verdict, the server (told through
    /// `health`, already failed) answers every open request and `/health` with it for the grace
    /// period, then every process ends.
    fn stop_group(&mut self, why: &str) -> ! {
        let grace = self.config.health_grace;
        tracing::error!(
            "rackfill: {why}; open requests get this error, /health answers 503, and the group \
             stops in {:.1} s",
            grace.as_secs_f64()
        );
        self.post(why.as_bytes(), VERDICT, false);
        std::thread::sleep(grace);
        self.abort(why)
    }

    /// Ends every process of the group with `MPI_Abort`, saying why.
    fn abort(&self, why: &str) -> ! {
        let message = format!("rackfill: {why}; stopping the group");
        tracing::error!("{message}");
        eprintln!("{message}");
        self.heart.abort(3)
    }

    /// Rewrites the heartbeat file while this process's engine thread makes progress (a stuck
    /// one lets it age, which is what a liveness probe checks).
    fn write_heartbeat_file(&self) {
        if self.progress.stalled_for() > self.config.watchdog_timeout {
            return;
        }
        if let Some(path) = &self.config.heartbeat_file {
            let stamp = format!(
                "rank {} alive, last progress {:.1} s ago\n",
                self.rank,
                self.progress.stalled_for().as_secs_f64()
            );
            if let Err(err) = std::fs::write(path, stamp) {
                tracing::warn!(path = %path.display(), %err, "cannot write the heartbeat file");
            }
        }
    }
}

/// Messages to one rank that may have stopped, sent without ever blocking the watchdog (a
/// blocking send to a stopped process can wait forever): each send is non-blocking and its
/// buffer is kept until MPI has delivered it.
struct Mailbox {
    rank: i32,
    pending: Vec<InFlight>,
}

/// A send on its way and the buffer it reads.
type InFlight = (Request<'static, [u8], StaticScope>, Box<[u8]>);

impl Mailbox {
    fn new(rank: usize) -> Self {
        Self {
            rank: rank as i32,
            pending: Vec::new(),
        }
    }

    /// Sends `bytes` with `tag`, unless `skip_if_busy` and an earlier message is still on its
    /// way (a stopped rank then holds one heartbeat, not one per period).
    fn post(&mut self, comm: &SimpleCommunicator, bytes: &[u8], tag: i32, skip_if_busy: bool) {
        let mut still = Vec::new();
        for (request, buffer) in self.pending.drain(..) {
            match request.test() {
                Ok(_) => drop(buffer),
                Err(request) => still.push((request, buffer)),
            }
        }
        self.pending = still;
        if skip_if_busy && !self.pending.is_empty() {
            return;
        }
        let buffer: Box<[u8]> = bytes.into();
        // SAFETY: the heap block of `buffer` neither moves nor is freed while the request is
        // pending: both are kept together in `pending` until the request completes, and a
        // mailbox dropped with requests pending leaks them (see `Drop`).
        let view: &'static [u8] =
            unsafe { std::slice::from_raw_parts(buffer.as_ptr(), buffer.len()) };
        let request =
            comm.process_at_rank(self.rank)
                .immediate_send_with_tag(StaticScope, view, tag);
        self.pending.push((request, buffer));
    }
}

impl Drop for Mailbox {
    fn drop(&mut self) {
        // Sends still on their way to a stopped rank when the loop ends: MPI may still read the
        // buffers, and an incomplete request may not be dropped.
        for pending in self.pending.drain(..) {
            std::mem::forget(pending);
        }
    }
}
