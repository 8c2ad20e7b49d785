//! [`DeviceMoe`]: the data plane of one model's MoE layers on one device, for the ranks this
//! process holds, and its [`MoeLane`]s: one per micro-batch in flight, each with its own streams,
//! replica slots, ready counters, tile planner and solver over the same home experts.

use std::ops::Range;
use std::sync::Arc;

use rackfill_balancer::quota::TargetRule;
use rackfill_balancer::relay::RelayConfig;
use rackfill_balancer::{Layout, Plan};

use super::super::exec::{DeviceBuffer, Event, Executor, Stream};
use super::super::replicate::{DeviceTileStream, LandedBytes, RankBuffers};
use super::super::solver::DeviceQuotaSolver;
use super::super::tile_plan::{TileGeometry, TilePlanner};
use super::super::tiles::DEFAULT_TILE_BYTES;
use super::super::CudaError;
use super::experts::HomeExperts;
use super::peers::{PeerWindows, ReplicaLayout};
use super::remote::HostExchange;
use crate::KernelError;

/// How a [`DeviceMoe`] runs its layers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeConfig {
    /// The relay trees replicas stream over.
    pub relay: RelayConfig,
    /// Solve quota plans on the device with this `u_min` and target rule (the quota
    /// balancers); `None`: every plan comes from the host and is uploaded.
    pub device_solver: Option<(u64, TargetRule)>,
    /// Dispatch and main-expert GEMMs run while the replicas stream; each replica's GEMMs wait
    /// only for its own slot. Off: the dispatch waits for every replica (UltraEP's order).
    pub pipelined_experts: bool,
    /// Every MoE layer keeps its own slots, so a replica still resident from the layer's last
    /// plan is not streamed again; off: one set of slots shared by every layer (UltraEP §4.1).
    pub per_layer_slots: bool,
    /// Lanes: micro-batches in flight together (1 or 2).
    pub lanes: usize,
    /// Check what the device built (plans, tile streams) against the host reference (slow).
    pub verify: bool,
}

impl Default for MoeConfig {
    fn default() -> Self {
        Self {
            relay: RelayConfig::default(),
            device_solver: None,
            pipelined_experts: true,
            per_layer_slots: false,
            lanes: 1,
            verify: false,
        }
    }
}

/// What every lane of a plane shares.
pub(super) struct Shared {
    pub exec: Arc<dyn Executor>,
    pub layout: Layout,
    /// World ranks this process holds.
    pub local: Range<usize>,
    pub hidden: usize,
    pub inter: usize,
    /// Bytes of one expert (a slot's size).
    pub expert_bytes: usize,
    /// `[moe layer][expert]`: byte offset in its home rank's buffer.
    pub home_offsets: Vec<Vec<u64>>,
    pub config: MoeConfig,
}

impl Shared {
    /// Whether this process holds every rank (then replicas and rows move on the device alone).
    pub fn all_local(&self) -> bool {
        self.local.len() == self.layout.ranks()
    }

    /// Local rank index of world rank `rank`.
    pub fn index(&self, rank: usize) -> Option<usize> {
        self.local.contains(&rank).then(|| rank - self.local.start)
    }
}

/// The MoE data plane of one model on one device: the home experts of this process's ranks and
/// one [`MoeLane`] per micro-batch in flight.
pub struct DeviceMoe {
    shared: Arc<Shared>,
    lanes: Vec<MoeLane>,
}

/// One micro-batch's share of a [`DeviceMoe`]: its streams (the main one, where dispatch,
/// experts and combine queue; one for replicas; one for host downloads beside them), its slots
/// and ready counters, its tile planner and device solver.
pub struct MoeLane {
    pub(super) shared: Arc<Shared>,
    pub(super) main: Stream,
    pub(super) replicas: Stream,
    pub(super) side: Stream,
    /// The local ranks' home experts, this lane's slot sets and ready counters.
    pub(super) buffers: RankBuffers,
    /// Bytes landed per (local rank, slot) in the current replication.
    pub(super) landed: LandedBytes,
    /// The device relay planner (every rank local: streams stay on the device).
    pub(super) tiles: Option<TilePlanner>,
    pub(super) solver: Option<DeviceQuotaSolver>,
    /// With per-layer slots, `[moe layer]`: every rank's slots after the layer's last
    /// completed stream (`R x n_slot`, as [`Plan::slots`]).
    pub(super) resident: Option<Vec<Vec<Option<u32>>>>,
    /// A layer the device solver planned, its replication already queued.
    pub(super) solved: Option<SolvedOnDevice>,
    /// Every rank's receive side in peer memory, once [`DeviceMoe::connect`] mapped it: rows
    /// and outputs then cross processes device to device.
    pub(super) peers: Option<PeerWindows>,
}

/// A replication queued on a lane's replica stream.
pub(super) struct Replication {
    pub begin: Event,
    pub end: Event,
    /// How the bytes move, and what the host checks once they have.
    pub how: Streamed,
    /// `[local rank][slot]`: whether this replication writes the slot (what a replica's GEMMs
    /// wait for; a resident replica kept in place is not waited on).
    pub streamed: Vec<Vec<bool>>,
    /// Replica bytes each local rank received.
    pub recv_bytes: Vec<u64>,
}

/// How a replication moved its bytes.
pub(super) enum Streamed {
    /// Tasks built by the lane's device tile planner.
    Planner,
    /// Tasks compiled on the host and uploaded (kept alive until the stream has run).
    Uploaded(Box<DeviceTileStream>),
    /// Host buffers and the process group's transport: landed before the replication returned.
    Host,
}

/// A layer the device solver planned, its replication already queued.
pub(super) struct SolvedOnDevice {
    pub layer: usize,
    pub plan: Plan,
    pub replication: Replication,
}

impl DeviceMoe {
    /// The plane over `homes` (the local ranks' home experts, [`HomeExperts`]) for the `local`
    /// ranks of `layout`, `(hidden, inter)` the experts' dimensions.
    pub fn new(
        exec: Arc<dyn Executor>,
        layout: &Layout,
        local: Range<usize>,
        (hidden, inter): (usize, usize),
        homes: HomeExperts,
        config: MoeConfig,
    ) -> Result<Self, CudaError> {
        if !(1..=2).contains(&config.lanes) {
            return Err(KernelError::OutOfRange {
                what: "lanes (micro-batches in flight)",
                value: config.lanes as u64,
                limit: 3,
            }
            .into());
        }
        if homes.buffers.len() != local.len() || local.end > layout.ranks() {
            return Err(KernelError::RankCount {
                got: homes.buffers.len(),
                ranks: local.len(),
            }
            .into());
        }
        if homes.expert_bytes != super::expert_bytes(hidden, inter) {
            return Err(KernelError::Length {
                what: "expert bytes of the home experts",
                len: homes.expert_bytes,
                expected: super::expert_bytes(hidden, inter),
            }
            .into());
        }
        let shared = Arc::new(Shared {
            exec,
            layout: layout.clone(),
            local,
            hidden,
            inter,
            expert_bytes: homes.expert_bytes,
            home_offsets: homes.offsets,
            config,
        });
        let homes: Arc<[DeviceBuffer]> = homes.buffers.into();
        let lanes = (0..config.lanes)
            .map(|lane| MoeLane::new(&shared, Arc::clone(&homes), lane))
            .collect::<Result<_, _>>()?;
        Ok(Self { shared, lanes })
    }

    /// Bytes of one expert's bf16 weights (what a replica moves).
    pub fn expert_bytes(&self) -> usize {
        self.shared.expert_bytes
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &MoeConfig {
        &self.shared.config
    }

    /// Whether plans of the configured balancer are solved on the device.
    pub fn solves_on_device(&self) -> bool {
        self.shared.config.device_solver.is_some()
    }

    /// Every lane, one per micro-batch.
    pub fn lanes_mut(&mut self) -> &mut [MoeLane] {
        &mut self.lanes
    }

    /// Lane `lane`.
    pub fn lane(&self, lane: usize) -> Option<&MoeLane> {
        self.lanes.get(lane)
    }

    /// Maps every rank's receive side and replica slots into every process of the group through
    /// peer memory (two windows per rank and lane, handles exchanged through `exchange`; every
    /// process calls this together), so that rows, outputs and replicas cross processes device
    /// to device. Returns the mechanism (`"cuda-fabric"`, `"cuda-ipc"`, `"memfd"`); an error
    /// leaves every lane on `exchange`'s host path, in every process alike (each learns whether
    /// all others mapped every window).
    pub fn connect(&mut self, exchange: &dyn HostExchange) -> Result<&'static str, CudaError> {
        let shared = Arc::clone(&self.shared);
        let exec = shared.exec.as_ref();
        let mechanism = exec
            .peer_memory()
            .ok_or_else(|| CudaError::Exec("the executor has no peer memory".into()))?;
        let n_slot = shared.layout.slots_per_rank();
        let (_, chunks) = rackfill_balancer::relay::chunk_geometry(
            shared.expert_bytes as u64,
            shared.config.relay.chunk_bytes,
        );
        let mut connected = Vec::with_capacity(self.lanes.len());
        for lane in &self.lanes {
            let replica = ReplicaLayout {
                slots: lane.buffers.set_bytes() * lane.slot_sets(),
                flags: n_slot * chunks as usize,
                n_slot,
            };
            let peers = PeerWindows::open(
                exec,
                (shared.layout.ranks(), shared.local.clone()),
                shared.hidden,
                replica.bytes(),
                exchange,
            )?;
            let (buffers, landed) = lane.replica_buffers_in(&peers, &replica)?;
            connected.push((peers, buffers, landed));
        }
        for (lane, (peers, buffers, landed)) in self.lanes.iter_mut().zip(connected) {
            lane.peers = Some(peers);
            lane.buffers = buffers;
            lane.landed = landed;
        }
        Ok(mechanism)
    }

    /// The peer memory rows and outputs cross processes through (`None`: every rank is in this
    /// process, or they go through the host).
    pub fn peer_memory(&self) -> Option<&'static str> {
        self.lanes
            .first()
            .and_then(|lane| lane.peers.as_ref())
            .and(self.shared.exec.peer_memory())
    }
}

impl MoeLane {
    fn new(
        shared: &Arc<Shared>,
        homes: Arc<[DeviceBuffer]>,
        lane: usize,
    ) -> Result<Self, CudaError> {
        let exec = shared.exec.as_ref();
        let layout = &shared.layout;
        let config = &shared.config;
        // The first lane computes on the main stream, where the model runs, so one micro-batch
        // needs no cross-stream ordering; a second lane has a stream of its own.
        let main = if lane == 0 {
            Stream::MAIN
        } else {
            exec.new_stream()?
        };
        let (replicas, side) = (exec.new_stream()?, exec.new_stream()?);
        let expert_bytes = shared.expert_bytes as u64;
        let moe_layers = shared.home_offsets.len();
        let sets = if config.per_layer_slots {
            moe_layers.max(1)
        } else {
            1
        };
        let tiles = if shared.all_local() {
            let geometry = TileGeometry {
                expert_bytes,
                slot_bytes: expert_bytes,
                tile_bytes: DEFAULT_TILE_BYTES,
                relay: config.relay,
            };
            Some(TilePlanner::new(
                Arc::clone(&shared.exec),
                layout,
                &geometry,
                &shared.home_offsets,
            )?)
        } else {
            None
        };
        let flags = tiles.as_ref().map_or(0, TilePlanner::flag_capacity);
        let set_bytes = layout.slots_per_rank() * shared.expert_bytes;
        let buffers = RankBuffers::new(
            exec,
            homes,
            (set_bytes, sets),
            &vec![flags; shared.local.len()],
        )?;
        let solver = config
            .device_solver
            .map(|(u_min, rule)| {
                DeviceQuotaSolver::new(Arc::clone(&shared.exec), layout, u_min, rule)
            })
            .transpose()?;
        Ok(Self {
            landed: LandedBytes::new(
                exec,
                shared.local.len(),
                layout.slots_per_rank(),
                expert_bytes,
            )?,
            resident: config
                .per_layer_slots
                .then(|| vec![vec![None; layout.ranks() * layout.slots_per_rank()]; moe_layers]),
            shared: Arc::clone(shared),
            main,
            replicas,
            side,
            buffers,
            tiles,
            solver,
            solved: None,
            peers: None,
        })
    }

    /// Slot sets this lane keeps (one per MoE layer with per-layer slots).
    fn slot_sets(&self) -> usize {
        if self.shared.config.per_layer_slots {
            self.shared.home_offsets.len().max(1)
        } else {
            1
        }
    }

    /// This lane's replica buffers moved into the replica windows of `peers`: its ranks' slots,
    /// ready counters and landed bytes in their own windows, every other rank's in theirs, so
    /// the tile stream pushes replicas straight into other processes' slots.
    fn replica_buffers_in(
        &self,
        peers: &PeerWindows,
        layout: &ReplicaLayout,
    ) -> Result<(RankBuffers, LandedBytes), CudaError> {
        let exec = self.shared.exec.as_ref();
        let windows = peers.replica_windows();
        let local = self.shared.local.clone();
        let part =
            |w: &Arc<DeviceBuffer>, at: usize, bytes: usize| DeviceBuffer::view(w, at, bytes);
        let mut parts = (Vec::new(), Vec::new(), Vec::new());
        for w in &windows[local.clone()] {
            parts.0.push(part(w, 0, layout.slots)?);
            parts.1.push(part(w, layout.flags_at(), layout.flags * 4)?);
            parts
                .2
                .push(part(w, layout.landed_at(), layout.n_slot * 4)?);
        }
        let address = |at: usize| windows.iter().map(|w| w.at(at)).collect::<Vec<_>>();
        // SAFETY: every window stays mapped while `peers` lives, which the lane keeps beside the
        // buffers; every rank's window has the same layout.
        let buffers = unsafe {
            RankBuffers::over_peers(
                exec,
                self.buffers.shared_homes(),
                (parts.0, parts.1),
                (&address(0), &address(layout.flags_at())),
                (self.buffers.set_bytes(), self.slot_sets()),
                local,
            )
        }?;
        let landed = LandedBytes::over(
            exec,
            parts.2,
            &address(layout.landed_at()),
            (layout.n_slot, self.shared.expert_bytes as u64),
        )?;
        Ok((buffers, landed))
    }

    /// The stream this lane's dispatch, experts and combine run on.
    pub fn stream(&self) -> Stream {
        self.main
    }

    /// The slot set MoE layer `layer` (its index among the MoE layers) uses.
    pub(super) fn set_of(&self, layer: usize) -> usize {
        if self.shared.config.per_layer_slots {
            layer
        } else {
            0
        }
    }

    /// Every rank's slots as MoE layer `layer`'s last completed stream left them, with per-layer
    /// slots (`None` with shared slots, which keep nothing from layer to layer).
    pub fn resident(&self, layer: usize) -> Option<&[Option<u32>]> {
        self.resident.as_ref()?.get(layer).map(Vec::as_slice)
    }

    /// What world rank `rank`'s redundant slot `slot` holds in MoE layer `layer`'s set, widened
    /// to f32 (tests, debugging), after this lane's replicas.
    pub fn slot_contents(
        &self,
        layer: usize,
        rank: usize,
        slot: usize,
    ) -> Result<Vec<f32>, CudaError> {
        let out_of_range = |what, value: usize, limit: usize| KernelError::OutOfRange {
            what,
            value: value as u64,
            limit: limit as u64,
        };
        let shared = &self.shared;
        let index = shared
            .index(rank)
            .ok_or_else(|| out_of_range("local rank", rank, shared.local.end))?;
        let n_slot = shared.layout.slots_per_rank();
        if slot >= n_slot {
            return Err(out_of_range("slot", slot, n_slot).into());
        }
        let buffer = self
            .buffers
            .slots(index)
            .ok_or_else(|| out_of_range("local rank", index, shared.local.len()))?;
        let at = self.set_of(layer) * self.buffers.set_bytes() + slot * shared.expert_bytes;
        let mut bytes = vec![0u8; shared.expert_bytes];
        shared.exec.read_on(self.replicas, buffer, at, &mut bytes)?;
        Ok(bytes
            .chunks_exact(2)
            .map(|b| super::super::exec::bf16_to_f32(u16::from_le_bytes([b[0], b[1]])))
            .collect())
    }

    /// The device address `rank` (world) computes `expert`'s `instance` of MoE layer `layer`
    /// with: its home buffer for the main instance, the slot the replica streamed into
    /// otherwise; `Some(slot)` for a replica.
    pub(super) fn weights_at(
        &self,
        (layer, plan): (usize, &Plan),
        rank: usize,
        expert: u32,
        instance: u32,
    ) -> Result<(u64, Option<usize>), CudaError> {
        use crate::weights::{weight_source, WeightSource};
        let shared = &self.shared;
        let index = shared.index(rank).ok_or(KernelError::OutOfRange {
            what: "local rank",
            value: rank as u64,
            limit: shared.local.end as u64,
        })?;
        match weight_source(&shared.layout, plan, rank, expert, instance) {
            Some(WeightSource::Home { .. }) => {
                let at = shared.home_offsets[layer][expert as usize] as usize;
                let home = self.buffers.home(index).ok_or(KernelError::RankCount {
                    got: index,
                    ranks: shared.local.len(),
                })?;
                Ok((home.at(at), None))
            }
            Some(WeightSource::Slot { slot }) => {
                let slots = self.buffers.slots(index).ok_or(KernelError::RankCount {
                    got: index,
                    ranks: shared.local.len(),
                })?;
                let at = self.set_of(layer) * self.buffers.set_bytes() + slot * shared.expert_bytes;
                Ok((slots.at(at), Some(slot)))
            }
            None => Err(KernelError::OutOfRange {
                what: "expert instance on this rank",
                value: u64::from(instance),
                limit: plan.instances(expert as usize).len() as u64,
            }
            .into()),
        }
    }
}
