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

use candle_core::{Device, Tensor};
use rayon::prelude::*;

use rackfill_balancer::metrics::{evaluate, PlanMetrics};
use rackfill_balancer::relay::{plan_transfers, RelayConfig};
use rackfill_balancer::{Algo, Balancer, Layout, LoadMatrix, Plan, Settings};
use rackfill_kernels::{
    combine, group_by_instance, permute_tokens, scatter_pairs, DispatchBuffers, InstanceRouter,
    KernelError,
};
use rackfill_models::layers::gated_mlp_rows;
use rackfill_models::layers::moe::{rows_of, MoeBlock};
use rackfill_models::{FeedForward, LogitsFor, MoeModel, Routing, SeqChunk, SequenceInput};

use crate::cost::{flops_per_pair, CostModel, SimulatedMakespan};
use crate::error::{EngineError, Result};
use crate::fabric::{Fabric, LocalFabric, Message, ReplicaBuffers};

/// Per-row metadata in dispatch messages: pair index, expert, instance.
const IDS_PER_ROW: usize = 3;

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
    /// solves, so tests turn it on).
    pub verify_plans: bool,
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
    /// Per rank: `n_slot` slots of `expert_floats` f32s, reused by every layer.
    slots: Vec<Vec<f32>>,
    /// Floats of one expert: `[H, 2I]` gate-up then `[I, H]` down.
    expert_floats: usize,
    gate_up_floats: usize,
    fabric: Box<dyn Fabric>,
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
        let gate_up_floats = hidden * 2 * inter;
        let expert_floats = gate_up_floats + inter * hidden;
        let slots = (0..config.ep_size)
            .map(|_| vec![0f32; config.redundant_slots * expert_floats])
            .collect();
        Ok(Self {
            model,
            config,
            layout,
            planners,
            slots,
            expert_floats,
            gate_up_floats,
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

    /// The contents of rank `rank`'s redundant slot `slot` (what the last layer streamed there).
    pub fn slot_contents(&self, rank: usize, slot: usize) -> Option<&[f32]> {
        let start = slot.checked_mul(self.expert_floats)?;
        self.slots
            .get(rank)?
            .get(start..start.checked_add(self.expert_floats)?)
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

        // 4. Replica weights into the slot buffers.
        let started = Instant::now();
        let replica_recv = self.stream_replicas(block, &plan)?;
        let replica_bytes = replica_recv.iter().sum();
        phases.replicate = started.elapsed();

        // 5. Token assignment by cumulative quotas, and dispatch.
        let started = Instant::now();
        let router = InstanceRouter::new(&plan);
        let permuted: Vec<Vec<DispatchBuffers>> = routed
            .par_iter()
            .enumerate()
            .map(|(rank, (xs, routing))| {
                permute_tokens(rank, xs, hidden, top_k, &routing.experts, &router)
            })
            .collect::<Result<_, KernelError>>()?;
        // A source keeps which pairs it sent where; the rows travel with (pair, expert, instance).
        let mut sent_pairs: Vec<Vec<Vec<u32>>> = Vec::with_capacity(permuted.len());
        let mut send: Vec<Vec<Message>> = Vec::with_capacity(permuted.len());
        for buffers in permuted {
            sent_pairs.push(buffers.iter().map(|b| b.pairs.clone()).collect());
            send.push(buffers.into_iter().map(to_message).collect());
        }
        let received = self.fabric.all_to_all_v(send)?;
        let mut recv_bytes = remote_bytes(&received);
        phases.dispatch = started.elapsed();

        // 6. Grouped expert compute on every rank, main and replica instances.
        let started = Instant::now();
        let slots = SlotView {
            slots: &self.slots,
            expert_floats: self.expert_floats,
            gate_up_floats: self.gate_up_floats,
        };
        let inter = self.model.config().moe.intermediate_size;
        let replies: Vec<Vec<Message>> = received
            .into_par_iter()
            .enumerate()
            .map(|(rank, messages)| {
                let received: Vec<DispatchBuffers> =
                    messages.into_iter().map(from_message).collect();
                let batches = group_by_instance(rank, &received, hidden, &router)?;
                let outputs: Vec<Vec<f32>> = batches
                    .groups()
                    .par_iter()
                    .map(|group| {
                        let weights = slots.instance_weights(
                            block,
                            &plan,
                            rank,
                            group.expert,
                            group.instance,
                        )?;
                        let input = batches.block(group).unwrap_or_default();
                        Ok(gated_mlp_rows(
                            weights,
                            hidden,
                            inter,
                            input,
                            group.rows.len(),
                        ))
                    })
                    .collect::<Result<_>>()?;
                let back = batches.return_outputs(&outputs.concat())?;
                Ok(back
                    .into_iter()
                    .map(|rows| Message {
                        rows,
                        ids: Vec::new(),
                    })
                    .collect())
            })
            .collect::<Result<_>>()?;
        phases.experts = started.elapsed();

        // 7. Combine back on the source ranks, weighted sum in top-k order, shared experts.
        let started = Instant::now();
        let returned = self.fabric.all_to_all_v(replies)?;
        for ((total, combined), replica) in recv_bytes
            .iter_mut()
            .zip(remote_bytes(&returned))
            .zip(replica_recv)
        {
            *total += combined + replica;
        }
        let outs = inputs
            .par_iter()
            .zip(routed.par_iter())
            .zip(returned.par_iter().zip(sent_pairs.par_iter()))
            .map(|((x, (_, routing)), (messages, pairs))| {
                let Some(x) = x else { return Ok(None) };
                let tokens = routing.num_tokens();
                let mut pair_outputs = vec![0f32; routing.experts.len() * hidden];
                for (message, pairs) in messages.iter().zip(pairs) {
                    scatter_pairs(&mut pair_outputs, hidden, pairs, &message.rows)?;
                }
                let acc = combine(&pair_outputs, &routing.weights, tokens, top_k, hidden)?;
                let routed = Tensor::from_vec(acc, (tokens, hidden), &Device::Cpu)
                    .map_err(rackfill_models::ModelError::from)?;
                Ok(Some(block.add_shared(x, routed)?))
            })
            .collect::<Result<_>>()?;
        phases.combine = started.elapsed();

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

    /// Solves the layer's plan from the gathered load. With `verify_plans`, every rank solves
    /// from its own copy and the plans must agree.
    fn solve(
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

    /// Streams every replica's weights from its home expert into its slot; returns the bytes
    /// each rank received.
    fn stream_replicas(&mut self, block: &MoeBlock, plan: &Plan) -> Result<Vec<u64>> {
        if plan.replicas() == 0 {
            return Ok(vec![0; plan.ranks()]);
        }
        let expert_bytes = (self.expert_floats * 4) as u64;
        let schedule = plan_transfers(plan, expert_bytes, &self.config.relay);
        let source = |e: u32| -> Vec<&[u8]> {
            block.experts[e as usize]
                .weights()
                .iter()
                .map(|w| f32_bytes(w))
                .collect()
        };
        let slot_bytes = self.expert_floats * 4;
        let slots: Vec<&mut [u8]> = self.slots.iter_mut().map(|s| f32_bytes_mut(s)).collect();
        let stats = self.fabric.stream_replicas(
            plan,
            &schedule,
            ReplicaBuffers {
                source: &source,
                slots,
                slot_bytes,
                expert_bytes: slot_bytes,
            },
        )?;
        Ok(stats.received_bytes)
    }
}

/// The redundant-slot buffers of every rank, as expert compute reads them.
struct SlotView<'a> {
    slots: &'a [Vec<f32>],
    expert_floats: usize,
    gate_up_floats: usize,
}

impl SlotView<'_> {
    /// The weights of `expert`'s `instance` as held by `rank`: the main expert on its home rank,
    /// or the redundant slot the plan streamed it into.
    fn instance_weights<'b>(
        &'b self,
        block: &'b MoeBlock,
        plan: &Plan,
        rank: usize,
        expert: u32,
        instance: u32,
    ) -> Result<[&'b [f32]; 2]> {
        let on = plan
            .instances(expert as usize)
            .get(instance as usize)
            .map(|i| i.rank as usize);
        if on != Some(rank) {
            return Err(EngineError::Fabric(format!(
                "rank {rank} received tokens for instance {instance} of expert {expert}, which lives on {on:?}"
            )));
        }
        if instance == 0 {
            return Ok(block.experts[expert as usize].weights());
        }
        let slot = plan
            .rank_slots(rank)
            .iter()
            .position(|&s| s == Some(expert))
            .ok_or_else(|| {
                EngineError::Fabric(format!("rank {rank} has no slot for expert {expert}"))
            })?;
        let floats = &self.slots[rank][slot * self.expert_floats..(slot + 1) * self.expert_floats];
        let (gate_up, down) = floats.split_at(self.gate_up_floats);
        Ok([gate_up, down])
    }
}

/// Per receiving rank: bytes of the messages that came from other ranks (`recv[dst][src]`).
fn remote_bytes(recv: &[Vec<Message>]) -> Vec<u64> {
    recv.iter()
        .enumerate()
        .map(|(dst, row)| {
            row.iter()
                .enumerate()
                .filter(|&(src, _)| src != dst)
                .map(|(_, m)| m.bytes())
                .sum()
        })
        .collect()
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

/// Dispatch rows on the wire: the activations, and (pair, expert, instance) per row.
fn to_message(buffers: DispatchBuffers) -> Message {
    let mut ids = Vec::with_capacity(buffers.len() * IDS_PER_ROW);
    for ((&p, &e), &i) in buffers
        .pairs
        .iter()
        .zip(&buffers.experts)
        .zip(&buffers.instances)
    {
        ids.extend_from_slice(&[p, e, i]);
    }
    Message {
        rows: buffers.rows,
        ids,
    }
}

/// The receiving side of [`to_message`].
fn from_message(message: Message) -> DispatchBuffers {
    let column = |c: usize| -> Vec<u32> {
        message
            .ids
            .chunks_exact(IDS_PER_ROW)
            .map(|ids| ids[c])
            .collect()
    };
    DispatchBuffers {
        pairs: column(0),
        experts: column(1),
        instances: column(2),
        rows: message.rows,
    }
}

/// The bytes of an f32 slice (what the fabric moves).
fn f32_bytes(xs: &[f32]) -> &[u8] {
    bytemuck::cast_slice(xs)
}

/// The bytes of a mutable f32 slice.
fn f32_bytes_mut(xs: &mut [f32]) -> &mut [u8] {
    bytemuck::cast_slice_mut(xs)
}
