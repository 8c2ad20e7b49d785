//! The router kernels against `Router::select` (router.rs): the same experts in the same order,
//! weights within 1e-6, on every fixture's router, the built-in model's, and larger ones, with
//! rows built to tie (quantised logits, all equal, underflowing softmax).

use super::*;
use rackfill_models::config::{MoeConfig, RouterKind};
use rackfill_models::layers::router::Router;

/// Width of the routers' (unused) gate weight: the tests feed logits directly.
const HIDDEN: usize = 4;

/// A router for `moe` loaded from an in-memory checkpoint, and its correction bias (sigmoid
/// routers: `bias_offset` plus small noise).
fn random_router(moe: &MoeConfig, rng: &mut Rng, bias_offset: f32) -> (Router, Option<Vec<f32>>) {
    let e = moe.num_experts;
    let weight = rng.vec(e * HIDDEN, 1.0);
    let mut tensors = vec![("gate.weight", vec![e, HIDDEN], weight, Dtype::BF16)];
    let bias = matches!(moe.router, RouterKind::SigmoidGrouped { .. }).then(|| {
        rng.vec(e, 0.05)
            .iter()
            .map(|b| b + bias_offset)
            .collect::<Vec<f32>>()
    });
    if let Some(b) = &bias {
        tensors.push((
            "gate.e_score_correction_bias",
            vec![e],
            b.clone(),
            Dtype::F32,
        ));
    }
    let ckpt = checkpoint(&tensors);
    (
        Router::load(&ckpt.root().pp("gate"), HIDDEN, moe).unwrap(),
        bias,
    )
}

/// Random rows, then rows that tie: logits on a coarse grid, all equal, one dominant (the
/// others' softmax underflows to 0), all very negative.
fn logits(rng: &mut Rng, experts: usize) -> Vec<f32> {
    let mut rows: Vec<Vec<f32>> = (0..12).map(|_| rng.vec(experts, 4.0)).collect();
    rows.extend((0..4).map(|_| {
        (0..experts)
            .map(|_| (rng.f32(2.0) * 2.0).round() / 2.0)
            .collect()
    }));
    rows.push(vec![0.25; experts]);
    let mut dominant = vec![-80.0; experts];
    dominant[experts / 2] = 80.0;
    rows.push(dominant);
    rows.push(rng.vec(experts, 1.0).iter().map(|l| l - 100.0).collect());
    rows.concat()
}

/// Runs the router kernel for `moe` (with `bias`, or a null bias pointer) and compares with
/// `router`; returns the largest weight difference.
fn check(
    dev: &Dev,
    what: &str,
    moe: &MoeConfig,
    router: &Router,
    bias: Option<&[f32]>,
    rng: &mut Rng,
) -> f32 {
    let (e, k) = (moe.num_experts, moe.top_k);
    let x = logits(rng, e);
    let rows = x.len() / e;
    let want = router.select(&x);
    let (lb, ids, weights) = (
        dev.f32(&x),
        dev.zeros(rows * k * 4),
        dev.zeros(rows * k * 4),
    );
    match moe.router {
        RouterKind::SoftmaxTopK { norm_topk_prob } => {
            let norm = u(usize::from(norm_topk_prob));
            let args = [p(&lb), u(rows), u(e), u(k), norm, p(&ids), p(&weights)];
            dev.run("router_softmax_topk", rows, &args);
        }
        RouterKind::SigmoidGrouped {
            n_group,
            topk_group,
            norm_topk_prob,
            routed_scaling_factor,
        } => {
            let bias_buf = bias.map(|b| dev.f32(b));
            let args = [
                p(&lb),
                bias_buf.as_ref().map_or(KernelArg::Ptr(0), p),
                u(rows),
                u(e),
                u(n_group),
                u(topk_group),
                u(k),
                u(usize::from(norm_topk_prob)),
                KernelArg::F32(routed_scaling_factor),
                p(&ids),
                p(&weights),
            ];
            dev.run("router_sigmoid_grouped_topk", rows, &args);
        }
    }
    let got_ids = dev.read_u32(&ids);
    for (r, (g, w)) in got_ids.chunks(k).zip(want.experts.chunks(k)).enumerate() {
        assert_eq!(
            g,
            w,
            "{what}: row {r} experts (logits {:?})",
            &x[r * e..(r + 1) * e]
        );
    }
    let got = dev.read_f32(&weights);
    let mut worst = 0f32;
    for (i, (g, w)) in got.iter().zip(&want.weights).enumerate() {
        let err = (g - w).abs();
        assert!(err <= 1e-6, "{what}: weight {i}: {g} vs {w}");
        worst = worst.max(err);
    }
    worst
}

#[test]
fn routers_select_the_cpu_experts_and_weights() {
    let Some(dev) = Dev::get() else { return };
    let mut rng = Rng(9);
    let mut worst = 0f32;
    for name in FIXTURES {
        let moe = ModelConfig::load(&fixture(name)).unwrap().moe;
        let (router, bias) = random_router(&moe, &mut rng, 0.0);
        worst = worst.max(check(&dev, name, &moe, &router, bias.as_deref(), &mut rng));
    }
    // The built-in model's own gate.
    let config = ModelConfig::load(&builtin()).unwrap();
    let ckpt = Checkpoint::open(&builtin()).unwrap();
    let gate = ckpt.root().pp("model.layers.0.mlp.gate");
    let router = Router::load(&gate, config.hidden_size, &config.moe).unwrap();
    worst = worst.max(check(&dev, "builtin", &config.moe, &router, None, &mut rng));

    let moe = |num_experts, top_k, router| MoeConfig {
        num_experts,
        top_k,
        intermediate_size: 32,
        router,
        shared: None,
    };
    let sigmoid =
        |n_group, topk_group, norm_topk_prob, routed_scaling_factor| RouterKind::SigmoidGrouped {
            n_group,
            topk_group,
            norm_topk_prob,
            routed_scaling_factor,
        };
    let cases = [
        // Qwen3-MoE-235B, Qwen2-MoE-57B, DeepSeek-V3.
        (
            moe(
                128,
                8,
                RouterKind::SoftmaxTopK {
                    norm_topk_prob: true,
                },
            ),
            0.0,
        ),
        (
            moe(
                60,
                4,
                RouterKind::SoftmaxTopK {
                    norm_topk_prob: false,
                },
            ),
            0.0,
        ),
        (moe(256, 8, sigmoid(8, 4, true, 2.5)), 0.0),
        // The kept groups hold fewer than k experts, and with a negative bias the other groups'
        // zeroed experts outrank them.
        (moe(8, 4, sigmoid(4, 1, false, 1.0)), 0.0),
        (moe(8, 3, sigmoid(4, 2, true, 1.5)), -2.0),
        (moe(6, 2, sigmoid(1, 1, true, 1.0)), 0.5),
    ];
    for (i, (moe, offset)) in cases.iter().enumerate() {
        let (router, bias) = random_router(moe, &mut rng, *offset);
        worst = worst.max(check(
            &dev,
            &format!("case {i}"),
            moe,
            &router,
            bias.as_deref(),
            &mut rng,
        ));
    }
    // No correction bias: a null pointer, against a zero bias on the CPU.
    let moe = moe(16, 4, sigmoid(4, 2, true, 1.0));
    let ckpt = checkpoint(&[
        (
            "gate.weight",
            vec![16, HIDDEN],
            rng.vec(16 * HIDDEN, 1.0),
            Dtype::BF16,
        ),
        (
            "gate.e_score_correction_bias",
            vec![16],
            vec![0.0; 16],
            Dtype::F32,
        ),
    ]);
    let router = Router::load(&ckpt.root().pp("gate"), HIDDEN, &moe).unwrap();
    worst = worst.max(check(&dev, "null bias", &moe, &router, None, &mut rng));
    eprintln!("routers: max weight difference {worst:e}");
}
