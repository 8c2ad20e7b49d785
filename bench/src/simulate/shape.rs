//! Model shapes: the dimensions the cost model needs (layers, experts, top-k, widths, attention).
//!
//! Built-in presets transcribe the public Hugging Face `config.json` of each model; `FILE.json`
//! is either a shape file in this module's own format or a Hugging Face `config.json` (parsed with
//! `rackfill_models` where it knows the architecture, with a generic reader of the common field
//! names otherwise, e.g. GLM-4.5/4.7's `glm4_moe`).

use super::error::SimError;
use crate::synthetic::MAX_EXPERTS;
use rackfill_engine::rack_cost::MoeDims;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::path::Path;

/// Largest width, head count, head dimension or rank a shape may give. Real models stay far below
/// (hidden sizes of a few ten thousand); the bound keeps every product of dimensions the cost
/// model forms (expert bytes `3 H I 2`, projection widths) exact in 64 bits, where a hidden size of
/// 2^62 wrapped an expert to 0 bytes and 2^40 planned terabytes of replica transfers.
pub const MAX_WIDTH: usize = 1 << 18;

/// Most decoder layers a shape may have (the largest models have about a hundred).
pub const MAX_LAYERS: usize = 4096;

/// Attention dimensions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum Attention {
    /// Grouped-query attention: `q_heads` query heads sharing `kv_heads` key/value heads.
    Gqa {
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
    },
    /// DeepSeek's multi-head latent attention, costed in its prefill (decompressed) form.
    Mla {
        q_heads: usize,
        /// Low-rank query projection; `None` projects queries directly.
        q_lora_rank: Option<usize>,
        kv_lora_rank: usize,
        qk_nope_head_dim: usize,
        qk_rope_head_dim: usize,
        v_head_dim: usize,
    },
}

/// One model's shape; also the JSON format of a shape file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelShape {
    pub name: String,
    /// Decoder layers.
    pub layers: usize,
    /// Layers with a dense MLP instead of experts (DeepSeek's `first_k_dense_replace`).
    #[serde(default)]
    pub dense_layers: usize,
    /// Routed experts per MoE layer.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    pub hidden: usize,
    /// Intermediate width of one routed expert.
    pub moe_intermediate: usize,
    /// Total intermediate width of the always-on shared experts (0: none).
    #[serde(default)]
    pub shared_intermediate: usize,
    /// Intermediate width of the dense MLP layers.
    #[serde(default)]
    pub dense_intermediate: usize,
    pub attention: Attention,
}

impl ModelShape {
    /// Qwen3-235B-A22B (`Qwen/Qwen3-235B-A22B` config.json): 94 layers, all MoE, 128 experts,
    /// top-8, hidden 4096, expert width 1536, GQA 64 q / 4 kv heads of 128.
    pub fn qwen3_235b() -> Self {
        Self {
            name: "qwen3-235b".into(),
            layers: 94,
            dense_layers: 0,
            experts: 128,
            top_k: 8,
            hidden: 4096,
            moe_intermediate: 1536,
            shared_intermediate: 0,
            dense_intermediate: 12288,
            attention: Attention::Gqa {
                q_heads: 64,
                kv_heads: 4,
                head_dim: 128,
            },
        }
    }

    /// DeepSeek-V3 (`deepseek-ai/DeepSeek-V3` config.json): 61 layers of which the first 3 dense
    /// (width 18432), 256 routed + 1 shared expert of width 2048, top-8, hidden 7168, MLA with 128
    /// heads, q rank 1536, kv rank 512, nope/rope/v head dims 128/64/128.
    pub fn deepseek_v3() -> Self {
        Self {
            name: "deepseek-v3".into(),
            layers: 61,
            dense_layers: 3,
            experts: 256,
            top_k: 8,
            hidden: 7168,
            moe_intermediate: 2048,
            shared_intermediate: 2048,
            dense_intermediate: 18432,
            attention: Attention::Mla {
                q_heads: 128,
                q_lora_rank: Some(1536),
                kv_lora_rank: 512,
                qk_nope_head_dim: 128,
                qk_rope_head_dim: 64,
                v_head_dim: 128,
            },
        }
    }

    /// GLM-4.7 (GLM-4.5-class `Glm4MoeForCausalLM`, 355B/358B): 92 layers of which the first 3
    /// dense (width 12288), 160 routed + 1 shared expert of width 1536, top-8, hidden 5120, GQA
    /// 96 q / 8 kv heads of 128.
    pub fn glm_4_7() -> Self {
        Self {
            name: "glm-4.7".into(),
            layers: 92,
            dense_layers: 3,
            experts: 160,
            top_k: 8,
            hidden: 5120,
            moe_intermediate: 1536,
            shared_intermediate: 1536,
            dense_intermediate: 12288,
            attention: Attention::Gqa {
                q_heads: 96,
                kv_heads: 8,
                head_dim: 128,
            },
        }
    }

    /// A preset name or a JSON file (shape file or Hugging Face `config.json`).
    pub fn load(spec: &str) -> Result<Self, SimError> {
        match spec {
            "qwen3-235b" => return Ok(Self::qwen3_235b()),
            "deepseek-v3" => return Ok(Self::deepseek_v3()),
            "glm-4.7" => return Ok(Self::glm_4_7()),
            _ => {}
        }
        if !spec.ends_with(".json") && !Path::new(spec).exists() {
            return Err(SimError::Input(format!(
                "unknown model shape '{spec}' (expected qwen3-235b, deepseek-v3, glm-4.7 or a JSON file)"
            )));
        }
        let text = std::fs::read_to_string(spec)
            .map_err(|e| SimError::Input(format!("cannot read shape file {spec}: {e}")))?;
        Self::from_json(&text, spec)
    }

    /// Parses a shape file or a Hugging Face config (told apart by `num_hidden_layers`).
    pub fn from_json(text: &str, origin: &str) -> Result<Self, SimError> {
        let bad = |why: String| SimError::Input(format!("shape file {origin}: {why}"));
        let value: Value = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        let Value::Object(map) = &value else {
            return Err(bad("expected a JSON object".into()));
        };
        let shape = if map.contains_key("num_hidden_layers") {
            from_hf_config(text, map, origin)?
        } else {
            serde_json::from_value(value).map_err(|e| bad(e.to_string()))?
        };
        shape.validate().map_err(bad)?;
        Ok(shape)
    }

    /// Checks the dimensions are usable and bounded ([`MAX_LAYERS`], the synthetic generator's
    /// [`MAX_EXPERTS`], [`MAX_WIDTH`]); the reason names the field.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("layers", self.layers, MAX_LAYERS),
            ("experts", self.experts, MAX_EXPERTS),
            ("top_k", self.top_k, MAX_EXPERTS),
            ("hidden", self.hidden, MAX_WIDTH),
            ("moe_intermediate", self.moe_intermediate, MAX_WIDTH),
        ];
        for (name, v, max) in positive {
            if !(1..=max).contains(&v) {
                return Err(format!("{name} must be in 1..={max}, got {v}"));
            }
        }
        for (name, v) in [
            ("shared_intermediate", self.shared_intermediate),
            ("dense_intermediate", self.dense_intermediate),
        ] {
            if v > MAX_WIDTH {
                return Err(format!("{name} must be at most {MAX_WIDTH}, got {v}"));
            }
        }
        if self.dense_layers >= self.layers {
            return Err(format!(
                "dense_layers {} leaves no MoE layer out of {}",
                self.dense_layers, self.layers
            ));
        }
        if self.top_k > self.experts {
            return Err(format!(
                "top_k {} exceeds the {} experts",
                self.top_k, self.experts
            ));
        }
        if self.dense_layers > 0 && self.dense_intermediate == 0 {
            return Err("dense_intermediate must be positive when dense_layers > 0".into());
        }
        match self.attention {
            Attention::Gqa {
                q_heads,
                kv_heads,
                head_dim,
            } => {
                if q_heads == 0 || kv_heads == 0 || head_dim == 0 || q_heads % kv_heads != 0 {
                    return Err(format!(
                        "attention needs positive heads and head_dim with kv_heads dividing q_heads, got {q_heads}/{kv_heads}/{head_dim}"
                    ));
                }
                if q_heads.max(head_dim) > MAX_WIDTH {
                    return Err(format!(
                        "attention heads and head_dim must be at most {MAX_WIDTH}, got {q_heads}/{head_dim}"
                    ));
                }
            }
            Attention::Mla {
                q_heads,
                q_lora_rank,
                kv_lora_rank,
                qk_nope_head_dim,
                qk_rope_head_dim,
                v_head_dim,
            } => {
                if q_heads == 0
                    || kv_lora_rank == 0
                    || qk_nope_head_dim == 0
                    || v_head_dim == 0
                    || q_lora_rank == Some(0)
                {
                    return Err("MLA attention needs positive heads, ranks and head dims".into());
                }
                let dims = [
                    q_heads,
                    q_lora_rank.unwrap_or(0),
                    kv_lora_rank,
                    qk_nope_head_dim,
                    qk_rope_head_dim,
                    v_head_dim,
                ];
                if dims.iter().any(|&d| d > MAX_WIDTH) {
                    return Err(format!(
                        "MLA heads, ranks and head dims must be at most {MAX_WIDTH}"
                    ));
                }
            }
        }
        Ok(())
    }

    /// MoE layers per forward pass.
    pub fn moe_layers(&self) -> usize {
        self.layers - self.dense_layers
    }

    /// The dimensions a routed expert's cost depends on (expert bytes, FLOPs per pair and token
    /// bytes, all BF16 as in UltraEP's evaluation: [`MoeDims`]).
    pub fn moe_dims(&self) -> MoeDims {
        MoeDims {
            hidden: self.hidden,
            intermediate: self.moe_intermediate,
        }
    }

    /// Projection FLOPs of attention per token (q, k, v and output projections).
    pub fn attention_projection_flops(&self) -> f64 {
        let h = self.hidden as f64;
        match self.attention {
            Attention::Gqa {
                q_heads,
                kv_heads,
                head_dim,
            } => 2.0 * h * (head_dim * (2 * q_heads + 2 * kv_heads)) as f64,
            Attention::Mla {
                q_heads,
                q_lora_rank,
                kv_lora_rank,
                qk_nope_head_dim,
                qk_rope_head_dim,
                v_head_dim,
            } => {
                let qk = (qk_nope_head_dim + qk_rope_head_dim) as f64;
                let heads = q_heads as f64;
                let q = match q_lora_rank {
                    Some(rank) => 2.0 * h * rank as f64 + 2.0 * rank as f64 * heads * qk,
                    None => 2.0 * h * heads * qk,
                };
                let kv_a = 2.0 * h * (kv_lora_rank + qk_rope_head_dim) as f64;
                let kv_b =
                    2.0 * kv_lora_rank as f64 * heads * (qk_nope_head_dim + v_head_dim) as f64;
                let o = 2.0 * heads * v_head_dim as f64 * h;
                q + kv_a + kv_b + o
            }
        }
    }

    /// Attention-core FLOPs per (query, key) pair: scores plus the weighted sum of values.
    pub fn attention_flops_per_pair(&self) -> f64 {
        match self.attention {
            Attention::Gqa {
                q_heads, head_dim, ..
            } => 4.0 * (q_heads * head_dim) as f64,
            Attention::Mla {
                q_heads,
                qk_nope_head_dim,
                qk_rope_head_dim,
                v_head_dim,
                ..
            } => 2.0 * (q_heads * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim)) as f64,
        }
    }

    /// Router FLOPs per token (one `H x E` product).
    pub fn router_flops(&self) -> f64 {
        2.0 * (self.hidden * self.experts) as f64
    }
}

/// A Hugging Face config: `rackfill_models` normalises the architectures it runs; anything else
/// goes through [`generic_hf_shape`].
fn from_hf_config(
    text: &str,
    map: &Map<String, Value>,
    origin: &str,
) -> Result<ModelShape, SimError> {
    use rackfill_models::config::MlaConfig;
    match rackfill_models::ModelConfig::from_json_str(text, Path::new(origin)) {
        Ok(config) => {
            let dense_layers = config.sparse_layers.iter().filter(|&&s| !s).count();
            let attention = match &config.mla {
                Some(MlaConfig {
                    q_lora_rank,
                    kv_lora_rank,
                    qk_nope_head_dim,
                    qk_rope_head_dim,
                    v_head_dim,
                    ..
                }) => Attention::Mla {
                    q_heads: config.num_heads,
                    q_lora_rank: *q_lora_rank,
                    kv_lora_rank: *kv_lora_rank,
                    qk_nope_head_dim: *qk_nope_head_dim,
                    qk_rope_head_dim: *qk_rope_head_dim,
                    v_head_dim: *v_head_dim,
                },
                None => Attention::Gqa {
                    q_heads: config.num_heads,
                    kv_heads: config.num_kv_heads,
                    head_dim: config.head_dim,
                },
            };
            Ok(ModelShape {
                name: model_name(map, origin),
                layers: config.num_layers,
                dense_layers,
                experts: config.moe.num_experts,
                top_k: config.moe.top_k,
                hidden: config.hidden_size,
                moe_intermediate: config.moe.intermediate_size,
                shared_intermediate: config
                    .moe
                    .shared
                    .as_ref()
                    .map_or(0, |s| s.intermediate_size),
                dense_intermediate: config.intermediate_size,
                attention,
            })
        }
        Err(rackfill_models::ModelError::UnknownArchitecture { .. }) => {
            generic_hf_shape(map, origin)
        }
        Err(e) => Err(SimError::Input(format!("shape file {e}"))),
    }
}

/// Reads the field names most MoE configs share (`glm4_moe`, `deepseek_v2`, ...): experts from
/// `n_routed_experts` / `num_experts` / `num_local_experts`, dense layers from
/// `first_k_dense_replace`, shared experts from `n_shared_experts` x `moe_intermediate_size` (or
/// `shared_expert_intermediate_size`), MLA when `kv_lora_rank` is present.
fn generic_hf_shape(map: &Map<String, Value>, origin: &str) -> Result<ModelShape, SimError> {
    let bad = |why: String| SimError::Input(format!("shape file {origin}: {why}"));
    let opt = |names: &[&str]| -> Result<Option<usize>, SimError> {
        for &name in names {
            match map.get(name) {
                None | Some(Value::Null) => continue,
                Some(v) => {
                    return v
                        .as_u64()
                        .map(|v| Some(v as usize))
                        .ok_or_else(|| bad(format!("{name} must be a non-negative integer")))
                }
            }
        }
        Ok(None)
    };
    let req = |names: &[&str]| -> Result<usize, SimError> {
        opt(names)?.ok_or_else(|| bad(format!("missing field {}", names.join(" / "))))
    };
    let hidden = req(&["hidden_size"])?;
    let q_heads = req(&["num_attention_heads"])?;
    let moe_intermediate = req(&["moe_intermediate_size"])?;
    let n_shared = opt(&["n_shared_experts", "num_shared_experts"])?.unwrap_or(0);
    let shared_intermediate = match opt(&["shared_expert_intermediate_size"])? {
        Some(width) => width,
        None => n_shared * moe_intermediate,
    };
    let attention = match opt(&["kv_lora_rank"])? {
        Some(kv_lora_rank) => Attention::Mla {
            q_heads,
            q_lora_rank: opt(&["q_lora_rank"])?,
            kv_lora_rank,
            qk_nope_head_dim: req(&["qk_nope_head_dim"])?,
            qk_rope_head_dim: req(&["qk_rope_head_dim"])?,
            v_head_dim: req(&["v_head_dim"])?,
        },
        None => Attention::Gqa {
            q_heads,
            kv_heads: opt(&["num_key_value_heads"])?.unwrap_or(q_heads),
            head_dim: match opt(&["head_dim"])? {
                Some(d) => d,
                None if q_heads > 0 => hidden / q_heads,
                None => 0,
            },
        },
    };
    Ok(ModelShape {
        name: model_name(map, origin),
        layers: req(&["num_hidden_layers"])?,
        dense_layers: opt(&["first_k_dense_replace"])?.unwrap_or(0),
        experts: req(&["n_routed_experts", "num_experts", "num_local_experts"])?,
        top_k: req(&["num_experts_per_tok"])?,
        hidden,
        moe_intermediate,
        shared_intermediate,
        dense_intermediate: opt(&["intermediate_size"])?.unwrap_or(0),
        attention,
    })
}

/// `_name_or_path`, else `model_type`, else the file name.
fn model_name(map: &Map<String, Value>, origin: &str) -> String {
    ["_name_or_path", "model_type"]
        .iter()
        .find_map(|k| map.get(*k).and_then(Value::as_str))
        .map(str::to_string)
        .unwrap_or_else(|| origin.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid_and_sized_like_the_paper() {
        for shape in [
            ModelShape::qwen3_235b(),
            ModelShape::deepseek_v3(),
            ModelShape::glm_4_7(),
        ] {
            shape.validate().unwrap();
        }
        // UltraEP §4.1: one Qwen3-235B redundant slot holds 36 MB of weights.
        let qwen = ModelShape::qwen3_235b();
        assert_eq!(qwen.moe_dims().expert_bytes(), 3 * 4096 * 1536 * 2);
        assert_eq!(qwen.moe_dims().expert_bytes() >> 20, 36);
        assert_eq!(ModelShape::deepseek_v3().moe_layers(), 58);
        assert_eq!(ModelShape::glm_4_7().moe_layers(), 89);
    }

    #[test]
    fn gqa_and_mla_flops_by_hand() {
        let qwen = ModelShape::qwen3_235b();
        // q 8192 + k 512 + v 512 + o 8192 output columns of a 4096-wide input, 2 FLOPs each.
        assert_eq!(qwen.attention_projection_flops(), 2.0 * 4096.0 * 17408.0);
        assert_eq!(qwen.attention_flops_per_pair(), 4.0 * 64.0 * 128.0);
        let ds = ModelShape::deepseek_v3();
        let want = 2.0 * 7168.0 * 1536.0
            + 2.0 * 1536.0 * 128.0 * 192.0
            + 2.0 * 7168.0 * 576.0
            + 2.0 * 512.0 * 128.0 * 256.0
            + 2.0 * 128.0 * 128.0 * 7168.0;
        assert_eq!(ds.attention_projection_flops(), want);
        assert_eq!(ds.attention_flops_per_pair(), 2.0 * 128.0 * 320.0);
    }
}
