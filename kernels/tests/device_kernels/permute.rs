//! The token permute kernels (`permute.cu`), the return gather (`glue.cu`'s `gather_rows_f32`)
//! and the weighted combine (`model.cu`'s `combine_topk_rows`) against the CPU data plane
//! ([`rackfill_kernels::permute`]), launched the way the MoE data plane chains them: bitwise
//! equal rows (bf16-representable activations, so the bf16 rows hold the CPU's f32 values
//! exactly), indices, group offsets and sums; bad experts and misrouted rows counted.

use super::cuda_common::{default_devices, read_u32, upload_u32, upload_u64, zeroed, Rng};
use rackfill_balancer::quota::QuotaPlanner;
use rackfill_balancer::{Balancer, Layout, LoadMatrix, Plan};
use rackfill_kernels::cuda::exec::{
    round_bf16, DeviceBuffer, Executor, ExecutorExt, KernelArg, Launch,
};
use rackfill_kernels::cuda::PlanArrays;
use rackfill_kernels::{
    combine, group_by_instance, permute_tokens, scatter_pairs, DispatchBuffers, InstanceRouter,
};

/// A plan's arrays on the device, as the permute kernels read them.
struct DeviceArrays {
    inst_offsets: DeviceBuffer,
    inst_rank: DeviceBuffer,
    split_offsets: DeviceBuffer,
    cumulative: DeviceBuffer,
    /// Global instances (`inst_offsets[E]`).
    instances: usize,
}

impl DeviceArrays {
    fn upload(exec: &dyn Executor, a: &PlanArrays) -> Self {
        Self {
            inst_offsets: upload_u32(exec, &a.inst_offsets),
            inst_rank: upload_u32(exec, &a.inst_rank),
            split_offsets: upload_u32(exec, &a.split_offsets),
            cumulative: upload_u64(exec, &a.cumulative),
            instances: *a.inst_offsets.last().unwrap() as usize,
        }
    }
}

/// How the kernels of one case are launched: warps of the ranking block, and the grid of the
/// grid-stride kernels (fewer blocks than rows, and block sizes that are not warp multiples).
#[derive(Debug, Clone, Copy)]
struct Geometry {
    warps: u32,
    blocks: u32,
    threads: u32,
}

impl Geometry {
    fn random(rng: &mut Rng) -> Self {
        Self {
            warps: 1 + rng.below(4) as u32,
            blocks: 1 + rng.below(3) as u32,
            threads: [7, 32, 96, 256][rng.below(4) as usize],
        }
    }

    fn grid(&self) -> Launch {
        Launch::blocks(self.blocks, self.threads)
    }
}

/// `stable_rank_by_key` over `n` keys: each key's position among equal keys, the exclusive prefix
/// of the key counts (`n_keys + 1` words), and how many keys were out of range.
struct Ranked {
    pos: DeviceBuffer,
    offsets: DeviceBuffer,
    bad: u32,
}

fn rank_by_key(
    exec: &dyn Executor,
    keys: &DeviceBuffer,
    n: usize,
    n_keys: usize,
    warps: u32,
) -> Ranked {
    let pos = zeroed(exec, 4 * n);
    let offsets = zeroed(exec, 4 * (n_keys + 1));
    let bad = zeroed(exec, 4);
    let launch = Launch {
        grid: [1, 1, 1],
        block: warps * 32,
        shared_bytes: ((warps as usize + 1) * n_keys * 4) as u32,
    };
    let args = [
        KernelArg::from(keys),
        KernelArg::U32(n as u32),
        KernelArg::U32(n_keys as u32),
        KernelArg::from(&pos),
        KernelArg::from(&offsets),
        KernelArg::from(&bad),
    ];
    // SAFETY: `stable_rank_by_key(keys[n], n, n_keys, out_pos[n], out_offsets[n_keys + 1],
    // out_bad)` with the `(warps + 1) * n_keys` words of shared memory it carves.
    unsafe { exec.launch("stable_rank_by_key", launch, &args) }.unwrap();
    let bad = read_u32(exec, &bad, 1)[0];
    Ranked { pos, offsets, bad }
}

/// One source rank's pairs permuted on the device into its send layout.
struct DeviceSent {
    dest_offsets: Vec<u32>,
    pairs: Vec<u32>,
    experts: Vec<u32>,
    instances: Vec<u32>,
    /// bf16 rows widened to f32.
    rows: Vec<f32>,
    /// Pair to its row in the send layout.
    row_of: DeviceBuffer,
}

/// The source side: ranking by expert, instance lookup, ranking by destination, scatter; or the
/// number of pairs the ranking by destination reported as bad.
fn permute_on_device(
    exec: &dyn Executor,
    plan: &DeviceArrays,
    (ranks, experts): (usize, usize),
    src: usize,
    (x, hidden, top_k): (&[f32], usize, usize),
    routed: &[u32],
    g: Geometry,
) -> Result<DeviceSent, u32> {
    let n = routed.len();
    let d_experts = upload_u32(exec, routed);
    // As the data plane does, the ranking by expert is not checked: an expert out of range gets
    // no instance and no destination, and the ranking by destination counts it.
    let occurrence = rank_by_key(exec, &d_experts, n, experts, g.warps);
    let (instance, dest) = (zeroed(exec, 4 * n), zeroed(exec, 4 * n));
    let args = [
        KernelArg::from(&d_experts),
        KernelArg::from(&occurrence.pos),
        KernelArg::U32(n as u32),
        KernelArg::U32(src as u32),
        KernelArg::U32(experts as u32),
        KernelArg::from(&plan.inst_offsets),
        KernelArg::from(&plan.inst_rank),
        KernelArg::from(&plan.split_offsets),
        KernelArg::from(&plan.cumulative),
        KernelArg::from(&instance),
        KernelArg::from(&dest),
    ];
    // SAFETY: `lookup_instance(experts[n], occ[n], n, src_rank, n_experts, inst_offsets,
    // inst_rank, split_offsets, cumulative, out_instance[n], out_dest[n])` on a plan's arrays.
    unsafe { exec.launch("lookup_instance", g.grid(), &args) }.unwrap();
    let by_dest = rank_by_key(exec, &dest, n, ranks, g.warps);
    if by_dest.bad != 0 {
        return Err(by_dest.bad);
    }
    let d_x = exec
        .upload_bf16(if x.is_empty() { &[0.0] } else { x })
        .unwrap();
    let rows = zeroed(exec, 2 * n * hidden);
    let [pairs, out_experts, out_instances, row_of] = [(); 4].map(|()| zeroed(exec, 4 * n));
    let args = [
        KernelArg::from(&d_x),
        KernelArg::U32(n as u32),
        KernelArg::U32(hidden as u32),
        KernelArg::U32(top_k as u32),
        KernelArg::from(&dest),
        KernelArg::from(&by_dest.pos),
        KernelArg::from(&by_dest.offsets),
        KernelArg::from(&d_experts),
        KernelArg::from(&instance),
        KernelArg::from(&rows),
        KernelArg::from(&pairs),
        KernelArg::from(&out_experts),
        KernelArg::from(&out_instances),
        KernelArg::from(&row_of),
    ];
    // SAFETY: `scatter_rows_bf16` of `n` pairs reading `n / top_k` token rows of `hidden` bf16;
    // every output holds `n` rows or words (the destinations' segments partition them).
    unsafe { exec.launch("scatter_rows_bf16", g.grid(), &args) }.unwrap();
    let rows = exec.download_bf16(&rows).unwrap();
    Ok(DeviceSent {
        dest_offsets: read_u32(exec, &by_dest.offsets, ranks + 1),
        pairs: read_u32(exec, &pairs, n),
        experts: read_u32(exec, &out_experts, n),
        instances: read_u32(exec, &out_instances, n),
        rows: rows[..n * hidden].to_vec(),
        row_of,
    })
}

/// A destination's received rows grouped on the device.
struct DeviceGrouped {
    /// Exclusive prefix of rows per global instance.
    offsets: Vec<u32>,
    /// bf16 rows widened to f32.
    rows: Vec<f32>,
    /// Received row to its grouped row.
    row_of: DeviceBuffer,
}

/// The destination side: instance keys, ranking by instance, scatter into groups; or the number
/// of rows reported as not computed on `rank`.
fn group_on_device(
    exec: &dyn Executor,
    plan: &DeviceArrays,
    (rank, experts): (usize, usize),
    (ids, instances, rows, hidden): (&[u32], &[u32], &[f32], usize),
    g: Geometry,
) -> Result<DeviceGrouped, u32> {
    let m = ids.len();
    let (d_ids, d_instances) = (upload_u32(exec, ids), upload_u32(exec, instances));
    let key = zeroed(exec, 4 * m);
    let args = [
        KernelArg::from(&d_ids),
        KernelArg::from(&d_instances),
        KernelArg::U32(m as u32),
        KernelArg::U32(experts as u32),
        KernelArg::U32(rank as u32),
        KernelArg::from(&plan.inst_offsets),
        KernelArg::from(&plan.inst_rank),
        KernelArg::from(&key),
    ];
    // SAFETY: `instance_keys(experts[m], instances[m], m, n_experts, rank, inst_offsets,
    // inst_rank, out_key[m])`.
    unsafe { exec.launch("instance_keys", g.grid(), &args) }.unwrap();
    let ranked = rank_by_key(exec, &key, m, plan.instances, g.warps);
    if ranked.bad != 0 {
        return Err(ranked.bad);
    }
    let d_rows = exec
        .upload_bf16(if rows.is_empty() { &[0.0] } else { rows })
        .unwrap();
    let grouped = zeroed(exec, 2 * m * hidden);
    let (index, row_of) = (zeroed(exec, 4 * m), zeroed(exec, 4 * m));
    let args = [
        KernelArg::from(&d_rows),
        KernelArg::U32(m as u32),
        KernelArg::U32(hidden as u32),
        KernelArg::U32(1),
        KernelArg::from(&key),
        KernelArg::from(&ranked.pos),
        KernelArg::from(&ranked.offsets),
        KernelArg::Ptr(0),
        KernelArg::Ptr(0),
        KernelArg::from(&grouped),
        KernelArg::from(&index),
        KernelArg::Ptr(0),
        KernelArg::Ptr(0),
        KernelArg::from(&row_of),
    ];
    // SAFETY: `scatter_rows_bf16` of `m` received rows into `m` grouped rows; the metadata
    // arrays are null, which the kernel skips.
    unsafe { exec.launch("scatter_rows_bf16", g.grid(), &args) }.unwrap();
    let rows = exec.download_bf16(&grouped).unwrap();
    Ok(DeviceGrouped {
        offsets: read_u32(exec, &ranked.offsets, plan.instances + 1),
        rows: rows[..m * hidden].to_vec(),
        row_of,
    })
}

/// Rows `x[rows[i]]` of `dim` f32 by `gather_rows_f32`.
fn gather_on_device(
    exec: &dyn Executor,
    x: &[f32],
    dim: usize,
    rows: &DeviceBuffer,
    n: usize,
    g: Geometry,
) -> Vec<f32> {
    let d_x = exec
        .upload_f32(if x.is_empty() { &[0.0] } else { x })
        .unwrap();
    let out = zeroed(exec, 4 * n * dim);
    let args = [
        KernelArg::from(&d_x),
        KernelArg::U32(dim as u32),
        KernelArg::from(rows),
        KernelArg::U32(n as u32),
        KernelArg::from(&out),
    ];
    // SAFETY: `gather_rows_f32(x[*, dim], dim, rows[n], n, out[n, dim])`; every row index is a
    // row of `x`.
    unsafe { exec.launch("gather_rows_f32", g.grid(), &args) }.unwrap();
    exec.download_f32(&out).unwrap()[..n * dim].to_vec()
}

/// `base + the router-weighted sum` by `combine_topk_rows` over the outputs in send layout.
fn combine_on_device(
    exec: &dyn Executor,
    outputs: &[f32],
    row_of: &DeviceBuffer,
    weights: &[f32],
    (tokens, top_k, hidden): (usize, usize, usize),
    base: &[f32],
    g: Geometry,
) -> Vec<f32> {
    let d_outputs = exec
        .upload_f32(if outputs.is_empty() { &[0.0] } else { outputs })
        .unwrap();
    let d_weights = exec
        .upload_f32(if weights.is_empty() { &[0.0] } else { weights })
        .unwrap();
    let out = zeroed(exec, 4 * tokens * hidden);
    exec.write(
        &out,
        0,
        &base
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>(),
    )
    .unwrap();
    let args = [
        KernelArg::from(&d_outputs),
        KernelArg::from(row_of),
        KernelArg::from(&d_weights),
        KernelArg::U32(tokens as u32),
        KernelArg::U32(top_k as u32),
        KernelArg::U32(hidden as u32),
        KernelArg::from(&out),
    ];
    // SAFETY: `combine_topk_rows(expert_out[n, H], pair_row[n], weights[n], tokens, k, hidden,
    // out[tokens, H])` with `n = tokens * k`.
    unsafe { exec.launch("combine_topk_rows", g.grid(), &args) }.unwrap();
    exec.download_f32(&out).unwrap()[..tokens * hidden].to_vec()
}

/// A stand-in expert: full-precision f32 outputs that differ per expert.
fn expert_fn(expert: u32, input: &[f32], hidden: usize) -> Vec<f32> {
    let scale = 0.5 + expert as f32 / 8.0;
    input
        .iter()
        .enumerate()
        .map(|(i, &v)| v * scale + (expert as f32 - (i % hidden) as f32 * 0.25) * 1e-3 + 1e-7)
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// One random routed batch per rank: token rows (bf16-representable), `top_k` distinct experts
/// per token (expert 1 hot), router weights.
fn batches(
    rng: &mut Rng,
    ranks: usize,
    experts: usize,
    (top_k, hidden): (usize, usize),
) -> Vec<(Vec<f32>, Vec<u32>, Vec<f32>)> {
    (0..ranks)
        .map(|_| {
            let tokens = rng.below(70) as usize;
            let mut routed = Vec::new();
            for _ in 0..tokens {
                let mut chosen: Vec<u32> = Vec::new();
                if rng.below(10) < 7 {
                    chosen.push(1);
                }
                while chosen.len() < top_k {
                    let e = rng.below(experts as u64) as u32;
                    if !chosen.contains(&e) {
                        chosen.push(e);
                    }
                }
                routed.extend(chosen);
            }
            let x = (0..tokens * hidden)
                .map(|_| round_bf16(rng.unit()))
                .collect();
            let w = (0..tokens * top_k).map(|_| rng.unit()).collect();
            (x, routed, w)
        })
        .collect()
}

fn plan_for(layout: &Layout, batches: &[(Vec<f32>, Vec<u32>, Vec<f32>)]) -> Plan {
    let mut load = LoadMatrix::zeros(layout.ranks(), layout.experts());
    for (r, (_, routed, _)) in batches.iter().enumerate() {
        for &e in routed {
            *load.get_mut(r, e as usize) += 1;
        }
    }
    QuotaPlanner::new(1).plan(layout, &load).unwrap()
}

#[test]
fn permute_group_return_and_combine_are_bitwise_equal_to_the_cpu_data_plane() {
    for device in default_devices() {
        let exec = device.exec.as_ref();
        let mut replicated = 0;
        for case in 0..16u64 {
            let mut rng = Rng(case + 100);
            let ranks = 2 + rng.below(6) as usize;
            let experts = 4 + rng.below(20) as usize;
            let top_k = 1 + rng.below(4) as usize;
            let hidden = 1 + rng.below(40) as usize;
            let g = Geometry::random(&mut rng);
            let layout = Layout::contiguous(ranks, experts, 2).unwrap();
            let batches = batches(&mut rng, ranks, experts, (top_k, hidden));
            let plan = plan_for(&layout, &batches);
            replicated += usize::from(plan.replicas() > 0);
            let router = InstanceRouter::new(&plan);
            let arrays = PlanArrays::from_plan(&plan).unwrap();
            let d_plan = DeviceArrays::upload(exec, &arrays);
            let what = format!(
                "{} case {case} {g:?} hidden {hidden} top_k {top_k}",
                device.name()
            );

            // The source side, and the combine of outputs returned into each send layout.
            let mut sent: Vec<Vec<DispatchBuffers>> = Vec::new();
            for (r, (x, routed, w)) in batches.iter().enumerate() {
                let cpu = permute_tokens(r, x, hidden, top_k, routed, &router).unwrap();
                let dims = (ranks, experts);
                let row_shape = (x.as_slice(), hidden, top_k);
                let got = permute_on_device(exec, &d_plan, dims, r, row_shape, routed, g)
                    .unwrap_or_else(|bad| panic!("{what}: {bad} bad pairs"));
                for (d, want) in cpu.iter().enumerate() {
                    let seg = got.dest_offsets[d] as usize..got.dest_offsets[d + 1] as usize;
                    let what = format!("{what}: src {r} dst {d}");
                    assert_eq!(got.pairs[seg.clone()], want.pairs, "{what}: pairs");
                    assert_eq!(got.experts[seg.clone()], want.experts, "{what}: experts");
                    assert_eq!(
                        got.instances[seg.clone()],
                        want.instances,
                        "{what}: instances"
                    );
                    let rows = &got.rows[seg.start * hidden..seg.end * hidden];
                    assert_eq!(bits(rows), bits(&want.rows), "{what}: rows");
                }
                // Each pair's output, in the send layout (as the experts' results come back).
                let outputs: Vec<f32> = got
                    .experts
                    .iter()
                    .zip(got.rows.chunks(hidden.max(1)))
                    .flat_map(|(&e, row)| expert_fn(e, row, hidden))
                    .collect();
                let mut pair_outputs = vec![0f32; routed.len() * hidden];
                for want in &cpu {
                    let seg: Vec<f32> = want
                        .experts
                        .iter()
                        .zip(want.rows.chunks(hidden.max(1)))
                        .flat_map(|(&e, row)| expert_fn(e, row, hidden))
                        .collect();
                    scatter_pairs(&mut pair_outputs, hidden, &want.pairs, &seg).unwrap();
                }
                let tokens = routed.len() / top_k;
                let combined = combine(&pair_outputs, w, tokens, top_k, hidden).unwrap();
                let base: Vec<f32> = (0..tokens * hidden).map(|_| rng.unit()).collect();
                let want: Vec<f32> = base.iter().zip(&combined).map(|(b, c)| b + c).collect();
                let shape = (tokens, top_k, hidden);
                let got = combine_on_device(exec, &outputs, &got.row_of, w, shape, &base, g);
                assert_eq!(bits(&got), bits(&want), "{what}: src {r} combine");
                // Two routed experts out of range: reported by the ranking by destination.
                if !routed.is_empty() {
                    let mut bad = routed.clone();
                    bad[0] = experts as u32;
                    *bad.last_mut().unwrap() = u32::MAX;
                    let want = if bad.len() == 1 { 1 } else { 2 };
                    let got = permute_on_device(exec, &d_plan, dims, r, row_shape, &bad, g);
                    assert_eq!(got.err(), Some(want), "{what}: src {r} bad experts");
                }
                sent.push(cpu);
            }

            // The destination side: grouping, the experts, the return to received order.
            for dst in 0..ranks {
                let inbox: Vec<DispatchBuffers> = sent.iter().map(|s| s[dst].clone()).collect();
                let cpu = group_by_instance(dst, &inbox, hidden, &router).unwrap();
                let ids: Vec<u32> = inbox.iter().flat_map(|b| b.experts.clone()).collect();
                let instances: Vec<u32> = inbox.iter().flat_map(|b| b.instances.clone()).collect();
                let rows: Vec<f32> = inbox.iter().flat_map(|b| b.rows.clone()).collect();
                let what = format!("{what}: dst {dst}");
                let got = group_on_device(
                    exec,
                    &d_plan,
                    (dst, experts),
                    (&ids, &instances, &rows, hidden),
                    g,
                )
                .unwrap_or_else(|bad| panic!("{what}: {bad} misrouted rows"));
                let mut groups = Vec::new();
                for e in 0..experts {
                    for key in arrays.inst_offsets[e]..arrays.inst_offsets[e + 1] {
                        let (lo, hi) = (
                            got.offsets[key as usize] as usize,
                            got.offsets[key as usize + 1] as usize,
                        );
                        if hi > lo {
                            groups.push((e as u32, key - arrays.inst_offsets[e], lo..hi));
                        }
                    }
                }
                let want: Vec<_> = cpu
                    .groups()
                    .iter()
                    .map(|g| (g.expert, g.instance, g.rows.clone()))
                    .collect();
                assert_eq!(groups, want, "{what}: groups");
                assert_eq!(bits(&got.rows), bits(cpu.rows()), "{what}: grouped rows");
                let mut outputs = vec![0f32; rows.len()];
                for group in cpu.groups() {
                    let range = group.rows.start * hidden..group.rows.end * hidden;
                    outputs[range.clone()].copy_from_slice(&expert_fn(
                        group.expert,
                        &cpu.rows()[range],
                        hidden,
                    ));
                }
                let back = gather_on_device(exec, &outputs, hidden, &got.row_of, ids.len(), g);
                let want: Vec<f32> = cpu.return_outputs(&outputs).unwrap().concat();
                assert_eq!(bits(&back), bits(&want), "{what}: returned");
                // A row for an instance computed elsewhere is counted, not grouped.
                if let Some(first) = ids.first() {
                    let e = *first as usize;
                    let owners = &arrays.inst_rank
                        [arrays.inst_offsets[e] as usize..arrays.inst_offsets[e + 1] as usize];
                    if let Some(other) = (0..ranks).find(|r| !owners.contains(&(*r as u32))) {
                        let got = group_on_device(
                            exec,
                            &d_plan,
                            (other, experts),
                            (&ids[..1], &instances[..1], &rows[..hidden], hidden),
                            g,
                        );
                        assert_eq!(
                            got.err(),
                            Some(1),
                            "{what}: a misrouted row on rank {other}"
                        );
                    }
                }
            }
        }
        assert!(replicated >= 8, "only {replicated} cases replicated");
    }
}
