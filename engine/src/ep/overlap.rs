//! Two micro-batches in flight (`EpConfig::micro_batches` = 2): each rank splits its step's
//! sequences into two micro-batches of about equal tokens, and while one micro-batch
//! communicates (count gather, plan, replica streaming and dispatch; or the combine) the other
//! computes (attention and router; or its experts). It is the schedule of DeepSeek's and SGLang's
//! two-batch overlap, the one `rackfill simulate` costs (`schedule::Schedule::TWO_BATCH`).
//!
//! Each micro-batch has its own exact load, its own plan and its own replica slots
//! ([`crate::plane::MicroPlane`]), so both micro-batches' replicas are resident together and the
//! logits equal the dense path's for every balancer. The fabric is called by one micro-batch at a
//! time, in an order fixed by the model's layers alone, so every process issues the same
//! collectives in the same order whatever its tokens.
//!
//! The step runs in ticks: at tick `t` micro-batch 0 runs its task `t` and micro-batch 1 its
//! task `t - 1`. An MoE layer is four tasks, compute and communication alternating (route, send,
//! experts, combine), so with the one-task lag one micro-batch always computes while the other
//! communicates. A dense layer is one compute task; both micro-batches then compute together.

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Tensor;

use rackfill_balancer::{Balancer, Layout};
use rackfill_models::layers::moe::MoeBlock;
use rackfill_models::{FeedForward, LogitsFor, MoeModel, Routing, SequenceInput};

use super::{
    add_residual, add_shared_ranks, attention_ranks, check_plans_agree, dense_ranks, embed_ranks,
    reuse_resident, route, solve_on_host, EpConfig, EpRuntime, Finished, Solved, StepOutput,
};
use crate::error::{EngineError, Result};
use crate::fabric::Fabric;
use crate::plane::{Computed, LayerWork, MicroPlane, PhaseTimes, PlaneOutput, Sent};

/// One step of one micro-batch, in the order it runs.
#[derive(Debug, Clone, Copy)]
enum Task {
    /// A dense layer: attention, MLP and residual.
    Dense(usize),
    /// An MoE layer's attention, FFN norm and router.
    Route(usize),
    /// Count gather, plan, replica streaming and dispatch.
    Send(usize),
    /// Main and replica experts on the received rows.
    Experts(usize),
    /// Outputs back to their sources, weighted sum, shared experts and residual.
    Combine(usize),
}

impl Task {
    /// Whether the task calls the fabric (only one micro-batch may at a time).
    fn communicates(self) -> bool {
        matches!(self, Task::Send(_) | Task::Combine(_))
    }

    /// Every micro-batch's tasks for `model`, in order.
    fn plan(model: &MoeModel) -> Vec<Task> {
        model
            .layers()
            .iter()
            .enumerate()
            .flat_map(|(index, layer)| match layer.ffn() {
                FeedForward::Dense(_) => vec![Task::Dense(index)],
                FeedForward::Moe(_) => vec![
                    Task::Route(index),
                    Task::Send(index),
                    Task::Experts(index),
                    Task::Combine(index),
                ],
            })
            .collect()
    }
}

/// One micro-batch's share of a step on the local ranks.
#[derive(Default)]
struct MicroBatch<'s, 'a> {
    /// Per local rank: its sequences in this micro-batch.
    seqs: Vec<&'s mut [SequenceInput<'a>]>,
    /// Per local rank: the residual stream (`None` without tokens).
    xs: Vec<Option<Tensor>>,
    /// The MoE layer between its route and its combine.
    in_flight: Option<InFlight>,
    /// Every MoE layer it finished, in layer order.
    finished: Vec<Finished>,
}

/// An MoE layer between its route and its combine.
struct InFlight {
    /// Per local rank: the FFN input (the shared experts' input).
    inputs: Vec<Option<Tensor>>,
    /// Per local rank: the FFN input rows and their routing.
    routed: Vec<(Vec<f32>, Routing)>,
    route_time: Duration,
    solved: Option<(Solved, Duration)>,
    sent: Option<Sent>,
    computed: Option<Computed>,
}

/// What the communicating micro-batch uses besides its own state: the fabric, the planners and
/// the layout (one micro-batch communicates at a time, so they are handed over per tick).
struct Comm<'r> {
    fabric: &'r dyn Fabric,
    planners: &'r mut [Option<Vec<Box<dyn Balancer>>>],
    layout: &'r Layout,
    config: &'r EpConfig,
}

impl EpRuntime {
    /// [`EpRuntime::forward`] with two micro-batches in flight (the module's doc says how).
    pub(super) fn forward_overlapped(
        &mut self,
        batches: &mut [Vec<SequenceInput<'_>>],
        which: &[Vec<LogitsFor>],
    ) -> Result<StepOutput> {
        let model = Arc::clone(&self.model);
        let cuts: Vec<usize> = batches.iter().map(|b| halving_cut(b)).collect();
        let mut micro: Vec<MicroBatch<'_, '_>> = vec![MicroBatch::default(), MicroBatch::default()];
        for (batch, &cut) in batches.iter_mut().zip(&cuts) {
            let (first, second) = batch.split_at_mut(cut);
            micro[0].seqs.push(first);
            micro[1].seqs.push(second);
        }
        for m in &mut micro {
            m.xs = embed_ranks(&model, &m.seqs)?;
        }

        let tasks = Task::plan(&model);
        {
            let EpRuntime {
                planners,
                plane,
                fabric,
                layout,
                config,
                ..
            } = self;
            let mut comm = Comm {
                fabric: &**fabric,
                planners,
                layout,
                config,
            };
            let mut planes = plane.micro_planes();
            let (first_plane, second_plane) = planes.split_at_mut(1);
            let (first, second) = micro.split_at_mut(1);
            let mut sides = [
                (&mut first[0], &mut first_plane[0]),
                (&mut second[0], &mut second_plane[0]),
            ];
            for tick in 0..=tasks.len() {
                let [(m0, p0), (m1, p1)] = &mut sides;
                let t0 = tasks.get(tick).copied();
                let t1 = tick.checked_sub(1).and_then(|t| tasks.get(t)).copied();
                run_tick(&model, &mut comm, (t0, m0, p0), (t1, m1, p1))?;
            }
        }

        // Logits per micro-batch, then each rank's rows in sequence order (micro-batch 0 holds
        // its first sequences).
        let mut logits = Vec::with_capacity(which.len());
        for (rank, which) in which.iter().enumerate() {
            let (w0, w1) = which.split_at(cuts[rank]);
            let mut parts = Vec::new();
            for (m, which) in micro.iter_mut().zip([w0, w1]) {
                let lens: Vec<usize> = m.seqs[rank].iter().map(|s| s.tokens.len()).collect();
                if let Some(x) = m.xs[rank].take() {
                    parts.push(model.logits_for(x, &lens, which)?);
                }
            }
            logits.push(match parts.len() {
                0 => None,
                1 => parts.pop(),
                _ => Some(Tensor::cat(&parts, 0).map_err(rackfill_models::ModelError::from)?),
            });
        }
        let mut finished: Vec<(usize, Finished)> = micro
            .into_iter()
            .enumerate()
            .flat_map(|(index, m)| m.finished.into_iter().map(move |f| (index, f)))
            .collect();
        finished.sort_by_key(|(index, f)| (f.layer, *index));
        let layers = finished
            .into_iter()
            .map(|(index, f)| self.layer_report(f, index))
            .collect();
        Ok(StepOutput { logits, layers })
    }
}

/// The sequence index that splits a rank's sequences into two micro-batches of about equal
/// tokens, each non-empty when there are two sequences or more.
fn halving_cut(batch: &[SequenceInput<'_>]) -> usize {
    let total: usize = batch.iter().map(|s| s.tokens.len()).sum();
    if batch.len() < 2 {
        return batch.len();
    }
    let mut before = 0usize;
    let mut best = (usize::MAX, 1);
    for (cut, s) in batch.iter().enumerate().take(batch.len() - 1) {
        before += s.tokens.len();
        let gap = before.abs_diff(total - before);
        if gap < best.0 {
            best = (gap, cut + 1);
        }
    }
    best.1
}

/// One micro-batch's side of a tick: its task (if any), its state and its share of the plane.
type Side<'t, 's, 'a, 'p> = (
    Option<Task>,
    &'t mut MicroBatch<'s, 'a>,
    &'t mut MicroPlane<'p>,
);

/// Runs micro-batch 0's and micro-batch 1's tasks of one tick: a computing task on its own thread
/// beside the other; two communicating tasks (never planned, but safe) one after the other.
fn run_tick<'t, 's, 'a, 'p>(
    model: &MoeModel,
    comm: &mut Comm<'_>,
    (t0, m0, p0): Side<'t, 's, 'a, 'p>,
    (t1, m1, p1): Side<'t, 's, 'a, 'p>,
) -> Result<()> {
    match (t0, t1) {
        (None, None) => Ok(()),
        (Some(t), None) => run_task(model, comm, t, m0, p0),
        (None, Some(t)) => run_task(model, comm, t, m1, p1),
        (Some(a), Some(b)) if a.communicates() && b.communicates() => {
            run_task(model, comm, a, m0, p0)?;
            run_task(model, comm, b, m1, p1)
        }
        (Some(a), Some(b)) => {
            // The computing side goes to its own thread; the other (communicating, or the second
            // computing one) stays on this one, the only thread that calls the fabric.
            let ((compute, mc, pc), (other, mo, po)) = if a.communicates() {
                ((b, m1, p1), (a, m0, p0))
            } else {
                ((a, m0, p0), (b, m1, p1))
            };
            std::thread::scope(|scope| {
                let computing = scope.spawn(|| compute_task(model, compute, mc, pc));
                let here = run_task(model, comm, other, mo, po);
                let there = computing.join().unwrap_or_else(|_| {
                    Err(EngineError::Config(
                        "a micro-batch's compute panicked".into(),
                    ))
                });
                here.and(there)
            })
        }
    }
}

/// Runs `task` on the calling thread.
fn run_task(
    model: &MoeModel,
    comm: &mut Comm<'_>,
    task: Task,
    micro: &mut MicroBatch<'_, '_>,
    plane: &mut MicroPlane<'_>,
) -> Result<()> {
    match task {
        Task::Send(layer) => send(model, comm, layer, micro, plane),
        Task::Combine(layer) => combine(model, comm.fabric, layer, micro, plane),
        _ => compute_task(model, task, micro, plane),
    }
}

/// Runs a task that does not call the fabric.
fn compute_task(
    model: &MoeModel,
    task: Task,
    micro: &mut MicroBatch<'_, '_>,
    plane: &MicroPlane<'_>,
) -> Result<()> {
    match task {
        Task::Dense(layer) => dense_layer(model, layer, micro),
        Task::Route(layer) => route_layer(model, layer, micro),
        Task::Experts(layer) => experts(model, layer, micro, plane),
        Task::Send(_) | Task::Combine(_) => Err(EngineError::Config(format!(
            "{task:?} communicates and runs on the fabric's thread"
        ))),
    }
}

fn dense_layer(model: &MoeModel, layer: usize, micro: &mut MicroBatch<'_, '_>) -> Result<()> {
    let (hs, inputs) = attention_ranks(model, layer, &micro.xs, &mut micro.seqs)?;
    let FeedForward::Dense(mlp) = model.layers()[layer].ffn() else {
        return Err(EngineError::Config(format!("layer {layer} is not dense")));
    };
    micro.xs = add_residual(hs, dense_ranks(mlp, &inputs)?)?;
    Ok(())
}

/// The MoE block of model layer `layer`.
fn moe_block(model: &MoeModel, layer: usize) -> Result<&MoeBlock> {
    match model.layers()[layer].ffn() {
        FeedForward::Moe(block) => Ok(block),
        FeedForward::Dense(_) => Err(EngineError::Config(format!(
            "layer {layer} is not an MoE layer"
        ))),
    }
}

fn route_layer(model: &MoeModel, layer: usize, micro: &mut MicroBatch<'_, '_>) -> Result<()> {
    let (hs, inputs) = attention_ranks(model, layer, &micro.xs, &mut micro.seqs)?;
    let started = Instant::now();
    let routed = route(moe_block(model, layer)?, &inputs, model.config().moe.top_k)?;
    micro.xs = hs;
    micro.in_flight = Some(InFlight {
        inputs,
        routed,
        route_time: started.elapsed(),
        solved: None,
        sent: None,
        computed: None,
    });
    Ok(())
}

/// The layer in flight, or an error naming the task that found none.
fn in_flight<'m>(micro: &'m mut MicroBatch<'_, '_>, task: &str) -> Result<&'m mut InFlight> {
    micro
        .in_flight
        .as_mut()
        .ok_or_else(|| EngineError::Config(format!("{task} without a routed MoE layer")))
}

/// The layer's work for the data plane, once its plan is known.
fn layer_work<'w>(
    model: &'w MoeModel,
    layer: usize,
    flight: &'w InFlight,
) -> Result<LayerWork<'w>> {
    let mc = model.config();
    let (solved, _) = flight
        .solved
        .as_ref()
        .ok_or_else(|| EngineError::Config(format!("layer {layer} has no plan yet")))?;
    Ok(LayerWork {
        layer,
        block: moe_block(model, layer)?,
        plan: &solved.plan,
        routed: &flight.routed,
        hidden: mc.hidden_size,
        top_k: mc.moe.top_k,
    })
}

/// Count gather, plan (every rank's copy), the plans-agree check, replicas and dispatch.
fn send(
    model: &MoeModel,
    comm: &mut Comm<'_>,
    layer: usize,
    micro: &mut MicroBatch<'_, '_>,
    plane: &mut MicroPlane<'_>,
) -> Result<()> {
    let flight = in_flight(micro, "send")?;
    let started = Instant::now();
    let counts: Vec<Vec<u64>> = flight
        .routed
        .iter()
        .map(|(_, routing)| routing.expert_counts(comm.layout.experts()))
        .collect();
    let gathered = comm.fabric.all_gather(&counts)?;
    let load = rackfill_balancer::LoadMatrix::from_rows(&gathered)?;
    let planners = comm.planners[layer]
        .as_mut()
        .ok_or_else(|| EngineError::Config(format!("layer {layer} has no planner")))?;
    let mut solved = solve_on_host(
        planners,
        comm.layout,
        comm.fabric.local_ranks(),
        layer,
        &load,
    )?;
    solved.plan = reuse_resident(
        comm.config,
        comm.layout,
        &load,
        solved.plan,
        plane.resident(layer),
    );
    check_plans_agree(comm.fabric, layer, &solved.plan)?;
    flight.solved = Some((solved, started.elapsed()));
    let sent = plane.send(comm.fabric, &layer_work(model, layer, flight)?)?;
    flight.sent = Some(sent);
    Ok(())
}

fn experts(
    model: &MoeModel,
    layer: usize,
    micro: &mut MicroBatch<'_, '_>,
    plane: &MicroPlane<'_>,
) -> Result<()> {
    let flight = in_flight(micro, "experts")?;
    let sent = flight
        .sent
        .take()
        .ok_or_else(|| EngineError::Config(format!("layer {layer}'s experts before its send")))?;
    let computed = plane.compute(&layer_work(model, layer, flight)?, sent)?;
    flight.computed = Some(computed);
    Ok(())
}

/// The combine, the shared experts and the residual; the layer is then finished.
fn combine(
    model: &MoeModel,
    fabric: &dyn Fabric,
    layer: usize,
    micro: &mut MicroBatch<'_, '_>,
    plane: &mut MicroPlane<'_>,
) -> Result<()> {
    let mut flight = micro
        .in_flight
        .take()
        .ok_or_else(|| EngineError::Config("combine without a routed MoE layer".into()))?;
    let computed = flight.computed.take().ok_or_else(|| {
        EngineError::Config(format!("layer {layer}'s combine before its experts"))
    })?;
    let PlaneOutput {
        routed,
        recv_bytes,
        replica_bytes,
        phases,
    } = plane.combine(fabric, &layer_work(model, layer, &flight)?, computed)?;
    let started = Instant::now();
    let outs = add_shared_ranks(moe_block(model, layer)?, &flight.inputs, routed)?;
    let shared_time = started.elapsed();
    micro.xs = add_residual(std::mem::take(&mut micro.xs), outs)?;
    let (solved, solve_time) = flight
        .solved
        .ok_or_else(|| EngineError::Config(format!("layer {layer} has no plan")))?;
    micro.finished.push(Finished {
        layer,
        solved,
        bytes: (replica_bytes, recv_bytes),
        phases: PhaseTimes {
            route: flight.route_time,
            solve: solve_time,
            combine: phases.combine + shared_time,
            ..phases
        },
    });
    Ok(())
}
