//! rackfill-models: Hugging Face MoE checkpoints (config.json, safetensors, tokenizer, chat
//! template) loaded offline, with each family split into attention, router and per-expert FFN so
//! that experts can run on any rank.

pub mod bundle;
pub mod chat_template;
pub mod checkpoint;
pub mod config;
pub mod error;
pub mod expert_selection;
pub mod families;
pub mod generation_config;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod layers;
pub mod model;
pub mod source;
mod synthetic;
pub mod tokenizer;

pub use bundle::{CheckpointModel, ModelBundle, ModelOrigin, BUILTIN_MODEL_NAME};
pub use chat_template::{ChatMessage, ChatTemplate};
pub use checkpoint::{Checkpoint, Synthetic};
pub use config::{Family, ModelConfig};
pub use error::{ModelError, Result};
pub use expert_selection::ExpertSelection;
pub use generation_config::GenerationConfig;
pub use layers::attention::SeqChunk;
pub use layers::kv_cache::{BlockKv, KvBlock, KvCache, LayerCache, KV_BLOCK_TOKENS};
pub use layers::router::Routing;
pub use model::{DecoderLayer, FeedForward, LogitsFor, MoeModel, SequenceInput};
pub use tokenizer::{DecodeStream, Tokenizer};
