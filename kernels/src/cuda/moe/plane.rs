//! [`GpuMoe`]: the plane's buffers, streams, solver and tile planner, how it is built (and a
//! second lane beside it), the device solve and the replication the layer stages start.

use crate::cuda::gemm::GroupedGemm;
use crate::cuda::home_weights::{pack_home_weights, HomeWeights};
use crate::cuda::replicate::{LandedBytes, RankBuffers};
use crate::cuda::solver::GpuQuotaSolver;
use crate::cuda::tile_plan::{TileGeometry, TilePlanner};
use crate::cuda::tiles::{self, BufferLayout, DEFAULT_TILE_BYTES};
use crate::cuda::{CudaError, DevicePlan, Gpu};
use crate::KernelError;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, CudaView};
use rackfill_balancer::quota::TargetRule;
use rackfill_balancer::relay::{plan_transfers, RelayConfig};
use rackfill_balancer::{Layout, LoadMatrix, Plan};
use std::sync::Arc;
use std::time::Duration;

pub use crate::cuda::home_weights::ExpertWeights;

/// One source rank's routed batch, in host memory.
#[derive(Debug, Clone, Copy)]
pub struct RankInput<'a> {
    /// `tokens x hidden` FFN inputs.
    pub x: &'a [f32],
    /// `tokens * top_k` routed experts (pair `p = token * top_k + k`).
    pub experts: &'a [u32],
    /// The router weights of those pairs.
    pub weights: &'a [f32],
}

/// Time of each part of [`GpuMoe::run_layer`]: the replication's device time (relay planning
/// and streaming, between two events), then wall time with the stream synchronised after each.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GpuPhases {
    pub replicate: Duration,
    pub dispatch: Duration,
    pub experts: Duration,
    pub combine: Duration,
}

/// What one layer produced.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerRun {
    /// Per rank: `tokens x hidden` routed-expert output (no shared experts), empty without tokens.
    pub outputs: Vec<Vec<f32>>,
    /// Per rank: bytes received from other ranks in dispatch (rows and their ids) and combine.
    pub token_recv_bytes: Vec<u64>,
    /// Per rank: replica weight bytes received.
    pub replica_recv_bytes: Vec<u64>,
    pub phases: GpuPhases,
}

/// The GPU data plane of one model: every MoE layer's experts resident, slots, solver, cuBLAS.
///
/// Two streams: the replicas are planned and streamed on their own (`replicas`), everything
/// else on the device's main stream, each ordered against the other by events. With pipelined
/// experts (the default) a layer's dispatch and main-expert GEMMs run while its replicas stream,
/// and only the replica instances' GEMMs wait for the stream's end; without, the dispatch waits
/// for it (UltraEP's order).
pub struct GpuMoe {
    pub(super) gpu: Gpu,
    /// The device on the replica stream.
    pub(super) replicas: Gpu,
    /// Bytes landed per (rank, slot) in the current replication.
    pub(super) landed: LandedBytes,
    pub(super) pipelined: bool,
    pub(super) layout: Layout,
    pub(super) hidden: usize,
    pub(super) inter: usize,
    pub(super) expert_bytes: u64,
    /// `[moe layer][expert]`: byte offset of the expert's weights in its home rank's buffer.
    pub(super) home_offsets: Vec<Vec<u64>>,
    pub(super) buffers: RankBuffers,
    pub(super) blas: GroupedGemm,
    pub(super) solver: Option<GpuQuotaSolver>,
    pub(super) tiles: TilePlanner,
    pub(super) relay: RelayConfig,
    /// Where solved plans are downloaded for the host, beside the replica streaming.
    pub(super) side: Arc<CudaStream>,
    /// The last host plan uploaded (a plan that did not come from the solver).
    pub(super) uploaded: Option<DevicePlan>,
    /// The layer whose replicas are streaming from the solver's plan, and that plan.
    pub(super) solved: Option<Solved>,
    pub(super) verify: bool,
}

/// A layer solved on the device whose replication is queued: [`GpuMoe::run_layer`] goes on from
/// there when it is asked for the same layer and plan.
pub(super) struct Solved {
    pub(super) layer: usize,
    pub(super) plan: Plan,
    pub(super) replication: Replication,
}

/// Events of one layer's replication on the replica stream.
pub(super) struct Replication {
    /// Timing events around relay planning and streaming.
    pub(super) begin: CudaEvent,
    pub(super) end: CudaEvent,
    /// The landed-byte counters and the stall word are zeroed: a wait for a slot may start.
    pub(super) counters_clear: CudaEvent,
}

impl GpuMoe {
    /// Uploads every MoE layer's experts (`layers[l][e]`, `E` per layer, each `hidden x 2 inter`
    /// then `inter x hidden`) for `layout`, with `layout.slots_per_rank()` slots per rank;
    /// replicas are distributed over `relay`'s trees. With `solver`, [`Self::solve_layer`] runs
    /// the quota planner on the device with that `u_min` and rule.
    pub fn new(
        gpu: &Gpu,
        layout: &Layout,
        hidden: usize,
        inter: usize,
        layers: &[Vec<ExpertWeights<'_>>],
        solver: Option<(u64, TargetRule)>,
        relay: RelayConfig,
    ) -> Result<Self, CudaError> {
        if hidden == 0 || inter == 0 {
            return Err(KernelError::ZeroDimension {
                what: "hidden and intermediate size",
            }
            .into());
        }
        let expert_bytes = ((hidden * 2 * inter + inter * hidden) * 4) as u64;
        let HomeWeights {
            bytes: homes,
            offsets: home_offsets,
        } = pack_home_weights(layout, layers, (hidden, inter), |w, out| {
            out.extend(w.to_ne_bytes())
        })?;
        let tiles = TilePlanner::new(gpu, layout, &geometry(expert_bytes, relay), &home_offsets)?;
        let slot_buffer = layout.slots_per_rank() * expert_bytes as usize;
        let flags = vec![tiles.flag_capacity(); layout.ranks()];
        let buffers = RankBuffers::new(gpu, &homes, slot_buffer, &flags)?;
        let solver = solver
            .map(|(u_min, rule)| GpuQuotaSolver::new(gpu, layout, u_min, rule))
            .transpose()?;
        Ok(Self {
            gpu: gpu.clone(),
            replicas: gpu.fork()?,
            landed: LandedBytes::new(gpu, layout.ranks(), layout.slots_per_rank(), expert_bytes)?,
            pipelined: true,
            layout: layout.clone(),
            hidden,
            inter,
            expert_bytes,
            home_offsets,
            buffers,
            blas: GroupedGemm::new(gpu)?,
            solver,
            tiles,
            relay,
            side: gpu.stream().fork()?,
            uploaded: None,
            solved: None,
            verify: false,
        })
    }

    /// A second lane of this plane for a second micro-batch in flight: its own main and replica
    /// streams, slots, ready counters, tile planner and cuBLAS handle, reading the same home
    /// weights (which both lanes only read), with the same settings. It has no device solver:
    /// its plans are solved on the host and uploaded.
    pub fn another_lane(&self) -> Result<Self, CudaError> {
        self.gpu.context().bind_to_thread()?;
        // Forked: the new streams start after everything queued so far (the homes' upload).
        let gpu = self.gpu.fork()?;
        let tiles = TilePlanner::new(
            &gpu,
            &self.layout,
            &geometry(self.expert_bytes, self.relay),
            &self.home_offsets,
        )?;
        let slot_buffer = self.layout.slots_per_rank() * self.expert_bytes as usize;
        let flags = vec![tiles.flag_capacity(); self.layout.ranks()];
        Ok(Self {
            replicas: gpu.fork()?,
            landed: LandedBytes::new(
                &gpu,
                self.layout.ranks(),
                self.layout.slots_per_rank(),
                self.expert_bytes,
            )?,
            pipelined: self.pipelined,
            layout: self.layout.clone(),
            hidden: self.hidden,
            inter: self.inter,
            expert_bytes: self.expert_bytes,
            home_offsets: self.home_offsets.clone(),
            buffers: self.buffers.sharing_homes(&gpu, slot_buffer, &flags)?,
            blas: GroupedGemm::new(&gpu)?,
            solver: None,
            tiles,
            relay: self.relay,
            side: gpu.stream().fork()?,
            uploaded: None,
            solved: None,
            verify: self.verify,
            gpu,
        })
    }

    /// With `on`, every layer also downloads the tile stream the device built and fails unless
    /// it equals what the host compiler makes of the same plan (a slow check, for tests and
    /// `verify_plans`).
    pub fn set_verify(&mut self, on: bool) {
        self.verify = on;
    }

    /// With `on` (the default), dispatch and main-expert GEMMs run while the replicas stream;
    /// off, the dispatch waits for the replicas.
    pub fn set_pipelined_experts(&mut self, on: bool) {
        self.pipelined = on;
    }

    /// Bytes of one expert's weights (what a replica slot holds).
    pub fn expert_bytes(&self) -> u64 {
        self.expert_bytes
    }

    /// Whether [`Self::solve_layer`] is available (the plane was built with a solver).
    pub fn has_solver(&self) -> bool {
        self.solver.is_some()
    }

    /// What rank `rank`'s redundant slot `slot` holds now, downloaded (tests and debugging).
    pub fn slot_contents(&self, rank: usize, slot: usize) -> Result<Vec<f32>, CudaError> {
        let buffer = self.buffers.slots(rank).ok_or(KernelError::OutOfRange {
            what: "rank",
            value: rank as u64,
            limit: self.layout.ranks() as u64,
        })?;
        let start = slot as u64 * self.expert_bytes;
        let view = f32_view(buffer, start, start + self.expert_bytes)?;
        self.gpu.context().bind_to_thread()?;
        // On the stream that streamed it: after the last replication.
        Ok(self.replicas.stream().clone_dtoh(&view)?)
    }

    /// Solves `load` for MoE layer `layer` with the device quota solver and queues the layer's
    /// replica distribution right behind it: the relay trees and tile tasks are built from the
    /// plan where the solver left it, and the weights start streaming, with no host round trip.
    /// Returns the host's copy of the plan (validated, bit-identical to the CPU planner's),
    /// downloaded on a side stream while the replicas stream; [`Self::run_layer`] goes on from
    /// there.
    pub fn solve_layer(&mut self, layer: usize, load: &LoadMatrix) -> Result<Plan, CudaError> {
        self.gpu.context().bind_to_thread()?;
        self.solved = None;
        self.solver.as_mut().ok_or_else(no_solver)?.solve(load)?;
        let solved = self.gpu.stream().record_event(None)?;
        let replication = self.start_replication(layer, true)?;
        self.side.wait(&solved)?;
        let solver = self.solver.as_ref().ok_or_else(no_solver)?;
        let (plan, _) = solver.download(&self.side, load)?;
        self.solved = Some(Solved {
            layer,
            plan: plan.clone(),
            replication,
        });
        Ok(plan)
    }

    /// Queues relay planning and streaming of MoE layer `layer` from the solver's plan (`solved`)
    /// or the uploaded one on the replica stream, behind everything the main stream holds (the
    /// plan, and the last layer's GEMMs reading the slots); every landed tile is counted per
    /// slot, for the replica GEMMs' waits.
    pub(super) fn start_replication(
        &mut self,
        layer: usize,
        solved: bool,
    ) -> Result<Replication, CudaError> {
        let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let stream = self.replicas.stream();
        stream.wait(&self.gpu.stream().record_event(None)?)?;
        let begin = stream.record_event(timing)?;
        self.landed.reset(&self.replicas)?;
        self.tiles.clear_stall(&self.replicas)?;
        let counters_clear = stream.record_event(None)?;
        let (plan, guard) = plan_on_device(&self.solver, &self.uploaded, solved)?;
        self.tiles.plan(&self.replicas, plan, guard, layer)?;
        let blocks = self.gpu.info().multiprocessors.max(1) * 2;
        self.tiles.stream(
            &self.replicas,
            &mut self.buffers,
            (blocks, 512),
            Some(&self.landed),
        )?;
        let end = stream.record_event(timing)?;
        Ok(Replication {
            begin,
            end,
            counters_clear,
        })
    }

    /// The host compiler's tile stream for `plan` must equal the one the device built.
    fn verify_tiles(&self, layer: usize, plan: &Plan) -> Result<(), CudaError> {
        let schedule = plan_transfers(plan, self.expert_bytes, &self.relay);
        let buffers = BufferLayout {
            expert_bytes: self.expert_bytes,
            home_offsets: &self.home_offsets[layer],
            slot_bytes: self.expert_bytes,
        };
        let want = tiles::compile(plan, &schedule, &buffers, self.tiles.params().tile_bytes)?;
        if self.tiles.download(&self.replicas)? != want {
            return Err(CudaError::TileMismatch { layer });
        }
        Ok(())
    }

    /// Runs MoE layer `layer` (its index among the MoE layers) under `plan` on every rank's
    /// `inputs`: after [`Self::solve_layer`] for the same layer and plan it goes on with the
    /// replication already queued; any other plan is uploaded and distributed first. The three
    /// stages (`layer.rs`) back to back.
    pub fn run_layer(
        &mut self,
        layer: usize,
        plan: &Plan,
        inputs: &[RankInput<'_>],
        top_k: usize,
    ) -> Result<LayerRun, CudaError> {
        let mut flight = self.dispatch_layer(layer, plan, inputs, top_k)?;
        self.experts_layer(&mut flight)?;
        self.combine_layer(flight)
    }

    /// Waits for the replication on the host: an error means no replica byte moved (nothing
    /// planned) or the slots cannot be trusted (a stalled relay); with verification on, the
    /// device's tile stream must equal the host compiler's.
    pub(super) fn finish_replication(&self, layer: usize, plan: &Plan) -> Result<(), CudaError> {
        self.tiles.finish(&self.replicas)?;
        if self.verify {
            self.verify_tiles(layer, plan)?;
        }
        Ok(())
    }
}

/// Tiles of the default size streaming whole experts into slots of one expert each.
fn geometry(expert_bytes: u64, relay: RelayConfig) -> TileGeometry {
    TileGeometry {
        expert_bytes,
        slot_bytes: expert_bytes,
        tile_bytes: DEFAULT_TILE_BYTES,
        relay,
    }
}

fn no_solver() -> KernelError {
    KernelError::ZeroDimension {
        what: "solver (the plane was built without one)",
    }
}

/// The plan in device memory: the solver's (with its status words, the relay planner's guard)
/// when `solved`, else the last uploaded one.
pub(super) fn plan_on_device<'a>(
    solver: &'a Option<GpuQuotaSolver>,
    uploaded: &'a Option<DevicePlan>,
    solved: bool,
) -> Result<(&'a DevicePlan, Option<&'a CudaSlice<u64>>), KernelError> {
    match (solved, solver, uploaded) {
        (true, Some(solver), _) => Ok((solver.device_plan(), Some(solver.status()))),
        (false, _, Some(uploaded)) => Ok((uploaded, None)),
        _ => Err(KernelError::ZeroDimension {
            what: "plan on the device",
        }),
    }
}

/// Bytes `start..end` of a weight buffer as f32s.
pub(super) fn f32_view(
    buffer: &CudaSlice<u8>,
    start: u64,
    end: u64,
) -> Result<CudaView<'_, f32>, CudaError> {
    let outside = || KernelError::OutOfRange {
        what: "expert weight bytes",
        value: end,
        limit: buffer.len() as u64,
    };
    let bytes = buffer
        .try_slice(start as usize..end as usize)
        .ok_or_else(outside)?;
    // SAFETY: the bytes are f32 weights uploaded by `GpuMoe::new` or streamed from them into a
    // slot, and `start` is a multiple of 4 (experts and their parts are whole numbers of f32s).
    Ok(unsafe { bytes.transmute::<f32>(((end - start) / 4) as usize) }.ok_or_else(outside)?)
}
