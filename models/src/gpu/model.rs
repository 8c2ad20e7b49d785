//! The model on the device: its weights, per-layer paged KV cache and block pool, and the
//! sequences that hold blocks of it.

use rackfill_kernels::cuda::grouped_gemm::ExpertGemms;
use std::sync::{Arc, Mutex};

use candle_core::{Device, Tensor};

use rackfill_kernels::cuda::exec::{DeviceBuffer, Executor};
use rackfill_kernels::flash::AttentionShape;
use rackfill_kernels::kv_blocks::{BlockPool, BlockTable};

use super::weights::{Experts, GpuAttention, GpuWeights};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::layers::kv_cache::{BlockKv, DeviceCache};
use crate::layers::router::Routing;
use crate::model::LogitsFor;

/// Tokens per KV cache block.
pub const BLOCK_TOKENS: usize = crate::layers::kv_cache::KV_BLOCK_TOKENS;

/// One sequence's blocks of a [`GpuModel`]'s paged KV cache, returned to the pool when it is
/// dropped. Made by [`GpuModel::new_sequence`].
#[derive(Debug)]
pub struct GpuSequence {
    pub(super) table: BlockTable,
    pub(super) pool: Arc<Mutex<BlockPool>>,
    /// The model's caches, for reading this sequence's KV back.
    pub(super) caches: Arc<ModelCaches>,
}

impl GpuSequence {
    /// Tokens cached so far.
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }
}

impl DeviceCache for GpuSequence {
    fn len(&self) -> usize {
        self.table.len()
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }

    fn read_back(&self) -> Result<Vec<BlockKv>> {
        let caches = &self.caches;
        let len = self.table.len();
        let blocks = self.table.blocks();
        caches
            .layers
            .iter()
            .map(|cache| {
                let (heads, dim) = (cache.heads, cache.dim);
                let row = heads * dim;
                let block_bytes = BLOCK_TOKENS * row * 2;
                // The table's blocks in order are the sequence's tokens in order, each token's
                // row `[heads, dim]` bf16: the first `len` rows, as f32.
                let read = |buffer: &DeviceBuffer| -> Result<Vec<f32>> {
                    let mut bytes = vec![0u8; blocks.len() * block_bytes];
                    // One copy per run of consecutive block ids (a sequence's blocks mostly
                    // are), not one per block.
                    let mut start = 0;
                    while start < blocks.len() {
                        let mut end = start + 1;
                        while end < blocks.len() && blocks[end] == blocks[end - 1] + 1 {
                            end += 1;
                        }
                        caches.exec.read(
                            buffer,
                            blocks[start] as usize * block_bytes,
                            &mut bytes[start * block_bytes..end * block_bytes],
                        )?;
                        start = end;
                    }
                    Ok(bytes
                        .chunks_exact(2)
                        .take(len * row)
                        .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                        .collect())
                };
                let heads_first = |rows: Vec<f32>| -> Result<Tensor> {
                    Ok(Tensor::from_vec(rows, (len, heads, dim), &Device::Cpu)?
                        .transpose(0, 1)?
                        .contiguous()?)
                };
                let keys = read(&cache.keys)?;
                match &cache.values {
                    Some(values) => Ok(BlockKv {
                        keys: heads_first(keys)?,
                        values: heads_first(read(values)?)?,
                        latent: None,
                    }),
                    None => {
                        let latent = Tensor::from_vec(keys, (len, dim), &Device::Cpu)?;
                        Ok(BlockKv {
                            keys: latent.unsqueeze(0)?,
                            values: latent.unsqueeze(0)?,
                            latent: Some(latent),
                        })
                    }
                }
            })
            .collect()
    }
}

impl Drop for GpuSequence {
    fn drop(&mut self) {
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        // The table's blocks came from this pool, so releasing them cannot fail.
        let _ = self.table.release(&mut pool);
    }
}

/// One sequence's new tokens for a batched forward.
pub struct GpuInput<'a> {
    pub tokens: &'a [u32],
    pub sequence: &'a mut GpuSequence,
    pub logits: LogitsFor,
}

/// What one forward returns.
#[derive(Debug, Default)]
pub struct GpuStep {
    /// f32 `[rows, V]`: the rows each sequence asked for, in batch order.
    pub logits: Vec<f32>,
    /// Every MoE layer's routing of the step's rows (batch order), in layer order, when the
    /// experts run here: the exact load the balancer and the routing trace read.
    pub routing: Vec<Routing>,
}

/// Per-layer device KV cache: `[blocks, BLOCK_TOKENS, kv_heads, dim]` bf16 keys (and values for
/// GQA; DeepSeek caches one latent row per token, its values being the latent's first columns).
pub(super) struct LayerCache {
    pub(super) keys: DeviceBuffer,
    pub(super) values: Option<DeviceBuffer>,
    /// KV heads (1 for MLA's latent rows).
    heads: usize,
    /// Elements per head and token (MLA: the latent row, `kv_lora + rot`).
    dim: usize,
}

/// Every layer's cache and the executor that owns them, shared by the model and its
/// sequences (a sequence reads its own KV back through them).
pub(super) struct ModelCaches {
    pub(super) exec: Arc<dyn Executor>,
    pub(super) layers: Vec<LayerCache>,
}

impl std::fmt::Debug for ModelCaches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelCaches")
            .field("layers", &self.layers.len())
            .finish_non_exhaustive()
    }
}

/// A model uploaded to one device with its paged KV cache.
pub struct GpuModel {
    pub(super) experts: Experts,
    pub(super) exec: Arc<dyn Executor>,
    pub(super) config: ModelConfig,
    pub(super) weights: GpuWeights,
    pub(super) caches: Arc<ModelCaches>,
    pub(super) pool: Arc<Mutex<BlockPool>>,
    /// How [`GpuModel::forward`] runs the routed experts.
    pub(super) expert_gemms: ExpertGemms,
}

impl GpuModel {
    /// The model of `weights` (uploaded by [`GpuModel::load`]) with a KV cache of `kv_tokens`
    /// tokens (rounded up to whole blocks) in every layer.
    /// Runs [`GpuModel::forward`]'s routed experts as `gemms` says: the grouped tensor-core
    /// kernels (the default), or one cuBLAS GEMM pair per expert (the baseline a benchmark
    /// compares them with).
    pub fn set_expert_gemms(&mut self, gemms: ExpertGemms) {
        self.expert_gemms = gemms;
    }

    pub(super) fn new(
        exec: Arc<dyn Executor>,
        config: ModelConfig,
        weights: GpuWeights,
        kv_tokens: usize,
        experts: Experts,
    ) -> Result<Self> {
        let blocks = kv_tokens.div_ceil(BLOCK_TOKENS).max(1);
        let too_many = || ModelError::Input(format!("a KV cache of {kv_tokens} tokens"));
        let caches = weights
            .layers
            .iter()
            .map(|layer| {
                let (heads, dim, values) = match &layer.attention {
                    GpuAttention::Gqa(a) => (a.kv_heads, a.head_dim, true),
                    GpuAttention::Mla(a) => (1, a.kv_lora + a.rot, false),
                };
                let bytes = blocks
                    .checked_mul(BLOCK_TOKENS * heads * dim * 2)
                    .ok_or_else(too_many)?;
                Ok(LayerCache {
                    keys: exec.alloc_zeroed(bytes)?,
                    values: values.then(|| exec.alloc_zeroed(bytes)).transpose()?,
                    heads,
                    dim,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let pool = BlockPool::new(
            u32::try_from(blocks).map_err(|_| too_many())?,
            BLOCK_TOKENS as u32,
        )?;
        let caches = Arc::new(ModelCaches {
            exec: Arc::clone(&exec),
            layers: caches,
        });
        Ok(Self {
            experts,
            exec,
            config,
            weights,
            caches,
            pool: Arc::new(Mutex::new(pool)),
            expert_gemms: ExpertGemms::Grouped,
        })
    }

    /// The executor the model runs on.
    pub fn executor(&self) -> &dyn Executor {
        self.exec.as_ref()
    }

    /// The normalised architecture.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Where the routed experts run: uploaded here, or on an EP data plane.
    pub fn experts(&self) -> Experts {
        self.experts
    }

    /// What runs the kernels.
    pub fn describe(&self) -> String {
        self.exec.describe()
    }

    /// KV cache blocks not held by any sequence.
    pub fn free_blocks(&self) -> usize {
        self.pool
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .free_blocks() as usize
    }

    /// An empty sequence (no blocks until its first tokens).
    pub fn new_sequence(&self) -> GpuSequence {
        GpuSequence {
            table: BlockTable::new(),
            pool: Arc::clone(&self.pool),
            caches: Arc::clone(&self.caches),
        }
    }

    /// Runs the batch's new tokens through the whole model on the device (every routed expert
    /// here), each sequence continuing from its cache; returns the logits of the rows each
    /// sequence asks for (every new token or its last) and every MoE layer's routing.
    pub fn forward(&self, batch: &mut [GpuInput<'_>]) -> Result<GpuStep> {
        let mut step = self.begin(batch)?;
        for layer in 0..self.weights.layers.len() {
            self.attention(layer, &mut step)?;
            self.feed_forward(layer, &mut step)?;
        }
        self.finish(step)
    }
}

/// The kernels' own limits (`kernels/cuda/model.cu`, `attention.cu`): a model beyond them is
/// refused before anything is uploaded, with what exceeds which limit.
pub(super) fn check_kernel_limits(c: &ModelConfig) -> Result<()> {
    const ROUTER_MAX_EXPERTS: usize = 1024;
    const ROUTER_MAX_K: usize = 32;
    const ROPE_MAX_DIM: usize = 512;
    let beyond = |what: String| Err(ModelError::Input(format!("the GPU path: {what}")));
    if c.moe.num_experts > ROUTER_MAX_EXPERTS || c.moe.top_k > ROUTER_MAX_K {
        return beyond(format!(
            "{} experts, top-{} (the router kernels take at most {ROUTER_MAX_EXPERTS}, top-{ROUTER_MAX_K})",
            c.moe.num_experts, c.moe.top_k
        ));
    }
    if let crate::config::RouterKind::SigmoidGrouped { n_group, .. } = c.moe.router {
        if n_group == 0 || !c.moe.num_experts.is_multiple_of(n_group) {
            return beyond(format!("{} experts in {n_group} groups", c.moe.num_experts));
        }
    }
    let u = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
    let (shape, rot) = match &c.mla {
        Some(m) => (
            AttentionShape {
                q_heads: u(c.num_heads),
                kv_heads: 1,
                qk_dim: u(m.kv_lora_rank + m.qk_rope_head_dim),
                v_dim: u(m.kv_lora_rank),
            },
            m.qk_rope_head_dim,
        ),
        None => (
            AttentionShape {
                q_heads: u(c.num_heads),
                kv_heads: u(c.num_kv_heads),
                qk_dim: u(c.head_dim),
                v_dim: u(c.head_dim),
            },
            c.head_dim,
        ),
    };
    if rot > ROPE_MAX_DIM {
        return beyond(format!(
            "{rot} rotary dimensions (the kernel takes {ROPE_MAX_DIM})"
        ));
    }
    shape.check()?;
    Ok(())
}
