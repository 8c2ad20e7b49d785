//! The whole-model path's dense kernels (kernels/cuda/model.cu), run through the host emulator,
//! against the CPU layers of this crate on the shapes of the conformance fixtures, the built-in
//! model's real bf16 weights, and a few larger random shapes.
//!
//! Tolerances (what each test asserts; the kernels are written to reproduce the CPU operation by
//! operation, so most comparisons are exact):
//! - embedding, bf16 conversions and gathers, residual / bias adds, the weighted top-k combine,
//!   `silu(gate) * up` to bf16 and RoPE: bit for bit. RoPE computes its angle in f32 and cos /
//!   sin in double rounded once, as `Rope::tables` does; silu uses fastmath.rs's own `exp`.
//! - RMSNorm to bf16: `|gpu - cpu| <= 2^-8 |cpu| + 1e-6` (the sum of squares is a tree here,
//!   sequential on the CPU; the bf16 rounding of the output is at most 2^-9 relative).
//! - RMSNorm in place (f32): `|gpu - cpu| <= 1e-6 |cpu| + 1e-7`.
//! - The sigmoid row scale: `|gpu - cpu| <= 2^-22 |cpu|` (e^x in double rounded once against
//!   glibc's expf, which is within 0.502 ulp).
//! - Routers: the same expert ids in the same order, weights within 1e-6.
//!
//! Without a C++ compiler every test prints why and passes.

#![cfg(feature = "cuda")]

use std::path::{Path, PathBuf};

use candle_core::{Device, Module, Tensor};
use rackfill_kernels::cuda::exec::{
    round_bf16, DeviceBuffer, Emulator, Executor, ExecutorExt, KernelArg, Launch,
};
use rackfill_models::layers::RmsNorm;
use rackfill_models::{Checkpoint, ModelConfig, MoeModel};
use safetensors::Dtype;

/// Threads per block: what the whole-model path launches with.
const BLOCK: u32 = 128;

/// The emulator and typed helpers around it; `None` (printed why) without a C++ compiler.
struct Dev(std::sync::Arc<Emulator>);

impl Dev {
    fn get() -> Option<Self> {
        Emulator::shared().map(Dev)
    }

    fn f32(&self, v: &[f32]) -> DeviceBuffer {
        self.0.upload_f32(v).unwrap()
    }

    fn bf16(&self, v: &[f32]) -> DeviceBuffer {
        self.0.upload_bf16(v).unwrap()
    }

    fn u32(&self, v: &[u32]) -> DeviceBuffer {
        self.0.upload_u32(v).unwrap()
    }

    fn zeros(&self, bytes: usize) -> DeviceBuffer {
        self.0.alloc_zeroed(bytes).unwrap()
    }

    fn read_f32(&self, b: &DeviceBuffer) -> Vec<f32> {
        self.0.download_f32(b).unwrap()
    }

    fn read_bf16(&self, b: &DeviceBuffer) -> Vec<f32> {
        self.0.download_bf16(b).unwrap()
    }

    fn read_u32(&self, b: &DeviceBuffer) -> Vec<u32> {
        self.0.download_u32(b).unwrap()
    }

    /// Launches `kernel` on `grid` blocks of [`BLOCK`] threads. Grids smaller than the row
    /// count exercise the kernels' grid-stride loops.
    fn run(&self, kernel: &str, grid: usize, args: &[KernelArg]) {
        let launch = Launch::blocks(grid.clamp(1, 8) as u32, BLOCK);
        // SAFETY: every caller passes the parameters model.cu declares for `kernel`, on buffers
        // at least as large as the shapes it passes.
        unsafe { self.0.launch(kernel, launch, args) }.unwrap_or_else(|e| panic!("{kernel}: {e}"));
    }
}

fn p(b: &DeviceBuffer) -> KernelArg {
    KernelArg::from(b)
}

fn u(v: usize) -> KernelArg {
    KernelArg::U32(u32::try_from(v).unwrap())
}

/// SplitMix64: reproducible inputs without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[-scale, scale)`.
    fn f32(&mut self, scale: f32) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
    }

    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f32(scale)).collect()
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn builtin() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("builtin")
}

const FIXTURES: [&str; 8] = [
    "qwen3_moe",
    "qwen3_moe_attnbias",
    "qwen3_moe_nonorm",
    "qwen2_moe",
    "mixtral",
    "deepseek_v3",
    "deepseek_v3_noqlora",
    "deepseek_v3_linear_eps",
];

/// A checkpoint in memory: `(name, shape, values, dtype)`, values rounded to the dtype.
fn checkpoint(tensors: &[(&str, Vec<usize>, Vec<f32>, Dtype)]) -> Checkpoint {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, values, dtype)| match dtype {
            Dtype::BF16 => values
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                .collect(),
            _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, shape, _, dtype), bytes)| {
            let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes);
            (name.to_string(), view.unwrap())
        })
        .collect();
    Checkpoint::from_bytes("<gpu_layers>", safetensors::serialize(views, None).unwrap()).unwrap()
}

/// An RmsNorm of `dim` with random bf16 weights, and those weights.
fn random_norm(rng: &mut Rng, dim: usize, eps: f64) -> (RmsNorm, Vec<f32>) {
    let weight: Vec<f32> = (0..dim).map(|_| round_bf16(1.0 + rng.f32(0.5))).collect();
    let ckpt = checkpoint(&[("norm.weight", vec![dim], weight.clone(), Dtype::BF16)]);
    (
        RmsNorm::load(&ckpt.root().pp("norm"), dim, eps).unwrap(),
        weight,
    )
}

fn cpu_rows(norm: &RmsNorm, x: &[f32], rows: usize, dim: usize) -> Vec<f32> {
    let t = Tensor::from_vec(x.to_vec(), (rows, dim), &Device::Cpu).unwrap();
    norm.forward(&t)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Largest `|a - b| / (|b| + floor)`, asserting each is within `rel * |b| + abs`.
fn check_close(what: &str, got: &[f32], want: &[f32], rel: f32, abs: f32) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = 0f32;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        assert!(err <= rel * w.abs() + abs, "{what}[{i}]: {g} vs {w}");
        worst = worst.max(err / w.abs().max(abs / rel));
    }
    worst
}

fn assert_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{what}[{i}]: {g} vs {w}");
    }
}

#[test]
fn embedding_rows_are_the_models_embeddings() {
    let Some(dev) = Dev::get() else { return };
    let model = MoeModel::load(&builtin()).unwrap();
    let (vocab, hidden) = (model.config().vocab_size, model.config().hidden_size);
    let table = Checkpoint::open(&builtin())
        .unwrap()
        .tensor("model.embed_tokens.weight", &[vocab, hidden])
        .unwrap();
    let table = dev.bf16(&table.flatten_all().unwrap().to_vec1::<f32>().unwrap());
    let mut rng = Rng(1);
    let ids: Vec<u32> = [0, vocab - 1]
        .into_iter()
        .chain((0..37).map(|_| rng.below(vocab)))
        .map(|i| i as u32)
        .collect();
    let out = dev.zeros(ids.len() * hidden * 4);
    let id_buf = dev.u32(&ids);
    let args = [p(&table), p(&id_buf), u(ids.len()), u(hidden), p(&out)];
    dev.run("embed_rows", ids.len(), &args);
    let want = model.embed(&ids).unwrap().flatten_all().unwrap();
    assert_bits("embed_rows", &dev.read_f32(&out), &want.to_vec1().unwrap());
}

#[test]
fn rms_norm_to_bf16_matches_rmsnorm() {
    let Some(dev) = Dev::get() else { return };
    let mut rng = Rng(2);
    // (rows, dim, x_stride, out_stride, eps): the fixtures' hidden size and DeepSeek's latent
    // norms (the first kv_lora_rank columns of kv_a's rows), then larger random shapes.
    let mut cases = vec![
        (9, 64, 64, 64, 1e-6),
        (5, 32, 40, 32, 1e-6),
        (5, 16, 24, 20, 1e-6),
    ];
    cases.extend([(3, 7168, 7168, 7168, 1e-6), (4, 4099, 4200, 4100, 1e-5)]);
    cases.push((6, 128, 128, 128, 1e-6));
    let mut worst = 0f32;
    for (rows, dim, x_stride, out_stride, eps) in cases {
        let (norm, weight) = random_norm(&mut rng, dim, eps);
        let x: Vec<f32> = (0..rows * x_stride)
            .map(|i| rng.f32(if i % 3 == 0 { 40.0 } else { 1.0 }))
            .collect();
        let dense: Vec<f32> = x.chunks(x_stride).flat_map(|r| r[..dim].to_vec()).collect();
        let want = cpu_rows(&norm, &dense, rows, dim);
        let (xb, wb) = (dev.f32(&x), dev.bf16(&weight));
        let out = dev.zeros(rows * out_stride * 2);
        let args = [
            p(&xb),
            u(x_stride),
            p(&wb),
            KernelArg::F32(eps as f32),
            u(rows),
            u(dim),
            p(&out),
            u(out_stride),
        ];
        dev.run("rms_norm_to_bf16", rows, &args);
        let got: Vec<f32> = dev
            .read_bf16(&out)
            .chunks(out_stride)
            .flat_map(|r| r[..dim].to_vec())
            .collect();
        worst = worst.max(check_close(
            "rms_norm_to_bf16",
            &got,
            &want,
            2f32.powi(-8),
            1e-6,
        ));
    }
    eprintln!("rms_norm_to_bf16: max relative error {worst:e}");
}

#[test]
fn rms_norm_inplace_matches_the_builtin_models_qk_norms() {
    let Some(dev) = Dev::get() else { return };
    let config = ModelConfig::load(&builtin()).unwrap();
    let ckpt = Checkpoint::open(&builtin()).unwrap();
    let d = config.head_dim;
    let mut rng = Rng(3);
    let mut worst = 0f32;
    for (name, heads) in [
        ("q_norm", config.num_heads),
        ("k_norm", config.num_kv_heads),
    ] {
        let w = ckpt.root().pp(format!("model.layers.1.self_attn.{name}"));
        let norm = RmsNorm::load(&w, d, config.rms_norm_eps).unwrap();
        let weight = w.get(&[d], "weight").unwrap().to_vec1::<f32>().unwrap();
        let rows = 13 * heads;
        let x = rng.vec(rows * d, 3.0);
        let buf = dev.f32(&x);
        let wb = dev.bf16(&weight);
        let eps = KernelArg::F32(config.rms_norm_eps as f32);
        let args = [p(&buf), u(d), p(&wb), eps, u(rows), u(d)];
        dev.run("rms_norm_inplace", rows, &args);
        let want = cpu_rows(&norm, &x, rows, d);
        worst = worst.max(check_close(name, &dev.read_f32(&buf), &want, 1e-6, 1e-7));
    }
    // A wide head_dim and a stride wider than the normalised columns.
    let (rows, dim, stride) = (7, 256, 300);
    let (norm, weight) = random_norm(&mut rng, dim, 1e-5);
    let x = rng.vec(rows * stride, 2.0);
    let (buf, wb) = (dev.f32(&x), dev.bf16(&weight));
    let args = [
        p(&buf),
        u(stride),
        p(&wb),
        KernelArg::F32(1e-5),
        u(rows),
        u(dim),
    ];
    dev.run("rms_norm_inplace", rows, &args);
    let got = dev.read_f32(&buf);
    let dense =
        |v: &[f32]| -> Vec<f32> { v.chunks(stride).flat_map(|r| r[..dim].to_vec()).collect() };
    let want = cpu_rows(&norm, &dense(&x), rows, dim);
    worst = worst.max(check_close(
        "rms_norm_inplace",
        &dense(&got),
        &want,
        1e-6,
        1e-7,
    ));
    let untouched =
        |v: &[f32]| -> Vec<f32> { v.chunks(stride).flat_map(|r| r[dim..].to_vec()).collect() };
    assert_bits("columns beyond dim", &untouched(&got), &untouched(&x));
    eprintln!("rms_norm_inplace: max relative error {worst:e}");
}

#[path = "gpu_layers/elementwise.rs"]
mod elementwise;
#[path = "gpu_layers/rope.rs"]
mod rope;
#[path = "gpu_layers/routers.rs"]
mod routers;
