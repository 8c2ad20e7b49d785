//! The MoE data plane's steps, each a few kernel launches, copies or GEMMs queued on one stream
//! of an [`Executor`]: pair ranking, the source permute, grouping and the grouped expert GEMMs
//! ([`super::super::grouped_gemm`]), and the combine.

use super::super::exec::{DeviceBuffer, Executor, KernelArg, Launch, Stream};
use super::super::grouped_gemm::{ExpertGemms, ExpertGroup, ExpertRows, GroupedExperts};
use super::super::ranking::{rank_by_key, Ranked};
use super::super::{to_u32, CudaError, DevicePlan};

/// Threads per block of the row kernels.
const THREADS: u32 = 256;

/// One source rank's pairs in its send layout: one segment per destination rank, in rank order.
pub(super) struct Sent {
    /// bf16 `[pairs, H]`.
    pub rows: DeviceBuffer,
    /// u32 `[pairs]`: each pair's expert.
    pub experts: DeviceBuffer,
    /// u32 `[pairs]`: each pair's instance of its expert.
    pub instances: DeviceBuffer,
    /// u32 `[pairs]`: pair (token-major) to its row in the send layout.
    pub row_of: DeviceBuffer,
}

/// The rows one destination received, senders in rank order.
pub(super) struct Received {
    /// bf16 `[len, H]`.
    pub rows: DeviceBuffer,
    /// u32 `[len]`.
    pub experts: DeviceBuffer,
    /// u32 `[len]`.
    pub instances: DeviceBuffer,
    pub len: usize,
}

/// One source rank's slice of the routed batch.
pub(super) struct Source<'a> {
    /// World rank.
    pub rank: usize,
    /// bf16 `[tokens, H]`.
    pub x: u64,
    /// u32 `[tokens * k]`.
    pub experts: u64,
    /// f32 `[tokens * k]`.
    pub weights: u64,
    /// f32 `[tokens, H]`: where the weighted sum is added.
    pub output: u64,
    pub tokens: usize,
    pub top_k: usize,
    /// The pairs' ranks among their expert's ([`Steps::rank_by_key`]).
    pub occurrence: &'a DeviceBuffer,
}

/// One group of rows an instance computes: rows `start..start + rows` of the grouped rows,
/// with the expert's bf16 weights at `weights` (`[2I, H]` gate-up rows then `[H, I]` down,
/// each stored as a linear layer's weight).
#[derive(Debug, Clone, Copy)]
pub(super) struct GroupWork {
    pub start: usize,
    pub rows: usize,
    pub weights: u64,
}

impl GroupWork {
    /// The group for the grouped GEMMs: its expert's gate-up weight, then the down weight
    /// right after it.
    fn expert_group(&self, hidden: usize, inter: usize) -> ExpertGroup {
        ExpertGroup {
            start: self.start,
            rows: self.rows,
            gate_up: self.weights,
            down: self.weights + (2 * inter * hidden * 2) as u64,
        }
    }
}

/// The executor, the stream the steps queue on, and the layer's dimensions.
pub(super) struct Steps<'a> {
    pub exec: &'a dyn Executor,
    pub stream: Stream,
    pub hidden: usize,
    pub inter: usize,
    pub experts: usize,
}

impl Steps<'_> {
    fn alloc(&self, bytes: usize) -> Result<DeviceBuffer, CudaError> {
        self.exec.alloc_zeroed_on(self.stream, bytes)
    }

    /// # Safety
    /// As [`Executor::launch_on`].
    unsafe fn launch(
        &self,
        kernel: &str,
        launch: Launch,
        args: &[KernelArg],
    ) -> Result<(), CudaError> {
        // SAFETY: the caller's contract.
        unsafe { self.exec.launch_on(self.stream, kernel, launch, args) }
    }

    /// `stable_rank_by_key` over `n` u32 keys at device address `keys`, on this stream.
    pub fn rank_by_key(&self, keys: u64, n: usize, n_keys: usize) -> Result<Ranked, CudaError> {
        rank_by_key(self.exec, self.stream, keys, n, n_keys)
    }

    /// A source's pairs into its send layout: instance by cumulative quota, destination rank,
    /// then each pair's row (its token's bf16 activations) scattered to its segment (`ranks`
    /// segments, world ranks in order).
    pub fn permute(
        &self,
        plan: &DevicePlan,
        source: &Source<'_>,
        ranks: usize,
    ) -> Result<Sent, CudaError> {
        let (h, n) = (self.hidden, source.tokens * source.top_k);
        let instance = self.alloc(n * 4)?;
        let dest = self.alloc(n * 4)?;
        let args = [
            KernelArg::Ptr(source.experts),
            ptr(source.occurrence),
            u32_arg(n)?,
            u32_arg(source.rank)?,
            u32_arg(self.experts)?,
            ptr(&plan.inst_offsets),
            ptr(&plan.inst_rank),
            ptr(&plan.split_offsets),
            ptr(&plan.cumulative),
            ptr(&instance),
            ptr(&dest),
        ];
        // SAFETY: `lookup_instance(experts[n], occ[n], n, src_rank, n_experts, inst_offsets,
        // inst_rank, split_offsets, cumulative, out_instance[n], out_dest[n])` on the plan's
        // arrays as `PlanArrays` lays them out.
        unsafe { self.launch("lookup_instance", item_blocks(n), &args) }?;
        let by_dest = self.rank_by_key(dest.ptr(), n, ranks)?;
        let sent = Sent {
            rows: self.alloc(n * h * 2)?,
            experts: self.alloc(n * 4)?,
            instances: self.alloc(n * 4)?,
            row_of: self.alloc(n * 4)?,
        };
        let index = self.alloc(n * 4)?;
        let args = [
            KernelArg::Ptr(source.x),
            u32_arg(n)?,
            u32_arg(h)?,
            u32_arg(source.top_k)?,
            ptr(&dest),
            ptr(&by_dest.pos),
            ptr(&by_dest.offsets),
            KernelArg::Ptr(source.experts),
            ptr(&instance),
            ptr(&sent.rows),
            ptr(&index),
            ptr(&sent.experts),
            ptr(&sent.instances),
            ptr(&sent.row_of),
        ];
        // SAFETY: `scatter_rows_bf16` with `n` pairs of `tokens = n / top_k` rows of `h` bf16;
        // every output holds `n` rows or words (the destinations' segments partition them).
        unsafe { self.launch("scatter_rows_bf16", row_blocks(n), &args) }?;
        Ok(sent)
    }

    /// An empty receive buffer for `len` rows.
    pub fn receive_buffer(&self, len: usize) -> Result<Received, CudaError> {
        Ok(Received {
            rows: self.alloc(len * self.hidden * 2)?,
            experts: self.alloc(len * 4)?,
            instances: self.alloc(len * 4)?,
            len,
        })
    }

    /// Rank `rank`'s received rows grouped by instance (`n_instances` global instances of the
    /// plan), then every group's expert MLP by the grouped GEMMs, groups in `order`: one launch
    /// for the groups up to the first that `waits`, and from each waiting group on, `wait(g)`
    /// (a replica's slot wait) queued first, one launch more. Returns the f32 outputs `[len, H]`
    /// in received order.
    pub fn experts(
        &self,
        plan: &DevicePlan,
        (rank, n_instances): (usize, usize),
        recv: &Received,
        (groups, order): (&[GroupWork], &[usize]),
        waits: &[bool],
        wait: &mut dyn FnMut(usize) -> Result<(), CudaError>,
    ) -> Result<DeviceBuffer, CudaError> {
        let (h, i, m) = (self.hidden, self.inter, recv.len);
        let key = self.alloc(m * 4)?;
        let args = [
            ptr(&recv.experts),
            ptr(&recv.instances),
            u32_arg(m)?,
            u32_arg(self.experts)?,
            u32_arg(rank)?,
            ptr(&plan.inst_offsets),
            ptr(&plan.inst_rank),
            ptr(&key),
        ];
        // SAFETY: `instance_keys(experts[m], instances[m], m, n_experts, rank, inst_offsets,
        // inst_rank, out_key[m])`.
        unsafe { self.launch("instance_keys", item_blocks(m), &args) }?;
        let by_instance = self.rank_by_key(key.ptr(), m, n_instances)?;
        let grouped = self.alloc(m * h * 2)?;
        let (index, row_of) = (self.alloc(m * 4)?, self.alloc(m * 4)?);
        let args = [
            ptr(&recv.rows),
            u32_arg(m)?,
            u32_arg(h)?,
            KernelArg::U32(1),
            ptr(&key),
            ptr(&by_instance.pos),
            ptr(&by_instance.offsets),
            KernelArg::Ptr(0),
            KernelArg::Ptr(0),
            ptr(&grouped),
            ptr(&index),
            KernelArg::Ptr(0),
            KernelArg::Ptr(0),
            ptr(&row_of),
        ];
        // SAFETY: `scatter_rows_bf16` of `m` received rows (one per item) into `m` grouped
        // rows; the metadata arrays are null, which the kernel skips.
        unsafe { self.launch("scatter_rows_bf16", row_blocks(m), &args) }?;

        let (act, out) = (self.alloc(m * i * 2)?, self.alloc(m * h * 4)?);
        let rows = ExpertRows {
            x: grouped.ptr(),
            act: act.ptr(),
            out: out.ptr(),
        };
        let ordered = order
            .iter()
            .map(|&g| groups[g].expert_group(h, i))
            .collect();
        let gemms = GroupedExperts::new(
            self.exec,
            self.stream,
            (h, i),
            ExpertGemms::Grouped,
            rows,
            ordered,
        )?;
        let mut run = 0;
        for (at, &g) in order.iter().enumerate() {
            if waits[g] {
                gemms.run(run..at)?;
                wait(g)?;
                run = at;
            }
        }
        gemms.run(run..order.len())?;
        let received = self.alloc(m * h * 4)?;
        let args = [
            ptr(&out),
            u32_arg(h)?,
            ptr(&row_of),
            u32_arg(m)?,
            ptr(&received),
        ];
        // SAFETY: `gather_rows_f32(x[m, H], dim, rows[m], n, out[m, H])`: each received row from
        // its grouped row.
        unsafe { self.launch("gather_rows_f32", row_blocks(m), &args) }?;
        Ok(received)
    }

    /// A source's outputs, returned into its send layout (f32 `[pairs, H]`), and their
    /// router-weighted sum in top-k order added into its output rows.
    pub fn combine(
        &self,
        source: &Source<'_>,
        sent: &Sent,
        returned: &DeviceBuffer,
    ) -> Result<(), CudaError> {
        let args = [
            ptr(returned),
            ptr(&sent.row_of),
            KernelArg::Ptr(source.weights),
            u32_arg(source.tokens)?,
            u32_arg(source.top_k)?,
            u32_arg(self.hidden)?,
            KernelArg::Ptr(source.output),
        ];
        // SAFETY: `combine_topk_rows(expert_out[n, H], pair_row[n], weights[n], tokens, k,
        // hidden, out[tokens, H])`, adding into the source's output rows.
        unsafe { self.launch("combine_topk_rows", row_blocks(source.tokens), &args) }
    }
}

fn ptr(buffer: &DeviceBuffer) -> KernelArg {
    KernelArg::Ptr(buffer.ptr())
}

fn u32_arg(v: usize) -> Result<KernelArg, CudaError> {
    Ok(KernelArg::U32(to_u32(v, "size")?))
}

/// Blocks of [`THREADS`] for `rows` grid-stride rows (at least one block).
fn row_blocks(rows: usize) -> Launch {
    Launch::blocks(rows.clamp(1, 65_535) as u32, THREADS)
}

/// Blocks of [`THREADS`] for `items` grid-stride items, one per thread.
fn item_blocks(items: usize) -> Launch {
    Launch::blocks(
        items.div_ceil(THREADS as usize).clamp(1, 65_535) as u32,
        THREADS,
    )
}
