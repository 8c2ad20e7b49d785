//! Attention over a batch of sequence chunks, each with its own KV cache.
//!
//! The engine batches chunked prefill from many sequences into one matrix of tokens; projections
//! run once on the whole batch, while RoPE, the cache append and the causal attention run per
//! sequence on its own rows. The causal core works in query blocks and never multiplies against
//! keys a block cannot see, so long prompts do not pay for the masked half of the score matrix.

use candle_core::{Device, Module, Tensor};
use rayon::prelude::*;

use crate::checkpoint::Weights;
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::layers::fastmath;
use crate::layers::gemm::{self, Dims};
use crate::layers::kv_cache::LayerCache;
use crate::layers::rope::Rope;
use crate::layers::{Linear, RmsNorm};

/// Query rows per block of the causal core: big enough for efficient GEMMs, small enough that
/// the diagonal blocks waste little work on masked scores.
const QUERY_BLOCK: usize = 256;

/// One sequence's rows in a batch: the next `len` rows of the batch matrix continue the sequence
/// whose cache is `cache` (their positions start at `cache.len()`).
pub struct SeqChunk<'a> {
    pub len: usize,
    pub cache: &'a mut LayerCache,
}

/// A family's attention: maps the normalised hidden states of a batch of chunks to the
/// attention output (before the residual add).
pub trait Attention: Send + Sync {
    /// `x` is `[sum of chunk lengths, hidden]`, rows in chunk order.
    fn forward(&self, x: &Tensor, chunks: &mut [SeqChunk<'_>]) -> Result<Tensor>;

    /// The concrete attention, for the GPU path's upload of its weights.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// Checks that the chunks cover the batch's rows exactly.
pub fn check_chunks(x: &Tensor, chunks: &[SeqChunk<'_>]) -> Result<()> {
    let rows = x.dim(0)?;
    let total: usize = chunks.iter().map(|c| c.len).sum();
    if rows != total {
        return Err(ModelError::Input(format!(
            "batch has {rows} rows but its chunks cover {total}"
        )));
    }
    Ok(())
}

/// Causal attention of `n` new queries at positions `start..start + n` against `start + n`
/// cached keys. Shapes: `q [heads, n, dk]`, `k [kv_heads, start + n, dk]`,
/// `v [kv_heads, start + n, dv]`; returns `[n, heads * dv]`. Grouped-query heads share their
/// KV head without copying it: heads `j*G .. (j+1)*G` read KV head `j`, as in transformers.
/// Work items are (head, query block) pairs run in parallel; each block multiplies only against
/// the keys it can see, [`KEY_BLOCK`] keys at a time with a running (online) softmax, so its
/// scratch memory does not grow with the context.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let (heads, n, dk) = q.dims3()?;
    let (kv_heads, total, _) = k.dims3()?;
    let dv = v.dim(2)?;
    if kv_heads == 0 || heads % kv_heads != 0 || total < n || k.dim(2)? != dk {
        return Err(ModelError::Input(format!(
            "attention shapes q {:?} k {:?} v {:?} are inconsistent",
            q.dims(),
            k.dims(),
            v.dims()
        )));
    }
    let group = heads / kv_heads;
    let start = total - n;
    let (q, k, v) = (flat(q)?, flat(k)?, flat(v)?);
    // Head-major output `[heads, n, dv]`, so every (head, query block) task owns a contiguous
    // slice; the scratch buffers are reused across the tasks a worker runs (fresh
    // multi-megabyte allocations cost page faults that showed up as a tenth of the profile).
    let mut by_head = vec![0f32; heads * n * dv];
    by_head
        .par_chunks_mut(n * dv)
        .enumerate()
        .flat_map(|(head, out)| {
            out.par_chunks_mut(QUERY_BLOCK * dv)
                .enumerate()
                .map(move |(block, out)| (head, block * QUERY_BLOCK, out))
        })
        .for_each_init(Scratch::default, |scratch, (head, first, out)| {
            let rows = out.len() / dv;
            let kv = head / group;
            let queries = QueryBlock {
                q: &q[(head * n + first) * dk..(head * n + first + rows) * dk],
                rows,
                // Row `i` sees keys `..first_visible + i`.
                first_visible: start + first + 1,
            };
            let keys = &k[kv * total * dk..(kv + 1) * total * dk];
            let values = &v[kv * total * dv..(kv + 1) * total * dv];
            attend_block(out, &queries, keys, values, (dk, dv), scale as f32, scratch);
        });
    let mut out = vec![0f32; n * heads * dv];
    for (head, rows) in by_head.chunks_exact(n * dv).enumerate() {
        for (i, row) in rows.chunks_exact(dv).enumerate() {
            let at = (i * heads + head) * dv;
            out[at..at + dv].copy_from_slice(row);
        }
    }
    Ok(Tensor::from_vec(out, (n, heads * dv), &Device::Cpu)?)
}

/// Keys per step of a query block's online softmax. A worker's scores buffer is then 256 KiB
/// whatever the context: scoring whole rows needed `256 x context` floats per worker (128 MiB
/// at a 128K-token context, times the worker threads). Speed is unchanged: a 4096-token
/// single-thread run took the same time both ways (docs/performance.md).
const KEY_BLOCK: usize = 256;

/// One task's queries: `rows x dk`, row `i` seeing the first `first_visible + i` keys.
struct QueryBlock<'a> {
    q: &'a [f32],
    rows: usize,
    first_visible: usize,
}

/// A worker's reusable buffers: one key block of scores, and per query row the running scaled
/// maximum and numerator sum.
#[derive(Default)]
struct Scratch {
    scores: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
}

/// `out = softmax(scale q k^T, causal) v` for one query block, key block by key block: each
/// block's numerators are taken against the running row maximum, what was accumulated before is
/// rescaled when the maximum grows, and rows are divided by their sums at the end.
fn attend_block(
    out: &mut [f32],
    queries: &QueryBlock<'_>,
    keys: &[f32],
    values: &[f32],
    (dk, dv): (usize, usize),
    scale: f32,
    scratch: &mut Scratch,
) {
    let rows = queries.rows;
    let visible = queries.first_visible + rows - 1;
    out.fill(0.0);
    scratch.max.clear();
    scratch.max.resize(rows, f32::NEG_INFINITY);
    scratch.sum.clear();
    scratch.sum.resize(rows, 0.0);
    for from in (0..visible).step_by(KEY_BLOCK) {
        let width = KEY_BLOCK.min(visible - from);
        scratch.scores.resize(rows * width, 0.0);
        let scores = &mut scratch.scores[..rows * width];
        let dims = Dims {
            m: rows,
            k: dk,
            n: width,
        };
        gemm::matmul_bt(
            scores,
            queries.q,
            &keys[from * dk..(from + width) * dk],
            dims,
        );
        for (i, row) in scores.chunks_exact_mut(width).enumerate() {
            // Keys this row sees in the block; the rest are causally masked.
            let seen = (queries.first_visible + i).saturating_sub(from).min(width);
            let (seen, masked) = row.split_at_mut(seen);
            masked.fill(0.0);
            if seen.is_empty() {
                continue;
            }
            let (max, sum) = fastmath::softmax_numerators(seen, scale, scratch.max[i]);
            if max > scratch.max[i] && scratch.sum[i] > 0.0 {
                let correction = fastmath::exp_scalar(scratch.max[i] - max);
                scratch.sum[i] *= correction;
                out[i * dv..(i + 1) * dv]
                    .iter_mut()
                    .for_each(|x| *x *= correction);
            }
            scratch.max[i] = max;
            scratch.sum[i] += sum;
        }
        let dims = Dims {
            m: rows,
            k: width,
            n: dv,
        };
        gemm::matmul_accumulate(out, scores, &values[from * dv..(from + width) * dv], dims);
    }
    for (row, sum) in out.chunks_exact_mut(dv).zip(&scratch.sum) {
        let inv = 1.0 / sum;
        row.iter_mut().for_each(|x| *x *= inv);
    }
}

/// Row-major contents of a tensor.
fn flat(x: &Tensor) -> Result<Vec<f32>> {
    Ok(x.flatten_all()?.to_vec1::<f32>()?)
}

/// Grouped-query attention (Qwen2-MoE, Qwen3-MoE, Mixtral): optional qkv bias (and output bias,
/// Qwen3-MoE's `attention_bias`), optional per-head q/k RMSNorm before RoPE.
pub struct GqaAttention {
    pub(crate) q_proj: Linear,
    pub(crate) k_proj: Linear,
    pub(crate) v_proj: Linear,
    pub(crate) o_proj: Linear,
    pub(crate) q_norm: Option<RmsNorm>,
    pub(crate) k_norm: Option<RmsNorm>,
    pub(crate) rope: Rope,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
}

impl GqaAttention {
    /// Loads `self_attn.{q,k,v,o}_proj` (and `q_norm` / `k_norm` when the config has them).
    pub fn load(w: &Weights, config: &ModelConfig) -> Result<Self> {
        let (hidden, heads, kv_heads, head_dim) = (
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        );
        let bias = config.attention_bias;
        let norm = |name: &str| RmsNorm::load(&w.pp(name), head_dim, config.rms_norm_eps);
        Ok(Self {
            q_proj: Linear::load(&w.pp("q_proj"), hidden, heads * head_dim, bias)?,
            k_proj: Linear::load(&w.pp("k_proj"), hidden, kv_heads * head_dim, bias)?,
            v_proj: Linear::load(&w.pp("v_proj"), hidden, kv_heads * head_dim, bias)?,
            o_proj: Linear::load(
                &w.pp("o_proj"),
                heads * head_dim,
                hidden,
                config.attention_out_bias,
            )?,
            q_norm: config.qk_norm.then(|| norm("q_norm")).transpose()?,
            k_norm: config.qk_norm.then(|| norm("k_norm")).transpose()?,
            rope: Rope::new(&config.rope, head_dim, false),
            heads,
            kv_heads,
            head_dim,
        })
    }

    /// `[n, heads * d]` rows to `[heads, n, d]`, with the optional per-head norm.
    fn split_heads(&self, x: &Tensor, heads: usize, norm: Option<&RmsNorm>) -> Result<Tensor> {
        let n = x.dim(0)?;
        let x = x.reshape((n, heads, self.head_dim))?;
        let x = match norm {
            Some(norm) => norm.forward(&x)?,
            None => x,
        };
        Ok(x.transpose(0, 1)?.contiguous()?)
    }
}

impl Attention for GqaAttention {
    fn forward(&self, x: &Tensor, chunks: &mut [SeqChunk<'_>]) -> Result<Tensor> {
        check_chunks(x, chunks)?;
        if x.dim(0)? == 0 {
            return Ok(x.clone());
        }
        let q = self.q_proj.forward(x)?;
        let k = self.k_proj.forward(x)?;
        let v = self.v_proj.forward(x)?;
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let mut outputs = Vec::with_capacity(chunks.len());
        let mut row = 0;
        for chunk in chunks.iter_mut() {
            let (n, start) = (chunk.len, chunk.cache.len());
            if n == 0 {
                continue;
            }
            let q = self.split_heads(&q.narrow(0, row, n)?, self.heads, self.q_norm.as_ref())?;
            let k = self.split_heads(&k.narrow(0, row, n)?, self.kv_heads, self.k_norm.as_ref())?;
            let v = self.split_heads(&v.narrow(0, row, n)?, self.kv_heads, None)?;
            let q = self.rope.apply(&q, start)?;
            let k = self.rope.apply(&k, start)?;
            let (keys, values) = chunk.cache.append(k, v)?;
            outputs.push(causal_attention(&q, &keys, &values, scale)?);
            row += n;
        }
        let out = Tensor::cat(&outputs, 0)?;
        Ok(self.o_proj.forward(&out)?)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// The definition, in f64: row `i` of head `h` attends to keys `..start + i + 1` of its KV
    /// head.
    fn naive(q: &[f32], k: &[f32], v: &[f32], shape: [usize; 6], scale: f64) -> Vec<f32> {
        let [heads, kv_heads, n, total, dk, dv] = shape;
        let start = total - n;
        let mut out = vec![0f32; n * heads * dv];
        for h in 0..heads {
            let kv = h / (heads / kv_heads);
            for i in 0..n {
                let seen = start + i + 1;
                let scores: Vec<f64> = (0..seen)
                    .map(|j| {
                        let dot: f64 = (0..dk)
                            .map(|d| {
                                q[(h * n + i) * dk + d] as f64 * k[(kv * total + j) * dk + d] as f64
                            })
                            .sum();
                        dot * scale
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = exps.iter().sum();
                for d in 0..dv {
                    let acc: f64 = (0..seen)
                        .map(|j| exps[j] * v[(kv * total + j) * dv + d] as f64)
                        .sum();
                    out[(i * heads + h) * dv + d] = (acc / sum) as f32;
                }
            }
        }
        out
    }

    #[test]
    fn blocked_attention_matches_the_definition() {
        // Several query blocks and key blocks, context before the chunk, grouped-query heads,
        // key and value widths that differ (MLA), scores large enough that later key blocks
        // raise the running maximum; and single-token chunks.
        for (heads, kv_heads, n, start, dk, dv) in [
            (4, 2, 300, 500, 16, 8),
            (2, 2, 1, 0, 8, 8),
            (3, 1, 1, 700, 8, 4),
            (2, 1, 257, 0, 4, 4),
        ] {
            let total = start + n;
            let q = values(heads * n * dk, 1, 2.0);
            let k = values(kv_heads * total * dk, 2, 2.0);
            let v = values(kv_heads * total * dv, 3, 1.0);
            let scale = 1.0 / (dk as f64).sqrt();
            let tensor = |data: &[f32], shape: (usize, usize, usize)| {
                Tensor::from_vec(data.to_vec(), shape, &Device::Cpu).unwrap()
            };
            let got = causal_attention(
                &tensor(&q, (heads, n, dk)),
                &tensor(&k, (kv_heads, total, dk)),
                &tensor(&v, (kv_heads, total, dv)),
                scale,
            )
            .unwrap();
            assert_eq!(got.dims(), &[n, heads * dv]);
            let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let want = naive(&q, &k, &v, [heads, kv_heads, n, total, dk, dv], scale);
            let worst = got
                .iter()
                .zip(&want)
                .map(|(g, w)| (g - w).abs())
                .fold(0f32, f32::max);
            assert!(
                worst <= 1e-5,
                "heads {heads}/{kv_heads}, {n} after {start}: off by {worst}"
            );
        }
    }
}
