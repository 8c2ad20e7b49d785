//! `GpuModel::load` from the checkpoint straight to the device, on the host emulator (whose
//! byte counter sees every host-to-device copy): every dense tensor is written once, each local
//! rank's home experts are written once each at their offsets in `HomeExperts` (byte for byte
//! from a bf16 checkpoint, rounded once on the device from f32 and f16 ones, per-expert and fused
//! layouts alike), no other expert is read, and two processes of one EP layout each write only
//! their own. Needs a C++ compiler for the emulator; without one it says so and passes.

#![cfg(feature = "cuda")]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rackfill_balancer::Layout;
use rackfill_kernels::cuda::exec::{f32_to_bf16, Emulator, EmulatorSettings, Executor};
use rackfill_kernels::cuda::moe::{expert_bytes, HomeExperts};
use rackfill_models::checkpoint::RawTensor;
use rackfill_models::gpu::{ExpertPlacement, Experts, GpuModel};
use rackfill_models::{Checkpoint, ModelConfig};
use safetensors::{Dtype, SafeTensors};

fn models_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn fixture(name: &str) -> PathBuf {
    match name {
        "builtin" => models_dir().join("builtin"),
        _ => models_dir().join("tests/fixtures").join(name),
    }
}

/// A fresh emulator with its own byte counter (the shared one counts every test's uploads).
fn emulator() -> Option<Arc<Emulator>> {
    let shared = Emulator::shared()?;
    Some(Arc::new(shared.with_settings(EmulatorSettings::default())))
}

/// Every tensor of a checkpoint file, as `(dtype, shape, bytes)` by name.
type Tensors = BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

fn read_tensors(dir: &Path) -> Tensors {
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<PathBuf> = if index.is_file() {
        let text = std::fs::read_to_string(&index).unwrap();
        let value: serde_json::Value = serde_json::from_str(&text).unwrap();
        let mut names: Vec<String> = value["weight_map"]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_str().unwrap().to_string())
            .collect();
        names.sort();
        names.dedup();
        names.into_iter().map(|n| dir.join(n)).collect()
    } else {
        vec![dir.join("model.safetensors")]
    };
    let mut tensors = Tensors::new();
    for file in files {
        let bytes = std::fs::read(file).unwrap();
        let parsed = SafeTensors::deserialize(&bytes).unwrap();
        for (name, view) in parsed.tensors() {
            let value = (view.dtype(), view.shape().to_vec(), view.data().to_vec());
            tensors.insert(name, value);
        }
    }
    tensors
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

/// `Some(e)` for a routed expert's tensor (`...mlp.experts.{e}.*` or
/// `...block_sparse_moe.experts.{e}.*`), `None` for every other tensor.
fn routed_expert(name: &str) -> Option<u32> {
    name.split_once(".experts.")
        .and_then(|(_, rest)| rest.split('.').next()?.parse().ok())
}

/// Bytes the host writes for the rotary tables: f32 inverse frequencies, one table a layer.
fn rope_bytes(config: &ModelConfig) -> u64 {
    let rot = match &config.mla {
        Some(mla) => mla.qk_rope_head_dim,
        None => config.head_dim,
    };
    (config.num_layers * rot / 2 * 4) as u64
}

/// Bytes of the expert weight tables a model holding every routed expert uploads (one
/// `(gate_up, down)` address pair per expert and MoE layer, `cuda::local_experts`): the one
/// upload that is not checkpoint bytes.
fn expert_table_bytes(config: &ModelConfig) -> u64 {
    (config.num_sparse_layers() * config.moe.num_experts * 16) as u64
}

/// An EP layout over `experts` experts whose homes are not contiguous runs: rank 1 homes every
/// third expert, rank 0 the rest.
fn interleaved(experts: usize) -> Layout {
    let home = (0..experts).map(|e| u32::from(e % 3 == 1)).collect();
    Layout::with_home(2, home, 1).unwrap()
}

/// The device-layout bytes of expert `e` of layer `at`: gate rows, up rows, down rows, each value rounded once to bf16 (byte for byte when stored bf16).
fn expected_expert(checkpoint: &Checkpoint, config: &ModelConfig, at: usize, e: u32) -> Vec<u8> {
    let (h, i) = (config.hidden_size, config.moe.intermediate_size);
    let prefix = |part: &str| {
        let block = format!("model.layers.{at}.block_sparse_moe.experts.{e}.{part}.weight");
        if checkpoint.contains(&block) {
            block
        } else {
            format!("model.layers.{at}.mlp.experts.{e}.{part}.weight")
        }
    };
    // Gate, up, down.
    let names = if checkpoint.contains(&prefix("w1")) {
        ["w1", "w3", "w2"]
    } else {
        ["gate_proj", "up_proj", "down_proj"]
    };
    let mut out = Vec::new();
    for (part, shape) in names.into_iter().zip([[i, h], [i, h], [h, i]]) {
        let raw: RawTensor<'_> = checkpoint.raw(&prefix(part), &shape).unwrap();
        if raw.dtype == Dtype::BF16 {
            out.extend_from_slice(raw.bytes);
        } else {
            out.extend(
                raw.to_f32()
                    .iter()
                    .flat_map(|&v| f32_to_bf16(v).to_le_bytes()),
            );
        }
    }
    out
}

/// Every local rank's home experts in `homes` are the checkpoint's (rounded to bf16), at their
/// offsets.
fn check_homes(
    what: &str,
    exec: &dyn Executor,
    homes: &HomeExperts,
    layout: &Layout,
    local: std::ops::Range<usize>,
    checkpoint: &Checkpoint,
    config: &ModelConfig,
) {
    let bytes = expert_bytes(config.hidden_size, config.moe.intermediate_size);
    assert_eq!(homes.expert_bytes, bytes);
    assert_eq!(
        homes.buffers.len(),
        local.len(),
        "{what}: one buffer a local rank"
    );
    let moe_layers: Vec<usize> = (0..config.num_layers)
        .filter(|&l| config.sparse_layers[l])
        .collect();
    for (index, rank) in local.enumerate() {
        let mains = layout.main_experts(rank);
        assert_eq!(
            homes.buffers[index].bytes(),
            moe_layers.len() * mains.len() * bytes,
            "{what}: rank {rank}'s buffer"
        );
        for (l, &at) in moe_layers.iter().enumerate() {
            for &e in mains {
                let mut got = vec![0u8; bytes];
                let offset = homes.offsets[l][e as usize] as usize;
                exec.read(&homes.buffers[index], offset, &mut got).unwrap();
                assert!(
                    got == expected_expert(checkpoint, config, at, e),
                    "{what}: layer {at} expert {e} on rank {rank}"
                );
            }
        }
    }
}

/// Bytes of the checkpoint's tensors that are not routed experts, and of the routed experts
/// `wanted` says.
fn tensor_bytes(tensors: &Tensors, wanted: impl Fn(u32) -> bool) -> (u64, u64) {
    let (mut dense, mut experts) = (0u64, 0u64);
    for (name, (_, _, bytes)) in tensors {
        match routed_expert(name) {
            None => dense += bytes.len() as u64,
            Some(e) if wanted(e) => experts += bytes.len() as u64,
            Some(_) => {}
        }
    }
    (dense, experts)
}

/// The built-in model's routed experts that no rank of `local` homes rewritten as I32 (same
/// shapes), a dtype the loader refuses: a load that reads any of their bytes fails.
fn poisoned_builtin(layout: &Layout, local: std::ops::Range<usize>) -> Checkpoint {
    let mut tensors = read_tensors(&fixture("builtin"));
    for (name, (dtype, shape, bytes)) in tensors.iter_mut() {
        if routed_expert(name).is_some_and(|e| !local.contains(&layout.home(e as usize))) {
            *dtype = Dtype::I32;
            *bytes = vec![0; shape.iter().product::<usize>() * 4];
        }
    }
    Checkpoint::from_bytes("<poisoned builtin>", serialize(&tensors)).unwrap()
}

#[test]
fn each_process_writes_the_dense_weights_and_its_own_home_experts_once() {
    let Some(_) = emulator() else {
        return;
    };
    let dir = fixture("builtin");
    let config = ModelConfig::load(&dir).unwrap();
    let tensors = read_tensors(&dir);
    let layout = interleaved(config.moe.num_experts);
    // Two processes of a 2-rank EP group, and one process holding both ranks.
    for local in [0..1, 1..2, 0..2] {
        let exec = emulator().unwrap();
        let checkpoint = poisoned_builtin(&layout, local.clone());
        let placement = ExpertPlacement::Homes {
            layout: &layout,
            local: local.clone(),
        };
        let (gpu, homes) =
            GpuModel::load(exec.clone(), &config, &checkpoint, 64, placement).unwrap();
        let homes = homes.expect("home experts");
        assert_eq!(gpu.experts(), Experts::Elsewhere);
        let (dense, mine) = tensor_bytes(&tensors, |e| local.contains(&layout.home(e as usize)));
        assert_eq!(
            exec.bytes_uploaded(),
            dense + mine + rope_bytes(&config),
            "local ranks {local:?}: the dense tensors and the home experts, once each"
        );
        // bf16 checkpoint: every expert byte for byte, at its offset.
        check_homes(
            &format!("ranks {local:?}"),
            exec.as_ref(),
            &homes,
            &layout,
            local.clone(),
            &checkpoint,
            &config,
        );
        assert_eq!(
            checkpoint.unused_tensors(),
            Vec::<&str>::new(),
            "other experts are skipped, not unused"
        );
    }
    // EP 1: one rank homing every expert.
    let exec = emulator().unwrap();
    let checkpoint = Checkpoint::open(&dir).unwrap();
    let single = Layout::contiguous(1, config.moe.num_experts, 0).unwrap();
    let placement = ExpertPlacement::Homes {
        layout: &single,
        local: 0..1,
    };
    let (_, homes) = GpuModel::load(exec.clone(), &config, &checkpoint, 64, placement).unwrap();
    let (dense, all) = tensor_bytes(&tensors, |_| true);
    assert_eq!(exec.bytes_uploaded(), dense + all + rope_bytes(&config));
    let homes = homes.unwrap();
    let what = "EP 1";
    check_homes(
        what,
        exec.as_ref(),
        &homes,
        &single,
        0..1,
        &checkpoint,
        &config,
    );
    // Every expert inside the model, and none.
    for (placement, experts) in [
        (ExpertPlacement::Here, all + expert_table_bytes(&config)),
        (ExpertPlacement::Elsewhere, 0),
    ] {
        let exec = emulator().unwrap();
        let (gpu, homes) =
            GpuModel::load(exec.clone(), &config, &checkpoint, 64, placement).unwrap();
        assert!(homes.is_none());
        assert_eq!(
            exec.bytes_uploaded(),
            dense + experts + rope_bytes(&config),
            "{:?}",
            gpu.experts()
        );
    }
}

#[test]
fn home_experts_of_f32_and_f16_checkpoints_are_rounded_once_on_the_device() {
    let Some(_) = emulator() else {
        return;
    };
    // f32 (with shared experts and dense layers), f16 in three shards with Mixtral's names.
    for name in ["qwen3_moe", "deepseek_v3", "mixtral"] {
        let dir = fixture(name);
        let config = ModelConfig::load(&dir).unwrap();
        let checkpoint = Checkpoint::open(&dir).unwrap();
        let layout = interleaved(config.moe.num_experts);
        let exec = emulator().unwrap();
        let placement = ExpertPlacement::Homes {
            layout: &layout,
            local: 1..2,
        };
        let (_, homes) = GpuModel::load(exec.clone(), &config, &checkpoint, 64, placement).unwrap();
        let tensors = read_tensors(&dir);
        let (dense, mine) = tensor_bytes(&tensors, |e| layout.home(e as usize) == 1);
        assert_eq!(
            exec.bytes_uploaded(),
            dense + mine + rope_bytes(&config),
            "{name}: the stored bytes, converted on the device"
        );
        let homes = homes.unwrap();
        check_homes(
            name,
            exec.as_ref(),
            &homes,
            &layout,
            1..2,
            &checkpoint,
            &config,
        );
    }
}

#[test]
fn fused_expert_tensors_fill_the_same_home_experts() {
    let Some(_) = emulator() else {
        return;
    };
    // The qwen3_moe fixture rewritten in the fused layout: `experts.gate_up_proj` [E, 2I, H]
    // (gate rows then up rows) and `experts.down_proj` [E, H, I].
    let dir = fixture("qwen3_moe");
    let config = ModelConfig::load(&dir).unwrap();
    let (e, i, h) = (
        config.moe.num_experts,
        config.moe.intermediate_size,
        config.hidden_size,
    );
    let mut tensors = read_tensors(&dir);
    for layer in (0..config.num_layers).filter(|&l| config.sparse_layers[l]) {
        let prefix = format!("model.layers.{layer}.mlp.experts");
        let mut take = |expert: usize, part: &str| {
            let name = format!("{prefix}.{expert}.{part}.weight");
            tensors.remove(&name).unwrap().2
        };
        let (mut gate_up, mut down) = (Vec::new(), Vec::new());
        for expert in 0..e {
            gate_up.extend(take(expert, "gate_proj"));
            gate_up.extend(take(expert, "up_proj"));
            down.extend(take(expert, "down_proj"));
        }
        let fused = (Dtype::F32, vec![e, 2 * i, h], gate_up);
        tensors.insert(format!("{prefix}.gate_up_proj"), fused);
        tensors.insert(
            format!("{prefix}.down_proj"),
            (Dtype::F32, vec![e, h, i], down),
        );
    }
    let fused = Checkpoint::from_bytes("<fused qwen3_moe>", serialize(&tensors)).unwrap();
    let per_expert = Checkpoint::open(&dir).unwrap();
    let layout = interleaved(e);
    let mut contents = Vec::new();
    for checkpoint in [&fused, &per_expert] {
        let exec = emulator().unwrap();
        let placement = ExpertPlacement::Homes {
            layout: &layout,
            local: 0..2,
        };
        let (_, homes) = GpuModel::load(exec.clone(), &config, checkpoint, 64, placement).unwrap();
        let homes = homes.unwrap();
        let buffers: Vec<Vec<u8>> = homes
            .buffers
            .iter()
            .map(|b| {
                let mut bytes = vec![0u8; b.bytes()];
                exec.read(b, 0, &mut bytes).unwrap();
                bytes
            })
            .collect();
        contents.push((buffers, exec.bytes_uploaded()));
    }
    assert!(contents[0] == contents[1], "fused and per-expert tensors");
    assert_eq!(fused.unused_tensors(), Vec::<&str>::new());
}

#[test]
fn a_layout_of_another_expert_count_is_refused() {
    let Some(exec) = emulator() else {
        return;
    };
    let dir = fixture("qwen3_moe");
    let config = ModelConfig::load(&dir).unwrap();
    let checkpoint = Checkpoint::open(&dir).unwrap();
    let layout = Layout::contiguous(2, config.moe.num_experts + 1, 0).unwrap();
    let placement = ExpertPlacement::Homes {
        layout: &layout,
        local: 0..1,
    };
    let err = GpuModel::load(exec.clone(), &config, &checkpoint, 64, placement)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("9 experts") && err.contains("of 8"), "{err}");
    assert_eq!(exec.bytes_uploaded(), 0, "refused before any upload");
}
