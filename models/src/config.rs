//! `config.json` normalised into one family-independent [`ModelConfig`].
//!
//! Hugging Face configs drift between releases (`num_experts` vs `num_local_experts`,
//! `rope_theta` vs `rope_parameters.rope_theta`, `rope_scaling.type` vs `rope_type`); everything
//! downstream reads the normalised form, so the drift is handled here once.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{ModelError, Result};

/// The MoE families this build runs, one file each under `families/`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Qwen3Moe,
    Qwen2Moe,
    Mixtral,
    DeepseekV3,
}

const SUPPORTED: &str =
    "Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, MixtralForCausalLM, DeepseekV3ForCausalLM";

impl Family {
    /// `rms_norm_eps` when `config.json` omits it (transformers' config class default).
    fn default_rms_norm_eps(self) -> f64 {
        match self {
            Self::Mixtral => 1e-5,
            Self::Qwen3Moe | Self::Qwen2Moe | Self::DeepseekV3 => 1e-6,
        }
    }

    /// `rope_theta` when `config.json` gives none (transformers' config class default).
    fn default_rope_theta(self) -> f64 {
        match self {
            Self::Mixtral => 1e6,
            Self::Qwen3Moe | Self::Qwen2Moe | Self::DeepseekV3 => 10_000.0,
        }
    }

    /// `max_position_embeddings` when `config.json` omits it (transformers' default).
    fn default_max_position_embeddings(self) -> usize {
        match self {
            Self::Qwen3Moe | Self::Qwen2Moe => 32_768,
            Self::Mixtral => 131_072,
            Self::DeepseekV3 => 4096,
        }
    }

    fn from_architecture(name: &str) -> Option<Self> {
        match name {
            "Qwen3MoeForCausalLM" => Some(Self::Qwen3Moe),
            "Qwen2MoeForCausalLM" => Some(Self::Qwen2Moe),
            "MixtralForCausalLM" => Some(Self::Mixtral),
            "DeepseekV3ForCausalLM" => Some(Self::DeepseekV3),
            _ => None,
        }
    }

    fn from_model_type(name: &str) -> Option<Self> {
        match name {
            "qwen3_moe" => Some(Self::Qwen3Moe),
            "qwen2_moe" => Some(Self::Qwen2Moe),
            "mixtral" => Some(Self::Mixtral),
            "deepseek_v3" => Some(Self::DeepseekV3),
            _ => None,
        }
    }
}

/// How rotary frequencies are scaled beyond the trained context.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f64,
    },
    /// YaRN (DeepSeek-V3): blended interpolation plus an attention-scale correction.
    Yarn {
        factor: f64,
        original_max_position_embeddings: usize,
        beta_fast: f64,
        beta_slow: f64,
        mscale: f64,
        mscale_all_dim: f64,
        /// Explicit cos/sin magnitude; derived from the mscales when absent.
        attention_factor: Option<f64>,
        /// Round the blend range outwards to whole dimensions (transformers' default).
        truncate: bool,
    },
}

/// Rotary position embedding parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    pub scaling: RopeScaling,
}

/// How the router turns logits into top-k experts and weights.
#[derive(Debug, Clone, PartialEq)]
pub enum RouterKind {
    /// Softmax over all experts, top-k, optionally renormalised (Qwen, Mixtral).
    SoftmaxTopK { norm_topk_prob: bool },
    /// Sigmoid scores plus a correction bias for selection, group-limited top-k, weights from
    /// the uncorrected scores, optionally renormalised, then scaled (DeepSeek-V3).
    SigmoidGrouped {
        n_group: usize,
        topk_group: usize,
        norm_topk_prob: bool,
        routed_scaling_factor: f32,
    },
}

/// Shared (always-on) experts beside the routed ones.
#[derive(Debug, Clone, PartialEq)]
pub struct SharedExpertConfig {
    pub intermediate_size: usize,
    /// Qwen2-MoE scales the shared expert by `sigmoid(shared_expert_gate(x))`.
    pub gated: bool,
}

/// The routed-expert part of the model.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub top_k: usize,
    pub intermediate_size: usize,
    pub router: RouterKind,
    pub shared: Option<SharedExpertConfig>,
}

/// DeepSeek's multi-head latent attention dimensions.
#[derive(Debug, Clone, PartialEq)]
pub struct MlaConfig {
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// Rotary dims stored interleaved (pairs) rather than as two halves.
    pub rope_interleave: bool,
    /// The RoPE parameters' `mscale_all_dim` when the RoPE is scaled (any `rope_type` but
    /// `default`), else 0: the softmax scale is multiplied by `yarn_mscale(factor, it)^2`, as
    /// transformers does for every scaled RoPE, not only YaRN.
    pub mscale_all_dim: f64,
}

/// How a checkpoint's linear weights are quantized (`config.json`'s `quantization_config`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Quantization {
    /// Block-quantized FP8, DeepSeek-V3's and Qwen3's format (`quant_method: "fp8"`, `fmt:
    /// "e4m3"`): each quantized weight `W` is stored as float8_e4m3fn (safetensors `F8_E4M3`)
    /// beside an f32 `W_scale_inv` of shape `[ceil(out / block[0]), ceil(in / block[1])]`; a
    /// weight's value is its fp8 value times its block's scale. Norms, routers, embeddings, the
    /// LM head and `modules_to_not_convert` are stored unquantized.
    Fp8 {
        /// `weight_block_size`: rows, columns of one scale's block.
        block: [usize; 2],
        /// Modules the checkpoint keeps unquantized (informative: every tensor says its dtype).
        modules_to_not_convert: Vec<String>,
    },
}

impl Quantization {
    /// The FP8 scale blocks, `[rows, cols]`.
    pub fn fp8_block(&self) -> [usize; 2] {
        match self {
            Self::Fp8 { block, .. } => *block,
        }
    }
}

/// A checkpoint's architecture, normalised across families and transformers versions.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub family: Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    /// DeepSeek's multi-token-prediction layers (`num_nextn_predict_layers`), stored after the
    /// last decoder layer: never run here (as in transformers), so their tensors are expected
    /// to stay unused. 0 for the other families.
    pub nextn_predict_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    /// Per-head dimension of q, k and v for GQA families (MLA uses [`MlaConfig`]).
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub rope: RopeConfig,
    /// q, k, v projections carry a bias (Qwen2-MoE's `qkv_bias`, Qwen3-MoE's and
    /// DeepSeek-V3's `attention_bias`).
    pub attention_bias: bool,
    /// The attention output projection `o_proj` carries a bias too (Qwen3-MoE's
    /// `attention_bias`; Qwen2-MoE's and Mixtral's never have one).
    pub attention_out_bias: bool,
    /// Per-head RMSNorm on q and k before RoPE (Qwen3-MoE).
    pub qk_norm: bool,
    /// Dense MLP width for layers that are not sparse.
    pub intermediate_size: usize,
    pub moe: MoeConfig,
    /// `sparse_layers[i]`: layer i runs the MoE block (else a dense MLP).
    pub sparse_layers: Vec<bool>,
    pub mla: Option<MlaConfig>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// How the checkpoint's weights are quantized, if they are.
    pub quantization: Option<Quantization>,
    /// The checkpoint's own dtype (`dtype`, or `torch_dtype` of older transformers), as
    /// written (`"bfloat16"`): what a decode engine of the same model keeps its KV cache in.
    pub dtype: Option<String>,
}

impl ModelConfig {
    /// Reads and normalises `dir/config.json`.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| match source.kind() {
            std::io::ErrorKind::NotFound => ModelError::MissingFile { path: path.clone() },
            _ => ModelError::Io {
                path: path.clone(),
                source,
            },
        })?;
        Self::from_json_str(&text, &path)
    }

    /// Parses `config.json` contents; `origin` names the file in errors.
    pub fn from_json_str(text: &str, origin: &Path) -> Result<Self> {
        let value: Value = serde_json::from_str(text).map_err(|e| ModelError::Json {
            path: origin.to_path_buf(),
            message: e.to_string(),
        })?;
        let Value::Object(map) = value else {
            return Err(ModelError::Json {
                path: origin.to_path_buf(),
                message: "expected a JSON object".into(),
            });
        };
        let raw = Raw {
            map: &map,
            path: origin.to_path_buf(),
        };
        let config = raw.normalise()?;
        config.check(origin)?;
        Ok(config)
    }

    /// Number of MoE layers.
    pub fn num_sparse_layers(&self) -> usize {
        self.sparse_layers.iter().filter(|&&s| s).count()
    }

    fn check(&self, origin: &Path) -> Result<()> {
        let fail = |message: String| {
            Err(ModelError::Config {
                path: origin.to_path_buf(),
                message,
            })
        };
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            // A context of 0 would load, then refuse every request.
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (name, value) in positive {
            if value == 0 {
                return fail(format!("{name} must be positive"));
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return fail(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_heads, self.num_kv_heads
            ));
        }
        let moe = &self.moe;
        if self.sparse_layers.iter().any(|&s| s) {
            if moe.num_experts == 0 || moe.top_k == 0 || moe.top_k > moe.num_experts {
                return fail(format!(
                    "need 0 < num_experts_per_tok ({}) <= number of experts ({})",
                    moe.top_k, moe.num_experts
                ));
            }
            if moe.intermediate_size == 0 {
                return fail("moe_intermediate_size must be positive".into());
            }
        }
        if self.sparse_layers.iter().any(|&s| !s) && self.intermediate_size == 0 {
            return fail("intermediate_size must be positive for dense layers".into());
        }
        if let RouterKind::SigmoidGrouped {
            n_group,
            topk_group,
            ..
        } = moe.router
        {
            if n_group == 0 || !moe.num_experts.is_multiple_of(n_group) || topk_group > n_group {
                return fail(format!(
                    "n_group {n_group} must divide the {} experts and be >= topk_group {topk_group}",
                    moe.num_experts
                ));
            }
            let per_group = moe.num_experts / n_group;
            if topk_group * per_group < moe.top_k {
                return fail(format!(
                    "topk_group {topk_group} groups of {per_group} experts hold fewer than \
                     num_experts_per_tok {}",
                    moe.top_k
                ));
            }
        }
        if let Some(mla) = &self.mla {
            if mla.qk_rope_head_dim % 2 != 0 || mla.kv_lora_rank == 0 {
                return fail("qk_rope_head_dim must be even and kv_lora_rank positive".into());
            }
        } else if !self.head_dim.is_multiple_of(2) {
            return fail(format!("head_dim {} must be even for RoPE", self.head_dim));
        }
        Ok(())
    }
}

/// Typed access to the raw JSON object, with errors naming the file and field.
struct Raw<'a> {
    map: &'a Map<String, Value>,
    path: PathBuf,
}

impl Raw<'_> {
    fn error(&self, message: String) -> ModelError {
        ModelError::Config {
            path: self.path.clone(),
            message,
        }
    }

    /// The first present, non-null value among `names`.
    fn first<'n>(&self, names: &[&'n str]) -> Option<(&'n str, &Value)> {
        names.iter().find_map(|&name| match self.map.get(name) {
            None | Some(Value::Null) => None,
            Some(value) => Some((name, value)),
        })
    }

    fn opt_usize(&self, names: &[&str]) -> Result<Option<usize>> {
        match self.first(names) {
            None => Ok(None),
            Some((name, value)) => value
                .as_u64()
                .map(|v| Some(v as usize))
                .ok_or_else(|| self.error(format!("{name} must be a non-negative integer"))),
        }
    }

    fn usize(&self, names: &[&str]) -> Result<usize> {
        self.opt_usize(names)?
            .ok_or_else(|| self.error(format!("missing field {}", names.join(" / "))))
    }

    fn opt_f64(&self, names: &[&str]) -> Result<Option<f64>> {
        match self.first(names) {
            None => Ok(None),
            Some((name, value)) => value
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.error(format!("{name} must be a number"))),
        }
    }

    fn opt_bool(&self, names: &[&str]) -> Result<Option<bool>> {
        match self.first(names) {
            None => Ok(None),
            Some((name, value)) => value
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.error(format!("{name} must be true or false"))),
        }
    }

    /// Every MLP and expert here is SiLU-gated (`silu(gate) * up`): a config asking for another
    /// activation is refused rather than served with the wrong one.
    fn check_activation(&self) -> Result<()> {
        match self.first(&["hidden_act"]) {
            None => Ok(()),
            Some((_, Value::String(act))) if act == "silu" || act == "swish" => Ok(()),
            Some((_, Value::String(act))) => Err(self.error(format!(
                "hidden_act \"{act}\" is not supported: rackfill runs SiLU-gated MLPs only \
                 (\"silu\")"
            ))),
            Some(_) => Err(self.error("hidden_act must be a string".into())),
        }
    }

    /// Token ids given as one integer or a list of integers.
    fn token_ids(&self, name: &str) -> Result<Vec<u32>> {
        let bad = || self.error(format!("{name} must be an integer or a list of integers"));
        match self.first(&[name]) {
            None => Ok(Vec::new()),
            Some((_, Value::Array(items))) => items
                .iter()
                .map(|v| v.as_u64().map(|id| id as u32).ok_or_else(bad))
                .collect(),
            Some((_, value)) => value.as_u64().map(|id| vec![id as u32]).ok_or_else(bad),
        }
    }

    fn family(&self) -> Result<Family> {
        let architectures = match self.map.get("architectures") {
            Some(Value::Array(items)) => items.iter().filter_map(Value::as_str).collect(),
            _ => Vec::new(),
        };
        if let Some(family) = architectures
            .iter()
            .find_map(|a| Family::from_architecture(a))
        {
            return Ok(family);
        }
        let model_type = self.map.get("model_type").and_then(Value::as_str);
        if let Some(family) = model_type.and_then(Family::from_model_type) {
            return Ok(family);
        }
        let found = architectures
            .first()
            .map(|s| s.to_string())
            .or(model_type.map(str::to_string))
            .unwrap_or_else(|| "<none: no architectures or model_type field>".into());
        Err(ModelError::UnknownArchitecture {
            path: self.path.clone(),
            found,
            supported: SUPPORTED,
        })
    }

    /// A number inside the RoPE parameters object (`rope_parameters` or `rope_scaling`).
    fn rope_param_f64(&self, name: &str) -> Result<Option<f64>> {
        match self.first(&["rope_parameters", "rope_scaling"]) {
            Some((_, Value::Object(map))) => Raw {
                map,
                path: self.path.clone(),
            }
            .opt_f64(&[name]),
            _ => Ok(None),
        }
    }

    /// `rope_parameters` (newer transformers) or `rope_scaling` + `rope_theta` (classic).
    fn rope(&self, family: Family) -> Result<RopeConfig> {
        let params = self.first(&["rope_parameters", "rope_scaling"]);
        let params = match params {
            None => None,
            Some((_, Value::Object(map))) => Some(map),
            Some((name, _)) => return Err(self.error(format!("{name} must be an object"))),
        };
        let nested = params.map(|map| Raw {
            map,
            path: self.path.clone(),
        });
        let theta = match nested.as_ref().map(|n| n.opt_f64(&["rope_theta"])) {
            Some(Ok(Some(theta))) => theta,
            Some(Err(e)) => return Err(e),
            _ => self
                .opt_f64(&["rope_theta"])?
                .unwrap_or(family.default_rope_theta()),
        };
        let Some(p) = nested else {
            return Ok(RopeConfig {
                theta,
                scaling: RopeScaling::None,
            });
        };
        let kind = p
            .first(&["rope_type", "type"])
            .and_then(|(_, v)| v.as_str())
            .unwrap_or("default");
        let factor = || {
            p.opt_f64(&["factor"])?
                .ok_or_else(|| self.error(format!("rope scaling {kind:?} needs a factor")))
        };
        let scaling = match kind {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear { factor: factor()? },
            "yarn" => {
                let original = match p.opt_usize(&["original_max_position_embeddings"])? {
                    Some(v) => v,
                    None => self.usize(&["original_max_position_embeddings"])?,
                };
                let factor = match p.opt_f64(&["factor"])? {
                    Some(f) => f,
                    None => {
                        self.usize(&["max_position_embeddings"])? as f64 / original.max(1) as f64
                    }
                };
                RopeScaling::Yarn {
                    factor,
                    original_max_position_embeddings: original,
                    beta_fast: p.opt_f64(&["beta_fast"])?.unwrap_or(32.0),
                    beta_slow: p.opt_f64(&["beta_slow"])?.unwrap_or(1.0),
                    mscale: p.opt_f64(&["mscale"])?.unwrap_or(1.0),
                    mscale_all_dim: p.opt_f64(&["mscale_all_dim"])?.unwrap_or(0.0),
                    attention_factor: p.opt_f64(&["attention_factor"])?,
                    truncate: p.opt_bool(&["truncate"])?.unwrap_or(true),
                }
            }
            other => {
                return Err(self.error(format!(
                    "rope scaling type {other:?} is not supported (default, linear, yarn)"
                )))
            }
        };
        Ok(RopeConfig { theta, scaling })
    }

    fn normalise(&self) -> Result<ModelConfig> {
        let family = self.family()?;
        let hidden_size = self.usize(&["hidden_size"])?;
        let num_heads = self.usize(&["num_attention_heads"])?;
        let num_layers = self.usize(&["num_hidden_layers"])?;
        let num_kv_heads = self
            .opt_usize(&["num_key_value_heads"])?
            .unwrap_or(num_heads);
        let head_dim = match self.opt_usize(&["head_dim"])? {
            Some(d) => d,
            None if num_heads > 0 => hidden_size / num_heads,
            None => 0,
        };
        let num_experts = self.usize(&["num_experts", "num_local_experts", "n_routed_experts"])?;
        let top_k = self.usize(&["num_experts_per_tok"])?;
        let norm_topk_prob = match family {
            // transformers' Mixtral always renormalises, whatever the config says.
            Family::Mixtral => true,
            // DeepseekV3Config defaults to true, the Qwen configs to false.
            Family::DeepseekV3 => self.opt_bool(&["norm_topk_prob"])?.unwrap_or(true),
            Family::Qwen3Moe | Family::Qwen2Moe => {
                self.opt_bool(&["norm_topk_prob"])?.unwrap_or(false)
            }
        };
        let intermediate_size = self.opt_usize(&["intermediate_size"])?.unwrap_or(0);
        let moe_intermediate = match family {
            Family::Mixtral => intermediate_size,
            _ => self.usize(&["moe_intermediate_size"])?,
        };
        let rope = self.rope(family)?;
        let (router, shared, mla) = match family {
            Family::DeepseekV3 => self.deepseek_parts(norm_topk_prob, moe_intermediate, &rope)?,
            Family::Qwen2Moe => {
                let shared = self
                    .opt_usize(&["shared_expert_intermediate_size"])?
                    .filter(|&size| size > 0)
                    .map(|intermediate_size| SharedExpertConfig {
                        intermediate_size,
                        gated: true,
                    });
                (RouterKind::SoftmaxTopK { norm_topk_prob }, shared, None)
            }
            Family::Qwen3Moe | Family::Mixtral => {
                (RouterKind::SoftmaxTopK { norm_topk_prob }, None, None)
            }
        };
        let sparse_layers = self.sparse_layers(family, num_layers, num_experts)?;
        self.check_activation()?;
        if let Some(window) = self.opt_bool(&["use_sliding_window"])? {
            if window && family != Family::Mixtral {
                return Err(self.error("use_sliding_window=true is not supported".into()));
            }
        }
        let mut max_position_embeddings = self
            .opt_usize(&["max_position_embeddings"])?
            .unwrap_or(family.default_max_position_embeddings());
        if family == Family::Mixtral {
            // Within the window, sliding-window attention is plain causal attention; the
            // context is capped there rather than computed differently from transformers.
            if let Some(window) = self.opt_usize(&["sliding_window"])? {
                if window == 0 {
                    return Err(self.error("sliding_window must be positive (or null)".into()));
                }
                max_position_embeddings = max_position_embeddings.min(window);
            }
        }
        let attention_bias = self.opt_bool(&["attention_bias"])?.unwrap_or(false);
        Ok(ModelConfig {
            family,
            vocab_size: self.usize(&["vocab_size"])?,
            hidden_size,
            num_layers,
            nextn_predict_layers: match family {
                Family::DeepseekV3 => self.opt_usize(&["num_nextn_predict_layers"])?.unwrap_or(0),
                _ => 0,
            },
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: self
                .opt_f64(&["rms_norm_eps"])?
                .unwrap_or(family.default_rms_norm_eps()),
            max_position_embeddings,
            tie_word_embeddings: self.opt_bool(&["tie_word_embeddings"])?.unwrap_or(false),
            rope,
            attention_bias: match family {
                Family::Qwen2Moe => self.opt_bool(&["qkv_bias"])?.unwrap_or(true),
                // transformers' Mixtral has no attention bias, whatever the config says.
                Family::Mixtral => false,
                Family::Qwen3Moe | Family::DeepseekV3 => attention_bias,
            },
            attention_out_bias: family == Family::Qwen3Moe && attention_bias,
            qk_norm: family == Family::Qwen3Moe,
            intermediate_size,
            moe: MoeConfig {
                num_experts,
                top_k,
                intermediate_size: moe_intermediate,
                router,
                shared,
            },
            sparse_layers,
            mla,
            bos_token_id: self.token_ids("bos_token_id")?.first().copied(),
            eos_token_ids: self.token_ids("eos_token_id")?,
            quantization: self.quantization()?,
            dtype: self
                .first(&["dtype", "torch_dtype"])
                .and_then(|(_, v)| v.as_str())
                .map(str::to_owned),
        })
    }

    /// `quantization_config`: block-quantized FP8 (e4m3, two block sizes) or nothing; any other
    /// method, format or block shape is refused naming the field.
    fn quantization(&self) -> Result<Option<Quantization>> {
        let map = match self.first(&["quantization_config"]) {
            None => return Ok(None),
            Some((_, Value::Object(map))) => map,
            Some(_) => return Err(self.error("quantization_config must be an object".into())),
        };
        let q = Raw {
            map,
            path: self.path.clone(),
        };
        match q.first(&["quant_method"]) {
            Some((_, Value::String(method))) if method == "fp8" => {}
            Some((_, Value::String(method))) => {
                return Err(self.error(format!(
                    "quantization_config.quant_method \"{method}\" is not supported (only \"fp8\")"
                )))
            }
            Some(_) => {
                return Err(self.error("quantization_config.quant_method must be a string".into()))
            }
            None => return Err(self.error("missing field quantization_config.quant_method".into())),
        }
        match q.first(&["fmt"]) {
            // Qwen3's FP8 configs leave it out: e4m3 is the only block FP8 format in use.
            None => {}
            Some((_, Value::String(fmt))) if fmt == "e4m3" => {}
            Some((_, fmt)) => {
                return Err(self.error(format!(
                    "quantization_config.fmt {fmt} is not supported (only \"e4m3\")"
                )))
            }
        }
        let bad_block = || {
            self.error(
                "quantization_config.weight_block_size must be two positive integers \
                 (e.g. [128, 128]; per-tensor FP8 scales are not supported)"
                    .into(),
            )
        };
        let block = match q.first(&["weight_block_size"]) {
            Some((_, Value::Array(items))) if items.len() == 2 => {
                let size = |v: &Value| {
                    v.as_u64()
                        .filter(|&n| n > 0 && n <= u32::MAX as u64)
                        .map(|n| n as usize)
                        .ok_or_else(bad_block)
                };
                [size(&items[0])?, size(&items[1])?]
            }
            _ => return Err(bad_block()),
        };
        let modules_to_not_convert = match q.first(&["modules_to_not_convert"]) {
            None => Vec::new(),
            Some((_, Value::Array(items))) => items
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .ok_or_else(|| {
                    self.error(
                        "quantization_config.modules_to_not_convert must list strings".into(),
                    )
                })?,
            Some(_) => {
                return Err(
                    self.error("quantization_config.modules_to_not_convert must be a list".into())
                )
            }
        };
        Ok(Some(Quantization::Fp8 {
            block,
            modules_to_not_convert,
        }))
    }

    /// A string field that, when present, must be `expected`: DeepSeek's original code switches
    /// behaviour on it while transformers' DeepseekV3 only implements `expected`, so anything else
    /// is refused rather than computed the other way.
    fn require_str(&self, name: &str, expected: &str) -> Result<()> {
        match self.first(&[name]) {
            None => Ok(()),
            Some((_, Value::String(value))) if value == expected => Ok(()),
            Some((_, value)) => Err(self.error(format!(
                "{name} {value} is not supported: only \"{expected}\" (what transformers' \
                 DeepseekV3 computes)"
            ))),
        }
    }

    /// Router, shared experts and latent-attention dimensions of DeepSeek-V3. Absent fields take
    /// `DeepseekV3Config`'s defaults (an absent `q_lora_rank` is 1536; `null` means no q LoRA).
    fn deepseek_parts(
        &self,
        norm_topk_prob: bool,
        moe_intermediate: usize,
        rope: &RopeConfig,
    ) -> Result<(RouterKind, Option<SharedExpertConfig>, Option<MlaConfig>)> {
        self.require_str("scoring_func", "sigmoid")?;
        self.require_str("topk_method", "noaux_tc")?;
        if let Some(freq) = self.opt_usize(&["moe_layer_freq"])? {
            if freq != 1 {
                return Err(self.error(format!(
                    "moe_layer_freq {freq} is not supported: DeepSeek-V3 layers from \
                     first_k_dense_replace on are all MoE (moe_layer_freq 1)"
                )));
            }
        }
        let router = RouterKind::SigmoidGrouped {
            n_group: self.opt_usize(&["n_group"])?.unwrap_or(8),
            topk_group: self.opt_usize(&["topk_group"])?.unwrap_or(4),
            norm_topk_prob,
            routed_scaling_factor: self.opt_f64(&["routed_scaling_factor"])?.unwrap_or(2.5) as f32,
        };
        let n_shared = self.opt_usize(&["n_shared_experts"])?.unwrap_or(1);
        let shared = (n_shared > 0).then(|| SharedExpertConfig {
            intermediate_size: moe_intermediate * n_shared,
            gated: false,
        });
        let q_lora_rank = match self.map.get("q_lora_rank") {
            None => Some(1536),
            Some(_) => self.opt_usize(&["q_lora_rank"])?,
        };
        let mscale_all_dim = match &rope.scaling {
            RopeScaling::None => 0.0,
            RopeScaling::Yarn { mscale_all_dim, .. } => *mscale_all_dim,
            RopeScaling::Linear { .. } => self.rope_param_f64("mscale_all_dim")?.unwrap_or(0.0),
        };
        let mla = MlaConfig {
            q_lora_rank,
            kv_lora_rank: self.usize(&["kv_lora_rank"])?,
            qk_nope_head_dim: self.usize(&["qk_nope_head_dim"])?,
            qk_rope_head_dim: self.usize(&["qk_rope_head_dim"])?,
            v_head_dim: self.usize(&["v_head_dim"])?,
            rope_interleave: self.opt_bool(&["rope_interleave"])?.unwrap_or(true),
            mscale_all_dim,
        };
        Ok((router, shared, Some(mla)))
    }

    /// Which layers are MoE: Qwen's `mlp_only_layers` + `decoder_sparse_step`, DeepSeek's
    /// `first_k_dense_replace` (its `moe_layer_freq` must be 1, checked with the router), Mixtral
    /// all.
    fn sparse_layers(&self, family: Family, layers: usize, experts: usize) -> Result<Vec<bool>> {
        match family {
            Family::Mixtral => Ok(vec![true; layers]),
            Family::Qwen3Moe | Family::Qwen2Moe => {
                let step = self.opt_usize(&["decoder_sparse_step"])?.unwrap_or(1);
                let dense: Vec<usize> = match self.first(&["mlp_only_layers"]) {
                    None => Vec::new(),
                    Some((_, Value::Array(items))) => items
                        .iter()
                        .map(|v| v.as_u64().map(|i| i as usize))
                        .collect::<Option<_>>()
                        .ok_or_else(|| self.error("mlp_only_layers must list integers".into()))?,
                    Some(_) => return Err(self.error("mlp_only_layers must be a list".into())),
                };
                Ok((0..layers)
                    .map(|i| !dense.contains(&i) && experts > 0 && step > 0 && (i + 1) % step == 0)
                    .collect())
            }
            Family::DeepseekV3 => {
                let first_dense = self.opt_usize(&["first_k_dense_replace"])?.unwrap_or(3);
                Ok((0..layers)
                    .map(|i| experts > 0 && i >= first_dense)
                    .collect())
            }
        }
    }
}
