//! What the engine runs a model from: its weights loaded on the host (the CPU path), or left in
//! the checkpoint for a device to read straight from its files (`--device cuda`: each process
//! uploads its ranks' home experts and the dense parts, each once, with no host copy).

use std::sync::Arc;

use rackfill_models::{CheckpointModel, ModelConfig, MoeModel};

/// A model's weights, where the engine takes them from.
#[derive(Clone)]
pub enum ModelWeights {
    /// Loaded into host memory in f32 ([`rackfill_models::ModelBundle::load`]).
    Host(Arc<MoeModel>),
    /// Still in the checkpoint ([`rackfill_models::ModelBundle::open`]).
    Checkpoint(Arc<CheckpointModel>),
}

impl ModelWeights {
    /// The model's normalised architecture.
    pub fn config(&self) -> &ModelConfig {
        match self {
            Self::Host(model) => model.config(),
            Self::Checkpoint(model) => &model.config,
        }
    }
}

impl From<MoeModel> for ModelWeights {
    fn from(model: MoeModel) -> Self {
        Self::Host(Arc::new(model))
    }
}

impl From<Arc<MoeModel>> for ModelWeights {
    fn from(model: Arc<MoeModel>) -> Self {
        Self::Host(model)
    }
}

impl From<CheckpointModel> for ModelWeights {
    fn from(model: CheckpointModel) -> Self {
        Self::Checkpoint(Arc::new(model))
    }
}
