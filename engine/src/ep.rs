//! The expert-parallel runtime: `R` ranks, data-parallel attention (each rank runs its own
//! sequences), experts sharded `E / R` per rank plus `n_slot` redundant slots per rank, and every
//! MoE layer balanced on its exact load before a token moves (docs/engine.md):
//!
//! router -> load matrix (all-gather) -> plan (every rank identical) -> replica weights streamed
//! over the relay schedule into the slot buffers -> token assignment by cumulative quotas ->
//! dispatch (all-to-all) -> grouped expert compute over main and replica experts -> combine
//! (all-to-all back, weighted sum in top-k order) -> shared experts -> residual.
//!
//! The combine sums each token's expert outputs in its top-k order, exactly as the dense path
//! does, so EP logits equal the dense single-rank logits whatever the plan.
//!
//! A runtime computes for the ranks its [`Fabric`] holds ([`Fabric::local_ranks`]: every rank
//! with the default in-process fabric, one with a process per GPU) and reaches the others only
//! through the fabric's collectives; the data plane (`plane`) does the per-layer work. Its model
//! needs only the routed experts homed on those ranks ([`EpRuntime::expert_selection`] says which
//! to load); replicas of the others arrive over the fabric.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use candle_core::Tensor;
use rayon::prelude::*;

use rackfill_balancer::metrics::{evaluate, PlanMetrics};
use rackfill_balancer::relay::RelayConfig;
use rackfill_balancer::reuse::{moves_replicas_of, prefer_resident};
use rackfill_balancer::{Algo, Balancer, Layout, LoadMatrix, Plan, Settings};
use rackfill_models::layers::moe::{rows_of, MoeBlock};
use rackfill_models::{
    ExpertSelection, FeedForward, KvCache, LogitsFor, ModelConfig, MoeModel, Routing, SeqChunk,
    SequenceInput,
};

use crate::error::{EngineError, Result};
use crate::fabric::{Fabric, LocalFabric};
use crate::model_device::ModelDevice;
use crate::plane::{DataPlane, LayerWork, PhaseTimes, Plane, PlaneConfig, PlaneOutput};
use crate::rack_cost::{MoeCost, MoeDims, PipelinedExperts, Rack, SimulatedMakespan, SlotMemory};

#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod on_device;
mod overlap;
mod planning;

use planning::{check_plans_agree, solve_on_host, Finished, Solved};

/// How the runtime is laid out and balanced.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EpConfig {
    /// `R`, ranks in the EP group (all of them in this process with the in-process fabric).
    pub ep_size: usize,
    /// `n_slot`, redundant expert slots per rank (shared by all layers).
    pub redundant_slots: usize,
    pub balancer: Algo,
    pub settings: Settings,
    pub relay: RelayConfig,
    /// Solve every layer's plan once per local rank, each from its own copy of the gathered load,
    /// and fail unless all plans are identical (what a multi-host deployment relies on; costs one
    /// solve per rank, so tests turn it on). With the GPU solver, the host planners must agree
    /// with it; on the GPU data plane, the tile stream built on the device must equal the host
    /// compiler's.
    pub verify_plans: bool,
    pub data_plane: DataPlane,
    /// Micro-batches each step's sequences are split into (1 or 2). With 2, one micro-batch
    /// communicates while the other computes, each with its own load, plan and replica slots
    /// (`ep/overlap.rs`; on the GPU data plane each micro-batch has its own lane of streams;
    /// not with the model on a device).
    pub micro_batches: usize,
    /// One set of redundant slots shared by every MoE layer (UltraEP §4.1), or one set per MoE
    /// layer (`PerLayer`, the CPU data plane only), keeping replicas resident between steps.
    pub slot_memory: SlotMemory,
    /// With per-layer slots and a quota balancer: move replicas onto ranks that still hold the
    /// same expert while the busiest rank's load stays within this fraction of the solved
    /// plan's (`rackfill_balancer::reuse::prefer_resident`); `None`: plans as solved.
    pub reuse_tolerance: Option<f64>,
    /// Pipelined experts: each MoE layer dispatches its tokens and runs its main experts' GEMMs
    /// while the replicas stream; only the replica instances wait for them (the schedule
    /// `rackfill simulate` costs as `pipelined_experts`). Off: replicas first, then dispatch
    /// (UltraEP's order). `Auto`: on the GPU plane, off on the CPU plane. It acts on steps of one
    /// micro-batch: with two, each micro-batch's replicas already stream under the other's
    /// compute.
    pub pipelined_experts: PipelinedExperts,
}

impl Default for EpConfig {
    fn default() -> Self {
        Self {
            ep_size: 8,
            redundant_slots: 2,
            balancer: Algo::Quota,
            settings: Settings::default(),
            relay: RelayConfig::default(),
            verify_plans: false,
            data_plane: DataPlane::Cpu,
            micro_batches: 1,
            slot_memory: SlotMemory::Shared,
            reuse_tolerance: Some(0.02),
            pipelined_experts: PipelinedExperts::Auto,
        }
    }
}

/// What one MoE layer of one step did.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerReport {
    pub layer: usize,
    /// The micro-batch of the step this report is for (0 with one micro-batch a step).
    pub micro_batch: usize,
    /// The exact load the plan was solved on (`load[r][e]`, token-expert pairs).
    pub load: LoadMatrix,
    pub metrics: PlanMetrics,
    /// Per rank: the expert each redundant slot holds after this layer.
    pub slots: Vec<Vec<Option<u32>>>,
    /// Replica weight bytes this process's ranks received.
    pub replica_bytes: u64,
    /// Per local rank (the fabric's, in order): bytes received from other ranks, dispatched rows,
    /// combined outputs and replica weights.
    pub recv_bytes: Vec<u64>,
    /// This layer's load and plan costed on the runtime's rack ([`EpRuntime::set_rack`]) by the
    /// cost model `rackfill simulate` uses, with the plan and without balancing.
    pub simulated: SimulatedMakespan,
    /// Plan solve time on one rank.
    pub solve_us: f64,
    pub phases: PhaseTimes,
}

/// The output of one EP step.
pub struct StepOutput {
    /// Per local rank: logits `[rows, V]`, or `None` when the rank had no tokens.
    pub logits: Vec<Option<Tensor>>,
    /// One report per MoE layer, in layer order.
    pub layers: Vec<LayerReport>,
}

/// The expert-parallel runtime of one model, for the local ranks of its fabric.
pub struct EpRuntime {
    model: Arc<MoeModel>,
    config: EpConfig,
    layout: Layout,
    /// Per layer (`None` for dense layers): one planner per local rank when plans are verified,
    /// else one.
    planners: Vec<Option<Vec<Box<dyn Balancer>>>>,
    plane: Plane,
    fabric: Box<dyn Fabric>,
    /// What each layer's simulated makespan is costed on.
    rack: Rack,
    /// The local ranks' dense parts (and, when every rank is local, the MoE data plane) on a
    /// GPU ([`EpRuntime::open_device`]); `None`: the CPU.
    #[cfg(feature = "cuda")]
    device: Option<on_device::OnDevice>,
}

impl EpRuntime {
    /// Lays `model` out over `config.ep_size` ranks, all in this process (the in-process
    /// fabric).
    pub fn new(model: Arc<MoeModel>, config: EpConfig) -> Result<Self> {
        let fabric = Box::new(LocalFabric::new(config.ep_size)?);
        Self::with_fabric(model, config, fabric)
    }

    /// Lays `model` out over the `config.ep_size` ranks of `fabric`'s group, computing for the
    /// ranks this process holds. The model must hold every routed expert homed on those ranks
    /// (all of them, or the [`Self::expert_selection`] for them).
    pub fn with_fabric(
        model: Arc<MoeModel>,
        config: EpConfig,
        fabric: Box<dyn Fabric>,
    ) -> Result<Self> {
        let local = fabric.local_ranks();
        if !(1..=2).contains(&config.micro_batches) {
            return Err(EngineError::Config(format!(
                "a step runs 1 or 2 micro-batches, not {}",
                config.micro_batches
            )));
        }
        if config.ep_size == 0
            || fabric.world_size() != config.ep_size
            || local.is_empty()
            || local.end > config.ep_size
        {
            return Err(EngineError::Config(format!(
                "EP size {} with a fabric holding ranks {local:?} of {}",
                config.ep_size,
                fabric.world_size()
            )));
        }
        let layout = home_layout(model.config(), &config)?;
        check_home_experts(&model, &layout, local.clone())?;
        let per_layer = if config.verify_plans { local.len() } else { 1 };
        let planners = model
            .layers()
            .iter()
            .map(|layer| match layer.ffn() {
                FeedForward::Moe(_) => Some(
                    (0..per_layer)
                        .map(|_| config.balancer.build(&config.settings))
                        .collect(),
                ),
                FeedForward::Dense(_) => None,
            })
            .collect();
        let plane_config = PlaneConfig {
            relay: config.relay,
            balancer: config.balancer,
            u_min: config.settings.u_min,
            verify: config.verify_plans,
            micro_batches: config.micro_batches,
            slot_memory: config.slot_memory,
            pipelined_experts: config
                .pipelined_experts
                .resolve(config.data_plane == DataPlane::Cpu),
        };
        let plane = Plane::open(config.data_plane, &model, &layout, local, &plane_config)?;
        Ok(Self {
            model,
            config,
            layout,
            planners,
            plane,
            fabric,
            rack: Rack::nvl72(),
            #[cfg(feature = "cuda")]
            device: None,
        })
    }

    /// Moves the local ranks' dense parts (embedding, attention with its KV cache, norms, dense
    /// MLPs, LM head) to `device`, GPU [`ModelDevice::gpu_ordinal`] for a process of local rank
    /// `local_rank`, with a paged KV cache for `kv_tokens_per_rank` tokens per local rank; the
    /// MoE layers stay on the data plane. Sequences then need caches from
    /// [`Self::new_cache`].
    pub fn open_device(
        &mut self,
        device: ModelDevice,
        local_rank: Option<usize>,
        kv_tokens_per_rank: usize,
    ) -> Result<()> {
        match device {
            ModelDevice::Cpu => Ok(()),
            #[cfg(feature = "cuda")]
            ModelDevice::Cuda { .. } => {
                let ordinal = device.gpu_ordinal(local_rank).unwrap_or(0);
                self.open_device_with(Self::open_gpu(ordinal)?, kv_tokens_per_rank)
            }
            #[cfg(feature = "cuda")]
            ModelDevice::Emulator => {
                let emulator =
                    rackfill_kernels::cuda::exec::Emulator::shared().ok_or_else(|| {
                        EngineError::Config("--device emulator needs a C++ compiler (CXX)".into())
                    })?;
                self.open_device_with(emulator, kv_tokens_per_rank)
            }
            #[cfg(not(feature = "cuda"))]
            _ => {
                let _ = (local_rank, kv_tokens_per_rank);
                Err(EngineError::Config(format!(
                    "--device {device} needs the GPU path of the default build (this binary was \
                     built with --no-default-features and runs on the CPU only)"
                )))
            }
        }
    }

    /// An empty KV cache for a new sequence on this runtime's device, in blocks of
    /// `block_tokens` tokens on the host.
    pub fn new_cache(&self, block_tokens: usize) -> KvCache {
        #[allow(unused_mut)]
        let mut cache = self.model.new_paged_cache(block_tokens);
        #[cfg(feature = "cuda")]
        if let Some(device) = &self.device {
            cache.device = Some(Box::new(device.model.new_sequence()));
        }
        cache
    }

    /// The routed experts a process holding EP ranks `local` of `config.ep_size` must load for a
    /// model of `model` (in every MoE layer): those homed on its ranks in the layout the runtime
    /// builds, [`ExpertSelection::All`] when its ranks home every expert. The rest reach its ranks
    /// as replicas streamed from their home ranks, so a process never reads them.
    pub fn expert_selection(
        model: &ModelConfig,
        config: &EpConfig,
        local: Range<usize>,
    ) -> Result<ExpertSelection> {
        if local.is_empty() || local.end > config.ep_size {
            return Err(EngineError::Config(format!(
                "local ranks {local:?} of EP size {}",
                config.ep_size
            )));
        }
        let layout = home_layout(model, config)?;
        let homed = local.flat_map(|rank| layout.main_experts(rank).iter().copied());
        let selection = ExpertSelection::only(homed);
        Ok(if selection.is_complete(layout.experts()) {
            ExpertSelection::All
        } else {
            selection
        })
    }

    /// Costs every layer's simulated makespan on `rack` from now on (default: NVL72, the rack
    /// `rackfill simulate` defaults to).
    pub fn set_rack(&mut self, rack: Rack) {
        self.rack = rack;
    }

    /// The rack simulated makespans are costed on.
    pub fn rack(&self) -> &Rack {
        &self.rack
    }

    /// The expert layout (home rank of every expert, slots per rank).
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The configuration this runtime was built with.
    pub fn config(&self) -> &EpConfig {
        &self.config
    }

    /// The model it runs.
    pub fn model(&self) -> &Arc<MoeModel> {
        &self.model
    }

    /// The ranks this runtime computes for (its fabric's local ranks).
    pub fn local_ranks(&self) -> std::ops::Range<usize> {
        self.fabric.local_ranks()
    }

    /// Bytes the fabric has delivered to this process's ranks since the runtime was built.
    pub fn bytes_moved(&self) -> u64 {
        self.fabric.bytes_moved()
    }

    /// A copy of local rank `rank`'s redundant slot `slot` of micro-batch `micro_batch`, in the
    /// slots model layer `layer` uses (what that micro-batch's last plan streamed there; read
    /// back from the device on a GPU plane, widened from bf16 on the device's own, which has one
    /// micro-batch).
    pub fn slot_contents(
        &self,
        (micro_batch, layer): (usize, usize),
        rank: usize,
        slot: usize,
    ) -> Option<Vec<f32>> {
        #[cfg(feature = "cuda")]
        if let Some(slots) = self
            .device
            .as_ref()
            .filter(|_| micro_batch == 0)
            .and_then(|d| d.slot_contents(rank, slot))
        {
            return slots;
        }
        self.plane.slot_contents((micro_batch, layer), rank, slot)
    }

    /// Whether the replica slots hold bf16 weights (the device's own data plane: what
    /// [`Self::slot_contents`] returns is then the home weights rounded to bf16).
    pub fn slots_in_bf16(&self) -> bool {
        #[cfg(feature = "cuda")]
        if let Some(device) = &self.device {
            return device.moe.is_some();
        }
        false
    }

    /// One step: every local rank's batch of sequence chunks through every layer. `batches[i]`
    /// is local rank `i`'s sequences, each continuing from its own KV cache; `which[i][j]` says
    /// which of sequence `j`'s rows get logits. Every process of the fabric's group steps
    /// together, a rank without sequences included.
    pub fn forward(
        &mut self,
        batches: &mut [Vec<SequenceInput<'_>>],
        which: &[Vec<LogitsFor>],
    ) -> Result<StepOutput> {
        self.check_step(batches, which)?;
        #[cfg(feature = "cuda")]
        if self.device.is_some() {
            return self.forward_on_device(batches, which);
        }
        if self.config.micro_batches > 1 {
            return self.forward_overlapped(batches, which);
        }
        let model = Arc::clone(&self.model);
        let mut seqs: Vec<&mut [SequenceInput<'_>]> =
            batches.iter_mut().map(Vec::as_mut_slice).collect();
        let mut xs = embed_ranks(&model, &seqs)?;
        let mut reports = Vec::new();
        for (index, layer) in model.layers().iter().enumerate() {
            let (hs, inputs) = attention_ranks(&model, index, &xs, &mut seqs)?;
            let outs = match layer.ffn() {
                FeedForward::Dense(mlp) => dense_ranks(mlp, &inputs)?,
                FeedForward::Moe(block) => {
                    let (outs, report) = self.moe_layer(index, block, &inputs)?;
                    reports.push(report);
                    outs
                }
            };
            xs = add_residual(hs, outs)?;
        }
        drop(seqs);
        let logits = xs
            .into_iter()
            .zip(batches.iter())
            .zip(which)
            .map(|((x, batch), which)| {
                let lens: Vec<usize> = batch.iter().map(|s| s.tokens.len()).collect();
                x.map(|x| model.logits_for(x, &lens, which))
                    .transpose()
                    .map_err(EngineError::from)
            })
            .collect::<Result<_>>()?;
        Ok(StepOutput {
            logits,
            layers: reports,
        })
    }

    /// One batch per local rank, one logits choice per sequence, caches made for this model.
    fn check_step(
        &self,
        batches: &[Vec<SequenceInput<'_>>],
        which: &[Vec<LogitsFor>],
    ) -> Result<()> {
        if which.len() != batches.len()
            || which
                .iter()
                .zip(batches.iter())
                .any(|(w, b)| w.len() != b.len())
        {
            return Err(EngineError::InvalidRequest(
                "one logits choice per sequence is needed".into(),
            ));
        }
        let local = self.fabric.local_ranks();
        if batches.len() != local.len() {
            return Err(EngineError::Fabric(format!(
                "{} rank batches for local ranks {local:?} of EP size {}",
                batches.len(),
                self.config.ep_size
            )));
        }
        let layers = self.model.layers().len();
        if batches
            .iter()
            .flatten()
            .any(|s| s.cache.layers.len() != layers)
        {
            return Err(EngineError::InvalidRequest(
                "KV cache was made for a different model".into(),
            ));
        }
        Ok(())
    }

    /// One MoE layer under EP on every local rank's FFN input.
    fn moe_layer(
        &mut self,
        layer: usize,
        block: &MoeBlock,
        inputs: &[Option<Tensor>],
    ) -> Result<(Vec<Option<Tensor>>, LayerReport)> {
        let mc = self.model.config();
        let (hidden, top_k) = (mc.hidden_size, mc.moe.top_k);

        // 1. Router on every local rank.
        let started = Instant::now();
        let routed = route(block, inputs, top_k)?;
        let route_time = started.elapsed();

        // 2. Count exchange; 3. plan on every rank's copy.
        let started = Instant::now();
        let counts: Vec<Vec<u64>> = routed
            .iter()
            .map(|(_, routing)| routing.expert_counts(self.layout.experts()))
            .collect();
        let gathered = self.fabric.all_gather(&counts)?;
        let Solved { plan, load, took } = self.solve(layer, gathered)?;
        let resident = self.plane.resident(layer);
        let plan = reuse_resident(&self.config, &self.layout, &load, plan, resident.as_deref());
        check_plans_agree(&*self.fabric, layer, &plan)?;
        let solve_time = started.elapsed();

        // 4-7. Replicas, token assignment and dispatch, expert compute, combine.
        let work = LayerWork {
            layer,
            block,
            plan: &plan,
            routed: &routed,
            hidden,
            top_k,
        };
        let PlaneOutput {
            routed: routed_out,
            recv_bytes,
            replica_bytes,
            phases,
        } = self.plane.run_layer(&*self.fabric, &work)?;

        // Shared experts on the source ranks (timed with the combine, as they finish the layer).
        let started = Instant::now();
        let outs = add_shared_ranks(block, inputs, routed_out)?;
        let shared_time = started.elapsed();

        let finished = Finished {
            layer,
            solved: Solved { plan, load, took },
            bytes: (replica_bytes, recv_bytes),
            phases: PhaseTimes {
                route: route_time,
                solve: solve_time,
                combine: phases.combine + shared_time,
                ..phases
            },
        };
        Ok((outs, self.layer_report(finished, 0)))
    }

    /// What one MoE layer of micro-batch `micro_batch` did: its exact load, the plan's metrics
    /// and slots, the plan costed on the runtime's rack, the solve time, what the data plane
    /// moved (replica bytes, bytes received per local rank) and its phase times.
    fn layer_report(&self, finished: Finished, micro_batch: usize) -> LayerReport {
        let Finished {
            layer,
            solved: Solved { plan, load, took },
            bytes: (replica_bytes, recv_bytes),
            phases,
        } = finished;
        let mc = self.model.config();
        let cost = MoeCost {
            rack: &self.rack,
            dims: MoeDims {
                hidden: mc.hidden_size,
                intermediate: mc.moe.intermediate_size,
            },
        };
        LayerReport {
            layer,
            micro_batch,
            metrics: evaluate(&self.layout, &load, &plan),
            simulated: cost.makespan(&self.layout, &load, &plan, &self.config.relay),
            slots: (0..plan.ranks())
                .map(|r| plan.rank_slots(r).to_vec())
                .collect(),
            load,
            replica_bytes,
            recv_bytes,
            solve_us: took.as_secs_f64() * 1e6,
            phases,
        }
    }

    /// Solves the layer's plan from the gathered load: where the data plane's data lives when it
    /// can (the GPU plane's device solver with a quota balancer), else on the host. With
    /// `verify_plans`, the host planners solve too, one per local rank from its own copy, and
    /// every plan must agree.
    fn solve(&mut self, layer: usize, gathered: Vec<Vec<u64>>) -> Result<Solved> {
        let load = LoadMatrix::from_rows(&gathered)?;
        let started = Instant::now();
        if let Some(plan) = self.plane.solve_on_device(layer, &load)? {
            let took = started.elapsed();
            if self.config.verify_plans {
                let host = self.planners_solve(layer, &load)?;
                if host.plan != plan {
                    return Err(EngineError::Gpu(format!(
                        "layer {layer}: the GPU solver's plan differs from the host planner's"
                    )));
                }
            }
            return Ok(Solved { plan, load, took });
        }
        self.planners_solve(layer, &load)
    }

    /// [`solve_on_host`] with this runtime's planners of `layer`.
    fn planners_solve(&mut self, layer: usize, load: &LoadMatrix) -> Result<Solved> {
        let planners = self.planners[layer]
            .as_mut()
            .ok_or_else(|| EngineError::Config(format!("layer {layer} has no planner")))?;
        solve_on_host(
            planners,
            &self.layout,
            self.fabric.local_ranks(),
            layer,
            load,
        )
    }
}

/// The expert layout of an EP group: `ep_size` ranks, each homing a contiguous run of the model's
/// routed experts, with `redundant_slots` slots (the one rule for the runtime and for what a
/// process loads).
fn home_layout(model: &ModelConfig, config: &EpConfig) -> Result<Layout> {
    Ok(Layout::contiguous(
        config.ep_size,
        model.moe.num_experts,
        config.redundant_slots,
    )?)
}

/// Fails unless `model` holds, in every MoE layer, every routed expert homed on the `local`
/// ranks: what the data plane computes main instances with and streams replicas from.
fn check_home_experts(model: &MoeModel, layout: &Layout, local: Range<usize>) -> Result<()> {
    for (index, layer) in model.layers().iter().enumerate() {
        let FeedForward::Moe(block) = layer.ffn() else {
            continue;
        };
        for rank in local.clone() {
            if let Some(missing) = layout
                .main_experts(rank)
                .iter()
                .find(|&&e| !block.experts.is_loaded(e))
            {
                return Err(EngineError::Config(format!(
                    "rank {rank} homes expert {missing} of layer {index}, but the model holds \
                     {} of {} there: load the experts of ranks {local:?} \
                     (EpRuntime::expert_selection)",
                    block.experts.selection(),
                    block.experts.num_experts()
                )));
            }
        }
    }
    Ok(())
}

/// `plan` with its replicas moved onto ranks that still hold the same expert (`resident`, the
/// layer's last plan's slots), within [`EpConfig::reuse_tolerance`]; quota balancers only
/// (their split is locality-first), and as solved otherwise.
fn reuse_resident(
    config: &EpConfig,
    layout: &Layout,
    load: &LoadMatrix,
    plan: Plan,
    resident: Option<&[Option<u32>]>,
) -> Plan {
    match (config.reuse_tolerance, resident) {
        (Some(tolerance), Some(resident)) if moves_replicas_of(config.balancer) => {
            prefer_resident(layout, load, &plan, resident, tolerance)
        }
        _ => plan,
    }
}

/// Per local rank: a tensor, or `None` for a rank without tokens.
type RankTensors = Vec<Option<Tensor>>;

/// Every local rank's tokens embedded, its sequences' tokens in order.
fn embed_ranks(model: &MoeModel, seqs: &[&mut [SequenceInput<'_>]]) -> Result<RankTensors> {
    seqs.iter()
        .map(|seqs| {
            let tokens: Vec<u32> = seqs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
            (!tokens.is_empty())
                .then(|| model.embed(&tokens))
                .transpose()
        })
        .collect::<Result<_, _>>()
        .map_err(EngineError::from)
}

/// Data-parallel attention of model layer `layer`: every rank on its own sequences, each
/// continuing its KV cache. Returns the residual stream after attention and the FFN input.
fn attention_ranks(
    model: &MoeModel,
    layer: usize,
    xs: &[Option<Tensor>],
    seqs: &mut [&mut [SequenceInput<'_>]],
) -> Result<(RankTensors, RankTensors)> {
    let block = &model.layers()[layer];
    let hs: RankTensors = xs
        .par_iter()
        .zip(seqs.par_iter_mut())
        .map(|(x, seqs)| {
            let Some(x) = x else { return Ok(None) };
            let mut chunks: Vec<SeqChunk<'_>> = seqs
                .iter_mut()
                .map(|s| SeqChunk {
                    len: s.tokens.len(),
                    cache: &mut s.cache.layers[layer],
                })
                .collect();
            block.attention_residual(x, &mut chunks).map(Some)
        })
        .collect::<Result<_, _>>()?;
    let inputs = hs
        .iter()
        .map(|h| h.as_ref().map(|h| block.ffn_input(h)).transpose())
        .collect::<Result<_, _>>()?;
    Ok((hs, inputs))
}

/// A dense MLP on every rank's FFN input.
fn dense_ranks(mlp: &impl candle_core::Module, inputs: &[Option<Tensor>]) -> Result<RankTensors> {
    inputs
        .iter()
        .map(|x| x.as_ref().map(|x| mlp.forward(x)).transpose())
        .collect::<Result<_, _>>()
        .map_err(|e| rackfill_models::ModelError::from(e).into())
}

/// The routed experts' output plus the shared experts' (on the FFN input) on every rank with
/// tokens.
fn add_shared_ranks(
    block: &MoeBlock,
    inputs: &[Option<Tensor>],
    routed: RankTensors,
) -> Result<RankTensors> {
    inputs
        .par_iter()
        .zip(routed)
        .map(|(x, routed)| match (x, routed) {
            (Some(x), Some(routed)) => Ok(Some(block.add_shared(x, routed)?)),
            _ => Ok(None),
        })
        .collect()
}

/// The residual stream after a layer: `h + out` on every rank with tokens.
fn add_residual(hs: RankTensors, outs: RankTensors) -> Result<RankTensors> {
    hs.into_iter()
        .zip(outs)
        .map(|(h, out)| match (h, out) {
            (Some(h), Some(out)) => Ok(Some((h + out)?)),
            _ => Ok(None),
        })
        .collect::<Result<_, candle_core::Error>>()
        .map_err(|e| rackfill_models::ModelError::from(e).into())
}

/// The router on every local rank: each rank's FFN input rows and their top-k routing (empty
/// for a rank without tokens).
fn route(
    block: &MoeBlock,
    inputs: &[Option<Tensor>],
    top_k: usize,
) -> Result<Vec<(Vec<f32>, Routing)>> {
    inputs
        .iter()
        .map(|x| match x {
            Some(x) => Ok((rows_of(x)?, block.router.route(x)?)),
            None => Ok((
                Vec::new(),
                Routing {
                    top_k,
                    experts: Vec::new(),
                    weights: Vec::new(),
                },
            )),
        })
        .collect::<Result<_, rackfill_models::ModelError>>()
        .map_err(EngineError::from)
}
