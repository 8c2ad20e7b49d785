//! The element-wise kernels against the CPU operations they replace: bf16 conversions, the
//! residual and bias adds, the shared-expert gate, the gated activation and the
//! weighted top-k combine.

use super::*;
use rackfill_models::layers::fastmath;

#[test]
fn bf16_conversions_round_to_nearest_even() {
    let Some(dev) = Dev::get() else { return };
    let mut rng = Rng(5);
    let (rows, cols, x_stride, out_stride) = (11, 300, 320, 310);
    // Magnitudes from tiny to huge, and exact halfway cases.
    let mut x: Vec<f32> = (0..rows * x_stride)
        .map(|i| rng.f32(1.0) * 10f32.powi((i % 9) as i32 - 4))
        .collect();
    x[1] = 1.0 + 2f32.powi(-8);
    x[2] = 1.0 + 3.0 * 2f32.powi(-8);
    let buf = dev.f32(&x);
    let out = dev.zeros(rows * out_stride * 2);
    let args = [
        p(&buf),
        u(x_stride),
        u(rows),
        u(cols),
        p(&out),
        u(out_stride),
    ];
    dev.run("f32_to_bf16_rows", rows, &args);
    let got = dev.read_bf16(&out);
    for r in 0..rows {
        let want: Vec<f32> = x[r * x_stride..r * x_stride + cols]
            .iter()
            .map(|&v| round_bf16(v))
            .collect();
        assert_bits(
            "f32_to_bf16_rows",
            &got[r * out_stride..r * out_stride + cols],
            &want,
        );
    }
}

#[test]
fn residual_bias_and_gate_scales_match_the_cpu_ops() {
    let Some(dev) = Dev::get() else { return };
    let mut rng = Rng(6);
    let (rows, cols, stride) = (9, 200, 210);
    let x = rng.vec(rows * stride, 5.0);
    let y = rng.vec(rows * stride, 5.0);
    let (xb, yb) = (dev.f32(&x), dev.f32(&y));
    dev.run("add_inplace", 3, &[p(&xb), p(&yb), u(x.len())]);
    let sum: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
    assert_bits("add_inplace", &dev.read_f32(&xb), &sum);

    // Linear's bias: candle's broadcast_add of the f32 (bf16-valued) bias.
    let bias: Vec<f32> = rng.vec(cols, 1.0).into_iter().map(round_bf16).collect();
    let bb = dev.bf16(&bias);
    dev.run(
        "add_bias_rows",
        rows,
        &[p(&xb), u(stride), p(&bb), u(rows), u(cols)],
    );
    let t = Tensor::from_vec(sum.clone(), (rows, stride), &Device::Cpu).unwrap();
    let bt = Tensor::from_vec(bias, cols, &Device::Cpu).unwrap();
    let biased = t.narrow(1, 0, cols).unwrap().broadcast_add(&bt).unwrap();
    let biased: Vec<Vec<f32>> = biased.to_vec2().unwrap();
    let got = dev.read_f32(&xb);
    for r in 0..rows {
        assert_bits(
            "add_bias_rows",
            &got[r * stride..r * stride + cols],
            &biased[r],
        );
        assert_bits(
            "add_bias_rows tail",
            &got[r * stride + cols..(r + 1) * stride],
            &sum[r * stride + cols..(r + 1) * stride],
        );
    }

    // Qwen2-MoE's shared-expert gate: out * sigmoid(logit), candle's sigmoid.
    let logit_stride = 3;
    let logits: Vec<f32> = (0..rows * logit_stride)
        .map(|i| rng.f32(if i % 2 == 0 { 30.0 } else { 2.0 }))
        .collect();
    let lb = dev.f32(&logits);
    let args = [p(&xb), u(stride), p(&lb), u(logit_stride), u(rows), u(cols)];
    dev.run("sigmoid_scale_rows", rows, &args);
    let column: Vec<f32> = logits.iter().step_by(logit_stride).copied().collect();
    let gate = Tensor::from_vec(column, (rows, 1), &Device::Cpu).unwrap();
    let scale = candle_nn::ops::sigmoid(&gate).unwrap();
    let t = Tensor::from_vec(got.clone(), (rows, stride), &Device::Cpu).unwrap();
    let want: Vec<Vec<f32>> = t
        .narrow(1, 0, cols)
        .unwrap()
        .broadcast_mul(&scale)
        .unwrap()
        .to_vec2()
        .unwrap();
    let scaled = dev.read_f32(&xb);
    let mut worst = 0f32;
    for r in 0..rows {
        let row = &scaled[r * stride..r * stride + cols];
        worst = worst.max(check_close(
            "sigmoid_scale_rows",
            row,
            &want[r],
            2f32.powi(-22),
            1e-30,
        ));
    }
    eprintln!("sigmoid_scale_rows: max relative error {worst:e}");
}

#[test]
fn silu_mul_to_bf16_is_the_cpu_activation_rounded() {
    let Some(dev) = Dev::get() else { return };
    let mut rng = Rng(7);
    // The fixtures' expert and dense widths, the built-in model's, then production sizes.
    for (rows, inter) in [(7, 32), (5, 96), (6, 64), (3, 2048), (2, 18432 / 8 + 3)] {
        let mut gate_up: Vec<f32> = (0..rows * 2 * inter)
            .map(|i| rng.f32(if i % 7 == 0 { 120.0 } else { 6.0 }))
            .collect();
        gate_up[0] = 0.0;
        gate_up[1] = -0.0;
        let buf = dev.f32(&gate_up);
        let out = dev.zeros(rows * inter * 2);
        dev.run(
            "silu_mul_to_bf16",
            rows,
            &[p(&buf), u(rows), u(inter), p(&out)],
        );
        let mut want = vec![0f32; rows * inter];
        for (o, gu) in want
            .chunks_exact_mut(inter)
            .zip(gate_up.chunks_exact(2 * inter))
        {
            let (gate, up) = gu.split_at(inter);
            fastmath::silu_mul(o, gate, up);
        }
        let want: Vec<f32> = want.into_iter().map(round_bf16).collect();
        assert_bits("silu_mul_to_bf16", &dev.read_bf16(&out), &want);
    }
}

#[test]
fn combine_adds_the_cpu_weighted_sum_to_the_shared_output() {
    let Some(dev) = Dev::get() else { return };
    let mut rng = Rng(8);
    // (tokens, k, hidden): fixture and built-in model shapes, then DeepSeek-V3's.
    for (tokens, k, hidden) in [(9, 2, 64), (7, 4, 64), (5, 4, 128), (3, 8, 7168)] {
        let pairs = tokens * k;
        let pair_outputs = rng.vec(pairs * hidden, 3.0);
        let weights = rng.vec(pairs, 1.0);
        let shared = rng.vec(tokens * hidden, 2.0);
        // The experts' outputs in grouped order: pair p lands on row pair_row[p].
        let mut pair_row: Vec<u32> = (0..pairs as u32).collect();
        for i in (1..pairs).rev() {
            pair_row.swap(i, rng.below(i + 1));
        }
        let mut grouped = vec![0f32; pairs * hidden];
        for (p, &row) in pair_row.iter().enumerate() {
            let row = row as usize;
            grouped[row * hidden..(row + 1) * hidden]
                .copy_from_slice(&pair_outputs[p * hidden..(p + 1) * hidden]);
        }
        let (gb, rb, wb, out) = (
            dev.f32(&grouped),
            dev.u32(&pair_row),
            dev.f32(&weights),
            dev.f32(&shared),
        );
        let args = [p(&gb), p(&rb), p(&wb), u(tokens), u(k), u(hidden), p(&out)];
        dev.run("combine_topk_rows", tokens, &args);
        let routed = rackfill_kernels::combine(&pair_outputs, &weights, tokens, k, hidden).unwrap();
        // MoeBlock::add_shared: routed + shared.
        let want: Vec<f32> = routed.iter().zip(&shared).map(|(r, s)| r + s).collect();
        assert_bits("combine_topk_rows", &dev.read_f32(&out), &want);
    }
}
