//! The harness of `gpu_attention.rs`: a layer's paged KV cache on an executor, stepped through
//! `kv_write` and flash attention exactly as the whole-model path will launch them, sequences
//! of fused qkv rows, the CPU reference, and the tolerance check.

use std::sync::Arc;

use candle_core::{Device, Tensor};
use rackfill_kernels::cuda::exec::{
    round_bf16, DeviceBuffer, Executor, ExecutorExt, KernelArg, Launch,
};
use rackfill_kernels::flash::{AttentionShape, FlashTiles, ATTENTION_THREADS};
use rackfill_kernels::kv_blocks::{BlockPool, BlockTable, PagedError, StepArrays};
use rackfill_models::layers::attention::causal_attention;

/// Largest relative L2 error of a step's outputs against the reference.
const MAX_REL_L2: f32 = 1e-2;
/// Largest error of one output element (values lie in [-1, 1]).
const MAX_ABS: f32 = 6e-3;

/// Deterministic values in `[-spread, spread)`.
pub fn values(len: usize, seed: u64, spread: f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * spread
        })
        .collect()
}

/// A layer's attention as the kernels see it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Heads {
    pub shape: AttentionShape,
    pub scale: f32,
    /// DeepSeek's absorbed MLA: one latent row per token in the K cache, V its first `v_dim`
    /// columns, no V cache.
    pub latent: bool,
}

impl Heads {
    /// Softmax scale `1 / sqrt(scale_dim)`: MLA's comes from the unabsorbed head width.
    pub fn new(heads: [usize; 2], (qk, v): (usize, usize), scale_dim: usize, latent: bool) -> Self {
        let shape = AttentionShape {
            q_heads: heads[0] as u32,
            kv_heads: heads[1] as u32,
            qk_dim: qk as u32,
            v_dim: v as u32,
        };
        let scale = 1.0 / (scale_dim as f32).sqrt();
        Self {
            shape,
            scale,
            latent,
        }
    }

    pub fn gqa(q_heads: usize, kv_heads: usize, head_dim: usize) -> Self {
        Self::new([q_heads, kv_heads], (head_dim, head_dim), head_dim, false)
    }

    pub fn q_width(&self) -> usize {
        (self.shape.q_heads * self.shape.qk_dim) as usize
    }

    pub fn k_width(&self) -> usize {
        (self.shape.kv_heads * self.shape.qk_dim) as usize
    }

    pub fn v_width(&self) -> usize {
        if self.latent {
            0
        } else {
            (self.shape.kv_heads * self.shape.v_dim) as usize
        }
    }

    /// A row of the fused qkv projection the kernels read: q, then k, then v.
    pub fn row_width(&self) -> usize {
        self.q_width() + self.k_width() + self.v_width()
    }

    pub fn out_width(&self) -> usize {
        (self.shape.q_heads * self.shape.v_dim) as usize
    }
}

/// One sequence: its fused qkv rows, made up front so that any split into chunks feeds the
/// kernels the same rows, and its blocks.
pub struct Sequence {
    pub rows: Vec<f32>,
    pub table: BlockTable,
}

impl Sequence {
    /// `tokens` rows: queries and keys in [-2, 2] (peaked softmaxes), values in [-1, 1].
    pub fn new(heads: &Heads, tokens: usize, seed: u64) -> Self {
        let width = heads.row_width();
        let (q, k) = (heads.q_width(), heads.k_width());
        let mut rows = values(tokens * width, seed, 2.0);
        for row in rows.chunks_exact_mut(width) {
            let values = if heads.latent {
                // The latent is also V: keep its first v_dim columns in [-1, 1].
                &mut row[q..q + heads.shape.v_dim as usize]
            } else {
                &mut row[q + k..]
            };
            values.iter_mut().for_each(|v| *v *= 0.5);
        }
        Self {
            rows,
            table: BlockTable::new(),
        }
    }

    /// Column `from..from + len` of rows `rows`, as the kernels see them.
    fn columns(
        &self,
        heads: &Heads,
        rows: std::ops::Range<usize>,
        from: usize,
        len: usize,
    ) -> Vec<f32> {
        let width = heads.row_width();
        rows.flat_map(|r| {
            self.rows[r * width + from..r * width + from + len]
                .iter()
                .copied()
        })
        .collect()
    }
}

/// `[tokens, heads, dim]` to the `[heads, tokens, dim]` tensor the reference takes.
pub fn heads_first(x: Vec<f32>, tokens: usize, heads: usize) -> Tensor {
    Tensor::from_vec(x, (tokens, heads, ()), &Device::Cpu)
        .and_then(|t| t.transpose(0, 1)?.contiguous())
        .expect("tensor")
}

/// The CPU reference for the `n` rows after `ctx` cached ones: `[n, q_heads * v_dim]`, keys and
/// values rounded to bf16 as the cache holds them, at softmax scale `scale`.
pub fn reference(heads: &Heads, seq: &Sequence, ctx: usize, n: usize, scale: f32) -> Vec<f32> {
    let s = heads.shape;
    let (q_heads, kv_heads, v) = (s.q_heads as usize, s.kv_heads as usize, s.v_dim as usize);
    let total = ctx + n;
    let q = seq.columns(heads, ctx..total, 0, heads.q_width());
    let round = |x: Vec<f32>| x.into_iter().map(round_bf16).collect::<Vec<_>>();
    let k = round(seq.columns(heads, 0..total, heads.q_width(), heads.k_width()));
    let v_from = if heads.latent {
        heads.q_width()
    } else {
        heads.q_width() + heads.k_width()
    };
    // Absorbed MLA (kv_heads 1): V is the latent row's first v_dim columns.
    let values = round(seq.columns(heads, 0..total, v_from, kv_heads * v));
    let out = causal_attention(
        &heads_first(q, n, q_heads),
        &heads_first(k, total, kv_heads),
        &heads_first(values, total, kv_heads),
        f64::from(scale),
    )
    .expect("reference attention");
    out.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// `(relative L2 error, max abs error)` of `got` against `want`.
pub fn errors(got: &[f32], want: &[f32]) -> (f32, f32) {
    assert_eq!(got.len(), want.len());
    let (mut diff, mut norm, mut worst) = (0f64, 0f64, 0f32);
    for (g, w) in got.iter().zip(want) {
        let d = g - w;
        diff += f64::from(d * d);
        norm += f64::from(w * w);
        worst = worst.max(d.abs());
    }
    ((diff / norm.max(f64::MIN_POSITIVE)).sqrt() as f32, worst)
}

pub fn within_tolerance(got: &[f32], want: &[f32]) -> bool {
    let (rel, abs) = errors(got, want);
    rel <= MAX_REL_L2 && abs <= MAX_ABS
}

/// The worst errors a test saw, printed at its end.
#[derive(Default)]
pub struct Worst {
    rel: f32,
    abs: f32,
    checks: usize,
}

impl Worst {
    pub fn check(&mut self, what: &str, got: &[f32], want: &[f32]) {
        let (rel, abs) = errors(got, want);
        assert!(
            rel <= MAX_REL_L2 && abs <= MAX_ABS,
            "{what}: relative L2 error {rel:e} (at most {MAX_REL_L2:e}), max abs {abs:e} (at most \
             {MAX_ABS:e})"
        );
        self.rel = self.rel.max(rel);
        self.abs = self.abs.max(abs);
        self.checks += 1;
    }

    pub fn report(&self, test: &str, exec: &dyn Executor) {
        eprintln!(
            "{test} on the {}: {} checks, worst relative L2 error {:.3e}, worst max abs {:.3e}",
            exec.describe(),
            self.checks,
            self.rel,
            self.abs
        );
    }
}

/// Where the kernels run: the host emulator (given a C++ compiler) and GPU 0 (on a GPU host).
pub fn executors() -> Vec<Arc<dyn Executor>> {
    rackfill_kernels::cuda::exec::available()
}

/// One layer's paged cache on an executor.
pub struct Layer {
    exec: Arc<dyn Executor>,
    heads: Heads,
    pub pool: BlockPool,
    k_cache: DeviceBuffer,
    v_cache: Option<DeviceBuffer>,
    /// The flash kernel's tile shape; `None`: the default for the heads.
    pub tiles: Option<FlashTiles>,
}

impl Layer {
    pub fn new(exec: Arc<dyn Executor>, heads: Heads, blocks: u32, block_size: u32) -> Self {
        heads.shape.check().expect("attention shape");
        let tokens = (blocks * block_size) as usize;
        let cache = |width: usize| exec.alloc_zeroed(tokens * width * 2).expect("cache");
        let (k_cache, v_cache) = (
            cache(heads.k_width()),
            (!heads.latent).then(|| cache(heads.v_width())),
        );
        Self {
            exec,
            heads,
            pool: BlockPool::new(blocks, block_size).expect("pool"),
            k_cache,
            v_cache,
            tiles: None,
        }
    }

    /// One step: the next `n` rows of each sequence (its cached ones are the context). Returns
    /// each sequence's `[n, q_heads * v_dim]` outputs, as bf16 widened to f32.
    pub fn step(
        &mut self,
        batch: &mut [(&mut Sequence, usize)],
    ) -> Result<Vec<Vec<f32>>, PagedError> {
        let h = self.heads;
        let width = h.row_width();
        let mut fused = Vec::new();
        for (seq, n) in batch.iter() {
            let at = seq.table.len() * width;
            fused.extend_from_slice(&seq.rows[at..at + n * width]);
        }
        let mut tables: Vec<(&mut BlockTable, usize)> =
            batch.iter_mut().map(|(s, n)| (&mut s.table, *n)).collect();
        let step = StepArrays::prepare(&mut self.pool, &mut tables)?;
        let rows = step.slot_mapping.len();
        let exec = self.exec.clone();
        let up = |v: &[u32]| exec.upload_u32(v).expect("upload");
        let fused = exec.upload_f32(&fused).expect("upload");
        let (slots, block_tables) = (up(&step.slot_mapping), up(&step.block_tables));
        let (q_start, q_len, ctx_len) = (up(&step.q_start), up(&step.q_len), up(&step.ctx_len));
        let out = exec.alloc_zeroed(rows * h.out_width() * 2).expect("alloc");
        let s = h.shape;
        let (q_width, k_width) = (h.q_width() as u32, h.k_width() as u32);
        let (v_cache, v_token, v_head) = match &self.v_cache {
            Some(v) => (KernelArg::from(v), s.kv_heads * s.v_dim, s.v_dim),
            None => (KernelArg::from(&self.k_cache), k_width, s.qk_dim),
        };
        let u = KernelArg::U32;
        if rows > 0 {
            let v_rows = if h.latent {
                KernelArg::Ptr(0)
            } else {
                KernelArg::from(&fused)
            };
            // A grid smaller than the rows: blocks stride over them.
            let launch = Launch::blocks((rows as u32).min(16), 128);
            let args = [
                KernelArg::from(&fused),
                u(width as u32),
                u(q_width),
                v_rows,
                u(width as u32),
                u(q_width + k_width),
                KernelArg::from(&slots),
                u(rows as u32),
                KernelArg::from(&self.k_cache),
                self.v_cache
                    .as_ref()
                    .map_or(KernelArg::Ptr(0), KernelArg::from),
                u(s.kv_heads),
                u(s.qk_dim),
                u(s.v_dim),
            ];
            // SAFETY: the arguments follow kv_write's signature; every row's slot lies in the
            // caches (the pool's blocks), and the fused rows hold `rows * width` floats.
            unsafe { exec.launch("kv_write", launch, &args) }.expect("kv_write");
        }
        let tiles = match self.tiles {
            Some(tiles) => tiles,
            None => FlashTiles::choose(&s, exec.shared_limit("flash_attention_k64_v64").unwrap())
                .expect("a tile shape fits"),
        };
        let launch = Launch {
            grid: s.grid(tiles, &step),
            block: ATTENTION_THREADS,
            shared_bytes: s.shared_bytes(tiles),
        };
        let args = [
            KernelArg::from(&fused),
            u(width as u32),
            KernelArg::from(&self.k_cache),
            u(k_width),
            u(s.qk_dim),
            v_cache,
            u(v_token),
            u(v_head),
            KernelArg::from(&block_tables),
            u(step.max_blocks),
            u(self.pool.block_size()),
            KernelArg::from(&q_start),
            KernelArg::from(&q_len),
            KernelArg::from(&ctx_len),
            KernelArg::from(&out),
            u(s.q_heads),
            u(s.kv_heads),
            u(s.qk_dim),
            u(s.v_dim),
            KernelArg::F32(h.scale),
        ];
        // SAFETY: the arguments follow the flash kernels' signature; the step arrays describe
        // sequences whose blocks lie in the caches, `out` holds every row's heads.
        unsafe { exec.launch(&tiles.kernel(), launch, &args) }.expect("flash attention");
        let out = exec.download_bf16(&out).expect("download");
        let per_row = h.out_width();
        Ok(step
            .q_start
            .iter()
            .zip(&step.q_len)
            .map(|(&at, &n)| out[at as usize * per_row..(at + n) as usize * per_row].to_vec())
            .collect())
    }
}
