//! Real model shapes for `rackfill bench forward --model-shape`: the published configs of
//! Qwen3-30B-A3B and DeepSeek-V3, or any Qwen3-MoE or DeepSeek-V3 `config.json` (optionally cut
//! to their first `layers`), every tensor name and shape a checkpoint of such a config holds
//! (what [`Checkpoint::synthetic`] serves, so a 61 GB model runs without a file), and the model
//! FLOPs of a prefill, the numerator of model FLOP utilisation.

use std::path::{Path, PathBuf};

use rackfill_models::config::Family;
use rackfill_models::{Checkpoint, ModelConfig};

/// Why a model shape cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum ShapeError {
    #[error(transparent)]
    Model(#[from] rackfill_models::ModelError),
    #[error("{0}")]
    Config(String),
}

/// A model `--model-shape` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelShape {
    /// Qwen3-30B-A3B: 48 layers, hidden 2048, 32/4 heads of 128, 128 experts top-8 of 768.
    Qwen3_30bA3b,
    /// DeepSeek-V3 (671B): 61 layers (3 dense), hidden 7168, MLA with 128 heads, 256 experts
    /// top-8 of 2048 and one shared expert, sigmoid group-limited routing.
    DeepseekV3,
    /// The model a `config.json` (or a directory holding one) describes: a Qwen3-MoE or a
    /// DeepSeek-V3 of any size, without its weights.
    Config(PathBuf),
}

impl ModelShape {
    /// Every shape, with the name `--model-shape` takes.
    pub const ALL: [(&'static str, Self); 2] = [
        ("qwen3-30b-a3b", Self::Qwen3_30bA3b),
        ("deepseek-v3", Self::DeepseekV3),
    ];

    /// The shape `name` names, or the `config.json` at the path `name` (one line listing the
    /// known names otherwise).
    pub fn parse(name: &str) -> Result<Self, String> {
        if let Some((_, shape)) = Self::ALL.iter().find(|(n, _)| *n == name) {
            return Ok(shape.clone());
        }
        let path = Path::new(name);
        let file = if path.is_dir() {
            path.join("config.json")
        } else {
            path.to_path_buf()
        };
        if file.is_file() {
            return Ok(Self::Config(file));
        }
        let known: Vec<&str> = Self::ALL.iter().map(|(n, _)| *n).collect();
        Err(format!(
            "unknown model shape '{name}' (one of {}, or a config.json)",
            known.join(", ")
        ))
    }

    /// The name `--model-shape` takes (the path, for a config file).
    pub fn name(&self) -> String {
        match self {
            Self::Config(path) => path.display().to_string(),
            shape => Self::ALL
                .iter()
                .find(|(_, s)| s == shape)
                .map_or("?", |(n, _)| n)
                .to_string(),
        }
    }

    /// The model's `config.json` (bf16, no multi-token-prediction layer), with its first
    /// `layers` decoder layers when given.
    pub fn config_json(&self, layers: Option<usize>) -> Result<serde_json::Value, ShapeError> {
        let mut config = match self {
            Self::Config(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    ShapeError::Config(format!("cannot read {}: {e}", path.display()))
                })?;
                serde_json::from_str(&text).map_err(|e| {
                    ShapeError::Config(format!("{} is not JSON: {e}", path.display()))
                })?
            }
            Self::Qwen3_30bA3b => serde_json::json!({
                "architectures": ["Qwen3MoeForCausalLM"],
                "model_type": "qwen3_moe",
                "vocab_size": 151936,
                "hidden_size": 2048,
                "intermediate_size": 6144,
                "moe_intermediate_size": 768,
                "num_hidden_layers": 48,
                "num_attention_heads": 32,
                "num_key_value_heads": 4,
                "head_dim": 128,
                "num_experts": 128,
                "num_experts_per_tok": 8,
                "norm_topk_prob": true,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "attention_bias": false,
                "rms_norm_eps": 1e-6,
                "rope_theta": 1000000.0,
                "max_position_embeddings": 40960,
                "tie_word_embeddings": false,
                "bos_token_id": 151643,
                "eos_token_id": 151645
            }),
            Self::DeepseekV3 => serde_json::json!({
                "architectures": ["DeepseekV3ForCausalLM"],
                "model_type": "deepseek_v3",
                "vocab_size": 129280,
                "hidden_size": 7168,
                "intermediate_size": 18432,
                "moe_intermediate_size": 2048,
                "num_hidden_layers": 61,
                "first_k_dense_replace": 3,
                "num_attention_heads": 128,
                "num_key_value_heads": 128,
                "head_dim": 64,
                "q_lora_rank": 1536,
                "kv_lora_rank": 512,
                "qk_nope_head_dim": 128,
                "qk_rope_head_dim": 64,
                "v_head_dim": 128,
                "n_routed_experts": 256,
                "n_shared_experts": 1,
                "num_experts_per_tok": 8,
                "n_group": 8,
                "topk_group": 4,
                "norm_topk_prob": true,
                "routed_scaling_factor": 2.5,
                "scoring_func": "sigmoid",
                "topk_method": "noaux_tc",
                "num_nextn_predict_layers": 0,
                "attention_bias": false,
                "rms_norm_eps": 1e-6,
                "rope_interleave": true,
                "rope_theta": 10000.0,
                "rope_scaling": {
                    "type": "yarn",
                    "factor": 40.0,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0,
                    "original_max_position_embeddings": 4096
                },
                "max_position_embeddings": 163840,
                "tie_word_embeddings": false,
                "bos_token_id": 0,
                "eos_token_id": 1
            }),
        };
        if let Some(layers) = layers {
            config["num_hidden_layers"] = layers.into();
        }
        Ok(config)
    }

    /// The config and a synthetic checkpoint (no stored values, see [`Checkpoint::synthetic`])
    /// of this shape with `layers` decoder layers (all when `None`), weights seeded by `seed`.
    pub fn synthetic(
        &self,
        layers: Option<usize>,
        seed: u64,
    ) -> Result<(ModelConfig, Checkpoint), ShapeError> {
        if layers == Some(0) {
            return Err(ShapeError::Config("--layers must be positive".into()));
        }
        let name = self.name();
        let json = self.config_json(layers)?.to_string();
        let config = ModelConfig::from_json_str(&json, Path::new(&name))?;
        if !matches!(config.family, Family::Qwen3Moe | Family::DeepseekV3) {
            return Err(ShapeError::Config(format!(
                "{name}: synthetic weights know Qwen3-MoE's and DeepSeek-V3's tensor names, not \
                 {:?}'s",
                config.family
            )));
        }
        let checkpoint = Checkpoint::synthetic(&name, tensor_shapes(&config), seed);
        Ok((config, checkpoint))
    }
}

/// Every tensor name and shape a checkpoint of `config` holds (Qwen3-MoE's names, or
/// DeepSeek-V3's for a model with latent attention), without multi-token-prediction layers.
pub fn tensor_shapes(config: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let (h, v) = (config.hidden_size, config.vocab_size);
    let mut shapes = vec![
        ("model.embed_tokens.weight".to_string(), vec![v, h]),
        ("model.norm.weight".to_string(), vec![h]),
    ];
    if !config.tie_word_embeddings {
        shapes.push(("lm_head.weight".to_string(), vec![v, h]));
    }
    for layer in 0..config.num_layers {
        let p = format!("model.layers.{layer}");
        let mut add = |name: &str, shape: Vec<usize>| shapes.push((format!("{p}.{name}"), shape));
        add("input_layernorm.weight", vec![h]);
        add("post_attention_layernorm.weight", vec![h]);
        attention_shapes(config, &mut add);
        let mlp = |add: &mut dyn FnMut(&str, Vec<usize>), prefix: &str, inter: usize| {
            add(&format!("{prefix}.gate_proj.weight"), vec![inter, h]);
            add(&format!("{prefix}.up_proj.weight"), vec![inter, h]);
            add(&format!("{prefix}.down_proj.weight"), vec![h, inter]);
        };
        if !config.sparse_layers[layer] {
            mlp(&mut add, "mlp", config.intermediate_size);
            continue;
        }
        let moe = &config.moe;
        add("mlp.gate.weight", vec![moe.num_experts, h]);
        if config.mla.is_some() {
            add("mlp.gate.e_score_correction_bias", vec![moe.num_experts]);
        }
        for e in 0..moe.num_experts {
            mlp(&mut add, &format!("mlp.experts.{e}"), moe.intermediate_size);
        }
        if let Some(shared) = &moe.shared {
            mlp(&mut add, "mlp.shared_experts", shared.intermediate_size);
        }
    }
    shapes
}

/// One layer's attention tensors: Qwen3's GQA (with q/k norms) or DeepSeek's latent attention.
fn attention_shapes(config: &ModelConfig, add: &mut dyn FnMut(&str, Vec<usize>)) {
    let h = config.hidden_size;
    let heads = config.num_heads;
    let Some(mla) = &config.mla else {
        let (d, kv) = (config.head_dim, config.num_kv_heads);
        add("self_attn.q_proj.weight", vec![heads * d, h]);
        add("self_attn.k_proj.weight", vec![kv * d, h]);
        add("self_attn.v_proj.weight", vec![kv * d, h]);
        add("self_attn.o_proj.weight", vec![h, heads * d]);
        if config.qk_norm {
            add("self_attn.q_norm.weight", vec![d]);
            add("self_attn.k_norm.weight", vec![d]);
        }
        return;
    };
    let qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim;
    match mla.q_lora_rank {
        Some(rank) => {
            add("self_attn.q_a_proj.weight", vec![rank, h]);
            add("self_attn.q_a_layernorm.weight", vec![rank]);
            add("self_attn.q_b_proj.weight", vec![heads * qk, rank]);
        }
        None => add("self_attn.q_proj.weight", vec![heads * qk, h]),
    }
    let latent = mla.kv_lora_rank;
    add(
        "self_attn.kv_a_proj_with_mqa.weight",
        vec![latent + mla.qk_rope_head_dim, h],
    );
    add("self_attn.kv_a_layernorm.weight", vec![latent]);
    add(
        "self_attn.kv_b_proj.weight",
        vec![heads * (mla.qk_nope_head_dim + mla.v_head_dim), latent],
    );
    add("self_attn.o_proj.weight", vec![h, heads * mla.v_head_dim]);
}

/// Model FLOPs of one prefill of `tokens` new tokens over `context` cached ones, last-position
/// logits: two per multiply-add of every projection, expert (the `top_k` chosen and the shared
/// ones), router and the LM head row, plus causal attention over the seen keys. DeepSeek's
/// attention is counted in its published, unabsorbed form (192-wide keys, 128-wide values per
/// head): the figure does not credit an implementation's own detours.
pub fn prefill_flops(config: &ModelConfig, tokens: usize, context: usize) -> f64 {
    let (n, h) = (tokens as f64, config.hidden_size as f64);
    let heads = config.num_heads as f64;
    let (projections, qk, vd) = match &config.mla {
        None => {
            let d = config.head_dim as f64;
            let kv = config.num_kv_heads as f64 * d;
            (h * (2.0 * heads * d + 2.0 * kv), d, d)
        }
        Some(mla) => {
            let qk = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) as f64;
            let (latent, rope) = (mla.kv_lora_rank as f64, mla.qk_rope_head_dim as f64);
            let (nope, vd) = (mla.qk_nope_head_dim as f64, mla.v_head_dim as f64);
            let q = match mla.q_lora_rank {
                Some(rank) => h * rank as f64 + rank as f64 * heads * qk,
                None => h * heads * qk,
            };
            let kv = h * (latent + rope) + latent * heads * (nope + vd);
            (q + kv + heads * vd * h, qk, vd)
        }
    };
    // Query i of the chunk sees context + i + 1 keys.
    let pairs = n * context as f64 + n * (n + 1.0) / 2.0;
    let attention = 2.0 * pairs * heads * (qk + vd);
    let mut per_token = 0.0;
    for &sparse in &config.sparse_layers {
        per_token += projections;
        per_token += if sparse {
            let moe = &config.moe;
            let shared = moe.shared.as_ref().map_or(0, |s| s.intermediate_size) as f64;
            h * moe.num_experts as f64
                + 3.0 * h * (moe.top_k * moe.intermediate_size) as f64
                + 3.0 * h * shared
        } else {
            3.0 * h * config.intermediate_size as f64
        };
    }
    let layers = config.num_layers as f64;
    2.0 * n * per_token + layers * attention + 2.0 * h * config.vocab_size as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../models/tests/fixtures")
            .join(name)
    }

    #[test]
    fn the_tensor_list_is_what_a_checkpoint_of_the_config_holds() {
        for name in ["qwen3_moe", "deepseek_v3", "deepseek_v3_noqlora"] {
            let dir = fixture(name);
            let config = ModelConfig::load(&dir).unwrap();
            let stored: Vec<(String, Vec<usize>)> = Checkpoint::open(&dir)
                .unwrap()
                .tensor_shapes()
                .into_iter()
                .map(|(n, s)| (n.to_string(), s.to_vec()))
                .collect();
            let mut listed = tensor_shapes(&config);
            listed.sort();
            assert_eq!(listed, stored, "{name}");
        }
    }

    #[test]
    fn the_real_shapes_parse_and_count_their_published_sizes() {
        let params = |shape: ModelShape| -> f64 {
            let json = shape.config_json(None).unwrap().to_string();
            let config = ModelConfig::from_json_str(&json, Path::new(&shape.name())).unwrap();
            tensor_shapes(&config)
                .iter()
                .map(|(_, s)| s.iter().product::<usize>() as f64)
                .sum()
        };
        // 30.5B and 671B (DeepSeek's 685B includes the 14B multi-token-prediction module).
        let qwen = params(ModelShape::Qwen3_30bA3b) / 1e9;
        assert!((30.0..31.0).contains(&qwen), "{qwen}");
        let deepseek = params(ModelShape::DeepseekV3) / 1e9;
        assert!((665.0..675.0).contains(&deepseek), "{deepseek}");
        assert_eq!(ModelShape::parse("deepseek-v3"), Ok(ModelShape::DeepseekV3));
        assert!(ModelShape::parse("llama")
            .unwrap_err()
            .contains("qwen3-30b-a3b"));
    }

    #[test]
    fn prefill_flops_are_twice_the_active_parameters_plus_attention() {
        let json = ModelShape::Qwen3_30bA3b
            .config_json(None)
            .unwrap()
            .to_string();
        let config = ModelConfig::from_json_str(&json, Path::new("qwen3")).unwrap();
        // 3.3B active parameters per token without embeddings (Qwen's "A3B").
        let per_token = (prefill_flops(&config, 1000, 0) - prefill_flops(&config, 0, 0)) / 1000.0;
        assert!((5.6e9..7.2e9).contains(&per_token), "{per_token}");
        // Attention grows with the square of the chunk.
        let long = prefill_flops(&config, 16384, 0) / 16384.0;
        assert!(long > per_token * 1.5, "{long} vs {per_token}");
    }
}
