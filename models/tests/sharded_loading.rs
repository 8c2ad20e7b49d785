//! Sharded loading: a process serving some EP ranks loads only their routed experts. A model
//! loaded with an [`ExpertSelection`] holds exactly the selected experts in every MoE layer,
//! bitwise the full model's, and every other weight (embeddings, attention, norms, routers,
//! shared experts, dense layers, LM head) in full; the other experts' bytes are never read; the
//! unused-tensor accounting does not count them; and the dense path, which needs every expert,
//! refuses such a model with an error naming the missing expert and the loaded set.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Module, Tensor};
use rackfill_models::layers::attention::SeqChunk;
use rackfill_models::layers::moe::MoeBlock;
use rackfill_models::{
    Checkpoint, ExpertSelection, FeedForward, LogitsFor, ModelBundle, ModelConfig, ModelError,
    MoeModel, SequenceInput,
};
use safetensors::{Dtype, SafeTensors};

fn models_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn fixture(name: &str) -> PathBuf {
    models_dir().join("tests/fixtures").join(name)
}

/// Deterministic activations `[rows, hidden]` of moderate size.
fn activations(rows: usize, hidden: usize) -> Tensor {
    let values: Vec<f32> = (0..rows * hidden)
        .map(|i| ((i * 37 % 101) as f32 / 50.0 - 1.0) * 0.7)
        .collect();
    Tensor::from_vec(values, (rows, hidden), &Device::Cpu).unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

fn moe_block(model: &MoeModel, layer: usize) -> Option<&MoeBlock> {
    match model.layers()[layer].ffn() {
        FeedForward::Moe(block) => Some(block),
        FeedForward::Dense(_) => None,
    }
}

/// `sharded` holds exactly `selection`'s routed experts, bitwise `full`'s, and computes every
/// other part of every layer exactly as `full` does.
fn assert_same_but_experts(full: &MoeModel, sharded: &MoeModel, selection: &ExpertSelection) {
    let config = full.config();
    assert_eq!(sharded.expert_selection(), selection);
    let x = activations(7, config.hidden_size);
    let tokens: Vec<u32> = (0..9)
        .map(|t| (t * 31 % config.vocab_size) as u32)
        .collect();
    assert_eq!(
        bits(&full.embed(&tokens).unwrap()),
        bits(&sharded.embed(&tokens).unwrap())
    );
    assert_eq!(
        bits(&full.logits(&x).unwrap()),
        bits(&sharded.logits(&x).unwrap())
    );
    let (mut full_cache, mut sharded_cache) = (full.new_cache(), sharded.new_cache());
    let mut moe_layers = 0;
    for (index, (a, b)) in full.layers().iter().zip(sharded.layers()).enumerate() {
        let attention = |layer: &rackfill_models::DecoderLayer,
                         cache: &mut rackfill_models::LayerCache| {
            let mut chunks = [SeqChunk { len: 7, cache }];
            layer.attention_residual(&x, &mut chunks).unwrap()
        };
        assert_eq!(
            bits(&attention(a, &mut full_cache.layers[index])),
            bits(&attention(b, &mut sharded_cache.layers[index])),
            "layer {index}: attention"
        );
        assert_eq!(
            bits(&a.ffn_input(&x).unwrap()),
            bits(&b.ffn_input(&x).unwrap()),
            "layer {index}: post-attention norm"
        );
        match (a.ffn(), b.ffn()) {
            (FeedForward::Dense(a), FeedForward::Dense(b)) => assert_eq!(
                bits(&a.forward(&x).unwrap()),
                bits(&b.forward(&x).unwrap()),
                "layer {index}: dense MLP"
            ),
            (FeedForward::Moe(a), FeedForward::Moe(b)) => {
                moe_layers += 1;
                assert_eq!(a.router.route(&x).unwrap(), b.router.route(&x).unwrap());
                let zeros = x.zeros_like().unwrap();
                assert_eq!(
                    bits(&a.add_shared(&x, zeros.clone()).unwrap()),
                    bits(&b.add_shared(&x, zeros).unwrap()),
                    "layer {index}: shared experts"
                );
                assert_eq!(b.experts.num_experts(), config.moe.num_experts);
                assert_eq!(b.experts.selection(), selection);
                for e in 0..config.moe.num_experts as u32 {
                    assert_eq!(b.experts.is_loaded(e), selection.contains(e), "expert {e}");
                    if let Ok(mine) = b.experts.get(e) {
                        let theirs = a.experts.get(e).unwrap();
                        assert!(
                            mine.weights() == theirs.weights(),
                            "layer {index}: expert {e}'s weights"
                        );
                    }
                }
            }
            _ => panic!("layer {index}: dense in one model, MoE in the other"),
        }
    }
    assert!(moe_layers > 0);
}

/// Loads `dir` with `selection`; returns the model and how many tensors were left unused.
fn load_counting_unused(dir: &Path, selection: &ExpertSelection) -> (MoeModel, usize) {
    let checkpoint = Checkpoint::open(dir).unwrap();
    let config = ModelConfig::load(dir).unwrap();
    let model = MoeModel::from_checkpoint_with(config, &checkpoint, selection).unwrap();
    (model, checkpoint.unused_tensors().len())
}

#[test]
fn builtin_shard_holds_exactly_its_experts_and_every_other_weight() {
    let full = ModelBundle::builtin().unwrap();
    let config = ModelBundle::config(None).unwrap();
    assert_eq!(config.moe.num_experts, full.model.config().moe.num_experts);
    assert_eq!(config.num_layers, full.model.config().num_layers);
    // EP 4 over 32 experts: rank 1 homes experts 8-15.
    let selection = ExpertSelection::only(8..16);
    let sharded = ModelBundle::builtin_with(&selection).unwrap();
    assert_same_but_experts(&full.model, &sharded.model, &selection);
    assert_eq!(full.model.expert_selection(), &ExpertSelection::All);
    // The bundle around the model is the same.
    assert_eq!(sharded.name, full.name);
    assert_eq!(sharded.stop_token_ids, full.stop_token_ids);
    let (_, unused) = load_counting_unused(&models_dir().join("builtin"), &selection);
    assert_eq!(unused, 0, "skipped experts are not unused");
}

#[test]
fn conformance_checkpoint_shards_hold_exactly_their_experts() {
    // Shared experts (gated and not), dense first layers, MLA, a sharded safetensors index.
    for (family, selection) in [
        ("qwen2_moe", ExpertSelection::only([2, 3, 4])),
        ("deepseek_v3", ExpertSelection::only(12..16)),
        ("mixtral", ExpertSelection::only([1])),
        ("qwen3_moe", ExpertSelection::only([])),
    ] {
        let dir = fixture(family);
        let full = MoeModel::load(&dir).unwrap();
        let (sharded, unused) = load_counting_unused(&dir, &selection);
        assert_eq!(unused, 0, "{family}: skipped experts are not unused");
        assert_same_but_experts(&full, &sharded, &selection);
        let via_dir = MoeModel::load_with(&dir, &selection).unwrap();
        assert_eq!(via_dir.expert_selection(), &selection);
        let config = ModelBundle::config(dir.to_str()).unwrap();
        assert_eq!(config.moe.num_experts, full.config().moe.num_experts);
    }
}

/// Every tensor of a checkpoint, as `(dtype, shape, bytes)` by name.
type Tensors = BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

fn read_tensors(path: &Path) -> Tensors {
    let bytes = std::fs::read(path).unwrap();
    let parsed = SafeTensors::deserialize(&bytes).unwrap();
    parsed
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let value = (view.dtype(), view.shape().to_vec(), view.data().to_vec());
            (name, value)
        })
        .collect()
}

fn serialize(tensors: &Tensors) -> Vec<u8> {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(name, (dtype, shape, bytes))| {
            let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes).unwrap();
            (name.clone(), view)
        })
        .collect();
    safetensors::serialize(views, None).unwrap()
}

/// The built-in model's routed experts not in `keep` rewritten as I32 (same shapes), a dtype the
/// loader refuses to convert: a load that reads any of their bytes fails.
fn builtin_with_unreadable_experts(keep: &ExpertSelection) -> Checkpoint {
    let mut tensors = read_tensors(&models_dir().join("builtin/model.safetensors"));
    let mut poisoned = 0;
    for (name, (dtype, shape, bytes)) in tensors.iter_mut() {
        let expert = name
            .split_once(".mlp.experts.")
            .and_then(|(_, rest)| rest.split('.').next()?.parse::<u32>().ok());
        if expert.is_some_and(|e| !keep.contains(e)) {
            *dtype = Dtype::I32;
            *bytes = vec![0; shape.iter().product::<usize>() * 4];
            poisoned += 1;
        }
    }
    assert!(poisoned > 0);
    Checkpoint::from_bytes("<poisoned builtin>", serialize(&tensors)).unwrap()
}

#[test]
fn other_experts_bytes_are_never_read() {
    let config = ModelConfig::load(&models_dir().join("builtin")).unwrap();
    let keep = ExpertSelection::only(24..32);
    let checkpoint = builtin_with_unreadable_experts(&keep);
    let sharded = MoeModel::from_checkpoint_with(config.clone(), &checkpoint, &keep).unwrap();
    assert_eq!(sharded.expert_selection(), &keep);
    assert_eq!(checkpoint.unused_tensors(), Vec::<&str>::new());
    // The full load does read them, and says which tensor it could not convert.
    let err = MoeModel::from_checkpoint(config, &checkpoint)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("mlp.experts.0.") && err.contains("dtype"),
        "{err}"
    );
}

#[test]
fn fused_expert_tensors_are_read_one_expert_at_a_time() {
    // The qwen3_moe fixture rewritten in the fused layout: `experts.gate_up_proj` [E, 2I, H]
    // (gate rows then up rows) and `experts.down_proj` [E, H, I].
    let dir = fixture("qwen3_moe");
    let config = ModelConfig::load(&dir).unwrap();
    let (e, i, h) = (
        config.moe.num_experts,
        config.moe.intermediate_size,
        config.hidden_size,
    );
    let mut tensors = read_tensors(&dir.join("model.safetensors"));
    for layer in 0..config.num_layers {
        let prefix = format!("model.layers.{layer}.mlp.experts");
        if !tensors.contains_key(&format!("{prefix}.0.gate_proj.weight")) {
            continue;
        }
        let mut take = |expert: usize, part: &str| {
            let (dtype, _, bytes) = tensors
                .remove(&format!("{prefix}.{expert}.{part}.weight"))
                .unwrap();
            (dtype, bytes)
        };
        let (mut gate_up, mut down, mut dtype) = (Vec::new(), Vec::new(), Dtype::F32);
        for expert in 0..e {
            let (d, gate) = take(expert, "gate_proj");
            gate_up.extend(gate);
            gate_up.extend(take(expert, "up_proj").1);
            down.extend(take(expert, "down_proj").1);
            dtype = d;
        }
        tensors.insert(
            format!("{prefix}.gate_up_proj"),
            (dtype, vec![e, 2 * i, h], gate_up),
        );
        tensors.insert(format!("{prefix}.down_proj"), (dtype, vec![e, h, i], down));
    }
    let fused = Checkpoint::from_bytes("<fused qwen3_moe>", serialize(&tensors)).unwrap();
    let full = MoeModel::load(&dir).unwrap();
    for selection in [ExpertSelection::All, ExpertSelection::only([0, 5, 7])] {
        let model = MoeModel::from_checkpoint_with(config.clone(), &fused, &selection).unwrap();
        let reference = MoeModel::load_with(&dir, &selection).unwrap();
        assert_same_but_experts(&full, &model, &selection);
        assert_same_but_experts(&full, &reference, &selection);
    }
    assert_eq!(fused.unused_tensors(), Vec::<&str>::new());
}

#[test]
fn the_dense_path_refuses_a_sharded_model_naming_the_missing_expert() {
    let selection = ExpertSelection::only(0..8);
    let sharded = ModelBundle::builtin_with(&selection).unwrap().model;
    let tokens = [1u32, 2, 3];
    let mut cache = sharded.new_cache();
    let mut batch = [SequenceInput {
        tokens: &tokens,
        cache: &mut cache,
    }];
    let err = sharded
        .forward(&mut batch, LogitsFor::AllPositions)
        .err()
        .unwrap();
    assert!(matches!(err, ModelError::ExpertNotLoaded { .. }), "{err}");
    let message = err.to_string();
    assert!(
        message.contains("model.layers.0.mlp.experts.8") && message.contains("experts 0-7 of 32"),
        "{message}"
    );
    // The block alone refuses too, whatever the routing.
    let block = moe_block(&sharded, 1).unwrap();
    let x = activations(4, sharded.config().hidden_size);
    let err = block.forward(&x).err().unwrap().to_string();
    assert!(
        err.contains("model.layers.1.mlp.experts.8") && err.contains("experts 0-7"),
        "{err}"
    );
    assert!(block.experts.get(3).is_ok());
    assert!(block.experts.get(99).is_err());
}

#[test]
fn a_selection_naming_experts_the_model_lacks_is_refused() {
    let err = ModelBundle::builtin_with(&ExpertSelection::only([31, 32]))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("expert 32") && err.contains("32 routed experts"),
        "{err}"
    );
    let err = ModelBundle::builtin_with(&ExpertSelection::Only(vec![3, 1]))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("ascending"), "{err}");
}
