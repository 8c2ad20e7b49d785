//! Safetensors checkpoints: one file or a sharded set with `model.safetensors.index.json`,
//! memory-mapped (or embedded, for the built-in model), converted to f32 on load.
//!
//! Headers are validated when the checkpoint opens, so a truncated file is reported with its
//! path before any layer is built; tensor lookups report the tensor name and expected shape.
//! Every lookup marks its tensor used, so once a model is built the tensors its config left
//! unused can be counted and warned about, as transformers does. Tensors are read one by one from
//! the map, so a process that loads part of a checkpoint (one EP rank's experts,
//! [`Checkpoint::skip`] for the rest) touches only those pages.
//!
//! Two ways to read a tensor: as f32 values ([`Checkpoint::tensor`], what the CPU model holds),
//! or as stored ([`Checkpoint::raw`]: dtype, shape and the bytes inside the map, borrowed, no
//! copy: what the GPU loader uploads). Block-quantized FP8 tensors ([`Quantization::Fp8`]) come
//! with their block scales in the raw form and dequantized in the f32 form.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use candle_core::{Device, Tensor};
/// A tensor's stored element type (safetensors' own).
pub use safetensors::Dtype;
use safetensors::SafeTensors;

use crate::config::{ModelConfig, Quantization};
use crate::error::{ModelError, Result};
pub use crate::synthetic::Synthetic;

/// An FP8 tensor's block scales, borrowed from the checkpoint.
#[derive(Debug, Clone, Copy)]
pub struct BlockScales<'a> {
    /// f32, little-endian: per matrix of the tensor `[ceil(rows / block[0]), ceil(cols /
    /// block[1])]`, matrix after matrix.
    pub bytes: &'a [u8],
    /// Rows and columns of the weight one scale covers (`weight_block_size`).
    pub block: [usize; 2],
}

/// One tensor (or one slice of it along its first dimension) as the checkpoint stores it: its
/// dtype, shape and bytes inside the memory map, borrowed without a copy.
#[derive(Debug, Clone, Copy)]
pub struct RawTensor<'a> {
    /// `BF16`, `F16`, `F32`, or `F8_E4M3` (then [`Self::scales`] is set).
    pub dtype: Dtype,
    pub shape: &'a [usize],
    /// Little-endian elements, row-major.
    pub bytes: &'a [u8],
    /// The block scales (`{name}_scale_inv`) of an `F8_E4M3` tensor; `None` for the others.
    pub scales: Option<BlockScales<'a>>,
    /// A tensor of a [`Checkpoint::synthetic`] checkpoint: no bytes, values generated where
    /// they are used.
    pub synthetic: Option<Synthetic>,
}

impl RawTensor<'_> {
    /// Number of elements.
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// The tensor as `(matrices, rows, cols)`: its last two dimensions (a vector is one row),
    /// the ones before them flattened.
    pub fn matrices(&self) -> (usize, usize, usize) {
        match *self.shape {
            [] => (1, 1, 1),
            [cols] => (1, 1, cols),
            [ref outer @ .., rows, cols] => (outer.iter().product(), rows, cols),
        }
    }

    /// The values as f32: exact for f32, bf16 and f16; an FP8 value times its block's scale
    /// (one f32 multiplication, as the device's dequantization computes it).
    pub fn to_f32(&self) -> Vec<f32> {
        if let Some(values) = self.synthetic {
            return (0..self.elements() as u64)
                .map(|i| values.value(i))
                .collect();
        }
        let bytes = self.bytes;
        match (self.dtype, self.scales) {
            (Dtype::F32, _) => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            (Dtype::BF16, _) => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            (Dtype::F16, _) => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            (Dtype::F8_E4M3, Some(scales)) => {
                let (matrices, rows, cols) = self.matrices();
                let [br, bc] = scales.block;
                let (srows, scols) = (rows.div_ceil(br), cols.div_ceil(bc));
                let scale = |i: usize| {
                    let b = &scales.bytes[4 * i..4 * i + 4];
                    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
                };
                let mut out = Vec::with_capacity(bytes.len());
                for m in 0..matrices {
                    for r in 0..rows {
                        let row = &bytes[(m * rows + r) * cols..][..cols];
                        let scale_row = (m * srows + r / br) * scols;
                        out.extend(
                            row.iter()
                                .enumerate()
                                .map(|(c, &q)| e4m3_to_f32(q) * scale(scale_row + c / bc)),
                        );
                    }
                }
                out
            }
            (dtype, _) => unreachable!("a raw tensor of dtype {dtype:?} (checked when read)"),
        }
    }
}

/// float8_e4m3fn bits as f32 (exact): bias 7, no infinities, `S.1111.111` is NaN.
pub fn e4m3_to_f32(v: u8) -> f32 {
    let sign = u32::from(v & 0x80) << 24;
    let (e, m) = (u32::from((v >> 3) & 15), u32::from(v & 7));
    if e == 15 && m == 7 {
        return f32::NAN;
    }
    if e == 0 {
        // m * 2^-9, exact.
        return f32::from_bits((m as f32 * 2f32.powi(-9)).to_bits() | sign);
    }
    f32::from_bits(sign | ((e + 120) << 23) | (m << 20))
}

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
    /// Set in a synthetic checkpoint (no bytes).
    synthetic: Option<Synthetic>,
}

/// All tensors of a checkpoint, addressable by name.
pub struct Checkpoint {
    shards: Vec<Shard>,
    entries: HashMap<String, Entry>,
    /// The FP8 scale blocks its config declares ([`Self::set_quantization`]): what an
    /// `F8_E4M3` tensor is read with.
    fp8_block: Mutex<Option<[usize; 2]>>,
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

    /// A bf16 checkpoint of the tensors `tensors` names with no stored values: each reads as
    /// [`Synthetic`] values, seeded by `seed` and its name: norm weights 1, biases 0, every
    /// other tensor uniform with standard deviation 0.02 (transformers' initialisation scale).
    /// What `rackfill bench forward --model-shape` runs a real-size model from without a file.
    pub fn synthetic(origin: &str, tensors: Vec<(String, Vec<usize>)>, seed: u64) -> Self {
        let entries = tensors
            .into_iter()
            .map(|(name, shape)| {
                let values = if name.ends_with("norm.weight") {
                    Synthetic::Constant(1.0)
                } else if name.ends_with("bias") {
                    Synthetic::Constant(0.0)
                } else {
                    // FNV-1a of the name: every tensor its own stream.
                    let named = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
                    });
                    Synthetic::Uniform {
                        seed: seed ^ named,
                        bound: 0.02 * 3f32.sqrt(),
                        first: 0,
                    }
                };
                let entry = Entry {
                    shard: 0,
                    dtype: Dtype::BF16,
                    shape,
                    start: 0,
                    end: 0,
                    used: AtomicBool::new(false),
                    synthetic: Some(values),
                };
                (name, entry)
            })
            .collect();
        Self {
            shards: vec![Shard {
                path: PathBuf::from(origin),
                bytes: ShardBytes::Owned(Vec::new()),
            }],
            entries,
            fp8_block: Mutex::new(None),
        }
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
                    synthetic: None,
                };
                entries.insert(name, entry);
            }
        }
        Ok(Self {
            shards,
            entries,
            fp8_block: Mutex::new(None),
        })
    }

    /// Reads the checkpoint's weights as `quantization` (its config's `quantization_config`)
    /// says: with FP8 blocks, `F8_E4M3` tensors are read with their `_scale_inv` block scales
    /// (without, they are refused). The model loaders call it with their config.
    pub fn set_quantization(&self, quantization: Option<&Quantization>) {
        *self.fp8_block.lock().unwrap_or_else(|e| e.into_inner()) =
            quantization.map(Quantization::fp8_block);
    }

    /// Every tensor's name and stored shape, sorted by name.
    pub fn tensor_shapes(&self) -> Vec<(&str, &[usize])> {
        let mut shapes: Vec<(&str, &[usize])> = self
            .entries
            .iter()
            .map(|(name, e)| (name.as_str(), e.shape.as_slice()))
            .collect();
        shapes.sort_unstable();
        shapes
    }

    /// Whether the checkpoint holds a tensor of this name.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// The stored shape of a tensor, if present.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.entries.get(name).map(|e| e.shape.as_slice())
    }

    /// Loads a tensor as f32 and checks its shape (an FP8 tensor dequantized by its scales).
    pub fn tensor(&self, name: &str, expected: &[usize]) -> Result<Tensor> {
        let raw = self.raw(name, expected)?;
        Ok(Tensor::from_vec(raw.to_f32(), expected, &Device::Cpu)?)
    }

    /// Loads `index` along the first dimension of a tensor of shape `expected` (one expert of a
    /// fused `[E, ...]` expert tensor), reading only that slice's bytes.
    pub fn tensor_index(&self, name: &str, expected: &[usize], index: usize) -> Result<Tensor> {
        let raw = self.raw_index(name, expected, index)?;
        Ok(Tensor::from_vec(raw.to_f32(), raw.shape, &Device::Cpu)?)
    }

    /// A tensor as stored, once its shape is `expected`: dtype, shape and its bytes in the map
    /// (no copy; only what the caller reads of them is touched), with the block scales of an
    /// FP8 tensor. Marks it (and its scales) used.
    pub fn raw(&self, name: &str, expected: &[usize]) -> Result<RawTensor<'_>> {
        let entry = self.checked_entry(name, expected)?;
        let data = &self.shards[entry.shard].bytes.as_slice()[entry.start..entry.end];
        let scales = self.scales(name, entry)?;
        Ok(RawTensor {
            dtype: entry.dtype,
            shape: &entry.shape,
            bytes: data,
            scales,
            synthetic: entry.synthetic,
        })
    }

    /// [`Self::raw`] of `index` along the first dimension of a tensor of shape `expected`: the
    /// slice's bytes (and its scales) only.
    pub fn raw_index(&self, name: &str, expected: &[usize], index: usize) -> Result<RawTensor<'_>> {
        let raw = self.raw(name, expected)?;
        let Some((&outer, inner)) = raw.shape.split_first() else {
            return Err(ModelError::Input(format!(
                "tensor {name:?} is a scalar: it has no index {index}"
            )));
        };
        if index >= outer {
            return Err(ModelError::Input(format!(
                "index {index} of tensor {name:?}, whose first dimension is {outer}"
            )));
        }
        fn slice(bytes: &[u8], outer: usize, index: usize) -> &[u8] {
            let stride = bytes.len() / outer;
            &bytes[index * stride..(index + 1) * stride]
        }
        let inner_elements: usize = inner.iter().product();
        Ok(RawTensor {
            dtype: raw.dtype,
            shape: inner,
            bytes: slice(raw.bytes, outer, index),
            scales: raw.scales.map(|s| BlockScales {
                bytes: slice(s.bytes, outer, index),
                block: s.block,
            }),
            synthetic: raw
                .synthetic
                .map(|values| values.skip((index * inner_elements) as u64)),
        })
    }

    /// The dtype a tensor is stored in, if present.
    pub fn dtype(&self, name: &str) -> Option<Dtype> {
        self.entries.get(name).map(|e| e.dtype)
    }

    /// Accounts for a tensor a sharded load leaves to other processes (another rank's routed
    /// expert): checks it exists with the expected shape, so every process agrees on the
    /// checkpoint, but reads none of its bytes, and keeps it (and an FP8 tensor's scales) out of
    /// [`Self::unused_tensors`].
    pub fn skip(&self, name: &str, expected: &[usize]) -> Result<()> {
        let entry = self.checked_entry(name, expected)?;
        if entry.dtype == Dtype::F8_E4M3 {
            if let Some(scales) = self.entries.get(&scale_name(name)) {
                scales.used.store(true, Ordering::Relaxed);
            }
        }
        Ok(())
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

    /// Checks `entry`'s dtype is one the loaders read, and for an FP8 tensor finds its block
    /// scales: present, f32, one per block of each matrix. Marks them used.
    fn scales(&self, name: &str, entry: &Entry) -> Result<Option<BlockScales<'_>>> {
        let path = || self.shards[entry.shard].path.clone();
        match entry.dtype {
            Dtype::F32 | Dtype::BF16 | Dtype::F16 => return Ok(None),
            Dtype::F8_E4M3 => {}
            other => {
                return Err(ModelError::TensorDtype {
                    path: path(),
                    name: name.to_string(),
                    dtype: format!("{other:?}"),
                })
            }
        }
        let fail = |message: String| ModelError::Quantization {
            path: path(),
            name: name.to_string(),
            message,
        };
        let block = self
            .fp8_block
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .ok_or_else(|| {
                fail(
                    "is F8_E4M3 but config.json declares no fp8 quantization_config \
                     (quant_method \"fp8\" with weight_block_size)"
                        .into(),
                )
            })?;
        let scale_name = scale_name(name);
        let Some(scales) = self.entries.get(&scale_name) else {
            return Err(fail(format!(
                "is F8_E4M3 but its block scales {scale_name:?} are missing"
            )));
        };
        scales.used.store(true, Ordering::Relaxed);
        let Some((&cols, rest)) = entry.shape.split_last() else {
            return Err(fail("is an F8_E4M3 scalar".into()));
        };
        let Some((&rows, outer)) = rest.split_last() else {
            return Err(fail(
                "is an F8_E4M3 vector: block scales need a matrix".into(),
            ));
        };
        let mut expected = outer.to_vec();
        expected.extend([rows.div_ceil(block[0]), cols.div_ceil(block[1])]);
        if scales.dtype != Dtype::F32 || scales.shape != expected {
            return Err(fail(format!(
                "its block scales {scale_name:?} are {:?} {:?}, expected F32 {expected:?} \
                 ({}x{} blocks of {:?})",
                scales.dtype, scales.shape, block[0], block[1], entry.shape
            )));
        }
        let shard = &self.shards[scales.shard];
        Ok(Some(BlockScales {
            bytes: &shard.bytes.as_slice()[scales.start..scales.end],
            block,
        }))
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

/// The block scales of FP8 tensor `name`.
fn scale_name(name: &str) -> String {
    format!("{name}_scale_inv")
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

    /// `prefix.name` as stored ([`Checkpoint::raw`]).
    pub fn raw(&self, shape: &[usize], name: &str) -> Result<RawTensor<'a>> {
        self.checkpoint.raw(&self.full(name), shape)
    }

    /// `index` along the first dimension of `prefix.name` as stored ([`Checkpoint::raw_index`]).
    pub fn raw_index(&self, shape: &[usize], name: &str, index: usize) -> Result<RawTensor<'a>> {
        self.checkpoint.raw_index(&self.full(name), shape, index)
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
