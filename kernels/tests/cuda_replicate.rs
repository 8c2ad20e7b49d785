//! Replica distribution by tile streaming: the schedule compiled to tile tasks replays the CPU
//! reference byte for byte (on the host, everywhere), bad schedules are refused before anything
//! runs, and on a GPU the persistent kernel fills every slot exactly like the CPU reference,
//! with direct fan-out and with relay trees, one block or many; the relay planner on the device
//! builds the host compiler's stream from the solver's plan or an uploaded one.

#![cfg(feature = "cuda")]

mod cuda_common;

use cuda_common::{gpu_or_skip, skewed_load, Rng};
use rackfill_balancer::quota::{QuotaPlanner, TargetRule};
use rackfill_balancer::relay::{plan_transfers, RelayConfig, TransferSchedule};
use rackfill_balancer::{Balancer, Layout, Plan};
use rackfill_kernels::cuda::replicate::{DeviceTileStream, RankBuffers};
use rackfill_kernels::cuda::solver::GpuQuotaSolver;
use rackfill_kernels::cuda::tile_plan::{TileGeometry, TilePlanner};
use rackfill_kernels::cuda::tiles::{self, BufferLayout, TileStream, SRC_HOME};
use rackfill_kernels::cuda::DevicePlan;
use rackfill_kernels::{distribute_replicas_sequential, KernelError, TransferFault};

const RANKS: usize = 24;
const EXPERTS: usize = 48;
const SLOTS: usize = 2;
/// Not a multiple of 16: tiles and chunks end unaligned.
const EXPERT_BYTES: u64 = 20_011;
const SLOT_BYTES: u64 = EXPERT_BYTES + 13;

fn plan(seed: u64) -> (Layout, Plan) {
    let layout = Layout::contiguous(RANKS, EXPERTS, SLOTS).unwrap();
    let load = skewed_load(&mut Rng(seed), RANKS, EXPERTS, 2);
    let plan = QuotaPlanner::new(1).plan(&layout, &load).unwrap();
    assert!(plan.max_fanout() > 4, "the test needs relay trees");
    (layout, plan)
}

fn weights(seed: u64) -> Vec<Vec<u8>> {
    let mut rng = Rng(seed ^ 0xF00D);
    (0..EXPERTS)
        .map(|_| (0..EXPERT_BYTES).map(|_| rng.next() as u8).collect())
        .collect()
}

/// Each rank's home buffer: its main experts back to back after `pad` bytes (so some home
/// offsets are unaligned), and the offsets.
fn homes(layout: &Layout, weights: &[Vec<u8>], pad: u64) -> (Vec<Vec<u8>>, Vec<u64>) {
    let mut offsets = vec![0; EXPERTS];
    let bufs = (0..RANKS)
        .map(|r| {
            let mut buf = vec![0xEE; pad as usize];
            for &e in layout.main_experts(r) {
                offsets[e as usize] = buf.len() as u64;
                buf.extend_from_slice(&weights[e as usize]);
            }
            buf
        })
        .collect();
    (bufs, offsets)
}

/// This file's expert and slot sizes over `home_offsets`.
fn buffer_layout(home_offsets: &[u64]) -> BufferLayout<'_> {
    BufferLayout {
        expert_bytes: EXPERT_BYTES,
        home_offsets,
        slot_bytes: SLOT_BYTES,
    }
}

/// The CPU reference: slot buffers after `distribute_replicas_sequential`.
fn reference(plan: &Plan, schedule: &TransferSchedule, weights: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let mut bufs = vec![vec![0u8; SLOTS * SLOT_BYTES as usize]; RANKS];
    let mut views: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    let source = |e: u32| vec![weights[e as usize].as_slice()];
    distribute_replicas_sequential(
        plan,
        schedule,
        EXPERT_BYTES as usize,
        &source,
        &mut views,
        SLOT_BYTES as usize,
    )
    .unwrap();
    bufs
}

/// Executes the task stream in order the way the kernel does (stage the tile, store it to every
/// destination, bump ready counters), checking that every wait is already satisfied.
fn replay(stream: &TileStream, homes: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let mut slots = vec![vec![0u8; SLOTS * SLOT_BYTES as usize]; RANKS];
    let mut flags: Vec<Vec<u32>> = stream
        .flags_per_rank
        .iter()
        .map(|&n| vec![0; n as usize])
        .collect();
    for (i, t) in stream.tasks.iter().enumerate() {
        assert!(t.len <= stream.tile_bytes && t.len > 0, "task {i}");
        if t.wait_flag >= 0 {
            let have = flags[t.src_rank as usize][t.wait_flag as usize];
            assert_eq!(
                have, t.wait_target,
                "task {i} would wait on a chunk still arriving"
            );
        }
        let (from, len) = (t.src_offset as usize, t.len as usize);
        let tile: Vec<u8> = if t.src_kind == SRC_HOME {
            homes[t.src_rank as usize][from..from + len].to_vec()
        } else {
            slots[t.src_rank as usize][from..from + len].to_vec()
        };
        for d in &stream.dsts[t.dst_begin as usize..(t.dst_begin + t.n_dst) as usize] {
            let at = (d.offset + t.tile_offset) as usize;
            slots[d.rank as usize][at..at + len].copy_from_slice(&tile);
            if d.ready_flag >= 0 {
                flags[d.rank as usize][d.ready_flag as usize] += 1;
            }
        }
    }
    slots
}

fn configs() -> [(RelayConfig, u32); 4] {
    [
        (
            RelayConfig {
                threshold: 4,
                chunk_bytes: 4096,
            },
            1024,
        ),
        (
            RelayConfig {
                threshold: 2,
                chunk_bytes: 5000,
            },
            16 * 1024,
        ),
        (
            RelayConfig {
                threshold: 64,
                chunk_bytes: 0,
            },
            4096,
        ),
        (
            RelayConfig {
                threshold: 1,
                chunk_bytes: 1 << 20,
            },
            2048,
        ),
    ]
}

#[test]
fn tile_streams_replay_the_cpu_reference() {
    for seed in 0..4 {
        let (layout, plan) = plan(seed);
        let w = weights(seed);
        let (home_bufs, home_offsets) = homes(&layout, &w, seed * 5);
        let buffers = buffer_layout(&home_offsets);
        for (config, tile_bytes) in configs() {
            let schedule = plan_transfers(&plan, EXPERT_BYTES, &config);
            let stream = tiles::compile(&plan, &schedule, &buffers, tile_bytes).unwrap();
            assert_eq!(
                replay(&stream, &home_bufs),
                reference(&plan, &schedule, &w),
                "seed {seed} {config:?}"
            );
            let moved: u64 = schedule.transfers.iter().map(|t| t.len).sum();
            assert_eq!(stream.stored_bytes, moved);
            stream.check_runnable(RANKS).unwrap();
        }
    }
}

/// What the kernel would misread, or wait on forever, is refused before upload; a compiled
/// stream always passes (above).
#[test]
fn streams_the_kernel_cannot_run_are_refused() {
    let (_, plan) = plan(3);
    let w = weights(3);
    let (_, home_offsets) = homes(&Layout::contiguous(RANKS, EXPERTS, SLOTS).unwrap(), &w, 0);
    let relayed = RelayConfig {
        threshold: 2,
        chunk_bytes: 8192,
    };
    let schedule = plan_transfers(&plan, EXPERT_BYTES, &relayed);
    let good = tiles::compile(&plan, &schedule, &buffer_layout(&home_offsets), 4096).unwrap();
    good.check_runnable(RANKS).unwrap();
    let waiter = good.tasks.iter().position(|t| t.wait_flag >= 0).unwrap();
    let producer = good.dsts.iter().position(|d| d.ready_flag >= 0).unwrap();
    type Corrupt = fn(&mut TileStream, usize, usize);
    let cases: [(&str, Corrupt); 8] = [
        ("tile of 100 bytes", |s, _, _| s.tile_bytes = 100),
        ("tile longer than tile_bytes", |s, _, _| {
            s.tasks[0].len = 4097
        }),
        ("source rank", |s, _, _| s.tasks[0].src_rank = RANKS as u32),
        ("destinations past the end", |s, _, _| {
            s.tasks[0].n_dst = s.dsts.len() as u32 + 1
        }),
        ("destination rank", |s, _, p| s.dsts[p].rank = RANKS as u32),
        ("ready counter", |s, _, p| s.dsts[p].ready_flag = i32::MAX),
        ("unreachable wait", |s, w, _| s.tasks[w].wait_target += 1),
        ("wait before its producers", |s, w, _| {
            let t = s.tasks.remove(w);
            s.tasks.insert(0, t);
        }),
    ];
    for (what, corrupt) in cases {
        let mut bad = good.clone();
        corrupt(&mut bad, waiter, producer);
        let err = bad.check_runnable(RANKS).unwrap_err();
        assert!(
            matches!(
                err,
                rackfill_kernels::cuda::CudaError::UnrunnableTask { .. }
            ),
            "{what}: {err}"
        );
    }
    assert!(matches!(
        good.check_runnable(RANKS - 1).unwrap_err(),
        rackfill_kernels::cuda::CudaError::Kernel(KernelError::RankCount { .. })
    ));
}

#[test]
fn each_source_tile_is_staged_once_for_all_its_destinations() {
    let (layout, plan) = plan(9);
    let home_offsets: Vec<u64> = (0..EXPERTS)
        .map(|e| (e % 2) as u64 * EXPERT_BYTES)
        .collect();
    let _ = layout;
    let buffers = buffer_layout(&home_offsets);
    let direct = RelayConfig {
        threshold: usize::MAX,
        chunk_bytes: 0,
    };
    let schedule = plan_transfers(&plan, EXPERT_BYTES, &direct);
    let stream = tiles::compile(&plan, &schedule, &buffers, 4096).unwrap();
    let tiles_per_expert = EXPERT_BYTES.div_ceil(4096) as usize;
    let replicated = (0..EXPERTS)
        .filter(|&e| plan.instances(e).len() > 1)
        .count();
    // Direct fan-out: one group per replicated expert, each tile read once.
    assert_eq!(stream.tasks.len(), replicated * tiles_per_expert);
    assert_eq!(stream.dsts.len(), plan.replicas());
    assert!(stream.tasks.iter().all(|t| t.wait_flag < 0));
    assert!(stream.flags_per_rank.iter().all(|&n| n == 0));
    // With relays, forwards wait for exactly the tiles of their chunk.
    let relayed = RelayConfig {
        threshold: 2,
        chunk_bytes: 8192,
    };
    let schedule = plan_transfers(&plan, EXPERT_BYTES, &relayed);
    let stream = tiles::compile(&plan, &schedule, &buffers, 4096).unwrap();
    let waiting: Vec<_> = stream.tasks.iter().filter(|t| t.wait_flag >= 0).collect();
    assert!(!waiting.is_empty());
    for t in waiting {
        assert!(t.wait_target == 1 || t.wait_target == 2, "{t:?}");
    }
}

#[test]
fn bad_schedules_and_layouts_are_refused() {
    let (layout, plan) = plan(2);
    let (_, home_offsets) = homes(&layout, &weights(2), 0);
    let buffers = buffer_layout(&home_offsets);
    let config = RelayConfig {
        threshold: 2,
        chunk_bytes: 4096,
    };
    let good = plan_transfers(&plan, EXPERT_BYTES, &config);
    let fault = |schedule: &TransferSchedule| match tiles::compile(&plan, schedule, &buffers, 1024)
    {
        Err(KernelError::Transfer { fault, .. }) => fault,
        other => panic!("expected a transfer fault, got {other:?}"),
    };
    let stage2 = good.transfers.iter().position(|t| t.stage == 2).unwrap();
    let mut s = good.clone();
    s.transfers[0].dst = RANKS as u32;
    assert!(matches!(fault(&s), TransferFault::Rank { .. }));
    let mut s = good.clone();
    s.transfers[0].src = (s.transfers[0].src + 1) % RANKS as u32;
    assert!(matches!(
        fault(&s),
        TransferFault::NotFromHome { .. } | TransferFault::NoSlot { .. }
    ));
    let mut s = good.clone();
    s.transfers[0].offset = EXPERT_BYTES - 1;
    s.transfers[0].len = 2;
    assert!(matches!(fault(&s), TransferFault::Range { .. }));
    let mut s = good.clone();
    s.transfers.swap(0, stage2);
    assert!(matches!(fault(&s), TransferFault::NotRelayed { .. }));
    let mut s = good.clone();
    let dup = s.transfers[0];
    s.transfers.insert(1, dup);
    assert!(matches!(fault(&s), TransferFault::Duplicate { .. }));
    let mut s = good.clone();
    s.transfers[stage2].wait_for_chunk_on = None;
    assert!(matches!(fault(&s), TransferFault::Wait { .. }));
    let mut s = good.clone();
    s.transfers.pop();
    assert!(matches!(
        tiles::compile(&plan, &s, &buffers, 1024),
        Err(KernelError::IncompleteReplica { .. })
    ));
    for tile_bytes in [0, 1000] {
        assert!(tiles::compile(&plan, &good, &buffers, tile_bytes).is_err());
    }
    let short = BufferLayout {
        home_offsets: &home_offsets[1..],
        ..buffers
    };
    assert!(matches!(
        tiles::compile(&plan, &good, &short, 1024),
        Err(KernelError::Length { .. })
    ));
    let small_slots = BufferLayout {
        slot_bytes: EXPERT_BYTES - 1,
        ..buffers
    };
    assert!(matches!(
        tiles::compile(&plan, &good, &small_slots, 1024),
        Err(KernelError::SlotTooSmall { .. })
    ));
}

#[test]
fn gpu_tile_streaming_fills_every_slot_like_the_cpu_reference() {
    let Some(gpu) = gpu_or_skip("gpu_tile_streaming_fills_every_slot_like_the_cpu_reference")
    else {
        return;
    };
    for seed in 0..3 {
        let (layout, plan) = plan(seed);
        let w = weights(seed);
        let (home_bufs, home_offsets) = homes(&layout, &w, [0, 16, 5][seed as usize]);
        let buffers = buffer_layout(&home_offsets);
        for (config, tile_bytes) in configs() {
            let schedule = plan_transfers(&plan, EXPERT_BYTES, &config);
            let expected = reference(&plan, &schedule, &w);
            let stream = tiles::compile(&plan, &schedule, &buffers, tile_bytes).unwrap();
            let mut device = DeviceTileStream::upload(&gpu, &stream, RANKS).unwrap();
            for (blocks, threads) in [(1, 128), (gpu.info().multiprocessors * 2, 512)] {
                let slot_buffer = SLOTS * SLOT_BYTES as usize;
                let mut ranks =
                    RankBuffers::new(&gpu, &home_bufs, slot_buffer, &stream.flags_per_rank)
                        .unwrap();
                ranks.reset_flags(&gpu).unwrap();
                device.launch(&gpu, &ranks, blocks, threads).unwrap();
                device.finish(&gpu).unwrap();
                for (r, want) in expected.iter().enumerate() {
                    let got = gpu.stream().clone_dtoh(ranks.slots(r).unwrap()).unwrap();
                    assert!(got == *want, "seed {seed} {config:?} tile {tile_bytes} blocks {blocks}: rank {r} differs");
                }
            }
        }
    }
}

#[test]
fn gpu_launch_refuses_buffers_smaller_than_the_tasks_touch() {
    let Some(gpu) = gpu_or_skip("gpu_launch_refuses_buffers_smaller_than_the_tasks_touch") else {
        return;
    };
    let (layout, plan) = plan(1);
    let w = weights(1);
    let (home_bufs, home_offsets) = homes(&layout, &w, 0);
    let buffers = buffer_layout(&home_offsets);
    let schedule = plan_transfers(&plan, EXPERT_BYTES, &RelayConfig::default());
    let stream = tiles::compile(&plan, &schedule, &buffers, 4096).unwrap();
    let mut device = DeviceTileStream::upload(&gpu, &stream, RANKS).unwrap();
    let ranks = RankBuffers::new(&gpu, &home_bufs, 100, &stream.flags_per_rank).unwrap();
    assert!(device.launch(&gpu, &ranks, 4, 128).is_err());
}

#[test]
fn gpu_relay_planner_builds_the_host_stream_and_fills_slots_from_the_solvers_plan() {
    let Some(gpu) = gpu_or_skip("gpu_relay_planner_builds_the_host_stream") else {
        return;
    };
    for seed in 0..3 {
        let (layout, plan) = plan(seed);
        let load = skewed_load(&mut Rng(seed), RANKS, EXPERTS, 2);
        let w = weights(seed);
        let (home_bufs, home_offsets) = homes(&layout, &w, [0, 16, 5][seed as usize]);
        let buffers = buffer_layout(&home_offsets);
        let mut solver = GpuQuotaSolver::new(&gpu, &layout, 1, TargetRule::BestFit).unwrap();
        let uploaded = DevicePlan::upload(&gpu, &plan).unwrap();
        for (config, tile_bytes) in configs() {
            let geometry = TileGeometry {
                expert_bytes: EXPERT_BYTES,
                slot_bytes: SLOT_BYTES,
                tile_bytes,
                relay: config,
            };
            let schedule = plan_transfers(&plan, EXPERT_BYTES, &config);
            let want = tiles::compile(&plan, &schedule, &buffers, tile_bytes).unwrap();
            let expected = reference(&plan, &schedule, &w);
            let mut planner = TilePlanner::new(
                &gpu,
                &layout,
                &geometry,
                std::slice::from_ref(&home_offsets),
            )
            .unwrap();
            let flags = vec![planner.flag_capacity(); RANKS];
            let slot_buffer = SLOTS * SLOT_BYTES as usize;
            for from_solver in [true, false] {
                let mut ranks = RankBuffers::new(&gpu, &home_bufs, slot_buffer, &flags).unwrap();
                if from_solver {
                    solver.solve(&load).unwrap();
                    let guard = Some(solver.status());
                    planner.plan(&gpu, solver.device_plan(), guard, 0).unwrap();
                } else {
                    planner.plan(&gpu, &uploaded, None, 0).unwrap();
                }
                planner
                    .stream(
                        &gpu,
                        &mut ranks,
                        (2 * gpu.info().multiprocessors, 512),
                        None,
                    )
                    .unwrap();
                let what = format!("seed {seed} {config:?} tile {tile_bytes} solver {from_solver}");
                planner.finish(&gpu).unwrap();
                assert_eq!(planner.download(&gpu).unwrap(), want, "{what}");
                for (r, want) in expected.iter().enumerate() {
                    let got = gpu.stream().clone_dtoh(ranks.slots(r).unwrap()).unwrap();
                    assert!(got == *want, "{what}: rank {r} differs");
                }
            }
        }
    }
}
