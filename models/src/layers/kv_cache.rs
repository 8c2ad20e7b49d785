//! The KV cache of one sequence on the CPU path, and the fixed-size blocks it is shared in.
//!
//! A running sequence keeps each layer's keys and values contiguous, `[kv_heads, len, dim]`:
//! attention multiplies against them directly, and a step appends its new positions with one
//! two-piece concatenation (rebuilding the cache from dozens of small blocks at every decode step
//! measured 13% slower decoding). The unit of sharing is the *block* of `block_tokens` positions
//! ([`KvBlock`]): the engine's prefix cache takes a copy of every block a sequence completes
//! ([`KvCache::block`]), which outlives the sequence, and starts a new sequence with the same
//! prefix from those blocks ([`KvCache::reuse`]), which it holds by reference (a candle tensor
//! clone shares its storage) and concatenates once into its own cache. Which block *ids* of the
//! rank's budget a sequence holds is the engine's book-keeping (the GPU path's `BlockPool` and
//! tables); this module holds the data.

use candle_core::Tensor;

use crate::error::{ModelError, Result};

/// Tokens per KV block unless configured otherwise: vLLM's default, and the GPU path's block.
pub const KV_BLOCK_TOKENS: usize = 16;

/// One layer's keys and values of one block, `[kv_heads, tokens, dim]` each.
#[derive(Debug, Clone)]
pub struct BlockKv {
    pub keys: Tensor,
    pub values: Tensor,
    /// Multi-head latent attention's compressed KV, `[tokens, kv_lora_rank + rope_dim]`: the
    /// normalised latent and the rotated shared key, what an MLA decode engine caches (and a KV
    /// export hands it); `None` for other attention.
    pub latent: Option<Tensor>,
}

/// One full block across every layer: what a prefix cache keeps and hands to the next sequence
/// with the same prefix. Cloning shares the tensors.
#[derive(Debug, Clone)]
pub struct KvBlock {
    /// Indexed by layer.
    pub layers: Vec<BlockKv>,
}

/// One layer's cached keys and values of one sequence.
#[derive(Debug, Clone)]
pub struct LayerCache {
    block_tokens: usize,
    /// The cached blocks the sequence started from (their positions lead `kv`).
    reused: Vec<BlockKv>,
    /// Every cached position, `[kv_heads, len, dim]` each.
    kv: Option<BlockKv>,
}

impl LayerCache {
    /// An empty cache of `block_tokens`-token blocks.
    pub fn new(block_tokens: usize) -> Self {
        Self {
            block_tokens: block_tokens.max(1),
            reused: Vec::new(),
            kv: None,
        }
    }

    /// Number of cached positions.
    pub fn len(&self) -> usize {
        self.kv.as_ref().map_or(0, |kv| kv.keys.dim(1).unwrap_or(0))
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every cached position's keys and values, `[kv_heads, len, dim]` each (reused blocks
    /// included): what a KV export copies out.
    pub fn keys_values(&self) -> Option<&BlockKv> {
        self.kv.as_ref()
    }

    /// Appends `[kv_heads, n, dim]` keys and values; returns the whole cache, `[kv_heads,
    /// len, dim]` each, for the attention over it.
    pub fn append(&mut self, keys: Tensor, values: Tensor) -> Result<(Tensor, Tensor)> {
        let kv = match self.kv.take() {
            Some(old) => BlockKv {
                keys: Tensor::cat(&[&old.keys, &keys], 1)?,
                values: Tensor::cat(&[&old.values, &values], 1)?,
                latent: old.latent,
            },
            None => BlockKv {
                keys,
                values,
                latent: None,
            },
        };
        self.kv = Some(kv.clone());
        Ok((kv.keys, kv.values))
    }

    /// Appends `[n, width]` rows of MLA's compressed KV for the positions the last
    /// [`LayerCache::append`] added.
    pub fn append_latent(&mut self, rows: Tensor) -> Result<()> {
        let kv = self
            .kv
            .as_mut()
            .ok_or_else(|| ModelError::Input("a latent appended before its keys".into()))?;
        kv.latent = Some(match kv.latent.take() {
            Some(old) => Tensor::cat(&[&old, &rows], 0)?,
            None => rows,
        });
        Ok(())
    }

    /// Full block `index`: the reused block itself, or a copy of its positions (a narrowed view
    /// would keep the whole cache alive).
    fn block(&self, index: usize) -> Result<BlockKv> {
        if let Some(reused) = self.reused.get(index) {
            return Ok(reused.clone());
        }
        let kv = self.kv.as_ref().ok_or_else(|| no_block(index))?;
        if (index + 1) * self.block_tokens > self.len() {
            return Err(no_block(index));
        }
        slice(kv, index * self.block_tokens, self.block_tokens)
    }
}

fn no_block(index: usize) -> ModelError {
    ModelError::Input(format!("KV block {index} is not complete"))
}

/// Positions `start..start + len` of `[kv_heads, positions, dim]` keys and values, copied into
/// their own storage.
fn slice(kv: &BlockKv, start: usize, len: usize) -> Result<BlockKv> {
    let latent = match &kv.latent {
        Some(latent) => Some(latent.narrow(0, start, len)?.contiguous()?),
        None => None,
    };
    Ok(BlockKv {
        keys: kv.keys.narrow(1, start, len)?.contiguous()?,
        values: kv.values.narrow(1, start, len)?.contiguous()?,
        latent,
    })
}

/// A sequence's cache on a device model (the GPU path's `GpuSequence`: its blocks of the
/// device's paged cache, returned to the pool when dropped); opaque to the CPU path.
pub trait DeviceCache: Send + std::fmt::Debug {
    /// Tokens cached so far.
    fn len(&self) -> usize;

    /// Whether nothing is cached yet.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The concrete cache, for the device model that made it.
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;

    /// Every cached position read back to host memory, one [`BlockKv`] per layer as the host
    /// path holds it (f32 `[kv_heads, len, dim]` keys and values, and MLA's compressed rows
    /// in `latent`): what a KV export copies out. Waits for the device's work so far.
    fn read_back(&self) -> Result<Vec<BlockKv>>;
}

/// A sequence's KV cache across all layers: host blocks on the CPU path, or the sequence's
/// place in a device model's cache (`device`).
#[derive(Debug)]
pub struct KvCache {
    pub layers: Vec<LayerCache>,
    pub device: Option<Box<dyn DeviceCache>>,
}

impl KvCache {
    /// An empty cache for `num_layers` layers of `block_tokens`-token blocks.
    pub fn new(num_layers: usize, block_tokens: usize) -> Self {
        Self {
            layers: vec![LayerCache::new(block_tokens); num_layers],
            device: None,
        }
    }

    /// Number of cached positions (the sequence's length so far).
    pub fn len(&self) -> usize {
        match &self.device {
            Some(device) => device.len(),
            None => self.layers.first().map_or(0, LayerCache::len),
        }
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tokens per block.
    pub fn block_tokens(&self) -> usize {
        self.layers
            .first()
            .map_or(KV_BLOCK_TOKENS, |l| l.block_tokens)
    }

    /// Full blocks cached in every layer (host caches; a device cache has none here).
    pub fn full_blocks(&self) -> usize {
        match &self.device {
            Some(_) => 0,
            None => {
                let len = self.layers.iter().map(LayerCache::len).min().unwrap_or(0);
                len / self.block_tokens()
            }
        }
    }

    /// Full block `index` across every layer, if it is cached: the block a sequence reused, or
    /// a copy of its positions.
    pub fn block(&self, index: usize) -> Option<KvBlock> {
        if index >= self.full_blocks() {
            return None;
        }
        let layers: Result<Vec<BlockKv>> = self.layers.iter().map(|l| l.block(index)).collect();
        layers.ok().map(|layers| KvBlock { layers })
    }

    /// Starts an empty host cache from the first `tokens` positions of `blocks`, an earlier
    /// sequence's prefix: the whole blocks are held by reference, and every reused position,
    /// a partly used last block's included, is concatenated once into this sequence's cache.
    pub fn reuse(&mut self, blocks: &[KvBlock], tokens: usize) -> Result<()> {
        let bt = self.block_tokens();
        if self.device.is_some() || !self.is_empty() || tokens > blocks.len() * bt {
            return Err(ModelError::Input(format!(
                "cannot reuse {tokens} tokens of {} blocks in a cache of {} tokens",
                blocks.len(),
                self.len()
            )));
        }
        let (whole, part) = (tokens / bt, tokens % bt);
        for (layer, cache) in self.layers.iter_mut().enumerate() {
            let kv = |b: &KvBlock| {
                b.layers.get(layer).cloned().ok_or_else(|| {
                    ModelError::Input(format!("a reused block has no layer {layer}"))
                })
            };
            cache.reused = blocks[..whole].iter().map(kv).collect::<Result<_>>()?;
            let mut pieces = cache.reused.clone();
            if part > 0 {
                pieces.push(slice(&kv(&blocks[whole])?, 0, part)?);
            }
            if pieces.is_empty() {
                continue;
            }
            let keys: Vec<&Tensor> = pieces.iter().map(|p| &p.keys).collect();
            let values: Vec<&Tensor> = pieces.iter().map(|p| &p.values).collect();
            let latents: Option<Vec<&Tensor>> = pieces.iter().map(|p| p.latent.as_ref()).collect();
            cache.kv = Some(BlockKv {
                keys: Tensor::cat(&keys, 1)?,
                values: Tensor::cat(&values, 1)?,
                latent: latents.map(|l| Tensor::cat(&l, 0)).transpose()?,
            });
        }
        Ok(())
    }
}
