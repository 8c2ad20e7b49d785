//! The expert-parallel runtime: `R` ranks in one process, data-parallel attention (each rank runs
//! its own sequences), experts sharded `E / R` per rank plus `n_slot` redundant slots per rank,
//! and every MoE layer balanced on its exact load before a token moves (DESIGN.md "Data flow"):
//!
//! router -> load matrix (all-gather) -> plan (every rank identical) -> replica weights streamed
//! over the relay schedule into the slot buffers -> token assignment by cumulative quotas ->
//! dispatch (all-to-all) -> grouped expert compute over main and replica experts -> combine
//! (all-to-all back, weighted sum in top-k order) -> shared experts -> residual.
//!
//! The combine sums each token's expert outputs in its top-k order, exactly as the dense path
//! does, so EP logits equal the dense single-rank logits whatever the plan.

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Tensor;
use rayon::prelude::*;

use rackfill_balancer::metrics::{evaluate, PlanMetrics};
use rackfill_balancer::relay::RelayConfig;
use rackfill_balancer::{Algo, Balancer, Layout, LoadMatrix, Plan, Settings};
use rackfill_models::layers::moe::{rows_of, MoeBlock};
use rackfill_models::{FeedForward, LogitsFor, MoeModel, Routing, SeqChunk, SequenceInput};

use crate::cost::{flops_per_pair, CostModel, SimulatedMakespan};
use crate::cpu_plane::{CpuPlane, LayerWork};
use crate::error::{EngineError, Result};
use crate::fabric::{Fabric, LocalFabric};

/// Per-row metadata in dispatch messages: pair index, expert, instance.
pub(crate) const IDS_PER_ROW: usize = 3;

/// Where the MoE layers' data plane (replica streaming, dispatch, expert compute, combine) runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DataPlane {
    /// Host memory and the model's own expert MLP (every build).
    #[default]
    Cpu,
    /// Every rank's experts, slots and token buffers on GPU `ordinal`, CUDA kernels and cuBLAS
    /// (builds with feature `cuda`; the router, attention and shared experts stay on the CPU).
    Gpu { ordinal: usize },
}

impl std::fmt::Display for DataPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DataPlane::Cpu => f.write_str("cpu"),
            DataPlane::Gpu { ordinal } => write!(f, "gpu:{ordinal}"),
        }
    }
}

impl std::str::FromStr for DataPlane {
    type Err = String;

    /// `cpu`, `gpu` (device 0) or `gpu:N`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cpu" => Ok(DataPlane::Cpu),
            "gpu" => Ok(DataPlane::Gpu { ordinal: 0 }),
            other => other
                .strip_prefix("gpu:")
                .and_then(|n| n.parse().ok())
                .map(|ordinal| DataPlane::Gpu { ordinal })
                .ok_or_else(|| {
                    format!("unknown data plane '{other}' (expected cpu, gpu or gpu:N)")
                }),
        }
    }
}

/// How the runtime is laid out and balanced.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EpConfig {
    /// `R`, ranks in this process.
    pub ep_size: usize,
    /// `n_slot`, redundant expert slots per rank (shared by all layers).
    pub redundant_slots: usize,
    pub balancer: Algo,
    pub settings: Settings,
    pub relay: RelayConfig,
    /// Per-rank throughput figures of the simulated makespan.
    pub cost: CostModel,
    /// Solve every layer's plan once per rank, each from its own copy of the gathered load, and
    /// fail unless all plans are identical (what a multi-host deployment relies on; costs `R`
    /// solves, so tests turn it on). With the GPU solver, the host planners must agree with it;
    /// on the GPU data plane, the tile stream built on the device must equal the host compiler's.
    pub verify_plans: bool,
    pub data_plane: DataPlane,
}

impl Default for EpConfig {
    fn default() -> Self {
        Self {
            ep_size: 8,
            redundant_slots: 2,
            balancer: Algo::Quota,
            settings: Settings::default(),
            relay: RelayConfig::default(),
            cost: CostModel::default(),
            verify_plans: false,
            data_plane: DataPlane::Cpu,
        }
    }
}

/// Wall time of each phase of one MoE layer.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PhaseTimes {
    pub route: Duration,
    pub solve: Duration,
    pub replicate: Duration,
    pub dispatch: Duration,
    pub experts: Duration,
    pub combine: Duration,
}

/// What one MoE layer of one step did.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerReport {
    pub layer: usize,
    /// The exact load the plan was solved on (`load[r][e]`, token-expert pairs).
    pub load: LoadMatrix,
    pub metrics: PlanMetrics,
    /// Per rank: the expert each redundant slot holds after this layer.
    pub slots: Vec<Vec<Option<u32>>>,
    /// Replica weight bytes streamed (all ranks).
    pub replica_bytes: u64,
    /// Bytes each rank received from other ranks: dispatched rows, combined outputs and
    /// replica weights.
    pub recv_bytes: Vec<u64>,
    /// The per-rank cost model's makespan of this layer, with the plan and without balancing.
    pub simulated: SimulatedMakespan,
    /// Plan solve time on one rank.
    pub solve_us: f64,
    pub phases: PhaseTimes,
}

/// The output of one EP step.
pub struct StepOutput {
    /// Per rank: logits `[rows, V]`, or `None` when the rank had no tokens.
    pub logits: Vec<Option<Tensor>>,
    /// One report per MoE layer, in layer order.
    pub layers: Vec<LayerReport>,
}

/// The expert-parallel runtime of one model.
pub struct EpRuntime {
    model: Arc<MoeModel>,
    config: EpConfig,
    layout: Layout,
    /// Per layer (`None` for dense layers): one planner per rank when plans are verified, else one.
    planners: Vec<Option<Vec<Box<dyn Balancer>>>>,
    plane: Plane,
    fabric: Box<dyn Fabric>,
}

/// The data plane in use.
enum Plane {
    Cpu(CpuPlane),
    #[cfg(feature = "cuda")]
    Gpu(Box<crate::gpu_plane::GpuPlane>),
}

/// What a data plane returns for one layer.
pub(crate) struct PlaneOutput {
    /// Per rank: the routed experts' combined output (`None` without tokens), before shared
    /// experts.
    pub routed: Vec<Option<Tensor>>,
    /// Per rank: bytes received from other ranks (dispatched rows, combined outputs, replicas).
    pub recv_bytes: Vec<u64>,
    /// Replica weight bytes streamed (all ranks).
    pub replica_bytes: u64,
}

impl EpRuntime {
    /// Lays `model` out over `config.ep_size` ranks with the in-process fabric.
    pub fn new(model: Arc<MoeModel>, config: EpConfig) -> Result<Self> {
        let fabric = Box::new(LocalFabric::new(config.ep_size)?);
        Self::with_fabric(model, config, fabric)
    }

    /// Lays `model` out over the ranks of `fabric`.
    pub fn with_fabric(
        model: Arc<MoeModel>,
        config: EpConfig,
        fabric: Box<dyn Fabric>,
    ) -> Result<Self> {
        if config.ep_size == 0 || fabric.ranks() != config.ep_size {
            return Err(EngineError::Config(format!(
                "EP size {} with a fabric of {} ranks",
                config.ep_size,
                fabric.ranks()
            )));
        }
        let mc = model.config();
        let (hidden, inter) = (mc.hidden_size, mc.moe.intermediate_size);
        let layout =
            Layout::contiguous(config.ep_size, mc.moe.num_experts, config.redundant_slots)?;
        let per_layer = if config.verify_plans {
            config.ep_size
        } else {
            1
        };
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
        let plane = match config.data_plane {
            DataPlane::Cpu => Plane::Cpu(CpuPlane::new(
                config.ep_size,
                config.redundant_slots,
                hidden,
                inter,
            )),
            #[cfg(feature = "cuda")]
            DataPlane::Gpu { ordinal } => Plane::Gpu(Box::new(crate::gpu_plane::GpuPlane::open(
                &model, &layout, &config, ordinal,
            )?)),
            #[cfg(not(feature = "cuda"))]
            DataPlane::Gpu { .. } => {
                return Err(EngineError::Gpu(
                    "this build has no GPU data plane (rebuild with `--features cuda`)".into(),
                ))
            }
        };
        Ok(Self {
            model,
            config,
            layout,
            planners,
            plane,
            fabric,
        })
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

    /// Bytes the fabric has moved since the runtime was built.
    pub fn bytes_moved(&self) -> u64 {
        self.fabric.bytes_moved()
    }

    /// A copy of rank `rank`'s redundant slot `slot` (what the last layer streamed there; read
    /// back from the device on the GPU plane).
    pub fn slot_contents(&self, rank: usize, slot: usize) -> Option<Vec<f32>> {
        match &self.plane {
            Plane::Cpu(cpu) => cpu.slot_contents(rank, slot),
            #[cfg(feature = "cuda")]
            Plane::Gpu(gpu) => gpu.slot_contents(rank, slot),
        }
    }

    /// One step: every rank's batch of sequence chunks through every layer. `batches[r]` is rank
    /// `r`'s sequences, each continuing from its own KV cache; `which[r][i]` says which of
    /// sequence `i`'s rows get logits.
    pub fn forward(
        &mut self,
        batches: &mut [Vec<SequenceInput<'_>>],
        which: &[Vec<LogitsFor>],
    ) -> Result<StepOutput> {
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
        if batches.len() != self.config.ep_size {
            return Err(EngineError::Fabric(format!(
                "{} rank batches for EP size {}",
                batches.len(),
                self.config.ep_size
            )));
        }
        let model = Arc::clone(&self.model);
        let layers = model.layers();
        if batches
            .iter()
            .flatten()
            .any(|s| s.cache.layers.len() != layers.len())
        {
            return Err(EngineError::InvalidRequest(
                "KV cache was made for a different model".into(),
            ));
        }
        let mut xs: Vec<Option<Tensor>> = batches
            .iter()
            .map(|batch| {
                let tokens: Vec<u32> = batch
                    .iter()
                    .flat_map(|s| s.tokens.iter().copied())
                    .collect();
                (!tokens.is_empty())
                    .then(|| model.embed(&tokens))
                    .transpose()
            })
            .collect::<Result<_, _>>()?;
        let mut reports = Vec::new();
        for (index, layer) in layers.iter().enumerate() {
            // Data-parallel attention: every rank on its own sequences.
            let hs: Vec<Option<Tensor>> = xs
                .par_iter()
                .zip(batches.par_iter_mut())
                .map(|(x, batch)| {
                    let Some(x) = x else { return Ok(None) };
                    let mut chunks: Vec<SeqChunk<'_>> = batch
                        .iter_mut()
                        .map(|s| SeqChunk {
                            len: s.tokens.len(),
                            cache: &mut s.cache.layers[index],
                        })
                        .collect();
                    layer.attention_residual(x, &mut chunks).map(Some)
                })
                .collect::<Result<_, _>>()?;
            let inputs: Vec<Option<Tensor>> = hs
                .iter()
                .map(|h| h.as_ref().map(|h| layer.ffn_input(h)).transpose())
                .collect::<Result<_, _>>()?;
            let outs = match layer.ffn() {
                FeedForward::Dense(mlp) => inputs
                    .iter()
                    .map(|x| {
                        x.as_ref()
                            .map(|x| candle_core::Module::forward(mlp, x))
                            .transpose()
                    })
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(rackfill_models::ModelError::from)?,
                FeedForward::Moe(block) => {
                    let (outs, report) = self.moe_layer(index, block, &inputs)?;
                    reports.push(report);
                    outs
                }
            };
            xs = hs
                .into_iter()
                .zip(outs)
                .map(|(h, out)| match (h, out) {
                    (Some(h), Some(out)) => Ok(Some((h + out)?)),
                    _ => Ok(None),
                })
                .collect::<Result<_, candle_core::Error>>()
                .map_err(rackfill_models::ModelError::from)?;
        }
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

    /// One MoE layer under EP on every rank's FFN input.
    fn moe_layer(
        &mut self,
        layer: usize,
        block: &MoeBlock,
        inputs: &[Option<Tensor>],
    ) -> Result<(Vec<Option<Tensor>>, LayerReport)> {
        let mut phases = PhaseTimes::default();
        let experts = self.layout.experts();
        let top_k = self.model.config().moe.top_k;
        let hidden = self.model.config().hidden_size;

        // 1. Router on every rank.
        let started = Instant::now();
        let routed: Vec<(Vec<f32>, Routing)> = inputs
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
            .collect::<Result<_, rackfill_models::ModelError>>()?;
        phases.route = started.elapsed();

        // 2. Count exchange; 3. plan on every rank's copy.
        let started = Instant::now();
        let counts: Vec<Vec<u64>> = routed
            .iter()
            .map(|(_, routing)| routing.expert_counts(experts))
            .collect();
        let gathered = self.fabric.all_gather(&counts)?;
        let (plan, load, solve) = self.solve(layer, gathered)?;
        phases.solve = started.elapsed();

        // 4-7. Replicas, token assignment and dispatch, expert compute, combine: on the GPU
        // when one runs the data plane, else on the CPU.
        let inter = self.model.config().moe.intermediate_size;
        let plane = self.run_data_plane(
            layer,
            &LayerWork {
                block,
                plan: &plan,
                routed: &routed,
                hidden,
                inter,
                top_k,
            },
            &mut phases,
        )?;
        let PlaneOutput {
            routed: routed_out,
            recv_bytes,
            replica_bytes,
        } = plane;
        // Shared experts on the source ranks (timed with the combine, as they finish the layer).
        let started = Instant::now();
        let outs = inputs
            .par_iter()
            .zip(routed_out)
            .map(|(x, routed)| match (x, routed) {
                (Some(x), Some(routed)) => Ok(Some(block.add_shared(x, routed)?)),
                _ => Ok(None),
            })
            .collect::<Result<_>>()?;
        phases.combine += started.elapsed();

        let metrics = evaluate(&self.layout, &load, &plan);
        let simulated = self.config.cost.layer(
            flops_per_pair(hidden, inter),
            &metrics.rank_load_after,
            &recv_bytes,
            &metrics.rank_load_before,
            &unbalanced_recv_bytes(&self.layout, &load, hidden),
        );
        let slots = (0..plan.ranks())
            .map(|r| plan.rank_slots(r).to_vec())
            .collect();
        Ok((
            outs,
            LayerReport {
                layer,
                load,
                metrics,
                slots,
                replica_bytes,
                recv_bytes,
                simulated,
                solve_us: solve.as_secs_f64() * 1e6,
                phases,
            },
        ))
    }

    /// Replication, dispatch, expert compute and combine of one layer on the plane in use.
    fn run_data_plane(
        &mut self,
        layer: usize,
        work: &LayerWork<'_>,
        phases: &mut PhaseTimes,
    ) -> Result<PlaneOutput> {
        match &mut self.plane {
            Plane::Cpu(cpu) => cpu.run_layer(&*self.fabric, &self.config.relay, work, phases),
            #[cfg(feature = "cuda")]
            Plane::Gpu(gpu) => gpu_layer(gpu, layer, work, phases),
        }
        .map_err(|err| match err {
            EngineError::Gpu(why) => EngineError::Gpu(format!("layer {layer}: {why}")),
            other => other,
        })
    }

    /// Solves the layer's plan from the gathered load: on the GPU when it runs the data plane
    /// with a quota balancer (the plan stays on the device for the permute), else on the host.
    /// With `verify_plans`, the host planners solve too, one per rank from its own copy, and
    /// every plan must agree.
    fn solve(
        &mut self,
        layer: usize,
        gathered: Vec<Vec<u64>>,
    ) -> Result<(Plan, LoadMatrix, Duration)> {
        #[cfg(feature = "cuda")]
        if let Plane::Gpu(gpu) = &mut self.plane {
            if gpu.solves() {
                let (ranks, experts) = (self.layout.ranks(), self.layout.experts());
                let first = gathered.first().cloned().unwrap_or_default();
                let load = LoadMatrix::from_flat(ranks, experts, first)?;
                let started = Instant::now();
                let plan = gpu.solve(layer, &load)?;
                let took = started.elapsed();
                if self.config.verify_plans {
                    let (host, _, _) = self.solve_on_host(layer, gathered)?;
                    if host != plan {
                        return Err(EngineError::Gpu(format!(
                            "layer {layer}: the GPU solver's plan differs from the host planner's"
                        )));
                    }
                }
                return Ok((plan, load, took));
            }
        }
        self.solve_on_host(layer, gathered)
    }

    /// [`Self::solve`] with the host planners.
    fn solve_on_host(
        &mut self,
        layer: usize,
        gathered: Vec<Vec<u64>>,
    ) -> Result<(Plan, LoadMatrix, Duration)> {
        let (ranks, experts) = (self.layout.ranks(), self.layout.experts());
        let planners = self.planners[layer]
            .as_mut()
            .ok_or_else(|| EngineError::Config(format!("layer {layer} has no planner")))?;
        let mut plan: Option<(Plan, LoadMatrix, Duration)> = None;
        for (rank, (planner, copy)) in planners.iter_mut().zip(gathered).enumerate() {
            let load = LoadMatrix::from_flat(ranks, experts, copy)?;
            let started = Instant::now();
            let mine = planner.plan(&self.layout, &load)?;
            let took = started.elapsed();
            match &plan {
                None => {
                    mine.validate(&self.layout, &load, planner.u_min())
                        .map_err(|violation| EngineError::InvalidPlan { layer, violation })?;
                    plan = Some((mine, load, took));
                }
                Some((first, _, _)) if *first != mine => {
                    return Err(EngineError::Fabric(format!(
                        "layer {layer}: rank {rank} solved a different plan than rank 0"
                    )));
                }
                Some(_) => {}
            }
        }
        plan.ok_or_else(|| EngineError::Config(format!("layer {layer} has no planner")))
    }
}

/// What each rank would receive without balancing: rows for its main experts from other
/// sources (activations and ids), and the outputs of its own pairs computed elsewhere.
fn unbalanced_recv_bytes(layout: &Layout, load: &LoadMatrix, hidden: usize) -> Vec<u64> {
    let row = (hidden * 4) as u64;
    let ids = (IDS_PER_ROW * 4) as u64;
    let mut recv = vec![0u64; layout.ranks()];
    for src in 0..load.ranks() {
        for (e, &pairs) in load.row(src).iter().enumerate() {
            let home = layout.home(e);
            if home != src {
                recv[home] += pairs * (row + ids);
                recv[src] += pairs * row;
            }
        }
    }
    recv
}

/// One layer on the GPU plane, the outputs back as tensors.
#[cfg(feature = "cuda")]
fn gpu_layer(
    gpu: &mut crate::gpu_plane::GpuPlane,
    layer: usize,
    work: &LayerWork<'_>,
    phases: &mut PhaseTimes,
) -> Result<PlaneOutput> {
    use rackfill_kernels::cuda::moe::RankInput;
    let inputs: Vec<RankInput<'_>> = work
        .routed
        .iter()
        .map(|(xs, routing)| RankInput {
            x: xs,
            experts: &routing.experts,
            weights: &routing.weights,
        })
        .collect();
    let run = gpu.run_layer(layer, work.plan, &inputs, work.top_k)?;
    phases.replicate = run.phases.replicate;
    phases.dispatch = run.phases.dispatch;
    phases.experts = run.phases.experts;
    phases.combine = run.phases.combine;
    let routed = run
        .outputs
        .into_iter()
        .map(|rows| {
            let tokens = rows.len() / work.hidden.max(1);
            (!rows.is_empty())
                .then(|| Tensor::from_vec(rows, (tokens, work.hidden), &candle_core::Device::Cpu))
                .transpose()
                .map_err(|e| rackfill_models::ModelError::from(e).into())
        })
        .collect::<Result<_>>()?;
    let recv_bytes = run
        .token_recv_bytes
        .iter()
        .zip(&run.replica_recv_bytes)
        .map(|(tokens, replicas)| tokens + replicas)
        .collect();
    Ok(PlaneOutput {
        routed,
        recv_bytes,
        replica_bytes: run.replica_recv_bytes.iter().sum(),
    })
}
