//! One process per EP rank (feature `mpi`): a process launched by `mpirun` or `srun --mpi=pmix`
//! into a world of `N` processes is EP rank `world rank` of an EP group of size `N`. Every
//! process runs data-parallel attention for its own sequences and its own KV budget; all run each
//! step's MoE layers together over a fabric between processes ([`crate::fabric`]): the same
//! [`EpRuntime`] and [`Scheduler`] as one process, only the fabric differs.
//!
//! Rank 0 is the leader: it alone serves HTTP, hands each new sequence to the least-loaded rank,
//! and forwards the events other ranks report back to the requests' streams ([`lockstep`]). The
//! other ranks are workers ([`run_worker`]). Every process watches the group ([`watchdog`]): a
//! rank that dies or stops stepping ends every process with a non-zero status and a message
//! naming it.
//!
//! At start the processes check that they agree on the model, the balancer, the layout and the
//! scheduler, so a mislaunched group fails at once with one line instead of computing garbage.

mod heartbeat;
mod lockstep;
mod progress;
mod watchdog;
mod watched;
mod wire;
mod world;

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;

use rackfill_models::Tokenizer;

pub use progress::request_drain;
pub use watchdog::GroupConfig;
pub use world::MpiWorld;

use crate::engine::{new_scheduler, open_recorder, start_kv_export, EngineConfig, EngineHandle};
use crate::ep::EpRuntime;
use crate::error::{EngineError, Result};
use crate::fabric::{self, Fabric, FabricKind};
use crate::health::EngineHealth;
use crate::kv_export::{KvExport, KvExportSupport};
use crate::model_weights::ModelWeights;
use lockstep::{Leader, Lockstep, Stepper};
use progress::Progress;
use watched::Watched;
use wire::{ControlPlane, LEADER};

/// What a process of the group serves: the same on every process (checked at start).
pub struct GroupModel {
    pub model: ModelWeights,
    pub tokenizer: Arc<Tokenizer>,
    pub eos: Vec<u32>,
    pub config: EngineConfig,
    pub group: GroupConfig,
    /// Which fabric carries the MoE layers' data between processes.
    pub fabric: FabricKind,
}

/// Joins the group as its leader (world rank 0) and starts the engine thread that steps it; the
/// returned handle is what the HTTP server talks to, as with one process.
pub fn start_leader(world: &MpiWorld, served: GroupModel) -> Result<EngineHandle> {
    // Replaced by the engine thread's own health once it starts.
    let joined = join(world, &served, Arc::default())?;
    let recorder = open_recorder(&served.config)?;
    let (tokenizer, eos) = (Arc::clone(&served.tokenizer), served.eos.clone());
    let kv_export = (
        joined.kv_export_support.clone(),
        joined.stepper.kv_export.clone(),
    );
    EngineHandle::start(
        served.model.config(),
        tokenizer,
        eos,
        &served.config,
        kv_export,
        move |thread| {
            // Moved whole (not field by field): `Joined` is what is Send.
            let joined = joined;
            let Joined {
                mut stepper,
                heart,
                pids,
                ..
            } = joined;
            // The server watches the handle's health: the group reports through it.
            stepper.health = thread.health;
            let leader = Leader::new(
                thread.commands,
                thread.queued,
                recorder,
                stepper.control.size(),
            );
            let progress = Arc::clone(&stepper.progress);
            let health = Arc::clone(&stepper.health);
            let watchdog = match watchdog::spawn(heart, progress, health, pids, served.group) {
                Ok(watchdog) => watchdog,
                Err(err) => {
                    tracing::error!("rackfill: cannot start the watchdog thread: {err}");
                    std::process::exit(3)
                }
            };
            Lockstep::new(
                stepper,
                served.tokenizer,
                served.eos,
                Some(leader),
                watchdog,
            )
            .run();
        },
    )
}

/// Joins the group as a worker (world rank > 0) and steps with it until the leader stops it.
pub fn run_worker(world: &MpiWorld, served: GroupModel) -> Result<()> {
    let health = Arc::new(EngineHealth::new());
    let Joined {
        stepper,
        heart,
        pids,
        ..
    } = join(world, &served, Arc::clone(&health))?;
    let progress = Arc::clone(&stepper.progress);
    let watchdog = watchdog::spawn(heart, progress, health, pids, served.group)
        .map_err(|e| EngineError::Config(format!("cannot start the watchdog thread: {e}")))?;
    Lockstep::new(stepper, served.tokenizer, served.eos, None, watchdog).run();
    Ok(())
}

/// A process's part of the group, ready to step, the communicator of its heartbeats, and the
/// ranks' processes as the leader can see them (see [`peer_processes`]).
struct Joined {
    stepper: Stepper,
    heart: mpi::topology::SimpleCommunicator,
    pids: Vec<Option<u32>>,
    /// Whether every rank can export KV (what the leader validates requests against).
    kv_export_support: KvExportSupport,
}

// SAFETY: MPI runs at MPI_THREAD_MULTIPLE (checked when the world is joined), and `heart` moves
// to the one thread that uses it (the watchdog).
unsafe impl Send for Joined {}

/// The steps every process takes, in the same order (communicator duplication and the
/// agreement check are collective).
fn join(world: &MpiWorld, served: &GroupModel, health: Arc<EngineHealth>) -> Result<Joined> {
    let ep = served.config.ep;
    if ep.ep_size != world.size() {
        return Err(EngineError::Config(format!(
            "EP size {} in a world of {} processes: one process per rank",
            ep.ep_size,
            world.size()
        )));
    }
    let control = ControlPlane::new(world.communicator());
    let heart = world.communicator();
    let fabric_comm = world.communicator();
    let device = world.local_rank();
    let mut kind = fabric::resolve_for_process(served.fabric, device);
    // `--fabric auto` is the group's choice: NCCL only where every process can run it (one GPU
    // each: processes sharing a GPU, which NCCL refuses, take MPI together). Collective on every
    // process whatever its flag, so that a launch whose flags differ still reaches the check.
    let without_nccl = control.any(!matches!(kind, Ok(FabricKind::Nccl)));
    if served.fabric == FabricKind::Auto && without_nccl {
        kind = Ok(FabricKind::Mpi);
    }
    // Agree before failing: a process that cannot run the fabric must not leave the others
    // waiting in the next collective.
    let resolved = kind.as_ref().map_or(u64::MAX, |k| hash(&k.to_string()));
    agree(&control, &fingerprints(served, resolved))?;
    let pids = peer_processes(&control);
    let progress = Arc::new(Progress::new());
    let fabric: Box<dyn Fabric> = Box::new(Watched::new(
        fabric::open(kind?, fabric_comm, device)?,
        Arc::clone(&progress),
    ));
    let runtime = EpRuntime::open(
        &served.model,
        ep,
        fabric,
        (served.config.device, Some(device)),
        served.config.scheduler.kv_tokens_per_rank,
    )?;
    let scheduler = new_scheduler(
        runtime.local_ranks().len(),
        &served.config,
        served.model.config(),
    )?;
    let (kv_export_support, kv_export) = start_group_kv_export(&control, served);
    Ok(Joined {
        stepper: Stepper {
            runtime,
            scheduler,
            control,
            progress,
            health,
            kv_export,
        },
        heart,
        pids,
        kv_export_support,
    })
}

/// Starts every process's KV exporter (collective): export is ready only where every rank's
/// started, so a request is never handed to a rank that cannot export it.
fn start_group_kv_export(
    control: &ControlPlane,
    served: &GroupModel,
) -> (KvExportSupport, Option<Arc<KvExport>>) {
    let config = served.config.kv_export.as_ref();
    let rank = control.rank();
    let (support, export) = start_kv_export(&served.config, served.model.config(), rank);
    let ready = u64::from(support == KvExportSupport::Ready);
    let without: Vec<usize> = control
        .all_gather(&[ready])
        .iter()
        .enumerate()
        .filter(|(_, row)| row[0] == 0)
        .map(|(rank, _)| rank)
        .collect();
    if config.is_none() || without.is_empty() {
        return (support, export);
    }
    let reason = match support {
        KvExportSupport::Unavailable(why) => why,
        _ => format!("rank(s) {without:?} could not start it (their logs say why)"),
    };
    (KvExportSupport::Unavailable(reason), export)
}

/// Every rank's process id where the leader can read its state: ranks in the leader's PID
/// namespace on the leader's host (same boot id), the leader's own excluded. Collective.
fn peer_processes(control: &ControlPlane) -> Vec<Option<u32>> {
    let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
    let namespace = std::fs::read_link("/proc/self/ns/pid")
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    let place = hash(&(read("/proc/sys/kernel/random/boot_id"), namespace));
    let all = control.all_gather(&[u64::from(std::process::id()), place]);
    all.iter()
        .enumerate()
        .map(|(rank, row)| (rank != LEADER && row[1] == all[LEADER][1]).then_some(row[0] as u32))
        .collect()
}

/// What the processes of a group must agree on, each as a name and a hash.
fn fingerprints(served: &GroupModel, fabric: u64) -> Vec<(&'static str, u64)> {
    let config = &served.config;
    let ep = &config.ep;
    vec![
        (
            "the model (config.json and vocabulary size)",
            hash(&(
                format!("{:?}", served.model.config()),
                served.tokenizer.vocab_size(),
            )),
        ),
        (
            "the balancer (--balancer and its settings)",
            hash(&format!(
                "{:?} {:?} {:?}",
                ep.balancer, ep.settings, ep.relay
            )),
        ),
        (
            "the layout and schedule (--redundant-slots, --schedule, --slot-memory, --device)",
            hash(&format!(
                "{} {:?} {:?} {}",
                ep.redundant_slots, ep.schedule, ep.slot_memory, config.device
            )),
        ),
        ("the fabric it can run (--fabric)", fabric),
        (
            "the scheduler (--chunk-tokens, --kv-tokens-per-rank, request limits)",
            hash(&format!(
                "{:?} {} {}",
                config.scheduler, config.max_waiting, config.max_request_tokens
            )),
        ),
        ("the rackfill version", hash(&env!("CARGO_PKG_VERSION"))),
    ]
}

fn hash(value: &impl Hash) -> u64 {
    let mut hasher = DefaultHasher::new();
    value.hash(&mut hasher);
    hasher.finish()
}

/// Fails on every process, naming the first rank and the first thing that differs from the
/// leader's, unless every process has the same fingerprints.
fn agree(control: &ControlPlane, mine: &[(&'static str, u64)]) -> Result<()> {
    let values: Vec<u64> = mine.iter().map(|(_, v)| *v).collect();
    let all = control.all_gather(&values);
    for (rank, theirs) in all.iter().enumerate().skip(1) {
        if let Some(i) = (0..values.len()).find(|&i| theirs[i] != all[0][i]) {
            return Err(EngineError::Config(format!(
                "rank {rank} disagrees with rank 0 on {}: every process of the group must be \
                 started with the same model and flags",
                mine[i].0
            )));
        }
    }
    Ok(())
}
