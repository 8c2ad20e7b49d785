//! One step of the EP runtime: the one layer loop, whatever the backend (the model and data
//! plane on the host or on a device) and the schedule (one or two micro-batches, pipelined
//! experts or not).
//!
//! Every micro-batch runs the same tasks in order, fixed by the model's layers alone: a dense
//! layer is one compute task; an MoE layer is four, compute and communication alternating:
//! `Route` (attention, FFN norm, router, the load counted), `Send` (count gather, plan, replica
//! streaming and dispatch), `Experts` (main and replica experts) and `Combine` (outputs back,
//! weighted sum, shared experts, residual). With one micro-batch the tasks run back to back.
//! With two (DeepSeek's and SGLang's two-batch overlap, `Schedule::TWO_BATCH` in the cost
//! model), each rank splits its sequences into two micro-batches of about equal tokens and the
//! step runs in ticks: at tick `t` micro-batch 0 runs its task `t` and micro-batch 1 its task
//! `t - 1`, so one micro-batch computes while the other communicates. Each micro-batch has its
//! own exact load, plan and replica slots (its lane of the data plane), so both micro-batches'
//! replicas are resident together and the logits equal the dense path's for every balancer. The
//! fabric is called by one micro-batch at a time, in an order fixed by the layers, so every
//! process issues the same collectives in the same order whatever its tokens.

use std::time::{Duration, Instant};

use candle_core::Tensor;
#[cfg(feature = "cuda")]
use rackfill_balancer::LoadMatrix;
use rackfill_models::{LogitsFor, SequenceInput};

use super::backend::{Backend, Lane, ModelRef};
#[cfg(feature = "cuda")]
use super::device::{DeviceFlight, DeviceMicro};
use super::host::{self, HostFlight, HostMicro};
use super::planning::{Comm, Finished, PlaneSide, Solved};
use crate::error::{EngineError, Result};

/// One step of one micro-batch, in the order it runs.
#[derive(Debug, Clone, Copy)]
enum Task {
    /// A dense layer: attention, MLP and residual.
    Dense(usize),
    /// An MoE layer's attention, FFN norm, router and load counts.
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

    /// Every micro-batch's tasks for a model whose MoE layers `sparse` marks, in order.
    fn plan(sparse: &[bool]) -> Vec<Task> {
        sparse
            .iter()
            .enumerate()
            .flat_map(|(index, &moe)| {
                if moe {
                    vec![
                        Task::Route(index),
                        Task::Send(index),
                        Task::Experts(index),
                        Task::Combine(index),
                    ]
                } else {
                    vec![Task::Dense(index)]
                }
            })
            .collect()
    }
}

/// A micro-batch's rows where the model runs.
enum Rows {
    Host(HostMicro),
    #[cfg(feature = "cuda")]
    Device(Box<DeviceMicro>),
}

/// One micro-batch's share of a step on the local ranks.
struct MicroBatch<'s, 'a> {
    /// Per local rank: its sequences in this micro-batch.
    seqs: Vec<&'s mut [SequenceInput<'a>]>,
    rows: Option<Rows>,
    /// The MoE layer between its route and its combine.
    in_flight: Option<InFlight>,
    /// Every MoE layer it finished, in layer order.
    finished: Vec<Finished>,
    /// Per finished layer: the device events that time its phases.
    #[cfg(feature = "cuda")]
    timings: Vec<Option<rackfill_kernels::cuda::moe::LayerTiming>>,
}

/// An MoE layer between its route and its combine.
struct InFlight {
    /// Per local rank: its expert counts.
    counts: Vec<Vec<u64>>,
    route_time: Duration,
    solved: Option<(Solved, Duration)>,
    work: Flight,
}

/// A layer's state on its backend.
enum Flight {
    Host(Box<HostFlight>),
    #[cfg(feature = "cuda")]
    Device(Box<DeviceFlight>),
}

/// A step's result: per local rank its logits, and every finished MoE layer with its
/// micro-batch.
type StepResult = (Vec<Option<Tensor>>, Vec<(usize, Finished)>);

/// Runs one step of `batches` (per local rank) on `backend`; returns per local rank its logits
/// and every finished MoE layer with its micro-batch, ordered by layer then micro-batch.
pub(super) fn run(
    backend: &mut Backend,
    mut comm: Comm<'_>,
    batches: &mut [Vec<SequenceInput<'_>>],
    which: &[Vec<LogitsFor>],
) -> Result<StepResult> {
    let schedule = comm.config.schedule;
    let pipelined_here = schedule.pipelined_experts && schedule.micro_batches == 1;
    let (model, mut lanes) = backend.split();
    let cuts: Vec<usize> = batches
        .iter()
        .map(|b| {
            if schedule.micro_batches > 1 {
                halving_cut(b)
            } else {
                b.len()
            }
        })
        .collect();
    let mut micro: Vec<MicroBatch<'_, '_>> = (0..schedule.micro_batches)
        .map(|_| MicroBatch {
            seqs: Vec::new(),
            rows: None,
            in_flight: None,
            finished: Vec::new(),
            #[cfg(feature = "cuda")]
            timings: Vec::new(),
        })
        .collect();
    for (batch, &cut) in batches.iter_mut().zip(&cuts) {
        let (first, second) = batch.split_at_mut(cut);
        micro[0].seqs.push(first);
        if let Some(m) = micro.get_mut(1) {
            m.seqs.push(second);
        }
    }
    let parts = |m: usize| -> Vec<&[LogitsFor]> {
        which
            .iter()
            .zip(&cuts)
            .map(|(w, &cut)| if m == 0 { &w[..cut] } else { &w[cut..] })
            .collect()
    };
    for (index, m) in micro.iter_mut().enumerate() {
        m.rows = Some(begin(model, &mut m.seqs, &parts(index))?);
    }
    let tasks = Task::plan(&sparse_layers(model));
    if lanes.len() < micro.len() {
        return Err(EngineError::Config(format!(
            "{} micro-batches on a data plane of {} lanes",
            micro.len(),
            lanes.len()
        )));
    }
    if micro.len() == 1 {
        for &task in &tasks {
            run_task(
                model,
                &mut comm,
                task,
                &mut micro[0],
                &mut lanes[0],
                pipelined_here,
            )?;
        }
    } else {
        let (first, second) = micro.split_at_mut(1);
        let (lane0, lane1) = lanes.split_at_mut(1);
        for tick in 0..=tasks.len() {
            let t0 = tasks.get(tick).copied();
            let t1 = tick.checked_sub(1).and_then(|t| tasks.get(t)).copied();
            run_tick(
                model,
                &mut comm,
                (t0, &mut first[0], &mut lane0[0]),
                (t1, &mut second[0], &mut lane1[0]),
            )?;
        }
    }
    drop(lanes);

    // Logits per micro-batch, then each rank's rows in sequence order (micro-batch 0 holds its
    // first sequences).
    let mut per_micro = Vec::with_capacity(micro.len());
    for (index, m) in micro.iter_mut().enumerate() {
        let rows = m
            .rows
            .take()
            .ok_or_else(|| EngineError::Config("a micro-batch lost its rows".into()))?;
        per_micro.push(logits(model, rows, &m.seqs, &parts(index))?);
    }
    let mut logits = Vec::with_capacity(cuts.len());
    for rank in 0..cuts.len() {
        let mut pieces: Vec<Tensor> = per_micro
            .iter_mut()
            .filter_map(|m| m[rank].take())
            .collect();
        logits.push(match pieces.len() {
            0 => None,
            1 => pieces.pop(),
            _ => Some(Tensor::cat(&pieces, 0).map_err(rackfill_models::ModelError::from)?),
        });
    }
    let mut finished: Vec<(usize, Finished)> = Vec::new();
    for (index, m) in micro.into_iter().enumerate() {
        #[cfg(feature = "cuda")]
        let mut m = m;
        #[cfg(feature = "cuda")]
        resolve_timings(model, &mut m)?;
        finished.extend(m.finished.into_iter().map(|f| (index, f)));
    }
    finished.sort_by_key(|(index, f)| (f.layer, *index));
    Ok((logits, finished))
}

/// Which layers are MoE layers, as the model says.
fn sparse_layers(model: ModelRef<'_>) -> Vec<bool> {
    match model {
        ModelRef::Host(model) => model.config().sparse_layers.clone(),
        #[cfg(feature = "cuda")]
        ModelRef::Device(device) => device.model.config().sparse_layers.clone(),
    }
}

/// A micro-batch's rows at the start of a step.
fn begin(
    model: ModelRef<'_>,
    seqs: &mut [&mut [SequenceInput<'_>]],
    which: &[&[LogitsFor]],
) -> Result<Rows> {
    match model {
        ModelRef::Host(model) => {
            let _ = which;
            Ok(Rows::Host(host::begin(model, seqs)?))
        }
        #[cfg(feature = "cuda")]
        ModelRef::Device(device) => Ok(Rows::Device(Box::new(device.begin(seqs, which)?))),
    }
}

/// A micro-batch's logits at the end of a step.
fn logits(
    model: ModelRef<'_>,
    rows: Rows,
    seqs: &[&mut [SequenceInput<'_>]],
    which: &[&[LogitsFor]],
) -> Result<Vec<Option<Tensor>>> {
    match (model, rows) {
        (ModelRef::Host(model), Rows::Host(rows)) => host::logits(model, rows, seqs, which),
        #[cfg(feature = "cuda")]
        (ModelRef::Device(device), Rows::Device(rows)) => device.logits(*rows),
        #[cfg(feature = "cuda")]
        _ => Err(other_backend()),
    }
}

/// The device phases of every finished layer of `micro`, now that the step's work has run.
#[cfg(feature = "cuda")]
fn resolve_timings(model: ModelRef<'_>, micro: &mut MicroBatch<'_, '_>) -> Result<()> {
    let ModelRef::Device(device) = model else {
        return Ok(());
    };
    for (finished, timing) in micro.finished.iter_mut().zip(&micro.timings) {
        if let Some(timing) = timing {
            finished.phases = device.phases(timing, finished.phases)?;
        }
    }
    Ok(())
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

/// One micro-batch's side of a tick: its task (if any), its state and its lane.
type Side<'t, 's, 'a, 'p> = (Option<Task>, &'t mut MicroBatch<'s, 'a>, &'t mut Lane<'p>);

/// Runs micro-batch 0's and micro-batch 1's tasks of one tick: a computing task on its own thread
/// beside the other; two communicating tasks (never planned, but safe) one after the other.
fn run_tick<'t, 's, 'a, 'p>(
    model: ModelRef<'_>,
    comm: &mut Comm<'_>,
    (t0, m0, p0): Side<'t, 's, 'a, 'p>,
    (t1, m1, p1): Side<'t, 's, 'a, 'p>,
) -> Result<()> {
    match (t0, t1) {
        (None, None) => Ok(()),
        (Some(t), None) => run_task(model, comm, t, m0, p0, false),
        (None, Some(t)) => run_task(model, comm, t, m1, p1, false),
        (Some(a), Some(b)) if a.communicates() && b.communicates() => {
            run_task(model, comm, a, m0, p0, false)?;
            run_task(model, comm, b, m1, p1, false)
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
                let here = run_task(model, comm, other, mo, po, false);
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

/// Runs `task` on the calling thread, the one that may call the fabric; `pipelined`: a host
/// layer's replicas stream under its main experts.
fn run_task(
    model: ModelRef<'_>,
    comm: &mut Comm<'_>,
    task: Task,
    micro: &mut MicroBatch<'_, '_>,
    lane: &mut Lane<'_>,
    pipelined: bool,
) -> Result<()> {
    match task {
        Task::Send(layer) => send(model, comm, layer, micro, lane, pipelined),
        Task::Combine(layer) => combine(model, comm, layer, micro, lane),
        Task::Experts(layer) => experts(model, Some(comm), layer, micro, lane, pipelined),
        _ => compute_task(model, task, micro, lane),
    }
}

/// Runs a task that does not call the fabric.
fn compute_task(
    model: ModelRef<'_>,
    task: Task,
    micro: &mut MicroBatch<'_, '_>,
    lane: &mut Lane<'_>,
) -> Result<()> {
    match task {
        Task::Dense(layer) => dense_layer(model, layer, micro),
        Task::Route(layer) => route_layer(model, layer, micro, lane),
        Task::Experts(layer) => experts(model, None, layer, micro, lane, false),
        Task::Send(_) | Task::Combine(_) => Err(EngineError::Config(format!(
            "{task:?} communicates and runs on the fabric's thread"
        ))),
    }
}

/// The micro-batch's rows, or an error when the step lost them (a bug, not a user's error).
fn rows_of(rows: &mut Option<Rows>) -> Result<&mut Rows> {
    rows.as_mut()
        .ok_or_else(|| EngineError::Config("a micro-batch lost its rows".into()))
}

fn dense_layer(model: ModelRef<'_>, layer: usize, micro: &mut MicroBatch<'_, '_>) -> Result<()> {
    match (model, rows_of(&mut micro.rows)?) {
        (ModelRef::Host(model), Rows::Host(rows)) => {
            host::dense_layer(model, layer, rows, &mut micro.seqs)
        }
        #[cfg(feature = "cuda")]
        (ModelRef::Device(device), Rows::Device(rows)) => device.dense_layer(layer, rows),
        #[cfg(feature = "cuda")]
        _ => Err(other_backend()),
    }
}

fn route_layer(
    model: ModelRef<'_>,
    layer: usize,
    micro: &mut MicroBatch<'_, '_>,
    lane: &mut Lane<'_>,
) -> Result<()> {
    let started = Instant::now();
    let (work, counts) = match (model, rows_of(&mut micro.rows)?, lane) {
        (ModelRef::Host(model), Rows::Host(rows), Lane::Host(_)) => {
            let (flight, counts) = host::route_layer(model, layer, rows, &mut micro.seqs)?;
            (Flight::Host(Box::new(flight)), counts)
        }
        #[cfg(feature = "cuda")]
        (ModelRef::Device(device), Rows::Device(rows), Lane::Device(lane)) => {
            let (flight, counts) = device.route_layer(lane, layer, rows)?;
            (Flight::Device(Box::new(flight)), counts)
        }
        #[cfg(feature = "cuda")]
        _ => return Err(other_backend()),
    };
    micro.in_flight = Some(InFlight {
        counts,
        route_time: started.elapsed(),
        solved: None,
        work,
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

/// The layer's plan (gathered counts, solved on the device or the host, moved onto resident
/// replicas, agreed), then replicas and dispatch.
fn send(
    model: ModelRef<'_>,
    comm: &mut Comm<'_>,
    layer: usize,
    micro: &mut MicroBatch<'_, '_>,
    lane: &mut Lane<'_>,
    pipelined: bool,
) -> Result<()> {
    let flight = in_flight(micro, "send")?;
    let started = Instant::now();
    let solved = match (model, &mut *lane) {
        (ModelRef::Host(_), Lane::Host(plane)) => {
            let resident = plane.resident(layer).map(<[_]>::to_vec);
            comm.plan_layer(
                layer,
                &flight.counts,
                PlaneSide {
                    device_solve: None,
                    resident,
                },
            )?
        }
        #[cfg(feature = "cuda")]
        (ModelRef::Device(device), Lane::Device(lane)) => {
            let resident = device.resident(lane, layer);
            let lane: &mut rackfill_kernels::cuda::moe::MoeLane = lane;
            let on_device = lane.has_solver();
            let mut solve = |load: &LoadMatrix| {
                device
                    .solve(lane, layer, load)?
                    .ok_or_else(|| EngineError::Config(format!("layer {layer}: no device solver")))
            };
            comm.plan_layer(
                layer,
                &flight.counts,
                PlaneSide {
                    device_solve: if on_device { Some(&mut solve) } else { None },
                    resident,
                },
            )?
        }
        #[cfg(feature = "cuda")]
        _ => return Err(other_backend()),
    };
    let plan_time = started.elapsed();
    let fabric = comm.fabric;
    match (model, lane, &mut flight.work) {
        (ModelRef::Host(model), Lane::Host(plane), Flight::Host(work)) => host::send(
            (model, plane, fabric),
            (layer, &solved.plan),
            work,
            pipelined,
        )?,
        #[cfg(feature = "cuda")]
        (ModelRef::Device(device), Lane::Device(lane), Flight::Device(work)) => {
            device.send((lane, fabric), (layer, &solved.plan, &solved.load), work)?
        }
        #[cfg(feature = "cuda")]
        _ => return Err(other_backend()),
    }
    flight.solved = Some((solved, plan_time));
    Ok(())
}

fn experts(
    model: ModelRef<'_>,
    comm: Option<&mut Comm<'_>>,
    layer: usize,
    micro: &mut MicroBatch<'_, '_>,
    lane: &mut Lane<'_>,
    pipelined: bool,
) -> Result<()> {
    let flight = in_flight(micro, "experts")?;
    let (solved, _) = flight
        .solved
        .as_ref()
        .ok_or_else(|| EngineError::Config(format!("layer {layer} has no plan yet")))?;
    match (model, lane, &mut flight.work) {
        (ModelRef::Host(model), Lane::Host(plane), Flight::Host(work)) => {
            let fabric = comm.map(|c| c.fabric);
            host::experts(
                (model, plane, fabric),
                (layer, &solved.plan),
                work,
                pipelined,
            )
        }
        #[cfg(feature = "cuda")]
        (ModelRef::Device(device), Lane::Device(lane), Flight::Device(work)) => {
            let _ = (comm, pipelined);
            device.experts(lane, layer, work)
        }
        #[cfg(feature = "cuda")]
        _ => Err(other_backend()),
    }
}

/// The combine, the shared experts and the residual; the layer is then finished.
fn combine(
    model: ModelRef<'_>,
    comm: &mut Comm<'_>,
    layer: usize,
    micro: &mut MicroBatch<'_, '_>,
    lane: &mut Lane<'_>,
) -> Result<()> {
    let InFlight {
        route_time,
        solved,
        work,
        ..
    } = micro
        .in_flight
        .take()
        .ok_or_else(|| EngineError::Config("combine without a routed MoE layer".into()))?;
    let solved = solved.ok_or_else(|| EngineError::Config(format!("layer {layer} has no plan")))?;
    let fabric = comm.fabric;
    let (bytes, phases) = match (model, rows_of(&mut micro.rows)?, lane, work) {
        (ModelRef::Host(model), Rows::Host(rows), Lane::Host(plane), Flight::Host(work)) => {
            #[cfg(feature = "cuda")]
            micro.timings.push(None);
            host::combine((model, plane, fabric), (layer, &solved.0.plan), *work, rows)?
        }
        #[cfg(feature = "cuda")]
        (
            ModelRef::Device(device),
            Rows::Device(rows),
            Lane::Device(lane),
            Flight::Device(work),
        ) => {
            let (bytes, timing) = device.combine((lane, fabric), layer, *work, rows)?;
            micro.timings.push(Some(timing));
            (bytes, crate::plane::PhaseTimes::default())
        }
        #[cfg(feature = "cuda")]
        _ => return Err(other_backend()),
    };
    micro
        .finished
        .push(Finished::new(layer, solved, route_time, bytes, phases));
    Ok(())
}

/// A stage handed state another backend made (a bug in the caller, not a user's error).
#[cfg(feature = "cuda")]
fn other_backend() -> EngineError {
    EngineError::Config("a step's state went to another backend than made it".into())
}
