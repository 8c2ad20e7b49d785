//! [`DeviceMoe`]: one MoE layer's EP data plane in bf16 for ranks sharing one device.
//!
//! Per layer:
//!
//! 1. [`DeviceMoe::count`]: each rank's pairs ranked among their expert's, which counts them
//!    too: the `R x E` load matrix is the one host copy, what the planner needs;
//! 2. [`DeviceMoe::run_layer`], once the plan is known:
//!    - replicas: the relay schedule compiled to tile tasks on the host (where the plan is) and
//!      streamed by the persistent tile kernel from the home weights into the slots, in bf16,
//!      so a replica moves half the bytes of the f32 plane's;
//!    - dispatch: instance lookup by cumulative quota, rows (bf16) scattered into each source's
//!      send layout, segments copied into each destination's receive buffer;
//!    - experts: rows grouped by instance, then per instance a gate-up GEMM, `silu(gate) * up`
//!      and a down GEMM (bf16 operands, f32 accumulation; main experts read the home weights,
//!      replicas their slot);
//!    - return and combine: outputs back in each sender's layout, their router-weighted sum in
//!      top-k order added into the block's output (which already holds the shared experts').
//!
//! The rows each instance receives follow from the plan's split and the counts, so every copy
//! and GEMM is sized on the host without reading anything back.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rackfill_balancer::relay::{plan_transfers, RelayConfig};
use rackfill_balancer::{Layout, Plan, PlanViolation};

use super::super::exec::{bf16_to_f32, f32_to_bf16, DeviceBuffer, Executor, ExecutorExt};
use super::super::home_weights::{pack_home_weights, HomeWeights};
use super::super::tiles::{self, BufferLayout, DEFAULT_TILE_BYTES};
use super::super::CudaError;
use super::routes::{check, Routes};
use super::steps::{Source, Steps};
use crate::weights::{weight_source, WeightSource};
use crate::KernelError;

pub use super::super::home_weights::ExpertWeights;

/// A batch's routed rows on the device, every local rank's rows one after another (what the
/// GPU model's router left there).
#[derive(Clone, Copy)]
pub struct RoutedRows<'a> {
    /// bf16 `[rows, H]`: the normalised FFN inputs.
    pub x: &'a DeviceBuffer,
    /// u32 `[rows, top_k]`: expert ids.
    pub experts: &'a DeviceBuffer,
    /// f32 `[rows, top_k]`: router weights.
    pub weights: &'a DeviceBuffer,
    /// Rows of each rank, in rank order (they sum to `rows`).
    pub rank_rows: &'a [usize],
    pub top_k: usize,
}

/// What [`DeviceMoe::count`] found: the load matrix, and each pair's rank among its expert's
/// pairs on its source (kept on the device for the dispatch).
pub struct Counted {
    /// `[rank][expert]`: pairs.
    pub counts: Vec<Vec<u64>>,
    /// Per rank: u32 `[rows_r * top_k]` (`None` without rows).
    occurrence: Vec<Option<DeviceBuffer>>,
}

/// What one layer moved and how long its parts took (wall time, the device synchronised after
/// each).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeviceLayerRun {
    /// Per rank: token bytes received from other ranks (dispatched bf16 rows with their expert
    /// and instance ids, then the f32 outputs of the rows it sent away).
    pub token_recv_bytes: Vec<u64>,
    /// Per rank: replica weight bytes received.
    pub replica_recv_bytes: Vec<u64>,
    pub replicate: Duration,
    pub dispatch: Duration,
    pub experts: Duration,
    pub combine: Duration,
}

/// The bf16 data plane of one model on one device: every rank's main experts of every MoE
/// layer, its redundant slots (shared by the layers, as on a rack), the relay settings.
pub struct DeviceMoe {
    exec: Arc<dyn Executor>,
    layout: Layout,
    hidden: usize,
    inter: usize,
    /// Bytes of one expert in bf16 (a slot's size).
    expert_bytes: usize,
    /// Per rank: its main experts of every MoE layer, layer after layer.
    homes: Vec<DeviceBuffer>,
    /// `[moe layer][expert]`: byte offset of the expert in its home rank's buffer.
    home_offsets: Vec<Vec<u64>>,
    /// Per rank: `slots_per_rank` slots of `expert_bytes`.
    slots: Vec<DeviceBuffer>,
    relay: RelayConfig,
}

impl DeviceMoe {
    /// Uploads every MoE layer's experts (`layers[l][e]`, `E` per layer) in bf16 to their home
    /// ranks' buffers for `layout`, with its slots; replicas stream over `relay`'s trees.
    pub fn new(
        exec: Arc<dyn Executor>,
        layout: &Layout,
        hidden: usize,
        inter: usize,
        layers: &[Vec<ExpertWeights<'_>>],
        relay: RelayConfig,
    ) -> Result<Self, CudaError> {
        if hidden == 0 || inter == 0 {
            return Err(KernelError::ZeroDimension {
                what: "hidden and intermediate size",
            }
            .into());
        }
        let expert_bytes = (hidden * 2 * inter + inter * hidden) * 2;
        let HomeWeights {
            bytes: homes,
            offsets: home_offsets,
        } = pack_home_weights(layout, layers, (hidden, inter), |w, out| {
            out.extend(f32_to_bf16(w).to_le_bytes())
        })?;
        let homes = homes
            .iter()
            .map(|bytes| exec.upload(bytes))
            .collect::<Result<Vec<_>, _>>()?;
        let slots = (0..layout.ranks())
            .map(|_| exec.alloc_zeroed(layout.slots_per_rank() * expert_bytes))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            exec,
            layout: layout.clone(),
            hidden,
            inter,
            expert_bytes,
            homes,
            home_offsets,
            slots,
            relay,
        })
    }

    /// Bytes of one expert's bf16 weights (what a replica moves).
    pub fn expert_bytes(&self) -> usize {
        self.expert_bytes
    }

    /// What rank `rank`'s redundant slot `slot` holds now, widened to f32 (tests, debugging).
    pub fn slot_contents(&self, rank: usize, slot: usize) -> Result<Vec<f32>, CudaError> {
        let out_of_range = |what, value: usize, limit: usize| KernelError::OutOfRange {
            what,
            value: value as u64,
            limit: limit as u64,
        };
        let buffer = self
            .slots
            .get(rank)
            .ok_or_else(|| out_of_range("rank", rank, self.layout.ranks()))?;
        if slot >= self.layout.slots_per_rank() {
            return Err(out_of_range("slot", slot, self.layout.slots_per_rank()).into());
        }
        let mut bytes = vec![0u8; self.expert_bytes];
        self.exec
            .read(buffer, slot * self.expert_bytes, &mut bytes)?;
        Ok(bytes
            .chunks_exact(2)
            .map(|b| bf16_to_f32(u16::from_le_bytes([b[0], b[1]])))
            .collect())
    }

    /// Ranks every rank's pairs among their expert's (token order, then top-k order) and counts
    /// them: the layer's load matrix, downloaded (`ranks x (E + 2)` words), the only host copy
    /// before the dispatch. An expert id out of range fails here.
    pub fn count(&self, routed: &RoutedRows<'_>) -> Result<Counted, CudaError> {
        self.check_routed(routed)?;
        let experts = self.layout.experts();
        let steps = self.steps();
        let mut counted = Counted {
            counts: Vec::with_capacity(routed.rank_rows.len()),
            occurrence: Vec::with_capacity(routed.rank_rows.len()),
        };
        for (rank, pairs) in rank_pairs(routed).enumerate() {
            if pairs.is_empty() {
                counted.counts.push(vec![0; experts]);
                counted.occurrence.push(None);
                continue;
            }
            let ids = routed.experts.at(pairs.start * 4);
            let ranked = steps.rank_by_key(ids, pairs.len(), experts)?;
            let offsets = self.exec.download_u32(&ranked.offsets)?;
            if offsets[experts + 1] != 0 {
                return Err(CudaError::Exec(format!(
                    "rank {rank}: {} routed expert ids are not below {experts}",
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

    /// Runs MoE layer `layer` (its index among the MoE layers) under `plan` for the rows
    /// [`Self::count`] counted: replicas, dispatch, experts, return, and the router-weighted sum
    /// added into `output` (f32 `[rows, H]`).
    pub fn run_layer(
        &self,
        layer: usize,
        plan: &Plan,
        routed: &RoutedRows<'_>,
        counted: &Counted,
        output: &DeviceBuffer,
    ) -> Result<DeviceLayerRun, CudaError> {
        self.check_routed(routed)?;
        let ranks = self.layout.ranks();
        if (plan.ranks(), plan.experts(), plan.slots_per_rank())
            != (ranks, self.layout.experts(), self.layout.slots_per_rank())
        {
            return Err(PlanViolation::Shape.into());
        }
        let home_offsets = self
            .home_offsets
            .get(layer)
            .ok_or(KernelError::OutOfRange {
                what: "MoE layer",
                value: layer as u64,
                limit: self.home_offsets.len() as u64,
            })?;
        let rows: usize = routed.rank_rows.iter().sum();
        check("output bytes", output.bytes(), rows * self.hidden * 4)?;
        check("ranks counted", counted.occurrence.len(), ranks)?;
        let steps = self.steps();
        let mut run = DeviceLayerRun::default();

        let started = Instant::now();
        run.replica_recv_bytes = self.replicate(&steps, plan, home_offsets)?;
        run.replicate = started.elapsed();

        let started = Instant::now();
        let routes = Routes::new(plan, &counted.counts)?;
        let device_plan = steps.upload_plan(plan)?;
        let sources: Vec<Option<Source<'_>>> = rank_pairs(routed)
            .zip(&counted.occurrence)
            .enumerate()
            .map(|(rank, (pairs, occurrence))| {
                let occurrence = occurrence.as_ref().filter(|_| !pairs.is_empty())?;
                let first_row = pairs.start / routed.top_k;
                Some(Source {
                    rank,
                    x: routed.x.at(first_row * self.hidden * 2),
                    experts: routed.experts.at(pairs.start * 4),
                    weights: routed.weights.at(pairs.start * 4),
                    output: output.at(first_row * self.hidden * 4),
                    tokens: pairs.len() / routed.top_k,
                    top_k: routed.top_k,
                    occurrence,
                })
            })
            .collect();
        let sent = sources
            .iter()
            .map(|s| {
                s.as_ref()
                    .map(|s| steps.permute(&device_plan, s))
                    .transpose()
            })
            .collect::<Result<Vec<_>, _>>()?;
        let received = (0..ranks)
            .map(|dst| steps.receive(&sent, &routes, dst))
            .collect::<Result<Vec<_>, _>>()?;
        self.exec.synchronize()?;
        run.dispatch = started.elapsed();

        let started = Instant::now();
        let mut computed = Vec::with_capacity(ranks);
        for (rank, recv) in received.iter().enumerate() {
            computed.push(match recv {
                Some(recv) => {
                    let groups = &routes.groups[rank];
                    let weights = groups
                        .iter()
                        .map(|&(e, t, _)| self.weights_at(plan, home_offsets, rank, e, t))
                        .collect::<Result<Vec<_>, _>>()?;
                    Some(steps.experts(&device_plan, rank, recv, groups, &weights)?)
                }
                None => None,
            });
        }
        self.exec.synchronize()?;
        run.experts = started.elapsed();

        let started = Instant::now();
        for (source, sent) in sources.iter().zip(&sent) {
            if let (Some(source), Some(sent)) = (source, sent) {
                steps.combine(source, sent, &computed, &routes)?;
            }
        }
        self.exec.synchronize()?;
        run.combine = started.elapsed();
        let dispatched = routes.received_from_others(2 * self.hidden as u64 + 8);
        let returned = routes.sent_to_others(4 * self.hidden as u64);
        run.token_recv_bytes = dispatched
            .iter()
            .zip(&returned)
            .map(|(a, b)| a + b)
            .collect();
        Ok(run)
    }

    fn steps(&self) -> Steps<'_> {
        Steps {
            exec: self.exec.as_ref(),
            hidden: self.hidden,
            inter: self.inter,
            experts: self.layout.experts(),
            ranks: self.layout.ranks(),
        }
    }

    fn check_routed(&self, routed: &RoutedRows<'_>) -> Result<(), CudaError> {
        if routed.rank_rows.len() != self.layout.ranks() {
            return Err(KernelError::RankCount {
                got: routed.rank_rows.len(),
                ranks: self.layout.ranks(),
            }
            .into());
        }
        if routed.top_k == 0 {
            return Err(KernelError::ZeroDimension { what: "top_k" }.into());
        }
        let rows: usize = routed.rank_rows.iter().sum();
        let pairs = rows * routed.top_k;
        check("routed row bytes", routed.x.bytes(), rows * self.hidden * 2)?;
        check("expert id bytes", routed.experts.bytes(), pairs * 4)?;
        check("router weight bytes", routed.weights.bytes(), pairs * 4)?;
        Ok(())
    }

    /// Streams `plan`'s replicas from the home weights into the slots over its relay trees;
    /// returns the replica bytes each rank received.
    fn replicate(
        &self,
        steps: &Steps<'_>,
        plan: &Plan,
        home_offsets: &[u64],
    ) -> Result<Vec<u64>, CudaError> {
        let expert_bytes = self.expert_bytes as u64;
        let received = (0..self.layout.ranks())
            .map(|rank| plan.rank_slots(rank).iter().flatten().count() as u64 * expert_bytes)
            .collect();
        let schedule = plan_transfers(plan, expert_bytes, &self.relay);
        let buffers = BufferLayout {
            expert_bytes,
            home_offsets,
            slot_bytes: expert_bytes,
        };
        let stream = tiles::compile(plan, &schedule, &buffers, DEFAULT_TILE_BYTES)?;
        if !stream.tasks.is_empty() {
            stream.check_runnable(self.layout.ranks())?;
            steps.stream_tiles(&stream, &self.homes, &self.slots)?;
        }
        Ok(received)
    }

    /// The device address of the weights `rank` computes `expert`'s `instance` with: its home
    /// buffer for the main instance, the slot the replica was streamed into otherwise.
    fn weights_at(
        &self,
        plan: &Plan,
        home_offsets: &[u64],
        rank: usize,
        expert: u32,
        instance: u32,
    ) -> Result<u64, CudaError> {
        match weight_source(&self.layout, plan, rank, expert, instance) {
            Some(WeightSource::Home { .. }) => {
                Ok(self.homes[rank].at(home_offsets[expert as usize] as usize))
            }
            Some(WeightSource::Slot { slot }) => Ok(self.slots[rank].at(slot * self.expert_bytes)),
            None => Err(KernelError::OutOfRange {
                what: "expert instance on this rank",
                value: u64::from(instance),
                limit: plan.instances(expert as usize).len() as u64,
            }
            .into()),
        }
    }
}

/// Each rank's range of pairs (token-major, `top_k` per row), in rank order.
fn rank_pairs<'a>(routed: &RoutedRows<'a>) -> impl Iterator<Item = std::ops::Range<usize>> + 'a {
    let k = routed.top_k;
    routed.rank_rows.iter().scan(0, move |start, &rows| {
        let range = *start * k..(*start + rows) * k;
        *start += rows;
        Some(range)
    })
}
