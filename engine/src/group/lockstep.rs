//! The loop every process of an EP group runs, one round at a time and all together:
//!
//! 1. the leader's control message reaches every process (new sequences handed to ranks,
//!    cancellations, stop);
//! 2. one reduction says whether any rank has work;
//! 3. if so, every process steps its ranks through the model, a rank without tokens included
//!    (it joins every MoE layer's collectives with zero tokens);
//! 4. every worker reports its sequences' events and its gauges to the leader, which forwards
//!    the events to the requests' streams.
//!
//! When no rank has work the leader sends an empty control message every half second, which is
//! also the group's heartbeat.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rackfill_models::Tokenizer;
use tokio::sync::mpsc as events;

use super::progress::Progress;
use ::metrics::gauge;

use super::wire::{Control, ControlPlane, HandOff, RankGauges, Report, LEADER};
use crate::engine::{fallback_seed, record_routing, Command};
use crate::ep::EpRuntime;
use crate::error::{EngineError, Result};
use crate::health::EngineHealth;
use crate::kv_export::KvExport;
use crate::metrics;
use crate::prefix_cache::{
    choose_rank, reusable_tokens, BlockHash, IndexChange, PrefixCacheStats, RankOffer,
};
use crate::request::{Event, GenerateRequest};
use crate::routing_trace::RoutingRecorder;
use crate::scheduler::{Scheduler, StepSummary};
use crate::sequence::{Sequence, SequenceParts};

/// How long an idle leader waits for a request before the next heartbeat round.
const IDLE_ROUND: Duration = Duration::from_millis(500);

/// One process's side of the group loop.
pub struct Lockstep {
    runtime: EpRuntime,
    scheduler: Scheduler,
    control: ControlPlane,
    progress: Arc<Progress>,
    /// This process's health: a failed round fails it, and the watchdog stops the group.
    health: Arc<EngineHealth>,
    tokenizer: Arc<Tokenizer>,
    eos: Arc<[u32]>,
    kv_export: Option<Arc<KvExport>>,
    /// Workers: the event streams of the sequences they run for the leader, by id.
    outboxes: BTreeMap<u64, events::UnboundedReceiver<Event>>,
    /// The leader's state; `None` on workers.
    leader: Option<Leader>,
    /// Joined once the loop ends, before MPI is finalised.
    watchdog: std::thread::JoinHandle<()>,
}

/// What a process steps with: its ranks' runtime and scheduler, the control plane, the
/// progress its watchdog watches and the health it reports to.
pub struct Stepper {
    pub runtime: EpRuntime,
    pub scheduler: Scheduler,
    pub control: ControlPlane,
    pub progress: Arc<Progress>,
    pub health: Arc<EngineHealth>,
    /// This process's KV exporter, if it runs.
    pub kv_export: Option<Arc<KvExport>>,
}

/// What only the leader keeps.
pub struct Leader {
    pub commands: Receiver<Command>,
    pub queued: Arc<AtomicUsize>,
    pub recorder: Option<RoutingRecorder>,
    pub step: u64,
    /// Sequences running on other ranks, by id.
    pub remote: HashMap<u64, Remote>,
    /// Per rank: tokens reserved (last report, plus what was handed to it since).
    pub reserved: Vec<usize>,
    /// Per rank: sequences running at the last report.
    pub running: Vec<usize>,
    /// Per rank, the leader's own included: the block hashes its prefix cache holds, mirrored
    /// from its index changes, plus those of the prompts handed to it since (it computes them).
    pub cached: Vec<HashSet<BlockHash>>,
    pub stopping: bool,
    /// Whether any rank still had work after the last round.
    pub busy: bool,
}

/// A sequence the leader handed to another rank.
pub struct Remote {
    rank: usize,
    events: events::UnboundedSender<Event>,
    cancelled: bool,
}

impl Leader {
    pub fn new(
        commands: Receiver<Command>,
        queued: Arc<AtomicUsize>,
        recorder: Option<RoutingRecorder>,
        ranks: usize,
    ) -> Self {
        Self {
            commands,
            queued,
            recorder,
            step: 0,
            remote: HashMap::new(),
            reserved: vec![0; ranks],
            running: vec![0; ranks],
            cached: vec![HashSet::new(); ranks],
            stopping: false,
            busy: false,
        }
    }
}

/// Where the leader sends a new sequence.
struct Route {
    rank: usize,
    /// Prompt tokens the rank is expected to reuse.
    reused: usize,
    /// The prompt's block hashes.
    hashes: Vec<BlockHash>,
}

/// What this process did in one round.
struct Round {
    /// The step, and how long it took.
    summary: Option<(StepSummary, Duration)>,
    left_waiting: usize,
    failed: Option<String>,
}

impl Lockstep {
    /// The loop of a leader (`leader` given) or a worker, serving the model of `tokenizer` and
    /// end-of-sequence ids `eos`.
    pub fn new(
        stepper: Stepper,
        tokenizer: Arc<Tokenizer>,
        eos: Vec<u32>,
        leader: Option<Leader>,
        watchdog: std::thread::JoinHandle<()>,
    ) -> Self {
        let Stepper {
            runtime,
            scheduler,
            control,
            progress,
            health,
            kv_export,
        } = stepper;
        let mut scheduler = scheduler;
        scheduler.journal_index_changes();
        Self {
            runtime,
            scheduler,
            control,
            progress,
            health,
            kv_export,
            tokenizer,
            eos: eos.into(),
            outboxes: BTreeMap::new(),
            leader,
            watchdog,
        }
    }

    /// Runs rounds until the leader says stop. An error (a failed step, a broken message)
    /// stops the whole group, since its processes cannot stay in step after it: this thread
    /// fails the process's health and waits, and the watchdog stops the group (on the leader,
    /// after every open request got the error; on a worker, once the leader, which learns of
    /// the failure from the round's report, says so).
    pub fn run(mut self) {
        loop {
            match self.round() {
                Ok(true) => {}
                Ok(false) => break,
                Err(err) => {
                    self.health.fail(&err.to_string());
                    loop {
                        std::thread::park();
                    }
                }
            }
        }
        self.progress.finish();
        let _ = self.watchdog.join();
        if let Some(leader) = &mut self.leader {
            leader.queued.store(0, Ordering::Release);
            for remote in leader.remote.values() {
                let _ = remote
                    .events
                    .send(Event::Error("the engine stopped".into()));
            }
        }
        self.scheduler.fail_all("the engine stopped");
    }

    /// One round; false once the group stops.
    fn round(&mut self) -> Result<bool> {
        let control = match self.leader.is_some() {
            true => {
                let control = self.leader_control();
                if control.stop {
                    // Workers leave as soon as they read it: no longer a fault.
                    self.progress.finish();
                }
                self.progress.tick("broadcasting the control message");
                let _waiting = self.progress.waiting_on_group();
                self.control.broadcast(Some(&control))?
            }
            false => {
                self.progress
                    .tick("waiting for the leader's control message");
                let _waiting = self.progress.waiting_on_group();
                self.control.broadcast(None)?
            }
        };
        self.progress.tick("applying the leader's control message");
        if control.stop {
            return Ok(false);
        }
        let round = self.apply_and_step(control);
        self.progress.tick("exchanging reports");
        match self.leader.is_some() {
            true => self.gather_reports(round)?,
            false => {
                let failed = round.failed.clone();
                let report = self.report(&round);
                let _waiting = self.progress.waiting_on_group();
                self.control.send_report(&report)?;
                if let Some(why) = failed {
                    return Err(step_failed(self.control.rank(), &why));
                }
            }
        }
        Ok(true)
    }

    /// The leader takes the handle's commands (waiting a little when the group is idle) and
    /// turns them into this round's control message.
    fn leader_control(&mut self) -> Control {
        let mut control = Control::default();
        let leader = self.leader.as_mut().expect("leader state");
        if !leader.busy && !leader.stopping {
            match leader.commands.recv_timeout(IDLE_ROUND) {
                Ok(command) => self.command(command, &mut control),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => self.leader_mut().stopping = true,
            }
        }
        while let Ok(command) = self.leader_mut().commands.try_recv() {
            self.command(command, &mut control);
        }
        let leader = self.leader_mut();
        for (&id, remote) in &mut leader.remote {
            if remote.events.is_closed() && !remote.cancelled {
                remote.cancelled = true;
                control.cancels.push((remote.rank, id));
            }
        }
        control.stop = leader.stopping
            && !leader.busy
            && control.handoffs.is_empty()
            && self.scheduler.is_idle();
        control
    }

    fn leader_mut(&mut self) -> &mut Leader {
        self.leader.as_mut().expect("leader state")
    }

    /// Applies one of the handle's commands on the leader.
    fn command(&mut self, command: Command, control: &mut Control) {
        match command {
            Command::Submit(sequences) => {
                for parts in sequences {
                    let route = self.route(&parts.request);
                    let rank = route.rank;
                    let reserve =
                        parts.request.prompt.len() + parts.request.params.max_tokens as usize;
                    // The rank computes the prompt's blocks: later requests with the same
                    // prefix go there too, and wait on the rank for them if they must.
                    self.leader_mut().cached[rank].extend(route.hashes);
                    if rank == LEADER {
                        let cache = self.runtime.new_cache(self.scheduler.block_tokens());
                        self.scheduler.enqueue(Sequence::new(parts, cache));
                        continue;
                    }
                    let leader = self.leader_mut();
                    leader.reserved[rank] += reserve - route.reused;
                    leader.running[rank] += 1;
                    leader.remote.insert(
                        parts.id,
                        Remote {
                            rank,
                            events: parts.events,
                            cancelled: false,
                        },
                    );
                    control.handoffs.push(HandOff {
                        rank,
                        id: parts.id,
                        request: parts.request,
                        waited: parts.arrived.elapsed(),
                        export_kv: parts.kv_export.is_some(),
                    });
                }
            }
            Command::Cancel(id) => match self.leader_mut().remote.get_mut(&id) {
                Some(remote) if !remote.cancelled => {
                    remote.cancelled = true;
                    control.cancels.push((remote.rank, id));
                }
                Some(_) => {}
                None => self.scheduler.cancel(id),
            },
            Command::Shutdown => self.leader_mut().stopping = true,
        }
    }

    /// The rank for a new sequence, by the rule one process's scheduler admits with
    /// ([`choose_rank`]) over every rank's mirrored cache: the rank holding the longest prefix
    /// of its prompt unless its reserved tokens exceed the least-loaded rank's by more than the
    /// prefix saves plus one step's tokens, else the least-loaded.
    fn route(&self, request: &GenerateRequest) -> Route {
        let leader = self.leader.as_ref().expect("leader state");
        let hasher = self.scheduler.hasher();
        let mut hashes = Vec::new();
        hasher.extend(&mut hashes, &request.prompt);
        let logprobs = request.params.prompt_logprobs.is_some();
        let bt = hasher.block_tokens();
        let offers: Vec<RankOffer> = (0..self.control.size())
            .map(|rank| {
                let (load, running) = match rank {
                    LEADER => (self.scheduler.reserved_tokens(), self.scheduler.running()),
                    _ => (leader.reserved[rank], leader.running[rank]),
                };
                let cached = &leader.cached[rank];
                let hit = hashes.iter().take_while(|h| cached.contains(h)).count();
                RankOffer {
                    rank,
                    load,
                    running,
                    reused: reusable_tokens(hit, bt, request.prompt.len(), logprobs),
                }
            })
            .collect();
        let rank = choose_rank(&offers, self.scheduler.cache_slack()).unwrap_or(LEADER);
        Route {
            rank,
            reused: offers.get(rank).map_or(0, |o| o.reused),
            hashes,
        }
    }

    /// Queues this rank's hand-offs, applies its cancellations, and steps with the group if any
    /// rank has work.
    fn apply_and_step(&mut self, control: Control) -> Round {
        let me = self.control.rank();
        for handoff in control.handoffs.into_iter().filter(|h| h.rank == me) {
            let (tx, rx) = events::unbounded_channel();
            let arrived = Instant::now()
                .checked_sub(handoff.waited)
                .unwrap_or_else(Instant::now);
            self.outboxes.insert(handoff.id, rx);
            let kv_export = match (handoff.export_kv, &self.kv_export) {
                (false, _) => None,
                (true, Some(export)) => Some(Arc::clone(export)),
                (true, None) => {
                    // The group agreed at start that every rank exports; kept as an answer
                    // rather than a silent response without its KV.
                    let _ = tx.send(Event::Error(format!("rank {me} cannot export KV")));
                    continue;
                }
            };
            let parts = SequenceParts {
                id: handoff.id,
                request: handoff.request,
                arrived,
                fallback_seed: fallback_seed(handoff.id),
                tokenizer: Arc::clone(&self.tokenizer),
                eos: Arc::clone(&self.eos),
                events: tx,
                kv_export,
            };
            let cache = self.runtime.new_cache(self.scheduler.block_tokens());
            self.scheduler.enqueue(Sequence::new(parts, cache));
        }
        for (_, id) in control.cancels.into_iter().filter(|(rank, _)| *rank == me) {
            self.scheduler.cancel(id);
        }
        let waiting = self.scheduler.waiting();
        let mut round = Round {
            summary: None,
            left_waiting: 0,
            failed: None,
        };
        let any_work = {
            let _waiting = self.progress.waiting_on_group();
            self.control.any(!self.scheduler.is_idle())
        };
        if any_work {
            self.progress.tick("stepping with the group");
            let started = Instant::now();
            match self.scheduler.step_with_group(&mut self.runtime) {
                Ok(summary) => round.summary = Some((summary, started.elapsed())),
                Err(err) => round.failed = Some(err.to_string()),
            }
        }
        round.left_waiting = waiting.saturating_sub(self.scheduler.waiting());
        round
    }

    fn gauges(&self) -> RankGauges {
        RankGauges {
            waiting: self.scheduler.waiting(),
            running: self.scheduler.running(),
            kv_usage: self.scheduler.kv_usage(),
            reserved_tokens: self.scheduler.reserved_tokens(),
            fabric_bytes: self.runtime.bytes_moved(),
            prefix: PrefixCacheStats::merged(&self.scheduler.prefix_stats()),
            kv_export: self
                .kv_export
                .as_ref()
                .map(|export| export.stats())
                .unwrap_or_default(),
        }
    }

    /// A worker's report: its sequences' new events (finished ones leave the outbox).
    fn report(&mut self, round: &Round) -> Report {
        let mut events = Vec::new();
        self.outboxes.retain(|&id, rx| {
            let mut batch = Vec::new();
            let mut open = true;
            while let Ok(event) = rx.try_recv() {
                open &= !matches!(event, Event::Finished(_) | Event::Error(_));
                batch.push(event);
            }
            if !batch.is_empty() {
                events.push((id, batch));
            }
            open
        });
        Report {
            events,
            gauges: self.gauges(),
            left_waiting: round.left_waiting,
            tokens: round
                .summary
                .as_ref()
                .map_or(0, |(s, _)| s.tokens.iter().sum()),
            failed: round.failed.clone(),
            index_changes: self.scheduler.take_index_changes(),
        }
    }

    /// The leader takes every worker's report, in rank order, forwards the events, and
    /// records the round's metrics; a failed rank stops the group.
    fn gather_reports(&mut self, round: Round) -> Result<()> {
        let size = self.control.size();
        let mut gauges = vec![self.gauges()];
        let mut tokens = round
            .summary
            .as_ref()
            .map_or(0, |(s, _)| s.tokens.iter().sum());
        let mut left = round.left_waiting;
        let mut failed = round.failed.map(|why| (LEADER, why));
        let own = self.scheduler.take_index_changes();
        mirror(&mut self.leader_mut().cached[LEADER], own);
        for rank in 1..size {
            // A failed step stops the group: the reports of the other ranks no longer matter,
            // and a rank that stalled (the likely cause) would never send its own.
            if let Some((rank, why)) = &failed {
                return Err(step_failed(*rank, why));
            }
            self.progress
                .tick(format!("waiting for rank {rank}'s report"));
            let report = {
                let _waiting = self.progress.waiting_on_group();
                self.control.receive_report(rank)?
            };
            let leader = self.leader_mut();
            for (id, batch) in report.events {
                let Some(remote) = leader.remote.get(&id) else {
                    continue;
                };
                let mut done = false;
                for event in batch {
                    done |= matches!(event, Event::Finished(_) | Event::Error(_));
                    let _ = remote.events.send(event);
                }
                if done {
                    leader.remote.remove(&id);
                }
            }
            mirror(&mut leader.cached[rank], report.index_changes);
            leader.reserved[rank] = report.gauges.reserved_tokens;
            leader.running[rank] = report.gauges.running;
            tokens += report.tokens;
            left += report.left_waiting;
            if failed.is_none() {
                failed = report.failed.map(|why| (rank, why));
            }
            gauges.push(report.gauges);
        }
        let idle = self.scheduler.is_idle() && gauges.iter().all(|g| g.waiting + g.running == 0);
        let leader = self.leader_mut();
        let _ = leader
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                Some(q.saturating_sub(left))
            });
        leader.busy = !idle;
        record_ranks(&gauges);
        if let Some((summary, took)) = &round.summary {
            metrics::record_step(&summary.output, tokens, *took);
            record_routing(&mut leader.recorder, leader.step, &summary.output);
            leader.step += 1;
            // The leader's own placement: every process of a group runs the same backend.
            metrics::record_placement(self.runtime.data_path(), self.runtime.device_weight_bytes());
        }
        match failed {
            Some((rank, why)) => Err(step_failed(rank, &why)),
            None => Ok(()),
        }
    }
}

/// The error of a step that failed on `rank`.
fn step_failed(rank: usize, why: &str) -> EngineError {
    EngineError::Fabric(format!("rank {rank}: engine step failed: {why}"))
}

/// Applies a rank's prefix-cache index changes to the leader's mirror of it.
fn mirror(cached: &mut HashSet<BlockHash>, changes: Vec<IndexChange>) {
    for change in changes {
        match change {
            IndexChange::Added(hash) => cached.insert(hash),
            IndexChange::Removed(hash) => cached.remove(&hash),
        };
    }
}

/// Records an EP group's queue and KV gauges on its leader: group totals under the usual names,
/// and every rank's under the `rank_` names with a `rank` label. `ranks[r]` is rank `r`'s.
fn record_ranks(ranks: &[RankGauges]) {
    let waiting = ranks.iter().map(|g| g.waiting).sum();
    let running = ranks.iter().map(|g| g.running).sum();
    let kv = ranks.iter().map(|g| g.kv_usage).sum::<f64>() / ranks.len().max(1) as f64;
    metrics::record_queue(waiting, running, kv);
    gauge!(metrics::GROUP_RANKS).set(ranks.len() as f64);
    metrics::record_fabric(ranks.iter().map(|g| g.fabric_bytes).sum());
    metrics::record_prefix_cache(&ranks.iter().map(|g| g.prefix).collect::<Vec<_>>());
    for (index, g) in ranks.iter().enumerate() {
        let rank = index.to_string();
        gauge!(metrics::RANK_FABRIC_BYTES, "rank" => rank.clone()).set(g.fabric_bytes as f64);
        gauge!(metrics::RANK_WAITING, "rank" => rank.clone()).set(g.waiting as f64);
        gauge!(metrics::RANK_RUNNING, "rank" => rank.clone()).set(g.running as f64);
        gauge!(metrics::RANK_KV_USAGE, "rank" => rank).set(g.kv_usage);
        if g.kv_export != Default::default() {
            crate::kv_export::pool::record_metrics(index, &g.kv_export);
        }
    }
}
