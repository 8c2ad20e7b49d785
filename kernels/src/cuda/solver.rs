//! Host side of the device quota solver (`kernels/cuda/quota_solver.cu`).
//!
//! [`DeviceQuotaSolver`] uploads the layout once, then per layer uploads the load matrix,
//! launches the one-block solver and leaves its plan on the device as a [`DevicePlan`]: slot
//! assignment, quotas, and the cumulative reroute split the token permute reads directly.
//! [`DevicePlan::download`] + [`PlanArrays::into_plan`](super::PlanArrays::into_plan) turn it
//! into a [`Plan`], validated, equal to the CPU planner's for the same input. It runs on any
//! [`Executor`]: a GPU, or the host emulator that checks it against the CPU planner in CI.

use super::exec::{DeviceBuffer, Executor, ExecutorExt, KernelArg, KernelParams, Launch, Stream};
use super::{to_u32, CudaError, DevicePlan};
use rackfill_balancer::quota::TargetRule;
use rackfill_balancer::{Layout, LoadMatrix, Plan};
use std::sync::Arc;

/// Kernel parameters; field for field the `SolverParams` struct of `quota_solver.cu` (see there
/// for each field). Public so that tools can run the kernel source elsewhere with the host's
/// exact shared-memory layout (the emulated tests do).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SolverParams {
    pub u_min: u64,
    pub ranks: u32,
    pub experts: u32,
    pub n_slot: u32,
    pub rule: u32,
    pub warps: u32,
    pub max_moves: u32,
    pub load_in_shared: u32,
    pub cumulative_capacity: u32,
    pub sh_load: u32,
    pub sh_totals: u32,
    pub sh_main_quota: u32,
    pub sh_rank_load: u32,
    pub sh_main_offsets: u32,
    pub sh_hottest: u32,
    pub sh_by_load: u32,
    pub sh_best: u32,
    pub sh_sorted: u32,
    pub sh_first_prefix: u32,
    pub sh_distinct: u32,
    pub sh_warps: u32,
    pub warp_stride: u32,
    pub w_a: u32,
    pub w_b: u32,
    pub w_c: u32,
    pub w_free: u32,
    pub w_quota: u32,
    pub w_expert: u32,
    pub w_rank: u32,
}

// SAFETY: plain `repr(C)` integers without padding (a u64 then 28 u32s: 120 bytes), the same
// layout as the CUDA struct.
unsafe impl KernelParams for SolverParams {}

/// Most probe warps per block (the kernel's `MAX_WARPS`).
pub const MAX_WARPS: u32 = 32;
/// Entries of the kernel's status output (`ST_LEN`).
const STATUS_LEN: usize = 9;

/// Dynamic shared memory carved into 8-byte aligned arrays.
struct Carver {
    next: u64,
}

impl Carver {
    fn take(&mut self, bytes: u64) -> u64 {
        let at = self.next;
        self.next = (at + bytes).next_multiple_of(8);
        at
    }
}

/// The kernel's dimensions and shared-memory layout for one problem shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SolverShape {
    pub params: SolverParams,
    /// Dynamic shared memory per launch.
    pub shared_bytes: usize,
}

impl SolverShape {
    /// The layout for `warps` probe warps, with or without the load matrix staged in shared
    /// memory. `None` when a size overflows the kernel's 32-bit offsets.
    pub fn new(
        layout: &Layout,
        u_min: u64,
        rule: TargetRule,
        warps: u32,
        stage: bool,
    ) -> Option<Self> {
        let r = layout.ranks() as u64;
        let e = layout.experts() as u64;
        let m = r.checked_mul(layout.slots_per_rank() as u64)?;
        let mut c = Carver { next: 0 };
        let sh_load = if stage {
            c.take(r.checked_mul(e)?.checked_mul(8)?)
        } else {
            0
        };
        let sh_totals = c.take(8 * e);
        let sh_main_quota = c.take(8 * e);
        let sh_rank_load = c.take(8 * r);
        let sh_main_offsets = c.take(4 * (r + 1));
        let sh_hottest = c.take(4 * e);
        let sh_by_load = c.take(4 * r);
        let sh_best = c.take(16 * m);
        let sh_sorted = c.take(16 * m);
        let sh_first_prefix = c.take(4 * (m + 1));
        let sh_distinct = c.take(4 * m);
        let mut w = Carver { next: 0 };
        let w_a = w.take(8 * r);
        let w_b = w.take(8 * r);
        let w_c = w.take(8 * r);
        let w_quota = w.take(8 * m);
        let w_free = w.take(4 * r);
        let w_expert = w.take(4 * m);
        let w_rank = w.take(4 * m);
        let warp_stride = w.next;
        let sh_warps = c.take(warp_stride.checked_mul(warps as u64)?);
        let shared_bytes = c.next;
        // Every split block lives in the cumulative output: at most R * 2M entries (one main
        // and one replica per move, at worst).
        let cumulative_capacity = r.checked_mul(2 * m)?.max(1);
        let u = |v: u64| u32::try_from(v).ok();
        let params = SolverParams {
            u_min: u_min.max(1),
            ranks: u(r)?,
            experts: u(e)?,
            n_slot: u(layout.slots_per_rank() as u64)?,
            rule: match rule {
                TargetRule::BestFit => 0,
                TargetRule::LargestSlack => 1,
            },
            warps,
            max_moves: u(m)?,
            load_in_shared: u32::from(stage),
            cumulative_capacity: u(cumulative_capacity)?,
            sh_load: u(sh_load)?,
            sh_totals: u(sh_totals)?,
            sh_main_quota: u(sh_main_quota)?,
            sh_rank_load: u(sh_rank_load)?,
            sh_main_offsets: u(sh_main_offsets)?,
            sh_hottest: u(sh_hottest)?,
            sh_by_load: u(sh_by_load)?,
            sh_best: u(sh_best)?,
            sh_sorted: u(sh_sorted)?,
            sh_first_prefix: u(sh_first_prefix)?,
            sh_distinct: u(sh_distinct)?,
            sh_warps: u(sh_warps)?,
            warp_stride: u(warp_stride)?,
            w_a: u(w_a)?,
            w_b: u(w_b)?,
            w_c: u(w_c)?,
            w_free: u(w_free)?,
            w_quota: u(w_quota)?,
            w_expert: u(w_expert)?,
            w_rank: u(w_rank)?,
        };
        // The split offsets the kernel emits are u32 too.
        u(r.checked_mul(e + 2 * m)?)?;
        Some(Self {
            params,
            shared_bytes: usize::try_from(shared_bytes).ok()?,
        })
    }

    /// The largest configuration that fits `limit` bytes of shared memory: the load matrix staged
    /// with as many warps as fit (at least 8), else not staged with as many warps as fit.
    pub fn fit(
        layout: &Layout,
        u_min: u64,
        rule: TargetRule,
        limit: usize,
    ) -> Result<Self, CudaError> {
        let too_large = || {
            CudaError::Kernel(crate::KernelError::Overflow {
                what: "quota solver sizes",
            })
        };
        for (stage, min_warps) in [(true, 8), (false, 1)] {
            for warps in (min_warps..=MAX_WARPS).rev() {
                let shape = Self::new(layout, u_min, rule, warps, stage).ok_or_else(too_large)?;
                if shape.shared_bytes <= limit {
                    return Ok(shape);
                }
            }
        }
        let needed = Self::new(layout, u_min, rule, 1, false)
            .ok_or_else(too_large)?
            .shared_bytes;
        Err(CudaError::SharedMemory {
            what: "the quota solver",
            needed,
            limit,
        })
    }
}

/// What the kernel reports about one solve besides the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SolveStats {
    /// Replicas created.
    pub replicas: u64,
    /// Search rounds (each evaluates up to `warps` probes at once).
    pub rounds: u64,
    /// Probes the CPU planner runs for the same input.
    pub probes: u64,
    /// Probes evaluated, speculative ones included.
    pub evaluated: u64,
    /// Max rank load of the plan (0 when no replica helps).
    pub reached: u64,
    /// [`rackfill_balancer::metrics::lower_bound`] of the input.
    pub lower_bound: u64,
    /// Whether the probes picked their targets with one-instruction warp reductions over packed
    /// 32-bit (slack, rank) keys: every rank load below `2^(32 - ceil(log2 R))`, i.e. below
    /// 2^26 token-expert pairs at R=64 (otherwise a shuffle tree over 64-bit slacks).
    pub packed_keys: bool,
}

/// The quota planner on a device, for one layout, keeping its device buffers between layers.
pub struct DeviceQuotaSolver {
    exec: Arc<dyn Executor>,
    layout: Layout,
    u_min: u64,
    shape: SolverShape,
    main_offsets: DeviceBuffer,
    mains: DeviceBuffer,
    home: DeviceBuffer,
    load: DeviceBuffer,
    status: DeviceBuffer,
    plan: DevicePlan,
}

impl DeviceQuotaSolver {
    /// A solver for `layout` with the quota floor and target rule of
    /// [`rackfill_balancer::quota::QuotaPlanner::with_rule`].
    pub fn new(
        exec: Arc<dyn Executor>,
        layout: &Layout,
        u_min: u64,
        rule: TargetRule,
    ) -> Result<Self, CudaError> {
        let u_min = u_min.max(1);
        // The kernel's static shared memory (its search state) comes out of the same budget.
        let limit = exec.shared_limit("quota_solve")?;
        let shape = SolverShape::fit(layout, u_min, rule, limit)?;
        let mut offsets = Vec::with_capacity(layout.ranks() + 1);
        let mut mains = Vec::with_capacity(layout.experts());
        for r in 0..layout.ranks() {
            offsets.push(to_u32(mains.len(), "main offsets")?);
            mains.extend_from_slice(layout.main_experts(r));
        }
        offsets.push(to_u32(mains.len(), "main offsets")?);
        let capacity = shape.params.cumulative_capacity as usize;
        let plan = DevicePlan::alloc(exec.as_ref(), Stream::MAIN, layout, capacity)?;
        Ok(Self {
            main_offsets: exec.upload_u32(&offsets)?,
            mains: exec.upload_u32(&mains)?,
            home: exec.upload_u32(layout.home_map())?,
            load: exec.alloc_zeroed(8 * layout.ranks() * layout.experts())?,
            status: exec.alloc_zeroed(8 * STATUS_LEN)?,
            exec,
            layout: layout.clone(),
            u_min,
            shape,
            plan,
        })
    }

    /// Probe warps per launch and whether the load matrix is staged in shared memory.
    pub fn config(&self) -> (u32, bool) {
        (
            self.shape.params.warps,
            self.shape.params.load_in_shared != 0,
        )
    }

    /// Uploads `load` and queues the solve on `stream`; the plan stays on the device
    /// ([`Self::device_plan`]).
    pub fn solve_on(&mut self, stream: Stream, load: &LoadMatrix) -> Result<(), CudaError> {
        load.check_shape(&self.layout)?;
        let bytes: Vec<u8> = load
            .as_flat()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        self.exec.write_on(stream, &self.load, 0, &bytes)?;
        let p = &self.plan;
        let args = [
            KernelArg::params(&self.shape.params),
            KernelArg::from(&self.load),
            KernelArg::from(&self.main_offsets),
            KernelArg::from(&self.mains),
            KernelArg::from(&self.home),
            KernelArg::from(&self.status),
            KernelArg::from(&p.slots),
            KernelArg::from(&p.inst_offsets),
            KernelArg::from(&p.inst_rank),
            KernelArg::from(&p.inst_quota),
            KernelArg::from(&p.split_offsets),
            KernelArg::from(&p.cumulative),
        ];
        let launch = Launch {
            grid: [1, 1, 1],
            block: self.shape.params.warps * 32,
            shared_bytes: self.shape.shared_bytes as u32,
        };
        // SAFETY: the arguments match `quota_solve`'s signature one for one; every buffer has the
        // size the shape's parameters promise the kernel (allocated from the same layout).
        unsafe { self.exec.launch_on(stream, "quota_solve", launch, &args) }
    }

    /// The plan of the last solve, on the device.
    pub fn device_plan(&self) -> &DevicePlan {
        &self.plan
    }

    /// The kernel's status words (word 0 nonzero: it failed); [`super::tile_plan`] reads them
    /// to plan nothing after a failed solve.
    pub fn status(&self) -> &DeviceBuffer {
        &self.status
    }

    /// Waits for the last solve (queued on `stream`, or ordered before it) and returns its
    /// statistics (an error if the kernel reported one).
    pub fn stats_on(&self, stream: Stream) -> Result<SolveStats, CudaError> {
        let s = self.exec.download_u64_on(stream, &self.status)?;
        if s[0] != 0 {
            return Err(CudaError::Solver(s[0]));
        }
        Ok(SolveStats {
            replicas: s[1],
            rounds: s[3],
            probes: s[4],
            evaluated: s[5],
            reached: s[6],
            lower_bound: s[7],
            packed_keys: s[8] != 0,
        })
    }

    /// Solves `load` on the main stream and downloads the plan, validated against the layout
    /// and load.
    pub fn plan(&mut self, load: &LoadMatrix) -> Result<(Plan, SolveStats), CudaError> {
        self.solve_on(Stream::MAIN, load)?;
        self.download(Stream::MAIN, load)
    }

    /// Downloads the last solve's plan for `load` after the work of `stream`, validated. On a
    /// stream other than the solve's, the caller orders it after the solve (an event), and the
    /// copy overlaps whatever the solve's stream runs next, e.g. the replica streaming of the
    /// plan.
    pub fn download(
        &self,
        stream: Stream,
        load: &LoadMatrix,
    ) -> Result<(Plan, SolveStats), CudaError> {
        let stats = self.stats_on(stream)?;
        let arrays = self.plan.download(self.exec.as_ref(), stream)?;
        let plan = arrays.into_plan(&self.layout, load, self.u_min)?;
        Ok((plan, stats))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_layout_is_aligned_disjoint_and_fits_h100_for_the_paper_shape() {
        let layout = Layout::contiguous(64, 256, 2).unwrap();
        let h100 = 227 * 1024;
        let shape = SolverShape::fit(&layout, 1, TargetRule::BestFit, h100).unwrap();
        assert!(shape.shared_bytes <= h100);
        assert_eq!(shape.params.load_in_shared, 1, "64 x 256 loads are staged");
        assert!(shape.params.warps >= 8);
        let p = shape.params;
        let (r, e, m) = (64u32, 256u32, 128u32);
        let w = p.warps;
        let mut regions = [
            (p.sh_load, 8 * r * e),
            (p.sh_totals, 8 * e),
            (p.sh_main_quota, 8 * e),
            (p.sh_rank_load, 8 * r),
            (p.sh_main_offsets, 4 * (r + 1)),
            (p.sh_hottest, 4 * e),
            (p.sh_by_load, 4 * r),
            (p.sh_best, 16 * m),
            (p.sh_sorted, 16 * m),
            (p.sh_first_prefix, 4 * (m + 1)),
            (p.sh_distinct, 4 * m),
            (p.sh_warps, p.warp_stride * w),
        ];
        regions.sort_unstable();
        for pair in regions.windows(2) {
            assert!(pair[0].0 + pair[0].1 <= pair[1].0, "{pair:?} overlap");
        }
        assert!(regions.iter().all(|(at, _)| at % 8 == 0));
        let last = regions.last().unwrap();
        assert_eq!((last.0 + last.1) as usize, shape.shared_bytes);
        let mut inner = [
            (p.w_a, 8 * r),
            (p.w_b, 8 * r),
            (p.w_c, 8 * r),
            (p.w_quota, 8 * m),
            (p.w_free, 4 * r),
            (p.w_expert, 4 * m),
            (p.w_rank, 4 * m),
        ];
        inner.sort_unstable();
        for pair in inner.windows(2) {
            assert!(pair[0].0 + pair[0].1 <= pair[1].0, "{pair:?} overlap");
        }
        assert!(inner.last().map(|(a, n)| a + n).unwrap() <= p.warp_stride);
        // The host and kernel structs agree in size: 8 + 28 * 4 bytes.
        assert_eq!(std::mem::size_of::<SolverParams>(), 120);
    }

    #[test]
    fn small_devices_drop_staging_then_warps_and_refuse_what_cannot_fit() {
        let layout = Layout::contiguous(64, 256, 2).unwrap();
        let shape = SolverShape::fit(&layout, 1, TargetRule::BestFit, 48 * 1024).unwrap();
        assert_eq!(shape.params.load_in_shared, 0);
        assert!(shape.shared_bytes <= 48 * 1024);
        let err = SolverShape::fit(&layout, 1, TargetRule::BestFit, 1024).unwrap_err();
        assert!(matches!(err, CudaError::SharedMemory { .. }), "{err}");
    }
}
