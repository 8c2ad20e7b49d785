//! A whole MoE layer's data plane on the GPU, for `R` ranks whose buffers all live on one device:
//! what the engine runs on a GPU host instead of its CPU data plane (docs/architecture.md, "One
//! MoE layer of one step").
//!
//! Per layer, after the plan is known (solved here by [`GpuQuotaSolver`], or by any host
//! balancer and uploaded):
//!
//! 1. replica weights: the relay trees and tile tasks built on the device from the plan
//!    ([`super::tile_plan`]) and streamed by the persistent kernel from the home weights into
//!    every rank's redundant slots ([`super::replicate`]). With the device solver, solve, relay
//!    planning and streaming are queued back to back ([`GpuMoe::solve_layer`]): the host's copy
//!    of the plan is downloaded on a side stream while the replicas stream;
//! 2. token permute by cumulative quotas on every source rank ([`super::permute`]);
//! 3. dispatch: each destination's segments copied device to device into its receive buffer,
//!    sender after sender (the all-to-all of ranks sharing one GPU);
//! 4. grouping by expert instance, the gate-up grouped GEMM, `silu(gate) * up`, the down grouped
//!    GEMM (cuBLAS; main experts read the home weights, replicas their slot);
//! 5. return: outputs back to received order and copied into each source's send layout;
//! 6. the weighted combine in top-k order, downloaded for the shared experts and the residual.
//!
//! Every expert's weights are uploaded once when the plane is built: per rank, its main
//! experts of every MoE layer, layer after layer, each as the engine stores it (`[H, 2I]`
//! gate-up then `[I, H]` down, row-major f32). The slots are shared by all layers, as on a rack.

use super::exchange::Exchange;
use super::gemm::{GemmGroup, GroupedGemm, WeightOrder};
use super::home_weights::{pack_home_weights, HomeWeights};
use super::permute::{self, Received, Routed};
use super::replicate::RankBuffers;
use super::solver::GpuQuotaSolver;
use super::tile_plan::{TileGeometry, TilePlanner};
use super::tiles::{self, BufferLayout, DEFAULT_TILE_BYTES};
use super::{instance_offsets, to_u32, CudaError, DevicePlan, Gpu};
use crate::permute::check_len;
use crate::weights::{weight_source, WeightSource};
use crate::KernelError;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, CudaView, LaunchConfig, PushKernelArg};
use rackfill_balancer::quota::TargetRule;
use rackfill_balancer::relay::{plan_transfers, RelayConfig};
use rackfill_balancer::{Layout, LoadMatrix, Plan, PlanViolation};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use super::home_weights::ExpertWeights;

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
pub struct GpuMoe {
    gpu: Gpu,
    layout: Layout,
    hidden: usize,
    inter: usize,
    expert_bytes: u64,
    /// `[moe layer][expert]`: byte offset of the expert's weights in its home rank's buffer.
    home_offsets: Vec<Vec<u64>>,
    buffers: RankBuffers,
    blas: GroupedGemm,
    solver: Option<GpuQuotaSolver>,
    tiles: TilePlanner,
    relay: RelayConfig,
    /// Where solved plans are downloaded for the host, beside the replica streaming.
    side: Arc<CudaStream>,
    /// The last host plan uploaded (a plan that did not come from the solver).
    uploaded: Option<DevicePlan>,
    /// The layer whose replicas are streaming from the solver's plan, and that plan.
    solved: Option<Solved>,
    verify: bool,
}

/// A layer solved on the device whose replication is queued: [`GpuMoe::run_layer`] goes on from
/// there when it is asked for the same layer and plan.
struct Solved {
    layer: usize,
    plan: Plan,
    /// Timing events around the replication.
    replication: (CudaEvent, CudaEvent),
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
        let geometry = TileGeometry {
            expert_bytes,
            slot_bytes: expert_bytes,
            tile_bytes: DEFAULT_TILE_BYTES,
            relay,
        };
        let tiles = TilePlanner::new(gpu, layout, &geometry, &home_offsets)?;
        let slot_buffer = layout.slots_per_rank() * expert_bytes as usize;
        let flags = vec![tiles.flag_capacity(); layout.ranks()];
        let buffers = RankBuffers::new(gpu, &homes, slot_buffer, &flags)?;
        let solver = solver
            .map(|(u_min, rule)| GpuQuotaSolver::new(gpu, layout, u_min, rule))
            .transpose()?;
        Ok(Self {
            gpu: gpu.clone(),
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

    /// With `on`, every layer also downloads the tile stream the device built and fails unless
    /// it equals what the host compiler makes of the same plan (a slow check, for tests and
    /// `verify_plans`).
    pub fn set_verify(&mut self, on: bool) {
        self.verify = on;
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
        Ok(self.gpu.stream().clone_dtoh(&view)?)
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
    /// or the uploaded one; returns timing events around them.
    fn start_replication(
        &mut self,
        layer: usize,
        solved: bool,
    ) -> Result<(CudaEvent, CudaEvent), CudaError> {
        let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let stream = self.gpu.stream();
        let begin = stream.record_event(timing)?;
        let (plan, guard) = plan_on_device(&self.solver, &self.uploaded, solved)?;
        self.tiles.plan(&self.gpu, plan, guard, layer)?;
        let blocks = self.gpu.info().multiprocessors.max(1) * 2;
        self.tiles
            .stream(&self.gpu, &mut self.buffers, blocks, 512)?;
        let end = stream.record_event(timing)?;
        Ok((begin, end))
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
        if self.tiles.download(&self.gpu)? != want {
            return Err(CudaError::TileMismatch { layer });
        }
        Ok(())
    }

    /// Runs MoE layer `layer` (its index among the MoE layers) under `plan` on every rank's
    /// `inputs`: after [`Self::solve_layer`] for the same layer and plan it goes on with the
    /// replication already queued; any other plan is uploaded and distributed first.
    pub fn run_layer(
        &mut self,
        layer: usize,
        plan: &Plan,
        inputs: &[RankInput<'_>],
        top_k: usize,
    ) -> Result<LayerRun, CudaError> {
        // The engine calls from its own thread; cuBLAS needs the context current there.
        self.gpu.context().bind_to_thread()?;
        let ranks = self.layout.ranks();
        if inputs.len() != ranks {
            return Err(KernelError::RankCount {
                got: inputs.len(),
                ranks,
            }
            .into());
        }
        if layer >= self.home_offsets.len() {
            return Err(KernelError::OutOfRange {
                what: "MoE layer",
                value: layer as u64,
                limit: self.home_offsets.len() as u64,
            }
            .into());
        }
        if (plan.ranks(), plan.experts(), plan.slots_per_rank())
            != (ranks, self.layout.experts(), self.layout.slots_per_rank())
        {
            return Err(PlanViolation::Shape.into());
        }
        let mut phases = GpuPhases::default();

        let (solved, (begin, end)) = match self.solved.take() {
            Some(s) if s.layer == layer && s.plan == *plan => (true, s.replication),
            _ => {
                self.uploaded = Some(DevicePlan::upload(&self.gpu, plan)?);
                (false, self.start_replication(layer, false)?)
            }
        };
        // Waits for the replication: an error here means no replica byte moved (nothing planned)
        // or the slots cannot be trusted (a stalled relay).
        self.tiles.finish(&self.gpu)?;
        phases.replicate =
            Duration::from_secs_f64(f64::from(begin.elapsed_ms(&end)?.max(0.0)) / 1e3);
        if self.verify {
            self.verify_tiles(layer, plan)?;
        }
        let mut replica_recv_bytes = vec![0u64; ranks];
        for (rank, received) in replica_recv_bytes.iter_mut().enumerate() {
            let filled = plan.rank_slots(rank).iter().flatten().count() as u64;
            *received = filled * self.expert_bytes;
        }
        let (device_plan, _) = plan_on_device(&self.solver, &self.uploaded, solved)?;

        let started = Instant::now();
        let sources = upload_inputs(&self.gpu, inputs, self.hidden, top_k)?;
        let dispatches = sources
            .iter()
            .enumerate()
            .map(|(rank, source)| {
                source
                    .as_ref()
                    .map(|s| {
                        let routed = Routed {
                            x: &s.x,
                            experts: &s.experts,
                            pairs: s.pairs,
                            hidden: self.hidden,
                            top_k,
                        };
                        permute::permute_tokens(&self.gpu, device_plan, rank, routed)
                    })
                    .transpose()
            })
            .collect::<Result<Vec<_>, _>>()?;
        let exchange = Exchange::new(&dispatches, ranks);
        let received = (0..ranks)
            .map(|dst| exchange.gather(&self.gpu, &dispatches, dst, self.hidden))
            .collect::<Result<Vec<_>, _>>()?;
        self.gpu.stream().synchronize()?;
        phases.dispatch = started.elapsed();

        let started = Instant::now();
        let layer_plan = LayerPlan {
            host: plan,
            device: device_plan,
            inst_offsets: &instance_offsets(plan)?,
        };
        let mut computed = Vec::with_capacity(ranks);
        for (rank, recv) in received.iter().enumerate() {
            computed.push(match recv {
                Some(recv) => Some(self.experts(layer, &layer_plan, rank, recv)?),
                None => None,
            });
        }
        self.gpu.stream().synchronize()?;
        phases.experts = started.elapsed();

        let started = Instant::now();
        let mut outputs = Vec::with_capacity(ranks);
        for (src, (source, dispatch)) in sources.iter().zip(&dispatches).enumerate() {
            let (Some(source), Some(dispatch)) = (source, dispatch) else {
                outputs.push(Vec::new());
                continue;
            };
            let returned =
                exchange.scatter_back(&self.gpu, &computed, dispatch, src, self.hidden)?;
            let out = permute::combine(
                &self.gpu,
                dispatch,
                &returned,
                &source.weights,
                source.pairs / top_k,
                top_k,
                self.hidden,
            )?;
            outputs.push(self.gpu.stream().clone_dtoh(&out)?);
        }
        phases.combine = started.elapsed();
        Ok(LayerRun {
            outputs,
            token_recv_bytes: exchange.remote_bytes(self.hidden),
            replica_recv_bytes,
            phases,
        })
    }

    /// Expert compute on `rank`: group by instance, gate-up GEMM, activation, down GEMM; the
    /// outputs in received order.
    fn experts(
        &self,
        layer: usize,
        plan: &LayerPlan<'_>,
        rank: usize,
        recv: &super::exchange::ReceivedRows,
    ) -> Result<CudaSlice<f32>, CudaError> {
        let (h, i) = (self.hidden, self.inter);
        let received = Received {
            rows: &recv.rows,
            experts: &recv.experts,
            instances: &recv.instances,
            len: recv.len,
            hidden: h,
        };
        let grouped =
            permute::group_by_instance(&self.gpu, plan.device, plan.inst_offsets, rank, received)?;
        let sources = grouped
            .groups()
            .iter()
            .map(|g| self.instance_weights(layer, plan.host, rank, g.expert, g.instance))
            .collect::<Result<Vec<_>, _>>()?;
        let gate_up_bytes = (h * 2 * i * 4) as u64;
        // Part 0: gate-up, the first `gate_up_bytes` of an expert; part 1: down, the rest.
        let gemm_groups = |part: usize| -> Result<Vec<GemmGroup<'_>>, CudaError> {
            grouped
                .groups()
                .iter()
                .zip(&sources)
                .map(|(g, &(buffer, offset))| {
                    let (start, end) = match part {
                        0 => (offset, offset + gate_up_bytes),
                        _ => (offset + gate_up_bytes, offset + self.expert_bytes),
                    };
                    Ok(GemmGroup {
                        rows: g.rows.clone(),
                        weight: f32_view(buffer, start, end)?,
                    })
                })
                .collect()
        };
        let s = self.gpu.stream();
        let rows = recv.len;
        let mut gate_up = s.alloc_zeros::<f32>(rows * 2 * i)?;
        let (g, order) = (&self.gpu, WeightOrder::InByOut);
        self.blas.run(
            g,
            &grouped.rows,
            &mut gate_up,
            h,
            2 * i,
            order,
            &gemm_groups(0)?,
        )?;
        let mut act = s.alloc_zeros::<f32>(rows * i)?;
        let (rows32, i32_) = (to_u32(rows, "rows")?, to_u32(i, "intermediate size")?);
        let mut launch = s.launch_builder(self.gpu.function("silu_mul"));
        launch.arg(&gate_up).arg(&rows32).arg(&i32_).arg(&mut act);
        let cfg = LaunchConfig {
            grid_dim: (rows32.clamp(1, 65_535), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: arguments match `silu_mul`; `gate_up` holds rows x 2I and `act` rows x I.
        unsafe { launch.launch(cfg) }?;
        let mut out = s.alloc_zeros::<f32>(rows * h)?;
        self.blas
            .run(g, &act, &mut out, i, h, order, &gemm_groups(1)?)?;
        grouped.return_outputs(&self.gpu, &out)
    }

    /// Where `rank` reads the weights of `expert`'s `instance`: its home buffer for a main
    /// expert, the slot the replica was streamed into otherwise (buffer, byte offset).
    fn instance_weights(
        &self,
        layer: usize,
        plan: &Plan,
        rank: usize,
        expert: u32,
        instance: u32,
    ) -> Result<(&CudaSlice<u8>, u64), CudaError> {
        let misrouted = || KernelError::OutOfRange {
            what: "expert instance on this rank",
            value: u64::from(instance),
            limit: plan.instances(expert as usize).len() as u64,
        };
        let (buffer, offset) = match weight_source(&self.layout, plan, rank, expert, instance)
            .ok_or_else(misrouted)?
        {
            WeightSource::Home { .. } => (
                self.buffers.home(rank),
                self.home_offsets[layer][expert as usize],
            ),
            WeightSource::Slot { slot } => {
                (self.buffers.slots(rank), slot as u64 * self.expert_bytes)
            }
        };
        Ok((buffer.ok_or_else(misrouted)?, offset))
    }
}

fn no_solver() -> KernelError {
    KernelError::ZeroDimension {
        what: "solver (the plane was built without one)",
    }
}

/// The plan in device memory: the solver's (with its status words, the relay planner's guard)
/// when `solved`, else the last uploaded one.
fn plan_on_device<'a>(
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
fn f32_view(buffer: &CudaSlice<u8>, start: u64, end: u64) -> Result<CudaView<'_, f32>, CudaError> {
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

/// A layer's plan as the expert step reads it: on the host (weight sources), on the device
/// (instance keys) and its instance offsets on the host (group sizes without a download).
struct LayerPlan<'a> {
    host: &'a Plan,
    device: &'a DevicePlan,
    inst_offsets: &'a [u32],
}

/// One source rank's inputs on the device.
struct SourceRows {
    x: CudaSlice<f32>,
    experts: CudaSlice<u32>,
    weights: CudaSlice<f32>,
    pairs: usize,
}

/// Uploads every rank's inputs (`None` for a rank without tokens: it sends nothing).
fn upload_inputs(
    gpu: &Gpu,
    inputs: &[RankInput<'_>],
    hidden: usize,
    top_k: usize,
) -> Result<Vec<Option<SourceRows>>, CudaError> {
    if top_k == 0 {
        return Err(KernelError::ZeroDimension { what: "top_k" }.into());
    }
    let s = gpu.stream();
    inputs
        .iter()
        .map(|input| {
            let tokens = input.x.len() / hidden;
            check_len("x", input.x.len(), tokens * hidden)?;
            check_len("experts", input.experts.len(), tokens * top_k)?;
            check_len("weights", input.weights.len(), tokens * top_k)?;
            if tokens == 0 {
                return Ok(None);
            }
            Ok(Some(SourceRows {
                x: s.clone_htod(input.x)?,
                experts: s.clone_htod(input.experts)?,
                weights: s.clone_htod(input.weights)?,
                pairs: tokens * top_k,
            }))
        })
        .collect()
}
