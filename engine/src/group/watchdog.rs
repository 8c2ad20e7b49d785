//! Liveness of an EP group: each process's watchdog thread stops the whole group when its own
//! engine thread makes no progress, and the leader's when a rank's heartbeats stop (killed,
//! stopped, or its host gone), naming the rank. Stopping means `MPI_Abort`: the launcher
//! (`mpirun`, `srun`) then ends every process with a non-zero status, so the orchestrator can
//! restart the group. A stalled group is thus stopped within `watchdog_timeout` plus about a
//! second of heartbeat period.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use metrics::gauge;
use mpi::point_to_point::{Destination, Source};
use mpi::topology::{Communicator, SimpleCommunicator};

use super::wire::{abort_group, LEADER};

/// How the group watches itself.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupConfig {
    /// A rank that makes no progress (or sends no heartbeat) for this long stops the group.
    /// Must exceed the longest step.
    pub watchdog_timeout: Duration,
    /// Rewritten about every second while this process's rank makes progress: what a liveness
    /// probe checks the age of.
    pub heartbeat_file: Option<PathBuf>,
}

impl Default for GroupConfig {
    fn default() -> Self {
        Self {
            watchdog_timeout: Duration::from_secs(30),
            heartbeat_file: None,
        }
    }
}

/// The engine thread's progress: when it last completed a round trip with the group, and what
/// it is waiting on now.
pub struct Progress {
    start: Instant,
    /// Milliseconds from `start` to the last tick.
    last: AtomicU64,
    doing: Mutex<String>,
    /// Set when the engine loop ended: the watchdog then stops watching.
    finished: AtomicBool,
}

impl Default for Progress {
    fn default() -> Self {
        Self::new()
    }
}

impl Progress {
    pub fn new() -> Self {
        Self {
            start: Instant::now(),
            last: AtomicU64::new(0),
            doing: Mutex::new("starting".into()),
            finished: AtomicBool::new(false),
        }
    }

    /// The engine loop ended (the group stopped or this process is leaving it).
    pub fn finish(&self) {
        self.finished.store(true, Ordering::Release);
    }

    /// The engine thread moved on; it is now `doing` this.
    pub fn tick(&self, doing: impl Into<String>) {
        self.last
            .store(self.start.elapsed().as_millis() as u64, Ordering::Release);
        if let Ok(mut d) = self.doing.lock() {
            *d = doing.into();
        }
    }

    fn stalled_for(&self) -> Duration {
        let last = Duration::from_millis(self.last.load(Ordering::Acquire));
        self.start.elapsed().saturating_sub(last)
    }

    fn doing(&self) -> String {
        self.doing.lock().map(|d| d.clone()).unwrap_or_default()
    }
}

/// Heartbeat period.
const BEAT: Duration = Duration::from_millis(500);

/// Tag of heartbeat messages.
const HEARTBEAT: i32 = 2;

/// Starts the watchdog thread of this process. `alive` (the leader's health flag) is cleared
/// before the group is stopped.
pub fn spawn(
    heart: SimpleCommunicator,
    progress: Arc<Progress>,
    alive: Option<Arc<AtomicBool>>,
    config: GroupConfig,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let watch = Watch {
        rank: usize::try_from(heart.rank()).unwrap_or_default(),
        size: usize::try_from(heart.size()).unwrap_or(1),
        heart,
        progress,
        alive,
        config,
    };
    std::thread::Builder::new()
        .name("rackfill-watchdog".into())
        .spawn(move || watch.run())
}

struct Watch {
    heart: SimpleCommunicator,
    rank: usize,
    size: usize,
    progress: Arc<Progress>,
    alive: Option<Arc<AtomicBool>>,
    config: GroupConfig,
}

// SAFETY: MPI runs at MPI_THREAD_MULTIPLE and only the watchdog thread uses `heart`.
unsafe impl Send for Watch {}

impl Watch {
    fn run(self) {
        let timeout = self.config.watchdog_timeout;
        let mut last_seen = vec![Instant::now(); self.size];
        loop {
            std::thread::sleep(BEAT);
            if self.progress.finished.load(Ordering::Acquire) {
                return;
            }
            let stalled = self.progress.stalled_for();
            if stalled > timeout {
                self.stop_group(&format!(
                    "rank {}: no progress for {:.0} s while {}",
                    self.rank,
                    stalled.as_secs_f64(),
                    self.progress.doing()
                ));
            }
            self.write_heartbeat_file();
            if self.rank == LEADER {
                self.receive_heartbeats(&mut last_seen);
                for (rank, seen) in last_seen.iter().enumerate().skip(1) {
                    let age = seen.elapsed();
                    gauge!(crate::metrics::RANK_HEARTBEAT_AGE, "rank" => rank.to_string())
                        .set(age.as_secs_f64());
                    if age > timeout {
                        self.stop_group(&format!(
                            "rank {rank} stopped: no heartbeat for {:.0} s (killed, stopped, \
                             or its host is down)",
                            age.as_secs_f64()
                        ));
                    }
                }
            } else {
                self.heart
                    .process_at_rank(LEADER as i32)
                    .send_with_tag(&[self.rank as u64][..], HEARTBEAT);
            }
        }
    }

    /// Takes every heartbeat that arrived, noting when each rank was last heard of.
    fn receive_heartbeats(&self, last_seen: &mut [Instant]) {
        while let Some(status) = self.heart.any_process().immediate_probe_with_tag(HEARTBEAT) {
            let (beat, _) = self
                .heart
                .process_at_rank(status.source_rank())
                .receive_vec_with_tag::<u64>(HEARTBEAT);
            if let Some(seen) = beat
                .first()
                .and_then(|&rank| last_seen.get_mut(rank as usize))
            {
                *seen = Instant::now();
            }
        }
    }

    fn write_heartbeat_file(&self) {
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

    fn stop_group(&self, why: &str) -> ! {
        abort_group(&self.heart, why, self.alive.as_deref())
    }
}
