//! What the processes of an EP group tell each other between steps, and how: the leader's
//! control message (broadcast), every worker's report (point-to-point to the leader), and the
//! one-flag reductions. Messages are bincode (exact for floats, compact for token ids).

use std::time::Duration;

use mpi::collective::SystemOperation;
use mpi::point_to_point::{Destination, Source};
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::{CommunicatorCollectives, Root};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};
use crate::kv_export::ExportStats;
use crate::prefix_cache::{IndexChange, PrefixCacheStats};
use crate::request::{Event, GenerateRequest};

/// The leader's rank.
pub const LEADER: usize = 0;

/// A sequence the leader hands to a rank.
#[derive(Debug, Serialize, Deserialize)]
pub struct HandOff {
    pub rank: usize,
    /// The id the leader gave it (its sampling seed derives from it, as in one process).
    pub id: u64,
    pub request: GenerateRequest,
    /// How long it has waited since it was submitted (its queue time continues on the rank).
    pub waited: Duration,
    /// Whether the rank exports the prompt's KV when the sequence finishes.
    pub export_kv: bool,
}

/// What every process applies at the start of a round, sent by the leader.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Control {
    pub handoffs: Vec<HandOff>,
    /// `(rank, sequence id)`: sequences whose client went away.
    pub cancels: Vec<(usize, u64)>,
    /// Every process leaves its loop (sent only when no rank has work left).
    pub stop: bool,
}

/// A rank's gauges, as the leader exports them labelled by rank.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct RankGauges {
    pub waiting: usize,
    pub running: usize,
    /// KV reserved by running sequences over the rank's budget.
    pub kv_usage: f64,
    /// Tokens reserved, waiting sequences included (what new sequences are balanced by).
    pub reserved_tokens: usize,
    /// Bytes the rank received over the fabric since start.
    pub fabric_bytes: u64,
    /// The rank's prefix-cache counters and KV block states.
    pub prefix: PrefixCacheStats,
    /// The rank's KV export arena.
    pub kv_export: ExportStats,
}

/// What a worker tells the leader at the end of a round.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Report {
    /// Events of the rank's sequences since the last report, per sequence id, in order.
    pub events: Vec<(u64, Vec<Event>)>,
    pub gauges: RankGauges,
    /// Sequences that left the rank's waiting queue this round (admitted or dropped).
    pub left_waiting: usize,
    /// Tokens the rank computed this round.
    pub tokens: usize,
    /// How the rank's prefix-cache index changed this round (the leader routes by it).
    pub index_changes: Vec<IndexChange>,
    /// Why the rank's step failed, if it did (the group stops after this round).
    pub failed: Option<String>,
}

/// The control plane's own communicator (see [`crate::group::MpiWorld::communicator`]).
pub struct ControlPlane {
    comm: SimpleCommunicator,
    rank: usize,
    size: usize,
}

// SAFETY: MPI runs at MPI_THREAD_MULTIPLE and only the engine thread uses this communicator.
unsafe impl Send for ControlPlane {}

/// Tag of report messages.
const REPORT: i32 = 1;

/// How long a pending control broadcast is tested back to back before sleeps between tests,
/// then the first and the longest sleep.
const SPIN: Duration = Duration::from_micros(500);
const MIN_BACKOFF: Duration = Duration::from_micros(50);
const MAX_BACKOFF: Duration = Duration::from_millis(1);

impl ControlPlane {
    pub fn new(comm: SimpleCommunicator) -> Self {
        let rank = usize::try_from(comm.rank()).unwrap_or_default();
        let size = usize::try_from(comm.size()).unwrap_or(1);
        Self { comm, rank, size }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// The leader's `control` reaches every process (`None` on workers).
    pub fn broadcast(&self, control: Option<&Control>) -> Result<Control> {
        let root = self.comm.process_at_rank(LEADER as i32);
        let mut bytes = match control {
            Some(control) => encode(control)?,
            None => Vec::new(),
        };
        let mut len = bytes.len() as u64;
        // Where an idle worker waits for the leader's next round (up to half a second): MPI's
        // blocking broadcast spins on its progress engine, which kept an idle group of four at
        // both of a machine's cores; a non-blocking one tested with a back-off costs nothing
        // idle and at most `MAX_BACKOFF` of latency once the leader sends.
        mpi::request::scope(|scope| {
            let mut request = root.immediate_broadcast_into(scope, &mut len);
            let started = std::time::Instant::now();
            let mut backoff = MIN_BACKOFF;
            loop {
                match request.test() {
                    Ok(_) => break,
                    Err(pending) => request = pending,
                }
                // A busy group's next round comes within `SPIN`: no sleep adds to its latency.
                if started.elapsed() > SPIN {
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        });
        bytes.resize(len as usize, 0);
        root.broadcast_into(&mut bytes[..]);
        decode(&bytes, "control message")
    }

    /// True on every process when `mine` is true on any.
    pub fn any(&self, mine: bool) -> bool {
        let mut any = 0u32;
        self.comm
            .all_reduce_into(&u32::from(mine), &mut any, SystemOperation::max());
        any != 0
    }

    /// Every process's `values` (the same length everywhere), in rank order.
    pub fn all_gather(&self, values: &[u64]) -> Vec<Vec<u64>> {
        let mut all = vec![0u64; values.len() * self.size];
        self.comm.all_gather_into(values, &mut all[..]);
        all.chunks(values.len().max(1))
            .map(<[u64]>::to_vec)
            .collect()
    }

    /// A worker's report to the leader.
    pub fn send_report(&self, report: &Report) -> Result<()> {
        let bytes = encode(report)?;
        self.comm
            .process_at_rank(LEADER as i32)
            .send_with_tag(&bytes[..], REPORT);
        Ok(())
    }

    /// The leader receives `rank`'s report of this round.
    pub fn receive_report(&self, rank: usize) -> Result<Report> {
        let (bytes, _) = self
            .comm
            .process_at_rank(rank as i32)
            .receive_vec_with_tag::<u8>(REPORT);
        decode(&bytes, "report")
    }
}

fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>> {
    bincode::serialize(value)
        .map_err(|e| EngineError::Fabric(format!("cannot encode a control-plane message: {e}")))
}

fn decode<T: DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T> {
    bincode::deserialize(bytes).map_err(|e| {
        EngineError::Fabric(format!("a malformed {what} ({} bytes): {e}", bytes.len()))
    })
}
