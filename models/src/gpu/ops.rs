//! One typed call per whole-model kernel: the launch geometry and the argument list in one place,
//! so the forward reads as tensor operations. Every call is `unsafe` inside and safe outside
//! because the buffers it is given are sized by the caller from the same shapes it passes
//! (the GPU model allocates them from its own config), which each function's doc states.

use rackfill_kernels::cuda::exec::{
    DType, DeviceBuffer, Executor, Gemm, KernelArg as A, Launch, MatrixRef, WeightLayout,
};
use rackfill_kernels::cuda::CudaError;

use crate::checkpoint::Synthetic;
use rackfill_kernels::flash::{AttentionShape, FlashTiles, ATTENTION_THREADS};
use rackfill_kernels::kv_blocks::StepArrays;

/// Threads per block of the row-wise kernels.
const THREADS: u32 = 128;

type R = Result<(), CudaError>;

fn n32(v: usize) -> u32 {
    u32::try_from(v).expect("a GPU dimension beyond u32 (the model's shapes are checked at upload)")
}

fn p(b: &DeviceBuffer) -> A {
    A::Ptr(b.ptr())
}

/// A device address as a kernel argument (an offset into a buffer).
fn at(b: &DeviceBuffer, elements: usize, elem_bytes: usize) -> A {
    A::Ptr(b.at(elements * elem_bytes))
}

/// The kernels of the whole-model path on one executor.
#[derive(Clone, Copy)]
pub(crate) struct Ops<'a> {
    pub exec: &'a dyn Executor,
}

impl Ops<'_> {
    fn launch(&self, kernel: &str, launch: Launch, args: &[A]) -> R {
        // SAFETY: every caller below passes the kernel's own parameter list, with buffers sized
        // from the shapes it passes (each function's contract).
        unsafe { self.exec.launch(kernel, launch, args) }
    }

    /// `out[i] = table[ids[i]]` as f32: `table` bf16 `[V, H]`, `ids` `[n]`, `out` f32 `[n, H]`.
    pub fn embed(
        &self,
        table: &DeviceBuffer,
        ids: &DeviceBuffer,
        n: usize,
        hidden: usize,
        out: &DeviceBuffer,
    ) -> R {
        self.launch(
            "embed_rows",
            Launch::blocks(n32(n), THREADS),
            &[
                p(table),
                p(ids),
                A::U32(n32(n)),
                A::U32(n32(hidden)),
                p(out),
            ],
        )
    }

    /// RMSNorm of the first `dim` columns of `rows` f32 rows (stride `x_stride`) into bf16 rows
    /// (stride `out_stride`); `weight` bf16 `[dim]`.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_to_bf16(
        &self,
        x: &DeviceBuffer,
        x_stride: usize,
        weight: &DeviceBuffer,
        eps: f32,
        rows: usize,
        dim: usize,
        out: &DeviceBuffer,
        out_stride: usize,
    ) -> R {
        self.launch(
            "rms_norm_to_bf16",
            Launch::blocks(n32(rows), THREADS),
            &[
                p(x),
                A::U32(n32(x_stride)),
                p(weight),
                A::F32(eps),
                A::U32(n32(rows)),
                A::U32(n32(dim)),
                p(out),
                A::U32(n32(out_stride)),
            ],
        )
    }

    /// RMSNorm in place of the first `dim` columns of `rows` f32 rows at `offset` elements into
    /// `x` (row stride `stride`).
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_inplace(
        &self,
        x: &DeviceBuffer,
        offset: usize,
        stride: usize,
        weight: &DeviceBuffer,
        eps: f32,
        rows: usize,
        dim: usize,
    ) -> R {
        self.launch(
            "rms_norm_inplace",
            Launch::blocks(n32(rows), THREADS),
            &[
                at(x, offset, 4),
                A::U32(n32(stride)),
                p(weight),
                A::F32(eps),
                A::U32(n32(rows)),
                A::U32(n32(dim)),
            ],
        )
    }

    /// Rotary embedding in place on `rows` f32 rows of `x` (row stride `row_stride`), `heads`
    /// heads `head_stride` apart, columns `offset..offset + rot_dim` of each head, at
    /// `positions[row]`.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        x: &DeviceBuffer,
        row_stride: usize,
        heads: usize,
        head_stride: usize,
        offset: usize,
        rope: &RopeTables,
        positions: &DeviceBuffer,
        rows: usize,
    ) -> R {
        self.launch(
            "rope",
            Launch::blocks(n32(rows), THREADS),
            &[
                p(x),
                A::U32(n32(row_stride)),
                A::U32(n32(heads)),
                A::U32(n32(head_stride)),
                A::U32(n32(offset)),
                A::U32(n32(rope.rot_dim)),
                p(positions),
                p(&rope.inv_freq),
                A::F32(rope.attention_factor),
                A::U32(u32::from(rope.interleaved)),
                A::U32(n32(rows)),
            ],
        )
    }

    /// `x[r, c] += bias[c]` for `rows` rows of `cols` (row stride `stride`); `bias` bf16.
    pub fn add_bias(
        &self,
        x: &DeviceBuffer,
        stride: usize,
        bias: &DeviceBuffer,
        rows: usize,
        cols: usize,
    ) -> R {
        self.launch(
            "add_bias_rows",
            Launch::blocks(n32(rows), THREADS),
            &[
                p(x),
                A::U32(n32(stride)),
                p(bias),
                A::U32(n32(rows)),
                A::U32(n32(cols)),
            ],
        )
    }

    /// `x += y`, `n` f32 elements.
    pub fn add(&self, x: &DeviceBuffer, y: &DeviceBuffer, n: usize) -> R {
        self.launch(
            "add_inplace",
            Launch::blocks(n32(n.div_ceil(THREADS as usize).max(1)), THREADS),
            &[p(x), p(y), A::U32(n32(n))],
        )
    }

    /// f32 rows (stride `x_stride`, from `x_offset` elements) to bf16 rows (stride `out_stride`).
    #[allow(clippy::too_many_arguments)]
    pub fn f32_to_bf16(
        &self,
        x: &DeviceBuffer,
        x_offset: usize,
        x_stride: usize,
        rows: usize,
        cols: usize,
        out: &DeviceBuffer,
        out_stride: usize,
    ) -> R {
        self.launch(
            "f32_to_bf16_rows",
            Launch::blocks(n32(rows), THREADS),
            &[
                at(x, x_offset, 4),
                A::U32(n32(x_stride)),
                A::U32(n32(rows)),
                A::U32(n32(cols)),
                p(out),
                A::U32(n32(out_stride)),
            ],
        )
    }

    /// `out[i] = x[rows[i]]`: `x` f32 `[*, dim]`, `rows` `[n]`, `out` f32 `[n, dim]`.
    pub fn gather_f32(
        &self,
        x: &DeviceBuffer,
        dim: usize,
        rows: &DeviceBuffer,
        n: usize,
        out: &DeviceBuffer,
    ) -> R {
        self.launch(
            "gather_rows_f32",
            Launch::blocks(n32(n), THREADS),
            &[p(x), A::U32(n32(dim)), p(rows), A::U32(n32(n)), p(out)],
        )
    }

    /// Strided f32 row copy: `rows` rows of `cols` from `x` (+`x_offset` elements, stride
    /// `x_stride`) to `out` (+`out_offset`, stride `out_stride`).
    #[allow(clippy::too_many_arguments)]
    pub fn copy_rows(
        &self,
        x: &DeviceBuffer,
        x_offset: usize,
        x_stride: usize,
        rows: usize,
        cols: usize,
        out: &DeviceBuffer,
        out_offset: usize,
        out_stride: usize,
    ) -> R {
        self.launch(
            "copy_rows_f32",
            Launch::blocks(n32(rows), THREADS),
            &[
                at(x, x_offset, 4),
                A::U32(n32(x_stride)),
                A::U32(n32(rows)),
                A::U32(n32(cols)),
                at(out, out_offset, 4),
                A::U32(n32(out_stride)),
            ],
        )
    }

    /// `out = bf16(silu(gate) * up)` for `gate_up` f32 `[rows, 2I]` (gate first), `out` bf16
    /// `[rows, I]`.
    pub fn silu_mul(
        &self,
        gate_up: &DeviceBuffer,
        rows: usize,
        inter: usize,
        out: &DeviceBuffer,
    ) -> R {
        self.launch(
            "silu_mul_to_bf16",
            Launch::blocks(n32(rows), THREADS),
            &[p(gate_up), A::U32(n32(rows)), A::U32(n32(inter)), p(out)],
        )
    }

    /// `y[r] *= sigmoid(gate[r])`: `y` f32 `[rows, cols]`, `gate` f32 `[rows]`.
    pub fn scale_by_sigmoid(
        &self,
        y: &DeviceBuffer,
        gate: &DeviceBuffer,
        rows: usize,
        cols: usize,
    ) -> R {
        self.launch(
            "sigmoid_scale_rows",
            Launch::blocks(n32(rows), THREADS),
            &[
                p(y),
                A::U32(n32(cols)),
                p(gate),
                A::U32(1),
                A::U32(n32(rows)),
                A::U32(n32(cols)),
            ],
        )
    }

    /// `out[t] += sum_j weights[t k + j] expert_out[pair_row[t k + j]]` in `j` order: `out` f32
    /// `[tokens, hidden]`, `expert_out` f32 `[tokens k, hidden]` in grouped order.
    #[allow(clippy::too_many_arguments)]
    pub fn combine(
        &self,
        expert_out: &DeviceBuffer,
        pair_row: &DeviceBuffer,
        weights: &DeviceBuffer,
        tokens: usize,
        k: usize,
        hidden: usize,
        out: &DeviceBuffer,
    ) -> R {
        self.launch(
            "combine_topk_rows",
            Launch::blocks(n32(tokens), THREADS),
            &[
                p(expert_out),
                p(pair_row),
                p(weights),
                A::U32(n32(tokens)),
                A::U32(n32(k)),
                A::U32(n32(hidden)),
                p(out),
            ],
        )
    }

    /// Softmax top-k routing of f32 `logits` `[rows, experts]` into `ids` and `weights`
    /// `[rows, k]`.
    #[allow(clippy::too_many_arguments)]
    pub fn router_softmax(
        &self,
        logits: &DeviceBuffer,
        rows: usize,
        experts: usize,
        k: usize,
        renormalise: bool,
        ids: &DeviceBuffer,
        weights: &DeviceBuffer,
    ) -> R {
        self.launch(
            "router_softmax_topk",
            Launch::blocks(n32(rows), THREADS),
            &[
                p(logits),
                A::U32(n32(rows)),
                A::U32(n32(experts)),
                A::U32(n32(k)),
                A::U32(u32::from(renormalise)),
                p(ids),
                p(weights),
            ],
        )
    }

    /// DeepSeek's sigmoid, group-limited top-k routing (`groups` = (groups, groups kept)).
    #[allow(clippy::too_many_arguments)]
    pub fn router_sigmoid_grouped(
        &self,
        logits: &DeviceBuffer,
        bias: Option<&DeviceBuffer>,
        rows: usize,
        experts: usize,
        groups: (usize, usize),
        k: usize,
        renormalise: bool,
        scaling: f32,
        ids: &DeviceBuffer,
        weights: &DeviceBuffer,
    ) -> R {
        self.launch(
            "router_sigmoid_grouped_topk",
            Launch::blocks(n32(rows), THREADS),
            &[
                p(logits),
                bias.map_or(A::Ptr(0), p),
                A::U32(n32(rows)),
                A::U32(n32(experts)),
                A::U32(n32(groups.0)),
                A::U32(n32(groups.1)),
                A::U32(n32(k)),
                A::U32(u32::from(renormalise)),
                A::F32(scaling),
                p(ids),
                p(weights),
            ],
        )
    }

    /// Writes `rows` new tokens' keys (f32, row stride `k_stride`) and values (if any) into the
    /// layer's paged cache at `slots`.
    pub fn kv_write(
        &self,
        keys: (&DeviceBuffer, usize),
        values: Option<(&DeviceBuffer, usize)>,
        rows: usize,
        slots: &DeviceBuffer,
        cache: &KvLayout<'_>,
    ) -> R {
        let (v, v_stride) = values.map_or((A::Ptr(0), 0), |(b, s)| (p(b), s));
        self.launch(
            "kv_write",
            Launch::blocks(n32(rows.clamp(1, 1024)), THREADS),
            &[
                p(keys.0),
                A::U32(n32(keys.1)),
                A::U32(0),
                v,
                A::U32(n32(v_stride)),
                A::U32(0),
                p(slots),
                A::U32(n32(rows)),
                p(cache.keys),
                A::Ptr(cache.values),
                A::U32(n32(cache.shape.kv_heads as usize)),
                A::U32(cache.shape.qk_dim),
                A::U32(cache.shape.v_dim),
            ],
        )
    }

    /// Causal flash attention of the step's queries (f32, row stride `q_stride`) over the
    /// layer's paged cache, into bf16 `out` `[rows, q_heads, v_dim]`, with `tiles` or the
    /// default tile shape for the heads ([`FlashTiles::choose`]).
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention(
        &self,
        q: &DeviceBuffer,
        q_stride: usize,
        cache: &KvLayout<'_>,
        step: &AttentionStep,
        scale: f32,
        out: &DeviceBuffer,
        tiles: Option<FlashTiles>,
    ) -> R {
        let shape = cache.shape;
        let tiles = match tiles {
            Some(tiles) => tiles,
            None => {
                let limit = self.exec.shared_limit(&FlashTiles::ALL[0].kernel())?;
                FlashTiles::choose(&shape, limit)?
            }
        };
        let launch = Launch {
            grid: shape.grid(tiles, &step.arrays),
            block: ATTENTION_THREADS,
            shared_bytes: shape.shared_bytes(tiles),
        };
        let k_token = shape.kv_heads * shape.qk_dim;
        self.launch(
            &tiles.kernel(),
            launch,
            &[
                p(q),
                A::U32(n32(q_stride)),
                p(cache.keys),
                A::U32(k_token),
                A::U32(shape.qk_dim),
                A::Ptr(cache.values),
                A::U32(n32(cache.value_token_stride)),
                A::U32(shape.v_dim),
                p(&step.block_tables),
                A::U32(step.arrays.max_blocks),
                A::U32(step.block_size),
                p(&step.q_start),
                p(&step.q_len),
                p(&step.ctx_len),
                p(out),
                A::U32(shape.q_heads),
                A::U32(shape.kv_heads),
                A::U32(shape.qk_dim),
                A::U32(shape.v_dim),
                A::F32(scale),
            ],
        )
    }

    /// `c = x · Wᵀ (+ beta c)` for a linear layer: `x` `[m, in]` of `x_dtype`, `w` the layer's
    /// weight `[out, in]` (as checkpoints store it) of the same dtype, `c` f32 `[m, out]`.
    pub fn linear(
        &self,
        x: (&DeviceBuffer, DType),
        m: usize,
        w: &DeviceWeight,
        c: &DeviceBuffer,
        beta: f32,
    ) -> R {
        let dense = |ptr: u64, dtype, ld| MatrixRef {
            ptr,
            dtype,
            ld,
            batch_stride: 0,
        };
        let gemm = Gemm {
            m,
            n: w.out_dim,
            k: w.in_dim,
            batch: 1,
            a: dense(x.0.ptr(), x.1, w.in_dim),
            b: dense(w.buffer.ptr(), w.dtype, w.in_dim),
            b_layout: WeightLayout::OutByIn,
            c: dense(c.ptr(), DType::F32, w.out_dim),
            alpha: 1.0,
            beta,
        };
        self.gemm(&gemm)
    }

    /// `n` elements at `src` of `from` converted into `to` at `dst` (each rounded once, to
    /// nearest even): a checkpoint's f32, f16 or bf16 tensor into the model's bf16 or f32.
    pub fn convert(&self, src: u64, from: ConvertFrom, n: usize, dst: u64, to: DType) -> R {
        if n == 0 {
            return Ok(());
        }
        self.launch(
            "convert_elements",
            elementwise(n),
            &[
                A::Ptr(src),
                A::U32(from as u32),
                A::U64(n as u64),
                A::Ptr(dst),
                A::U32(dtype_code(to)),
            ],
        )
    }

    /// `n` elements of a synthetic checkpoint's tensor generated into `to` at `dst` (the bf16
    /// values [`Synthetic::value`] gives on the host).
    pub fn fill_synthetic(&self, values: Synthetic, n: usize, dst: u64, to: DType) -> R {
        if n == 0 {
            return Ok(());
        }
        let (seed, first, bound, constant, uniform) = match values {
            Synthetic::Constant(v) => (0, 0, 0.0, v, 0),
            Synthetic::Uniform { seed, bound, first } => (seed, first, bound, 0.0, 1),
        };
        self.launch(
            "fill_synthetic",
            elementwise(n),
            &[
                A::Ptr(dst),
                A::U32(dtype_code(to)),
                A::U64(n as u64),
                A::U64(seed),
                A::U64(first),
                A::F32(bound),
                A::F32(constant),
                A::U32(uniform),
            ],
        )
    }

    /// A block-quantized FP8 (e4m3) `[rows, cols]` matrix at `src` dequantized into `to` at
    /// `dst`: each value times its `block`'s f32 scale (`scales` `[ceil(rows / block[0]),
    /// ceil(cols / block[1])]`).
    pub fn dequant_fp8(
        &self,
        src: u64,
        scales: u64,
        (rows, cols): (usize, usize),
        block: [usize; 2],
        dst: u64,
        to: DType,
    ) -> R {
        if rows * cols == 0 {
            return Ok(());
        }
        self.launch(
            "dequant_fp8_e4m3",
            elementwise(rows * cols),
            &[
                A::Ptr(src),
                A::Ptr(scales),
                A::U32(n32(rows)),
                A::U32(n32(cols)),
                A::U32(n32(block[0])),
                A::U32(n32(block[1])),
                A::Ptr(dst),
                A::U32(dtype_code(to)),
            ],
        )
    }

    /// Any GEMM whose operands the caller sized (see [`Gemm`]).
    pub fn gemm(&self, gemm: &Gemm) -> R {
        if gemm.m == 0 {
            return Ok(());
        }
        // SAFETY: the callers build `gemm` from buffers allocated for exactly these shapes.
        unsafe { self.exec.gemm(gemm) }
    }
}

/// Element types `convert_elements` reads (`convert.cu`'s codes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ConvertFrom {
    F32 = 0,
    Bf16 = 1,
    F16 = 2,
}

fn dtype_code(dtype: DType) -> u32 {
    match dtype {
        DType::F32 => ConvertFrom::F32 as u32,
        DType::Bf16 => ConvertFrom::Bf16 as u32,
    }
}

/// A grid-stride launch over `n` elements: 256 threads a block, up to 16 elements a thread
/// before more blocks are added (at most 65,535).
fn elementwise(n: usize) -> Launch {
    const THREADS: usize = 256;
    let blocks = n.div_ceil(THREADS * 16).clamp(1, 65_535);
    Launch::blocks(blocks as u32, THREADS as u32)
}

/// A weight matrix in device memory, stored `[out_dim, in_dim]` row-major, as checkpoints store
/// a linear layer (the GEMMs read it as [`WeightLayout::OutByIn`]).
pub(crate) struct DeviceWeight {
    pub buffer: DeviceBuffer,
    pub dtype: DType,
    pub out_dim: usize,
    pub in_dim: usize,
}

/// The rotary frequencies of one attention, on the device.
pub(crate) struct RopeTables {
    /// f32 `[rot_dim / 2]`.
    pub inv_freq: DeviceBuffer,
    pub rot_dim: usize,
    pub attention_factor: f32,
    pub interleaved: bool,
}

/// One layer's paged cache as the attention kernels read it: keys at `keys`, values at
/// `values` (the keys' own buffer for DeepSeek's latent cache) with `value_token_stride`
/// elements between tokens.
pub(crate) struct KvLayout<'a> {
    pub shape: AttentionShape,
    pub keys: &'a DeviceBuffer,
    pub values: u64,
    pub value_token_stride: usize,
}

/// A step's batch as the attention kernel reads it, on the device.
pub(crate) struct AttentionStep {
    pub arrays: StepArrays,
    pub block_size: u32,
    pub block_tables: DeviceBuffer,
    pub q_start: DeviceBuffer,
    pub q_len: DeviceBuffer,
    pub ctx_len: DeviceBuffer,
}
