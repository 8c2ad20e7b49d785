//! Everything the server needs to serve one model: the weights, the tokenizer, the chat template,
//! the generation defaults and the name clients address it by. [`ModelBundle::load`] takes what a
//! user passes to `--model` (a directory or a hub id), or nothing for the built-in model;
//! [`ModelBundle::load_with`] loads only some routed experts (one EP rank's, in a process per
//! rank). Both load the weights into host memory (the CPU path); [`ModelBundle::open`] leaves
//! them in the checkpoint ([`CheckpointModel`]), for a device to read straight from its files.

use std::path::{Path, PathBuf};

use crate::chat_template::{load_chat_template, ChatTemplate};
use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::expert_selection::ExpertSelection;
use crate::generation_config::GenerationConfig;
use crate::model::MoeModel;
use crate::source;
use crate::tokenizer::Tokenizer;
use crate::Result;

/// The name the built-in model is served under (`"model"` in requests, `/v1/models`).
pub const BUILTIN_MODEL_NAME: &str = "rackfill-tiny-moe";

/// The built-in model's files, compiled into the binary so that `rackfill serve` works offline
/// from any directory. `scripts/make_builtin_model.py` writes them.
mod builtin_files {
    pub const CONFIG: &str = include_str!("../builtin/config.json");
    pub const WEIGHTS: &[u8] = include_bytes!("../builtin/model.safetensors");
    pub const TOKENIZER: &[u8] = include_bytes!("../builtin/tokenizer.json");
    pub const TOKENIZER_CONFIG: &str = include_str!("../builtin/tokenizer_config.json");
    pub const GENERATION_CONFIG: &str = include_str!("../builtin/generation_config.json");
}

/// Where a bundle's files came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelOrigin {
    /// The model compiled into the binary.
    Builtin,
    /// A checkpoint directory (given directly or resolved from a hub id).
    Directory(PathBuf),
}

/// A model whose weights are still in its checkpoint (memory-mapped, nothing read): what a
/// device loads straight from the files, each process only the tensors it runs.
pub struct CheckpointModel {
    pub config: ModelConfig,
    pub checkpoint: Checkpoint,
}

/// A model ready to serve: its weights (`W`: loaded on the host, [`MoeModel`], or still in the
/// checkpoint, [`CheckpointModel`]) and what serving it needs besides.
pub struct ModelBundle<W = MoeModel> {
    /// The id clients put in `"model"`: the `--model` argument as given, or
    /// [`BUILTIN_MODEL_NAME`].
    pub name: String,
    pub origin: ModelOrigin,
    pub model: W,
    pub tokenizer: Tokenizer,
    /// `None` for base models without a template (chat requests are then refused).
    pub chat_template: Option<ChatTemplate>,
    /// Defaults from `generation_config.json` (all empty when the file is absent).
    pub generation: GenerationConfig,
    /// Tokens that end a generation: `generation_config.json`'s `eos_token_id`, else
    /// `config.json`'s, else the tokenizer config's `eos_token`.
    pub stop_token_ids: Vec<u32>,
}

impl<W> ModelBundle<W> {
    /// The same bundle with its weights turned by `f` (e.g. into the engine's own type).
    pub fn map<V>(self, f: impl FnOnce(W) -> V) -> ModelBundle<V> {
        ModelBundle {
            name: self.name,
            origin: self.origin,
            model: f(self.model),
            tokenizer: self.tokenizer,
            chat_template: self.chat_template,
            generation: self.generation,
            stop_token_ids: self.stop_token_ids,
        }
    }

    fn assemble(
        (name, origin): (String, ModelOrigin),
        (model, config): (W, &ModelConfig),
        tokenizer: Tokenizer,
        chat_template: Option<ChatTemplate>,
        generation: GenerationConfig,
    ) -> Self {
        let stop_token_ids = stop_tokens(&generation, config, &tokenizer, &chat_template);
        Self {
            name,
            origin,
            model,
            tokenizer,
            chat_template,
            generation,
            stop_token_ids,
        }
    }
}

impl ModelBundle<CheckpointModel> {
    /// [`ModelBundle::load`] with the weights left in the checkpoint (opened and checked, not
    /// read): for a device to load.
    pub fn open(spec: Option<&str>) -> Result<Self> {
        match spec {
            None | Some(BUILTIN_MODEL_NAME) => {
                let config = builtin_config()?;
                let checkpoint =
                    Checkpoint::from_static("<builtin>/model.safetensors", builtin_files::WEIGHTS)?;
                let (tokenizer, chat_template, generation) = builtin_files()?;
                Ok(Self::assemble(
                    (BUILTIN_MODEL_NAME.into(), ModelOrigin::Builtin),
                    (
                        CheckpointModel {
                            config: config.clone(),
                            checkpoint,
                        },
                        &config,
                    ),
                    tokenizer,
                    chat_template,
                    generation,
                ))
            }
            Some(spec) => {
                let dir = source::resolve(spec)?;
                let config = ModelConfig::load(&dir)?;
                let checkpoint = Checkpoint::open(&dir)?;
                let (tokenizer, chat_template, generation) = dir_files(&dir)?;
                Ok(Self::assemble(
                    (
                        spec.trim_end_matches('/').to_string(),
                        ModelOrigin::Directory(dir),
                    ),
                    (
                        CheckpointModel {
                            config: config.clone(),
                            checkpoint,
                        },
                        &config,
                    ),
                    tokenizer,
                    chat_template,
                    generation,
                ))
            }
        }
    }
}

impl ModelBundle {
    /// Loads `spec` (a checkpoint directory, `org/name` or `org/name@revision`), or the built-in
    /// model when `spec` is `None` or its name, [`BUILTIN_MODEL_NAME`].
    pub fn load(spec: Option<&str>) -> Result<Self> {
        Self::load_with(spec, &ExpertSelection::All)
    }

    /// [`Self::load`] with only the `selection` of routed experts read (what a process serving
    /// some EP ranks runs: their home experts, `EpRuntime::expert_selection`).
    pub fn load_with(spec: Option<&str>, selection: &ExpertSelection) -> Result<Self> {
        match spec {
            None | Some(BUILTIN_MODEL_NAME) => Self::builtin_with(selection),
            Some(spec) => {
                let dir = source::resolve(spec)?;
                Self::from_dir_with(&dir, spec.trim_end_matches('/').to_string(), selection)
            }
        }
    }

    /// The normalised `config.json` of `spec` (as [`Self::load`] takes it) without loading any
    /// weight: what a process needs to work out its [`ExpertSelection`] before
    /// [`Self::load_with`].
    pub fn config(spec: Option<&str>) -> Result<ModelConfig> {
        match spec {
            None | Some(BUILTIN_MODEL_NAME) => builtin_config(),
            Some(spec) => ModelConfig::load(&source::resolve(spec)?),
        }
    }

    /// The built-in tiny Qwen3-MoE (see `models/builtin/README.md`).
    pub fn builtin() -> Result<Self> {
        Self::builtin_with(&ExpertSelection::All)
    }

    /// [`Self::builtin`] with only the `selection` of routed experts.
    pub fn builtin_with(selection: &ExpertSelection) -> Result<Self> {
        let config = builtin_config()?;
        let checkpoint =
            Checkpoint::from_static("<builtin>/model.safetensors", builtin_files::WEIGHTS)?;
        let model = MoeModel::from_checkpoint_with(config.clone(), &checkpoint, selection)?;
        let (tokenizer, chat_template, generation) = builtin_files()?;
        Ok(Self::assemble(
            (BUILTIN_MODEL_NAME.into(), ModelOrigin::Builtin),
            (model, &config),
            tokenizer,
            chat_template,
            generation,
        ))
    }

    /// Loads a checkpoint directory: `config.json`, the safetensors, `tokenizer.json` (required),
    /// the chat template and `generation_config.json` (both optional).
    pub fn from_dir(dir: &Path, name: String) -> Result<Self> {
        Self::from_dir_with(dir, name, &ExpertSelection::All)
    }

    /// [`Self::from_dir`] with only the `selection` of routed experts read.
    pub fn from_dir_with(dir: &Path, name: String, selection: &ExpertSelection) -> Result<Self> {
        let model = MoeModel::load_with(dir, selection)?;
        let (tokenizer, chat_template, generation) = dir_files(dir)?;
        let config = model.config().clone();
        Ok(Self::assemble(
            (name, ModelOrigin::Directory(dir.to_path_buf())),
            (model, &config),
            tokenizer,
            chat_template,
            generation,
        ))
    }
}

/// The built-in model's normalised `config.json`.
fn builtin_config() -> Result<ModelConfig> {
    ModelConfig::from_json_str(builtin_files::CONFIG, Path::new("<builtin>/config.json"))
}

/// The built-in model's tokenizer, chat template and generation defaults.
fn builtin_files() -> Result<(Tokenizer, Option<ChatTemplate>, GenerationConfig)> {
    let tokenizer = Tokenizer::from_bytes(builtin_files::TOKENIZER, "<builtin>/tokenizer.json")?;
    let chat_template = ChatTemplate::from_tokenizer_config_json(
        builtin_files::TOKENIZER_CONFIG,
        "<builtin>/tokenizer_config.json",
    )?;
    let generation = GenerationConfig::from_json_str(
        builtin_files::GENERATION_CONFIG,
        "<builtin>/generation_config.json",
    )?;
    Ok((tokenizer, chat_template, generation))
}

/// A checkpoint directory's tokenizer (required), chat template and generation defaults (both
/// optional).
fn dir_files(dir: &Path) -> Result<(Tokenizer, Option<ChatTemplate>, GenerationConfig)> {
    let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json"))?;
    let chat_template = load_chat_template(dir)?;
    let generation = GenerationConfig::load(dir)?.unwrap_or_default();
    Ok((tokenizer, chat_template, generation))
}

/// The first source that names any end-of-sequence token wins, as in `transformers`' `generate`
/// (which merges `generation_config.json` over `config.json`).
fn stop_tokens(
    generation: &GenerationConfig,
    config: &ModelConfig,
    tokenizer: &Tokenizer,
    template: &Option<ChatTemplate>,
) -> Vec<u32> {
    if !generation.eos_token_ids.is_empty() {
        return dedup(&generation.eos_token_ids);
    }
    if !config.eos_token_ids.is_empty() {
        return dedup(&config.eos_token_ids);
    }
    template
        .as_ref()
        .and_then(|t| t.special_tokens().eos_token.as_deref())
        .and_then(|text| tokenizer.token_id(text))
        .into_iter()
        .collect()
}

fn dedup(ids: &[u32]) -> Vec<u32> {
    let mut out = Vec::with_capacity(ids.len());
    for &id in ids {
        if !out.contains(&id) {
            out.push(id);
        }
    }
    out
}
