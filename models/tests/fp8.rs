//! Block-quantized FP8 checkpoints (DeepSeek-V3's and Qwen3's format): `quantization_config`
//! `quant_method: "fp8"`, `fmt: "e4m3"`, `weight_block_size`; each quantized linear weight stored
//! as float8_e4m3fn (safetensors `F8_E4M3`) beside its f32 `_scale_inv` block scales.
//!
//! A generator here quantizes a conformance fixture's linear weights to e4m3 with block scales
//! (the fixtures are small: 128 x 128 blocks cover partial edges, and a 16 x 24 block size gives
//! several blocks per matrix with partial ones at the edges), keeping some modules unquantized
//! (`modules_to_not_convert`), and writes beside it the checkpoint of its dequantized weights in
//! f32. The FP8 checkpoint must give that checkpoint's logits: on the CPU (dequantized to f32 at
//! load, within 1e-4) and on the device (fp8 bytes and scales uploaded, dequantized to bf16 by a
//! kernel, within 2e-3; on the host emulator, and GPU 0 on a GPU host). Broken FP8 checkpoints
//! fail in one line naming the tensor or field.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rackfill_models::checkpoint::e4m3_to_f32;
use rackfill_models::{Checkpoint, LogitsFor, ModelConfig, ModelError, MoeModel, SequenceInput};
use safetensors::{Dtype, SafeTensors};
use serde_json::{json, Value};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
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

fn write_checkpoint(dir: &Path, config: &Value, tensors: &Tensors) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(name, (dtype, shape, bytes))| {
            let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes).unwrap();
            (name.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn le_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// float8_e4m3fn bits as f64, from the format's definition (bias 7, no infinities,
/// `S.1111.111` NaN).
fn e4m3_value(v: u8) -> f64 {
    let sign = if v & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (i32::from((v >> 3) & 15), f64::from(v & 7));
    sign * match e {
        15 if m == 7.0 => f64::NAN,
        0 => m * 2f64.powi(-9),
        _ => (8.0 + m) * 2f64.powi(e - 10),
    }
}

/// `x` as the nearest e4m3 value (ties to the even code), saturating at 448.
fn to_e4m3(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let x = f64::from(x.abs()).min(448.0);
    let code = if x < 2f64.powi(-6) {
        // Subnormals, steps of 2^-9 (a carry into code 8 is the smallest normal, 2^-6).
        (x * 512.0).round_ties_even() as u8
    } else {
        let mut e = x.log2().floor() as i32;
        let mut m = ((x / 2f64.powi(e) - 1.0) * 8.0).round_ties_even() as i32;
        if m == 8 {
            (e, m) = (e + 1, 0);
        }
        (((e + 7) << 3) | m) as u8
    };
    code.min(0x7e) | sign
}
/// A fixture's checkpoint quantized to FP8 with `block` scales, and the checkpoint of its
/// dequantized weights (f32, no quantization_config), under `root`.
struct Pair {
    fp8: PathBuf,
    dequantized: PathBuf,
}

/// Modules kept unquantized (beside the norms, routers, embedding and LM head, which are never
/// quantized): one projection, as real FP8 checkpoints list some.
const NOT_CONVERTED: [&str; 2] = ["lm_head", "model.layers.0.self_attn.o_proj"];

fn quantized_pair(name: &str, block: [usize; 2], root: &Path) -> Pair {
    let dir = fixture(name);
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let (mut fp8, mut dequantized) = (Tensors::new(), Tensors::new());
    let mut quantized = 0;
    for (tensor, (dtype, shape, bytes)) in read_tensors(&dir.join("model.safetensors")) {
        assert_eq!(dtype, Dtype::F32, "{name}: an f32 fixture");
        let module = tensor.strip_suffix(".weight").unwrap_or("");
        let quantize = tensor.ends_with("_proj.weight")
            && shape.len() == 2
            && !NOT_CONVERTED.contains(&module);
        if !quantize {
            fp8.insert(tensor.clone(), (dtype, shape.clone(), bytes.clone()));
            dequantized.insert(tensor, (dtype, shape, bytes));
            continue;
        }
        quantized += 1;
        let (rows, cols) = (shape[0], shape[1]);
        let values = f32s(&bytes);
        let (srows, scols) = (rows.div_ceil(block[0]), cols.div_ceil(block[1]));
        let mut scales = vec![0f32; srows * scols];
        for (i, scale) in scales.iter_mut().enumerate() {
            let (br, bc) = (i / scols, i % scols);
            let amax = (br * block[0]..((br + 1) * block[0]).min(rows))
                .flat_map(|r| (bc * block[1]..((bc + 1) * block[1]).min(cols)).map(move |c| (r, c)))
                .map(|(r, c)| values[r * cols + c].abs())
                .fold(0f32, f32::max);
            *scale = if amax > 0.0 { amax / 448.0 } else { 1.0 };
        }
        let scale_of = |r: usize, c: usize| scales[(r / block[0]) * scols + c / block[1]];
        let codes: Vec<u8> = (0..rows * cols)
            .map(|i| to_e4m3(values[i] / scale_of(i / cols, i % cols)))
            .collect();
        let restored: Vec<f32> = (0..rows * cols)
            .map(|i| e4m3_value(codes[i]) as f32 * scale_of(i / cols, i % cols))
            .collect();
        fp8.insert(tensor.clone(), (Dtype::F8_E4M3, shape.clone(), codes));
        fp8.insert(
            format!("{tensor}_scale_inv"),
            (Dtype::F32, vec![srows, scols], le_bytes(&scales)),
        );
        dequantized.insert(tensor, (Dtype::F32, shape, le_bytes(&restored)));
    }
    assert!(quantized > 5, "{name}: {quantized} weights quantized");
    let pair = Pair {
        fp8: root.join(format!("{name}-fp8")),
        dequantized: root.join(format!("{name}-dequantized")),
    };
    write_checkpoint(&pair.dequantized, &config, &dequantized);
    config["quantization_config"] = json!({
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": block,
        "modules_to_not_convert": NOT_CONVERTED,
    });
    write_checkpoint(&pair.fp8, &config, &fp8);
    pair
}

fn prompt(len: usize, seed: u32, vocab: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 40_503) >> 7) % vocab as u32)
        .collect()
}

/// The CPU model's logits for two prompts, every position.
fn cpu_logits(model: &MoeModel) -> Vec<f32> {
    let vocab = model.config().vocab_size;
    let (a, b) = (prompt(11, 1, vocab), prompt(5, 2, vocab));
    let (mut ca, mut cb) = (model.new_cache(), model.new_cache());
    let mut batch = [
        SequenceInput {
            tokens: &a,
            cache: &mut ca,
        },
        SequenceInput {
            tokens: &b,
            cache: &mut cb,
        },
    ];
    let logits = model.forward(&mut batch, LogitsFor::AllPositions).unwrap();
    logits.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

fn max_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

#[test]
fn the_e4m3_decoder_is_the_format() {
    for v in 0..=u8::MAX {
        let (got, want) = (e4m3_to_f32(v), e4m3_value(v) as f32);
        assert!(
            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
            "{v:#04x}: {got} vs {want}"
        );
    }
    assert_eq!(e4m3_to_f32(0x7e), 448.0);
    assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
    // The test's encoder picks the nearest value, ties to even.
    for v in (0..0x7eu8).filter(|v| v & 7 != 7 || v >> 3 != 15) {
        let (x, next) = (e4m3_value(v), e4m3_value(v + 1));
        assert_eq!(to_e4m3(x as f32), v);
        let middle = ((x + next) / 2.0) as f32;
        assert_eq!(
            to_e4m3(middle),
            if v % 2 == 0 { v } else { v + 1 },
            "{v:#04x}"
        );
        assert_eq!(to_e4m3(-(x as f32)), v | 0x80);
    }
}

#[test]
fn fp8_checkpoints_load_as_their_dequantized_weights_on_the_cpu() {
    let root = tempfile::tempdir().unwrap();
    for (name, block) in [
        ("qwen3_moe", [128, 128]),
        ("qwen3_moe", [16, 24]),
        ("deepseek_v3", [16, 24]),
    ] {
        let pair = quantized_pair(name, block, root.path());
        let config = ModelConfig::load(&pair.fp8).unwrap();
        assert_eq!(config.quantization.as_ref().unwrap().fp8_block(), block);
        let checkpoint = Checkpoint::open(&pair.fp8).unwrap();
        let model = MoeModel::from_checkpoint(config, &checkpoint).unwrap();
        assert_eq!(
            checkpoint.unused_tensors(),
            Vec::<&str>::new(),
            "{name}: every scale read"
        );
        let reference = MoeModel::load(&pair.dequantized).unwrap();
        let diff = max_difference(&cpu_logits(&model), &cpu_logits(&reference));
        assert!(diff <= 1e-4, "{name} {block:?}: logits differ by {diff}");
    }
}

#[cfg(feature = "cuda")]
mod device {
    use super::*;
    use rackfill_kernels::cuda::exec::available;
    use rackfill_models::gpu::{ExpertPlacement, GpuInput, GpuModel};

    fn gpu_logits(
        exec: std::sync::Arc<dyn rackfill_kernels::cuda::exec::Executor>,
        dir: &Path,
    ) -> Vec<f32> {
        let config = ModelConfig::load(dir).unwrap();
        let checkpoint = Checkpoint::open(dir).unwrap();
        let (gpu, _) =
            GpuModel::load(exec, &config, &checkpoint, 64, ExpertPlacement::Here).unwrap();
        let vocab = config.vocab_size;
        let (a, b) = (prompt(11, 1, vocab), prompt(5, 2, vocab));
        let (mut sa, mut sb) = (gpu.new_sequence(), gpu.new_sequence());
        let mut batch = [
            GpuInput {
                tokens: &a,
                sequence: &mut sa,
                logits: LogitsFor::AllPositions,
            },
            GpuInput {
                tokens: &b,
                sequence: &mut sb,
                logits: LogitsFor::AllPositions,
            },
        ];
        gpu.forward(&mut batch).unwrap().logits
    }

    #[test]
    fn fp8_checkpoints_dequantize_on_the_device_as_their_dequantized_weights() {
        let root = tempfile::tempdir().unwrap();
        // MLA (kv_b's absorbed halves), shared experts and a dense layer, in 16 x 24 blocks.
        let pair = quantized_pair("deepseek_v3", [16, 24], root.path());
        for exec in available() {
            let got = gpu_logits(exec.clone(), &pair.fp8);
            let want = gpu_logits(exec.clone(), &pair.dequantized);
            let diff = max_difference(&got, &want);
            eprintln!(
                "{}: fp8 against dequantized logits: {diff}",
                exec.describe()
            );
            assert!(diff <= 2e-3, "{}: logits differ by {diff}", exec.describe());
        }
    }

    #[test]
    fn a_missing_scale_fails_the_device_load_naming_the_tensor() {
        let root = tempfile::tempdir().unwrap();
        let pair = quantized_pair("qwen3_moe", [128, 128], root.path());
        let name = "model.layers.2.mlp.experts.3.down_proj.weight";
        let mut tensors = read_tensors(&pair.fp8.join("model.safetensors"));
        tensors.remove(&format!("{name}_scale_inv")).unwrap();
        let config_json: Value =
            serde_json::from_str(&std::fs::read_to_string(pair.fp8.join("config.json")).unwrap())
                .unwrap();
        let broken = root.path().join("broken");
        write_checkpoint(&broken, &config_json, &tensors);
        let config = ModelConfig::load(&broken).unwrap();
        let checkpoint = Checkpoint::open(&broken).unwrap();
        for exec in available() {
            let err = GpuModel::load(exec, &config, &checkpoint, 64, ExpertPlacement::Here)
                .err()
                .unwrap()
                .to_string();
            assert!(
                err.contains(name) && err.contains("_scale_inv") && !err.contains('\n'),
                "{err}"
            );
        }
    }
}

/// `quantized_pair(name, block)`'s FP8 checkpoint after `edit` (of its config and tensors),
/// loaded on the CPU: the error.
fn broken(name: &str, edit: impl FnOnce(&mut Value, &mut Tensors)) -> ModelError {
    let root = tempfile::tempdir().unwrap();
    let pair = quantized_pair(name, [128, 128], root.path());
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(pair.fp8.join("config.json")).unwrap())
            .unwrap();
    let mut tensors = read_tensors(&pair.fp8.join("model.safetensors"));
    edit(&mut config, &mut tensors);
    let dir = root.path().join("broken");
    write_checkpoint(&dir, &config, &tensors);
    let err = MoeModel::load(&dir).err().unwrap();
    assert!(!err.to_string().contains('\n'), "one line: {err}");
    err
}

#[test]
fn broken_fp8_checkpoints_fail_naming_the_tensor_or_field() {
    let weight = "model.layers.0.self_attn.q_proj.weight";
    let scale = "model.layers.0.self_attn.q_proj.weight_scale_inv";
    // A missing scale.
    let err = broken("qwen3_moe", |_, t| {
        t.remove(scale).unwrap();
    });
    assert!(matches!(err, ModelError::Quantization { .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains(weight) && text.contains("missing"), "{text}");
    // A scale of the wrong shape (per-tensor instead of per-block).
    let err = broken("qwen3_moe", |_, t| {
        t.insert(
            scale.into(),
            (Dtype::F32, vec![1], 1f32.to_le_bytes().to_vec()),
        );
    })
    .to_string();
    assert!(err.contains(scale) && err.contains("[1, 1]"), "{err}");
    // A scale of the wrong dtype.
    let err = broken("qwen3_moe", |_, t| {
        t.insert(scale.into(), (Dtype::BF16, vec![1, 1], vec![0x80, 0x3f]));
    })
    .to_string();
    assert!(err.contains(scale) && err.contains("BF16"), "{err}");
    // FP8 tensors without a quantization_config.
    let err = broken("qwen3_moe", |c, _| {
        c.as_object_mut().unwrap().remove("quantization_config");
    })
    .to_string();
    assert!(
        err.contains("F8_E4M3") && err.contains("quantization_config"),
        "{err}"
    );
    // Another FP8 format in the file than the config declares.
    let err = broken("qwen3_moe", |_, t| {
        t.get_mut(weight).unwrap().0 = Dtype::F8_E5M2;
    })
    .to_string();
    assert!(err.contains(weight) && err.contains("F8_E5M2"), "{err}");
}

#[test]
fn quantization_configs_other_than_block_fp8_e4m3_are_refused_naming_the_field() {
    let base: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("qwen3_moe").join("config.json")).unwrap(),
    )
    .unwrap();
    let parse = |q: Value| {
        let mut config = base.clone();
        config["quantization_config"] = q;
        ModelConfig::from_json_str(&config.to_string(), Path::new("config.json"))
    };
    let ok = parse(json!({"quant_method": "fp8", "weight_block_size": [128, 64]})).unwrap();
    assert_eq!(
        ok.quantization.unwrap().fp8_block(),
        [128, 64],
        "fmt defaults to e4m3"
    );
    assert!(parse(Value::Null).unwrap().quantization.is_none());
    for (q, field) in [
        (
            json!({"quant_method": "awq", "weight_block_size": [128, 128]}),
            "quant_method",
        ),
        (json!({"weight_block_size": [128, 128]}), "quant_method"),
        (
            json!({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}),
            "quantization_config.fmt",
        ),
        (json!({"quant_method": "fp8"}), "weight_block_size"),
        (
            json!({"quant_method": "fp8", "weight_block_size": [128]}),
            "weight_block_size",
        ),
        (
            json!({"quant_method": "fp8", "weight_block_size": [0, 128]}),
            "weight_block_size",
        ),
        (
            json!({"quant_method": "fp8", "weight_block_size": [128, "a"]}),
            "weight_block_size",
        ),
        (
            json!({"quant_method": "fp8", "weight_block_size": [1, 2, 3]}),
            "weight_block_size",
        ),
        (json!("fp8"), "quantization_config"),
        (
            json!({"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": [1]}),
            "modules_to_not_convert",
        ),
    ] {
        let err = parse(q.clone()).err().unwrap().to_string();
        assert!(
            err.contains(field) && !err.contains('\n'),
            "{q}: {err} (should name {field})"
        );
    }
}
