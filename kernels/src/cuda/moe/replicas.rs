//! One layer's replica distribution on a lane, queued on the lane's replica stream:
//!
//! - every rank here, shared slots: the relay trees and tile tasks built on the device from the
//!   plan where it is (the solver's, or an uploaded one), streamed by the persistent kernel;
//! - every rank here, per-layer slots: replicas still resident from the layer's last plan move
//!   to their new slot numbers on their rank, and only the new ones stream (or the whole plan
//!   over its relay trees, when that loads the busiest rank less:
//!   [`rackfill_balancer::reuse::replica_stream`]), compiled to tile tasks on the host;
//! - ranks in other processes: the replicated experts homed here are downloaded, the process
//!   group's transport ([`HostExchange`]) moves them, and what lands on a local rank is uploaded
//!   into its slot.
//!
//! Every streamed tile is counted per slot ([`LandedBytes`]), so a replica's GEMMs can wait for
//! their own slot alone.

use std::collections::BTreeMap;

use rackfill_balancer::relay::{plan_transfers, TransferSchedule};
use rackfill_balancer::reuse::{replica_stream, ReplicaStream};
use rackfill_balancer::Plan;

use super::super::exec::DeviceBuffer;
use super::super::replicate::DeviceTileStream;
use super::super::tiles::{self, BufferLayout, DEFAULT_TILE_BYTES};
use super::super::{CudaError, DevicePlan};
use super::peers::Signal;
use super::plane::{MoeLane, Replication, Streamed};
use super::remote::HostExchange;

/// Threads per block of the persistent tile stream.
const STREAM_THREADS: u32 = 512;

impl Replication {
    /// Marks every slot `plan` fills on the local ranks as streamed (a stream of the whole plan
    /// built on the device, which the host learns only afterwards).
    pub(super) fn fills(&mut self, lane: &MoeLane, plan: &Plan) {
        let expert_bytes = lane.shared.expert_bytes as u64;
        self.streamed = lane.filled_slots(plan);
        self.recv_bytes = replica_bytes(&self.streamed, expert_bytes);
    }
}

/// Per local rank: replica bytes of the slots marked streamed.
fn replica_bytes(streamed: &[Vec<bool>], expert_bytes: u64) -> Vec<u64> {
    streamed
        .iter()
        .map(|slots| slots.iter().filter(|&&s| s).count() as u64 * expert_bytes)
        .collect()
}

impl MoeLane {
    /// Whether replicas are planned and streamed on the device alone (every rank here, one
    /// shared slot set).
    pub(super) fn replicates_on_device(&self) -> bool {
        self.tiles.is_some() && self.resident.is_none()
    }

    /// Queues MoE layer `layer`'s replicas of the plan in device memory (`device_plan`, with
    /// the solver's status words as `guard` when it solved it) on the replica stream: relay
    /// trees and tile tasks built on the device, then streamed, behind everything the lane's
    /// main stream queued so far (the last layer's GEMMs reading the slots). What it streams is
    /// marked by [`Replication::fills`] once the host knows the plan.
    pub(super) fn replicate_on_device(
        &self,
        layer: usize,
        device_plan: &DevicePlan,
        guard: Option<&DeviceBuffer>,
    ) -> Result<Replication, CudaError> {
        let exec = self.shared.exec.as_ref();
        let tiles = self
            .tiles
            .as_ref()
            .ok_or(crate::KernelError::ZeroDimension {
                what: "device tile planner",
            })?;
        let stream = self.replicas;
        exec.wait_for(stream, &exec.record(self.main)?)?;
        let begin = exec.record(stream)?;
        self.landed.reset(exec, stream)?;
        tiles.clear_stall(stream)?;
        tiles.plan(stream, device_plan, guard, layer)?;
        tiles.stream(
            stream,
            (&self.buffers, self.set_of(layer)),
            (exec.multiprocessors() * 2, STREAM_THREADS),
            Some(&self.landed),
        )?;
        Ok(Replication {
            end: exec.record(stream)?,
            begin,
            how: Streamed::Planner,
            streamed: Vec::new(),
            recv_bytes: Vec::new(),
        })
    }

    /// Queues MoE layer `layer`'s replicas of `plan` (uploaded as `device_plan`) on the replica
    /// stream: on the device alone when [`Self::replicates_on_device`], else compiled on the
    /// host (per-layer slots: only what is not resident) or through `remote` (ranks of other
    /// processes).
    pub(super) fn replicate(
        &mut self,
        layer: usize,
        (plan, device_plan): (&Plan, &DevicePlan),
        remote: Option<&dyn HostExchange>,
        epoch: Option<u32>,
    ) -> Result<Replication, CudaError> {
        if self.replicates_on_device() && remote.is_none() {
            let mut replication = self.replicate_on_device(layer, device_plan, None)?;
            replication.fills(self, plan);
            return Ok(replication);
        }
        let exec = self.shared.exec.clone();
        let stream = self.replicas;
        exec.wait_for(stream, &exec.record(self.main)?)?;
        let begin = exec.record(stream)?;
        self.landed.reset(exec.as_ref(), stream)?;
        let set = self.set_of(layer);
        let previous = self.resident.as_mut().map(|resident| {
            // Until the stream is checked, the set counts as holding nothing: a stream that fails
            // half-way leaves no stale record.
            std::mem::replace(&mut resident[layer], vec![None; plan.slots().len()])
        });
        let expert_bytes = self.shared.expert_bytes as u64;
        let relay = self.shared.config.relay;
        let ReplicaStream {
            plan: stream_plan,
            schedule,
        } = match &previous {
            Some(previous) => replica_stream(plan, Some(previous), expert_bytes, &relay),
            None => ReplicaStream {
                plan: plan.clone(),
                schedule: plan_transfers(plan, expert_bytes, &relay),
            },
        };
        if let Some(previous) = &previous {
            self.keep_resident(set, plan, previous)?;
        }
        let streamed = self.destinations(plan, &schedule);
        let how = match (remote, epoch) {
            (None, _) => self.stream_uploaded(layer, &stream_plan, &schedule)?,
            (Some(_), Some(epoch)) => {
                self.stream_to_peers(layer, (&stream_plan, &schedule), &streamed, epoch)?
            }
            (Some(remote), None) => {
                self.stream_through_host((layer, set), (&stream_plan, &schedule), remote)?
            }
        };
        Ok(Replication {
            end: exec.record(stream)?,
            begin,
            how,
            recv_bytes: replica_bytes(&streamed, expert_bytes),
            streamed,
        })
    }

    /// Waits for a replication on the host and checks it: an error if the device planner
    /// failed or a relay stalled; with verification, the device-built tile stream must equal
    /// the host compiler's. With per-layer slots, records what the layer's set now holds.
    pub(super) fn finish_replication(
        &mut self,
        layer: usize,
        plan: &Plan,
        replication: &Replication,
    ) -> Result<(), CudaError> {
        let exec = self.shared.exec.as_ref();
        match &replication.how {
            Streamed::Planner => {
                let tiles = self.tiles.as_ref().ok_or(CudaError::TileStreamStalled)?;
                tiles.finish(self.replicas)?;
                if self.shared.config.verify {
                    let schedule = plan_transfers(
                        plan,
                        self.shared.expert_bytes as u64,
                        &self.shared.config.relay,
                    );
                    let buffers = BufferLayout {
                        expert_bytes: self.shared.expert_bytes as u64,
                        home_offsets: &self.shared.home_offsets[layer],
                        slot_bytes: self.shared.expert_bytes as u64,
                    };
                    let want =
                        tiles::compile(plan, &schedule, &buffers, tiles.params().tile_bytes)?;
                    if tiles.download(self.replicas)? != want {
                        return Err(CudaError::TileMismatch { layer });
                    }
                }
            }
            Streamed::Uploaded(stream) => stream.finish(exec, self.replicas)?,
            Streamed::Host => {}
        }
        if let Some(peers) = &self.peers {
            // A wait for a peer's slots that gave up.
            peers.check(exec, self.replicas)?;
        }
        if let Some(resident) = self.resident.as_mut() {
            resident[layer] = plan.slots().to_vec();
        }
        Ok(())
    }

    /// `[local rank][slot]`: the slots `plan` fills on the local ranks.
    fn filled_slots(&self, plan: &Plan) -> Vec<Vec<bool>> {
        self.shared
            .local
            .clone()
            .map(|rank| plan.rank_slots(rank).iter().map(Option::is_some).collect())
            .collect()
    }

    /// `[local rank][slot]`: the slots `schedule` writes on the local ranks (their slot numbers
    /// in `plan`).
    fn destinations(&self, plan: &Plan, schedule: &TransferSchedule) -> Vec<Vec<bool>> {
        let n_slot = plan.slots_per_rank();
        let mut out = vec![vec![false; n_slot]; self.shared.local.len()];
        for t in &schedule.transfers {
            let Some(index) = self.shared.index(t.dst as usize) else {
                continue;
            };
            if let Some(slot) = plan
                .rank_slots(t.dst as usize)
                .iter()
                .position(|&s| s == Some(t.expert))
            {
                out[index][slot] = true;
            }
        }
        out
    }

    /// Before a stream into slot set `set`: every replica the set holds on a local rank
    /// (`previous`, the layer's last plan's slots) is copied to the slot `plan` gives it on that
    /// rank, since slots are numbered per plan. Nothing moves between ranks.
    fn keep_resident(
        &self,
        set: usize,
        plan: &Plan,
        previous: &[Option<u32>],
    ) -> Result<(), CudaError> {
        let exec = self.shared.exec.as_ref();
        let (n_slot, bytes) = (plan.slots_per_rank(), self.shared.expert_bytes);
        let set_bytes = self.buffers.set_bytes();
        for (index, rank) in self.shared.local.clone().enumerate() {
            let before = &previous[rank * n_slot..(rank + 1) * n_slot];
            let after = plan.rank_slots(rank);
            let moves: Vec<(usize, usize)> = after
                .iter()
                .enumerate()
                .filter_map(|(slot, expert)| {
                    let from = before.iter().position(|&b| b.is_some() && b == *expert)?;
                    (from != slot).then_some((from, slot))
                })
                .collect();
            if moves.is_empty() {
                continue;
            }
            let Some(slots) = self.buffers.slots(index) else {
                continue;
            };
            let base = set * set_bytes;
            let old = exec.alloc_zeroed_on(self.replicas, set_bytes)?;
            exec.copy_on(self.replicas, (slots, base), (&old, 0), set_bytes)?;
            for (from, to) in moves {
                exec.copy_on(
                    self.replicas,
                    (&old, from * bytes),
                    (slots, base + to * bytes),
                    bytes,
                )?;
            }
        }
        Ok(())
    }

    /// Compiles `schedule` for `stream_plan` on the host and queues it on the replica stream
    /// (every rank here).
    fn stream_uploaded(
        &self,
        layer: usize,
        stream_plan: &Plan,
        schedule: &TransferSchedule,
    ) -> Result<Streamed, CudaError> {
        let exec = self.shared.exec.as_ref();
        let expert_bytes = self.shared.expert_bytes as u64;
        let buffers = BufferLayout {
            expert_bytes,
            home_offsets: &self.shared.home_offsets[layer],
            slot_bytes: expert_bytes,
        };
        let compiled = tiles::compile(stream_plan, schedule, &buffers, DEFAULT_TILE_BYTES)?;
        let uploaded =
            DeviceTileStream::upload(exec, self.replicas, &compiled, self.shared.layout.ranks())?;
        if !uploaded.is_empty() {
            uploaded.launch(
                exec,
                self.replicas,
                (&self.buffers, self.set_of(layer)),
                (exec.multiprocessors() * 2, STREAM_THREADS),
                Some(&self.landed),
            )?;
        }
        Ok(Streamed::Uploaded(Box::new(uploaded)))
    }

    /// Streams `schedule`'s bytes of MoE layer `layer` across processes through peer memory:
    /// every process compiles the same tile stream and runs the tasks its own ranks send, pushing
    /// tiles straight into other processes' slots and bumping their counters there. Each rank
    /// zeroes its counters and raises its armed signal (its slots free: the replica stream
    /// waited for the lane's earlier work) before any rank pushes; the replication ends once
    /// every slot streamed into this process's ranks has landed.
    fn stream_to_peers(
        &self,
        layer: usize,
        (stream_plan, schedule): (&Plan, &TransferSchedule),
        streamed: &[Vec<bool>],
        epoch: u32,
    ) -> Result<Streamed, CudaError> {
        let shared = &self.shared;
        let exec = shared.exec.as_ref();
        let stream = self.replicas;
        let peers = self
            .peers
            .as_ref()
            .ok_or(crate::KernelError::ZeroDimension {
                what: "peer windows",
            })?;
        let expert_bytes = shared.expert_bytes as u64;
        let buffers = BufferLayout {
            expert_bytes,
            home_offsets: &shared.home_offsets[layer],
            slot_bytes: expert_bytes,
        };
        let compiled = tiles::compile(stream_plan, schedule, &buffers, DEFAULT_TILE_BYTES)?;
        let uploaded = DeviceTileStream::upload(exec, stream, &compiled, shared.layout.ranks())?;
        self.buffers.reset_flags(exec, stream)?;
        for rank in shared.local.clone() {
            peers.signal(exec, stream, (Signal::Armed, rank), epoch)?;
        }
        for rank in shared.local.clone() {
            peers.wait(exec, stream, (Signal::Armed, rank), epoch)?;
        }
        if !uploaded.is_empty() {
            uploaded.launch_armed(
                exec,
                stream,
                (&self.buffers, self.set_of(layer)),
                (exec.multiprocessors() * 2, STREAM_THREADS),
                Some(&self.landed),
            )?;
        }
        for (index, slots) in streamed.iter().enumerate() {
            for (slot, _) in slots.iter().enumerate().filter(|(_, &s)| s) {
                self.landed.wait(
                    exec,
                    stream,
                    (index, slot),
                    expert_bytes,
                    uploaded.counter(),
                )?;
            }
        }
        Ok(Streamed::Uploaded(Box::new(uploaded)))
    }

    /// Moves `schedule`'s bytes of MoE layer `layer` through host buffers and `remote`, then
    /// uploads what landed on the local ranks into slot set `set`.
    fn stream_through_host(
        &self,
        (layer, set): (usize, usize),
        (stream_plan, schedule): (&Plan, &TransferSchedule),
        remote: &dyn HostExchange,
    ) -> Result<Streamed, CudaError> {
        if schedule.transfers.is_empty() {
            // The same on every process: the plan and what was resident agree everywhere.
            return Ok(Streamed::Host);
        }
        let exec = self.shared.exec.as_ref();
        let bytes = self.shared.expert_bytes;
        let layer_offsets = &self.shared.home_offsets[layer];
        // Every replicated expert homed here, from its home buffer.
        let mut homes = BTreeMap::new();
        for (expert, &offset) in layer_offsets.iter().enumerate() {
            let instances = stream_plan.instances(expert);
            let main = instances[0].rank as usize;
            let (true, Some(index)) = (instances.len() > 1, self.shared.index(main)) else {
                continue;
            };
            let home = self
                .buffers
                .home(index)
                .ok_or(crate::KernelError::RankCount {
                    got: index,
                    ranks: self.shared.local.len(),
                })?;
            let mut weights = vec![0u8; bytes];
            exec.read_on(self.replicas, home, offset as usize, &mut weights)?;
            homes.insert(expert as u32, weights);
        }
        let set_bytes = self.buffers.set_bytes();
        let mut images = vec![vec![0u8; set_bytes]; self.shared.local.len()];
        remote
            .stream_replicas(
                stream_plan,
                schedule,
                &homes,
                images.iter_mut().map(Vec::as_mut_slice).collect(),
                bytes,
            )
            .map_err(CudaError::Exec)?;
        for (index, slots) in self.destinations(stream_plan, schedule).iter().enumerate() {
            let buffer = self
                .buffers
                .slots(index)
                .ok_or(crate::KernelError::RankCount {
                    got: index,
                    ranks: self.shared.local.len(),
                })?;
            for (slot, _) in slots.iter().enumerate().filter(|(_, &s)| s) {
                let range = slot * bytes..(slot + 1) * bytes;
                exec.write_on(
                    self.replicas,
                    buffer,
                    set * set_bytes + range.start,
                    &images[index][range],
                )?;
            }
        }
        Ok(Streamed::Host)
    }
}
