//! Safetensors checkpoints: one file or a sharded set with `model.safetensors.index.json`,
//! memory-mapped (or embedded, for the built-in model), converted to f32 on load.
//!
//! Headers are validated when the checkpoint opens, so a truncated file is reported with its
//! path before any layer is built; tensor lookups report the tensor name and expected shape.
//! Every lookup marks its tensor used, so once a model is built the tensors its config left
//! unused can be counted and warned about, as transformers does. Tensors are read one by one from
//! the map, so a process that loads part of a checkpoint (one EP rank's experts,
//! [`Checkpoint::skip`] for the rest) touches only those pages.

use std::collections::{BTreeSet, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::{Device, Tensor};
use safetensors::{Dtype, SafeTensors};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};

/// The bytes of one safetensors file.
enum ShardBytes {
    Mapped(memmap2::Mmap),
    Static(&'static [u8]),
    Owned(Vec<u8>),
}

impl ShardBytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Self::Mapped(map) => map,
            Self::Static(bytes) => bytes,
            Self::Owned(bytes) => bytes,
        }
    }
}

struct Shard {
    path: PathBuf,
    bytes: ShardBytes,
}

/// Where one tensor lives: its shard, dtype, shape and byte range in the shard, and whether the
/// model has used it (loaded it, or skipped it as another rank's expert).
struct Entry {
    shard: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    start: usize,
    end: usize,
    used: AtomicBool,
}

/// All tensors of a checkpoint, addressable by name.
pub struct Checkpoint {
    shards: Vec<Shard>,
    entries: HashMap<String, Entry>,
}

impl Checkpoint {
    /// Opens `dir/model.safetensors.index.json` and its shards, or `dir/model.safetensors`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let files = if index.is_file() {
            shard_files(&index)?
                .into_iter()
                .map(|name| dir.join(name))
                .collect()
        } else {
            let single = dir.join("model.safetensors");
            if !single.is_file() {
                return Err(ModelError::MissingFile { path: single });
            }
            vec![single]
        };
        let shards = files
            .into_iter()
            .map(|path| {
                let file = std::fs::File::open(&path).map_err(|source| match source.kind() {
                    std::io::ErrorKind::NotFound => ModelError::MissingFile { path: path.clone() },
                    _ => ModelError::Io {
                        path: path.clone(),
                        source,
                    },
                })?;
                // SAFETY: the map is read-only; a checkpoint modified while being served is the
                // user's error, as for every mmap-based loader (transformers, candle, vLLM).
                let map =
                    unsafe { memmap2::Mmap::map(&file) }.map_err(|source| ModelError::Io {
                        path: path.clone(),
                        source,
                    })?;
                Ok(Shard {
                    path,
                    bytes: ShardBytes::Mapped(map),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Self::index(shards)
    }

    /// A checkpoint from embedded bytes (`origin` names it in errors).
    pub fn from_static(origin: &str, bytes: &'static [u8]) -> Result<Self> {
        Self::index(vec![Shard {
            path: PathBuf::from(origin),
            bytes: ShardBytes::Static(bytes),
        }])
    }

    /// A checkpoint from safetensors bytes built in memory (benchmarks with generated weights).
    pub fn from_bytes(origin: &str, bytes: Vec<u8>) -> Result<Self> {
        Self::index(vec![Shard {
            path: PathBuf::from(origin),
            bytes: ShardBytes::Owned(bytes),
        }])
    }

    fn index(shards: Vec<Shard>) -> Result<Self> {
        let mut entries = HashMap::new();
        for (shard_index, shard) in shards.iter().enumerate() {
            let data = shard.bytes.as_slice();
            let parsed = SafeTensors::deserialize(data).map_err(|e| ModelError::Safetensors {
                path: shard.path.clone(),
                message: e.to_string(),
            })?;
            for (name, view) in parsed.tensors() {
                let start = view.data().as_ptr() as usize - data.as_ptr() as usize;
                let entry = Entry {
                    shard: shard_index,
                    dtype: view.dtype(),
                    shape: view.shape().to_vec(),
                    start,
                    end: start + view.data().len(),
                    used: AtomicBool::new(false),
                };
                entries.insert(name, entry);
            }
        }
        Ok(Self { shards, entries })
    }

    /// Whether the checkpoint holds a tensor of this name.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// The stored shape of a tensor, if present.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.entries.get(name).map(|e| e.shape.as_slice())
    }

    /// Loads a tensor as f32 and checks its shape.
    pub fn tensor(&self, name: &str, expected: &[usize]) -> Result<Tensor> {
        let entry = self.checked_entry(name, expected)?;
        let values = self.values(name, entry, entry.start..entry.end)?;
        Ok(Tensor::from_vec(values, expected, &Device::Cpu)?)
    }

    /// Loads `index` along the first dimension of a tensor of shape `expected` (one expert of a
    /// fused `[E, ...]` expert tensor), reading only that slice's bytes.
    pub fn tensor_index(&self, name: &str, expected: &[usize], index: usize) -> Result<Tensor> {
        let entry = self.checked_entry(name, expected)?;
        let Some((&outer, inner)) = expected.split_first() else {
            return Err(ModelError::Input(format!(
                "tensor {name:?} is a scalar: it has no index {index}"
            )));
        };
        if index >= outer {
            return Err(ModelError::Input(format!(
                "index {index} of tensor {name:?}, whose first dimension is {outer}"
            )));
        }
        let stride = (entry.end - entry.start) / outer;
        let start = entry.start + index * stride;
        let values = self.values(name, entry, start..start + stride)?;
        Ok(Tensor::from_vec(values, inner, &Device::Cpu)?)
    }

    /// Accounts for a tensor a sharded load leaves to other processes (another rank's routed
    /// expert): checks it exists with the expected shape, so every process agrees on the
    /// checkpoint, but reads none of its bytes, and keeps it out of [`Self::unused_tensors`].
    pub fn skip(&self, name: &str, expected: &[usize]) -> Result<()> {
        self.checked_entry(name, expected).map(|_| ())
    }

    /// The entry of `name`, marked used, once its stored shape is `expected`.
    fn checked_entry(&self, name: &str, expected: &[usize]) -> Result<&Entry> {
        let entry = self.entry(name)?;
        entry.used.store(true, Ordering::Relaxed);
        if entry.shape != expected {
            return Err(ModelError::TensorShape {
                path: self.shards[entry.shard].path.clone(),
                name: name.to_string(),
                found: entry.shape.clone(),
                expected: expected.to_vec(),
            });
        }
        Ok(entry)
    }

    fn entry(&self, name: &str) -> Result<&Entry> {
        self.entries
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                path: self.describe(),
                name: name.to_string(),
            })
    }

    /// The f32 values of `bytes` (a range of `entry`'s data): only those pages of a mapped file
    /// are touched.
    fn values(&self, name: &str, entry: &Entry, bytes: Range<usize>) -> Result<Vec<f32>> {
        let shard = &self.shards[entry.shard];
        let bytes = &shard.bytes.as_slice()[bytes];
        Ok(match entry.dtype {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(ModelError::TensorDtype {
                    path: shard.path.clone(),
                    name: name.to_string(),
                    dtype: format!("{other:?}"),
                })
            }
        })
    }

    /// The checkpoint's files, for error messages about tensors found in none of them.
    fn describe(&self) -> PathBuf {
        match self.shards.as_slice() {
            [one] => one.path.clone(),
            shards => {
                let dir = shards
                    .first()
                    .and_then(|s| s.path.parent())
                    .unwrap_or(Path::new(""));
                dir.join(format!("model-*.safetensors ({} shards)", shards.len()))
            }
        }
    }

    /// The tensors no module has loaded or skipped, sorted by name: once a model is built, those
    /// its config leaves out (a sharded load's other experts are skipped, not unused).
    pub fn unused_tensors(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self
            .entries
            .iter()
            .filter(|(_, entry)| !entry.used.load(Ordering::Relaxed))
            .map(|(name, _)| name.as_str())
            .collect();
        names.sort_unstable();
        names
    }

    /// Warns, as transformers does, when the model built from `config` left tensors of this
    /// checkpoint unused: the sign of a config that does not describe its checkpoint (most
    /// often `num_hidden_layers` smaller than the layers stored, which would otherwise serve a
    /// truncated model silently). Tensors no model loads are not counted: DeepSeek's
    /// multi-token-prediction layers and stored `rotary_emb.inv_freq` buffers. Returns the
    /// number counted.
    pub fn warn_unused(&self, config: &ModelConfig) -> usize {
        let mtp_layers = config.num_layers..config.num_layers + config.nextn_predict_layers;
        let unused: Vec<&str> = self
            .unused_tensors()
            .into_iter()
            .filter(|name| !name.ends_with("rotary_emb.inv_freq"))
            .filter(|name| !layer_index(name).is_some_and(|i| mtp_layers.contains(&i)))
            .collect();
        if unused.is_empty() {
            return 0;
        }
        let beyond = unused
            .iter()
            .filter(|name| layer_index(name).is_some_and(|i| i >= config.num_layers))
            .count();
        let layers = config.num_layers;
        let hint = if beyond > 0 {
            format!(
                "; {beyond} of them belong to layers {layers} and above, which \
                 num_hidden_layers = {layers} leaves out"
            )
        } else {
            String::new()
        };
        let first: Vec<&str> = unused.iter().take(3).copied().collect();
        tracing::warn!(
            unused = unused.len(),
            "{}: {} tensors of the checkpoint are not used by the model{hint} (first: {})",
            self.describe().display(),
            unused.len(),
            first.join(", "),
        );
        unused.len()
    }

    /// A prefix view for building one module (`VarBuilder::pp` style).
    pub fn root(&self) -> Weights<'_> {
        Weights {
            checkpoint: self,
            prefix: String::new(),
        }
    }
}

/// `i` for a tensor named `model.layers.{i}.*`.
fn layer_index(name: &str) -> Option<usize> {
    name.strip_prefix("model.layers.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

/// The distinct shard file names listed in an index's `weight_map`.
pub(crate) fn shard_files(index: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(index).map_err(|source| ModelError::Io {
        path: index.to_path_buf(),
        source,
    })?;
    let bad = |message: String| ModelError::Json {
        path: index.to_path_buf(),
        message,
    };
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("missing object weight_map".into()))?;
    let files: BTreeSet<&str> = map
        .values()
        .map(|v| {
            v.as_str()
                .ok_or_else(|| bad("weight_map values must be file names".into()))
        })
        .collect::<Result<_>>()?;
    if let Some(bad_name) = files.iter().find(|f| f.contains('/') || f.contains("..")) {
        return Err(bad(format!(
            "shard {bad_name:?} is not a file name in this directory"
        )));
    }
    Ok(files.into_iter().map(str::to_string).collect())
}

/// A checkpoint seen under a name prefix, the way a module's weights are named.
#[derive(Clone)]
pub struct Weights<'a> {
    checkpoint: &'a Checkpoint,
    prefix: String,
}

impl<'a> Weights<'a> {
    /// Descends into a submodule: `w.pp("layers").pp(3)` names `layers.3.*`.
    pub fn pp(&self, name: impl std::fmt::Display) -> Weights<'a> {
        let prefix = if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{}", self.prefix, name)
        };
        Weights {
            checkpoint: self.checkpoint,
            prefix,
        }
    }

    fn full(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{}", self.prefix, name)
        }
    }

    /// Loads `prefix.name` with the expected shape.
    pub fn get(&self, shape: &[usize], name: &str) -> Result<Tensor> {
        self.checkpoint.tensor(&self.full(name), shape)
    }

    /// Loads `index` along the first dimension of `prefix.name` (of shape `shape`).
    pub fn get_index(&self, shape: &[usize], name: &str, index: usize) -> Result<Tensor> {
        self.checkpoint.tensor_index(&self.full(name), shape, index)
    }

    /// Checks `prefix.name` exists with shape `shape` without reading it ([`Checkpoint::skip`]).
    pub fn skip(&self, shape: &[usize], name: &str) -> Result<()> {
        self.checkpoint.skip(&self.full(name), shape)
    }

    /// The prefix this view names its tensors under (`model.layers.3.mlp.experts`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Whether `prefix.name` exists.
    pub fn contains(&self, name: &str) -> bool {
        self.checkpoint.contains(&self.full(name))
    }
}
