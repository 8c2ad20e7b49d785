//! The device data plane's steps, each a few kernel launches, copies or GEMMs on an
//! [`Executor`]: pair ranking, the plan's arrays, replica tile streaming, the source permute,
//! the exchange between rank buffers, grouping and the expert GEMMs, the return and the combine.

use rackfill_balancer::Plan;

use super::super::exec::{
    DType, DeviceBuffer, Executor, ExecutorExt, Gemm, KernelArg, Launch, MatrixRef, WeightLayout,
};
use super::super::tiles::TileStream;
use super::super::{to_u32, CudaError, PlanArrays};
use super::routes::Routes;

/// Threads per block of the row kernels and the tile stream.
const THREADS: u32 = 256;
/// Blocks of the persistent tile stream (each claims tiles until none is left).
const STREAM_BLOCKS: u32 = 64;
/// Shared memory `stable_rank_by_key` may use without opting in.
const RANK_SHARED: usize = 48 * 1024;

/// A ranking on the device: each key's position among equal keys, and the exclusive prefix of
/// the key counts (`n_keys + 1` words) followed by the count of keys out of range.
pub(super) struct Ranked {
    pub pos: DeviceBuffer,
    pub offsets: DeviceBuffer,
}

/// The plan's arrays the lookup kernels read.
pub(super) struct DevicePlanArrays {
    inst_offsets: DeviceBuffer,
    inst_rank: DeviceBuffer,
    split_offsets: DeviceBuffer,
    cumulative: DeviceBuffer,
    instances: usize,
}

/// One source rank's pairs in its send layout: one segment per destination rank.
pub(super) struct Sent {
    /// bf16 `[pairs, H]`.
    rows: DeviceBuffer,
    /// u32 `[pairs]`: each pair's expert, then its instance.
    experts: DeviceBuffer,
    instances: DeviceBuffer,
    /// u32 `[pairs]`: pair (token-major) to its row in the send layout.
    row_of: DeviceBuffer,
}

/// The rows one destination received, senders in rank order.
pub(super) struct Received {
    rows: DeviceBuffer,
    experts: DeviceBuffer,
    instances: DeviceBuffer,
    len: usize,
}

/// One source rank's slice of the routed batch.
pub(super) struct Source<'a> {
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

/// The executor and the layer's dimensions.
pub(super) struct Steps<'a> {
    pub exec: &'a dyn Executor,
    pub hidden: usize,
    pub inter: usize,
    pub experts: usize,
    pub ranks: usize,
}

impl Steps<'_> {
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
            pos: self.exec.alloc_zeroed(n * 4)?,
            offsets: self.exec.alloc_zeroed((n_keys + 2) * 4)?,
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
        unsafe { self.exec.launch("stable_rank_by_key", launch, &args) }?;
        Ok(ranked)
    }

    pub fn upload_plan(&self, plan: &Plan) -> Result<DevicePlanArrays, CudaError> {
        let arrays = PlanArrays::from_plan(plan)?;
        let cumulative: Vec<u8> = arrays
            .cumulative
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        Ok(DevicePlanArrays {
            inst_offsets: self.exec.upload_u32(&arrays.inst_offsets)?,
            inst_rank: self.exec.upload_u32(&arrays.inst_rank)?,
            split_offsets: self.exec.upload_u32(&arrays.split_offsets)?,
            cumulative: self.exec.upload(&cumulative)?,
            instances: arrays.inst_rank.len(),
        })
    }

    /// Runs the persistent tile kernel over `stream` between the ranks' `homes` and `slots`;
    /// fails if a relay chunk never landed.
    pub fn stream_tiles(
        &self,
        stream: &TileStream,
        homes: &[DeviceBuffer],
        slots: &[DeviceBuffer],
    ) -> Result<(), CudaError> {
        let exec = self.exec;
        let tasks: Vec<u8> = stream
            .tasks
            .iter()
            .flat_map(|t| {
                let words = [
                    t.src_rank,
                    t.src_kind,
                    t.len,
                    t.dst_begin,
                    t.n_dst,
                    t.wait_flag as u32,
                    t.wait_target,
                    t.reserved,
                ];
                [t.src_offset, t.tile_offset]
                    .into_iter()
                    .flat_map(u64::to_le_bytes)
                    .chain(words.into_iter().flat_map(u32::to_le_bytes))
            })
            .collect();
        let dsts: Vec<u8> = stream
            .dsts
            .iter()
            .flat_map(|d| {
                d.offset
                    .to_le_bytes()
                    .into_iter()
                    .chain(d.rank.to_le_bytes())
                    .chain(d.ready_flag.to_le_bytes())
            })
            .collect();
        let (tasks, dsts) = (exec.upload(&tasks)?, exec.upload(&dsts)?);
        let count = exec.upload_u32(&[to_u32(stream.tasks.len(), "tile tasks")?])?;
        // The claim counter, then the stall word.
        let claim = exec.alloc_zeroed(8)?;
        let flags = stream
            .flags_per_rank
            .iter()
            .map(|&n| exec.alloc_zeroed(n.max(1) as usize * 4))
            .collect::<Result<Vec<_>, _>>()?;
        let table = |buffers: &[DeviceBuffer]| {
            let ptrs: Vec<u8> = buffers.iter().flat_map(|b| b.ptr().to_le_bytes()).collect();
            exec.upload(&ptrs)
        };
        let (homes, slots, flags) = (table(homes)?, table(slots)?, table(&flags)?);
        let launch = Launch {
            grid: [(stream.tasks.len() as u32).min(STREAM_BLOCKS), 1, 1],
            block: THREADS,
            shared_bytes: 2 * stream.tile_bytes,
        };
        let args = [
            ptr(&tasks),
            ptr(&count),
            ptr(&dsts),
            ptr(&claim),
            ptr(&homes),
            ptr(&slots),
            ptr(&flags),
            KernelArg::U32(stream.tile_bytes),
            // No landed-byte counters: the layer's GEMMs wait for the whole stream.
            KernelArg::Ptr(0),
            KernelArg::U64(0),
            KernelArg::U32(0),
        ];
        // SAFETY: `tile_stream(tasks, task_count, dsts, next_task[2], home_base, slot_base,
        // flag_base, tile_bytes, landed, slot_bytes, n_slot)`; the stream passed
        // `check_runnable` and was compiled for these buffers' home offsets and slot sizes; every
        // flag buffer holds its rank's counters.
        unsafe { exec.launch("tile_stream", launch, &args) }?;
        let mut stalled = [0u8; 4];
        exec.read(&claim, 4, &mut stalled)?;
        if u32::from_le_bytes(stalled) != 0 {
            return Err(CudaError::Exec(
                "replica streaming stalled: a relay chunk never became ready".into(),
            ));
        }
        Ok(())
    }

    /// A source's pairs into its send layout: instance by cumulative quota, destination rank,
    /// then each pair's row (its token's bf16 activations) scattered to its segment.
    pub fn permute(&self, plan: &DevicePlanArrays, source: &Source<'_>) -> Result<Sent, CudaError> {
        let exec = self.exec;
        let (h, n) = (self.hidden, source.tokens * source.top_k);
        let instance = exec.alloc_zeroed(n * 4)?;
        let dest = exec.alloc_zeroed(n * 4)?;
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
        unsafe { exec.launch("lookup_instance", item_blocks(n), &args) }?;
        let by_dest = self.rank_by_key(dest.ptr(), n, self.ranks)?;
        let sent = Sent {
            rows: exec.alloc_zeroed(n * h * 2)?,
            experts: exec.alloc_zeroed(n * 4)?,
            instances: exec.alloc_zeroed(n * 4)?,
            row_of: exec.alloc_zeroed(n * 4)?,
        };
        let index = exec.alloc_zeroed(n * 4)?;
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
        unsafe { exec.launch("scatter_rows_bf16", row_blocks(n), &args) }?;
        Ok(sent)
    }

    /// Destination `dst`'s rows: each sender's segment for it, senders in rank order.
    pub fn receive(
        &self,
        sent: &[Option<Sent>],
        routes: &Routes,
        dst: usize,
    ) -> Result<Option<Received>, CudaError> {
        let len: usize = (0..self.ranks).map(|src| routes.sent(src, dst)).sum();
        if len == 0 {
            return Ok(None);
        }
        let row = self.hidden * 2;
        let exec = self.exec;
        let recv = Received {
            rows: exec.alloc_zeroed(len * row)?,
            experts: exec.alloc_zeroed(len * 4)?,
            instances: exec.alloc_zeroed(len * 4)?,
            len,
        };
        for (src, sent) in sent.iter().enumerate() {
            let n = routes.sent(src, dst);
            let Some(sent) = sent.as_ref().filter(|_| n > 0) else {
                continue;
            };
            let (from, to) = (routes.send_offset(src, dst), routes.recv_offset(src, dst));
            exec.copy(&sent.rows, from * row, &recv.rows, to * row, n * row)?;
            exec.copy(&sent.experts, from * 4, &recv.experts, to * 4, n * 4)?;
            exec.copy(&sent.instances, from * 4, &recv.instances, to * 4, n * 4)?;
        }
        Ok(Some(recv))
    }

    /// Rank `rank`'s expert compute: its received rows grouped by instance, per group the
    /// gate-up GEMM, the activation and the down GEMM with the weights at `weights[g]` (the
    /// group's expert: `[H, 2I]` gate-up then `[I, H]` down, bf16); f32 outputs `[len, H]` in
    /// received order.
    pub fn experts(
        &self,
        plan: &DevicePlanArrays,
        rank: usize,
        recv: &Received,
        groups: &[(u32, u32, usize)],
        weights: &[u64],
    ) -> Result<DeviceBuffer, CudaError> {
        let exec = self.exec;
        let (h, i, m) = (self.hidden, self.inter, recv.len);
        let key = exec.alloc_zeroed(m * 4)?;
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
        unsafe { exec.launch("instance_keys", item_blocks(m), &args) }?;
        let by_instance = self.rank_by_key(key.ptr(), m, plan.instances)?;
        let grouped = exec.alloc_zeroed(m * h * 2)?;
        let (index, row_of) = (exec.alloc_zeroed(m * 4)?, exec.alloc_zeroed(m * 4)?);
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
        unsafe { exec.launch("scatter_rows_bf16", row_blocks(m), &args) }?;

        let gate_up = exec.alloc_zeroed(m * 2 * i * 4)?;
        let act = exec.alloc_zeroed(m * i * 2)?;
        let out = exec.alloc_zeroed(m * h * 4)?;
        let mut start = 0;
        for (&(_, _, rows), &w) in groups.iter().zip(weights) {
            let gemm = |a: u64, k: usize, b: u64, c: u64, n: usize| Gemm {
                m: rows,
                n,
                k,
                batch: 1,
                a: dense(a, DType::Bf16, k),
                b: dense(b, DType::Bf16, n),
                b_layout: WeightLayout::InByOut,
                c: dense(c, DType::F32, n),
                alpha: 1.0,
                beta: 0.0,
            };
            let up = gemm(
                grouped.at(start * h * 2),
                h,
                w,
                gate_up.at(start * 2 * i * 4),
                2 * i,
            );
            // SAFETY: rows `start..start + rows` of the grouped rows and the gate-up output;
            // `w` addresses the group's expert, `[H, 2I]` bf16 first.
            unsafe { exec.gemm(&up) }?;
            start += rows;
        }
        let args = [ptr(&gate_up), u32_arg(m)?, u32_arg(i)?, ptr(&act)];
        // SAFETY: `silu_mul_to_bf16(gate_up[m, 2I], rows, inter, out[m, I])`.
        unsafe { exec.launch("silu_mul_to_bf16", row_blocks(m), &args) }?;
        start = 0;
        for (&(_, _, rows), &w) in groups.iter().zip(weights) {
            let down = Gemm {
                m: rows,
                n: h,
                k: i,
                batch: 1,
                a: dense(act.at(start * i * 2), DType::Bf16, i),
                b: dense(w + (h * 2 * i * 2) as u64, DType::Bf16, h),
                b_layout: WeightLayout::InByOut,
                c: dense(out.at(start * h * 4), DType::F32, h),
                alpha: 1.0,
                beta: 0.0,
            };
            // SAFETY: as above; the down projection `[I, H]` follows the gate-up in the expert.
            unsafe { exec.gemm(&down) }?;
            start += rows;
        }
        let received = exec.alloc_zeroed(m * h * 4)?;
        let args = [
            ptr(&out),
            ptr(&row_of),
            u32_arg(m)?,
            u32_arg(h)?,
            ptr(&received),
        ];
        // SAFETY: `gather_rows(src[m, H], index[m], n, hidden, out[m, H])`: each received row
        // from its grouped row.
        unsafe { exec.launch("gather_rows", row_blocks(m), &args) }?;
        Ok(received)
    }

    /// A source's outputs back from every destination into its send layout, and their
    /// router-weighted sum in top-k order added into its output rows.
    pub fn combine(
        &self,
        source: &Source<'_>,
        sent: &Sent,
        computed: &[Option<DeviceBuffer>],
        routes: &Routes,
    ) -> Result<(), CudaError> {
        let exec = self.exec;
        let (h, k, row) = (self.hidden, source.top_k, self.hidden * 4);
        let n = source.tokens * k;
        let returned = exec.alloc_zeroed(n * row)?;
        for (dst, computed) in computed.iter().enumerate() {
            let rows = routes.sent(source.rank, dst);
            let Some(computed) = computed.as_ref().filter(|_| rows > 0) else {
                continue;
            };
            let from = routes.recv_offset(source.rank, dst);
            let to = routes.send_offset(source.rank, dst);
            exec.copy(computed, from * row, &returned, to * row, rows * row)?;
        }
        let args = [
            ptr(&returned),
            ptr(&sent.row_of),
            KernelArg::Ptr(source.weights),
            u32_arg(source.tokens)?,
            u32_arg(k)?,
            u32_arg(h)?,
            KernelArg::Ptr(source.output),
        ];
        // SAFETY: `combine_topk_rows(expert_out[n, H], pair_row[n], weights[n], tokens, k,
        // hidden, out[tokens, H])`, adding into the source's output rows.
        unsafe { exec.launch("combine_topk_rows", row_blocks(source.tokens), &args) }?;
        Ok(())
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
