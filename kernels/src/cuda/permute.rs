//! Host side of the GPU token permute (`kernels/cuda/permute.cu`), step for step the CPU
//! reference in [`crate::permute`] and bitwise equal to it:
//!
//! 1. [`permute_tokens`] (source rank): each token-expert pair goes to an instance by cumulative
//!    quota and lands in its destination rank's segment of one send buffer, in pair order;
//! 2. [`group_by_instance`] (destination rank): the received rows regrouped into one block per
//!    (expert, instance), rows in sender order, for one GEMM each; [`DeviceGroups::return_outputs`]
//!    puts the outputs back in received order;
//! 3. [`combine`] (source rank): each token's outputs summed with its router weights in top-k order.
//!
//! The plan is read from a [`DevicePlan`]: the quota solver's outputs, or a host plan uploaded.

use super::{to_u32, CudaError, DevicePlan, Gpu};
use crate::permute::check_len;
use crate::permute::InstanceGroup;
use crate::KernelError;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

/// Threads per block for row copies: enough to cover typical hidden sizes in one pass.
const ROW_THREADS: u32 = 256;
/// Grid cap for grid-stride kernels.
const MAX_BLOCKS: u32 = 65_535;

fn rows_cfg(rows: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.clamp(1, MAX_BLOCKS), 1, 1),
        block_dim: (ROW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn items_cfg(items: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (items.div_ceil(256).clamp(1, MAX_BLOCKS), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Shared memory `stable_rank_by_key` may use without opting in.
const RANK_SHARED: usize = 48 * 1024;

/// Stable counting by key on the device: position of each item among earlier items with its
/// key, and the exclusive per-key offsets followed by the count of keys out of range.
struct DeviceRanked {
    pos: CudaSlice<u32>,
    /// `n_keys + 1` offsets, then the bad-key counter: one download brings both back.
    offsets: CudaSlice<u32>,
}

/// A [`DeviceRanked`] whose offsets the host has (it sizes buffers with them).
struct Ranked {
    pos: CudaSlice<u32>,
    offsets: CudaSlice<u32>,
    host_offsets: Vec<u32>,
}

/// Ranks `keys` and downloads the offsets; keys out of range are a [`CudaError::DeviceInput`]
/// about `what`.
fn stable_rank(
    gpu: &Gpu,
    keys: &CudaSlice<u32>,
    n: u32,
    n_keys: usize,
    what: &'static str,
) -> Result<Ranked, CudaError> {
    let DeviceRanked { pos, offsets } = stable_rank_on_device(gpu, keys, n, n_keys)?;
    let mut host_offsets = gpu.stream().clone_dtoh(&offsets)?;
    let bad = host_offsets.pop().unwrap_or(0);
    if bad != 0 {
        return Err(CudaError::DeviceInput { what, count: bad });
    }
    Ok(Ranked {
        pos,
        host_offsets,
        offsets,
    })
}

/// Enqueues the ranking only (no host round trip).
fn stable_rank_on_device(
    gpu: &Gpu,
    keys: &CudaSlice<u32>,
    n: u32,
    n_keys: usize,
) -> Result<DeviceRanked, CudaError> {
    let s = gpu.stream();
    let n_keys32 = to_u32(n_keys, "keys")?;
    let warps = (RANK_SHARED / 4 / n_keys.max(1)).saturating_sub(1).min(32);
    if warps == 0 {
        return Err(CudaError::SharedMemory {
            what: "stable_rank_by_key",
            needed: 8 * n_keys,
            limit: RANK_SHARED,
        });
    }
    let mut pos = s.alloc_zeros::<u32>(n.max(1) as usize)?;
    let mut offsets = s.alloc_zeros::<u32>(n_keys + 2)?;
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (warps as u32 * 32, 1, 1),
        shared_mem_bytes: ((warps + 1) * n_keys * 4) as u32,
    };
    {
        let (mut key_offsets, mut bad) = offsets.split_at_mut(n_keys + 1);
        let mut launch = s.launch_builder(gpu.function("stable_rank_by_key"));
        launch
            .arg(keys)
            .arg(&n)
            .arg(&n_keys32)
            .arg(&mut pos)
            .arg(&mut key_offsets)
            .arg(&mut bad);
        // SAFETY: arguments match the kernel; `keys` holds at least `n` entries (callers'
        // buffers), `key_offsets` n_keys + 1 and `bad` one.
        unsafe { launch.launch(cfg) }?;
    }
    Ok(DeviceRanked { pos, offsets })
}

/// One source rank's all-to-all send side, on the device: rows grouped by destination rank
/// (rank `d`'s segment is `dest_offsets[d]..dest_offsets[d + 1]`), in pair order within a segment
/// (the rows [`crate::permute_tokens`] puts in its `DispatchBuffers` for `d`).
pub struct DeviceDispatch {
    pub rows: CudaSlice<f32>,
    pub pairs: CudaSlice<u32>,
    pub experts: CudaSlice<u32>,
    pub instances: CudaSlice<u32>,
    /// Row of each pair in the send buffer (what the returned outputs are read back through).
    pub row_of_pair: CudaSlice<u32>,
    /// `R + 1` offsets of the destination segments.
    pub dest_offsets: Vec<u32>,
}

impl DeviceDispatch {
    /// Rows sent in total.
    pub fn len(&self) -> usize {
        self.dest_offsets.last().copied().unwrap_or(0) as usize
    }

    /// Whether nothing is sent.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One source rank's routed batch on the device.
#[derive(Clone, Copy)]
pub struct Routed<'a> {
    /// `tokens x hidden` activations.
    pub x: &'a CudaSlice<f32>,
    /// `tokens * top_k` routed expert ids (pair `p = token * top_k + k`), at least `pairs` long.
    pub experts: &'a CudaSlice<u32>,
    /// Token-expert pairs, `tokens * top_k`.
    pub pairs: usize,
    pub hidden: usize,
    pub top_k: usize,
}

/// [`crate::permute_tokens`] on the device for source rank `src_rank`.
pub fn permute_tokens(
    gpu: &Gpu,
    plan: &DevicePlan,
    src_rank: usize,
    routed: Routed<'_>,
) -> Result<DeviceDispatch, CudaError> {
    let Routed {
        x,
        experts,
        pairs,
        hidden,
        top_k,
    } = routed;
    if hidden == 0 {
        return Err(KernelError::ZeroDimension { what: "hidden" }.into());
    }
    if top_k == 0 {
        return Err(KernelError::ZeroDimension { what: "top_k" }.into());
    }
    if pairs % top_k != 0 {
        return Err(KernelError::NotMultiple {
            what: "experts",
            len: pairs,
            of: top_k,
        }
        .into());
    }
    if src_rank >= plan.ranks() {
        return Err(KernelError::OutOfRange {
            what: "source rank",
            value: src_rank as u64,
            limit: plan.ranks() as u64,
        }
        .into());
    }
    let tokens = pairs / top_k;
    check_len("x", x.len(), tokens * hidden)?;
    check_len("experts", experts.len(), pairs.max(1))?;
    let n = to_u32(pairs, "pairs")?;
    let s = gpu.stream();
    // Not downloaded: a routed expert out of range gets no instance and no destination
    // (`lookup_instance`), so the ranking by destination below counts and reports it.
    let by_expert = stable_rank_on_device(gpu, experts, n, plan.experts())?;
    let mut instance = s.alloc_zeros::<u32>(pairs.max(1))?;
    let mut dest = s.alloc_zeros::<u32>(pairs.max(1))?;
    if n > 0 {
        let (src32, e32) = (
            to_u32(src_rank, "rank")?,
            to_u32(plan.experts(), "experts")?,
        );
        let mut launch = s.launch_builder(gpu.function("lookup_instance"));
        launch
            .arg(experts)
            .arg(&by_expert.pos)
            .arg(&n)
            .arg(&src32)
            .arg(&e32)
            .arg(&plan.inst_offsets)
            .arg(&plan.inst_rank)
            .arg(&plan.split_offsets)
            .arg(&plan.cumulative)
            .arg(&mut instance)
            .arg(&mut dest);
        // SAFETY: arguments match the kernel; every buffer holds `n` entries or the plan's arrays.
        unsafe { launch.launch(items_cfg(n)) }?;
    }
    let by_dest = stable_rank(gpu, &dest, n, plan.ranks(), "routed experts")?;
    let mut out = DeviceDispatch {
        rows: s.alloc_zeros((pairs * hidden).max(1))?,
        pairs: s.alloc_zeros(pairs.max(1))?,
        experts: s.alloc_zeros(pairs.max(1))?,
        instances: s.alloc_zeros(pairs.max(1))?,
        row_of_pair: s.alloc_zeros(pairs.max(1))?,
        dest_offsets: by_dest.host_offsets.clone(),
    };
    if n > 0 {
        let (h32, k32) = (to_u32(hidden, "hidden")?, to_u32(top_k, "top_k")?);
        let mut launch = s.launch_builder(gpu.function("scatter_rows"));
        launch
            .arg(x)
            .arg(&n)
            .arg(&h32)
            .arg(&k32)
            .arg(&dest)
            .arg(&by_dest.pos)
            .arg(&by_dest.offsets)
            .arg(experts)
            .arg(&instance)
            .arg(&mut out.rows)
            .arg(&mut out.pairs)
            .arg(&mut out.experts)
            .arg(&mut out.instances)
            .arg(&mut out.row_of_pair);
        // SAFETY: arguments match the kernel; output buffers hold `n` rows.
        unsafe { launch.launch(rows_cfg(n)) }?;
    }
    Ok(out)
}

/// Everything one rank received, regrouped on the device by expert instance.
pub struct DeviceGroups {
    /// `rows x hidden`, group after group (same order as [`Self::groups`]).
    pub rows: CudaSlice<f32>,
    groups: Vec<InstanceGroup>,
    /// Grouped row of each received row.
    row_of: CudaSlice<u32>,
    received: usize,
    hidden: usize,
}

impl DeviceGroups {
    /// The groups, ascending by (expert, instance).
    pub fn groups(&self) -> &[InstanceGroup] {
        &self.groups
    }

    /// Routes grouped outputs (`rows x hidden`, same order as [`Self::rows`]) back to received
    /// order: row `i` of the result is the output of received row `i`.
    pub fn return_outputs(
        &self,
        gpu: &Gpu,
        outputs: &CudaSlice<f32>,
    ) -> Result<CudaSlice<f32>, CudaError> {
        check_len(
            "outputs",
            outputs.len(),
            (self.received * self.hidden).max(1),
        )?;
        let s = gpu.stream();
        let mut back = s.alloc_zeros::<f32>((self.received * self.hidden).max(1))?;
        if self.received > 0 {
            let (n, h) = (
                to_u32(self.received, "rows")?,
                to_u32(self.hidden, "hidden")?,
            );
            let mut launch = s.launch_builder(gpu.function("gather_rows"));
            launch
                .arg(outputs)
                .arg(&self.row_of)
                .arg(&n)
                .arg(&h)
                .arg(&mut back);
            // SAFETY: arguments match the kernel; `row_of` holds rows < received.
            unsafe { launch.launch(rows_cfg(n)) }?;
        }
        Ok(back)
    }
}

/// What one rank received in the all-to-all, concatenated in sender order.
#[derive(Clone, Copy)]
pub struct Received<'a> {
    /// `len x hidden` rows.
    pub rows: &'a CudaSlice<f32>,
    pub experts: &'a CudaSlice<u32>,
    pub instances: &'a CudaSlice<u32>,
    pub len: usize,
    pub hidden: usize,
}

/// [`crate::group_by_instance`] on the device for rank `rank`; rows whose instance is not
/// computed on `rank` are an error. `inst_offsets` is the plan's [`PlanArrays::inst_offsets`]
/// held on the host (the caller has the plan), so grouping downloads no plan data; it must
/// describe the same plan as `plan`.
pub fn group_by_instance(
    gpu: &Gpu,
    plan: &DevicePlan,
    inst_offsets: &[u32],
    rank: usize,
    received: Received<'_>,
) -> Result<DeviceGroups, CudaError> {
    let Received {
        rows,
        experts,
        instances,
        len: received,
        hidden,
    } = received;
    if hidden == 0 {
        return Err(KernelError::ZeroDimension { what: "hidden" }.into());
    }
    check_len("rows", rows.len(), (received * hidden).max(1))?;
    check_len("experts", experts.len(), received.max(1))?;
    check_len("instances", instances.len(), received.max(1))?;
    check_len("instance offsets", inst_offsets.len(), plan.experts() + 1)?;
    let s = gpu.stream();
    let n = to_u32(received, "rows")?;
    let n_keys = inst_offsets[plan.experts()] as usize;
    let mut keys = s.alloc_zeros::<u32>(received.max(1))?;
    if n > 0 {
        let (e32, r32) = (to_u32(plan.experts(), "experts")?, to_u32(rank, "rank")?);
        let mut launch = s.launch_builder(gpu.function("instance_keys"));
        launch
            .arg(experts)
            .arg(instances)
            .arg(&n)
            .arg(&e32)
            .arg(&r32)
            .arg(&plan.inst_offsets)
            .arg(&plan.inst_rank)
            .arg(&mut keys);
        // SAFETY: arguments match the kernel.
        unsafe { launch.launch(items_cfg(n)) }?;
    }
    let ranked = stable_rank(
        gpu,
        &keys,
        n,
        n_keys,
        "received rows (misrouted or unknown)",
    )?;
    let mut grouped = s.alloc_zeros::<f32>((received * hidden).max(1))?;
    let mut origin = s.alloc_zeros::<u32>(received.max(1))?;
    let mut row_of = s.alloc_zeros::<u32>(received.max(1))?;
    if n > 0 {
        let (h32, one) = (to_u32(hidden, "hidden")?, 1u32);
        let null = 0u64;
        let mut launch = s.launch_builder(gpu.function("scatter_rows"));
        launch
            .arg(rows)
            .arg(&n)
            .arg(&h32)
            .arg(&one)
            .arg(&keys)
            .arg(&ranked.pos)
            .arg(&ranked.offsets)
            .arg(&null)
            .arg(&null)
            .arg(&mut grouped)
            .arg(&mut origin)
            .arg(&null)
            .arg(&null)
            .arg(&mut row_of);
        // SAFETY: arguments match the kernel (null metadata pointers are skipped by it).
        unsafe { launch.launch(rows_cfg(n)) }?;
    }
    let mut groups = Vec::new();
    for e in 0..plan.experts() {
        for key in inst_offsets[e]..inst_offsets[e + 1] {
            let (lo, hi) = (
                ranked.host_offsets[key as usize],
                ranked.host_offsets[key as usize + 1],
            );
            if hi > lo {
                groups.push(InstanceGroup {
                    expert: e as u32,
                    instance: key - inst_offsets[e],
                    rows: lo as usize..hi as usize,
                });
            }
        }
    }
    Ok(DeviceGroups {
        rows: grouped,
        groups,
        row_of,
        received,
        hidden,
    })
}

/// [`crate::scatter_pairs`] + [`crate::combine`] on the device: `rows` are the outputs in the
/// send buffer's layout (each destination's returned segment in place), read through
/// `dispatch.row_of_pair`; `weights` the `tokens * top_k` router weights.
pub fn combine(
    gpu: &Gpu,
    dispatch: &DeviceDispatch,
    rows: &CudaSlice<f32>,
    weights: &CudaSlice<f32>,
    tokens: usize,
    top_k: usize,
    hidden: usize,
) -> Result<CudaSlice<f32>, CudaError> {
    if hidden == 0 {
        return Err(KernelError::ZeroDimension { what: "hidden" }.into());
    }
    let pairs = tokens * top_k;
    if dispatch.len() != pairs {
        return Err(KernelError::Length {
            what: "dispatched pairs",
            len: dispatch.len(),
            expected: pairs,
        }
        .into());
    }
    check_len("weights", weights.len(), pairs.max(1))?;
    check_len("rows", rows.len(), (pairs * hidden).max(1))?;
    let s = gpu.stream();
    let mut out = s.alloc_zeros::<f32>((tokens * hidden).max(1))?;
    if tokens > 0 {
        let t32 = to_u32(tokens, "tokens")?;
        let (k32, h32) = (to_u32(top_k, "top_k")?, to_u32(hidden, "hidden")?);
        let mut launch = s.launch_builder(gpu.function("combine_topk"));
        launch
            .arg(rows)
            .arg(&dispatch.row_of_pair)
            .arg(weights)
            .arg(&t32)
            .arg(&k32)
            .arg(&h32)
            .arg(&mut out);
        // SAFETY: arguments match the kernel; `row_of_pair` holds rows < pairs.
        unsafe { launch.launch(rows_cfg(t32)) }?;
    }
    Ok(out)
}
