//! A loaded MoE model split into the pieces the engine schedules separately: embedding, per
//! layer attention (on a rank's own tokens, with KV cache), router, per-expert FFNs, shared
//! experts, final norm and LM head. [`MoeModel::forward`] is the dense single-device reference
//! path: all experts local. A model loaded for some EP ranks
//! ([`MoeModel::from_checkpoint_with`]) holds every weight but the other ranks' routed experts.

use std::path::Path;

use candle_core::{Device, Module, Tensor};

use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::expert_selection::ExpertSelection;
use crate::families;
use crate::layers::attention::{Attention, SeqChunk};
use crate::layers::kv_cache::{KvCache, KV_BLOCK_TOKENS};
use crate::layers::moe::MoeBlock;
use crate::layers::{Linear, Mlp, RmsNorm};

/// The feed-forward half of a decoder layer.
pub enum FeedForward {
    /// A dense gated MLP (Qwen `mlp_only_layers`, DeepSeek's first layers).
    Dense(Mlp),
    /// Router, routed experts and shared experts.
    Moe(MoeBlock),
}

impl FeedForward {
    /// Dense reference forward (all experts local).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Dense(mlp) => Ok(mlp.forward(x)?),
            Self::Moe(block) => block.forward(x),
        }
    }
}

/// One transformer block: pre-norm attention and pre-norm feed-forward, each with a residual.
pub struct DecoderLayer {
    pub(crate) input_norm: RmsNorm,
    pub(crate) attention: Box<dyn Attention>,
    pub(crate) post_attention_norm: RmsNorm,
    pub(crate) ffn: FeedForward,
}

impl DecoderLayer {
    /// `x + attention(norm(x))` for a batch of sequence chunks.
    pub fn attention_residual(&self, x: &Tensor, chunks: &mut [SeqChunk<'_>]) -> Result<Tensor> {
        let normed = self.input_norm.forward(x)?;
        Ok((x + self.attention.forward(&normed, chunks)?)?)
    }

    /// The normalised input of the feed-forward half.
    pub fn ffn_input(&self, h: &Tensor) -> Result<Tensor> {
        Ok(self.post_attention_norm.forward(h)?)
    }

    /// The feed-forward half (dense MLP or MoE block).
    pub fn ffn(&self) -> &FeedForward {
        &self.ffn
    }

    /// Dense reference forward of the whole layer.
    pub fn forward(&self, x: &Tensor, chunks: &mut [SeqChunk<'_>]) -> Result<Tensor> {
        let h = self.attention_residual(x, chunks)?;
        let out = self.ffn.forward(&self.ffn_input(&h)?)?;
        Ok((h + out)?)
    }
}

/// One sequence's new tokens and its cache, for a batched forward.
pub struct SequenceInput<'a> {
    pub tokens: &'a [u32],
    pub cache: &'a mut KvCache,
}

/// A token id the model has no embedding for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("token id {token} is outside the vocabulary (size {vocab_size})")]
pub struct OutOfVocabulary {
    pub token: u32,
    pub vocab_size: usize,
}

/// The first id of `tokens` that is not below `vocab_size`, as an error: the one definition of
/// the vocabulary check, used by the engine's request validation and by [`MoeModel::embed`].
pub fn check_vocabulary(tokens: &[u32], vocab_size: usize) -> Result<(), OutOfVocabulary> {
    match tokens.iter().find(|&&t| t as usize >= vocab_size) {
        Some(&token) => Err(OutOfVocabulary { token, vocab_size }),
        None => Ok(()),
    }
}

/// Which positions get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsFor {
    /// Every new token (prompt scoring, `echo` with logprobs).
    AllPositions,
    /// Only each sequence's last new token (plain prefill then sampling).
    LastPosition,
}

/// A loaded model of any supported family.
pub struct MoeModel {
    config: ModelConfig,
    /// `[V, H]`.
    pub(crate) embed_tokens: Tensor,
    layers: Vec<DecoderLayer>,
    pub(crate) norm: RmsNorm,
    pub(crate) lm_head: Linear,
    /// The routed experts loaded in every MoE layer.
    experts: ExpertSelection,
}

impl MoeModel {
    /// Loads `config.json` and the safetensors of a local checkpoint directory.
    pub fn load(dir: &Path) -> Result<Self> {
        Self::load_with(dir, &ExpertSelection::All)
    }

    /// [`Self::load`] with only the `selection` of routed experts read from the checkpoint.
    pub fn load_with(dir: &Path, selection: &ExpertSelection) -> Result<Self> {
        let config = ModelConfig::load(dir)?;
        let checkpoint = Checkpoint::open(dir)?;
        Self::from_checkpoint_with(config, &checkpoint, selection)
    }

    /// Builds the model from a parsed config and an opened checkpoint.
    pub fn from_checkpoint(config: ModelConfig, checkpoint: &Checkpoint) -> Result<Self> {
        Self::from_checkpoint_with(config, checkpoint, &ExpertSelection::All)
    }

    /// Builds the model with only the `selection` of routed experts in every MoE layer (one EP
    /// rank's home experts): the other experts' tensors are checked in the checkpoint's header
    /// but never read, so a process holds only what it runs. Everything else (embeddings,
    /// attention, norms, routers, shared experts, dense layers, LM head) is loaded in full.
    pub fn from_checkpoint_with(
        config: ModelConfig,
        checkpoint: &Checkpoint,
        selection: &ExpertSelection,
    ) -> Result<Self> {
        selection.check(config.moe.num_experts)?;
        checkpoint.set_quantization(config.quantization.as_ref());
        let loader = families::loader(config.family);
        let root = checkpoint.root();
        let model = root.pp("model");
        let (vocab, hidden, eps) = (config.vocab_size, config.hidden_size, config.rms_norm_eps);
        let embed_tokens = model.pp("embed_tokens").get(&[vocab, hidden], "weight")?;
        let layers = (0..config.num_layers)
            .map(|i| {
                let w = model.pp("layers").pp(i);
                let ffn = if config.sparse_layers[i] {
                    let (block, names) = (loader.moe_names)(&w);
                    FeedForward::Moe(MoeBlock::load(&block, &config, names, selection)?)
                } else {
                    FeedForward::Dense((loader.dense)(&w, &config)?)
                };
                Ok(DecoderLayer {
                    input_norm: RmsNorm::load(&w.pp("input_layernorm"), hidden, eps)?,
                    attention: (loader.attention)(&w, &config)?,
                    post_attention_norm: RmsNorm::load(
                        &w.pp("post_attention_layernorm"),
                        hidden,
                        eps,
                    )?,
                    ffn,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::load(&model.pp("norm"), hidden, eps)?;
        let lm_head = if config.tie_word_embeddings && !root.contains("lm_head.weight") {
            Linear::from_weight(&embed_tokens)?
        } else {
            Linear::load(&root.pp("lm_head"), hidden, vocab, false)?
        };
        checkpoint.warn_unused(&config);
        Ok(Self {
            config,
            embed_tokens,
            layers,
            norm,
            lm_head,
            experts: selection.clone(),
        })
    }

    /// The normalised architecture.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The routed experts loaded in every MoE layer ([`ExpertSelection::All`] unless the model
    /// was loaded for some EP ranks).
    pub fn expert_selection(&self) -> &ExpertSelection {
        &self.experts
    }

    /// The decoder layers, for the engine's layer-by-layer EP execution.
    pub fn layers(&self) -> &[DecoderLayer] {
        &self.layers
    }

    /// An empty KV cache for one sequence.
    pub fn new_cache(&self) -> KvCache {
        self.new_paged_cache(KV_BLOCK_TOKENS)
    }

    /// An empty KV cache for one sequence, in blocks of `block_tokens` tokens (what the
    /// engine's prefix cache shares between sequences).
    pub fn new_paged_cache(&self, block_tokens: usize) -> KvCache {
        KvCache::new(self.config.num_layers, block_tokens)
    }

    /// Token embeddings `[T, H]`; ids beyond the vocabulary are an input error (the engine
    /// refuses them when a request is validated; this guards direct callers of the model).
    pub fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        check_vocabulary(tokens, self.config.vocab_size)
            .map_err(|e| ModelError::Input(e.to_string()))?;
        let ids = Tensor::from_slice(tokens, tokens.len(), &Device::Cpu)?;
        Ok(self.embed_tokens.index_select(&ids, 0)?)
    }

    /// Final norm and LM head: hidden states `[T, H]` to logits `[T, V]`.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(self.lm_head.forward(&self.norm.forward(hidden)?)?)
    }

    /// Dense reference forward of a batch of sequences, each continuing from its cache.
    /// Returns logits for every new token (rows in batch order) or for each sequence's last one.
    /// Runs every routed expert here, so a model loaded for some EP ranks only refuses it
    /// ([`ModelError::ExpertNotLoaded`]) before any work.
    pub fn forward(&self, batch: &mut [SequenceInput<'_>], which: LogitsFor) -> Result<Tensor> {
        let tokens: Vec<u32> = batch
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect();
        if batch
            .iter()
            .any(|s| s.cache.layers.len() != self.layers.len())
        {
            return Err(ModelError::Input(
                "KV cache was made for a different model".into(),
            ));
        }
        for layer in &self.layers {
            if let FeedForward::Moe(block) = &layer.ffn {
                block.experts.require_all()?;
            }
        }
        let mut x = self.embed(&tokens)?;
        for (index, layer) in self.layers.iter().enumerate() {
            let mut chunks: Vec<SeqChunk<'_>> = batch
                .iter_mut()
                .map(|s| SeqChunk {
                    len: s.tokens.len(),
                    cache: &mut s.cache.layers[index],
                })
                .collect();
            x = layer.forward(&x, &mut chunks)?;
        }
        let lens: Vec<usize> = batch.iter().map(|s| s.tokens.len()).collect();
        self.logits_for(x, &lens, &vec![which; batch.len()])
    }

    /// Final norm and LM head on the rows of `hidden` that each sequence asks for: `lens[i]`
    /// consecutive rows belong to sequence `i`, and `which[i]` selects all of them or the last.
    pub fn logits_for(
        &self,
        hidden: Tensor,
        lens: &[usize],
        which: &[LogitsFor],
    ) -> Result<Tensor> {
        if lens.len() != which.len() || lens.iter().sum::<usize>() != hidden.dim(0)? {
            return Err(ModelError::Input(format!(
                "{} hidden rows for sequences of lengths {lens:?}",
                hidden.dim(0)?
            )));
        }
        if which.iter().all(|&w| w == LogitsFor::AllPositions) {
            return self.logits(&hidden);
        }
        let mut rows = Vec::new();
        let mut start = 0u32;
        for (&len, &w) in lens.iter().zip(which) {
            let end = start + len as u32;
            match w {
                _ if len == 0 => {}
                LogitsFor::AllPositions => rows.extend(start..end),
                LogitsFor::LastPosition => rows.push(end - 1),
            }
            start = end;
        }
        let n = rows.len();
        self.logits(&hidden.index_select(&Tensor::from_vec(rows, n, &Device::Cpu)?, 0)?)
    }
}
