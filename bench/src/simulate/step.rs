//! Costing steps: every balancer plans every simulated layer on the step's routing (the real
//! planners, validated), and the plan is costed term by term beside the force-balanced ideal.

use super::cost::{Segment, Terms};
use super::error::SimError;
use super::spec::SimSpec;
use super::trace::even_load;
use rackfill_balancer::metrics::imbalance;
use rackfill_balancer::{main_rank_loads, Algo, Balancer, Layout, LoadMatrix, Plan, Settings};
use rackfill_engine::cost::ReplicaTraffic;
use std::time::Instant;

/// The balancers of one algorithm: one planner per simulated layer, and the slots each layer's
/// last plan filled (for history-based planners, whose replicas stay resident between steps).
struct AlgoState {
    algo: Algo,
    planners: Vec<Box<dyn Balancer>>,
    previous_slots: Vec<Option<Vec<Option<u32>>>>,
}

/// What one algorithm cost in one step.
#[derive(Debug, Clone, Copy, Default)]
pub struct AlgoStep {
    pub terms: Terms,
    /// Means over the simulated layers.
    pub imbalance_before: f64,
    pub imbalance_after: f64,
    pub replicas: f64,
    pub max_fanout: f64,
    /// Replica bytes the busiest rank sends or receives, MB (1e6 bytes).
    pub replica_mb: f64,
    pub solve_us: f64,
}

/// Steps a set of balancers through routing, costing each step (one planner per simulated layer
/// and balancer, the ideal beside them).
pub struct StepCoster<'a> {
    spec: &'a SimSpec,
    /// Load matrices every step brings (one planner per layer and algorithm).
    layers: usize,
    layout: Layout,
    states: Vec<AlgoState>,
    step: usize,
}

/// History-based planners keep a placement for many steps; deployments keep those replicas
/// resident per layer and copy only what changes. Exact-load planners re-plan every layer and
/// stream into shared slots (UltraEP §4.1).
fn keeps_replicas(algo: Algo) -> bool {
    algo == Algo::EplbHistory
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
                planners: (0..layers).map(|_| algo.build(&spec.settings)).collect(),
                previous_slots: vec![None; layers],
            })
            .collect();
        Ok(Self {
            spec,
            layers,
            layout,
            states,
            step: 0,
        })
    }

    /// The force-balanced ideal of a step in which rank `r` prefills `batch[r]`.
    pub fn ideal(&self, batch: &[Vec<Segment>]) -> Terms {
        let cost = self.spec.cost();
        let tokens: Vec<u64> = batch
            .iter()
            .map(|s| s.iter().map(|x| x.tokens).sum())
            .collect();
        let even = even_load(&tokens, self.spec.shape.experts, self.spec.shape.top_k);
        let plan = Plan::main_only(&self.layout, &even.expert_totals());
        let per_layer = cost.moe_layer(&even, &plan, &ReplicaTraffic::default(), 0);
        cost.step_dense_terms(batch) + per_layer.scaled(self.spec.shape.moe_layers() as f64)
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
        if loads.len() != self.layers {
            return Err(SimError::Input(format!(
                "a step brought {} load matrices for {} simulated layers",
                loads.len(),
                self.layers
            )));
        }
        let dense = self.spec.cost().step_dense_terms(batch);
        let scale = self.spec.shape.moe_layers() as f64 / loads.len() as f64;
        let step = self.step;
        self.step += 1;
        let mut states = std::mem::take(&mut self.states);
        let out = states
            .iter_mut()
            .map(|state| {
                if step == 0 {
                    warm_up(state.algo, &self.spec.settings, &self.layout, loads);
                }
                let mut acc = AlgoStep::default();
                for (l, load) in loads.iter().enumerate() {
                    acc.add_layer(&self.cost_layer(state, step, l, load)?, loads.len() as f64);
                }
                acc.terms = dense + acc.terms.scaled(scale);
                Ok(acc)
            })
            .collect();
        self.states = states;
        out
    }

    /// Plans, validates and costs simulated layer `l` of step `step` for one balancer.
    fn cost_layer(
        &self,
        state: &mut AlgoState,
        step: usize,
        l: usize,
        load: &LoadMatrix,
    ) -> Result<LayerCost, SimError> {
        let spec = self.spec;
        let fail = |message: String| SimError::Plan {
            balancer: state.algo.name().into(),
            step,
            layer: l,
            message,
        };
        let planner = &mut state.planners[l];
        let started = Instant::now();
        let plan = planner
            .plan(&self.layout, load)
            .map_err(|e| fail(e.to_string()))?;
        let measured_us = started.elapsed().as_secs_f64() * 1e6;
        plan.validate(&self.layout, load, planner.u_min())
            .map_err(|e| fail(e.to_string()))?;
        let bytes = spec.shape.moe_dims().expert_bytes();
        // A history balancer re-plans every few steps and keeps its placement between re-plans:
        // only a step whose placement changed pays its solve and its reloads.
        let (traffic, replanned) = if keeps_replicas(state.algo) {
            let previous = state.previous_slots[l].as_deref();
            let replanned = previous != Some(plan.slots());
            let traffic = ReplicaTraffic::new_replicas(&self.layout, &plan, previous, bytes);
            state.previous_slots[l] = Some(plan.slots().to_vec());
            (traffic, replanned)
        } else {
            (ReplicaTraffic::planned(&plan, bytes, &spec.relay), true)
        };
        let solve_us = match state.algo {
            Algo::None => 0.0,
            _ if !replanned => 0.0,
            _ => spec.solve_us.unwrap_or(measured_us),
        };
        let busiest = traffic.send.iter().chain(&traffic.recv).copied().max();
        let moe = spec
            .cost()
            .moe_layer(load, &plan, &traffic, spec.relay.chunk_bytes);
        Ok(LayerCost {
            terms: Terms {
                solve: solve_us * 1e-3,
                ..moe
            },
            replica_bytes: busiest.unwrap_or(0),
            imbalance_before: imbalance(&main_rank_loads(&self.layout, &load.expert_totals())),
            imbalance_after: imbalance(&plan.rank_loads()),
            replicas: plan.replicas(),
            max_fanout: plan.max_fanout(),
            solve_us,
        })
    }
}

/// What one balancer's plan of one simulated layer cost.
struct LayerCost {
    terms: Terms,
    /// Replica bytes the busiest rank sends or receives.
    replica_bytes: u64,
    imbalance_before: f64,
    imbalance_after: f64,
    replicas: usize,
    max_fanout: usize,
    solve_us: f64,
}

impl AlgoStep {
    /// Adds one of a step's `layers` simulated layers (the figures are means over them).
    fn add_layer(&mut self, layer: &LayerCost, layers: f64) {
        self.terms += layer.terms;
        self.replica_mb += layer.replica_bytes as f64 / 1e6 / layers;
        self.imbalance_before += layer.imbalance_before / layers;
        self.imbalance_after += layer.imbalance_after / layers;
        self.replicas += layer.replicas as f64 / layers;
        self.max_fanout += layer.max_fanout as f64 / layers;
        self.solve_us += layer.solve_us / layers;
    }
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
