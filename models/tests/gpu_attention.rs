//! The GPU attention kernels (`kernels/cuda/attention.cu`: `kv_write` into the paged bf16 KV
//! cache, flash attention on tensor cores over it, every tile shape) on the host emulator
//! (warp-level `mma.sync` / `ldmatrix`, `cp.async` landing at its wait), and on GPU 0 where
//! there is one, against the CPU reference `causal_attention` on the conformance fixtures' head
//! shapes and on real widths (128-wide GQA heads, DeepSeek-V3's 576/512 latent): chunked
//! prefill over a cached context longer than a key tile, batches of sequences of different
//! lengths, decode, grouped-query heads, key and value widths that differ, DeepSeek's absorbed
//! MLA layout (V read out of the latent K cache), and cache blocks reused after a sequence ends.
//!
//! Tolerances (`MAX_REL_L2`, `MAX_ABS` in the harness). The reference gets the inputs the
//! kernels see: f32 queries, keys and values rounded to bf16 as `kv_write` rounds them; it
//! computes in f32. The kernels also round the queries and the softmax probabilities to bf16
//! for the tensor cores (as transformers' bf16 attention has them in bf16), sum in a different
//! order, and round their output to bf16 (relative error at most 2^-9). So, with values in
//! [-1, 1]: the relative L2 error of a step's outputs is at most 1e-2, and no element is off
//! by more than 6e-3 (three times bf16's largest rounding error below 1). Observed on the
//! emulator: relative L2 at most 3.4e-3, max abs 4.4e-3 (the tests print theirs). A prefill
//! split into chunks must equal the whole prefill bit for bit: every query row runs the same
//! key tiles in the same order whatever block computes it.
//!
//! Without a C++ compiler (the emulator) and a GPU the tests print why and pass.

#![cfg(feature = "cuda")]

mod paged_harness;

use std::path::{Path, PathBuf};

use paged_harness::{
    errors, executors, heads_first, reference, values, within_tolerance, Heads, Layer, Sequence,
    Worst,
};
use rackfill_kernels::cuda::exec::{round_bf16, ExecutorExt, KernelArg, Launch};
use rackfill_kernels::flash::FlashTiles;
use rackfill_kernels::kv_blocks::{BlockTable, PagedError, NO_SLOT};
use rackfill_models::layers::attention::causal_attention;
use rackfill_models::ModelConfig;

/// The head shapes of the conformance fixtures and the built-in model: GQA as configured; MLA
/// both as the CPU model caches it (expanded per-head keys and values, `qk_dim != v_dim`) and
/// absorbed, as the GPU caches it.
fn fixture_heads() -> Vec<(String, Heads)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root.join("tests/fixtures"))
        .expect("fixtures")
        .map(|e| e.expect("fixture").path())
        .filter(|p| p.join("config.json").exists())
        .collect();
    dirs.sort();
    dirs.push(root.join("builtin"));
    let mut shapes: Vec<(String, Heads)> = Vec::new();
    for dir in dirs {
        let config = ModelConfig::load(&dir).expect("fixture config");
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let heads = config.num_heads;
        let found = match &config.mla {
            None => vec![(
                name,
                Heads::gqa(heads, config.num_kv_heads, config.head_dim),
            )],
            Some(mla) => {
                let (rank, rope) = (mla.kv_lora_rank, mla.qk_rope_head_dim);
                let qk = mla.qk_nope_head_dim + rope;
                let expanded = Heads::new([heads; 2], (qk, mla.v_head_dim), qk, false);
                let absorbed = Heads::new([heads, 1], (rank + rope, rank), qk, true);
                vec![
                    (name.clone(), expanded),
                    (format!("{name} absorbed"), absorbed),
                ]
            }
        };
        for (name, heads) in found {
            if !shapes.iter().any(|(_, h)| *h == heads) {
                shapes.push((name, heads));
            }
        }
    }
    shapes
}

#[test]
fn chunked_prefill_and_decode_match_the_cpu_reference_on_every_fixture_shape() {
    for exec in executors() {
        let mut worst = Worst::default();
        let shapes = fixture_heads();
        assert!(shapes.len() >= 5, "{shapes:?}");
        for (i, (name, heads)) in shapes.into_iter().enumerate() {
            // Block sizes that do and do not divide the 16-key tiles.
            let block_size = [4, 5, 8, 16][i % 4];
            let mut whole = Layer::new(exec.clone(), heads, 16, block_size);
            let mut chunked = Layer::new(exec.clone(), heads, 16, block_size);
            let mut a = Sequence::new(&heads, 39, 10 + i as u64);
            let mut b = Sequence::new(&heads, 39, 10 + i as u64);
            let all = whole.step(&mut [(&mut a, 37)]).unwrap().remove(0);
            worst.check(
                &format!("{name}: prefill"),
                &all,
                &reference(&heads, &a, 0, 37, heads.scale),
            );
            let mut pieces = Vec::new();
            for n in [12, 1, 24] {
                pieces.extend(chunked.step(&mut [(&mut b, n)]).unwrap().remove(0));
            }
            assert!(
                pieces == all,
                "{name}: chunked prefill differs from the whole prefill"
            );
            for ctx in [37, 38] {
                let got = chunked.step(&mut [(&mut b, 1)]).unwrap().remove(0);
                worst.check(
                    &format!("{name}: decode after {ctx}"),
                    &got,
                    &reference(&heads, &b, ctx, 1, heads.scale),
                );
            }
        }
        worst.report("chunked_prefill_and_decode", exec.as_ref());
    }
}

#[test]
fn a_batch_of_sequences_of_different_lengths_runs_in_one_step() {
    for exec in executors() {
        let mut worst = Worst::default();
        let absorbed = fixture_heads()
            .into_iter()
            .find(|(_, h)| h.latent)
            .expect("an MLA fixture")
            .1;
        for heads in [Heads::gqa(4, 2, 16), absorbed] {
            let mut layer = Layer::new(exec.clone(), heads, 24, 8);
            let mut seqs: Vec<Sequence> =
                (0..4).map(|s| Sequence::new(&heads, 40, 20 + s)).collect();
            let [s0, s1, s2, s3] = &mut seqs[..] else {
                unreachable!()
            };
            let first = layer.step(&mut [(s0, 20), (s1, 10)]).unwrap();
            // A chunk over a cached context, a decode, a fresh prefill, and a sequence idle this step.
            let second = layer
                .step(&mut [(s0, 7), (s1, 1), (s2, 33), (s3, 0)])
                .unwrap();
            assert!(second[3].is_empty());
            for (what, got, seq, ctx, n) in [
                ("first step, sequence 0", &first[0], &seqs[0], 0, 20),
                ("first step, sequence 1", &first[1], &seqs[1], 0, 10),
                ("chunk after 20", &second[0], &seqs[0], 20, 7),
                ("decode after 10", &second[1], &seqs[1], 10, 1),
                ("fresh prefill", &second[2], &seqs[2], 0, 33),
            ] {
                worst.check(
                    &format!("{:?}: {what}", heads.shape),
                    got,
                    &reference(&heads, seq, ctx, n, heads.scale),
                );
            }
        }
        worst.report("a_batch_of_sequences", exec.as_ref());
    }
}

#[test]
fn every_flash_tile_shape_matches_the_reference_on_real_head_widths() {
    // Qwen3-MoE's and Llama's 128-wide heads (GQA 8/2 here) and DeepSeek-V3's absorbed latent
    // (576 key columns, 512 value columns: several value-column blocks), over contexts longer
    // than a key tile, with ragged chunks and a decode; every tile shape the kernels compile.
    for exec in executors() {
        let mut worst = Worst::default();
        let deepseek = Heads::new([4, 1], (576, 512), 192, true);
        for heads in [Heads::gqa(8, 2, 128), deepseek] {
            let limit = exec.shared_limit("flash_attention_k64_v64").unwrap();
            for tiles in FlashTiles::ALL {
                if heads.shape.shared_bytes(tiles) as usize > limit {
                    continue;
                }
                let mut layer = Layer::new(exec.clone(), heads, 16, 16);
                layer.tiles = Some(tiles);
                let mut a = Sequence::new(&heads, 140, 60);
                let mut b = Sequence::new(&heads, 40, 61);
                let first = layer.step(&mut [(&mut a, 70), (&mut b, 3)]).unwrap();
                let second = layer.step(&mut [(&mut a, 69), (&mut b, 1)]).unwrap();
                for (what, got, seq, ctx, n) in [
                    ("prefill of 70", &first[0], &a, 0, 70),
                    ("prefill of 3", &first[1], &b, 0, 3),
                    ("69 over 70 cached", &second[0], &a, 70, 69),
                    ("decode after 3", &second[1], &b, 3, 1),
                ] {
                    worst.check(
                        &format!("{:?} {tiles}: {what}", heads.shape),
                        got,
                        &reference(&heads, seq, ctx, n, heads.scale),
                    );
                }
            }
        }
        worst.report("every_flash_tile_shape", exec.as_ref());
    }
}

#[test]
fn blocks_freed_by_a_finished_sequence_serve_the_next() {
    for exec in executors() {
        let mut worst = Worst::default();
        let heads = Heads::gqa(4, 2, 16);
        let mut layer = Layer::new(exec.clone(), heads, 6, 8);
        let mut a = Sequence::new(&heads, 40, 30);
        let mut b = Sequence::new(&heads, 8, 31);
        let mut c = Sequence::new(&heads, 31, 32);
        layer.step(&mut [(&mut a, 40), (&mut b, 6)]).unwrap();
        assert_eq!(layer.pool.free_blocks(), 0);
        let err = layer.step(&mut [(&mut c, 1)]).unwrap_err();
        assert_eq!(err, PagedError::Exhausted { needed: 1, free: 0 });
        let mut old = a.table.blocks().to_vec();
        a.table.release(&mut layer.pool).unwrap();
        // c takes a's blocks, which still hold a's keys and values past c's tokens.
        let got = layer.step(&mut [(&mut c, 30), (&mut b, 1)]).unwrap();
        let mut reused = c.table.blocks().to_vec();
        reused.sort_unstable();
        old.sort_unstable();
        assert!(
            reused.iter().all(|blk| old.contains(blk)),
            "{reused:?} vs {old:?}"
        );
        worst.check(
            "prefill in reused blocks",
            &got[0],
            &reference(&heads, &c, 0, 30, heads.scale),
        );
        worst.check(
            "decode beside it",
            &got[1],
            &reference(&heads, &b, 6, 1, heads.scale),
        );
        let got = layer.step(&mut [(&mut c, 1)]).unwrap();
        worst.check(
            "decode in reused blocks",
            &got[0],
            &reference(&heads, &c, 30, 1, heads.scale),
        );
        worst.report("blocks_freed", exec.as_ref());
    }
}

#[test]
fn absorbed_mla_attention_is_deepseek_attention() {
    // DeepSeek caches one latent row per token, [kv_a latent (normed), rotated k_rot]; with
    // W_UK absorbed into the queries and W_UV applied after, attention over it is the MLA of
    // families/deepseek_v3.rs: per-head keys [W_UK latent, k_rot] and values W_UV latent.
    for exec in executors() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek_v3");
        let config = ModelConfig::load(&dir).expect("fixture config");
        let mla = config.mla.expect("MLA dimensions");
        let (h, r, p) = (config.num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim);
        let (nope, v) = (mla.qk_nope_head_dim, mla.v_head_dim);
        let heads = Heads::new([h, 1], (r + p, r), nope + p, true);
        let tokens = 29;
        // kv_b_proj: per head, nope rows of W_UK then v rows of W_UV, each `[.., r]`.
        let kv_b = values(h * (nope + v) * r, 50, (3.0 / r as f32).sqrt());
        let w_uk = |head: usize, i: usize| &kv_b[(head * (nope + v) + i) * r..][..r];
        let w_uv = |head: usize, i: usize| &kv_b[(head * (nope + v) + nope + i) * r..][..r];
        let latent = values(tokens * r, 51, 1.0);
        let k_rot = values(tokens * p, 52, 2.0);
        let q_nope = values(tokens * h * nope, 53, 2.0);
        let q_rope = values(tokens * h * p, 54, 2.0);
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();

        // The absorbed rows the kernels read: q_abs per head [W_UK^T q_nope, q_rope], then the
        // latent row [latent, k_rot].
        let mut rows = Vec::with_capacity(tokens * heads.row_width());
        for t in 0..tokens {
            for head in 0..h {
                let qn = &q_nope[(t * h + head) * nope..][..nope];
                rows.extend(
                    (0..r).map(|c| (0..nope).map(|i| qn[i] * w_uk(head, i)[c]).sum::<f32>()),
                );
                rows.extend_from_slice(&q_rope[(t * h + head) * p..][..p]);
            }
            rows.extend_from_slice(&latent[t * r..][..r]);
            rows.extend_from_slice(&k_rot[t * p..][..p]);
        }
        let mut seq = Sequence {
            rows,
            table: BlockTable::new(),
        };
        let mut layer = Layer::new(exec.clone(), heads, 8, 8);
        let mut got = layer.step(&mut [(&mut seq, 17)]).unwrap().remove(0);
        got.extend(layer.step(&mut [(&mut seq, 12)]).unwrap().remove(0));
        // W_UV on each head's latent-space output.
        let got: Vec<f32> = got
            .chunks_exact(r)
            .enumerate()
            .flat_map(|(i, o)| (0..v).map(move |c| (i % h, c, o)))
            .map(|(head, c, o)| dot(w_uv(head, c), o))
            .collect();

        // The expanded computation, on the bf16 latent and k_rot the cache holds.
        let latent: Vec<f32> = latent.into_iter().map(round_bf16).collect();
        let k_rot: Vec<f32> = k_rot.into_iter().map(round_bf16).collect();
        let mut q = Vec::new();
        let (mut keys, mut vals) = (Vec::new(), Vec::new());
        for t in 0..tokens {
            let lat = &latent[t * r..][..r];
            for head in 0..h {
                q.extend_from_slice(&q_nope[(t * h + head) * nope..][..nope]);
                q.extend_from_slice(&q_rope[(t * h + head) * p..][..p]);
                keys.extend((0..nope).map(|i| dot(w_uk(head, i), lat)));
                keys.extend_from_slice(&k_rot[t * p..][..p]);
                vals.extend((0..v).map(|i| dot(w_uv(head, i), lat)));
            }
        }
        let want = causal_attention(
            &heads_first(q, tokens, h),
            &heads_first(keys, tokens, h),
            &heads_first(vals, tokens, h),
            f64::from(heads.scale),
        )
        .expect("reference attention");
        let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let mut worst = Worst::default();
        worst.check("absorbed MLA", &got, &want);
        worst.report("absorbed_mla", exec.as_ref());
    }
}

#[test]
fn kv_write_rounds_strided_columns_into_their_slots_and_skips_padding() {
    // Rows of 7 floats, keys at column 2 (two heads of 2), values at column 5 (two heads of
    // 1); slots 3, padding, 0. Then a latent-only write (null values) into a second cache.
    let rows = values(3 * 7, 60, 3.0);
    let slots = [3, NO_SLOT, 0];
    for exec in executors() {
        let upload = exec.upload_f32(&rows).unwrap();
        let slot_buffer = exec.upload_u32(&slots).unwrap();
        let (k_cache, v_cache) = (
            exec.upload_bf16(&[9.0; 16]).unwrap(),
            exec.upload_bf16(&[9.0; 8]).unwrap(),
        );
        let latent = exec.upload_bf16(&[9.0; 16]).unwrap();
        let u = KernelArg::U32;
        for (keys, v, v_cache, k_dim, v_dim) in [
            (
                &k_cache,
                KernelArg::from(&upload),
                KernelArg::from(&v_cache),
                2,
                1,
            ),
            (&latent, KernelArg::Ptr(0), KernelArg::Ptr(0), 2, 0),
        ] {
            let args = [
                KernelArg::from(&upload),
                u(7),
                u(2),
                v,
                u(7),
                u(5),
                KernelArg::from(&slot_buffer),
                u(3),
                KernelArg::from(keys),
                v_cache,
                u(2),
                u(k_dim),
                u(v_dim),
            ];
            // SAFETY: kv_write's signature; slots 3 and 0 of 4-wide key rows fit 16 values.
            unsafe { exec.launch("kv_write", Launch::blocks(2, 32), &args) }.unwrap();
        }
        let expect = |width: usize, col: usize| {
            let mut cache = vec![9.0; 4 * width];
            for (row, slot) in [(0, 3), (2, 0)] {
                for e in 0..width {
                    cache[slot * width + e] = round_bf16(rows[row * 7 + col + e]);
                }
            }
            cache
        };
        assert_eq!(exec.download_bf16(&k_cache).unwrap(), expect(4, 2));
        assert_eq!(exec.download_bf16(&v_cache).unwrap(), expect(2, 5));
        assert_eq!(exec.download_bf16(&latent).unwrap(), expect(4, 2));
    }
}

#[test]
fn the_tolerance_tells_a_wrong_attention_from_a_right_one() {
    // The checks above can fail: a 5% different softmax scale, one changed key of the
    // context, or one output element off by 1e-2 are all outside the tolerance.
    let heads = Heads::gqa(4, 2, 16);
    let seq = Sequence::new(&heads, 40, 40);
    let right = reference(&heads, &seq, 8, 24, heads.scale);
    assert!(within_tolerance(&right, &right));
    let scaled = reference(&heads, &seq, 8, 24, heads.scale * 1.05);
    assert!(
        !within_tolerance(&scaled, &right),
        "{:?}",
        errors(&scaled, &right)
    );
    let mut tampered = Sequence::new(&heads, 40, 40);
    let key = 3 * heads.row_width() + heads.q_width();
    tampered.rows[key..key + heads.k_width()]
        .iter_mut()
        .for_each(|k| *k = -*k);
    let tampered = reference(&heads, &tampered, 8, 24, heads.scale);
    assert!(
        !within_tolerance(&tampered, &right),
        "{:?}",
        errors(&tampered, &right)
    );
    let mut off = right.clone();
    off[17] += 1e-2;
    assert!(!within_tolerance(&off, &right));
}
