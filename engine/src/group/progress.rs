//! What the watchdog knows of its process's engine thread: when it last completed a round trip
//! with the group, what it does now, and whether it is waiting on the other ranks (in a
//! collective) or working on its own. The difference is what lets the leader name the rank that
//! holds a group up rather than the ranks blocked waiting for it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The engine thread's progress.
pub struct Progress {
    start: Instant,
    /// Milliseconds from `start` to the last tick.
    last: AtomicU64,
    doing: Mutex<String>,
    /// Inside a collective: waiting on other ranks, not holding them up.
    waiting: AtomicBool,
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
            waiting: AtomicBool::new(false),
            finished: AtomicBool::new(false),
        }
    }

    /// The engine loop ended or is about to (the group stops, or this process leaves it): from
    /// now on a rank that exits is no fault.
    pub fn finish(&self) {
        self.finished.store(true, Ordering::Release);
    }

    pub fn is_finished(&self) -> bool {
        self.finished.load(Ordering::Acquire)
    }

    /// The engine thread moved on; it is now `doing` this.
    pub fn tick(&self, doing: impl Into<String>) {
        self.last
            .store(self.start.elapsed().as_millis() as u64, Ordering::Release);
        if let Ok(mut d) = self.doing.lock() {
            *d = doing.into();
        }
    }

    /// Marks the engine thread as waiting on the other ranks until the guard is dropped.
    pub fn waiting_on_group(&self) -> WaitingOnGroup<'_> {
        self.waiting.store(true, Ordering::Release);
        WaitingOnGroup(self)
    }

    pub fn is_waiting(&self) -> bool {
        self.waiting.load(Ordering::Acquire)
    }

    pub fn stalled_for(&self) -> Duration {
        let last = Duration::from_millis(self.last.load(Ordering::Acquire));
        self.start.elapsed().saturating_sub(last)
    }

    pub fn doing(&self) -> String {
        self.doing.lock().map(|d| d.clone()).unwrap_or_default()
    }
}

/// While it lives, the engine thread waits on the other ranks.
pub struct WaitingOnGroup<'a>(&'a Progress);

impl Drop for WaitingOnGroup<'_> {
    fn drop(&mut self) {
        self.0.waiting.store(false, Ordering::Release);
    }
}

/// Set by [`request_drain`]: this process received a termination signal.
static DRAIN_REQUESTED: AtomicBool = AtomicBool::new(false);

/// This process was asked to stop (SIGTERM from `mpirun`, `srun` or a pod's runtime, which
/// signal every process). A worker passes it on to the leader with its heartbeats; the leader
/// then drains the whole group, so it does not matter which process the signal reached.
pub fn request_drain() {
    DRAIN_REQUESTED.store(true, Ordering::Release);
}

pub(super) fn drain_requested() -> bool {
    DRAIN_REQUESTED.load(Ordering::Acquire)
}
