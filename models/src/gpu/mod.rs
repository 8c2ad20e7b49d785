//! The whole model on a GPU, per rank: bf16 weights on the device ([`weights`]), the dense
//! layer kernels, paged attention over a device KV cache and the MoE layer with every expert
//! local ([`forward`]), run through an [`Executor`]: the GPU itself, or the host emulator that
//! checks this very code against the CPU model on machines without one.
//!
//! Precision: weights, GEMM inputs and the KV cache are bf16; GEMMs accumulate in f32 and write
//! f32; the residual stream, norms' arithmetic, RoPE, attention scores and softmax, the routers
//! (weights kept in f32, so selection does not flip on a rounding) and the logits are f32.

mod forward;
mod ops;
mod weights;

use std::sync::Arc;

use rackfill_kernels::cuda::exec::{DeviceBuffer, Executor};
use rackfill_kernels::paged::{BlockPool, BlockTable};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::layers::router::Routing;
use crate::model::{LogitsFor, MoeModel};
use weights::{GpuAttention, GpuWeights};

/// Tokens per KV cache block.
pub const BLOCK_TOKENS: usize = 16;

/// One sequence's place in the device KV cache: its block table. Created by
/// [`GpuModel::new_sequence`], returned with [`GpuModel::release`].
#[derive(Debug, Default)]
pub struct GpuSequence {
    table: BlockTable,
}

impl GpuSequence {
    /// Tokens cached so far.
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.table.len() == 0
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
    /// Every MoE layer's routing of the step's rows (batch order), in layer order: the exact
    /// load the balancer and the routing trace read.
    pub routing: Vec<Routing>,
}

/// Per-layer device KV cache: `[blocks, BLOCK_TOKENS, kv_heads, dim]` bf16 keys (and values for
/// GQA; DeepSeek caches one latent row per token, its values being the latent's first columns).
struct LayerCache {
    keys: DeviceBuffer,
    values: Option<DeviceBuffer>,
}

/// A model uploaded to one device with its paged KV cache.
pub struct GpuModel {
    exec: Arc<dyn Executor>,
    config: ModelConfig,
    weights: GpuWeights,
    caches: Vec<LayerCache>,
    pool: BlockPool,
}

impl GpuModel {
    /// Uploads `model` (every routed expert loaded) to `exec` with a KV cache of `kv_tokens`
    /// tokens (rounded up to whole blocks) in every layer.
    pub fn upload(exec: Arc<dyn Executor>, model: &MoeModel, kv_tokens: usize) -> Result<Self> {
        let weights = GpuWeights::upload(exec.as_ref(), model)?;
        let blocks = kv_tokens.div_ceil(BLOCK_TOKENS).max(1);
        let caches = weights
            .layers
            .iter()
            .map(|layer| {
                let (row, values) = match &layer.attention {
                    GpuAttention::Gqa(a) => (a.kv_heads * a.head_dim, true),
                    GpuAttention::Mla(a) => (a.kv_lora + a.rot, false),
                };
                let bytes = blocks * BLOCK_TOKENS * row * 2;
                Ok(LayerCache {
                    keys: exec.alloc_zeroed(bytes)?,
                    values: values.then(|| exec.alloc_zeroed(bytes)).transpose()?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            exec,
            config: model.config().clone(),
            weights,
            caches,
            pool: BlockPool::new(
                u32::try_from(blocks)
                    .map_err(|_| ModelError::Input(format!("{kv_tokens} KV tokens")))?,
                BLOCK_TOKENS as u32,
            )?,
        })
    }

    /// The normalised architecture.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// What runs the kernels.
    pub fn describe(&self) -> String {
        self.exec.describe()
    }

    /// KV cache blocks not held by any sequence.
    pub fn free_blocks(&self) -> usize {
        self.pool.free_blocks() as usize
    }

    /// An empty sequence (no blocks until its first tokens).
    pub fn new_sequence(&self) -> GpuSequence {
        GpuSequence::default()
    }

    /// Returns a finished sequence's blocks to the pool.
    pub fn release(&mut self, mut sequence: GpuSequence) -> Result<()> {
        Ok(sequence.table.release(&mut self.pool)?)
    }

    /// Runs the batch's new tokens through the model, each sequence continuing from its cache;
    /// returns the logits of the rows each sequence asks for (every new token or its last) and
    /// every MoE layer's routing. Blocks for every new token are taken before any work, so a
    /// full cache fails the step with nothing changed.
    pub fn forward(&mut self, batch: &mut [GpuInput<'_>]) -> Result<GpuStep> {
        for s in batch.iter() {
            crate::model::check_vocabulary(s.tokens, self.config.vocab_size)
                .map_err(|e| ModelError::Input(e.to_string()))?;
        }
        forward::run(self, batch)
    }
}
