//! One MoE layer on a [`GpuMoe`], in three stages that queue their work and hand a
//! [`LayerInFlight`] on: [`GpuMoe::dispatch_layer`] (replicas queued on the replica stream,
//! inputs uploaded, tokens permuted and exchanged), [`GpuMoe::experts_layer`] (the grouped
//! GEMMs: main instances, then each replica instance behind its own slot's wait) and
//! [`GpuMoe::combine_layer`] (outputs back, weighted sum, download). Between stages nothing waits
//! on the host, so two micro-batches on two lanes ([`GpuMoe::another_lane`]) keep the device
//! busy with one while the host queues the other.

use super::plane::{
    f32_view, plan_on_device, GpuMoe, GpuPhases, LayerRun, RankInput, Replication, Solved,
};
use crate::cuda::exchange::{Exchange, ReceivedRows};
use crate::cuda::gemm::{GemmGroup, WeightOrder};
use crate::cuda::permute::{self, DeviceDispatch, Received, Routed};
use crate::cuda::{instance_offsets, to_u32, CudaError, DevicePlan, Gpu};
use crate::permute::check_len;
use crate::weights::{weight_source, WeightSource};
use crate::KernelError;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaSlice, LaunchConfig, PushKernelArg};
use rackfill_balancer::{Plan, PlanViolation};
use std::time::Duration;

/// A layer between its stages: everything the next stage reads, on the device.
pub struct LayerInFlight {
    layer: usize,
    plan: Plan,
    top_k: usize,
    /// The device plan is the solver's (else the uploaded one).
    solved: bool,
    /// Events of the replication (on the replica stream); timing events around the dispatch and
    /// the experts (on the main stream).
    replication: Replication,
    dispatch: (CudaEvent, CudaEvent),
    experts: Option<(CudaEvent, CudaEvent)>,
    sources: Vec<Option<SourceRows>>,
    dispatches: Vec<Option<DeviceDispatch>>,
    exchange: Exchange,
    received: Vec<Option<ReceivedRows>>,
    /// Per rank: its outputs in received order, once the experts ran.
    computed: Vec<Option<CudaSlice<f32>>>,
}

/// Events that time device work (the default flags; the driver's `CU_EVENT_DISABLE_TIMING`
/// would make `elapsed_ms` fail).
const TIMING: Option<CUevent_flags> = Some(CUevent_flags::CU_EVENT_DEFAULT);

impl GpuMoe {
    /// Stage 1 of MoE layer `layer` (its index among the MoE layers) under `plan`: the
    /// replication (already queued after [`Self::solve_layer`] for the same layer and plan; any
    /// other plan is uploaded and distributed first), then every rank's `inputs` uploaded,
    /// permuted by cumulative quotas and exchanged; without pipelined experts the dispatch waits
    /// for the replicas.
    pub fn dispatch_layer(
        &mut self,
        layer: usize,
        plan: &Plan,
        inputs: &[RankInput<'_>],
        top_k: usize,
    ) -> Result<LayerInFlight, CudaError> {
        // The engine calls from its own threads; cuBLAS needs the context current there.
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
        let (solved, replication) = match self.solved.take() {
            Some(Solved {
                layer: l,
                plan: p,
                replication,
            }) if l == layer && p == *plan => (true, replication),
            _ => {
                self.uploaded = Some(DevicePlan::upload(&self.gpu, plan)?);
                (false, self.start_replication(layer, false)?)
            }
        };
        let s = self.gpu.stream();
        if !self.pipelined {
            s.wait(&replication.end)?;
        }
        let begin = s.record_event(TIMING)?;
        let (device_plan, _) = plan_on_device(&self.solver, &self.uploaded, solved)?;
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
        let end = s.record_event(TIMING)?;
        Ok(LayerInFlight {
            layer,
            plan: plan.clone(),
            top_k,
            solved,
            replication,
            dispatch: (begin, end),
            experts: None,
            sources,
            dispatches,
            exchange,
            received,
            computed: Vec::new(),
        })
    }

    /// Stage 2: every rank's main-expert GEMMs, then the replica instances', each behind a wait
    /// for its own slot to have landed (with pipelined experts; otherwise the dispatch already
    /// waited for the whole replication).
    pub fn experts_layer(&self, flight: &mut LayerInFlight) -> Result<(), CudaError> {
        self.gpu.context().bind_to_thread()?;
        let s = self.gpu.stream();
        let begin = s.record_event(TIMING)?;
        let (device_plan, _) = plan_on_device(&self.solver, &self.uploaded, flight.solved)?;
        let layer_plan = LayerPlan {
            host: &flight.plan,
            device: device_plan,
            inst_offsets: &instance_offsets(&flight.plan)?,
        };
        let mut pending = Vec::with_capacity(flight.received.len());
        for (rank, recv) in flight.received.iter().enumerate() {
            pending.push(match recv {
                Some(recv) => Some(self.main_experts(flight.layer, &layer_plan, rank, recv)?),
                None => None,
            });
        }
        if self.pipelined {
            // The slot waits read counters the replica stream zeroes first.
            s.wait(&flight.replication.counters_clear)?;
        }
        flight.computed = pending
            .into_iter()
            .map(|p| p.map(|p| self.replica_experts(p)).transpose())
            .collect::<Result<Vec<_>, _>>()?;
        flight.experts = Some((begin, s.record_event(TIMING)?));
        Ok(())
    }

    /// Stage 3: the outputs back into each source's send layout, the router-weighted sum in
    /// top-k order, downloaded; then the replication is checked (a stalled relay, or with
    /// verification a tile stream unlike the host compiler's, fails the layer) and the stages
    /// timed.
    pub fn combine_layer(&self, flight: LayerInFlight) -> Result<LayerRun, CudaError> {
        self.gpu.context().bind_to_thread()?;
        let (h, top_k) = (self.hidden, flight.top_k);
        let Some(experts) = flight.experts else {
            return Err(CudaError::StageOrder {
                layer: flight.layer,
                stage: "the combine",
            });
        };
        let s = self.gpu.stream();
        let begin = s.record_event(TIMING)?;
        let mut outputs = Vec::with_capacity(flight.sources.len());
        for (src, (source, dispatch)) in flight.sources.iter().zip(&flight.dispatches).enumerate() {
            let (Some(source), Some(dispatch)) = (source, dispatch) else {
                outputs.push(Vec::new());
                continue;
            };
            let returned =
                flight
                    .exchange
                    .scatter_back(&self.gpu, &flight.computed, dispatch, src, h)?;
            let out = permute::combine(
                &self.gpu,
                dispatch,
                &returned,
                &source.weights,
                source.pairs / top_k,
                top_k,
                h,
            )?;
            outputs.push(s.clone_dtoh(&out)?);
        }
        let end = s.record_event(TIMING)?;
        end.synchronize()?;
        self.finish_replication(flight.layer, &flight.plan)?;
        let ranks = self.layout.ranks();
        let replica_recv_bytes = (0..ranks)
            .map(|rank| flight.plan.rank_slots(rank).iter().flatten().count() as u64)
            .map(|filled| filled * self.expert_bytes)
            .collect();
        let elapsed = |(a, b): &(CudaEvent, CudaEvent)| -> Result<Duration, CudaError> {
            Ok(Duration::from_secs_f64(
                f64::from(a.elapsed_ms(b)?.max(0.0)) / 1e3,
            ))
        };
        Ok(LayerRun {
            outputs,
            token_recv_bytes: flight.exchange.remote_bytes(h),
            replica_recv_bytes,
            phases: GpuPhases {
                replicate: elapsed(&(flight.replication.begin, flight.replication.end))?,
                dispatch: elapsed(&flight.dispatch)?,
                experts: elapsed(&experts)?,
                combine: elapsed(&(begin, end))?,
            },
        })
    }

    /// Expert compute on `rank`, main instances: group by instance, then the gate-up GEMM,
    /// activation and down GEMM of every group whose weights are home (none of them reads a
    /// slot, so they may run while the replicas stream).
    fn main_experts<'r>(
        &'r self,
        layer: usize,
        plan: &LayerPlan<'_>,
        rank: usize,
        recv: &ReceivedRows,
    ) -> Result<RankExperts<'r>, CudaError> {
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
        let s = self.gpu.stream();
        let rows = recv.len;
        let mut experts = RankExperts {
            rank,
            gate_up: s.alloc_zeros::<f32>(rows * 2 * i)?,
            act: s.alloc_zeros::<f32>(rows * i)?,
            out: s.alloc_zeros::<f32>(rows * h)?,
            grouped,
            sources,
        };
        self.expert_gemms(&mut experts, false)?;
        Ok(experts)
    }

    /// The replica instances' GEMMs of a rank whose main experts ran (each behind its slot's
    /// wait when pipelined), then its outputs in received order.
    fn replica_experts(&self, mut experts: RankExperts<'_>) -> Result<CudaSlice<f32>, CudaError> {
        if experts.sources.iter().any(|s| s.slot.is_some()) {
            self.expert_gemms(&mut experts, true)?;
        }
        experts.grouped.return_outputs(&self.gpu, &experts.out)
    }

    /// Gate-up GEMM, `silu(gate) * up` and down GEMM of a rank's replica groups (`replicas`) or
    /// main groups. The activation runs over all rows: rows of groups not computed yet read
    /// zeros or their final values, and rewriting a row already computed writes the same bytes.
    fn expert_gemms(&self, experts: &mut RankExperts<'_>, replicas: bool) -> Result<(), CudaError> {
        let (h, i) = (self.hidden, self.inter);
        let gate_up_bytes = (h * 2 * i * 4) as u64;
        // Part 0: gate-up, the first `gate_up_bytes` of an expert; part 1: down, the rest.
        let gemm_groups = |part: usize| -> Result<Vec<GemmGroup<'_>>, CudaError> {
            experts
                .grouped
                .groups()
                .iter()
                .zip(&experts.sources)
                .filter(|(_, w)| w.slot.is_some() == replicas)
                .map(|(g, w)| {
                    let (start, end) = match part {
                        0 => (w.offset, w.offset + gate_up_bytes),
                        _ => (w.offset + gate_up_bytes, w.offset + self.expert_bytes),
                    };
                    Ok(GemmGroup {
                        rows: g.rows.clone(),
                        weight: f32_view(w.buffer, start, end)?,
                    })
                })
                .collect()
        };
        let (g, order) = (&self.gpu, WeightOrder::InByOut);
        let (gate_up_groups, down_groups) = (gemm_groups(0)?, gemm_groups(1)?);
        if replicas && self.pipelined {
            // Each replica's gate-up GEMM behind its own slot's wait (down GEMMs come after
            // every wait, so they need none).
            let slots = experts.sources.iter().filter_map(|w| w.slot);
            for (group, slot) in gate_up_groups.iter().zip(slots) {
                self.tiles.wait_for_slot(
                    g,
                    &self.landed,
                    (experts.rank, slot),
                    self.expert_bytes,
                )?;
                self.blas.run(
                    g,
                    &experts.grouped.rows,
                    &mut experts.gate_up,
                    h,
                    2 * i,
                    order,
                    std::slice::from_ref(group),
                )?;
            }
        } else {
            self.blas.run(
                g,
                &experts.grouped.rows,
                &mut experts.gate_up,
                h,
                2 * i,
                order,
                &gate_up_groups,
            )?;
        }
        let rows = experts.act.len() / i;
        let (rows32, i32_) = (to_u32(rows, "rows")?, to_u32(i, "intermediate size")?);
        let s = self.gpu.stream();
        let mut launch = s.launch_builder(self.gpu.function("silu_mul"));
        launch
            .arg(&experts.gate_up)
            .arg(&rows32)
            .arg(&i32_)
            .arg(&mut experts.act);
        let cfg = LaunchConfig {
            grid_dim: (rows32.clamp(1, 65_535), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: arguments match `silu_mul`; `gate_up` holds rows x 2I and `act` rows x I.
        unsafe { launch.launch(cfg) }?;
        self.blas
            .run(g, &experts.act, &mut experts.out, i, h, order, &down_groups)
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
    ) -> Result<InstanceWeights<'_>, CudaError> {
        let misrouted = || KernelError::OutOfRange {
            what: "expert instance on this rank",
            value: u64::from(instance),
            limit: plan.instances(expert as usize).len() as u64,
        };
        let (buffer, offset, slot) = match weight_source(&self.layout, plan, rank, expert, instance)
            .ok_or_else(misrouted)?
        {
            WeightSource::Home { .. } => (
                self.buffers.home(rank),
                self.home_offsets[layer][expert as usize],
                None,
            ),
            WeightSource::Slot { slot } => (
                self.buffers.slots(rank),
                slot as u64 * self.expert_bytes,
                Some(slot),
            ),
        };
        Ok(InstanceWeights {
            buffer: buffer.ok_or_else(misrouted)?,
            offset,
            slot,
        })
    }
}

/// Where a rank reads one expert instance's weights: a buffer and the byte offset of the
/// expert in it; `slot` when it is a redundant slot (streamed by the layer's replication).
#[derive(Clone, Copy)]
struct InstanceWeights<'a> {
    buffer: &'a CudaSlice<u8>,
    offset: u64,
    slot: Option<usize>,
}

/// One rank's expert step between its main and its replica instances' GEMMs.
struct RankExperts<'a> {
    rank: usize,
    grouped: permute::DeviceGroups,
    /// Per group of `grouped`.
    sources: Vec<InstanceWeights<'a>>,
    /// `rows x 2I`, `rows x I` and `rows x H`, group after group.
    gate_up: CudaSlice<f32>,
    act: CudaSlice<f32>,
    out: CudaSlice<f32>,
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
