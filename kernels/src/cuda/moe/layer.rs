//! One MoE layer on a [`MoeLane`], in stages the engine interleaves with other work (the other
//! micro-batch's, in a two-batch step):
//!
//! 1. [`MoeLane::count`]: each local rank's pairs ranked among their expert's, which counts them
//!    too: the `ranks x E` load matrix is the one host copy before the plan;
//! 2. [`MoeLane::solve`] (quota balancers): the plan solved on the device, the replication
//!    queued right behind it from the plan where the solver left it, and the host's copy of the
//!    plan downloaded on a side stream while the replicas stream;
//! 3. [`MoeLane::send`]: the replication (unless the solve queued it), then token assignment by
//!    cumulative quota on every local source and the dispatch into each destination's receive
//!    buffer (device copies between ranks here, host buffers and the group's transport to
//!    ranks elsewhere). With pipelined experts it does not wait for the replicas;
//! 4. [`MoeLane::experts`]: per destination, rows grouped by instance, main instances' GEMMs
//!    first, then each replica's behind a wait for its own slot's landed bytes;
//! 5. [`MoeLane::combine`]: outputs back into each source's send layout, their router-weighted
//!    sum in top-k order added into the block's output, the replication checked.
//!
//! The rows each instance receives follow from the plan's split and the gathered counts
//! ([`Routes`]), so every copy and GEMM is sized on the host without reading anything back.

use std::time::Duration;

use rackfill_balancer::{LoadMatrix, Plan, PlanViolation};

use super::super::exec::{DeviceBuffer, Event, Executor, ExecutorExt, Stream};
use super::super::{CudaError, DevicePlan};
use super::plane::{MoeLane, Replication, SolvedOnDevice, Streamed};
use super::remote::HostExchange;
use super::routes::{check, Routes};
use super::steps::{GroupWork, Received, Sent, Source, Steps};
use crate::KernelError;

/// One MoE layer's routed rows of a batch on the device, every local rank's rows one after
/// another, as the model's router leaves them. A layer owns them from [`MoeLane::send`] until
/// [`MoeLane::combine`] hands them back with the routed experts' sum added into `output`.
pub struct RoutedRows {
    /// bf16 `[rows, H]`: the normalised FFN inputs.
    pub x: DeviceBuffer,
    /// u32 `[rows, top_k]`: expert ids.
    pub experts: DeviceBuffer,
    /// f32 `[rows, top_k]`: router weights.
    pub weights: DeviceBuffer,
    /// f32 `[rows, H]`: where the routed sum is added (holding the shared experts' output).
    pub output: DeviceBuffer,
    /// Rows of each local rank, in rank order (they sum to `rows`).
    pub rank_rows: Vec<usize>,
    pub top_k: usize,
    /// The stream that wrote them, which reads `output` after the combine.
    pub stream: Stream,
}

impl RoutedRows {
    /// Each local rank's range of pairs (token-major, `top_k` per row), in rank order.
    fn rank_pairs(&self) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
        let k = self.top_k;
        self.rank_rows.iter().scan(0, move |start, &rows| {
            let range = *start * k..(*start + rows) * k;
            *start += rows;
            Some(range)
        })
    }
}

/// What [`MoeLane::count`] found: the local ranks' rows of the load matrix, and each pair's rank
/// among its expert's pairs on its source (kept on the device for the dispatch).
pub struct Counted {
    /// `[local rank][expert]`: pairs.
    pub counts: Vec<Vec<u64>>,
    /// Per local rank: u32 `[rows_r * top_k]` (`None` without rows).
    occurrence: Vec<Option<DeviceBuffer>>,
}

/// A layer between its stages: everything the next stage reads, on the device.
pub struct LayerInFlight {
    pub(super) layer: usize,
    pub(super) plan: Plan,
    /// The plan the permute and grouping read: the solver's (`None`) or this one, uploaded.
    pub(super) uploaded: Option<DevicePlan>,
    pub(super) routes: Routes,
    pub(super) replication: Replication,
    pub(super) rows: RoutedRows,
    pub(super) occurrence: Vec<Option<DeviceBuffer>>,
    /// Per local source: its send layout.
    pub(super) sent: Vec<Option<Sent>>,
    /// Per local destination: what it received.
    pub(super) received: Vec<Option<Received>>,
    /// Per local destination: its outputs in received order, once the experts ran.
    pub(super) computed: Vec<Option<DeviceBuffer>>,
    pub(super) dispatch: (Event, Event),
    pub(super) experts: Option<(Event, Event)>,
    /// The ready-flag epoch of a layer whose rows cross processes through peer memory.
    pub(super) epoch: Option<u32>,
}

/// What one layer moved, and the events that time its phases on the device.
pub struct LayerRun {
    /// Per local rank: token bytes received from other ranks (dispatched bf16 rows with their
    /// expert and instance ids, then the f32 outputs of the rows it sent away).
    pub token_recv_bytes: Vec<u64>,
    /// Per local rank: replica weight bytes received.
    pub replica_recv_bytes: Vec<u64>,
    pub timing: LayerTiming,
}

/// Events around each phase of a layer; [`LayerTiming::resolve`] reads the device times once the
/// step's work has run (reading them earlier would wait for it).
pub struct LayerTiming {
    replicate: (Event, Event),
    dispatch: (Event, Event),
    experts: (Event, Event),
    combine: (Event, Event),
}

/// Device time of each phase of a layer.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LayerPhases {
    pub replicate: Duration,
    pub dispatch: Duration,
    pub experts: Duration,
    pub combine: Duration,
}

impl LayerTiming {
    /// The phases' device times (waits for the layer's work).
    pub fn resolve(&self, exec: &dyn Executor) -> Result<LayerPhases, CudaError> {
        let time = |(a, b): &(Event, Event)| exec.elapsed(a, b);
        Ok(LayerPhases {
            replicate: time(&self.replicate)?,
            dispatch: time(&self.dispatch)?,
            experts: time(&self.experts)?,
            combine: time(&self.combine)?,
        })
    }
}

impl MoeLane {
    /// The layer's plan in device memory: the uploaded host plan, else the one the device
    /// solver left.
    fn device_plan<'a>(
        &'a self,
        uploaded: Option<&'a DevicePlan>,
    ) -> Result<&'a DevicePlan, CudaError> {
        match uploaded {
            Some(plan) => Ok(plan),
            None => Ok(self
                .solver
                .as_ref()
                .ok_or(KernelError::ZeroDimension {
                    what: "device solver",
                })?
                .device_plan()),
        }
    }

    pub(super) fn steps(&self) -> Steps<'_> {
        Steps {
            exec: self.shared.exec.as_ref(),
            stream: self.main,
            hidden: self.shared.hidden,
            inter: self.shared.inter,
            experts: self.shared.layout.experts(),
        }
    }

    fn check_rows(&self, rows: &RoutedRows) -> Result<(), CudaError> {
        let shared = &self.shared;
        if rows.rank_rows.len() != shared.local.len() {
            return Err(KernelError::RankCount {
                got: rows.rank_rows.len(),
                ranks: shared.local.len(),
            }
            .into());
        }
        if rows.top_k == 0 {
            return Err(KernelError::ZeroDimension { what: "top_k" }.into());
        }
        let n: usize = rows.rank_rows.iter().sum();
        let pairs = n * rows.top_k;
        let at_least = |what, len: usize, needed: usize| {
            if len < needed {
                Err(KernelError::Length {
                    what,
                    len,
                    expected: needed,
                })
            } else {
                Ok(())
            }
        };
        at_least("routed row bytes", rows.x.bytes(), n * shared.hidden * 2)?;
        at_least("expert id bytes", rows.experts.bytes(), pairs * 4)?;
        at_least("router weight bytes", rows.weights.bytes(), pairs * 4)?;
        at_least("output bytes", rows.output.bytes(), n * shared.hidden * 4)?;
        Ok(())
    }

    /// Ranks every local rank's pairs among their expert's (token order, then top-k order) and
    /// counts them: the local rows of the layer's load matrix, downloaded (`E + 2` words a
    /// rank), the only host copy before the plan. An expert id out of range fails here.
    pub fn count(&self, rows: &RoutedRows) -> Result<Counted, CudaError> {
        self.check_rows(rows)?;
        let exec = self.shared.exec.as_ref();
        if rows.stream != self.main {
            exec.wait_for(self.main, &exec.record(rows.stream)?)?;
        }
        let experts = self.shared.layout.experts();
        let steps = self.steps();
        let mut counted = Counted {
            counts: Vec::with_capacity(rows.rank_rows.len()),
            occurrence: Vec::with_capacity(rows.rank_rows.len()),
        };
        for (index, pairs) in rows.rank_pairs().enumerate() {
            if pairs.is_empty() {
                counted.counts.push(vec![0; experts]);
                counted.occurrence.push(None);
                continue;
            }
            let ids = rows.experts.at(pairs.start * 4);
            let ranked = steps.rank_by_key(ids, pairs.len(), experts)?;
            let offsets = exec.download_u32_on(self.main, &ranked.offsets)?;
            if offsets[experts + 1] != 0 {
                return Err(CudaError::Exec(format!(
                    "rank {}: {} routed expert ids are not below {experts}",
                    self.shared.local.start + index,
                    offsets[experts + 1]
                )));
            }
            counted.counts.push(
                offsets[..=experts]
                    .windows(2)
                    .map(|w| u64::from(w[1] - w[0]))
                    .collect(),
            );
            counted.occurrence.push(Some(ranked.pos));
        }
        Ok(counted)
    }

    /// Whether this lane solves plans on the device.
    pub fn has_solver(&self) -> bool {
        self.solver.is_some()
    }

    /// Solves `load` for MoE layer `layer` on the device and, with every rank here and shared
    /// slots, queues the layer's replication right behind it from the plan where the solver
    /// left it. Returns the host's copy of the plan (validated, equal to the CPU planner's),
    /// downloaded on a side stream while the replicas stream; `None` without a device solver.
    pub fn solve(&mut self, layer: usize, load: &LoadMatrix) -> Result<Option<Plan>, CudaError> {
        self.solved = None;
        let Some(solver) = self.solver.as_mut() else {
            return Ok(None);
        };
        let exec = self.shared.exec.clone();
        solver.solve_on(self.main, load)?;
        let solved = exec.record(self.main)?;
        exec.wait_for(self.side, &solved)?;
        let solver = self.solver.as_ref().expect("checked above");
        let replication = self
            .replicates_on_device()
            .then(|| self.replicate_on_device(layer, solver.device_plan(), Some(solver.status())))
            .transpose()?;
        let (plan, _) = solver.download(self.side, load)?;
        if let Some(mut replication) = replication {
            replication.fills(self, &plan);
            self.solved = Some(SolvedOnDevice {
                layer,
                plan: plan.clone(),
                replication,
            });
        }
        Ok(Some(plan))
    }

    /// Stage 1 of MoE layer `layer` (its index among the MoE layers) under `plan`, solved on
    /// `load` (every rank's counts): the replication (already queued after [`Self::solve`] for
    /// the same layer and plan), then token assignment on every local source and the dispatch.
    /// `remote` moves what goes to ranks of other processes (required when there are any).
    pub fn send(
        &mut self,
        (layer, plan, load): (usize, &Plan, &LoadMatrix),
        rows: RoutedRows,
        counted: Counted,
        remote: Option<&dyn HostExchange>,
    ) -> Result<LayerInFlight, CudaError> {
        self.check_rows(&rows)?;
        let shared = self.shared.clone();
        let layout = &shared.layout;
        if (plan.ranks(), plan.experts(), plan.slots_per_rank())
            != (layout.ranks(), layout.experts(), layout.slots_per_rank())
        {
            return Err(PlanViolation::Shape.into());
        }
        if layer >= shared.home_offsets.len() {
            return Err(KernelError::OutOfRange {
                what: "MoE layer",
                value: layer as u64,
                limit: shared.home_offsets.len() as u64,
            }
            .into());
        }
        check(
            "ranks counted",
            counted.occurrence.len(),
            shared.local.len(),
        )?;
        if remote.is_none() && !shared.all_local() {
            return Err(CudaError::Exec(
                "ranks of other processes need a host exchange".into(),
            ));
        }
        let exec = shared.exec.clone();
        if rows.stream != self.main {
            exec.wait_for(self.main, &exec.record(rows.stream)?)?;
        }
        // Rows, outputs and replicas of this layer cross processes through peer memory under
        // one epoch of ready flags.
        let routes = Routes::new(plan, load)?;
        let epoch = match (self.peers.as_mut(), remote) {
            (Some(peers), Some(remote)) if !shared.all_local() => {
                peers.ensure(exec.as_ref(), &routes, remote)?;
                Some(peers.next_epoch())
            }
            _ => None,
        };
        let (uploaded, replication) = match self.solved.take() {
            Some(s) if s.layer == layer && s.plan == *plan => (None, s.replication),
            _ => {
                let uploaded = DevicePlan::upload(exec.as_ref(), self.main, plan)?;
                let replication = self.replicate(layer, (plan, &uploaded), remote, epoch)?;
                (Some(uploaded), replication)
            }
        };
        if !shared.config.pipelined_experts {
            exec.wait_for(self.main, &replication.end)?;
        }
        let begin = exec.record(self.main)?;
        let device_plan = self.device_plan(uploaded.as_ref())?;
        let steps = self.steps();
        let mut sent = Vec::with_capacity(shared.local.len());
        for (index, (pairs, occurrence)) in rows.rank_pairs().zip(&counted.occurrence).enumerate() {
            let source = source_of(&rows, &shared, index, pairs, occurrence.as_ref());
            sent.push(
                source
                    .map(|s| steps.permute(device_plan, &s, layout.ranks()))
                    .transpose()?,
            );
        }
        let received = match epoch {
            Some(epoch) => self.dispatch_to_peers(&routes, &sent, epoch)?,
            None => self.dispatch(&routes, &sent, remote)?,
        };
        let end = exec.record(self.main)?;
        Ok(LayerInFlight {
            layer,
            plan: plan.clone(),
            uploaded,
            routes,
            replication,
            rows,
            occurrence: counted.occurrence,
            sent,
            received,
            computed: Vec::new(),
            dispatch: (begin, end),
            experts: None,
            epoch,
        })
    }

    /// Stage 2: every local destination's expert GEMMs: in one grouped launch every instance
    /// whose weights are in place, then each replica still streaming, behind a wait for its own
    /// slot's landed bytes (with pipelined experts; otherwise the dispatch already waited for
    /// the whole replication).
    pub fn experts(&self, flight: &mut LayerInFlight) -> Result<(), CudaError> {
        let shared = &self.shared;
        let exec = shared.exec.as_ref();
        let begin = exec.record(self.main)?;
        let device_plan = self.device_plan(flight.uploaded.as_ref())?;
        let n_instances = (0..flight.plan.experts())
            .map(|e| flight.plan.instances(e).len())
            .sum();
        let steps = self.steps();
        let pipelined = shared.config.pipelined_experts;
        let mut computed = Vec::with_capacity(shared.local.len());
        for (index, dst) in shared.local.clone().enumerate() {
            let Some(recv) = flight.received[index].as_ref() else {
                computed.push(None);
                continue;
            };
            let mut works = Vec::new();
            let mut slots = Vec::new();
            let mut start = 0;
            for &(expert, instance, rows) in &flight.routes.groups[dst] {
                let (weights, slot) =
                    self.weights_at((flight.layer, &flight.plan), dst, expert, instance)?;
                works.push(GroupWork {
                    start,
                    rows,
                    weights,
                });
                slots.push(slot);
                start += rows;
            }
            let streamed = &flight.replication.streamed[index];
            let counter = self.replication_counter(&flight.replication);
            // A replica waits for its own slot when its bytes are still streaming.
            let waits: Vec<bool> = slots
                .iter()
                .map(|slot| pipelined && counter.is_some() && slot.is_some_and(|s| streamed[s]))
                .collect();
            // Groups that need nothing still streaming first, all in one launch.
            let mut order: Vec<usize> = (0..works.len()).collect();
            order.sort_by_key(|&g| waits[g]);
            let mut wait = |g: usize| -> Result<(), CudaError> {
                match (slots[g], counter) {
                    (Some(slot), Some(counter)) => self.landed.wait(
                        exec,
                        self.main,
                        (index, slot),
                        shared.expert_bytes as u64,
                        counter,
                    ),
                    _ => Ok(()),
                }
            };
            computed.push(Some(steps.experts(
                device_plan,
                (dst, n_instances),
                recv,
                (&works, &order),
                &waits,
                &mut wait,
            )?));
        }
        flight.computed = computed;
        flight.experts = Some((begin, exec.record(self.main)?));
        Ok(())
    }

    /// The stall word's buffer of a replication whose slots the device fills (`None`: it landed
    /// through the host and nothing needs waiting for).
    fn replication_counter<'a>(&'a self, replication: &'a Replication) -> Option<&'a DeviceBuffer> {
        match &replication.how {
            Streamed::Planner => self.tiles.as_ref().map(|t| t.counter()),
            Streamed::Uploaded(stream) => Some(stream.counter()),
            Streamed::Host => None,
        }
    }

    /// Stage 3: every output back to its source (device copies, or through `remote`), each
    /// source's router-weighted sum added into its output rows, the replication checked.
    /// Returns what the layer moved and the rows, their output complete, ordered for their
    /// stream.
    pub fn combine(
        &mut self,
        mut flight: LayerInFlight,
        remote: Option<&dyn HostExchange>,
    ) -> Result<(LayerRun, RoutedRows), CudaError> {
        let shared = self.shared.clone();
        let exec = shared.exec.clone();
        let experts = flight.experts.take().ok_or(CudaError::StageOrder {
            layer: flight.layer,
            stage: "combine",
        })?;
        let begin = exec.record(self.main)?;
        let h = shared.hidden;
        let routes = &flight.routes;
        let steps = self.steps();
        // Per local source: its pairs' outputs in its send layout.
        let returned = match flight.epoch {
            Some(epoch) => self.return_to_peers(&flight, epoch)?,
            None => self.return_outputs(&flight, remote)?,
        };
        for (index, (pairs, occurrence)) in
            flight.rows.rank_pairs().zip(&flight.occurrence).enumerate()
        {
            let source = source_of(&flight.rows, &shared, index, pairs, occurrence.as_ref());
            if let (Some(source), Some(sent), Some(back)) =
                (source, &flight.sent[index], &returned[index])
            {
                steps.combine(&source, sent, back)?;
            }
        }
        let end = exec.record(self.main)?;
        self.finish_replication(flight.layer, &flight.plan, &flight.replication)?;
        if flight.rows.stream != self.main {
            exec.wait_for(flight.rows.stream, &end)?;
        }
        let local = |per_rank: Vec<u64>| per_rank[shared.local.clone()].to_vec();
        let dispatched = local(routes.received_from_others(2 * h as u64 + 8));
        let sent_back = local(routes.sent_to_others(4 * h as u64));
        let run = LayerRun {
            token_recv_bytes: dispatched
                .iter()
                .zip(&sent_back)
                .map(|(a, b)| a + b)
                .collect(),
            replica_recv_bytes: flight.replication.recv_bytes.clone(),
            timing: LayerTiming {
                replicate: (flight.replication.begin, flight.replication.end),
                dispatch: flight.dispatch,
                experts,
                combine: (begin, end),
            },
        };
        Ok((run, flight.rows))
    }
}

/// Local rank `index`'s slice of the routed rows, `None` without pairs.
fn source_of<'a>(
    rows: &RoutedRows,
    shared: &super::plane::Shared,
    index: usize,
    pairs: std::ops::Range<usize>,
    occurrence: Option<&'a DeviceBuffer>,
) -> Option<Source<'a>> {
    let occurrence = occurrence.filter(|_| !pairs.is_empty())?;
    let first_row = pairs.start / rows.top_k;
    Some(Source {
        rank: shared.local.start + index,
        x: rows.x.at(first_row * shared.hidden * 2),
        experts: rows.experts.at(pairs.start * 4),
        weights: rows.weights.at(pairs.start * 4),
        output: rows.output.at(first_row * shared.hidden * 4),
        tokens: pairs.len() / rows.top_k,
        top_k: rows.top_k,
        occurrence,
    })
}

impl MoeLane {
    /// The three stages back to back: [`Self::send`], [`Self::experts`], [`Self::combine`].
    pub fn run_layer(
        &mut self,
        (layer, plan, load): (usize, &Plan, &LoadMatrix),
        rows: RoutedRows,
        counted: Counted,
        remote: Option<&dyn HostExchange>,
    ) -> Result<(LayerRun, RoutedRows), CudaError> {
        let mut flight = self.send((layer, plan, load), rows, counted, remote)?;
        self.experts(&mut flight)?;
        self.combine(flight, remote)
    }
}
