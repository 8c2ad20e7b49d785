//! The GPU attention kernels (`kernels/cuda/attention.cu`: `kv_write` into the paged bf16 KV
//! cache, `paged_attention` over it) on the host emulator, against the CPU reference
//! `causal_attention` on the conformance fixtures' head shapes: chunked prefill over a cached
//! context, batches of sequences of different lengths, decode, grouped-query heads, key and
//! value widths that differ, DeepSeek's absorbed MLA layout (V read out of the latent K cache),
//! and cache blocks reused after a sequence ends.
//!
//! Tolerances. The reference gets the same inputs the kernels see: f32 queries, and keys and
//! values rounded to bf16 as `kv_write` rounds them; it computes in f32 like the kernels. What
//! remains is the kernels' bf16 output (relative rounding error at most 2^-9 per element) and
//! the order of f32 sums and `exp`. So, with values in [-1, 1]: relative L2 error of a step's
//! outputs at most [`MAX_REL_L2`] = 1e-2, and no element off by more than [`MAX_ABS`] = 4e-3
//! (twice bf16's largest
//! rounding error below 1, 2^-9). Observed on the emulator: relative L2 at most 1.9e-3, max abs
//! 1.96e-3 (the tests print theirs). A prefill split into chunks must equal the whole
//! prefill bit for bit: every query row runs the same key tiles in the same order whatever
//! block computes it.
//!
//! Without a C++ compiler the emulator is unavailable: the tests print why and pass.

#![cfg(feature = "cuda")]

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use rackfill_kernels::cuda::exec::{
    round_bf16, DeviceBuffer, Emulator, Executor, ExecutorExt, KernelArg, Launch,
};
use rackfill_kernels::paged::{
    AttentionShape, BlockPool, BlockTable, PagedError, StepArrays, ATTENTION_THREADS,
};
use rackfill_models::layers::attention::causal_attention;
use rackfill_models::ModelConfig;

/// Largest relative L2 error of a step's outputs against the reference.
const MAX_REL_L2: f32 = 1e-2;
/// Largest error of one output element (values lie in [-1, 1]).
const MAX_ABS: f32 = 4e-3;

/// Deterministic values in `[-spread, spread)`.
fn values(len: usize, seed: u64, spread: f32) -> Vec<f32> {
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
struct Heads {
    shape: AttentionShape,
    scale: f32,
    /// DeepSeek's absorbed MLA: one latent row per token in the K cache, V its first `v_dim`
    /// columns, no V cache.
    latent: bool,
}

impl Heads {
    /// Softmax scale `1 / sqrt(scale_dim)`: MLA's comes from the unabsorbed head width.
    fn new(heads: [usize; 2], (qk, v): (usize, usize), scale_dim: usize, latent: bool) -> Self {
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

    fn gqa(q_heads: usize, kv_heads: usize, head_dim: usize) -> Self {
        Self::new([q_heads, kv_heads], (head_dim, head_dim), head_dim, false)
    }

    fn q_width(&self) -> usize {
        (self.shape.q_heads * self.shape.qk_dim) as usize
    }

    fn k_width(&self) -> usize {
        (self.shape.kv_heads * self.shape.qk_dim) as usize
    }

    fn v_width(&self) -> usize {
        if self.latent {
            0
        } else {
            (self.shape.kv_heads * self.shape.v_dim) as usize
        }
    }

    /// A row of the fused qkv projection the kernels read: q, then k, then v.
    fn row_width(&self) -> usize {
        self.q_width() + self.k_width() + self.v_width()
    }

    fn out_width(&self) -> usize {
        (self.shape.q_heads * self.shape.v_dim) as usize
    }
}

/// The head shapes of the conformance fixtures and the built-in model: GQA as configured; MLA
/// both as the CPU model caches it (expanded per-head keys and values, `qk_dim != v_dim`) and
/// absorbed, as the GPU caches it.
fn fixture_heads() -> Vec<(String, Heads)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root.join("tests/fixtures"))
        .expect("fixtures")
        .map(|e| e.expect("fixture").path())
        .filter(|p| p.join("config.json").exists())
        .collect();
    dirs.sort();
    dirs.push(root.join("builtin"));
    let mut shapes: Vec<(String, Heads)> = Vec::new();
    for dir in dirs {
        let config = ModelConfig::load(&dir).expect("fixture config");
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let heads = config.num_heads;
        let found = match &config.mla {
            None => vec![(
                name,
                Heads::gqa(heads, config.num_kv_heads, config.head_dim),
            )],
            Some(mla) => {
                let (rank, rope) = (mla.kv_lora_rank, mla.qk_rope_head_dim);
                let qk = mla.qk_nope_head_dim + rope;
                let expanded = Heads::new([heads; 2], (qk, mla.v_head_dim), qk, false);
                let absorbed = Heads::new([heads, 1], (rank + rope, rank), qk, true);
                vec![
                    (name.clone(), expanded),
                    (format!("{name} absorbed"), absorbed),
                ]
            }
        };
        for (name, heads) in found {
            if !shapes.iter().any(|(_, h)| *h == heads) {
                shapes.push((name, heads));
            }
        }
    }
    shapes
}

/// One sequence: its fused qkv rows, made up front so that any split into chunks feeds the
/// kernels the same rows, and its blocks.
struct Sequence {
    rows: Vec<f32>,
    table: BlockTable,
}

impl Sequence {
    /// `tokens` rows: queries and keys in [-2, 2] (peaked softmaxes), values in [-1, 1].
    fn new(heads: &Heads, tokens: usize, seed: u64) -> Self {
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
fn heads_first(x: Vec<f32>, tokens: usize, heads: usize) -> Tensor {
    Tensor::from_vec(x, (tokens, heads, ()), &Device::Cpu)
        .and_then(|t| t.transpose(0, 1)?.contiguous())
        .expect("tensor")
}

/// The CPU reference for the `n` rows after `ctx` cached ones: `[n, q_heads * v_dim]`, keys and
/// values rounded to bf16 as the cache holds them, at softmax scale `scale`.
fn reference(heads: &Heads, seq: &Sequence, ctx: usize, n: usize, scale: f32) -> Vec<f32> {
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
fn errors(got: &[f32], want: &[f32]) -> (f32, f32) {
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

fn within_tolerance(got: &[f32], want: &[f32]) -> bool {
    let (rel, abs) = errors(got, want);
    rel <= MAX_REL_L2 && abs <= MAX_ABS
}

/// The worst errors a test saw, printed at its end.
#[derive(Default)]
struct Worst {
    rel: f32,
    abs: f32,
    checks: usize,
}

impl Worst {
    fn check(&mut self, what: &str, got: &[f32], want: &[f32]) {
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

    fn report(&self, test: &str) {
        eprintln!(
            "{test}: {} checks, worst relative L2 error {:.3e}, worst max abs {:.3e}",
            self.checks, self.rel, self.abs
        );
    }
}

/// One layer's paged cache on the emulator.
struct Layer {
    emu: &'static Emulator,
    heads: Heads,
    pool: BlockPool,
    k_cache: DeviceBuffer,
    v_cache: Option<DeviceBuffer>,
}

impl Layer {
    fn new(emu: &'static Emulator, heads: Heads, blocks: u32, block_size: u32) -> Self {
        heads.shape.check().expect("attention shape");
        let tokens = (blocks * block_size) as usize;
        let cache = |width: usize| emu.alloc_zeroed(tokens * width * 2).expect("cache");
        Self {
            emu,
            heads,
            pool: BlockPool::new(blocks, block_size).expect("pool"),
            k_cache: cache(heads.k_width()),
            v_cache: (!heads.latent).then(|| cache(heads.v_width())),
        }
    }

    /// One step: the next `n` rows of each sequence (its cached ones are the context). Returns
    /// each sequence's `[n, q_heads * v_dim]` outputs, as bf16 widened to f32.
    fn step(&mut self, batch: &mut [(&mut Sequence, usize)]) -> Result<Vec<Vec<f32>>, PagedError> {
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
        let emu = self.emu;
        let up = |v: &[u32]| emu.upload_u32(v).expect("upload");
        let fused = emu.upload_f32(&fused).expect("upload");
        let (slots, block_tables) = (up(&step.slot_mapping), up(&step.block_tables));
        let (q_start, q_len, ctx_len) = (up(&step.q_start), up(&step.q_len), up(&step.ctx_len));
        let out = emu.alloc_zeroed(rows * h.out_width() * 2).expect("alloc");
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
            unsafe { emu.launch("kv_write", launch, &args) }.expect("kv_write");
        }
        let launch = Launch {
            grid: s.grid(&step),
            block: ATTENTION_THREADS,
            shared_bytes: s.shared_bytes(),
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
        // SAFETY: the arguments follow paged_attention's signature; the step arrays describe
        // sequences whose blocks lie in the caches, `out` holds every row's heads.
        unsafe { emu.launch("paged_attention", launch, &args) }.expect("paged_attention");
        let out = emu.download_bf16(&out).expect("download");
        let per_row = h.out_width();
        Ok(step
            .q_start
            .iter()
            .zip(&step.q_len)
            .map(|(&at, &n)| out[at as usize * per_row..(at + n) as usize * per_row].to_vec())
            .collect())
    }
}

#[test]
fn chunked_prefill_and_decode_match_the_cpu_reference_on_every_fixture_shape() {
    let Some(emu) = Emulator::shared() else {
        return;
    };
    let mut worst = Worst::default();
    let shapes = fixture_heads();
    assert!(shapes.len() >= 5, "{shapes:?}");
    for (i, (name, heads)) in shapes.into_iter().enumerate() {
        // Block sizes that do and do not divide the 16-key tiles.
        let block_size = [4, 5, 8, 16][i % 4];
        let mut whole = Layer::new(emu, heads, 16, block_size);
        let mut chunked = Layer::new(emu, heads, 16, block_size);
        let mut a = Sequence::new(&heads, 39, 10 + i as u64);
        let mut b = Sequence::new(&heads, 39, 10 + i as u64);
        let all = whole.step(&mut [(&mut a, 37)]).unwrap().remove(0);
        worst.check(
            &format!("{name}: prefill"),
            &all,
            &reference(&heads, &a, 0, 37, heads.scale),
        );
        let mut pieces = Vec::new();
        for n in [12, 1, 24] {
            pieces.extend(chunked.step(&mut [(&mut b, n)]).unwrap().remove(0));
        }
        assert!(
            pieces == all,
            "{name}: chunked prefill differs from the whole prefill"
        );
        for ctx in [37, 38] {
            let got = chunked.step(&mut [(&mut b, 1)]).unwrap().remove(0);
            worst.check(
                &format!("{name}: decode after {ctx}"),
                &got,
                &reference(&heads, &b, ctx, 1, heads.scale),
            );
        }
    }
    worst.report("chunked_prefill_and_decode");
}

#[test]
fn a_batch_of_sequences_of_different_lengths_runs_in_one_step() {
    let Some(emu) = Emulator::shared() else {
        return;
    };
    let mut worst = Worst::default();
    let absorbed = fixture_heads()
        .into_iter()
        .find(|(_, h)| h.latent)
        .expect("an MLA fixture")
        .1;
    for heads in [Heads::gqa(4, 2, 16), absorbed] {
        let mut layer = Layer::new(emu, heads, 24, 8);
        let mut seqs: Vec<Sequence> = (0..4).map(|s| Sequence::new(&heads, 40, 20 + s)).collect();
        let [s0, s1, s2, s3] = &mut seqs[..] else {
            unreachable!()
        };
        let first = layer.step(&mut [(s0, 20), (s1, 10)]).unwrap();
        // A chunk over a cached context, a decode, a fresh prefill, and a sequence idle this step.
        let second = layer
            .step(&mut [(s0, 7), (s1, 1), (s2, 33), (s3, 0)])
            .unwrap();
        assert!(second[3].is_empty());
        for (what, got, seq, ctx, n) in [
            ("first step, sequence 0", &first[0], &seqs[0], 0, 20),
            ("first step, sequence 1", &first[1], &seqs[1], 0, 10),
            ("chunk after 20", &second[0], &seqs[0], 20, 7),
            ("decode after 10", &second[1], &seqs[1], 10, 1),
            ("fresh prefill", &second[2], &seqs[2], 0, 33),
        ] {
            worst.check(
                &format!("{:?}: {what}", heads.shape),
                got,
                &reference(&heads, seq, ctx, n, heads.scale),
            );
        }
    }
    worst.report("a_batch_of_sequences");
}

#[test]
fn blocks_freed_by_a_finished_sequence_serve_the_next() {
    let Some(emu) = Emulator::shared() else {
        return;
    };
    let mut worst = Worst::default();
    let heads = Heads::gqa(4, 2, 16);
    let mut layer = Layer::new(emu, heads, 6, 8);
    let mut a = Sequence::new(&heads, 40, 30);
    let mut b = Sequence::new(&heads, 8, 31);
    let mut c = Sequence::new(&heads, 31, 32);
    layer.step(&mut [(&mut a, 40), (&mut b, 6)]).unwrap();
    assert_eq!(layer.pool.free_blocks(), 0);
    let err = layer.step(&mut [(&mut c, 1)]).unwrap_err();
    assert_eq!(err, PagedError::Exhausted { needed: 1, free: 0 });
    let mut old = a.table.blocks().to_vec();
    a.table.release(&mut layer.pool).unwrap();
    // c takes a's blocks, which still hold a's keys and values past c's tokens.
    let got = layer.step(&mut [(&mut c, 30), (&mut b, 1)]).unwrap();
    let mut reused = c.table.blocks().to_vec();
    reused.sort_unstable();
    old.sort_unstable();
    assert!(
        reused.iter().all(|blk| old.contains(blk)),
        "{reused:?} vs {old:?}"
    );
    worst.check(
        "prefill in reused blocks",
        &got[0],
        &reference(&heads, &c, 0, 30, heads.scale),
    );
    worst.check(
        "decode beside it",
        &got[1],
        &reference(&heads, &b, 6, 1, heads.scale),
    );
    let got = layer.step(&mut [(&mut c, 1)]).unwrap();
    worst.check(
        "decode in reused blocks",
        &got[0],
        &reference(&heads, &c, 30, 1, heads.scale),
    );
    worst.report("blocks_freed");
}

#[test]
fn absorbed_mla_attention_is_deepseek_attention() {
    // DeepSeek caches one latent row per token, [kv_a latent (normed), rotated k_rot]; with
    // W_UK absorbed into the queries and W_UV applied after, attention over it is the MLA of
    // families/deepseek_v3.rs: per-head keys [W_UK latent, k_rot] and values W_UV latent.
    let Some(emu) = Emulator::shared() else {
        return;
    };
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek_v3");
    let config = ModelConfig::load(&dir).expect("fixture config");
    let mla = config.mla.expect("MLA dimensions");
    let (h, r, p) = (config.num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim);
    let (nope, v) = (mla.qk_nope_head_dim, mla.v_head_dim);
    let heads = Heads::new([h, 1], (r + p, r), nope + p, true);
    let tokens = 29;
    // kv_b_proj: per head, nope rows of W_UK then v rows of W_UV, each `[.., r]`.
    let kv_b = values(h * (nope + v) * r, 50, (3.0 / r as f32).sqrt());
    let w_uk = |head: usize, i: usize| &kv_b[(head * (nope + v) + i) * r..][..r];
    let w_uv = |head: usize, i: usize| &kv_b[(head * (nope + v) + nope + i) * r..][..r];
    let latent = values(tokens * r, 51, 1.0);
    let k_rot = values(tokens * p, 52, 2.0);
    let q_nope = values(tokens * h * nope, 53, 2.0);
    let q_rope = values(tokens * h * p, 54, 2.0);
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();

    // The absorbed rows the kernels read: q_abs per head [W_UK^T q_nope, q_rope], then the
    // latent row [latent, k_rot].
    let mut rows = Vec::with_capacity(tokens * heads.row_width());
    for t in 0..tokens {
        for head in 0..h {
            let qn = &q_nope[(t * h + head) * nope..][..nope];
            rows.extend((0..r).map(|c| (0..nope).map(|i| qn[i] * w_uk(head, i)[c]).sum::<f32>()));
            rows.extend_from_slice(&q_rope[(t * h + head) * p..][..p]);
        }
        rows.extend_from_slice(&latent[t * r..][..r]);
        rows.extend_from_slice(&k_rot[t * p..][..p]);
    }
    let mut seq = Sequence {
        rows,
        table: BlockTable::new(),
    };
    let mut layer = Layer::new(emu, heads, 8, 8);
    let mut got = layer.step(&mut [(&mut seq, 17)]).unwrap().remove(0);
    got.extend(layer.step(&mut [(&mut seq, 12)]).unwrap().remove(0));
    // W_UV on each head's latent-space output.
    let got: Vec<f32> = got
        .chunks_exact(r)
        .enumerate()
        .flat_map(|(i, o)| (0..v).map(move |c| (i % h, c, o)))
        .map(|(head, c, o)| dot(w_uv(head, c), o))
        .collect();

    // The expanded computation, on the bf16 latent and k_rot the cache holds.
    let latent: Vec<f32> = latent.into_iter().map(round_bf16).collect();
    let k_rot: Vec<f32> = k_rot.into_iter().map(round_bf16).collect();
    let mut q = Vec::new();
    let (mut keys, mut vals) = (Vec::new(), Vec::new());
    for t in 0..tokens {
        let lat = &latent[t * r..][..r];
        for head in 0..h {
            q.extend_from_slice(&q_nope[(t * h + head) * nope..][..nope]);
            q.extend_from_slice(&q_rope[(t * h + head) * p..][..p]);
            keys.extend((0..nope).map(|i| dot(w_uk(head, i), lat)));
            keys.extend_from_slice(&k_rot[t * p..][..p]);
            vals.extend((0..v).map(|i| dot(w_uv(head, i), lat)));
        }
    }
    let want = causal_attention(
        &heads_first(q, tokens, h),
        &heads_first(keys, tokens, h),
        &heads_first(vals, tokens, h),
        f64::from(heads.scale),
    )
    .expect("reference attention");
    let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let mut worst = Worst::default();
    worst.check("absorbed MLA", &got, &want);
    worst.report("absorbed_mla");
}

#[test]
fn the_tolerance_tells_a_wrong_attention_from_a_right_one() {
    // The checks above can fail: a 5% different softmax scale, one changed key of the
    // context, or one output element off by 1e-2 are all outside the tolerance.
    let heads = Heads::gqa(4, 2, 16);
    let seq = Sequence::new(&heads, 40, 40);
    let right = reference(&heads, &seq, 8, 24, heads.scale);
    assert!(within_tolerance(&right, &right));
    let scaled = reference(&heads, &seq, 8, 24, heads.scale * 1.05);
    assert!(
        !within_tolerance(&scaled, &right),
        "{:?}",
        errors(&scaled, &right)
    );
    let mut tampered = Sequence::new(&heads, 40, 40);
    let key = 3 * heads.row_width() + heads.q_width();
    tampered.rows[key..key + heads.k_width()]
        .iter_mut()
        .for_each(|k| *k = -*k);
    let tampered = reference(&heads, &tampered, 8, 24, heads.scale);
    assert!(
        !within_tolerance(&tampered, &right),
        "{:?}",
        errors(&tampered, &right)
    );
    let mut off = right.clone();
    off[17] += 1e-2;
    assert!(!within_tolerance(&off, &right));
}
