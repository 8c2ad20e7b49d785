//! Costing steps: every balancer plans every simulated layer on the step's routing (the real
//! planners, validated), once on the whole step and once per micro-batch of its two-way split,
//! and each plan is costed phase by phase; the step's time is the makespan of those phases under
//! every schedule of [`Schedule::ALL`] (`rackfill_engine::rack_cost::step_schedule`), beside
//! the force-balanced ideal under the same schedule.

use super::cost::{Segment, Terms};
use super::error::SimError;
use super::spec::SimSpec;
use super::trace::{even_load, thin_rows};
use crate::parallel::map_dynamic;
use rackfill_balancer::metrics::imbalance;
use rackfill_balancer::reuse::{moves_replicas_of, prefer_resident};
use rackfill_balancer::{main_rank_loads, Algo, Balancer, Layout, LoadMatrix, Plan, Settings};
use rackfill_engine::rack_cost::{
    makespan, LayerPhases, MoeCost, ReplicaTraffic, Schedule, SlotMemory,
};
use rand::rngs::StdRng;
use rand::SeedableRng;
use std::borrow::Cow;
use std::time::Instant;

/// Planner slots of one simulated layer: the whole step, then the two micro-batches.
const PLAN_SLOTS: usize = 3;

/// The balancers of one algorithm, per simulated layer.
struct AlgoState {
    algo: Algo,
    layers: Vec<LayerPlanners>,
}

/// One simulated layer's planners, one per planner slot (the whole step, micro-batch 0,
/// micro-batch 1: each micro-batch has its own plan and replicas), and the slots each one's
/// last plan filled (for history-based planners, whose replicas stay resident). Layers plan
/// independently, so they are planned in parallel.
struct LayerPlanners {
    planners: Vec<Box<dyn Balancer>>,
    previous_slots: Vec<Option<Vec<Option<u32>>>>,
}

/// One step under one schedule of [`Schedule::ALL`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ScheduledStep {
    /// Work of each term (every micro-batch's phases summed), ms.
    pub terms: Terms,
    /// The step's makespan under the schedule, ms.
    pub step_ms: f64,
    /// Mean over the simulated layers of the replica MB the busiest rank sends or receives, both
    /// micro-batches' replicas together.
    pub replica_mb: f64,
}

/// What one algorithm cost in one step.
#[derive(Debug, Clone, Copy, Default)]
pub struct AlgoStep {
    /// Per schedule of [`Schedule::ALL`].
    pub schedules: [ScheduledStep; 4],
    /// Means over the simulated layers (and micro-batches) of the spec's schedule.
    pub imbalance_before: f64,
    pub imbalance_after: f64,
    pub replicas: f64,
    pub max_fanout: f64,
    pub solve_us: f64,
}

/// The ideal's step under every schedule of [`Schedule::ALL`].
#[derive(Debug, Clone, Copy, Default)]
pub struct IdealStep {
    pub schedules: [ScheduledStep; 4],
}

/// Steps a set of balancers through routing, costing each step (one planner per simulated layer,
/// planner slot and balancer, the ideal beside them).
pub struct StepCoster<'a> {
    spec: &'a SimSpec,
    /// Cost every schedule of [`Schedule::ALL`] (the throughput report's ablation), or only
    /// the spec's (request mode: the other micro-batch count is never planned).
    ablation: bool,
    /// Load matrices every step brings (one planner per layer and algorithm).
    layers: usize,
    layout: Layout,
    states: Vec<AlgoState>,
    step: usize,
}

/// History-based planners keep a placement for many steps; deployments keep those replicas
/// resident per layer and copy only what changes. Exact-load planners re-plan every layer and
/// stream into shared slots (UltraEP §4.1), unless each layer keeps its own slots
/// ([`SlotMemory::PerLayer`]): then a replica still resident from the layer's last plan is
/// reused.
fn keeps_replicas(algo: Algo, memory: SlotMemory) -> bool {
    algo == Algo::EplbHistory || memory == SlotMemory::PerLayer
}

/// A step cut into `n` micro-batches (1 or 2): per micro-batch, each rank's segments and the
/// load of every simulated layer (the caller's, or cut here).
struct MicroBatches<'l> {
    batches: Vec<Vec<Vec<Segment>>>,
    loads: Vec<Cow<'l, [LoadMatrix]>>,
}

impl<'a> StepCoster<'a> {
    /// A coster for `algos` (any subset of the spec's; none for an ideal-only timeline) over the
    /// spec's `sim_layers` layers.
    pub fn new(spec: &'a SimSpec, algos: &[Algo]) -> Result<Self, SimError> {
        Self::with_layers(spec, algos, spec.sim_layers)
    }

    /// A coster whose steps bring `layers` load matrices (a recorded trace's own layers).
    pub fn with_layers(spec: &'a SimSpec, algos: &[Algo], layers: usize) -> Result<Self, SimError> {
        spec.validate()?;
        spec.check_step_size(layers)?;
        let layout = Layout::contiguous(spec.ep, spec.shape.experts, spec.slots)
            .map_err(|e| SimError::Input(e.to_string()))?;
        let states = algos
            .iter()
            .map(|&algo| AlgoState {
                algo,
                layers: (0..layers)
                    .map(|_| LayerPlanners {
                        planners: (0..PLAN_SLOTS)
                            .map(|_| algo.build(&spec.settings))
                            .collect(),
                        previous_slots: vec![None; PLAN_SLOTS],
                    })
                    .collect(),
            })
            .collect();
        Ok(Self {
            spec,
            layers,
            layout,
            states,
            step: 0,
            ablation: true,
        })
    }

    /// A coster of the spec's schedule only ([`AlgoStep::schedules`] of the other micro-batch
    /// count stay zero): half to a third of the planning, for runs that report one schedule.
    pub fn chosen_schedule_only(spec: &'a SimSpec, algos: &[Algo]) -> Result<Self, SimError> {
        let mut coster = Self::new(spec, algos)?;
        coster.ablation = false;
        Ok(coster)
    }

    /// The force-balanced ideal of a step in which rank `r` prefills `batch[r]`, under every
    /// schedule: even routing per micro-batch, main experts only, no solve, no replicas.
    pub fn ideal(&self, batch: &[Vec<Segment>]) -> IdealStep {
        let cost = self.spec.cost();
        let variants = [1, 2].map(|n| {
            let batches = split_batch(batch, n);
            let phases: Vec<Vec<LayerPhases>> = batches
                .iter()
                .map(|b| {
                    let tokens: Vec<u64> =
                        b.iter().map(|s| s.iter().map(|x| x.tokens).sum()).collect();
                    let even = even_load(&tokens, self.spec.shape.experts, self.spec.shape.top_k);
                    let plan = Plan::main_only(&self.layout, &even.expert_totals());
                    let dense = self.dense_phases(b);
                    let none = ReplicaTraffic::default();
                    vec![
                        moe_phases(&cost.moe(), &even, &plan, &none, 0, dense[0]),
                        dense[1],
                    ]
                })
                .collect();
            phases
        });
        let mut ideal = IdealStep::default();
        for (out, schedule) in ideal.schedules.iter_mut().zip(Schedule::ALL) {
            let per_micro = &variants[schedule.micro_batches - 1];
            // Every MoE layer alike: one simulated layer standing for all of them.
            let moe = vec![per_micro.iter().map(|p| p[0]).collect()];
            let dense = per_micro.iter().map(|p| p[1]).collect();
            let layers = self.overlap_slowdown(&schedule, self.model_layers(moe, dense));
            *out = ScheduledStep {
                terms: work(&layers),
                step_ms: makespan(&schedule, &layers),
                replica_mb: 0.0,
            };
        }
        ideal
    }

    /// Rank-level imbalance of the ideal's routing: 1 unless the experts do not divide evenly
    /// over the ranks (256 experts on 72 ranks put 4 on some ranks and 3 on others).
    pub fn ideal_imbalance(&self, batch: &[Vec<Segment>]) -> f64 {
        let tokens: Vec<u64> = batch
            .iter()
            .map(|s| s.iter().map(|x| x.tokens).sum())
            .collect();
        let even = even_load(&tokens, self.spec.shape.experts, self.spec.shape.top_k);
        imbalance(&main_rank_loads(&self.layout, &even.expert_totals()))
    }

    /// Costs one step for every algorithm: `batch[r]` is what rank `r` prefills, `loads[l]` the
    /// routing of simulated layer `l`.
    pub fn step(
        &mut self,
        batch: &[Vec<Segment>],
        loads: &[LoadMatrix],
    ) -> Result<Vec<AlgoStep>, SimError> {
        self.step_split(batch, loads, None)
    }

    /// [`StepCoster::step`] with the routing of the two micro-batches given (`halves[m][l]`:
    /// micro-batch `m`, layer `l`, drawn for the token halves of [`split_batch`]) instead of cut
    /// from `loads` here.
    pub fn step_split(
        &mut self,
        batch: &[Vec<Segment>],
        loads: &[LoadMatrix],
        halves: Option<&[Vec<LoadMatrix>; 2]>,
    ) -> Result<Vec<AlgoStep>, SimError> {
        if loads.len() != self.layers {
            return Err(SimError::Input(format!(
                "a step brought {} load matrices for {} simulated layers",
                loads.len(),
                self.layers
            )));
        }
        let step = self.step;
        self.step += 1;
        let chosen_micro = self.spec.schedule.micro_batches;
        // Per micro-batch count (1, 2): whether this run costs it.
        let needed = [1, 2].map(|n| self.ablation || n == chosen_micro);
        let split = [
            MicroBatches {
                batches: vec![batch.to_vec()],
                loads: vec![Cow::Borrowed(loads)],
            },
            if let (true, Some([a, b])) = (needed[1], halves) {
                MicroBatches {
                    batches: split_batch(batch, 2),
                    loads: vec![Cow::Borrowed(a.as_slice()), Cow::Borrowed(b.as_slice())],
                }
            } else if needed[1] {
                self.split_loads(batch, loads, step)
            } else {
                MicroBatches {
                    batches: Vec::new(),
                    loads: Vec::new(),
                }
            },
        ];
        let dense: Vec<Vec<[LayerPhases; 2]>> = split
            .iter()
            .map(|mb| mb.batches.iter().map(|b| self.dense_phases(b)).collect())
            .collect();
        let mut states = std::mem::take(&mut self.states);
        let out = states
            .iter_mut()
            .map(|state| {
                if step == 0 {
                    warm_up(state.algo, &self.spec.settings, &self.layout, loads);
                }
                // Per micro-batch count: [layer][micro-batch] costs.
                let costed = self.cost_layers(state, step, &split, needed, &dense)?;
                let mut result = AlgoStep::default();
                for (out, schedule) in result.schedules.iter_mut().zip(Schedule::ALL) {
                    let n = schedule.micro_batches - 1;
                    if !needed[n] {
                        continue;
                    }
                    let moe: Vec<Vec<LayerPhases>> = costed[n]
                        .iter()
                        .map(|per_micro| per_micro.iter().map(|c| c.phases).collect())
                        .collect();
                    let dense_layer = dense[n].iter().map(|d| d[1]).collect();
                    let layers =
                        self.overlap_slowdown(&schedule, self.model_layers(moe, dense_layer));
                    let replica_mb: f64 = costed[n]
                        .iter()
                        .map(|per_micro| {
                            per_micro
                                .iter()
                                .map(|c| c.replica_bytes as f64)
                                .sum::<f64>()
                        })
                        .sum::<f64>()
                        / 1e6
                        / self.layers as f64;
                    *out = ScheduledStep {
                        terms: work(&layers),
                        step_ms: makespan(&schedule, &layers),
                        replica_mb,
                    };
                }
                let stats = &costed[chosen_micro - 1];
                let count = (self.layers * chosen_micro) as f64;
                for c in stats.iter().flatten() {
                    result.imbalance_before += c.imbalance_before / count;
                    result.imbalance_after += c.imbalance_after / count;
                    result.replicas += c.replicas as f64 / self.layers as f64;
                    result.max_fanout += c.max_fanout as f64 / count;
                    result.solve_us += c.solve_us / self.layers as f64;
                }
                Ok(result)
            })
            .collect();
        self.states = states;
        out
    }

    /// Plans and costs every simulated layer for each micro-batch count this run costs
    /// (`split[n]`: `n + 1` micro-batches; planner slot 0 for the whole step, slots 1 and 2 for
    /// the two halves), the layers spread over `spec.threads` threads. Returns
    /// `[n][layer][micro-batch]`, empty for a count not `needed`.
    fn cost_layers(
        &self,
        state: &mut AlgoState,
        step: usize,
        split: &[MicroBatches; 2],
        needed: [bool; 2],
        dense: &[Vec<[LayerPhases; 2]>],
    ) -> Result<[Vec<Vec<LayerCost>>; 2], SimError> {
        let planning = Planning {
            spec: self.spec,
            layout: &self.layout,
            algo: state.algo,
            step,
        };
        let cost_one = |(l, planners): (usize, &mut LayerPlanners)| {
            let mut per_count = [Vec::new(), Vec::new()];
            for (n, costs) in per_count.iter_mut().enumerate().filter(|&(n, _)| needed[n]) {
                // Micro-batch m of n + 1: its loads and its batch's dense phases.
                for (m, (loads, dense)) in split[n].loads.iter().zip(&dense[n]).enumerate() {
                    let slot = if n == 0 { 0 } else { 1 + m };
                    costs.push(planning.cost_layer(planners, slot, l, &loads[l], dense[0])?);
                }
            }
            Ok(per_count)
        };
        let threads = self.spec.threads.max(1);
        let layers = map_dynamic(state.layers.iter_mut().enumerate(), threads, cost_one);
        let mut costed = [
            Vec::with_capacity(self.layers),
            Vec::with_capacity(self.layers),
        ];
        for layer in layers {
            let [one, two] = layer?;
            costed[0].push(one);
            costed[1].push(two);
        }
        for (costs, needed) in costed.iter_mut().zip(needed) {
            if !needed {
                costs.clear();
            }
        }
        Ok(costed)
    }

    /// The step cut in two micro-batches: each rank's tokens halved (the first half's segments,
    /// then the rest attending to them), each layer's routing split by drawing the first half's
    /// pairs from the rank's row (seeded by step and layer, so every balancer sees the same
    /// split) and leaving the rest to the second.
    fn split_loads(
        &self,
        batch: &[Vec<Segment>],
        loads: &[LoadMatrix],
        step: usize,
    ) -> MicroBatches<'static> {
        let batches = split_batch(batch, 2);
        let full: Vec<u64> = batch
            .iter()
            .map(|s| s.iter().map(|x| x.tokens).sum())
            .collect();
        let first: Vec<u64> = batches[0]
            .iter()
            .map(|s| s.iter().map(|x| x.tokens).sum())
            .collect();
        let k = self.spec.shape.top_k;
        let mut halves = [
            Vec::with_capacity(loads.len()),
            Vec::with_capacity(loads.len()),
        ];
        for (l, load) in loads.iter().enumerate() {
            let seed = self.spec.seed ^ (step as u64) << 20 ^ l as u64;
            let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            // Every row is thinned to its first half of tokens (`thin_rows` keeps rows whose
            // quota reaches their tokens whole, so the largest row sets `full`).
            let most = full.iter().copied().max().unwrap_or(0) + 1;
            let a = thin_rows(load, most, &first, k, &mut rng);
            let rest: Vec<u64> = load
                .as_flat()
                .iter()
                .zip(a.as_flat())
                .map(|(all, first)| all - first)
                .collect();
            let b = LoadMatrix::from_flat(load.ranks(), load.experts(), rest)
                .expect("the rest of a row is bounded by the row");
            halves[0].push(a);
            halves[1].push(b);
        }
        MicroBatches {
            batches,
            loads: halves.map(Cow::Owned).into(),
        }
    }

    /// The phases every layer of a micro-batch shares, on its busiest rank: `[0]` an MoE layer's
    /// attention (with the router) and shared experts, `[1]` a dense layer's attention and MLP.
    fn dense_phases(&self, batch: &[Vec<Segment>]) -> [LayerPhases; 2] {
        let cost = self.spec.cost();
        let shape = &self.spec.shape;
        let busiest =
            |f: &dyn Fn(&[Segment]) -> f64| batch.iter().map(|s| f(s)).fold(0.0, f64::max);
        let tokens = |s: &[Segment]| s.iter().map(|x| x.tokens).sum::<u64>();
        [
            LayerPhases {
                attention: busiest(&|s| cost.rank_attention_ms(s, true)),
                dense_ffn: busiest(&|s| cost.dense_mlp_ms(tokens(s), shape.shared_intermediate)),
                ..LayerPhases::default()
            },
            LayerPhases {
                attention: busiest(&|s| cost.rank_attention_ms(s, false)),
                dense_ffn: busiest(&|s| cost.dense_mlp_ms(tokens(s), shape.dense_intermediate)),
                ..LayerPhases::default()
            },
        ]
    }

    /// The model's layers in order for the schedule: its dense layers first, then each MoE layer
    /// as the simulated layer standing for it (`moe[j][m]`: simulated layer `j`, micro-batch
    /// `m`); `dense[m]` a dense layer of micro-batch `m`.
    fn model_layers(
        &self,
        moe: Vec<Vec<LayerPhases>>,
        dense: Vec<LayerPhases>,
    ) -> Vec<Vec<LayerPhases>> {
        let shape = &self.spec.shape;
        let moe_layers = shape.moe_layers();
        let mut layers = vec![dense; shape.dense_layers];
        layers.extend((0..moe_layers).map(|i| moe[i * moe.len() / moe_layers].clone()));
        layers
    }

    /// With two micro-batches communication kernels run beside compute and hold some of the SMs:
    /// compute phases take `1 / overlap_compute_efficiency` as long (the rack's figure).
    fn overlap_slowdown(
        &self,
        schedule: &Schedule,
        mut layers: Vec<Vec<LayerPhases>>,
    ) -> Vec<Vec<LayerPhases>> {
        if schedule.micro_batches > 1 {
            let slow = 1.0 / self.spec.rack.overlap_compute_efficiency;
            for p in layers.iter_mut().flatten() {
                p.attention *= slow;
                p.dense_ffn *= slow;
                p.expert_main *= slow;
                p.expert_replica *= slow;
            }
        }
        layers
    }
}

/// What planning one algorithm's layers in one step needs (shared by the planning threads).
struct Planning<'a> {
    spec: &'a SimSpec,
    layout: &'a Layout,
    algo: Algo,
    step: usize,
}

impl Planning<'_> {
    /// Plans, validates and costs simulated layer `l` of step `step` for one balancer with the
    /// planner of `slot`, on top of the micro-batch's `dense` phases (quota plans moved onto
    /// resident replicas first, with per-layer slots and a reuse tolerance).
    fn cost_layer(
        &self,
        state: &mut LayerPlanners,
        slot: usize,
        l: usize,
        load: &LoadMatrix,
        dense: LayerPhases,
    ) -> Result<LayerCost, SimError> {
        let (spec, algo, step) = (self.spec, self.algo, self.step);
        let fail = |message: String| SimError::Plan {
            balancer: algo.name().into(),
            step,
            layer: l,
            message,
        };
        let planner = &mut state.planners[slot];
        let started = Instant::now();
        let mut plan = planner
            .plan(self.layout, load)
            .map_err(|e| fail(e.to_string()))?;
        let previous = state.previous_slots[slot].as_deref();
        if let (Some(tolerance), Some(resident)) = (self.spec.resident_preference(), previous) {
            if moves_replicas_of(algo) {
                plan = prefer_resident(self.layout, load, &plan, resident, tolerance);
            }
        }
        let measured_us = started.elapsed().as_secs_f64() * 1e6;
        plan.validate(self.layout, load, planner.u_min())
            .map_err(|e| fail(e.to_string()))?;
        let bytes = spec.shape.moe_dims().expert_bytes();
        // A history balancer re-plans every few steps and keeps its placement between re-plans:
        // only a step whose placement changed pays its solve and its reloads.
        let (traffic, replanned) = if keeps_replicas(algo, spec.slot_memory) {
            // Exact-load planners solve every layer of every step whatever stays resident.
            let replanned = algo != Algo::EplbHistory || previous != Some(plan.slots());
            let traffic = if algo == Algo::EplbHistory {
                ReplicaTraffic::new_replicas(self.layout, &plan, previous, bytes)
            } else {
                // New replicas go directly from their home, or the whole plan over its relay
                // trees when that loads the busiest rank less (the engine's rule).
                let nothing = vec![None; plan.slots().len()];
                ReplicaTraffic::reused(&plan, previous.unwrap_or(&nothing), bytes, &spec.relay)
            };
            state.previous_slots[slot] = Some(plan.slots().to_vec());
            (traffic, replanned)
        } else {
            (ReplicaTraffic::planned(&plan, bytes, &spec.relay), true)
        };
        let solve_us = match algo {
            Algo::None => 0.0,
            _ if !replanned => 0.0,
            _ => spec.solve_us.unwrap_or(measured_us),
        };
        let busiest = busiest_bytes(&traffic);
        let cost = spec.cost();
        let chunk = spec.relay.chunk_bytes;
        let phases = moe_phases(&cost.moe(), load, &plan, &traffic, chunk, dense);
        Ok(LayerCost {
            phases: LayerPhases {
                solve: solve_us * 1e-3,
                ..phases
            },
            replica_bytes: busiest,
            imbalance_before: imbalance(&main_rank_loads(self.layout, &load.expert_totals())),
            imbalance_after: imbalance(&plan.rank_loads()),
            replicas: plan.replicas(),
            max_fanout: plan.max_fanout(),
            solve_us,
        })
    }
}

/// What one balancer's plan of one simulated layer and micro-batch cost.
struct LayerCost {
    phases: LayerPhases,
    /// Replica bytes the busiest rank sends or receives.
    replica_bytes: u64,
    imbalance_before: f64,
    imbalance_after: f64,
    replicas: usize,
    max_fanout: usize,
    solve_us: f64,
}

/// The MoE phases of one layer under `plan` (its replicas moving as `traffic` says, in chunks
/// of `chunk_bytes`) on top of the layer's `dense` phases; no solve.
fn moe_phases(
    moe: &MoeCost,
    load: &LoadMatrix,
    plan: &Plan,
    traffic: &ReplicaTraffic,
    chunk_bytes: u64,
    dense: LayerPhases,
) -> LayerPhases {
    let (main, expert) = moe.expert_split_ms(plan);
    let dispatch = moe.dispatch_ms(load, plan);
    LayerPhases {
        replicate: moe.replicate_ms(traffic, chunk_bytes),
        dispatch,
        expert_main: main,
        expert_replica: expert - main,
        // Combine moves the dispatched pairs back.
        combine: dispatch,
        ..dense
    }
}

/// Replica bytes the busiest rank sends or receives.
fn busiest_bytes(traffic: &ReplicaTraffic) -> u64 {
    traffic
        .send
        .iter()
        .chain(&traffic.recv)
        .copied()
        .max()
        .unwrap_or(0)
}

/// Every phase of `layers` summed per term (the work, whatever overlaps).
fn work(layers: &[Vec<LayerPhases>]) -> Terms {
    let mut t = Terms::default();
    for p in layers.iter().flatten() {
        t += Terms {
            attention: p.attention,
            dense_ffn: p.dense_ffn,
            solve: p.solve,
            replicate: p.replicate,
            dispatch: p.dispatch,
            expert: p.expert_main + p.expert_replica,
            combine: p.combine,
        };
    }
    t
}

/// Each rank's segments cut into `n` micro-batches (1 or 2) of about equal tokens: the first
/// takes the first half of the rank's tokens in order, the second the rest, its segments
/// attending to the first's tokens of the same request as context.
fn split_batch(batch: &[Vec<Segment>], n: usize) -> Vec<Vec<Vec<Segment>>> {
    if n == 1 {
        return vec![batch.to_vec()];
    }
    let mut first = Vec::with_capacity(batch.len());
    let mut second = Vec::with_capacity(batch.len());
    for segments in batch {
        let total: u64 = segments.iter().map(|s| s.tokens).sum();
        let mut left = total / 2;
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for s in segments {
            let take = s.tokens.min(left);
            left -= take;
            if take > 0 {
                a.push(Segment {
                    tokens: take,
                    context: s.context,
                });
            }
            if s.tokens > take {
                b.push(Segment {
                    tokens: s.tokens - take,
                    context: s.context + take,
                });
            }
        }
        first.push(a);
        second.push(b);
    }
    vec![first, second]
}

/// Plans the first step once with a throwaway planner, untimed, so the measured solve of step 0
/// is not a cold start (first-touch allocations, cold caches) that a serving engine pays once,
/// not per layer. A throwaway instance keeps history planners' windows clean.
fn warm_up(algo: Algo, settings: &Settings, layout: &Layout, loads: &[LoadMatrix]) {
    let mut planner = algo.build(settings);
    for load in loads {
        // A failing plan is reported by the timed call that follows.
        let _ = planner.plan(layout, load);
    }
}
