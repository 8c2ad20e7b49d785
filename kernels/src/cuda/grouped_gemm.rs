//! The routed experts' MLPs over rows grouped by expert instance, every group of a layer in one
//! launch of each half (`grouped_gemm.cu`): `grouped_gate_up_silu` (the gate and up GEMMs with
//! `silu(gate) * up` fused into their epilogue, rounded once to bf16) and `grouped_down` (into
//! f32). Both the EP data plane ([`super::moe`]) and the whole-model path run their experts
//! through [`GroupedExperts`], so one kernel pair serves both and one switch
//! ([`ExpertGemms::PerGroup`]) gives the per-instance cuBLAS baseline.
//!
//! The host already knows every group's row count (it sized the groups), so it cuts the groups
//! into row tiles of [`TILE_ROWS`] and uploads them once as a table: a block reads its tile from
//! `blockIdx.x` and its column tile from `blockIdx.y`, no block searches for work or idles, and a
//! group without rows has no tile. Groups are laid out in run order, so any run of consecutive
//! groups (the EP plane launches every instance whose weights are in place, then each replica
//! still streaming after its slot wait) is a contiguous range of the one table.

use std::ops::Range;

use super::exec::{DType, DeviceBuffer, Executor, Gemm, KernelArg, Launch, MatrixRef, Stream};
use super::exec::{ExecutorExt, WeightLayout};
use super::{to_u32, CudaError};
use crate::KernelError;

/// Rows per block tile.
pub const TILE_ROWS: usize = 64;
/// Activation columns per gate-up block (each with its gate and its up column).
const GATE_UP_COLS: usize = 64;
/// Output columns per down block.
const DOWN_COLS: usize = 128;
/// Threads per block: four warps of 32 x 64 (down) or 32 x 2·32 (gate-up) outputs.
const THREADS: u32 = 128;
/// Dynamic shared memory: two stages of a 64-row A tile and a 128-row B tile, rows of 32 bf16
/// plus 8 of padding (within the 48 KiB every device grants without opting in).
const SHARED_BYTES: u32 = 2 * (64 + 128) * (32 + 8) * 2;
/// Threads per block of `silu_mul_to_bf16` (per-group path).
const ROW_THREADS: u32 = 256;

/// One group of rows multiplied by one expert (an instance).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertGroup {
    /// The group's first row among the grouped rows.
    pub start: usize,
    /// Rows in the group (0: nothing runs).
    pub rows: usize,
    /// Device address of the expert's bf16 gate-up weight `[2I, H]`: gate rows, then up rows,
    /// each row a linear layer's ("out x in").
    pub gate_up: u64,
    /// Device address of its bf16 down weight `[H, I]`.
    pub down: u64,
}

/// Where the grouped rows are: device addresses of row 0 of each matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertRows {
    /// bf16 `[rows, H]`: the input.
    pub x: u64,
    /// bf16 `[rows, I]`: the activation between the halves (scratch; only group rows written).
    pub act: u64,
    /// f32 `[rows, H]`: the output (only group rows written).
    pub out: u64,
}

/// How the expert GEMMs run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertGemms {
    /// The grouped tensor-core kernels, one launch of each per run of groups; per group where
    /// [`ExpertGemms::grouped_supported`] says the kernels cannot take the shape.
    Grouped,
    /// Per group a cuBLAS gate-up GEMM into f32, `silu_mul_to_bf16`, and a cuBLAS down GEMM:
    /// the fallback, and the baseline a benchmark measures the grouped kernels against.
    PerGroup,
}

impl ExpertGemms {
    /// Whether the grouped kernels take `hidden` and `inter` with these buffers: both sizes
    /// multiples of 8 (a 16-byte `cp.async` never straddles a row's end) within a launch's
    /// grid, and every address 16-byte aligned.
    pub fn grouped_supported(
        hidden: usize,
        inter: usize,
        rows: &ExpertRows,
        groups: &[ExpertGroup],
    ) -> bool {
        let aligned = |p: u64| p.is_multiple_of(16);
        hidden.is_multiple_of(8)
            && inter.is_multiple_of(8)
            && hidden.div_ceil(DOWN_COLS) <= 65_535
            && inter.div_ceil(GATE_UP_COLS) <= 65_535
            && [rows.x, rows.act, rows.out].into_iter().all(aligned)
            && groups.iter().all(|g| aligned(g.gate_up) && aligned(g.down))
    }
}

/// One row tile as `grouped_gemm.cu`'s `ExpertTile` reads it (24 bytes, little-endian).
struct GroupTile {
    gate_up: u64,
    down: u64,
    row0: u32,
    rows: u32,
}

impl GroupTile {
    const BYTES: usize = 24;

    fn push_to(&self, table: &mut Vec<u8>) {
        table.extend(self.gate_up.to_le_bytes());
        table.extend(self.down.to_le_bytes());
        table.extend(self.row0.to_le_bytes());
        table.extend(self.rows.to_le_bytes());
    }
}

/// How a [`GroupedExperts`] runs, with what it prepared for it.
enum Path {
    /// The tile table and, per group, its first tile (`groups + 1` entries).
    Grouped {
        table: DeviceBuffer,
        first: Vec<usize>,
    },
    /// f32 `[rows, 2I]`: the gate-up GEMMs' outputs.
    PerGroup { gate_up: DeviceBuffer },
}

/// One layer's expert groups, ready to run in runs of consecutive groups.
pub struct GroupedExperts<'a> {
    exec: &'a dyn Executor,
    stream: Stream,
    hidden: usize,
    inter: usize,
    rows: ExpertRows,
    groups: Vec<ExpertGroup>,
    path: Path,
}

impl<'a> GroupedExperts<'a> {
    /// Prepares `groups` (in the order they will run) over `rows` for `gemms`, queued on
    /// `stream`: the tile table uploaded once (grouped), or the f32 gate-up scratch allocated
    /// (per group). The groups must not overlap; rows outside every group are never touched.
    pub fn new(
        exec: &'a dyn Executor,
        stream: Stream,
        (hidden, inter): (usize, usize),
        gemms: ExpertGemms,
        rows: ExpertRows,
        groups: Vec<ExpertGroup>,
    ) -> Result<Self, CudaError> {
        if hidden == 0 || inter == 0 {
            return Err(KernelError::ZeroDimension {
                what: "hidden and intermediate size",
            }
            .into());
        }
        to_u32(hidden.max(inter), "hidden and intermediate size")?;
        let end = groups.iter().map(|g| g.start + g.rows).max().unwrap_or(0);
        to_u32(end, "grouped rows")?;
        let grouped = gemms == ExpertGemms::Grouped
            && ExpertGemms::grouped_supported(hidden, inter, &rows, &groups);
        let path = if grouped {
            let (mut table, mut first) = (Vec::new(), vec![0]);
            for g in &groups {
                for row0 in (g.start..g.start + g.rows).step_by(TILE_ROWS) {
                    let tile = GroupTile {
                        gate_up: g.gate_up,
                        down: g.down,
                        row0: row0 as u32,
                        rows: (g.start + g.rows - row0).min(TILE_ROWS) as u32,
                    };
                    tile.push_to(&mut table);
                }
                first.push(table.len() / GroupTile::BYTES);
            }
            let table = exec.upload_on(stream, &table)?;
            Path::Grouped { table, first }
        } else {
            let gate_up = exec.alloc_zeroed_on(stream, end * 2 * inter * 4)?;
            Path::PerGroup { gate_up }
        };
        Ok(Self {
            exec,
            stream,
            hidden,
            inter,
            rows,
            groups,
            path,
        })
    }

    /// Whether the grouped kernels run (else the per-group GEMMs).
    pub fn grouped(&self) -> bool {
        matches!(self.path, Path::Grouped { .. })
    }

    /// Queues every group.
    pub fn run_all(&self) -> Result<(), CudaError> {
        self.run(0..self.groups.len())
    }

    /// Queues groups `range` (indices into the groups as given to [`Self::new`]): one launch of
    /// each grouped kernel for all of them (none when they have no rows), or each group's GEMM
    /// pair.
    pub fn run(&self, range: Range<usize>) -> Result<(), CudaError> {
        let (h, i) = (self.hidden, self.inter);
        match &self.path {
            Path::Grouped { table, first } => {
                let (begin, end) = (first[range.start], first[range.end]);
                let tiles = table.at(begin * GroupTile::BYTES);
                launch_tiles(
                    self.exec,
                    self.stream,
                    (tiles, end - begin),
                    (h, i),
                    &self.rows,
                )
            }
            Path::PerGroup { gate_up } => {
                for g in &self.groups[range] {
                    if g.rows > 0 {
                        self.per_group(g, gate_up)?;
                    }
                }
                Ok(())
            }
        }
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

    /// One group's cuBLAS gate-up GEMM into f32 `gate_up`, its activation and its down GEMM.
    fn per_group(&self, g: &ExpertGroup, gate_up: &DeviceBuffer) -> Result<(), CudaError> {
        let (h, i, start) = (self.hidden, self.inter, g.start);
        let linear = |a: (u64, usize), b: u64, c: (u64, usize)| Gemm {
            m: g.rows,
            n: c.1,
            k: a.1,
            batch: 1,
            a: dense(a.0, DType::Bf16, a.1),
            b: dense(b, DType::Bf16, a.1),
            b_layout: WeightLayout::OutByIn,
            c: dense(c.0, DType::F32, c.1),
            alpha: 1.0,
            beta: 0.0,
        };
        let x = (self.rows.x + (start * h * 2) as u64, h);
        let up = linear(x, g.gate_up, (gate_up.at(start * 2 * i * 4), 2 * i));
        // SAFETY: the group's rows of x and of the scratch `[rows, 2I]`, its `[2I, H]` weight.
        unsafe { self.exec.gemm_on(self.stream, &up) }?;
        let act = self.rows.act + (start * i * 2) as u64;
        let args = [
            KernelArg::Ptr(gate_up.at(start * 2 * i * 4)),
            KernelArg::U32(g.rows as u32),
            KernelArg::U32(i as u32),
            KernelArg::Ptr(act),
        ];
        let blocks = Launch::blocks(g.rows.min(65_535) as u32, ROW_THREADS);
        // SAFETY: `silu_mul_to_bf16(gate_up[rows, 2I], rows, inter, out[rows, I])` on the
        // group's rows (grid-stride over rows).
        unsafe { self.launch("silu_mul_to_bf16", blocks, &args) }?;
        let out = (self.rows.out + (start * h * 4) as u64, h);
        let down = linear((act, i), g.down, out);
        // SAFETY: the group's rows of act and out, its `[H, I]` weight.
        unsafe { self.exec.gemm_on(self.stream, &down) }
    }
}

/// Queues both grouped kernels over `tiles` entries of a tile table at device address `table`
/// (each a row tile of a group of `rows` with its expert's weights; entries of zero rows are
/// skipped by their blocks), on `stream`.
pub(crate) fn launch_tiles(
    exec: &dyn Executor,
    stream: Stream,
    (table, tiles): (u64, usize),
    (h, i): (usize, usize),
    rows: &ExpertRows,
) -> Result<(), CudaError> {
    if tiles == 0 {
        return Ok(());
    }
    let (hidden, inter) = (KernelArg::U32(h as u32), KernelArg::U32(i as u32));
    let launch = |cols: usize| Launch {
        grid: [tiles as u32, cols as u32, 1],
        block: THREADS,
        shared_bytes: SHARED_BYTES,
    };
    let args = [
        KernelArg::Ptr(table),
        KernelArg::Ptr(rows.x),
        hidden,
        inter,
        KernelArg::Ptr(rows.act),
    ];
    // SAFETY: `grouped_gate_up_silu(tiles, x[*, H], hidden, inter, act[*, I])` over the table's
    // `tiles` entries, each a row tile inside a group of the caller's rows with its expert's
    // weights (or none); the grid is (tiles, I / 64 rounded up), the shared memory the kernel's
    // two stages.
    unsafe {
        exec.launch_on(
            stream,
            "grouped_gate_up_silu",
            launch(i.div_ceil(GATE_UP_COLS)),
            &args,
        )
    }?;
    let args = [
        KernelArg::Ptr(table),
        KernelArg::Ptr(rows.act),
        hidden,
        inter,
        KernelArg::Ptr(rows.out),
    ];
    // SAFETY: `grouped_down(tiles, act[*, I], hidden, inter, out[*, H])` over the same tiles,
    // reading the activations just written; grid (tiles, H / 128).
    unsafe { exec.launch_on(stream, "grouped_down", launch(h.div_ceil(DOWN_COLS)), &args) }
}

fn dense(ptr: u64, dtype: DType, ld: usize) -> MatrixRef {
    MatrixRef {
        ptr,
        dtype,
        ld,
        batch_stride: 0,
    }
}
