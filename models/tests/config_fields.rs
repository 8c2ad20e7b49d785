//! `config.json` as the hub has it over the years: classic and newer transformers field names
//! must normalise to the same [`ModelConfig`], and layer layouts must follow each family's rules.

use std::path::Path;

use rackfill_models::config::{RopeScaling, RouterKind};
use rackfill_models::{ModelConfig, ModelError};
use serde_json::{json, Value};

fn parse(value: &Value) -> Result<ModelConfig, ModelError> {
    ModelConfig::from_json_str(&value.to_string(), Path::new("config.json"))
}

fn qwen3(extra: Value) -> Value {
    let mut base = json!({
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 100, "hidden_size": 16, "num_hidden_layers": 4,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "moe_intermediate_size": 8, "intermediate_size": 32, "num_experts_per_tok": 2,
    });
    base.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    base
}

#[test]
fn classic_and_new_field_names_normalise_alike() {
    let classic = parse(&qwen3(json!({"num_experts": 8, "rope_theta": 1e6}))).unwrap();
    let newer = parse(&qwen3(json!({
        "num_local_experts": 8,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    })))
    .unwrap();
    assert_eq!(classic, newer);
    assert_eq!(classic.moe.num_experts, 8);
    assert_eq!(classic.rope.theta, 1e6);
    assert_eq!(classic.rope.scaling, RopeScaling::None);
}

#[test]
fn rope_scaling_type_and_rope_type_are_both_read() {
    let old = parse(&qwen3(json!({
        "num_experts": 8, "rope_scaling": {"type": "linear", "factor": 2.0},
    })))
    .unwrap();
    let new = parse(&qwen3(json!({
        "num_experts": 8, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    })))
    .unwrap();
    assert_eq!(old.rope, new.rope);
    assert_eq!(old.rope.scaling, RopeScaling::Linear { factor: 2.0 });
    let unsupported = parse(&qwen3(json!({
        "num_experts": 8, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
    })))
    .unwrap_err();
    assert!(unsupported.to_string().contains("dynamic"), "{unsupported}");
}

#[test]
fn qwen_dense_layers_follow_mlp_only_layers_and_sparse_step() {
    let config = parse(&qwen3(json!({
        "num_experts": 8, "decoder_sparse_step": 2, "mlp_only_layers": [3],
    })))
    .unwrap();
    assert_eq!(config.sparse_layers, vec![false, true, false, false]);
    let norm_default = parse(&qwen3(json!({"num_experts": 8}))).unwrap();
    assert_eq!(
        norm_default.moe.router,
        RouterKind::SoftmaxTopK {
            norm_topk_prob: false
        }
    );
}

#[test]
fn deepseek_first_layers_are_dense() {
    let config = parse(&json!({
        "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": 100, "hidden_size": 16, "num_hidden_layers": 3,
        "num_attention_heads": 2, "num_key_value_heads": 2,
        "moe_intermediate_size": 8, "intermediate_size": 32,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": true,
        "q_lora_rank": null, "kv_lora_rank": 8, "qk_nope_head_dim": 4,
        "qk_rope_head_dim": 4, "v_head_dim": 4,
    }))
    .unwrap();
    assert_eq!(config.sparse_layers, vec![false, true, true]);
    assert_eq!(config.moe.num_experts, 8);
    assert_eq!(config.moe.shared.as_ref().unwrap().intermediate_size, 8);
    let mla = config.mla.as_ref().unwrap();
    assert_eq!(mla.q_lora_rank, None);
    assert_eq!(
        config.moe.router,
        RouterKind::SigmoidGrouped {
            n_group: 2,
            topk_group: 1,
            norm_topk_prob: true,
            routed_scaling_factor: 2.5
        }
    );
}

#[test]
fn mixtral_sliding_window_caps_the_context() {
    let mixtral = |window: Value| {
        parse(&json!({
            "architectures": ["MixtralForCausalLM"],
            "vocab_size": 100, "hidden_size": 16, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 8,
            "num_local_experts": 4, "num_experts_per_tok": 2,
            "max_position_embeddings": 32768, "sliding_window": window,
        }))
        .unwrap()
    };
    assert_eq!(mixtral(Value::Null).max_position_embeddings, 32768);
    assert_eq!(mixtral(json!(4096)).max_position_embeddings, 4096);
    assert_eq!(mixtral(Value::Null).moe.intermediate_size, 8);
}

#[test]
fn wrong_types_name_the_field() {
    let err = parse(&qwen3(json!({"num_experts": "eight"}))).unwrap_err();
    assert!(err.to_string().contains("num_experts"), "{err}");
    let err = parse(&qwen3(json!({"num_experts": 8, "mlp_only_layers": "none"}))).unwrap_err();
    assert!(err.to_string().contains("mlp_only_layers"), "{err}");
}

#[test]
fn only_silu_gated_mlps_are_accepted() {
    for act in ["silu", "swish"] {
        parse(&qwen3(json!({"num_experts": 8, "hidden_act": act}))).unwrap();
    }
    for act in ["gelu", "relu", "gelu_pytorch_tanh"] {
        let err = parse(&qwen3(json!({"num_experts": 8, "hidden_act": act}))).unwrap_err();
        let message = err.to_string();
        assert!(
            message.contains("hidden_act") && message.contains(act),
            "{message}"
        );
    }
    let err = parse(&qwen3(json!({"num_experts": 8, "hidden_act": 3}))).unwrap_err();
    assert!(err.to_string().contains("hidden_act"), "{err}");
}

#[test]
fn output_projection_bias_follows_the_family() {
    // Qwen3-MoE's attention_bias covers o_proj too; Qwen2-MoE's qkv_bias does not, and
    // transformers' Mixtral has no attention bias at all.
    let config = parse(&qwen3(json!({"num_experts": 8, "attention_bias": true}))).unwrap();
    assert!(config.attention_bias && config.attention_out_bias);
    let config = parse(&qwen3(json!({"num_experts": 8}))).unwrap();
    assert!(!config.attention_bias && !config.attention_out_bias);
}

fn mixtral(extra: Value) -> Value {
    let mut base = json!({
        "architectures": ["MixtralForCausalLM"],
        "vocab_size": 100, "hidden_size": 16, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 8,
        "num_local_experts": 4, "num_experts_per_tok": 2,
    });
    base.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    base
}

fn deepseek(extra: Value) -> Value {
    let mut base = json!({
        "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": 100, "hidden_size": 16, "num_hidden_layers": 4,
        "num_attention_heads": 2, "moe_intermediate_size": 8, "intermediate_size": 32,
        "n_routed_experts": 16, "num_experts_per_tok": 2, "kv_lora_rank": 8,
        "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4,
    });
    base.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    base
}

#[test]
fn absent_fields_take_the_family_defaults_of_transformers() {
    // MixtralConfig defaults: rms_norm_eps 1e-5, rope_theta 1e6.
    let config = parse(&mixtral(json!({}))).unwrap();
    assert_eq!(config.rms_norm_eps, 1e-5);
    assert_eq!(config.rope.theta, 1e6);
    let config = parse(&qwen3(json!({"num_experts": 8}))).unwrap();
    assert_eq!(config.rms_norm_eps, 1e-6);
    assert_eq!(config.rope.theta, 10_000.0);
    // DeepseekV3Config defaults: 8 groups, 4 kept, renormalised, scaled by 2.5, one shared
    // expert, three dense layers, q LoRA rank 1536 (an explicit null means no q LoRA).
    let config = parse(&deepseek(json!({}))).unwrap();
    assert_eq!(
        config.moe.router,
        RouterKind::SigmoidGrouped {
            n_group: 8,
            topk_group: 4,
            norm_topk_prob: true,
            routed_scaling_factor: 2.5
        }
    );
    assert_eq!(config.moe.shared.as_ref().unwrap().intermediate_size, 8);
    assert_eq!(config.sparse_layers, vec![false, false, false, true]);
    assert_eq!(config.mla.as_ref().unwrap().q_lora_rank, Some(1536));
    let config = parse(&deepseek(json!({"q_lora_rank": null}))).unwrap();
    assert_eq!(config.mla.as_ref().unwrap().q_lora_rank, None);
}

#[test]
fn mixtral_always_renormalises_its_top_k() {
    // transformers' Mixtral router ignores a stray norm_topk_prob.
    let config = parse(&mixtral(json!({"norm_topk_prob": false}))).unwrap();
    assert_eq!(
        config.moe.router,
        RouterKind::SoftmaxTopK {
            norm_topk_prob: true
        }
    );
}

#[test]
fn deepseek_softmax_mscale_is_read_for_every_scaled_rope() {
    let linear = parse(&deepseek(json!({
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "mscale_all_dim": 1.0},
    })))
    .unwrap();
    assert_eq!(linear.mla.as_ref().unwrap().mscale_all_dim, 1.0);
    let unscaled = parse(&deepseek(json!({
        "rope_parameters": {"rope_type": "default", "mscale_all_dim": 1.0},
    })))
    .unwrap();
    assert_eq!(unscaled.mla.as_ref().unwrap().mscale_all_dim, 0.0);
}

#[test]
fn deepseek_routing_variants_transformers_lacks_are_refused() {
    for (field, value) in [
        ("scoring_func", json!("softmax")),
        ("topk_method", json!("greedy")),
        ("topk_method", json!("group_limited_greedy")),
        ("moe_layer_freq", json!(2)),
    ] {
        let err = parse(&deepseek(json!({ field: value }))).unwrap_err();
        let message = err.to_string();
        assert!(message.contains(field), "{message}");
        assert!(!message.contains('\n'), "{message}");
    }
    parse(&deepseek(json!({
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
    })))
    .unwrap();
}

#[test]
fn a_zero_context_is_refused_naming_the_field() {
    // It would load, then refuse every request as too long.
    let err = parse(&qwen3(
        json!({"num_experts": 8, "max_position_embeddings": 0}),
    ))
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("max_position_embeddings must be positive"),
        "{err}"
    );
    assert!(!err.contains('\n'), "{err}");
    // Mixtral's window caps the context: a window of 0 is named as such.
    let err = parse(&mixtral(json!({"sliding_window": 0})))
        .unwrap_err()
        .to_string();
    assert!(err.contains("sliding_window must be positive"), "{err}");
}

#[test]
fn deepseek_multi_token_prediction_layers_are_read() {
    let config = parse(&deepseek(json!({"num_nextn_predict_layers": 1}))).unwrap();
    assert_eq!(config.nextn_predict_layers, 1);
    assert_eq!(parse(&deepseek(json!({}))).unwrap().nextn_predict_layers, 0);
    let qwen = parse(&qwen3(
        json!({"num_experts": 8, "num_nextn_predict_layers": 1}),
    ))
    .unwrap();
    assert_eq!(qwen.nextn_predict_layers, 0);
}
