//! What the engine tells the server in front of it beyond "its thread runs": that a rank of its
//! group is suspected (so `/health` fails while the group may still recover), that the group is
//! about to stop and why (so requests in flight get an answer naming the cause before the
//! processes go), and that another process of the group was asked to stop (so the server drains
//! as if it had been signalled itself).
//!
//! One process serves one engine, so the reasons are plain strings meant for operators: they
//! name the rank and what happened to it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use tokio::sync::watch;

/// The engine's health, shared by its thread, its group's watchdog and the server.
pub struct EngineHealth {
    /// Whether the engine thread runs (cleared when its loop ends or unwinds).
    alive: AtomicBool,
    /// Why a rank is suspected now; cleared when it recovers.
    suspect: Mutex<Option<String>>,
    /// Why the group is about to stop; set once, never cleared.
    failing: watch::Sender<Option<String>>,
    /// Set once when the group was asked to stop (a termination signal on another process).
    stop: watch::Sender<bool>,
}

impl Default for EngineHealth {
    fn default() -> Self {
        Self::new()
    }
}

impl EngineHealth {
    pub fn new() -> Self {
        Self {
            alive: AtomicBool::new(true),
            suspect: Mutex::new(None),
            failing: watch::channel(None).0,
            stop: watch::channel(false).0,
        }
    }

    /// Whether the engine thread runs.
    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    /// The engine thread ended: health checks fail and submissions get `Unavailable`.
    pub(crate) fn set_stopped(&self) {
        self.alive.store(false, Ordering::Release);
    }

    /// `Ok` when the engine can serve; otherwise why not, for `/health`'s body.
    pub fn check(&self) -> Result<(), String> {
        if let Some(why) = self.failing.borrow().as_ref() {
            return Err(why.clone());
        }
        if !self.is_alive() {
            return Err("the engine is not running".into());
        }
        match self.suspect.lock().ok().and_then(|s| s.clone()) {
            Some(why) => Err(why),
            None => Ok(()),
        }
    }

    /// Sets (or, with `None`, clears) why a rank is suspected; true when that changed.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))] // a group's watchdog calls it
    pub(crate) fn set_suspect(&self, why: Option<String>) -> bool {
        let Ok(mut suspect) = self.suspect.lock() else {
            return false;
        };
        let changed = *suspect != why;
        *suspect = why;
        changed
    }

    /// The group is about to stop because of `why`: true for the first caller only (the one
    /// that then stops it), false when it was already failing.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))] // a group's watchdog calls it
    pub(crate) fn fail(&self, why: &str) -> bool {
        self.failing.send_if_modified(|failing| match failing {
            Some(_) => false,
            None => {
                *failing = Some(why.to_owned());
                true
            }
        })
    }

    /// Why the group is about to stop, once it is.
    pub fn failure(&self) -> Option<String> {
        self.failing.borrow().clone()
    }

    /// Changes to `Some(why)` when the group is about to stop.
    pub fn watch_failure(&self) -> watch::Receiver<Option<String>> {
        self.failing.subscribe()
    }

    /// Another process of the group was asked to stop: the server should drain.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))] // a group's watchdog calls it
    pub(crate) fn request_stop(&self) -> bool {
        self.stop
            .send_if_modified(|stop| !std::mem::replace(stop, true))
    }

    /// Changes to true when the group was asked to stop.
    pub fn watch_stop_request(&self) -> watch::Receiver<bool> {
        self.stop.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_wins_over_a_suspicion_and_is_set_once() {
        let health = EngineHealth::new();
        assert_eq!(health.check(), Ok(()));
        assert!(health.set_suspect(Some("rank 3 is stopped".into())));
        assert!(!health.set_suspect(Some("rank 3 is stopped".into())));
        assert_eq!(health.check(), Err("rank 3 is stopped".into()));
        let watch = health.watch_failure();
        assert!(health.fail("rank 3 stopped: no heartbeat for 5 s"));
        assert!(!health.fail("rank 1: engine step failed"));
        assert_eq!(
            watch.borrow().as_deref(),
            Some("rank 3 stopped: no heartbeat for 5 s")
        );
        assert_eq!(
            health.check(),
            Err("rank 3 stopped: no heartbeat for 5 s".into())
        );
        assert!(health.set_suspect(None));
        assert!(health.check().is_err(), "a failure is never cleared");
    }

    #[test]
    fn a_stop_request_is_reported_once() {
        let health = EngineHealth::new();
        let watch = health.watch_stop_request();
        assert!(health.request_stop());
        assert!(!health.request_stop());
        assert!(*watch.borrow());
        health.set_stopped();
        assert_eq!(health.check(), Err("the engine is not running".into()));
    }
}
