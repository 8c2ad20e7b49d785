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
use crate::layers::rope::Rope;
use crate::layers::{Linear, RmsNorm};

/// Query rows per block of the causal core: big enough for efficient GEMMs, small enough that
/// the diagonal blocks waste little work on masked scores.
const QUERY_BLOCK: usize = 256;

/// One layer's cached keys and values of one sequence, `[kv_heads, len, dim]` each.
#[derive(Debug, Clone, Default)]
pub struct LayerCache {
    keys: Option<Tensor>,
    values: Option<Tensor>,
}

impl LayerCache {
    /// Number of cached positions.
    pub fn len(&self) -> usize {
        self.keys.as_ref().map_or(0, |k| k.dim(1).unwrap_or(0))
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends `[kv_heads, n, dim]` keys and values; returns the whole cache.
    pub fn append(&mut self, keys: Tensor, values: Tensor) -> Result<(Tensor, Tensor)> {
        let keys = match self.keys.take() {
            Some(old) => Tensor::cat(&[&old, &keys], 1)?,
            None => keys,
        };
        let values = match self.values.take() {
            Some(old) => Tensor::cat(&[&old, &values], 1)?,
            None => values,
        };
        self.keys = Some(keys.clone());
        self.values = Some(values.clone());
        Ok((keys, values))
    }
}

/// A sequence's KV cache across all layers.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    pub layers: Vec<LayerCache>,
}

impl KvCache {
    /// An empty cache for `num_layers` layers.
    pub fn new(num_layers: usize) -> Self {
        Self {
            layers: vec![LayerCache::default(); num_layers],
        }
    }

    /// Number of cached positions (the sequence's length so far).
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, LayerCache::len)
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

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
/// the keys it can see and masks only its diagonal part.
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
    // slice; the scores buffer is reused across the tasks a worker runs (fresh multi-megabyte
    // allocations cost page faults that showed up as a tenth of the profile).
    let mut by_head = vec![0f32; heads * n * dv];
    by_head
        .par_chunks_mut(n * dv)
        .enumerate()
        .flat_map(|(head, out)| {
            out.par_chunks_mut(QUERY_BLOCK * dv)
                .enumerate()
                .map(move |(block, out)| (head, block * QUERY_BLOCK, out))
        })
        .for_each_init(Vec::new, |scores: &mut Vec<f32>, (head, first, out)| {
            let rows = out.len() / dv;
            let visible = start + first + rows;
            let kv = head / group;
            let q = &q[(head * n + first) * dk..(head * n + first + rows) * dk];
            let k = &k[kv * total * dk..(kv * total + visible) * dk];
            let v = &v[kv * total * dv..(kv * total + visible) * dv];
            scores.resize(rows * visible, 0.0);
            gemm::matmul_bt(
                scores,
                q,
                k,
                Dims {
                    m: rows,
                    k: dk,
                    n: visible,
                },
            );
            let sums: Vec<f32> = scores
                .chunks_exact_mut(visible)
                .enumerate()
                .map(|(i, row)| softmax_prefix(row, start + first + i + 1, scale as f32))
                .collect();
            let dims = Dims {
                m: rows,
                k: visible,
                n: dv,
            };
            gemm::matmul_strided(out, dv, scores, v, dims);
            for (row, sum) in out.chunks_exact_mut(dv).zip(sums) {
                let inv = 1.0 / sum;
                row.iter_mut().for_each(|x| *x *= inv);
            }
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

/// Row-major contents of a tensor.
fn flat(x: &Tensor) -> Result<Vec<f32>> {
    Ok(x.flatten_all()?.to_vec1::<f32>()?)
}

/// In place: softmax numerators of `scale * row[..visible]`, zeros after (the causally masked
/// keys); returns the denominator, applied to the output row after the value product.
fn softmax_prefix(row: &mut [f32], visible: usize, scale: f32) -> f32 {
    let (seen, masked) = row.split_at_mut(visible);
    masked.fill(0.0);
    fastmath::softmax_numerators(seen, scale)
}

/// Grouped-query attention (Qwen2-MoE, Qwen3-MoE, Mixtral): optional qkv bias (and output bias,
/// Qwen3-MoE's `attention_bias`), optional per-head q/k RMSNorm before RoPE.
pub struct GqaAttention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    rope: Rope,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
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
}
