//! A config that leaves tensors of its checkpoint unused (`num_hidden_layers` smaller than the
//! layers stored) still loads, as in transformers, but warns with the number of unused tensors,
//! instead of serving a truncated model silently. Every fixture and the built-in model use all
//! of their tensors.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rackfill_models::{Checkpoint, ModelConfig, MoeModel};
use serde_json::Value;

fn models_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A copy of fixture `name` whose `config.json` has `edit` applied.
fn edited_fixture(name: &str, edit: impl FnOnce(&mut Value)) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in fs::read_dir(models_dir().join("tests/fixtures").join(name)).unwrap() {
        let path = entry.unwrap().path();
        fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    let path = dir.path().join("config.json");
    let mut config: Value = serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    fs::write(&path, config.to_string()).unwrap();
    dir
}

/// Builds the model of `dir`; returns the checkpoint (for its unused tensors) and every warning
/// logged meanwhile.
fn load(dir: &Path) -> (Checkpoint, String) {
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);
    impl Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .finish();
    let checkpoint = Checkpoint::open(dir).unwrap();
    tracing::subscriber::with_default(subscriber, || {
        let config = ModelConfig::load(dir).unwrap();
        MoeModel::from_checkpoint(config, &checkpoint).unwrap();
    });
    let log = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    (checkpoint, log)
}

#[test]
fn every_fixture_uses_all_its_tensors() {
    let mut dirs = vec![models_dir().join("builtin")];
    for entry in fs::read_dir(models_dir().join("tests/fixtures")).unwrap() {
        let path = entry.unwrap().path();
        if path.join("config.json").is_file() {
            dirs.push(path);
        }
    }
    assert!(dirs.len() > 5, "{dirs:?}");
    for dir in dirs {
        let (checkpoint, log) = load(&dir);
        assert_eq!(
            checkpoint.unused_tensors(),
            Vec::<&str>::new(),
            "{}",
            dir.display()
        );
        assert!(log.is_empty(), "{}: {log}", dir.display());
    }
}

#[test]
fn fewer_layers_than_stored_warn_with_the_number_of_unused_tensors() {
    let dir = edited_fixture("qwen3_moe", |config| {
        config["num_hidden_layers"] = 2.into();
    });
    // The stored third layer, counted from the file itself.
    let bytes = fs::read(dir.path().join("model.safetensors")).unwrap();
    let stored = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let dropped = stored
        .names()
        .into_iter()
        .filter(|name| name.starts_with("model.layers.2."))
        .count();
    assert!(dropped > 10, "{dropped}");

    let (checkpoint, log) = load(dir.path());
    let unused = checkpoint.unused_tensors();
    assert_eq!(unused.len(), dropped, "{unused:?}");
    assert!(unused
        .iter()
        .all(|name| name.starts_with("model.layers.2.")));
    assert_eq!(log.lines().count(), 1, "{log}");
    assert!(log.contains("WARN"), "{log}");
    assert!(
        log.contains(&format!("{dropped} tensors of the checkpoint are not used")),
        "{log}"
    );
    assert!(log.contains("num_hidden_layers = 2"), "{log}");
    assert!(log.contains("model.safetensors"), "{log}");
}

#[test]
fn deepseek_multi_token_prediction_layers_are_expected_to_stay_unused() {
    // The fixture's last layer, declared a multi-token-prediction layer: stored, never run, and
    // not worth a warning (transformers ignores it too).
    let dir = edited_fixture("deepseek_v3", |config| {
        let layers = config["num_hidden_layers"].as_u64().unwrap();
        config["num_hidden_layers"] = (layers - 1).into();
        config["num_nextn_predict_layers"] = 1.into();
    });
    let (checkpoint, log) = load(dir.path());
    assert!(!checkpoint.unused_tensors().is_empty());
    assert!(log.is_empty(), "{log}");
}
