//! Where a model's files come from: a local directory, or a Hugging Face id resolved through the
//! hub cache (`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`), offline when
//! the files are cached, downloaded when a network exists and `HF_HUB_OFFLINE` is not set.

use std::path::{Path, PathBuf};

use hf_hub::{Cache, Repo, RepoType};

use crate::error::{ModelError, Result};

/// Files fetched with a model when it is downloaded; absent ones are skipped.
const OPTIONAL_FILES: [&str; 4] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
];

/// Resolves `spec` (a directory, `org/name` or `org/name@revision`) to a directory holding
/// `config.json` and the safetensors.
pub fn resolve(spec: &str) -> Result<PathBuf> {
    let path = Path::new(spec);
    if path.is_dir() {
        return Ok(path.to_path_buf());
    }
    if path.exists() {
        return Err(not_found(
            spec,
            "is a file; pass the checkpoint's directory",
        ));
    }
    let (id, revision) = match spec.split_once('@') {
        Some((id, revision)) => (id, revision.to_string()),
        None => (spec, "main".to_string()),
    };
    if !looks_like_hub_id(id) {
        return Err(not_found(spec, "no such directory"));
    }
    let repo = Repo::with_revision(id.to_string(), RepoType::Model, revision);
    let cache = hub_cache();
    if let Some(dir) = cached_snapshot(&cache, &repo) {
        return Ok(dir);
    }
    if offline() {
        return Err(not_found(
            spec,
            &format!(
                "not a local directory and not complete in the Hugging Face cache {} \
                 (HF_HUB_OFFLINE is set, so nothing is downloaded)",
                cache.path().display()
            ),
        ));
    }
    download(spec, cache, repo)
}

/// `org/name` with the characters the hub allows.
fn looks_like_hub_id(id: &str) -> bool {
    let mut parts = id.split('/');
    let (Some(org), Some(name), None) = (parts.next(), parts.next(), parts.next()) else {
        return false;
    };
    let valid = |s: &str| {
        !s.is_empty()
            && !s.starts_with('.')
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    valid(org) && valid(name)
}

fn hub_cache() -> Cache {
    match std::env::var_os("HF_HUB_CACHE") {
        Some(dir) => Cache::new(PathBuf::from(dir)),
        None => Cache::from_env(),
    }
}

fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| !v.is_empty() && v != "0")
}

fn not_found(spec: &str, message: &str) -> ModelError {
    ModelError::NotFound {
        id: spec.to_string(),
        message: message.to_string(),
    }
}

/// The snapshot directory when config and every weight shard are cached.
fn cached_snapshot(cache: &Cache, repo: &Repo) -> Option<PathBuf> {
    let cached = cache.repo(repo.clone());
    let config = cached.get("config.json")?;
    let dir = config.parent()?.to_path_buf();
    weight_files(&dir)
        .ok()?
        .iter()
        .all(|f| dir.join(f).is_file())
        .then_some(dir)
}

/// The weight files a snapshot needs: the index's shards, or `model.safetensors`.
fn weight_files(dir: &Path) -> Result<Vec<String>> {
    let index = dir.join("model.safetensors.index.json");
    if !index.is_file() {
        return Ok(vec!["model.safetensors".into()]);
    }
    let mut files = crate::checkpoint::shard_files(&index)?;
    files.push("model.safetensors.index.json".into());
    Ok(files)
}

/// Downloads config, weights and tokenizer files into the cache; returns the snapshot directory.
fn download(spec: &str, cache: Cache, repo: Repo) -> Result<PathBuf> {
    let failed = |e: hf_hub::api::sync::ApiError| not_found(spec, &format!("download failed: {e}"));
    let api = hf_hub::api::sync::ApiBuilder::from_cache(cache)
        .with_progress(false)
        .build()
        .map_err(failed)?;
    let remote = api.repo(repo);
    let config = remote.get("config.json").map_err(failed)?;
    let dir = config
        .parent()
        .ok_or_else(|| not_found(spec, "cache path has no parent"))?
        .to_path_buf();
    let weights = match remote.get("model.safetensors.index.json") {
        Ok(_) => weight_files(&dir)?,
        Err(_) => vec!["model.safetensors".to_string()],
    };
    for file in &weights {
        remote.get(file).map_err(failed)?;
    }
    for file in OPTIONAL_FILES {
        // Optional: a checkpoint without a chat template or generation config still serves.
        let _ = remote.get(file);
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_ids_are_recognised() {
        assert!(looks_like_hub_id("Qwen/Qwen3-30B-A3B"));
        assert!(looks_like_hub_id("deepseek-ai/DeepSeek-V3"));
        assert!(!looks_like_hub_id("no-slash"));
        assert!(!looks_like_hub_id("a/b/c"));
        assert!(!looks_like_hub_id("../etc"));
        assert!(!looks_like_hub_id("org/na me"));
    }
}
