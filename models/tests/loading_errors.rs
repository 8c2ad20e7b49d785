//! Loading through the real code paths: the Hugging Face cache layout (offline), and every kind
//! of broken checkpoint getting a typed error that names the file and tensor, never a panic.

use std::fs;
use std::path::{Path, PathBuf};

use rackfill_models::{source, ModelError, MoeModel};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// A copy of a fixture's files in a temporary directory, for breaking them.
fn copy_fixture(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in fs::read_dir(fixture(name)).unwrap() {
        let path = entry.unwrap().path();
        fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    dir
}

fn load_err(dir: &Path) -> String {
    match MoeModel::load(dir) {
        Ok(_) => panic!("{} loaded but should not", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn hub_cache_resolves_offline_and_unknown_ids_are_reported() {
    let cache = tempfile::tempdir().unwrap();
    let repo = cache.path().join("models--tiny-org--tiny-qwen3");
    let snapshot = repo.join("snapshots/0123abcd");
    fs::create_dir_all(&snapshot).unwrap();
    fs::create_dir_all(repo.join("refs")).unwrap();
    fs::write(repo.join("refs/main"), "0123abcd").unwrap();
    for entry in fs::read_dir(fixture("qwen3_moe")).unwrap() {
        let path = entry.unwrap().path();
        fs::copy(&path, snapshot.join(path.file_name().unwrap())).unwrap();
    }
    // Process-wide variables: this is the only test in this binary that reads them.
    std::env::set_var("HF_HUB_CACHE", cache.path());
    std::env::set_var("HF_HUB_OFFLINE", "1");

    let dir = source::resolve("tiny-org/tiny-qwen3").unwrap();
    assert_eq!(dir, snapshot);
    MoeModel::load(&dir).unwrap();

    let err = source::resolve("tiny-org/not-cached").unwrap_err();
    assert!(matches!(err, ModelError::NotFound { .. }), "{err}");
    assert!(err.to_string().contains("HF_HUB_OFFLINE"), "{err}");

    // Cached config but a missing weight shard is not a usable snapshot.
    fs::remove_file(snapshot.join("model.safetensors")).unwrap();
    assert!(source::resolve("tiny-org/tiny-qwen3").is_err());

    let err = source::resolve("/no/such/dir").unwrap_err();
    assert!(err.to_string().contains("no such directory"), "{err}");
}

#[test]
fn missing_config_names_the_file() {
    let dir = copy_fixture("qwen3_moe");
    fs::remove_file(dir.path().join("config.json")).unwrap();
    let err = load_err(dir.path());
    assert!(
        err.contains("config.json") && err.contains("not found"),
        "{err}"
    );
}

#[test]
fn unknown_architecture_is_named() {
    let dir = copy_fixture("qwen3_moe");
    let path = dir.path().join("config.json");
    let text = fs::read_to_string(&path).unwrap();
    let text = text
        .replace("Qwen3MoeForCausalLM", "GPT2LMHeadModel")
        .replace("\"qwen3_moe\"", "\"gpt2\"");
    fs::write(&path, text).unwrap();
    let err = load_err(dir.path());
    assert!(
        err.contains("unsupported architecture \"GPT2LMHeadModel\""),
        "{err}"
    );
}

#[test]
fn invalid_config_values_are_reported() {
    let dir = copy_fixture("qwen3_moe");
    let path = dir.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    config["num_experts_per_tok"] = serde_json::json!(99);
    fs::write(&path, config.to_string()).unwrap();
    let err = load_err(dir.path());
    assert!(err.contains("num_experts_per_tok"), "{err}");

    fs::write(&path, "{not json").unwrap();
    let err = load_err(dir.path());
    assert!(err.contains("invalid JSON"), "{err}");
}

#[test]
fn missing_and_misshaped_tensors_are_named() {
    let dir = copy_fixture("qwen3_moe");
    let path = dir.path().join("config.json");
    let original = fs::read_to_string(&path).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&original).unwrap();
    config["moe_intermediate_size"] = serde_json::json!(40);
    fs::write(&path, config.to_string()).unwrap();
    let err = load_err(dir.path());
    assert!(
        err.contains("model.layers.0.mlp.experts.0.gate_proj.weight")
            && err.contains("expected [40, 64]"),
        "{err}"
    );

    let mut config: serde_json::Value = serde_json::from_str(&original).unwrap();
    config["num_hidden_layers"] = serde_json::json!(4);
    fs::write(&path, config.to_string()).unwrap();
    let err = load_err(dir.path());
    assert!(
        err.contains("missing tensor") && err.contains("model.layers.3."),
        "{err}"
    );
}

#[test]
fn corrupt_and_missing_safetensors_are_reported() {
    let dir = copy_fixture("qwen3_moe");
    let weights = dir.path().join("model.safetensors");
    let bytes = fs::read(&weights).unwrap();
    fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap();
    let err = load_err(dir.path());
    assert!(
        err.contains("model.safetensors") && err.contains("corrupt"),
        "{err}"
    );

    fs::write(&weights, b"garbage").unwrap();
    assert!(load_err(dir.path()).contains("corrupt"));

    fs::remove_file(&weights).unwrap();
    let err = load_err(dir.path());
    assert!(err.contains("model.safetensors: file not found"), "{err}");
}

#[test]
fn missing_shard_of_an_index_is_named() {
    let dir = copy_fixture("mixtral");
    let shard = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().contains("-of-"))
        .unwrap();
    fs::remove_file(&shard).unwrap();
    let err = load_err(dir.path());
    assert!(
        err.contains(shard.file_name().unwrap().to_str().unwrap()),
        "{err}"
    );
}

#[test]
fn out_of_vocabulary_tokens_are_an_input_error() {
    let model = MoeModel::load(&fixture("qwen3_moe")).unwrap();
    let err = model.embed(&[1, 2, 100_000]).unwrap_err();
    assert!(matches!(err, ModelError::Input(_)), "{err}");
}
