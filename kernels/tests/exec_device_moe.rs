//! The bf16 device data plane ([`DeviceMoe`]) on every executor this machine has (the host
//! emulator everywhere, GPU 0 on a GPU host) against a host reference of the same layer: the
//! counts equal the routing's, every replica slot holds its expert's bf16 weights bit for bit
//! (relay trees with chunk waits included), and the output rows equal the shared-expert
//! baseline plus the router-weighted sum of each pair's expert MLP, computed in f32 from the
//! same bf16 operands (tolerance: 1e-4 relative to the row's largest value, what summation
//! order can move), for several balancers, ranks without rows, and a second MoE layer.

#![cfg(feature = "cuda")]

use std::sync::Arc;

use rackfill_balancer::relay::RelayConfig;
use rackfill_balancer::{Algo, Layout, LoadMatrix, Plan, Settings};
use rackfill_kernels::cuda::device_moe::{DeviceMoe, ExpertWeights, RoutedRows};
use rackfill_kernels::cuda::exec::{self, round_bf16, Executor, ExecutorExt};

const H: usize = 32;
const I: usize = 24;
const K: usize = 3;
const EXPERTS: usize = 10;
const RANKS: usize = 3;

/// Deterministic values in [-1, 1), rounded to bf16.
fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8;
            round_bf16((x % 2001) as f32 / 1000.0 - 1.0)
        })
        .collect()
}

/// `layers[l][e]`: gate-up `[H, 2I]` then down `[I, H]`, scaled to keep activations O(1).
fn expert_weights() -> Vec<Vec<[Vec<f32>; 2]>> {
    (0..2u32)
        .map(|l| {
            (0..EXPERTS as u32)
                .map(|e| {
                    let seed = 1000 * l + 17 * e;
                    let scale =
                        |v: Vec<f32>, s: f32| v.into_iter().map(|x| round_bf16(x * s)).collect();
                    [
                        scale(values(H * 2 * I, seed), 0.25),
                        scale(values(I * H, seed + 7), 0.25),
                    ]
                })
                .collect()
        })
        .collect()
}

/// The engine's view of `weights`: slices per expert.
fn as_slices(weights: &[Vec<[Vec<f32>; 2]>]) -> Vec<Vec<ExpertWeights<'_>>> {
    weights
        .iter()
        .map(|l| {
            l.iter()
                .map(|[a, b]| [a.as_slice(), b.as_slice()])
                .collect()
        })
        .collect()
}

/// Each row's `K` distinct experts (expert 3 is hot: most rows pick it) and their weights.
fn routing(rows: usize, seed: usize) -> (Vec<u32>, Vec<f32>) {
    let mut experts = Vec::with_capacity(rows * K);
    for r in 0..rows {
        let mut picked = vec![3u32];
        if (r + seed).is_multiple_of(4) {
            picked[0] = ((r * 7 + seed) % EXPERTS) as u32;
        }
        let mut next = (r * 5 + seed * 3) % EXPERTS;
        while picked.len() < K {
            if !picked.contains(&(next as u32)) {
                picked.push(next as u32);
            }
            next = (next + 1) % EXPERTS;
        }
        experts.extend(picked);
    }
    let weights = values(rows * K, seed as u32 + 99)
        .into_iter()
        .map(|w| (w.abs() + 0.1) / 1.1)
        .collect();
    (experts, weights)
}

/// `silu(x · W_gu)` gated, rounded to bf16 (the device's activation), times `W_down`, in f32.
fn expert_mlp(x: &[f32], [gate_up, down]: &[Vec<f32>; 2]) -> Vec<f32> {
    let mut gu = [0f32; 2 * I];
    for (j, out) in gu.iter_mut().enumerate() {
        *out = (0..H).map(|h| x[h] * gate_up[h * 2 * I + j]).sum();
    }
    let act: Vec<f32> = (0..I)
        .map(|j| {
            let g = gu[j];
            round_bf16(g / (1.0 + (-g).exp()) * gu[I + j])
        })
        .collect();
    (0..H)
        .map(|h| (0..I).map(|j| act[j] * down[j * H + h]).sum())
        .collect()
}

struct Case {
    rank_rows: Vec<usize>,
    x: Vec<f32>,
    experts: Vec<u32>,
    weights: Vec<f32>,
    baseline: Vec<f32>,
}

impl Case {
    fn new(rank_rows: &[usize], seed: usize) -> Self {
        let rows: usize = rank_rows.iter().sum();
        let (experts, weights) = routing(rows, seed);
        Self {
            rank_rows: rank_rows.to_vec(),
            x: values(rows * H, seed as u32 + 5),
            experts,
            weights,
            baseline: values(rows * H, seed as u32 + 11),
        }
    }

    fn counts(&self) -> Vec<Vec<u64>> {
        let mut counts = vec![vec![0u64; EXPERTS]; RANKS];
        let mut row = 0;
        for (rank, &n) in self.rank_rows.iter().enumerate() {
            for e in &self.experts[row * K..(row + n) * K] {
                counts[rank][*e as usize] += 1;
            }
            row += n;
        }
        counts
    }

    /// The baseline plus every row's router-weighted expert outputs, in top-k order.
    fn reference(&self, layer: &[[Vec<f32>; 2]]) -> Vec<f32> {
        let mut out = self.baseline.clone();
        for (t, row) in out.chunks_mut(H).enumerate() {
            let x = &self.x[t * H..(t + 1) * H];
            let mut acc = vec![0f32; H];
            for k in 0..K {
                let y = expert_mlp(x, &layer[self.experts[t * K + k] as usize]);
                for (a, v) in acc.iter_mut().zip(y) {
                    *a += self.weights[t * K + k] * v;
                }
            }
            for (o, a) in row.iter_mut().zip(acc) {
                *o += a;
            }
        }
        out
    }
}

fn plan_for(algo: Algo, layout: &Layout, counts: &[Vec<u64>]) -> Plan {
    let settings = Settings {
        u_min: 1,
        ..Settings::default()
    };
    let load = LoadMatrix::from_rows(counts).unwrap();
    algo.build(&settings).plan(layout, &load).unwrap()
}

#[test]
fn the_device_plane_equals_the_host_reference_for_every_balancer() {
    for exec in exec::available() {
        device_plane_equals_host_reference(exec);
    }
}

fn device_plane_equals_host_reference(exec: Arc<dyn Executor>) {
    let layout = Layout::contiguous(RANKS, EXPERTS, 2).unwrap();
    let weights = expert_weights();
    let layers = as_slices(&weights);
    // Relay trees for any expert with more than one replica, streamed in 1 KiB chunks: a relay
    // forwards chunk c while chunk c + 1 is still arriving, so stage-2 tiles wait on flags.
    let relay = RelayConfig {
        threshold: 1,
        chunk_bytes: 1024,
    };
    let moe = DeviceMoe::new(Arc::clone(&exec), &layout, H, I, &layers, relay).unwrap();
    assert_eq!(moe.expert_bytes(), (H * 2 * I + I * H) * 2, "bf16 experts");
    for (case, algo, layer) in [
        (Case::new(&[7, 5, 12], 1), Algo::Quota, 1),
        (Case::new(&[9, 0, 4], 2), Algo::Quota, 0),
        (Case::new(&[6, 6, 6], 3), Algo::EplbExact, 1),
        (Case::new(&[0, 0, 11], 4), Algo::GreedyMove, 0),
        (Case::new(&[3, 8, 2], 5), Algo::None, 1),
    ] {
        let what = format!(
            "{} {algo:?} layer {layer} rows {:?}",
            exec.describe(),
            case.rank_rows
        );
        let x = exec.upload_bf16(&case.x).unwrap();
        let ids = exec.upload_u32(&case.experts).unwrap();
        let router = exec.upload_f32(&case.weights).unwrap();
        let output = exec.upload_f32(&case.baseline).unwrap();
        let routed = RoutedRows {
            x: &x,
            experts: &ids,
            weights: &router,
            rank_rows: &case.rank_rows,
            top_k: K,
        };
        let counted = moe.count(&routed).unwrap();
        assert_eq!(counted.counts, case.counts(), "{what}: counts");
        let plan = plan_for(algo, &layout, &counted.counts);
        let run = moe
            .run_layer(layer, &plan, &routed, &counted, &output)
            .unwrap();

        // Every filled slot holds its expert's bf16 weights exactly.
        let mut filled = 0;
        for rank in 0..RANKS {
            for (slot, expert) in plan.rank_slots(rank).iter().enumerate() {
                let Some(e) = expert else { continue };
                let [gate_up, down] = &weights[layer][*e as usize];
                let want: Vec<f32> = gate_up.iter().chain(down).copied().collect();
                assert!(
                    moe.slot_contents(rank, slot).unwrap() == want,
                    "{what}: rank {rank} slot {slot} is not expert {e}"
                );
                filled += 1;
            }
        }
        if algo != Algo::None {
            assert!(filled > 0, "{what}: the hot expert is replicated");
        }
        let replica_bytes: u64 = run.replica_recv_bytes.iter().sum();
        assert_eq!(
            replica_bytes,
            (filled * moe.expert_bytes()) as u64,
            "{what}"
        );

        let got = exec.download_f32(&output).unwrap();
        let want = case.reference(&weights[layer]);
        for (t, (g, w)) in got.chunks(H).zip(want.chunks(H)).enumerate() {
            let scale = w.iter().fold(1f32, |m, v| m.max(v.abs()));
            let off = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(off <= 1e-4 * scale, "{what}: row {t} off by {off}");
        }
        if algo == Algo::None {
            // Without replicas every pair goes home: the bytes received are the pairs homed
            // elsewhere (bf16 row and two ids out, an f32 row back).
            let mut remote = 0u64;
            let mut row = 0;
            for (rank, &n) in case.rank_rows.iter().enumerate() {
                for e in &case.experts[row * K..(row + n) * K] {
                    remote += u64::from(layout.home(*e as usize) != rank);
                }
                row += n;
            }
            let bytes: u64 = run.token_recv_bytes.iter().sum();
            assert_eq!(bytes, remote * (2 * H as u64 + 8 + 4 * H as u64), "{what}");
        }
    }
}

#[test]
fn bad_routing_and_mismatched_plans_are_errors() {
    let Some(exec) = exec::available().into_iter().next() else {
        return;
    };
    let layout = Layout::contiguous(RANKS, EXPERTS, 2).unwrap();
    let weights = expert_weights();
    let layers = as_slices(&weights);
    let moe = DeviceMoe::new(
        Arc::clone(&exec),
        &layout,
        H,
        I,
        &layers,
        RelayConfig::default(),
    )
    .unwrap();
    let case = Case::new(&[2, 2, 2], 7);
    let x = exec.upload_bf16(&case.x).unwrap();
    let router = exec.upload_f32(&case.weights).unwrap();
    let mut experts = case.experts.clone();
    experts[4] = EXPERTS as u32;
    let bad_ids = exec.upload_u32(&experts).unwrap();
    let routed = RoutedRows {
        x: &x,
        experts: &bad_ids,
        weights: &router,
        rank_rows: &case.rank_rows,
        top_k: K,
    };
    let err = moe.count(&routed).err().expect("an expert id out of range");
    assert!(err.to_string().contains("not below 10"), "{err}");

    let ids = exec.upload_u32(&case.experts).unwrap();
    let two_ranks = RoutedRows {
        experts: &ids,
        rank_rows: &[3, 3],
        ..routed
    };
    assert!(
        moe.count(&two_ranks).is_err(),
        "rows for two ranks of three"
    );

    let routed = RoutedRows {
        experts: &ids,
        ..routed
    };
    let counted = moe.count(&routed).unwrap();
    let output = exec.upload_f32(&case.baseline).unwrap();
    let other = Layout::contiguous(2, EXPERTS, 2).unwrap();
    let plan = plan_for(Algo::None, &other, &[vec![1; EXPERTS], vec![1; EXPERTS]]);
    assert!(
        moe.run_layer(0, &plan, &routed, &counted, &output).is_err(),
        "plan for 2 ranks"
    );
    let plan = plan_for(Algo::None, &layout, &counted.counts);
    assert!(
        moe.run_layer(2, &plan, &routed, &counted, &output).is_err(),
        "no MoE layer 2"
    );
    // Nothing was added to the output by the refused runs.
    assert_eq!(exec.download_f32(&output).unwrap(), case.baseline);
}
