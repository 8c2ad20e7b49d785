//! The built-in model (what `rackfill serve` runs with no `--model`): it loads from the bytes
//! compiled into the binary, matches transformers' logits, chats in ChatML, and its routers are
//! skewed enough that EP 8 has something to balance.

use std::path::Path;

use rackfill_models::{
    ChatMessage, FeedForward, LogitsFor, ModelBundle, ModelOrigin, SeqChunk, SequenceInput,
    BUILTIN_MODEL_NAME,
};
use safetensors::SafeTensors;
use serde_json::Value;

const TOLERANCE: f32 = 1e-4;
const EP: usize = 8;
const MIN_IMBALANCE: f64 = 1.5;

fn manifest(path: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

#[test]
fn builtin_loads_with_its_tokenizer_template_and_stop_tokens() {
    let bundle = ModelBundle::load(None).unwrap();
    assert_eq!(bundle.name, BUILTIN_MODEL_NAME);
    assert_eq!(bundle.origin, ModelOrigin::Builtin);
    let im_end = bundle.tokenizer.token_id("<|im_end|>").unwrap();
    assert!(bundle.stop_token_ids.contains(&im_end));
    let template = bundle.chat_template.as_ref().expect("ChatML template");
    let prompt = template
        .render(
            &[ChatMessage {
                role: "user".into(),
                content: "Hi".into(),
            }],
            true,
        )
        .unwrap();
    assert_eq!(
        prompt,
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = bundle.tokenizer.encode(&prompt, false).unwrap();
    assert_eq!(ids[0], bundle.tokenizer.token_id("<|im_start|>").unwrap());
    assert_eq!(bundle.tokenizer.decode(&ids, false).unwrap(), prompt);
}

#[test]
fn builtin_matches_transformers_logits() {
    let bundle = ModelBundle::builtin().unwrap();
    let bytes = std::fs::read(manifest("tests/fixtures/builtin_reference.safetensors")).unwrap();
    let refs = SafeTensors::deserialize(&bytes).unwrap();
    let mut checked = 0;
    for i in 0.. {
        let Ok(ids) = refs.tensor(&format!("input_ids_{i}")) else {
            break;
        };
        let ids: Vec<u32> = ids
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
            .collect();
        let want: Vec<f32> = refs
            .tensor(&format!("logits_{i}"))
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let mut cache = bundle.model.new_cache();
        let got = bundle
            .model
            .forward(
                &mut [SequenceInput {
                    tokens: &ids,
                    cache: &mut cache,
                }],
                LogitsFor::AllPositions,
            )
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(got.len(), want.len());
        let diff = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(diff <= TOLERANCE, "prompt {i}: max abs diff {diff}");
        checked += 1;
    }
    assert!(checked >= 2, "reference file holds {checked} prompts");
}

/// Per-layer expert token counts over the given prompts (each its own forward), read from the
/// routers the way the engine reads them.
fn expert_counts(bundle: &ModelBundle, prompts: &[Vec<u32>]) -> Vec<Vec<u64>> {
    let model = &bundle.model;
    let num_experts = model.config().moe.num_experts;
    let mut counts = vec![vec![0u64; num_experts]; model.layers().len()];
    for ids in prompts {
        let mut cache = model.new_cache();
        let mut x = model.embed(ids).unwrap();
        for (l, layer) in model.layers().iter().enumerate() {
            let mut chunks = [SeqChunk {
                len: ids.len(),
                cache: &mut cache.layers[l],
            }];
            let h = layer.attention_residual(&x, &mut chunks).unwrap();
            let input = layer.ffn_input(&h).unwrap();
            let FeedForward::Moe(block) = layer.ffn() else {
                panic!("the built-in model is sparse in every layer");
            };
            let routing = block.router.route(&input).unwrap();
            for (c, n) in counts[l].iter_mut().zip(routing.expert_counts(num_experts)) {
                *c += n;
            }
            let out = layer.ffn().forward(&input).unwrap();
            x = (h + out).unwrap();
        }
    }
    counts
}

/// Max over ranks of the rank's load divided by the mean, experts placed contiguously.
fn imbalance(counts: &[u64], ep: usize) -> f64 {
    let per_rank = counts.len() / ep;
    let loads: Vec<u64> = counts.chunks(per_rank).map(|c| c.iter().sum()).collect();
    let mean = loads.iter().sum::<u64>() as f64 / ep as f64;
    *loads.iter().max().unwrap() as f64 / mean
}

#[test]
fn builtin_routers_are_skewed_at_ep8() {
    let bundle = ModelBundle::builtin().unwrap();
    let skew: Value =
        serde_json::from_str(&std::fs::read_to_string(manifest("builtin/skew.json")).unwrap())
            .unwrap();
    let prompts: Vec<Vec<u32>> = skew["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| bundle.tokenizer.encode(p.as_str().unwrap(), false).unwrap())
        .collect();
    let counts = expert_counts(&bundle, &prompts);
    let recorded = skew["imbalance_per_layer"].as_array().unwrap();
    assert_eq!(counts.len(), recorded.len());
    for (l, layer_counts) in counts.iter().enumerate() {
        let got = imbalance(layer_counts, EP);
        let want = recorded[l].as_f64().unwrap();
        assert!(
            got >= MIN_IMBALANCE,
            "layer {l}: imbalance {got:.3} at EP {EP}"
        );
        // Same routing as transformers up to a near-tie or two.
        assert!(
            (got - want).abs() < 0.02,
            "layer {l}: imbalance {got:.4}, transformers measured {want:.4}"
        );
    }
}
