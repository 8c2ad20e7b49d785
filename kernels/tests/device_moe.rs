//! The MoE data plane ([`DeviceMoe`]) on every executor this machine has (the host emulator
//! everywhere, GPU 0 on a GPU host) against a host reference of the same layer: the counts equal
//! the routing's, every replica slot holds its expert's bf16 weights bit for bit (relay trees
//! with chunk waits included), and the output rows equal the shared-expert baseline plus the
//! router-weighted sum of each pair's expert MLP, computed in f32 from the same bf16 operands
//! (tolerance: 1e-4 relative to the row's largest value, what summation order can move). Over
//! every balancer, plans solved on the host and on the device, pipelined experts on and off,
//! shared and per-layer slots (resident replicas kept, not streamed again), two lanes with
//! their stages interleaved, ranks without rows, and bad input.

#![cfg(feature = "cuda")]

use std::sync::Arc;

use rackfill_balancer::quota::TargetRule;
use rackfill_balancer::relay::RelayConfig;
use rackfill_balancer::{Algo, Layout, LoadMatrix, Plan, Settings};
use rackfill_kernels::cuda::exec::{self, round_bf16, Executor, ExecutorExt, Stream};
use rackfill_kernels::cuda::moe::{
    DeviceMoe, ExpertWeights, HomeExperts, MoeConfig, MoeLane, RoutedRows,
};

const H: usize = 32;
const I: usize = 24;
const K: usize = 3;
const EXPERTS: usize = 10;
const RANKS: usize = 3;
const SLOTS: usize = 2;

/// Deterministic values in [-1, 1), rounded to bf16.
fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8;
            round_bf16((x % 2001) as f32 / 1000.0 - 1.0)
        })
        .collect()
}

/// `layers[l][e]`: gate-up `[H, 2I]` then down `[I, H]` (the engine's layout), scaled to keep
/// activations O(1).
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

/// Expert `[gate_up, down]` in the device layout (`[2I, H]` then `[H, I]`), as f32: what a
/// slot holding it reads back as.
fn device_layout([gate_up, down]: &[Vec<f32>; 2]) -> Vec<f32> {
    let mut out = Vec::with_capacity(3 * H * I);
    for j in 0..2 * I {
        out.extend((0..H).map(|h| gate_up[h * 2 * I + j]));
    }
    for h in 0..H {
        out.extend((0..I).map(|i| down[i * H + h]));
    }
    out
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

    /// The rows on the device, produced on `stream`.
    fn upload(&self, exec: &dyn Executor, stream: Stream) -> RoutedRows {
        RoutedRows {
            x: exec.upload_bf16(&self.x).unwrap(),
            experts: exec.upload_u32(&self.experts).unwrap(),
            weights: exec.upload_f32(&self.weights).unwrap(),
            output: exec.upload_f32(&self.baseline).unwrap(),
            rank_rows: self.rank_rows.clone(),
            top_k: K,
            stream,
        }
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

    fn check(&self, what: &str, got: &[f32], layer: &[[Vec<f32>; 2]]) {
        let want = self.reference(layer);
        for (t, (g, w)) in got.chunks(H).zip(want.chunks(H)).enumerate() {
            let scale = w.iter().fold(1f32, |m, v| m.max(v.abs()));
            let off = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(off <= 1e-4 * scale, "{what}: row {t} off by {off}");
        }
    }
}

fn settings() -> Settings {
    Settings {
        u_min: 1,
        ..Settings::default()
    }
}

fn plan_for(algo: Algo, layout: &Layout, load: &LoadMatrix) -> Plan {
    algo.build(&settings()).plan(layout, load).unwrap()
}

/// Relay trees for any expert with more than one replica, streamed in 1 KiB chunks: a relay
/// forwards chunk c while chunk c + 1 is still arriving, so stage-2 tiles wait on flags.
fn relay() -> RelayConfig {
    RelayConfig {
        threshold: 1,
        chunk_bytes: 1024,
    }
}

fn plane(exec: &Arc<dyn Executor>, weights: &[Vec<[Vec<f32>; 2]>], config: MoeConfig) -> DeviceMoe {
    let layout = Layout::contiguous(RANKS, EXPERTS, SLOTS).unwrap();
    let homes = HomeExperts::upload(
        exec.as_ref(),
        &layout,
        0..RANKS,
        (H, I),
        &as_slices(weights),
    )
    .unwrap();
    DeviceMoe::new(Arc::clone(exec), &layout, 0..RANKS, (H, I), homes, config).unwrap()
}

/// One layer on `lane`: counted, planned by `algo` (on the device when the lane solves), run;
/// checks the counts, the output and the slots. Returns the plan and the replica bytes.
fn run_case(
    exec: &dyn Executor,
    lane: &mut MoeLane,
    (algo, layer): (Algo, usize),
    case: &Case,
    weights: &[Vec<[Vec<f32>; 2]>],
    what: &str,
) -> (Plan, u64) {
    let layout = Layout::contiguous(RANKS, EXPERTS, SLOTS).unwrap();
    let rows = case.upload(exec, Stream::MAIN);
    let counted = lane.count(&rows).unwrap();
    assert_eq!(counted.counts, case.counts(), "{what}: counts");
    let load = LoadMatrix::from_rows(&counted.counts).unwrap();
    let host = plan_for(algo, &layout, &load);
    let plan = match lane.solve(layer, &load).unwrap() {
        Some(device) => {
            assert_eq!(device, host, "{what}: the device solver's plan");
            device
        }
        None => host,
    };
    let (run, rows) = lane
        .run_layer((layer, &plan, &load), rows, counted, None)
        .unwrap();
    exec.synchronize().unwrap();
    let got = exec.download_f32(&rows.output).unwrap();
    case.check(what, &got, &weights[layer]);
    for rank in 0..RANKS {
        for (slot, expert) in plan.rank_slots(rank).iter().enumerate() {
            let Some(e) = expert else { continue };
            assert!(
                lane.slot_contents(layer, rank, slot).unwrap()
                    == device_layout(&weights[layer][*e as usize]),
                "{what}: rank {rank} slot {slot} is not expert {e}"
            );
        }
    }
    let phases = run.timing.resolve(exec).unwrap();
    assert!(phases.experts >= std::time::Duration::ZERO);
    (plan, run.replica_recv_bytes.iter().sum())
}

#[test]
fn every_configuration_equals_the_host_reference() {
    let weights = expert_weights();
    for exec in exec::available() {
        for pipelined_experts in [true, false] {
            for per_layer_slots in [false, true] {
                for device_solver in [false, true] {
                    let config = MoeConfig {
                        relay: relay(),
                        device_solver: device_solver.then_some((1, TargetRule::BestFit)),
                        pipelined_experts,
                        per_layer_slots,
                        lanes: 1,
                        verify: true,
                    };
                    let mut moe = plane(&exec, &weights, config);
                    let expert_bytes = moe.expert_bytes() as u64;
                    let lane = &mut moe.lanes_mut()[0];
                    let algos: &[Algo] = if device_solver {
                        &[Algo::Quota]
                    } else {
                        &[Algo::Quota, Algo::EplbExact, Algo::GreedyMove, Algo::None]
                    };
                    for (i, &algo) in algos.iter().enumerate() {
                        for (case, layer) in [
                            (Case::new(&[7, 5, 12], 1 + i), 1),
                            (Case::new(&[9, 0, 4], 2 + i), 0),
                            (Case::new(&[0, 0, 11], 4 + i), 1),
                        ] {
                            let what = format!(
                                "{} {algo:?} {config:?} layer {layer} rows {:?}",
                                exec.describe(),
                                case.rank_rows
                            );
                            let (plan, bytes) = run_case(
                                exec.as_ref(),
                                lane,
                                (algo, layer),
                                &case,
                                &weights,
                                &what,
                            );
                            if algo == Algo::Quota {
                                assert!(
                                    plan.replicas() > 0,
                                    "{what}: the hot expert is replicated"
                                );
                            }
                            if !per_layer_slots {
                                assert_eq!(bytes, plan.replicas() as u64 * expert_bytes, "{what}");
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn per_layer_slots_keep_resident_replicas_instead_of_streaming_them() {
    let weights = expert_weights();
    for exec in exec::available() {
        let config = MoeConfig {
            relay: relay(),
            per_layer_slots: true,
            lanes: 1,
            ..MoeConfig::default()
        };
        let mut moe = plane(&exec, &weights, config);
        let lane = &mut moe.lanes_mut()[0];
        let case = Case::new(&[7, 5, 12], 1);
        let what = exec.describe();
        let (first, bytes) = run_case(
            exec.as_ref(),
            lane,
            (Algo::Quota, 1),
            &case,
            &weights,
            &what,
        );
        assert!(bytes > 0, "{what}: the first plan streams its replicas");
        assert_eq!(lane.resident(1).unwrap(), first.slots(), "{what}");
        // The other layer's set is untouched, and the same plan again streams nothing.
        assert!(
            lane.resident(0).unwrap().iter().all(Option::is_none),
            "{what}"
        );
        let (again, bytes) = run_case(
            exec.as_ref(),
            lane,
            (Algo::Quota, 1),
            &case,
            &weights,
            &what,
        );
        assert_eq!(again, first);
        assert_eq!(bytes, 0, "{what}: every replica was resident");
    }
}

#[test]
fn two_lanes_with_interleaved_stages_each_equal_the_reference() {
    let weights = expert_weights();
    let layout = Layout::contiguous(RANKS, EXPERTS, SLOTS).unwrap();
    for exec in exec::available() {
        let config = MoeConfig {
            relay: relay(),
            device_solver: Some((1, TargetRule::BestFit)),
            lanes: 2,
            ..MoeConfig::default()
        };
        let mut moe = plane(&exec, &weights, config);
        let cases = [Case::new(&[7, 5, 12], 1), Case::new(&[2, 9, 3], 6)];
        let layers = [1, 0];
        let (first, second) = moe.lanes_mut().split_at_mut(1);
        let lanes = [&mut first[0], &mut second[0]];
        let mut flights = Vec::new();
        let mut plans = Vec::new();
        for ((lane, case), &layer) in lanes.into_iter().zip(&cases).zip(&layers) {
            let rows = case.upload(exec.as_ref(), Stream::MAIN);
            let counted = lane.count(&rows).unwrap();
            let load = LoadMatrix::from_rows(&counted.counts).unwrap();
            let plan = lane.solve(layer, &load).unwrap().unwrap();
            assert_eq!(plan, plan_for(Algo::Quota, &layout, &load));
            let flight = lane_send(lane, (layer, &plan, &load), rows, counted);
            flights.push((lane, flight));
            plans.push(plan);
        }
        for (lane, flight) in &mut flights {
            lane.experts(flight).unwrap();
        }
        for (((lane, flight), case), &layer) in flights.into_iter().zip(&cases).zip(&layers) {
            let (_, rows) = lane.combine(flight, None).unwrap();
            exec.synchronize().unwrap();
            let got = exec.download_f32(&rows.output).unwrap();
            case.check(
                &format!("{} lane layer {layer}", exec.describe()),
                &got,
                &weights[layer],
            );
        }
    }
}

fn lane_send(
    lane: &mut MoeLane,
    at: (usize, &Plan, &LoadMatrix),
    rows: RoutedRows,
    counted: rackfill_kernels::cuda::moe::Counted,
) -> rackfill_kernels::cuda::moe::LayerInFlight {
    lane.send(at, rows, counted, None).unwrap()
}

#[test]
fn bad_routing_and_mismatched_plans_are_errors() {
    let Some(exec) = exec::available().into_iter().next() else {
        return;
    };
    let weights = expert_weights();
    let mut moe = plane(&exec, &weights, MoeConfig::default());
    let lane = &mut moe.lanes_mut()[0];
    let layout = Layout::contiguous(RANKS, EXPERTS, SLOTS).unwrap();
    let case = Case::new(&[2, 2, 2], 7);
    let mut rows = case.upload(exec.as_ref(), Stream::MAIN);
    let mut experts = case.experts.clone();
    experts[4] = EXPERTS as u32;
    rows.experts = exec.upload_u32(&experts).unwrap();
    let err = lane.count(&rows).err().expect("an expert id out of range");
    assert!(err.to_string().contains("not below 10"), "{err}");

    let mut two_ranks = case.upload(exec.as_ref(), Stream::MAIN);
    two_ranks.rank_rows = vec![3, 3];
    assert!(
        lane.count(&two_ranks).is_err(),
        "rows for two ranks of three"
    );

    let rows = case.upload(exec.as_ref(), Stream::MAIN);
    let counted = lane.count(&rows).unwrap();
    let load = LoadMatrix::from_rows(&counted.counts).unwrap();
    let other = Layout::contiguous(2, EXPERTS, SLOTS).unwrap();
    let two = LoadMatrix::from_rows(&[vec![1; EXPERTS], vec![1; EXPERTS]]).unwrap();
    let plan = plan_for(Algo::None, &other, &two);
    assert!(
        lane.send((0, &plan, &load), rows, counted, None).is_err(),
        "plan for 2 ranks"
    );
    let rows = case.upload(exec.as_ref(), Stream::MAIN);
    let counted = lane.count(&rows).unwrap();
    let output = rows.output.ptr();
    let plan = plan_for(Algo::None, &layout, &load);
    let err = lane.send((2, &plan, &load), rows, counted, None).err();
    assert!(err.is_some(), "no MoE layer 2 ({output:#x})");
}
