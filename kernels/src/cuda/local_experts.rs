//! A layer's routed experts when every expert is local (the whole-model path,
//! `rackfill_models::gpu::GpuModel::forward`): the router's pairs ranked by expert
//! (`stable_rank_by_key`) and their rows grouped (`scatter_rows_bf16`) on the device; then the
//! tile table built there too (`expert_tiles`) and both grouped GEMMs run, so the host never
//! sees the routing: no copy back, no wait, inside the layer. Where the grouped kernels cannot
//! take the shape, or the per-expert cuBLAS baseline is asked for, only the per-expert row
//! offsets come back to size [`GroupedExperts`]' groups.

use super::exec::{DeviceBuffer, Executor, ExecutorExt, KernelArg, Launch, Stream};
use super::grouped_gemm::{
    launch_tiles, ExpertGemms, ExpertGroup, ExpertRows, GroupedExperts, TILE_ROWS,
};
use super::ranking::rank_by_key;
use super::{to_u32, CudaError};

/// Bytes of one tile table entry (`ExpertTile` in grouped_gemm.cu).
const TILE_BYTES: usize = 24;
/// Threads per block of the row scatter and of `expert_tiles`.
const THREADS: u32 = 256;

/// Every expert of one MoE layer, resident on the device, with the weight table the
/// device-built tile tables point into.
pub struct LocalExperts {
    /// Each expert's bf16 gate-up `[2I, H]` and down `[H, I]` addresses, in expert order.
    pointers: Vec<(u64, u64)>,
    /// The same as u64 `[E, 2]` on the device; `None` when the grouped kernels cannot take the
    /// shape (sizes not multiples of 8, or a weight not 16-byte aligned).
    table: Option<DeviceBuffer>,
    hidden: usize,
    inter: usize,
}

/// What [`LocalExperts::run`] leaves on the device.
pub struct ExpertOutputs {
    /// f32 `[pairs, H]`: each pair's expert output, pairs grouped by expert.
    pub out: DeviceBuffer,
    /// u32 `[pairs]`: pair (token-major, `row * k + j`) to its row of `out`.
    pub row_of: DeviceBuffer,
}

impl LocalExperts {
    /// The experts `experts` (`(gate_up, down)` device addresses per expert, in expert
    /// order) of a layer with `hidden` and `inter`, their weight table uploaded when the grouped
    /// kernels can take the shape.
    pub fn upload(
        exec: &dyn Executor,
        experts: &[(u64, u64)],
        (hidden, inter): (usize, usize),
    ) -> Result<Self, CudaError> {
        to_u32(hidden.max(inter), "hidden and intermediate size")?;
        let aligned = experts
            .iter()
            .all(|&(g, d)| g.is_multiple_of(16) && d.is_multiple_of(16));
        let table = if hidden.is_multiple_of(8) && inter.is_multiple_of(8) && aligned {
            let bytes: Vec<u8> = experts
                .iter()
                .flat_map(|&(g, d)| g.to_le_bytes().into_iter().chain(d.to_le_bytes()))
                .collect();
            Some(exec.upload(&bytes)?)
        } else {
            None
        };
        Ok(Self {
            pointers: experts.to_vec(),
            table,
            hidden,
            inter,
        })
    }

    /// Queues the layer's experts on the main stream for `rows` rows of bf16 input `x`
    /// (`[rows, H]`) whose router chose `ids` (u32 `[rows, top_k]`, each below the expert
    /// count): every pair's rows grouped by expert in token order (the CPU path's grouping),
    /// then, with [`ExpertGemms::Grouped`] and a weight table, one launch of each grouped GEMM
    /// over a tile table built on the device and sized for the worst case
    /// (`ceil(pairs / TILE_ROWS) + E` entries; blocks past the last tile return at once);
    /// otherwise the per-expert row offsets are copied back and the groups run as `gemms` says.
    pub fn run(
        &self,
        exec: &dyn Executor,
        x: &DeviceBuffer,
        (rows, top_k): (usize, usize),
        ids: &DeviceBuffer,
        gemms: ExpertGemms,
    ) -> Result<ExpertOutputs, CudaError> {
        let stream = Stream::MAIN;
        let (h, i, e) = (self.hidden, self.inter, self.pointers.len());
        let pairs = rows * top_k;
        let ranked = rank_by_key(exec, stream, ids.ptr(), pairs, e)?;
        let grouped = exec.alloc_zeroed(pairs * h * 2)?;
        let index = exec.alloc_zeroed(pairs * 4)?;
        let row_of = exec.alloc_zeroed(pairs * 4)?;
        let u32_arg = |v: usize| to_u32(v, "size").map(KernelArg::U32);
        let args = [
            KernelArg::Ptr(x.ptr()),
            u32_arg(pairs)?,
            u32_arg(h)?,
            u32_arg(top_k)?,
            KernelArg::Ptr(ids.ptr()),
            KernelArg::Ptr(ranked.pos.ptr()),
            KernelArg::Ptr(ranked.offsets.ptr()),
            KernelArg::Ptr(0),
            KernelArg::Ptr(0),
            KernelArg::Ptr(grouped.ptr()),
            KernelArg::Ptr(index.ptr()),
            KernelArg::Ptr(0),
            KernelArg::Ptr(0),
            KernelArg::Ptr(row_of.ptr()),
        ];
        let blocks = Launch::blocks(pairs.clamp(1, 65_535) as u32, THREADS);
        // SAFETY: `scatter_rows_bf16(in_rows[rows, H], n = pairs, hidden, row_div = top_k, key =
        // ids, pos, offsets, null, null, out_rows[pairs, H], out_index[pairs], null, null,
        // out_row_of[pairs])`: pair p reads row p / top_k and lands at offsets[id] + pos[p].
        unsafe { exec.launch_on(stream, "scatter_rows_bf16", blocks, &args) }?;
        let (act, out) = (
            exec.alloc_zeroed(pairs * i * 2)?,
            exec.alloc_zeroed(pairs * h * 4)?,
        );
        let rows_io = ExpertRows {
            x: grouped.ptr(),
            act: act.ptr(),
            out: out.ptr(),
        };
        match (&self.table, gemms) {
            (Some(weights), ExpertGemms::Grouped) => {
                let bound = pairs.div_ceil(TILE_ROWS) + e;
                let table = exec.alloc_zeroed(bound * TILE_BYTES)?;
                let args = [
                    KernelArg::Ptr(ranked.offsets.ptr()),
                    KernelArg::Ptr(weights.ptr()),
                    u32_arg(e)?,
                    KernelArg::Ptr(table.ptr()),
                ];
                let one = Launch {
                    grid: [1, 1, 1],
                    block: THREADS,
                    shared_bytes: (e * 4) as u32,
                };
                // SAFETY: `expert_tiles(offsets[E + 1], weights[E, 2], n_experts,
                // tiles[bound])`: the ranking's offsets, this layer's weight table; at most
                // `bound` tiles are written.
                unsafe { exec.launch_on(stream, "expert_tiles", one, &args) }?;
                launch_tiles(exec, stream, (table.ptr(), bound), (h, i), &rows_io)?;
            }
            _ => {
                let offsets = exec.download_u32(&ranked.offsets)?;
                let groups = self
                    .pointers
                    .iter()
                    .enumerate()
                    .map(|(expert, &(gate_up, down))| ExpertGroup {
                        start: offsets[expert] as usize,
                        rows: (offsets[expert + 1] - offsets[expert]) as usize,
                        gate_up,
                        down,
                    })
                    .collect();
                GroupedExperts::new(exec, stream, (h, i), gemms, rows_io, groups)?.run_all()?;
            }
        }
        Ok(ExpertOutputs { out, row_of })
    }
}
