//! Token permute, grouping, return and combine on plans with replicas: every instance receives
//! exactly its quota, rows are the source rows, and the EP round trip is bitwise equal to the
//! dense weighted sum.

use rackfill_balancer::{Algo, Layout, Plan, Settings};
use rackfill_kernels::{
    combine, group_by_instance, permute_tokens, remote_recv_bytes, scatter_pairs, DispatchBuffers,
    InstanceRouter, KernelError, IDS_PER_ROW,
};
use std::collections::BTreeMap;

const RANKS: usize = 8;
const EXPERTS: usize = 16;
const TOP_K: usize = 4;
const HIDDEN: usize = 8;

mod common;

use common::{load_of, skewed_batches, Batch, Rng, Routing};

fn tokens(b: &Batch) -> usize {
    b.experts.len() / TOP_K
}

/// Skewed routing: most tokens pick expert 3 first, so the planner replicates it.
fn batches(seed: u64) -> Vec<Batch> {
    let shape = Routing {
        ranks: RANKS,
        experts: EXPERTS,
        top_k: TOP_K,
        hidden: HIDDEN,
        hot: 3,
        base_tokens: 40,
        tokens_per_rank: 10,
    };
    skewed_batches(seed, &shape)
}

fn plan_for(batches: &[Batch]) -> Plan {
    let load = load_of(batches, EXPERTS);
    let layout = Layout::contiguous(RANKS, EXPERTS, 2).unwrap();
    let mut planner = Algo::Quota.build(&Settings::default());
    let plan = planner.plan(&layout, &load).unwrap();
    plan.validate(&layout, &load, planner.u_min()).unwrap();
    assert!(plan.replicas() > 0, "the skewed load must produce replicas");
    plan
}

/// A row-wise stand-in for an expert FFN: each output row depends only on its input row and the
/// expert, so where and in which batch a row is computed cannot change it.
fn expert_fn(expert: u32, input: &[f32], output: &mut [f32]) {
    let scale = 0.5 + expert as f32 / 8.0;
    for (i, (o, &v)) in output.iter_mut().zip(input).enumerate() {
        *o = v * scale + (expert as f32 - (i % HIDDEN) as f32 * 0.25) * 1e-3;
    }
}

/// Every source's buffers, `sent[src][dst]`.
fn dispatch(batches: &[Batch], router: &InstanceRouter) -> Vec<Vec<DispatchBuffers>> {
    batches
        .iter()
        .enumerate()
        .map(|(r, b)| permute_tokens(r, &b.x, HIDDEN, TOP_K, &b.experts, router).unwrap())
        .collect()
}

#[test]
fn each_instance_receives_exactly_its_quota_of_source_rows() {
    for seed in 0..4 {
        let batches = batches(seed);
        let plan = plan_for(&batches);
        let router = InstanceRouter::new(&plan);
        let sent = dispatch(&batches, &router);
        let mut received: BTreeMap<(u32, u32), u64> = BTreeMap::new();
        for (src, bufs) in sent.iter().enumerate() {
            assert_eq!(bufs.len(), RANKS);
            let b = &batches[src];
            let mut pairs_seen = 0;
            for (dst, buf) in bufs.iter().enumerate() {
                assert!(buf.pairs.windows(2).all(|w| w[0] < w[1]), "pair order");
                for i in 0..buf.len() {
                    let (p, e, inst) = (buf.pairs[i] as usize, buf.experts[i], buf.instances[i]);
                    assert_eq!(b.experts[p], e);
                    let instance = plan.instances(e as usize)[inst as usize];
                    assert_eq!(instance.rank as usize, dst);
                    let token = p / TOP_K;
                    assert_eq!(
                        &buf.rows[i * HIDDEN..(i + 1) * HIDDEN],
                        &b.x[token * HIDDEN..(token + 1) * HIDDEN]
                    );
                    *received.entry((e, inst)).or_default() += 1;
                }
                pairs_seen += buf.len();
            }
            assert_eq!(pairs_seen, b.experts.len());
        }
        for e in 0..EXPERTS {
            for (inst, instance) in plan.instances(e).iter().enumerate() {
                let got = received.get(&(e as u32, inst as u32)).copied();
                assert_eq!(
                    got.unwrap_or(0),
                    instance.quota,
                    "expert {e} instance {inst}"
                );
            }
        }
    }
}

/// Dense reference: every pair computed in place, summed in k order from zero.
fn dense(b: &Batch) -> Vec<f32> {
    let mut out = vec![0f32; tokens(b) * HIDDEN];
    let mut y = vec![0f32; HIDDEN];
    for t in 0..tokens(b) {
        for k in 0..TOP_K {
            let p = t * TOP_K + k;
            expert_fn(b.experts[p], &b.x[t * HIDDEN..(t + 1) * HIDDEN], &mut y);
            for (o, &v) in out[t * HIDDEN..(t + 1) * HIDDEN].iter_mut().zip(&y) {
                *o += b.weights[p] * v;
            }
        }
    }
    out
}

#[test]
fn ep_round_trip_is_bitwise_equal_to_the_dense_path() {
    for seed in 0..4 {
        let batches = batches(seed);
        let plan = plan_for(&batches);
        let router = InstanceRouter::new(&plan);
        let sent = dispatch(&batches, &router);
        // returned[dst][src]: what destination dst sends back to source src.
        let mut returned = Vec::new();
        for dst in 0..RANKS {
            let inbox: Vec<DispatchBuffers> = sent.iter().map(|s| s[dst].clone()).collect();
            let grouped = group_by_instance(dst, &inbox, HIDDEN, &router).unwrap();
            let mut last = None;
            for g in grouped.groups() {
                assert!(Some((g.expert, g.instance)) > last, "groups ascending");
                last = Some((g.expert, g.instance));
                assert_eq!(
                    plan.instances(g.expert as usize)[g.instance as usize].rank as usize,
                    dst
                );
                assert_eq!(grouped.block(g).unwrap().len(), g.rows.len() * HIDDEN);
            }
            let back = grouped
                .run(|g, input, output| {
                    expert_fn(g.expert, input, output);
                    Ok::<(), KernelError>(())
                })
                .unwrap();
            // The same through a gathered output computed elsewhere.
            let mut gathered = vec![0f32; grouped.rows().len()];
            for g in grouped.groups() {
                let range = g.rows.start * HIDDEN..g.rows.end * HIDDEN;
                expert_fn(
                    g.expert,
                    &grouped.rows()[range.clone()],
                    &mut gathered[range],
                );
            }
            assert_eq!(grouped.return_outputs(&gathered).unwrap(), back);
            assert!(matches!(
                grouped.return_outputs(&gathered[1..]),
                Err(KernelError::Length { .. })
            ));
            returned.push(back);
        }
        for (src, b) in batches.iter().enumerate() {
            let mut pair_outputs = vec![f32::NAN; b.experts.len() * HIDDEN];
            for dst in 0..RANKS {
                let rows = &returned[dst][src];
                scatter_pairs(&mut pair_outputs, HIDDEN, &sent[src][dst].pairs, rows).unwrap();
            }
            assert!(
                pair_outputs.iter().all(|v| !v.is_nan()),
                "every pair returned"
            );
            let ep = combine(&pair_outputs, &b.weights, tokens(b), TOP_K, HIDDEN).unwrap();
            let reference = dense(b);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&ep), bits(&reference), "seed {seed} source {src}");
        }
    }
}

#[test]
fn combine_is_the_weighted_sum_in_choice_order() {
    let mut rng = Rng(99);
    let (tokens, top_k, hidden) = (5, 3, 4);
    let pair_outputs: Vec<f32> = (0..tokens * top_k * hidden).map(|_| rng.unit()).collect();
    let weights: Vec<f32> = (0..tokens * top_k).map(|_| rng.unit()).collect();
    let out = combine(&pair_outputs, &weights, tokens, top_k, hidden).unwrap();
    for t in 0..tokens {
        for h in 0..hidden {
            let mut naive = 0f32;
            for k in 0..top_k {
                let p = t * top_k + k;
                naive += weights[p] * pair_outputs[p * hidden + h];
            }
            assert_eq!(out[t * hidden + h].to_bits(), naive.to_bits());
        }
    }
    assert!(matches!(
        combine(&pair_outputs, &weights[1..], tokens, top_k, hidden),
        Err(KernelError::Length {
            what: "weights",
            ..
        })
    ));
    assert!(matches!(
        combine(&pair_outputs[1..], &weights, tokens, top_k, hidden),
        Err(KernelError::Length {
            what: "pair_outputs",
            ..
        })
    ));
    assert!(matches!(
        combine(&pair_outputs, &weights, tokens, top_k, 0),
        Err(KernelError::ZeroDimension { .. })
    ));
    assert!(matches!(
        combine(&[], &[], usize::MAX, 2, 1),
        Err(KernelError::Overflow { .. })
    ));
}

#[test]
fn bad_permute_input_is_an_error() {
    let batches = batches(5);
    let plan = plan_for(&batches);
    let router = InstanceRouter::new(&plan);
    let b = &batches[0];
    let mut experts = b.experts.clone();
    experts[6] = EXPERTS as u32;
    assert!(matches!(
        permute_tokens(0, &b.x, HIDDEN, TOP_K, &experts, &router),
        Err(KernelError::ExpertOutOfRange { pair: 6, .. })
    ));
    assert!(matches!(
        permute_tokens(0, &b.x, HIDDEN, TOP_K, &b.experts[1..], &router),
        Err(KernelError::NotMultiple { .. })
    ));
    assert!(matches!(
        permute_tokens(0, &b.x[1..], HIDDEN, TOP_K, &b.experts, &router),
        Err(KernelError::Length { what: "x", .. })
    ));
    assert!(matches!(
        permute_tokens(RANKS, &b.x, HIDDEN, TOP_K, &b.experts, &router),
        Err(KernelError::OutOfRange { .. })
    ));
    assert!(matches!(
        permute_tokens(0, &b.x, 0, TOP_K, &b.experts, &router),
        Err(KernelError::ZeroDimension { what: "hidden" })
    ));
    assert!(matches!(
        permute_tokens(0, &b.x, HIDDEN, 0, &b.experts, &router),
        Err(KernelError::ZeroDimension { what: "top_k" })
    ));
}

#[test]
fn bad_received_and_returned_buffers_are_errors() {
    let batches = batches(6);
    let plan = plan_for(&batches);
    let router = InstanceRouter::new(&plan);
    let sent = dispatch(&batches, &router);
    let inbox =
        |dst: usize| -> Vec<DispatchBuffers> { sent.iter().map(|s| s[dst].clone()).collect() };
    // Buffers delivered to the wrong rank.
    let (dst, src) = (0..RANKS)
        .flat_map(|d| (0..RANKS).map(move |s| (d, s)))
        .find(|&(d, s)| !sent[s][d].is_empty())
        .unwrap();
    let wrong = (dst + 1) % RANKS;
    let mut misdelivered = inbox(wrong);
    misdelivered[src] = sent[src][dst].clone();
    assert!(matches!(
        group_by_instance(wrong, &misdelivered, HIDDEN, &router),
        Err(KernelError::Misrouted { rank, .. }) if rank == wrong
    ));
    let mut bad = inbox(dst);
    bad[src].instances[0] = 99;
    assert!(matches!(
        group_by_instance(dst, &bad, HIDDEN, &router),
        Err(KernelError::OutOfRange {
            what: "instance",
            ..
        })
    ));
    let mut bad = inbox(dst);
    bad[src].experts[0] = EXPERTS as u32;
    assert!(matches!(
        group_by_instance(dst, &bad, HIDDEN, &router),
        Err(KernelError::ExpertOutOfRange { .. })
    ));
    let mut bad = inbox(dst);
    bad[src].rows.pop();
    assert!(matches!(
        group_by_instance(dst, &bad, HIDDEN, &router),
        Err(KernelError::Length { what: "rows", .. })
    ));
    let mut bad = inbox(dst);
    bad[src].instances.pop();
    assert!(matches!(
        group_by_instance(dst, &bad, HIDDEN, &router),
        Err(KernelError::Length {
            what: "instances",
            ..
        })
    ));

    let mut pair_outputs = vec![0f32; 4 * HIDDEN];
    let rows = vec![1f32; 2 * HIDDEN];
    assert!(matches!(
        scatter_pairs(&mut pair_outputs, HIDDEN, &[0, 4], &rows),
        Err(KernelError::OutOfRange {
            what: "pair index",
            value: 4,
            ..
        })
    ));
    assert!(matches!(
        scatter_pairs(&mut pair_outputs, HIDDEN, &[0], &rows),
        Err(KernelError::Length { what: "rows", .. })
    ));
    assert!(matches!(
        scatter_pairs(&mut pair_outputs[1..], HIDDEN, &[0, 1], &rows),
        Err(KernelError::NotMultiple { .. })
    ));
    assert!(
        pair_outputs.iter().all(|&v| v == 0.0),
        "errors write nothing"
    );
    scatter_pairs(&mut pair_outputs, HIDDEN, &[3, 1], &rows).unwrap();
    assert_eq!(pair_outputs[3 * HIDDEN], 1.0);
    assert_eq!(pair_outputs[0], 0.0);
}

#[test]
fn dispatch_rows_survive_the_wire_and_are_counted_once() {
    let batches = batches(11);
    let router = InstanceRouter::new(&plan_for(&batches));
    let sent = dispatch(&batches, &router);
    for per_dst in &sent {
        for buffers in per_dst {
            let (rows, ids) = buffers.clone().into_wire();
            assert_eq!(ids.len(), buffers.len() * IDS_PER_ROW);
            assert_eq!(&DispatchBuffers::from_wire(rows, &ids).unwrap(), buffers);
        }
    }
    assert!(matches!(
        DispatchBuffers::from_wire(Vec::new(), &[1, 2]),
        Err(KernelError::NotMultiple { .. })
    ));
    // Rank 1 of 3 receives 2 rows from rank 0 and 5 from rank 2 (8 floats + 3 ids each, 44
    // bytes) and gets back the outputs of the 4 rows it sent to rank 2 (32 bytes); its own rows
    // (7 in, 7 out) never leave it.
    assert_eq!(
        remote_recv_bytes(1, &[2, 7, 5], &[0, 7, 4], HIDDEN),
        7 * 44 + 4 * 32
    );
}
