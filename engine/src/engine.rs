//! The engine thread and its handle.
//!
//! The EP runtime and the scheduler live on one dedicated OS thread (model compute is CPU-bound
//! and must never block an async runtime), fed by a bounded channel. Callers validate requests
//! ([`EngineHandle::validate`]) and queue them ([`EngineHandle::enqueue`]) from any thread
//! through a cloneable [`EngineHandle`], and read events from an unbounded tokio channel per
//! sequence; dropping the receiver cancels the sequence at the next step.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use rackfill_balancer::LoadMatrix;
use rackfill_models::{ModelConfig, Tokenizer};
use tokio::sync::mpsc as events;

use crate::ep::{EpConfig, EpRuntime, StepOutput};
use crate::error::{EngineError, Result};
use crate::fabric::LocalFabric;
use crate::health::EngineHealth;
use crate::kv_export::{self, KvExport, KvExportConfig, KvExportSupport};
use crate::metrics;
use crate::model_device::ModelDevice;
use crate::model_weights::ModelWeights;
use crate::prefix_cache;
use crate::request::{GenerateRequest, RequestStream};
use crate::routing_trace::{RoutingRecorder, RoutingTraceConfig};
use crate::scheduler::{Scheduler, SchedulerConfig};
use crate::sequence::{Sequence, SequenceParts};
use crate::validation::{RequestError, RequestLimits, ValidatedRequest};

/// Everything the engine needs besides the model.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub ep: EpConfig,
    /// Where each rank's dense parts run (the routed experts run on `ep.data_plane`).
    pub device: ModelDevice,
    pub scheduler: SchedulerConfig,
    /// Sequences submitted but not yet admitted beyond which `enqueue` answers `QueueFull`;
    /// also the most sequences one request may have.
    pub max_waiting: usize,
    /// The most tokens (prompt plus `max_tokens`, summed over its sequences) one request may
    /// reserve; more is refused at validation, so one request cannot hold the engine for
    /// minutes (default 524,288: 128 sequences of a 4,096-token context).
    pub max_request_tokens: usize,
    /// Record every step's per-layer load matrices, up to a byte cap (see [`RoutingRecorder`]).
    pub record_routing: Option<RoutingTraceConfig>,
    /// Hand prompts' KV to decode engines over NIXL (see [`crate::kv_export`]).
    pub kv_export: Option<KvExportConfig>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            ep: EpConfig::default(),
            device: ModelDevice::Cpu,
            scheduler: SchedulerConfig::default(),
            max_waiting: 1024,
            max_request_tokens: 1 << 19,
            record_routing: None,
            kv_export: None,
        }
    }
}

/// What callers need to know about the served model.
#[derive(Debug, Clone)]
pub struct EngineInfo {
    /// The model's own context length (`max_position_embeddings`).
    pub max_model_len: usize,
    /// End-of-sequence ids (generation stops on them unless `ignore_eos`).
    pub eos: Arc<[u32]>,
    /// What requests are validated against.
    pub limits: RequestLimits,
}

/// What the handle asks of the engine thread.
pub(crate) enum Command {
    /// Every sequence of one request, queued together.
    Submit(Vec<SequenceParts>),
    Cancel(u64),
    Shutdown,
}

/// The engine thread's side of its handle.
pub(crate) struct EngineThread {
    pub(crate) commands: Receiver<Command>,
    /// Sequences not yet admitted (the thread lowers it as it admits or drops them).
    pub(crate) queued: Arc<AtomicUsize>,
    /// Whether the engine can serve, and why not (what health checks report).
    pub(crate) health: Arc<EngineHealth>,
}

struct Shared {
    tx: SyncSender<Command>,
    info: EngineInfo,
    tokenizer: Arc<Tokenizer>,
    next_id: AtomicU64,
    /// Sequences not yet admitted: in the channel or waiting in the scheduler.
    queued: Arc<AtomicUsize>,
    health: Arc<EngineHealth>,
    /// This process's KV exporter, if it runs (the leader's, in a group).
    kv_export: Option<Arc<KvExport>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// Whether the engine thread runs: set while an `AliveFlag` lives, cleared when it is dropped,
/// which happens when the thread's loop returns and when it unwinds from a panic.
struct AliveFlag(Arc<EngineHealth>);

impl Drop for AliveFlag {
    fn drop(&mut self) {
        self.0.set_stopped();
    }
}

/// A cloneable handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    shared: Arc<Shared>,
}

impl EngineHandle {
    /// Starts the engine thread on `model`, every EP rank in this process.
    pub fn spawn(
        weights: impl Into<ModelWeights>,
        tokenizer: Arc<Tokenizer>,
        eos: Vec<u32>,
        config: EngineConfig,
    ) -> Result<Self> {
        let weights = weights.into();
        let fabric = Box::new(LocalFabric::new(config.ep.ep_size)?);
        let runtime = EpRuntime::open(
            &weights,
            config.ep,
            fabric,
            (config.device, None),
            config.scheduler.kv_tokens_per_rank,
        )?;
        let scheduler = new_scheduler(config.ep.ep_size, &config, weights.config())?;
        let recorder = open_recorder(&config)?;
        let kv_export = start_kv_export(&config, weights.config(), 0);
        Self::start(
            weights.config(),
            tokenizer,
            eos,
            &config,
            kv_export,
            move |thread| {
                EngineLoop {
                    runtime,
                    scheduler,
                    recorder,
                    queued: thread.queued,
                    step: 0,
                }
                .run(thread.commands);
            },
        )
    }

    /// Starts `body` on the engine thread, with the handle's end of the command channel; the
    /// engine's limits come from `model` and `config`.
    pub(crate) fn start(
        model: &ModelConfig,
        tokenizer: Arc<Tokenizer>,
        eos: Vec<u32>,
        config: &EngineConfig,
        (kv_export_support, kv_export): (KvExportSupport, Option<Arc<KvExport>>),
        body: impl FnOnce(EngineThread) + Send + 'static,
    ) -> Result<Self> {
        let max_model_len = model.max_position_embeddings;
        let info = EngineInfo {
            max_model_len,
            eos: eos.into(),
            limits: RequestLimits {
                vocab_size: model.vocab_size,
                max_context: max_model_len.min(config.scheduler.kv_capacity_tokens()),
                max_sequences: config.max_waiting,
                max_request_tokens: config.max_request_tokens,
                max_token_bytes: tokenizer.max_token_bytes(),
                kv_export: kv_export_support,
            },
        };
        let (tx, rx) = mpsc::sync_channel(config.max_waiting.max(1));
        let queued = Arc::new(AtomicUsize::new(0));
        let health = Arc::new(EngineHealth::new());
        let thread = {
            let engine_thread = EngineThread {
                commands: rx,
                queued: Arc::clone(&queued),
                health: Arc::clone(&health),
            };
            std::thread::Builder::new()
                .name("rackfill-engine".into())
                .spawn(move || {
                    // Cleared when the loop ends, also when it panics: health checks then fail
                    // and submissions get `Unavailable` instead of waiting on a dead thread.
                    let _alive = AliveFlag(Arc::clone(&engine_thread.health));
                    body(engine_thread);
                })
                .map_err(|e| EngineError::Config(format!("cannot start the engine thread: {e}")))?
        };
        Ok(Self {
            shared: Arc::new(Shared {
                tx,
                info,
                tokenizer,
                next_id: AtomicU64::new(1),
                queued,
                health,
                kv_export,
                thread: Mutex::new(Some(thread)),
            }),
        })
    }

    /// The served model's limits.
    pub fn info(&self) -> &EngineInfo {
        &self.shared.info
    }

    /// The tokenizer the engine detokenizes with.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.shared.tokenizer
    }

    /// Whether the engine thread is running.
    pub fn is_alive(&self) -> bool {
        self.shared.health.is_alive()
    }

    /// Whether the engine can serve, why not, and what its group reports (a rank suspected,
    /// the group about to stop, a stop asked for by another process).
    pub fn health(&self) -> &Arc<EngineHealth> {
        &self.shared.health
    }

    /// Checks the sequences of one request against the served model and the engine's limits
    /// (see [`RequestLimits`]): the only way to a [`ValidatedRequest`]. Cheap; never blocks.
    pub fn validate(
        &self,
        sequences: Vec<GenerateRequest>,
    ) -> Result<ValidatedRequest, RequestError> {
        self.shared.info.limits.validate(sequences)
    }

    /// As [`EngineHandle::validate`] for one sequence whose prompt's KV is to be handed to a
    /// decode engine when it finishes (`kv_transfer_params.do_remote_decode`): refused when
    /// this engine cannot export (not configured, or NIXL missing), naming why.
    pub fn validate_kv_export(
        &self,
        sequence: GenerateRequest,
    ) -> Result<ValidatedRequest, RequestError> {
        self.shared.info.limits.validate_kv_export(sequence)
    }

    /// Queues every sequence of `request`, or none of them: `QueueFull` when the waiting queue
    /// cannot take them all now, `Unavailable` when the engine stopped. The streams are in the
    /// order of [`ValidatedRequest::sequences`]; never blocks.
    pub fn enqueue(&self, request: ValidatedRequest) -> Result<Vec<RequestStream>> {
        if !self.is_alive() {
            return Err(EngineError::Unavailable);
        }
        let export_kv = request.exports_kv();
        let sequences = request.into_sequences();
        let needed = sequences.len();
        self.reserve_queue(needed)?;
        let arrived = Instant::now();
        let mut streams = Vec::with_capacity(needed);
        let mut parts = Vec::with_capacity(needed);
        for request in sequences {
            let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
            let (tx, rx) = events::unbounded_channel();
            streams.push(RequestStream { id, events: rx });
            parts.push(SequenceParts {
                id,
                request,
                arrived,
                fallback_seed: fallback_seed(id),
                tokenizer: Arc::clone(&self.shared.tokenizer),
                eos: Arc::clone(&self.shared.info.eos),
                events: tx,
                kv_export: export_kv.then(|| self.shared.kv_export.clone()).flatten(),
            });
        }
        match self.shared.tx.try_send(Command::Submit(parts)) {
            Ok(()) => Ok(streams),
            Err(err) => {
                self.shared.queued.fetch_sub(needed, Ordering::AcqRel);
                Err(match err {
                    TrySendError::Full(_) => self.queue_full(needed),
                    TrySendError::Disconnected(_) => EngineError::Unavailable,
                })
            }
        }
    }

    /// Validates and queues one sequence ([`EngineHandle::validate`] then
    /// [`EngineHandle::enqueue`]). Errors here mean nothing was queued.
    pub fn submit(&self, request: GenerateRequest) -> Result<RequestStream> {
        let validated = self.validate(vec![request])?;
        let mut streams = self.enqueue(validated)?;
        Ok(streams.remove(0))
    }

    /// Cancels request `id` (a no-op once it finished). Dropping its stream does the same.
    pub fn cancel(&self, id: u64) {
        let _ = self.shared.tx.try_send(Command::Cancel(id));
    }

    /// Stops accepting work, lets in-flight requests finish, and joins the engine thread.
    pub fn shutdown(&self) {
        let _ = self.shared.tx.send(Command::Shutdown);
        let thread = self.shared.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(thread) = thread {
            let _ = thread.join();
        }
    }

    /// Sequences waiting for admission.
    pub fn queued(&self) -> usize {
        self.shared.queued.load(Ordering::Acquire)
    }

    /// Counts `needed` more sequences as queued, if they fit `max_waiting` (atomically: two
    /// callers cannot both take the last places).
    fn reserve_queue(&self, needed: usize) -> Result<()> {
        let limit = self.shared.info.limits.max_sequences;
        self.shared
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |waiting| {
                (waiting + needed <= limit).then_some(waiting + needed)
            })
            .map(|_| ())
            .map_err(|_| self.queue_full(needed))
    }

    fn queue_full(&self, needed: usize) -> EngineError {
        EngineError::QueueFull {
            waiting: self.queued(),
            needed,
            limit: self.shared.info.limits.max_sequences,
        }
    }
}

/// The seed of a sequence that gave none: fixed by its id, so any process that runs it samples
/// the same tokens.
pub(crate) fn fallback_seed(id: u64) -> u64 {
    id.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// The scheduler of `ranks` ranks for `model` under `config`. The prefix cache shares host KV
/// blocks, so with the whole model on a device (`--device cuda|emulator`, whose KV lives in the
/// device's own blocks) it is off, and said so once.
pub(crate) fn new_scheduler(
    ranks: usize,
    config: &EngineConfig,
    model: &ModelConfig,
) -> Result<Scheduler> {
    let mut scheduler = config.scheduler;
    if scheduler.prefix_caching && config.device != ModelDevice::Cpu {
        tracing::info!(
            device = %config.device,
            "the prefix cache is off: it shares host KV blocks, and --device keeps the KV on \
             the device"
        );
        scheduler.prefix_caching = false;
    }
    let salt = prefix_cache::model_salt("rackfill", format!("{model:?}"));
    Scheduler::new(ranks, scheduler, salt)
}

/// Opens the routing trace `config` asks for, if any.
/// This process's KV exporter for rank `rank`, when `config` asks for one (see
/// [`kv_export::start_for_rank`]).
pub(crate) fn start_kv_export(
    config: &EngineConfig,
    model: &ModelConfig,
    rank: usize,
) -> (KvExportSupport, Option<Arc<KvExport>>) {
    let scheduler = &config.scheduler;
    kv_export::start_for_rank(
        config.kv_export.as_ref(),
        model,
        (scheduler.block_tokens, scheduler.kv_blocks_per_rank()),
        rank,
    )
}

pub(crate) fn open_recorder(config: &EngineConfig) -> Result<Option<RoutingRecorder>> {
    config
        .record_routing
        .as_ref()
        .map(|trace| {
            RoutingRecorder::create(trace).map_err(|e| {
                EngineError::Config(format!(
                    "cannot create routing trace {}: {e}",
                    trace.path.display()
                ))
            })
        })
        .transpose()
}

/// Appends step `step`'s per-layer loads to the routing trace, if one records; a recorder that
/// stops (its byte cap, a failed write) says why once and is dropped.
pub(crate) fn record_routing(
    recorder: &mut Option<RoutingRecorder>,
    step: u64,
    output: &StepOutput,
) {
    if let Some(active) = recorder {
        let loads = step_loads(output);
        let layers = loads.iter().map(|(layer, load)| (*layer, load));
        if let Err(stopped) = active.record(step, layers) {
            tracing::warn!("{stopped}");
            *recorder = None;
        }
    }
}

/// Each MoE layer's load over the whole step, in layer order: with two micro-batches a layer is
/// reported once per micro-batch, and the trace records their sum (what the step routed).
fn step_loads(output: &StepOutput) -> Vec<(usize, LoadMatrix)> {
    let mut loads: Vec<(usize, LoadMatrix)> = Vec::new();
    for report in &output.layers {
        match loads.last_mut() {
            Some((layer, load)) if *layer == report.layer => {
                if let Ok(sum) = load.sum(&report.load) {
                    *load = sum;
                }
            }
            _ => loads.push((report.layer, report.load.clone())),
        }
    }
    loads
}

/// The engine thread's state.
struct EngineLoop {
    runtime: EpRuntime,
    scheduler: Scheduler,
    recorder: Option<RoutingRecorder>,
    queued: Arc<AtomicUsize>,
    step: u64,
}

impl EngineLoop {
    fn run(mut self, rx: Receiver<Command>) {
        let mut stopping = false;
        loop {
            if self.scheduler.is_idle() {
                if stopping {
                    break;
                }
                match rx.recv() {
                    Ok(command) => stopping |= self.handle(command),
                    Err(_) => break,
                }
            }
            while let Ok(command) = rx.try_recv() {
                stopping |= self.handle(command);
            }
            let before = self.scheduler.waiting();
            let started = Instant::now();
            let stepped = self.scheduler.step(&mut self.runtime);
            let took = started.elapsed();
            // Admitted (or dropped) sequences leave the queue.
            self.queued.fetch_sub(
                before.saturating_sub(self.scheduler.waiting()),
                Ordering::AcqRel,
            );
            match stepped {
                Ok(Some(summary)) => {
                    metrics::record_step(&summary.output, summary.tokens.iter().sum(), took);
                    metrics::record_fabric(self.runtime.bytes_moved());
                    metrics::record_placement(
                        self.runtime.data_path(),
                        self.runtime.device_weight_bytes(),
                    );
                    record_routing(&mut self.recorder, self.step, &summary.output);
                    self.step += 1;
                }
                Ok(None) => {}
                Err(err) => tracing::error!(%err, "engine step failed; its sequences were failed"),
            }
            metrics::record_queue(
                self.scheduler.waiting(),
                self.scheduler.running(),
                self.scheduler.kv_usage(),
            );
            metrics::record_prefix_cache(&self.scheduler.prefix_stats());
        }
        self.queued.store(0, Ordering::Release);
        self.scheduler.fail_all("the engine stopped");
    }

    /// Applies one command; returns true on shutdown.
    fn handle(&mut self, command: Command) -> bool {
        match command {
            Command::Submit(sequences) => {
                for parts in sequences {
                    let cache = self.runtime.new_cache(self.scheduler.block_tokens());
                    self.scheduler.enqueue(Sequence::new(parts, cache));
                }
                false
            }
            Command::Cancel(id) => {
                self.scheduler.cancel(id);
                false
            }
            Command::Shutdown => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_alive_flag_clears_when_its_thread_panics() {
        let health = Arc::new(EngineHealth::new());
        let flag = AliveFlag(Arc::clone(&health));
        let thread = std::thread::spawn(move || {
            let _flag = flag;
            panic!("engine step failed");
        });
        assert!(thread.join().is_err());
        assert!(!health.is_alive());
    }
}
