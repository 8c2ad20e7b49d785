//! The GPU measurements `rackfill kernels bench` reports (docs/gpu.md): quota-solver latency
//! against the CPU planner, relay planning on the device against the host's schedule and tile
//! compiler, replica-distribution bandwidth against a device-to-device copy of the same bytes,
//! and relay versus direct fan-out. Times come from CUDA events around the kernels
//! alone (inputs already on the device); medians over the repetitions.

use super::exec::{DeviceBuffer, Executor, Stream};
use super::replicate::{DeviceTileStream, RankBuffers};
use super::solver::DeviceQuotaSolver;
use super::tile_plan::{TileGeometry, TilePlanner};
use super::tiles::{self, BufferLayout, DEFAULT_TILE_BYTES};
use super::CudaError;
use rackfill_balancer::quota::{QuotaPlanner, TargetRule};
use rackfill_balancer::relay::{plan_transfers, RelayConfig};
use rackfill_balancer::{Balancer, Layout, LoadMatrix, Plan};
use std::sync::Arc;
use std::time::Instant;

/// Solver latency for one shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SolverBench {
    pub gpu_median_us: f64,
    pub cpu_median_us: f64,
    /// Inputs whose GPU plan equals the CPU planner's, out of `inputs`.
    pub identical: usize,
    pub inputs: usize,
    pub warps: u32,
    pub load_staged: bool,
}

/// Relay trees and tile tasks for one solved layer, on the device and on the host.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TilePlanBench {
    /// `plan_tiles` on the device, reading the solver's plan in place.
    pub gpu_median_us: f64,
    /// `plan_transfers` + `tiles::compile` on the host (the plan already downloaded; the
    /// download and the task upload the device path avoids are not counted).
    pub host_median_us: f64,
    pub tasks: usize,
    /// Whether the device stream equals the host compiler's.
    pub identical: bool,
}

/// Replica distribution of one skewed layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DistributionBench {
    pub stored_bytes: u64,
    pub kernel_us: f64,
    pub copy_us: f64,
}

impl DistributionBench {
    /// Effective bandwidth of the tile-streaming kernel, GB/s.
    pub fn kernel_gbps(&self) -> f64 {
        self.stored_bytes as f64 / self.kernel_us / 1e3
    }

    /// Bandwidth of the reference device-to-device copy, GB/s.
    pub fn copy_gbps(&self) -> f64 {
        self.stored_bytes as f64 / self.copy_us / 1e3
    }
}

/// One hot expert sent to `fanout` replicas, directly and through a relay tree.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RelayBench {
    pub direct_us: f64,
    pub relay_us: f64,
    pub relays: usize,
}

/// splitmix64: deterministic inputs without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// A skewed prefill layer: 4096 tokens per rank, top-8, a few hot experts (Zipf-like weights).
pub fn skewed_load(ranks: usize, experts: usize, seed: u64) -> LoadMatrix {
    let mut rng = Rng(seed);
    let weights: Vec<u64> = (0..experts)
        .map(|i| {
            let rank = (i as u64 * 2_654_435_761 + rng.next() % 7) % experts as u64 + 1;
            1_000_000 / rank
        })
        .collect();
    let sum: u64 = weights.iter().sum::<u64>().max(1);
    let pairs = 4096 * 8u64;
    let rows: Vec<Vec<u64>> = (0..ranks)
        .map(|_| {
            weights
                .iter()
                .map(|&w| pairs * w / sum + rng.next() % 8)
                .collect()
        })
        .collect();
    // Sizes are small and rows equal in length: from_rows cannot fail here.
    LoadMatrix::from_rows(&rows).unwrap_or_else(|_| LoadMatrix::zeros(ranks, experts))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Times `f` (which queues work on the main stream) with events, median of `reps`.
fn time_us(
    exec: &dyn Executor,
    reps: usize,
    mut f: impl FnMut() -> Result<(), CudaError>,
) -> Result<f64, CudaError> {
    f()?; // warm-up
    let mut samples = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = exec.record(Stream::MAIN)?;
        f()?;
        let end = exec.record(Stream::MAIN)?;
        samples.push(exec.elapsed(&start, &end)?.as_secs_f64() * 1e6);
    }
    Ok(median(samples))
}

/// Solver latency on 16 skewed inputs of shape `R x E`, `n_slot` slots, and plan identity
/// with the CPU planner.
pub fn solver_latency(
    exec: &Arc<dyn Executor>,
    ranks: usize,
    experts: usize,
    n_slot: usize,
    reps: usize,
) -> Result<SolverBench, CudaError> {
    let layout = Layout::contiguous(ranks, experts, n_slot)?;
    let mut solver = DeviceQuotaSolver::new(Arc::clone(exec), &layout, 1, TargetRule::BestFit)?;
    let mut cpu = QuotaPlanner::new(1);
    let inputs = 16;
    let (mut gpu_us, mut cpu_us, mut identical) = (Vec::new(), Vec::new(), 0);
    for seed in 0..inputs {
        let load = skewed_load(ranks, experts, seed as u64);
        let (gpu_plan, _) = solver.plan(&load)?;
        let cpu_plan = cpu.plan(&layout, &load)?;
        identical += usize::from(gpu_plan == cpu_plan);
        gpu_us.push(time_us(exec.as_ref(), reps, || {
            solver.solve_on(Stream::MAIN, &load)
        })?);
        let mut samples = Vec::with_capacity(reps);
        for _ in 0..reps {
            let t = Instant::now();
            let plan = cpu.plan(&layout, &load)?;
            samples.push(t.elapsed().as_secs_f64() * 1e6);
            std::hint::black_box(plan);
        }
        cpu_us.push(median(samples));
    }
    let (warps, load_staged) = solver.config();
    Ok(SolverBench {
        gpu_median_us: median(gpu_us),
        cpu_median_us: median(cpu_us),
        identical,
        inputs,
        warps,
        load_staged,
    })
}

/// Relay planning for a skewed layer of shape `R x E`, `n_slot` slots, `expert_bytes` experts:
/// the device planner over the solver's plan against the host path over the same plan.
pub fn tile_planning_latency(
    exec: &Arc<dyn Executor>,
    ranks: usize,
    experts: usize,
    n_slot: usize,
    expert_bytes: u64,
    reps: usize,
) -> Result<TilePlanBench, CudaError> {
    let layout = Layout::contiguous(ranks, experts, n_slot)?;
    let load = skewed_load(ranks, experts, 7);
    let mut solver = DeviceQuotaSolver::new(Arc::clone(exec), &layout, 1, TargetRule::BestFit)?;
    let (plan, _) = solver.plan(&load)?;
    let (home_offsets, _) = packed_homes(&layout, expert_bytes);
    let geometry = TileGeometry {
        expert_bytes,
        slot_bytes: expert_bytes,
        tile_bytes: DEFAULT_TILE_BYTES,
        relay: RelayConfig::default(),
    };
    let planner = TilePlanner::new(
        Arc::clone(exec),
        &layout,
        &geometry,
        std::slice::from_ref(&home_offsets),
    )?;
    let gpu_median_us = time_us(exec.as_ref(), reps, || {
        planner.plan(Stream::MAIN, solver.device_plan(), Some(solver.status()), 0)
    })?;
    let buffers = BufferLayout {
        expert_bytes,
        home_offsets: &home_offsets,
        slot_bytes: expert_bytes,
    };
    let mut host = Vec::with_capacity(reps);
    let mut want = None;
    for _ in 0..reps.max(1) {
        let started = Instant::now();
        let schedule = plan_transfers(&plan, expert_bytes, &geometry.relay);
        let stream = tiles::compile(&plan, &schedule, &buffers, DEFAULT_TILE_BYTES)?;
        host.push(started.elapsed().as_secs_f64() * 1e6);
        want = Some(stream);
    }
    let got = planner.download(Stream::MAIN)?;
    Ok(TilePlanBench {
        gpu_median_us,
        host_median_us: median(host),
        tasks: got.tasks.len(),
        identical: want.as_ref() == Some(&got),
    })
}

/// Every rank's main experts back to back: each expert's home offset, and each rank's bytes.
fn packed_homes(layout: &Layout, expert_bytes: u64) -> (Vec<u64>, Vec<usize>) {
    let mut home_offsets = vec![0u64; layout.experts()];
    let mut home_bytes = Vec::with_capacity(layout.ranks());
    for r in 0..layout.ranks() {
        for (local, &e) in layout.main_experts(r).iter().enumerate() {
            home_offsets[e as usize] = local as u64 * expert_bytes;
        }
        home_bytes.push(layout.main_experts(r).len() * expert_bytes as usize);
    }
    (home_offsets, home_bytes)
}

/// Buffers, tasks and a launch for distributing `plan`'s replicas on one GPU.
struct Distribution {
    buffers: RankBuffers,
    stream: DeviceTileStream,
    stored_bytes: u64,
}

fn distribution(
    exec: &dyn Executor,
    layout: &Layout,
    plan: &Plan,
    expert_bytes: u64,
    config: &RelayConfig,
) -> Result<Distribution, CudaError> {
    let schedule = plan_transfers(plan, expert_bytes, config);
    let (home_offsets, home_bytes) = packed_homes(layout, expert_bytes);
    let buffers_layout = BufferLayout {
        expert_bytes,
        home_offsets: &home_offsets,
        slot_bytes: expert_bytes,
    };
    let tasks = tiles::compile(plan, &schedule, &buffers_layout, DEFAULT_TILE_BYTES)?;
    let slot_buffer = layout.slots_per_rank() * expert_bytes as usize;
    let homes = home_bytes
        .iter()
        .map(|&n| exec.alloc_zeroed(n))
        .collect::<Result<Arc<[DeviceBuffer]>, _>>()?;
    let buffers = RankBuffers::new(exec, homes, (slot_buffer, 1), &tasks.flags_per_rank)?;
    Ok(Distribution {
        stream: DeviceTileStream::upload(exec, Stream::MAIN, &tasks, layout.ranks())?,
        stored_bytes: tasks.stored_bytes,
        buffers,
    })
}

fn time_distribution(exec: &dyn Executor, d: &Distribution, reps: usize) -> Result<f64, CudaError> {
    let blocks = exec.multiprocessors() * 2;
    let us = time_us(exec, reps, || {
        d.stream
            .launch(exec, Stream::MAIN, (&d.buffers, 0), (blocks, 512), None)
    })?;
    d.stream.finish(exec, Stream::MAIN)?;
    Ok(us)
}

/// Distribution of a skewed layer's replicas, `expert_bytes` per expert, and a device-to-device
/// copy of the same number of bytes.
pub fn distribution_bandwidth(
    exec: &dyn Executor,
    ranks: usize,
    experts: usize,
    n_slot: usize,
    expert_bytes: u64,
    reps: usize,
) -> Result<DistributionBench, CudaError> {
    let layout = Layout::contiguous(ranks, experts, n_slot)?;
    let plan = QuotaPlanner::new(1).plan(&layout, &skewed_load(ranks, experts, 7))?;
    let d = distribution(exec, &layout, &plan, expert_bytes, &RelayConfig::default())?;
    let kernel_us = time_distribution(exec, &d, reps)?;
    let bytes = d.stored_bytes.max(1) as usize;
    let src = exec.alloc_zeroed(bytes)?;
    let dst = exec.alloc_zeroed(bytes)?;
    let copy_us = time_us(exec, reps, || exec.copy(&src, 0, &dst, 0, bytes))?;
    Ok(DistributionBench {
        stored_bytes: d.stored_bytes,
        kernel_us,
        copy_us,
    })
}

/// One expert replicated on `fanout` ranks (each rank one slot), sent directly from its home and
/// through the default relay tree.
pub fn relay_vs_direct(
    exec: &dyn Executor,
    fanout: usize,
    expert_bytes: u64,
    reps: usize,
) -> Result<RelayBench, CudaError> {
    let ranks = fanout + 1;
    let layout = Layout::contiguous(ranks, ranks, 1)?;
    let mut hot = vec![vec![0u64; ranks]; ranks];
    for row in &mut hot {
        row[0] = 1000;
    }
    let load = LoadMatrix::from_rows(&hot)?;
    let plan = QuotaPlanner::new(1).plan(&layout, &load)?;
    let direct = RelayConfig {
        threshold: fanout,
        ..RelayConfig::default()
    };
    let relay = RelayConfig::default();
    let relays = plan_transfers(&plan, expert_bytes, &relay)
        .trees
        .first()
        .map_or(0, |t| t.relays.len());
    let d = distribution(exec, &layout, &plan, expert_bytes, &direct)?;
    let direct_us = time_distribution(exec, &d, reps)?;
    let d = distribution(exec, &layout, &plan, expert_bytes, &relay)?;
    let relay_us = time_distribution(exec, &d, reps)?;
    Ok(RelayBench {
        direct_us,
        relay_us,
        relays,
    })
}
