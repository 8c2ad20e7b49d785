//! The leader's view of its group's liveness, and the rules that turn it into a verdict.
//!
//! Every worker sends the leader a [`Beat`] twice a second from its watchdog thread, apart from
//! its engine thread: so a rank whose process is killed, stopped or cut off goes silent, while a
//! rank whose engine thread is stuck still beats and says how long it has been stuck and whether
//! it waits on the other ranks (in a collective) or on its own work. For ranks on its own host
//! the leader also reads the process's state from `/proc`, which tells a killed or stopped
//! process at once. From that the leader alone names the rank at fault: a healthy rank blocked
//! waiting for it never decides anything.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::progress::Progress;

/// A worker's heartbeat.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Beat {
    pub rank: usize,
    /// How long its engine thread had made no progress when it sent this.
    pub stalled: Duration,
    /// Whether its engine thread waits on the other ranks.
    pub waiting: bool,
    /// What its engine thread does.
    pub doing: String,
    /// The process received a termination signal: the group should drain.
    pub drain: bool,
}

impl Beat {
    /// This process's beat now.
    pub fn of(rank: usize, progress: &Progress, drain: bool) -> Self {
        Self {
            rank,
            stalled: progress.stalled_for(),
            waiting: progress.is_waiting(),
            doing: progress.doing(),
            drain,
        }
    }
}

/// A rank's process as `/proc` shows it (ranks on the leader's host only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessState {
    /// On another host (or another PID namespace): only heartbeats tell.
    Unknown,
    Running,
    /// Stopped by a signal (SIGSTOP, SIGTSTP) or a debugger.
    Stopped,
    /// Exited or killed (gone, or a zombie not yet reaped).
    Gone,
}

impl ProcessState {
    /// The state of process `pid`, from the state letter of `/proc/PID/stat`.
    pub fn of(pid: u32) -> Self {
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            return Self::Gone;
        };
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next());
        match state {
            Some('T' | 't') => Self::Stopped,
            Some('Z' | 'X' | 'x') | None => Self::Gone,
            Some(_) => Self::Running,
        }
    }
}

/// What the leader knows of one rank.
#[derive(Debug, Clone)]
struct RankState {
    /// When its last heartbeat arrived (start, until the first).
    heard: Instant,
    last: Beat,
    pid: Option<u32>,
    process: ProcessState,
}

/// What the leader concludes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Healthy,
    /// A rank may be failing; the group still waits for it (`/health` answers 503 meanwhile).
    Suspect(String),
    /// The group must stop, for this reason.
    Failed(String),
}

/// The leader's view of every rank of its group.
pub struct GroupView {
    ranks: Vec<RankState>,
    timeout: Duration,
    suspect_after: Duration,
    /// After the leader's own process did not run: judge only processes gone until then, while
    /// the group's progress catches up.
    settle_until: Option<Instant>,
}

/// How long the group gets to catch up after the leader's own process did not run.
const SETTLE: Duration = Duration::from_secs(2);

impl GroupView {
    /// A group of `pids.len()` ranks; `pids[r]` is rank `r`'s process when the leader can read
    /// its state (same host and PID namespace). A rank silent or stuck for `timeout` fails the
    /// group; one silent for a heartbeat period or two is suspected.
    pub fn new(pids: Vec<Option<u32>>, timeout: Duration, now: Instant) -> Self {
        let ranks = pids
            .into_iter()
            .map(|pid| RankState {
                heard: now,
                last: Beat::default(),
                pid,
                process: if pid.is_some() {
                    ProcessState::Running
                } else {
                    ProcessState::Unknown
                },
            })
            .collect();
        Self {
            ranks,
            timeout,
            suspect_after: (timeout / 2).min(Duration::from_secs(2)),
            settle_until: None,
        }
    }

    /// Rank `beat.rank`'s heartbeat arrived at `now`.
    pub fn heard(&mut self, beat: Beat, now: Instant) {
        if let Some(rank) = self.ranks.get_mut(beat.rank) {
            rank.heard = now;
            rank.last = beat;
        }
    }

    /// Counts every rank as heard from at `now`: the leader's own process did not run for a
    /// while, so the silence meanwhile says nothing about the others.
    pub fn restart_clocks(&mut self, now: Instant) {
        for rank in &mut self.ranks {
            rank.heard = now;
        }
        self.settle_until = Some(now + SETTLE);
    }

    /// How long ago each rank was last heard of.
    pub fn heartbeat_ages(&self, now: Instant) -> impl Iterator<Item = (usize, Duration)> + '_ {
        self.ranks
            .iter()
            .enumerate()
            .map(move |(r, s)| (r, now.saturating_duration_since(s.heard)))
    }

    /// Reads the state of every rank whose process the leader can see.
    pub fn poll_processes(&mut self) {
        for rank in &mut self.ranks {
            if let Some(pid) = rank.pid {
                rank.process = ProcessState::of(pid);
            }
        }
    }

    /// The first rank whose process received a termination signal.
    pub fn drain_requested_by(&self) -> Option<usize> {
        self.ranks.iter().position(|r| r.last.drain)
    }

    /// The verdict at `now`, rank `r`'s engine thread now being `stalled[r]` behind (its last
    /// beat's figure aged by the time since).
    pub fn assess(&self, now: Instant) -> Verdict {
        let named = |r: usize| match self.ranks[r].pid {
            Some(pid) => format!("rank {r} (pid {pid})"),
            None => format!("rank {r}"),
        };
        if let Some(r) = self.position(|s| s.process == ProcessState::Gone) {
            return Verdict::Failed(format!("{} exited or was killed", named(r)));
        }
        if self.settle_until.is_some_and(|until| now < until) {
            return Verdict::Healthy;
        }
        let silent = |s: &RankState| now.saturating_duration_since(s.heard);
        if let Some(r) = self.position(|s| silent(s) > self.timeout) {
            let why = match self.ranks[r].process {
                ProcessState::Stopped => "its process is stopped (SIGSTOP or a debugger)",
                _ => "killed, stopped, or its host is down",
            };
            return Verdict::Failed(format!(
                "{} stopped: no heartbeat for {:.1} s ({why})",
                named(r),
                silent(&self.ranks[r]).as_secs_f64()
            ));
        }
        if let Some(verdict) = self.assess_progress(now, &named) {
            return verdict;
        }
        if let Some(r) = self.position(|s| s.process == ProcessState::Stopped) {
            return Verdict::Suspect(format!(
                "{} is stopped (SIGSTOP or a debugger): the group stops unless it resumes \
                 within {:.0} s",
                named(r),
                self.timeout.as_secs_f64()
            ));
        }
        if let Some(r) = self.position(|s| silent(s) > self.suspect_after) {
            return Verdict::Suspect(format!(
                "{} is suspected: no heartbeat for {:.1} s",
                named(r),
                silent(&self.ranks[r]).as_secs_f64()
            ));
        }
        Verdict::Healthy
    }

    /// A group whose ranks stopped making progress while they still beat: the rank stuck in
    /// its own work is at fault, not those waiting for it in a collective. When every stuck
    /// rank waits on the group, the longest-stuck one is named. A rank gone silent is judged
    /// by its silence instead.
    fn assess_progress(&self, now: Instant, named: &dyn Fn(usize) -> String) -> Option<Verdict> {
        let silent = |s: &RankState| now.saturating_duration_since(s.heard);
        let stalled = |s: &RankState| s.last.stalled + silent(s);
        let stuck: Vec<usize> = (0..self.ranks.len())
            .filter(|&r| {
                let s = &self.ranks[r];
                silent(s) <= self.suspect_after && stalled(s) > self.timeout
            })
            .collect();
        let oldest = |ranks: &mut dyn Iterator<Item = usize>| {
            ranks.max_by_key(|&r| (stalled(&self.ranks[r]), std::cmp::Reverse(r)))
        };
        if stuck.is_empty() {
            return None;
        }
        // Someone is stuck past the timeout: who holds the group up, among the ranks heard
        // from? A process seen stopped (a debugger may stop its engine thread alone, even inside
        // a collective); else a rank long busy with its own work while the others wait (its own
        // figure may lag the waiters' by a heartbeat); else the longest-stuck.
        let heard: Vec<usize> = (0..self.ranks.len())
            .filter(|&r| silent(&self.ranks[r]) <= self.suspect_after)
            .collect();
        let process_stopped = |r: &usize| self.ranks[*r].process == ProcessState::Stopped;
        let long_working = |r: &usize| {
            let s = &self.ranks[*r];
            !s.last.waiting && stalled(s) > self.timeout / 2
        };
        let (r, others) =
            if let Some(r) = oldest(&mut heard.iter().copied().filter(process_stopped)) {
                (r, "its process is stopped; the other ranks wait for it")
            } else if let Some(r) = oldest(&mut heard.iter().copied().filter(long_working)) {
                (r, "the other ranks wait for it")
            } else {
                (
                    oldest(&mut stuck.iter().copied())?,
                    "every stuck rank waits on the group",
                )
            };
        let s = &self.ranks[r];
        Some(Verdict::Failed(format!(
            "{} made no progress for {:.1} s while {} ({others})",
            named(r),
            stalled(s).as_secs_f64(),
            s.last.doing
        )))
    }

    fn position(&self, pred: impl Fn(&RankState) -> bool) -> Option<usize> {
        self.ranks.iter().position(pred)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMEOUT: Duration = Duration::from_secs(5);

    fn beat(rank: usize, stalled_s: u64, waiting: bool, doing: &str) -> Beat {
        Beat {
            rank,
            stalled: Duration::from_secs(stalled_s),
            waiting,
            doing: doing.into(),
            drain: false,
        }
    }

    #[test]
    fn a_silent_rank_is_suspected_then_named_while_the_others_wait() {
        let t0 = Instant::now();
        let mut view = GroupView::new(vec![None; 4], TIMEOUT, t0);
        let at = |s: f64| t0 + Duration::from_secs_f64(s);
        for r in 0..4 {
            view.heard(beat(r, 0, false, "stepping"), at(0.5));
        }
        assert_eq!(view.assess(at(1.0)), Verdict::Healthy);
        // Rank 3 goes silent; the healthy ranks wait for it in a collective and keep beating.
        for s in [1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 5.5] {
            for r in 0..3 {
                view.heard(beat(r, (s - 0.5) as u64, true, "in a collective"), at(s));
            }
        }
        assert_eq!(
            view.assess(at(3.0)),
            Verdict::Suspect("rank 3 is suspected: no heartbeat for 2.5 s".into())
        );
        // Had its last beat said it had been working for 2 s, it is still judged by its silence.
        let mut working = GroupView::new(vec![None; 4], TIMEOUT, t0);
        for r in 0..4 {
            working.heard(beat(r, 2 * u64::from(r == 3), false, "stepping"), at(0.5));
        }
        for r in 0..3 {
            working.heard(beat(r, 0, false, "stepping"), at(4.2));
        }
        assert!(matches!(working.assess(at(4.2)), Verdict::Suspect(_)));
        match view.assess(at(5.6)) {
            Verdict::Failed(why) => assert!(
                why.starts_with("rank 3 stopped: no heartbeat for 5.1 s"),
                "{why}"
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn silence_while_the_leader_itself_was_stopped_proves_nothing() {
        let t0 = Instant::now();
        let mut view = GroupView::new(vec![None; 3], TIMEOUT, t0);
        for r in 0..3 {
            view.heard(beat(r, 0, false, "idle"), t0);
        }
        let resumed = t0 + Duration::from_secs(10);
        assert!(matches!(view.assess(resumed), Verdict::Failed(_)));
        view.restart_clocks(resumed);
        assert_eq!(view.assess(resumed), Verdict::Healthy);
        // Meanwhile every engine looked stuck (they waited for the leader); they catch up.
        for r in 0..3 {
            view.heard(beat(r, 9, true, "in a collective"), resumed);
        }
        assert_eq!(
            view.assess(resumed + Duration::from_secs(1)),
            Verdict::Healthy
        );
        for r in 0..3 {
            view.heard(beat(r, 0, false, "stepping"), resumed + SETTLE);
        }
        assert_eq!(view.assess(resumed + SETTLE), Verdict::Healthy);
    }

    #[test]
    fn the_rank_stuck_in_its_own_work_is_named_not_those_waiting_for_it() {
        let t0 = Instant::now();
        let mut view = GroupView::new(vec![None; 4], TIMEOUT, t0);
        let now = t0 + Duration::from_secs(10);
        view.heard(beat(0, 6, true, "waiting for rank 1's report"), now);
        view.heard(beat(1, 7, true, "stepping with the group"), now);
        view.heard(beat(2, 6, false, "stepping with the group"), now);
        view.heard(beat(3, 8, true, "stepping with the group"), now);
        match view.assess(now) {
            Verdict::Failed(why) => assert_eq!(
                why,
                "rank 2 made no progress for 6.0 s while stepping with the group (the other \
                 ranks wait for it)"
            ),
            other => panic!("{other:?}"),
        }
        // A process seen stopped is named, even when its engine thread was inside a collective.
        let mut traced = GroupView::new(vec![None, None, Some(own_pid()), None], TIMEOUT, t0);
        for (r, stalled) in [(0, 6), (1, 7), (2, 6), (3, 8)] {
            traced.heard(beat(r, stalled, true, "stepping with the group"), now);
        }
        traced.ranks[2].process = ProcessState::Stopped;
        match traced.assess(now) {
            Verdict::Failed(why) => assert!(why.starts_with("rank 2 (pid"), "{why}"),
            other => panic!("{other:?}"),
        }
        // The culprit's own figure lags the waiters' by a heartbeat: still named.
        let mut lagging = GroupView::new(vec![None; 3], TIMEOUT, t0);
        lagging.heard(beat(0, 6, true, "waiting for rank 2's report"), now);
        lagging.heard(beat(1, 6, true, "stepping with the group"), now);
        lagging.heard(beat(2, 4, false, "stepping with the group"), now);
        match lagging.assess(now) {
            Verdict::Failed(why) => assert!(why.starts_with("rank 2 made no progress"), "{why}"),
            other => panic!("{other:?}"),
        }
        // Everyone waiting (a lost message): the longest-stuck rank.
        view.heard(beat(2, 6, true, "stepping with the group"), now);
        match view.assess(now) {
            Verdict::Failed(why) => assert!(why.starts_with("rank 3 made no progress"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    fn own_pid() -> u32 {
        std::process::id()
    }

    #[test]
    fn a_process_seen_on_this_host_is_judged_at_once() {
        let t0 = Instant::now();
        let own = std::process::id();
        // Far above any PID this host hands out: no such process.
        let gone = 4_000_000_000;
        let mut view = GroupView::new(vec![None, Some(own), Some(gone)], TIMEOUT, t0);
        view.poll_processes();
        assert_eq!(
            view.assess(t0),
            Verdict::Failed(format!("rank 2 (pid {gone}) exited or was killed"))
        );
        assert_eq!(ProcessState::of(own), ProcessState::Running);
    }

    #[test]
    fn a_termination_signal_on_any_rank_is_seen() {
        let t0 = Instant::now();
        let mut view = GroupView::new(vec![None; 3], TIMEOUT, t0);
        assert_eq!(view.drain_requested_by(), None);
        view.heard(
            Beat {
                drain: true,
                ..beat(2, 0, false, "idle")
            },
            t0,
        );
        assert_eq!(view.drain_requested_by(), Some(2));
    }
}
