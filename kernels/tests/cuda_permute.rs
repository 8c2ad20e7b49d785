//! The GPU token permute, grouping, return and combine reproduce the CPU reference bit for bit
//! on plans with replicas, fed either by an uploaded CPU plan or directly by the GPU quota
//! solver's device-resident plan; bad routing is an error. GPU only (skips without one).

#![cfg(feature = "cuda")]

mod cuda_common;

use cuda_common::common::{load_of, skewed_batches, Batch, Routing};
use cuda_common::gpu_or_skip;
use rackfill_balancer::quota::{QuotaPlanner, TargetRule};
use rackfill_balancer::{Balancer, Layout, Plan};
use rackfill_kernels::cuda::permute::{self, Received, Routed};
use rackfill_kernels::cuda::solver::GpuQuotaSolver;
use rackfill_kernels::cuda::{instance_offsets, CudaError, DevicePlan, Gpu};
use rackfill_kernels::{
    combine, group_by_instance, permute_tokens, scatter_pairs, DispatchBuffers, InstanceRouter,
};

const RANKS: usize = 8;
const EXPERTS: usize = 16;
const TOP_K: usize = 4;
const HIDDEN: usize = 40;

fn batches(seed: u64) -> Vec<Batch> {
    let shape = Routing {
        ranks: RANKS,
        experts: EXPERTS,
        top_k: TOP_K,
        hidden: HIDDEN,
        hot: 5,
        base_tokens: 30,
        tokens_per_rank: 7,
    };
    skewed_batches(seed, &shape)
}

fn expert_fn(expert: u32, input: &[f32], output: &mut [f32]) {
    let scale = 0.5 + expert as f32 / 8.0;
    for (i, (o, &v)) in output.iter_mut().zip(input).enumerate() {
        *o = v * scale + (expert as f32 - (i % HIDDEN) as f32 * 0.25) * 1e-3;
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The whole EP round trip on the GPU against the CPU reference, for one plan on the device.
fn round_trip(gpu: &Gpu, plan: &Plan, device_plan: &DevicePlan, batches: &[Batch], what: &str) {
    let s = gpu.stream();
    let router = InstanceRouter::new(plan);
    let inst_offsets = instance_offsets(plan).unwrap();
    // 1. Permute on every source rank.
    let mut cpu_sent: Vec<Vec<DispatchBuffers>> = Vec::new();
    let mut gpu_sent = Vec::new();
    for (r, b) in batches.iter().enumerate() {
        let cpu = permute_tokens(r, &b.x, HIDDEN, TOP_K, &b.experts, &router).unwrap();
        let x = s.clone_htod(&b.x).unwrap();
        let experts = s.clone_htod(&b.experts).unwrap();
        let routed = Routed {
            x: &x,
            experts: &experts,
            pairs: b.experts.len(),
            hidden: HIDDEN,
            top_k: TOP_K,
        };
        let dev = permute::permute_tokens(gpu, device_plan, r, routed).unwrap();
        let rows = s.clone_dtoh(&dev.rows).unwrap();
        let pairs = s.clone_dtoh(&dev.pairs).unwrap();
        let experts = s.clone_dtoh(&dev.experts).unwrap();
        let instances = s.clone_dtoh(&dev.instances).unwrap();
        for (d, want) in cpu.iter().enumerate() {
            let seg = dev.dest_offsets[d] as usize..dev.dest_offsets[d + 1] as usize;
            assert_eq!(
                &pairs[seg.clone()],
                &want.pairs[..],
                "{what}: src {r} dst {d} pairs"
            );
            assert_eq!(&experts[seg.clone()], &want.experts[..], "{what}: experts");
            assert_eq!(
                &instances[seg.clone()],
                &want.instances[..],
                "{what}: instances"
            );
            let rows_seg = &rows[seg.start * HIDDEN..seg.end * HIDDEN];
            assert_eq!(
                bits(rows_seg),
                bits(&want.rows),
                "{what}: src {r} dst {d} rows"
            );
        }
        cpu_sent.push(cpu);
        gpu_sent.push(dev);
    }
    // 2. Group on every destination, compute, return.
    // back[dst][src]: rows destination dst returns to source src, in the order src sent them.
    let mut back: Vec<Vec<Vec<f32>>> = Vec::new();
    for dst in 0..RANKS {
        let inbox: Vec<DispatchBuffers> = cpu_sent.iter().map(|s| s[dst].clone()).collect();
        let cpu = group_by_instance(dst, &inbox, HIDDEN, &router).unwrap();
        let cat = |f: &dyn Fn(&DispatchBuffers) -> Vec<u32>| {
            inbox.iter().flat_map(f).collect::<Vec<u32>>()
        };
        let rows: Vec<f32> = inbox.iter().flat_map(|b| b.rows.clone()).collect();
        let n = rows.len() / HIDDEN;
        let d_rows = s
            .clone_htod(&if rows.is_empty() { vec![0.0] } else { rows })
            .unwrap();
        let d_experts = s
            .clone_htod(&{
                let v = cat(&|b| b.experts.clone());
                if v.is_empty() {
                    vec![0]
                } else {
                    v
                }
            })
            .unwrap();
        let d_inst = s
            .clone_htod(&{
                let v = cat(&|b| b.instances.clone());
                if v.is_empty() {
                    vec![0]
                } else {
                    v
                }
            })
            .unwrap();
        let received = Received {
            rows: &d_rows,
            experts: &d_experts,
            instances: &d_inst,
            len: n,
            hidden: HIDDEN,
        };
        let groups =
            permute::group_by_instance(gpu, device_plan, &inst_offsets, dst, received).unwrap();
        assert_eq!(groups.groups(), cpu.groups(), "{what}: dst {dst} groups");
        let grouped = s.clone_dtoh(&groups.rows).unwrap();
        assert_eq!(
            bits(&grouped[..n * HIDDEN]),
            bits(cpu.rows()),
            "{what}: dst {dst} grouped rows"
        );
        let mut outputs = vec![0f32; (n * HIDDEN).max(1)];
        for g in cpu.groups() {
            let range = g.rows.start * HIDDEN..g.rows.end * HIDDEN;
            expert_fn(g.expert, &cpu.rows()[range.clone()], &mut outputs[range]);
        }
        let cpu_back = cpu.return_outputs(&outputs[..n * HIDDEN]).unwrap();
        let gpu_back = s
            .clone_dtoh(
                &groups
                    .return_outputs(gpu, &s.clone_htod(&outputs).unwrap())
                    .unwrap(),
            )
            .unwrap();
        let cpu_cat: Vec<f32> = cpu_back.iter().flatten().copied().collect();
        assert_eq!(
            bits(&gpu_back[..n * HIDDEN]),
            bits(&cpu_cat),
            "{what}: dst {dst} returned"
        );
        back.push(cpu_back);
    }
    // 3. Combine on every source rank.
    for (r, b) in batches.iter().enumerate() {
        let tokens = b.experts.len() / TOP_K;
        let mut pair_outputs = vec![0f32; b.experts.len() * HIDDEN];
        let mut send_layout = Vec::new();
        for (dst, from_dst) in back.iter().enumerate() {
            scatter_pairs(
                &mut pair_outputs,
                HIDDEN,
                &cpu_sent[r][dst].pairs,
                &from_dst[r],
            )
            .unwrap();
            send_layout.extend_from_slice(&from_dst[r]);
        }
        let want = combine(&pair_outputs, &b.weights, tokens, TOP_K, HIDDEN).unwrap();
        let rows = s.clone_htod(&send_layout).unwrap();
        let weights = s.clone_htod(&b.weights).unwrap();
        let got =
            permute::combine(gpu, &gpu_sent[r], &rows, &weights, tokens, TOP_K, HIDDEN).unwrap();
        assert_eq!(
            bits(&s.clone_dtoh(&got).unwrap()),
            bits(&want),
            "{what}: src {r} combine"
        );
    }
}

#[test]
fn gpu_round_trip_is_bitwise_equal_to_the_cpu_reference() {
    let Some(gpu) = gpu_or_skip("gpu_round_trip_is_bitwise_equal_to_the_cpu_reference") else {
        return;
    };
    let layout = Layout::contiguous(RANKS, EXPERTS, 2).unwrap();
    for seed in 0..4 {
        let batches = batches(seed);
        let load = load_of(&batches, EXPERTS);
        let plan = QuotaPlanner::new(1).plan(&layout, &load).unwrap();
        assert!(plan.replicas() > 0);
        let uploaded = DevicePlan::upload(&gpu, &plan).unwrap();
        round_trip(
            &gpu,
            &plan,
            &uploaded,
            &batches,
            &format!("seed {seed}, uploaded plan"),
        );
        // The solver's outputs feed the permute directly, without a host round trip.
        let mut solver = GpuQuotaSolver::new(&gpu, &layout, 1, TargetRule::BestFit).unwrap();
        solver.solve(&load).unwrap();
        round_trip(
            &gpu,
            &plan,
            solver.device_plan(),
            &batches,
            &format!("seed {seed}, solver plan"),
        );
    }
}

#[test]
fn gpu_permute_rejects_bad_experts_and_misrouted_rows() {
    let Some(gpu) = gpu_or_skip("gpu_permute_rejects_bad_experts_and_misrouted_rows") else {
        return;
    };
    let s = gpu.stream();
    let batches = batches(1);
    let layout = Layout::contiguous(RANKS, EXPERTS, 2).unwrap();
    let plan = QuotaPlanner::new(1)
        .plan(&layout, &load_of(&batches, EXPERTS))
        .unwrap();
    let device_plan = DevicePlan::upload(&gpu, &plan).unwrap();
    let b = &batches[0];
    let mut experts = b.experts.clone();
    experts[3] = EXPERTS as u32;
    let x = s.clone_htod(&b.x).unwrap();
    let d_experts = s.clone_htod(&experts).unwrap();
    let routed = Routed {
        x: &x,
        experts: &d_experts,
        pairs: experts.len(),
        hidden: HIDDEN,
        top_k: TOP_K,
    };
    assert!(matches!(
        permute::permute_tokens(&gpu, &device_plan, 0, routed),
        Err(CudaError::DeviceInput { count: 1, .. })
    ));
    let routed = Routed {
        pairs: experts.len() - 1,
        ..routed
    };
    assert!(permute::permute_tokens(&gpu, &device_plan, 0, routed).is_err());
    // A row for an instance rank 1 does not compute.
    let rows = s.clone_htod(&vec![0f32; HIDDEN]).unwrap();
    let home_of_0 = layout.home(0);
    let other = (home_of_0 + 1) % RANKS;
    let e = s.clone_htod(&[0u32]).unwrap();
    let i = s.clone_htod(&[0u32]).unwrap();
    let received = Received {
        rows: &rows,
        experts: &e,
        instances: &i,
        len: 1,
        hidden: HIDDEN,
    };
    let offsets = instance_offsets(&plan).unwrap();
    assert!(matches!(
        permute::group_by_instance(&gpu, &device_plan, &offsets, other, received),
        Err(CudaError::DeviceInput { count: 1, .. })
    ));
    assert!(permute::group_by_instance(&gpu, &device_plan, &offsets, home_of_0, received).is_ok());
    // Host offsets of another shape are refused before anything runs.
    let short = &offsets[..offsets.len() - 1];
    assert!(permute::group_by_instance(&gpu, &device_plan, short, home_of_0, received).is_err());
}
