//! The MoE data plane's steps, each a few kernel launches, copies or GEMMs queued on one stream
//! of an [`Executor`]: pair ranking, the source permute, grouping and the expert GEMMs, and the
//! combine.

use super::super::exec::{
    DType, DeviceBuffer, Executor, Gemm, KernelArg, Launch, MatrixRef, Stream, WeightLayout,
};
use super::super::{to_u32, CudaError, DevicePlan};

/// Threads per block of the row kernels.
const THREADS: u32 = 256;
/// Shared memory `stable_rank_by_key` may use without opting in.
const RANK_SHARED: usize = 48 * 1024;

/// A ranking on the device: each key's position among equal keys, and the exclusive prefix of
/// the key counts (`n_keys + 1` words) followed by the count of keys out of range.
pub(super) struct Ranked {
    pub pos: DeviceBuffer,
    pub offsets: DeviceBuffer,
}

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

    /// `stable_rank_by_key` over `n` u32 keys at device address `keys`.
    pub fn rank_by_key(&self, keys: u64, n: usize, n_keys: usize) -> Result<Ranked, CudaError> {
        let warps = (RANK_SHARED / 4 / n_keys.max(1))
            .saturating_sub(1)
            .min(THREADS as usize / 32);
        if warps == 0 {
            return Err(CudaError::SharedMemory {
                what: "stable_rank_by_key",
                needed: 8 * n_keys,
                limit: RANK_SHARED,
            });
        }
        let ranked = Ranked {
            pos: self.alloc(n * 4)?,
            offsets: self.alloc((n_keys + 2) * 4)?,
        };
        let launch = Launch {
            grid: [1, 1, 1],
            block: warps as u32 * 32,
            shared_bytes: ((warps + 1) * n_keys * 4) as u32,
        };
        let args = [
            KernelArg::Ptr(keys),
            u32_arg(n)?,
            u32_arg(n_keys)?,
            ptr(&ranked.pos),
            ptr(&ranked.offsets),
            KernelArg::Ptr(ranked.offsets.at((n_keys + 1) * 4)),
        ];
        // SAFETY: `stable_rank_by_key(keys, n, n_keys, out_pos[n], out_offsets[n_keys + 1],
        // out_bad)`; the caller's keys hold `n` words; the shared memory is the kernel's
        // `(warps + 1) * n_keys` words.
        unsafe { self.launch("stable_rank_by_key", launch, &args) }?;
        Ok(ranked)
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
    /// plan), then per group the gate-up GEMM, the activation and the down GEMM with its
    /// weights; `before[g]` runs before group `g`'s GEMMs are queued (a replica's slot wait).
    /// Groups run in `order`. Returns the f32 outputs `[len, H]` in received order.
    pub fn experts(
        &self,
        plan: &DevicePlan,
        (rank, n_instances): (usize, usize),
        recv: &Received,
        groups: &[GroupWork],
        order: &[usize],
        before: &mut dyn FnMut(usize) -> Result<(), CudaError>,
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

        let gate_up = self.alloc(m * 2 * i * 4)?;
        let act = self.alloc(m * i * 2)?;
        let out = self.alloc(m * h * 4)?;
        for &g in order {
            before(g)?;
            let GroupWork {
                start,
                rows,
                weights,
            } = groups[g];
            let linear = |a: (u64, DType, usize), b: u64, c: (u64, usize), k: usize| Gemm {
                m: rows,
                n: c.1,
                k,
                batch: 1,
                a: dense(a.0, a.1, a.2),
                b: dense(b, DType::Bf16, k),
                b_layout: WeightLayout::OutByIn,
                c: dense(c.0, DType::F32, c.1),
                alpha: 1.0,
                beta: 0.0,
            };
            let up = linear(
                (grouped.at(start * h * 2), DType::Bf16, h),
                weights,
                (gate_up.at(start * 2 * i * 4), 2 * i),
                h,
            );
            // SAFETY: rows `start..start + rows` of the grouped rows and the gate-up output;
            // `weights` addresses the group's expert, `[2I, H]` bf16 first.
            unsafe { self.exec.gemm_on(self.stream, &up) }?;
            let args = [
                KernelArg::Ptr(gate_up.at(start * 2 * i * 4)),
                u32_arg(rows)?,
                u32_arg(i)?,
                KernelArg::Ptr(act.at(start * i * 2)),
            ];
            // SAFETY: `silu_mul_to_bf16(gate_up[rows, 2I], rows, inter, out[rows, I])` on the
            // group's rows.
            unsafe { self.launch("silu_mul_to_bf16", row_blocks(rows), &args) }?;
            let down = linear(
                (act.at(start * i * 2), DType::Bf16, i),
                weights + (2 * i * h * 2) as u64,
                (out.at(start * h * 4), h),
                i,
            );
            // SAFETY: as above; the down projection `[H, I]` follows the gate-up in the expert.
            unsafe { self.exec.gemm_on(self.stream, &down) }?;
        }
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

fn dense(ptr: u64, dtype: DType, ld: usize) -> MatrixRef {
    MatrixRef {
        ptr,
        dtype,
        ld,
        batch_stride: 0,
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
