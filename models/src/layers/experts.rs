//! The routed experts of one MoE layer, addressable by id, of which a process may hold only some
//! (an EP rank's home experts, [`ExpertSelection`]): asking for one it does not hold is an error
//! naming the expert and what is held, never a panic.

use crate::checkpoint::Weights;
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::expert_selection::ExpertSelection;
use crate::layers::{Mlp, MlpNames};

/// One MoE layer's routed experts: `num_experts()` ids, the selected ones loaded.
#[derive(Debug, Clone)]
pub struct RoutedExperts {
    /// What errors call this layer's experts (their checkpoint prefix, e.g.
    /// `model.layers.3.mlp.experts`).
    name: String,
    /// Indexed by expert id; `None` for an expert this process did not load.
    experts: Vec<Option<Mlp>>,
    selection: ExpertSelection,
}

impl RoutedExperts {
    /// Every expert of a layer, loaded (`name` labels them in errors).
    pub fn all(name: impl Into<String>, experts: Vec<Mlp>) -> Self {
        Self {
            name: name.into(),
            experts: experts.into_iter().map(Some).collect(),
            selection: ExpertSelection::All,
        }
    }

    /// `E`, the layer's routed experts, loaded here or not.
    pub fn num_experts(&self) -> usize {
        self.experts.len()
    }

    /// Which experts are loaded.
    pub fn selection(&self) -> &ExpertSelection {
        &self.selection
    }

    /// Whether expert `expert` is loaded here.
    pub fn is_loaded(&self, expert: u32) -> bool {
        self.experts
            .get(expert as usize)
            .is_some_and(|e| e.is_some())
    }

    /// Expert `expert`, or an error naming it and the experts this process holds.
    pub fn get(&self, expert: u32) -> Result<&Mlp> {
        match self.experts.get(expert as usize) {
            Some(Some(mlp)) => Ok(mlp),
            Some(None) => Err(ModelError::ExpertNotLoaded {
                expert: format!("{}.{expert}", self.name),
                loaded: self.selection.to_string(),
                num_experts: self.experts.len(),
            }),
            None => Err(ModelError::Input(format!(
                "expert {expert} of {}, which has {} experts",
                self.name,
                self.experts.len()
            ))),
        }
    }

    /// Fails unless every expert is loaded: what a path that runs all experts here (the dense
    /// reference) needs, checked before any work so the error does not depend on the routing.
    pub fn require_all(&self) -> Result<()> {
        match self.experts.iter().position(Option::is_none) {
            Some(missing) => self.get(missing as u32).map(|_| ()),
            None => Ok(()),
        }
    }
}

/// Loads the selected routed experts of a block: per-expert tensors
/// (`experts.{e}.gate_proj.weight`, the classic hub layout) or fused ones
/// (`experts.gate_up_proj` `[E, 2I, H]` and `experts.down_proj` `[E, H, I]`, what newer
/// transformers versions may write), in which only the selected experts' slices are read. The
/// other experts' tensors are checked in the header and skipped, never read.
pub fn load_experts(
    w: &Weights,
    config: &ModelConfig,
    names: MlpNames,
    selection: &ExpertSelection,
) -> Result<RoutedExperts> {
    let (e, h, i) = (
        config.moe.num_experts,
        config.hidden_size,
        config.moe.intermediate_size,
    );
    selection.check(e)?;
    let experts = if w.contains("gate_up_proj") {
        let (gate_up_shape, down_shape) = ([e, 2 * i, h], [e, h, i]);
        w.skip(&gate_up_shape, "gate_up_proj")?;
        w.skip(&down_shape, "down_proj")?;
        (0..e)
            .map(|expert| {
                if !selection.contains(expert as u32) {
                    return Ok(None);
                }
                let fused = w.get_index(&gate_up_shape, "gate_up_proj", expert)?;
                let down = w.get_index(&down_shape, "down_proj", expert)?;
                Mlp::from_parts(&fused.narrow(0, 0, i)?, &fused.narrow(0, i, i)?, &down).map(Some)
            })
            .collect::<Result<Vec<_>>>()?
    } else {
        (0..e)
            .map(|expert| {
                let w = w.pp(expert);
                if selection.contains(expert as u32) {
                    return Mlp::load(&w, h, i, names).map(Some);
                }
                for (name, shape) in [
                    (names.gate, [i, h]),
                    (names.up, [i, h]),
                    (names.down, [h, i]),
                ] {
                    w.pp(name).skip(&shape, "weight")?;
                }
                Ok(None)
            })
            .collect::<Result<Vec<_>>>()?
    };
    Ok(RoutedExperts {
        name: w.prefix().to_string(),
        experts,
        selection: selection.clone(),
    })
}
