//! RoPE against `Rope::apply` (rope.rs): every fixture's schedule and layout, and each
//! schedule (default, linear, YaRN) in both layouts at production head sizes, bit for bit.

use super::*;
use rackfill_models::config::{RopeConfig, RopeScaling};
use rackfill_models::layers::rope::Rope;

/// One rotary layout: `heads` heads of `head_stride` columns per row, rotating
/// `[offset, offset + rot)` of each.
struct RopeCase {
    heads: usize,
    head_stride: usize,
    offset: usize,
    rot: usize,
    row_stride: usize,
}

/// Runs `rope` on chunks of rows at positions `start..start + n` and compares with
/// `Rope::apply` on the same chunks, bit for bit, columns outside the rotated span untouched.
fn check_rope(dev: &Dev, rope: &Rope, case: &RopeCase, chunks: &[(usize, usize)], rng: &mut Rng) {
    let n: usize = chunks.iter().map(|c| c.1).sum();
    let x = rng.vec(n * case.row_stride, 2.0);
    let positions: Vec<u32> = chunks
        .iter()
        .flat_map(|&(start, len)| (start..start + len).map(|p| p as u32))
        .collect();
    let (buf, pos, freq) = (dev.f32(&x), dev.u32(&positions), dev.f32(rope.inv_freq()));
    let args = [
        p(&buf),
        u(case.row_stride),
        u(case.heads),
        u(case.head_stride),
        u(case.offset),
        u(case.rot),
        p(&pos),
        p(&freq),
        KernelArg::F32(rope.attention_factor()),
        u(usize::from(rope.interleaved())),
        u(n),
    ];
    dev.run("rope", n, &args);
    let got = dev.read_f32(&buf);
    let mut want = x.clone();
    let mut row = 0;
    for &(start, len) in chunks {
        // [heads, len, rot] for the CPU.
        let mut part = Vec::with_capacity(case.heads * len * case.rot);
        for h in 0..case.heads {
            for r in row..row + len {
                let at = r * case.row_stride + h * case.head_stride + case.offset;
                part.extend_from_slice(&x[at..at + case.rot]);
            }
        }
        let t = Tensor::from_vec(part, (case.heads, len, case.rot), &Device::Cpu).unwrap();
        let rotated: Vec<f32> = rope
            .apply(&t, start)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        for (i, chunk) in rotated.chunks(case.rot).enumerate() {
            let (h, r) = (i / len, row + i % len);
            let at = r * case.row_stride + h * case.head_stride + case.offset;
            want[at..at + case.rot].copy_from_slice(chunk);
        }
        row += len;
    }
    assert_bits("rope", &got, &want);
}

#[test]
fn rope_matches_the_cpu_rotation_for_every_schedule_and_layout() {
    let Some(dev) = Dev::get() else { return };
    let mut rng = Rng(4);
    let chunks = [(0, 5), (3, 4), (4093, 6), (131_000, 3)];
    // Every fixture's own schedule and layout (MLA: q's rope part in each head, and k's shared
    // rope part at the end of kv_a's rows).
    for name in FIXTURES {
        let config = ModelConfig::load(&fixture(name)).unwrap();
        let cases = match &config.mla {
            Some(mla) => {
                let rope = Rope::new(&config.rope, mla.qk_rope_head_dim, mla.rope_interleave);
                let (nope, rot) = (mla.qk_nope_head_dim, mla.qk_rope_head_dim);
                let q = RopeCase {
                    heads: config.num_heads,
                    head_stride: nope + rot,
                    offset: nope,
                    rot,
                    row_stride: config.num_heads * (nope + rot),
                };
                let k = RopeCase {
                    heads: 1,
                    head_stride: 0,
                    offset: mla.kv_lora_rank,
                    rot,
                    row_stride: mla.kv_lora_rank + rot,
                };
                vec![(rope.clone(), q), (rope, k)]
            }
            None => {
                let d = config.head_dim;
                let rope = Rope::new(&config.rope, d, false);
                let layout = |heads| RopeCase {
                    heads,
                    head_stride: d,
                    offset: 0,
                    rot: d,
                    row_stride: heads * d,
                };
                vec![
                    (rope.clone(), layout(config.num_heads)),
                    (rope, layout(config.num_kv_heads)),
                ]
            }
        };
        for (rope, case) in cases {
            check_rope(&dev, &rope, &case, &chunks, &mut rng);
        }
    }
    // Each schedule in both layouts at production head sizes.
    let yarn = |attention_factor| RopeScaling::Yarn {
        factor: 40.0,
        original_max_position_embeddings: 4096,
        beta_fast: 32.0,
        beta_slow: 1.0,
        mscale: 1.0,
        mscale_all_dim: 0.707,
        attention_factor,
        truncate: true,
    };
    let schedules = [
        RopeScaling::None,
        RopeScaling::Linear { factor: 4.0 },
        yarn(None),
        yarn(Some(1.25)),
    ];
    for scaling in schedules {
        let config = RopeConfig {
            theta: 10_000.0,
            scaling,
        };
        for interleaved in [false, true] {
            let rope = Rope::new(&config, 64, interleaved);
            let case = RopeCase {
                heads: 3,
                head_stride: 192,
                offset: 128,
                rot: 64,
                row_stride: 3 * 192 + 8,
            };
            check_rope(&dev, &rope, &case, &chunks, &mut rng);
        }
        let rope = Rope::new(&config, 128, false);
        let case = RopeCase {
            heads: 2,
            head_stride: 128,
            offset: 0,
            rot: 128,
            row_stride: 256,
        };
        check_rope(&dev, &rope, &case, &chunks, &mut rng);
    }
}
