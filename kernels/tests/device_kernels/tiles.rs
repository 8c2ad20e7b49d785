//! Replica distribution by tile streaming: the host compiler's task stream replays the CPU
//! executor and refuses what the kernel cannot run; `plan_tiles` (`tile_plan.cu`) builds the
//! host compiler's stream entry for entry and refuses what it cannot plan; `tile_stream`
//! (`replicate.cu`) fills every slot like the CPU executor, from host-compiled streams
//! ([`DeviceTileStream`]) and right after `plan_tiles` ([`TilePlanner`], as the data plane chains
//! them), counts every slot's landed bytes, and gives up on a broken relay instead of spinning.
//! On the emulator a stream runs as a grid of up to four concurrent blocks (forked processes)
//! whose system-scope fences are held back, so relay chunks cross blocks that really wait.

use super::cuda_common::{
    default_devices, emulator, random_layout, read_bytes, read_u32, skewed_load, upload_i32,
    upload_u32, upload_u64, zeroed, Device, Rng,
};
use rackfill_balancer::quota::{QuotaPlanner, TargetRule};
use rackfill_balancer::relay::{plan_transfers, RelayConfig, TransferSchedule};
use rackfill_balancer::{Algo, Balancer, Layout, LoadMatrix, Plan, Settings};
use rackfill_kernels::cuda::exec::{
    DeviceBuffer, Emulator, EmulatorSettings, Executor, ExecutorExt, KernelArg, Launch, Stream,
};
use rackfill_kernels::cuda::replicate::{
    dst_bytes, dsts_from_bytes, task_bytes, tasks_from_bytes, DeviceTileStream, LandedBytes,
    RankBuffers,
};
use rackfill_kernels::cuda::solver::DeviceQuotaSolver;
use rackfill_kernels::cuda::tile_plan::{TileGeometry, TilePlanParams, TilePlanner};
use rackfill_kernels::cuda::tiles::{self, BufferLayout, TileStream, SRC_HOME};
use rackfill_kernels::cuda::{CudaError, DevicePlan, PlanArrays, TilePlanFault};
use rackfill_kernels::{distribute_replicas_sequential, KernelError, TransferFault};
use std::sync::Arc;

// ---------------------------------------------------------------------------------------------
// The host compiler (no device).

const RANKS: usize = 24;
const EXPERTS: usize = 48;
const SLOTS: usize = 2;
/// Not a multiple of 16: tiles and chunks end unaligned.
const EXPERT_BYTES: u64 = 20_011;
const SLOT_BYTES: u64 = EXPERT_BYTES + 13;

fn fixed_plan(seed: u64) -> (Layout, Plan) {
    let layout = Layout::contiguous(RANKS, EXPERTS, SLOTS).unwrap();
    let load = skewed_load(&mut Rng(seed), RANKS, EXPERTS, 2);
    let plan = QuotaPlanner::new(1).plan(&layout, &load).unwrap();
    assert!(plan.max_fanout() > 4, "the test needs relay trees");
    (layout, plan)
}

/// Random bytes for every expert.
fn expert_weights(rng: &mut Rng, experts: usize, expert_bytes: u64) -> Vec<Vec<u8>> {
    (0..experts)
        .map(|_| (0..expert_bytes).map(|_| rng.next() as u8).collect())
        .collect()
}

/// Each rank's home buffer: its main experts back to back after `pad` bytes (so some home offsets
/// are unaligned), and every expert's offset in its home's buffer.
fn homes(layout: &Layout, weights: &[Vec<u8>], pad: u64) -> (Vec<Vec<u8>>, Vec<u64>) {
    let mut offsets = vec![0; layout.experts()];
    let bufs = (0..layout.ranks())
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

/// The CPU executor's slot buffers (`slot_len` bytes per rank) after `schedule` for `plan`,
/// expert `e`'s weights being `weights[e]`.
fn cpu_slots(
    plan: &Plan,
    schedule: &TransferSchedule,
    weights: &[Vec<u8>],
    slot_bytes: u64,
    slot_len: usize,
) -> Vec<Vec<u8>> {
    let mut slots = vec![vec![0u8; slot_len]; plan.ranks()];
    let mut views: Vec<&mut [u8]> = slots.iter_mut().map(Vec::as_mut_slice).collect();
    let source = |e: u32| vec![weights[e as usize].as_slice()];
    let expert_bytes = weights.first().map_or(0, Vec::len);
    distribute_replicas_sequential(
        plan,
        schedule,
        expert_bytes,
        &source,
        &mut views,
        slot_bytes as usize,
    )
    .unwrap();
    slots
}

/// Executes the task stream in order the way the kernel does (stage the tile, store it to every
/// destination, bump ready counters), checking that every wait is already satisfied.
fn replay(stream: &TileStream, homes: &[Vec<u8>], slot_len: usize) -> Vec<Vec<u8>> {
    let mut slots = vec![vec![0u8; slot_len]; homes.len()];
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

fn fixed_configs() -> [(RelayConfig, u32); 4] {
    let relay = |threshold, chunk_bytes| RelayConfig {
        threshold,
        chunk_bytes,
    };
    [
        (relay(4, 4096), 1024),
        (relay(2, 5000), 16 * 1024),
        (relay(64, 0), 4096),
        (relay(1, 1 << 20), 2048),
    ]
}

fn fixed_buffers(home_offsets: &[u64]) -> BufferLayout<'_> {
    BufferLayout {
        expert_bytes: EXPERT_BYTES,
        home_offsets,
        slot_bytes: SLOT_BYTES,
    }
}

#[test]
fn compiled_tile_streams_replay_the_cpu_executor() {
    for seed in 0..4 {
        let (layout, plan) = fixed_plan(seed);
        let w = expert_weights(&mut Rng(seed ^ 0xF00D), EXPERTS, EXPERT_BYTES);
        let (home_bufs, home_offsets) = homes(&layout, &w, seed * 5);
        let buffers = fixed_buffers(&home_offsets);
        let slot_len = SLOTS * SLOT_BYTES as usize;
        for (config, tile_bytes) in fixed_configs() {
            let schedule = plan_transfers(&plan, EXPERT_BYTES, &config);
            let stream = tiles::compile(&plan, &schedule, &buffers, tile_bytes).unwrap();
            assert_eq!(
                replay(&stream, &home_bufs, slot_len),
                cpu_slots(&plan, &schedule, &w, SLOT_BYTES, slot_len),
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
    let (layout, plan) = fixed_plan(3);
    let w = expert_weights(&mut Rng(3), EXPERTS, EXPERT_BYTES);
    let (_, home_offsets) = homes(&layout, &w, 0);
    let relayed = RelayConfig {
        threshold: 2,
        chunk_bytes: 8192,
    };
    let schedule = plan_transfers(&plan, EXPERT_BYTES, &relayed);
    let good = tiles::compile(&plan, &schedule, &fixed_buffers(&home_offsets), 4096).unwrap();
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
            matches!(err, CudaError::UnrunnableTask { .. }),
            "{what}: {err}"
        );
    }
    assert!(matches!(
        good.check_runnable(RANKS - 1).unwrap_err(),
        CudaError::Kernel(KernelError::RankCount { .. })
    ));
}

#[test]
fn each_source_tile_is_staged_once_for_all_its_destinations() {
    let (_, plan) = fixed_plan(9);
    let home_offsets: Vec<u64> = (0..EXPERTS)
        .map(|e| (e % 2) as u64 * EXPERT_BYTES)
        .collect();
    let buffers = fixed_buffers(&home_offsets);
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
    let (layout, plan) = fixed_plan(2);
    let w = expert_weights(&mut Rng(2), EXPERTS, EXPERT_BYTES);
    let (_, home_offsets) = homes(&layout, &w, 0);
    let buffers = fixed_buffers(&home_offsets);
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

// ---------------------------------------------------------------------------------------------
// plan_tiles: the relay trees and tile tasks built on the device.

/// Bytes after a global arena that `plan_tiles` must never write.
const CANARY: usize = 64;

/// `plan_tiles` launched directly with `threads` threads over plan arrays of any shape (the
/// kernel must check them): the stream it built, or its fault. With the arena in global memory,
/// canary bytes after `TilePlanParams::arena_bytes` catch a carve that outgrows it.
fn launch_plan_tiles(
    exec: &dyn Executor,
    p: &TilePlanParams,
    guard: u64,
    arrays: &PlanArrays,
    home_offsets: &[u64],
    threads: u32,
) -> Result<TileStream, TilePlanFault> {
    let (r, e) = (p.ranks as usize, p.experts as usize);
    let mut inst_rank = arrays.inst_rank.clone();
    // Instance offsets that run past the ranks read zeros, as from a buffer sized for them.
    inst_rank.resize(inst_rank.len().max(arrays.inst_offsets[e] as usize), 0);
    let arena = p.arena_bytes();
    let global = zeroed(exec, arena + CANARY);
    exec.write(&global, arena, &[0xA5; CANARY]).unwrap();
    let header = zeroed(exec, 16);
    let flags = zeroed(exec, 4 * r);
    let tasks = zeroed(exec, 48 * p.task_capacity as usize);
    let dsts = zeroed(exec, 16 * p.dst_capacity as usize);
    let bufs = [
        upload_u64(exec, &[guard]),
        upload_i32(exec, &arrays.slots),
        upload_u32(exec, &arrays.inst_offsets),
        upload_u32(exec, &inst_rank),
        upload_u64(exec, home_offsets),
    ];
    let mut args = vec![KernelArg::params(p)];
    args.extend(bufs.iter().map(KernelArg::from));
    args.extend([&global, &tasks, &dsts, &header, &flags].map(KernelArg::from));
    let launch = Launch {
        grid: [1, 1, 1],
        block: threads,
        shared_bytes: if p.arena_in_shared == 1 {
            arena as u32
        } else {
            0
        },
    };
    // SAFETY: `plan_tiles(p, guard, slots, inst_offsets, inst_rank, home_offsets, global_arena,
    // tasks, dsts, header, flags_per_rank)`; the arena (shared or global) and every output are as
    // large as the parameters say; the plan arrays cover what their offsets claim.
    unsafe { exec.launch("plan_tiles", launch, &args) }.unwrap();
    let canary = read_bytes(exec, &global, arena + CANARY);
    assert!(
        canary[arena..].iter().all(|&b| b == 0xA5),
        "plan_tiles wrote past its {arena}-byte arena"
    );
    let header = read_u32(exec, &header, 4);
    if header[0] != 0 {
        assert_eq!(&header[1..], &[0, 0, 0], "a failed plan reports no tasks");
        return Err(TilePlanFault::from_status(header[0]));
    }
    let tasks = tasks_from_bytes(&read_bytes(exec, &tasks, 48 * header[1] as usize));
    let dsts = dsts_from_bytes(&read_bytes(exec, &dsts, 16 * header[2] as usize));
    Ok(TileStream {
        stored_bytes: tasks
            .iter()
            .map(|t| u64::from(t.len) * u64::from(t.n_dst))
            .sum(),
        tasks,
        dsts,
        flags_per_rank: read_u32(exec, &flags, r),
        tile_bytes: p.tile_bytes,
    })
}

/// A plan from one of the shipped planners for a skewed load of `layout`: several hot experts,
/// so that fan-outs cross every relay threshold the tests draw.
fn skewed_plan(rng: &mut Rng, layout: &Layout, algo: Algo) -> Plan {
    let hot = 1 + rng.below(3) as usize;
    let load = skewed_load(rng, layout.ranks(), layout.experts(), hot);
    let settings = Settings {
        u_min: 1 + rng.below(4),
        ..Settings::default()
    };
    algo.build(&settings).plan(layout, &load).unwrap()
}

#[test]
fn plan_tiles_builds_the_host_compilers_stream() {
    let algos = [
        Algo::Quota,
        Algo::QuotaPaper,
        Algo::EplbExact,
        Algo::GreedyMove,
    ];
    for device in default_devices() {
        let exec = device.exec.as_ref();
        let mut relayed = 0;
        for case in 0..36u64 {
            let mut rng = Rng(case + 4242);
            let layout = random_layout(&mut rng, 24, 60);
            let plan = skewed_plan(&mut rng, &layout, algos[case as usize % algos.len()]);
            let expert_bytes = 16 * (1 + rng.below(200)) + rng.below(2) * rng.below(16);
            let geometry = TileGeometry {
                expert_bytes,
                slot_bytes: expert_bytes + rng.below(3) * 16 + rng.below(2) * 5,
                tile_bytes: 16 * (1 + rng.below(24)) as u32,
                relay: RelayConfig {
                    threshold: rng.below(6) as usize,
                    chunk_bytes: [0, 48, 100, 512, 1 << 20][rng.below(5) as usize],
                },
            };
            // Homes packed in layout order after a pad, so offsets differ between ranks.
            let pad = rng.below(3) * 40;
            let mut home_offsets = vec![0u64; layout.experts()];
            for r in 0..layout.ranks() {
                for (i, &e) in layout.main_experts(r).iter().enumerate() {
                    home_offsets[e as usize] = pad + i as u64 * expert_bytes;
                }
            }
            let schedule = plan_transfers(&plan, expert_bytes, &geometry.relay);
            let buffers = BufferLayout {
                expert_bytes,
                home_offsets: &home_offsets,
                slot_bytes: geometry.slot_bytes,
            };
            let want = tiles::compile(&plan, &schedule, &buffers, geometry.tile_bytes).unwrap();
            let params = TilePlanParams {
                // The arena in shared or in global memory: the same code either way.
                arena_in_shared: rng.below(2) as u32,
                ..TilePlanParams::new(&layout, &geometry).unwrap()
            };
            let arrays = PlanArrays::from_plan(&plan).unwrap();
            let threads = 32 * (1 + rng.below(4) as u32);
            let got = launch_plan_tiles(exec, &params, 0, &arrays, &home_offsets, threads);
            let what = format!(
                "{} case {case}: R={} E={} n_slot={} replicas={} {geometry:?} threads={threads}",
                device.name(),
                layout.ranks(),
                layout.experts(),
                layout.slots_per_rank(),
                plan.replicas()
            );
            assert_eq!(got.as_ref(), Ok(&want), "{what}");
            relayed += usize::from(!schedule.trees.is_empty());
        }
        assert!(relayed >= 12, "only {relayed} cases built relay trees");

        // The paper's shape through the host wrapper: R=64, E=256, n_slot=2, a 1 MiB expert in
        // 256 KiB chunks.
        let layout = Layout::contiguous(64, 256, 2).unwrap();
        let plan = skewed_plan(&mut Rng(77), &layout, Algo::Quota);
        let geometry = TileGeometry {
            expert_bytes: 1 << 20,
            slot_bytes: 1 << 20,
            tile_bytes: 16 * 1024,
            relay: RelayConfig {
                threshold: 4,
                chunk_bytes: 256 * 1024,
            },
        };
        let home_offsets: Vec<u64> = (0..256).map(|e| (e % 4) << 20).collect();
        let schedule = plan_transfers(&plan, 1 << 20, &geometry.relay);
        assert!(!schedule.trees.is_empty(), "the paper shape should relay");
        let buffers = BufferLayout {
            expert_bytes: 1 << 20,
            home_offsets: &home_offsets,
            slot_bytes: 1 << 20,
        };
        let want = tiles::compile(&plan, &schedule, &buffers, 16 * 1024).unwrap();
        let exec = &device.exec;
        let planner = TilePlanner::new(
            Arc::clone(exec),
            &layout,
            &geometry,
            std::slice::from_ref(&home_offsets),
        )
        .unwrap();
        let uploaded = DevicePlan::upload(exec.as_ref(), Stream::MAIN, &plan).unwrap();
        planner.plan(Stream::MAIN, &uploaded, None, 0).unwrap();
        let counts = planner.counts(Stream::MAIN).unwrap();
        assert_eq!(counts.tasks as usize, want.tasks.len());
        let got = planner.download(Stream::MAIN).unwrap();
        assert_eq!(got, want, "{}: R=64 E=256", device.name());
        assert!(
            planner.plan(Stream::MAIN, &uploaded, None, 1).is_err(),
            "a layer it has no homes for"
        );
    }
}

#[test]
fn plan_tiles_refuses_what_it_cannot_plan_and_plans_nothing() {
    let layout = Layout::contiguous(12, 24, 2).unwrap();
    let plan = skewed_plan(&mut Rng(5), &layout, Algo::Quota);
    let geometry = TileGeometry {
        expert_bytes: 4096,
        slot_bytes: 4096,
        tile_bytes: 512,
        relay: RelayConfig {
            threshold: 2,
            chunk_bytes: 1024,
        },
    };
    let home_offsets: Vec<u64> = (0..24).map(|e| (e % 2) * 4096).collect();
    let schedule = plan_transfers(&plan, 4096, &geometry.relay);
    assert!(!schedule.trees.is_empty());
    let buffers = BufferLayout {
        expert_bytes: 4096,
        home_offsets: &home_offsets,
        slot_bytes: 4096,
    };
    let want = tiles::compile(&plan, &schedule, &buffers, 512).unwrap();
    let arrays = PlanArrays::from_plan(&plan).unwrap();
    for device in default_devices() {
        let exec = device.exec.as_ref();
        for arena_in_shared in [0, 1] {
            let params = TilePlanParams {
                arena_in_shared,
                ..TilePlanParams::new(&layout, &geometry).unwrap()
            };
            let what = format!("{} arena in shared {arena_in_shared}", device.name());
            let run = |params: &TilePlanParams, guard: u64, arrays: &PlanArrays| {
                launch_plan_tiles(exec, params, guard, arrays, &home_offsets, 64)
            };
            assert_eq!(run(&params, 0, &arrays).as_ref(), Ok(&want), "{what}");
            // The solver failed: its plan buffers are not read.
            assert_eq!(
                run(&params, 3, &arrays),
                Err(TilePlanFault::Solver),
                "{what}"
            );
            // Capacities one short of what this plan needs.
            let short = |edit: &dyn Fn(&mut TilePlanParams)| {
                let mut p = params;
                edit(&mut p);
                run(&p, 0, &arrays)
            };
            let tasks = want.tasks.len() as u32;
            let dsts = want.dsts.len() as u32;
            let flags = *want.flags_per_rank.iter().max().unwrap();
            assert!(flags > 0);
            assert_eq!(
                short(&|p| p.task_capacity = tasks - 1),
                Err(TilePlanFault::Tasks)
            );
            assert_eq!(
                short(&|p| p.dst_capacity = dsts - 1),
                Err(TilePlanFault::Destinations)
            );
            assert_eq!(
                short(&|p| p.flag_capacity = flags - 1),
                Err(TilePlanFault::Flags)
            );
            assert!(short(&|p| p.task_capacity = tasks).is_ok(), "{what}");
            // Malformed plans: a replica whose rank has no slot for it, an expert twice on one
            // rank, instance offsets that run past the replicas a layout can have.
            let filled = arrays.slots.iter().position(|&s| s >= 0).unwrap();
            let mut no_slot = arrays.clone();
            no_slot.slots[filled] = -1;
            assert_eq!(
                run(&params, 0, &no_slot),
                Err(TilePlanFault::Plan),
                "{what}"
            );
            let mut twice = arrays.clone();
            let e = (0..24)
                .find(|&e| twice.inst_offsets[e + 1] - twice.inst_offsets[e] >= 3)
                .unwrap();
            let first = twice.inst_offsets[e] as usize + 1;
            twice.inst_rank[first + 1] = twice.inst_rank[first];
            // Without relay trees both copies come from the home: two identical edges.
            let direct = TilePlanParams {
                threshold: u32::MAX,
                ..params
            };
            assert_eq!(run(&direct, 0, &twice), Err(TilePlanFault::Plan), "{what}");
            let mut past = arrays.clone();
            past.inst_offsets[24] = 24 + params.edge_capacity + 1;
            assert_eq!(run(&params, 0, &past), Err(TilePlanFault::Plan), "{what}");
        }
        // The host wrapper behind a failed solve: it plans nothing and says why.
        let planner = TilePlanner::new(
            Arc::clone(&device.exec),
            &layout,
            &geometry,
            std::slice::from_ref(&home_offsets),
        )
        .unwrap();
        let uploaded = DevicePlan::upload(exec, Stream::MAIN, &plan).unwrap();
        let failed = upload_u64(exec, &[3]);
        planner
            .plan(Stream::MAIN, &uploaded, Some(&failed), 0)
            .unwrap();
        assert!(matches!(
            planner.counts(Stream::MAIN),
            Err(CudaError::TilePlan(TilePlanFault::Solver))
        ));
    }
}

// ---------------------------------------------------------------------------------------------
// tile_stream: the slots filled.

/// How `tile_stream` runs: `blocks` persistent blocks of `threads`. On the emulator a grid of
/// several blocks runs them concurrently (forked processes), every system-scope fence held back
/// 200 µs so that relay consumers in other blocks find chunks still in flight, and a healthy
/// stream gets 20 s before a wait counts as a stall (blocks really wait for each other, on a
/// machine busy with other tests).
#[derive(Debug, Clone, Copy)]
struct Grid {
    blocks: u32,
    threads: u32,
}

impl Grid {
    /// One to four blocks of one to three warps on the emulator (`gpu` none); on a GPU one
    /// block of 128 threads or two per multiprocessor of 512.
    fn random(rng: &mut Rng, gpu: Option<&dyn Executor>) -> Self {
        let Some(gpu) = gpu else {
            return Self {
                blocks: 1 + rng.below(4) as u32,
                threads: 32 * (1 + rng.below(3) as u32),
            };
        };
        if rng.below(2) == 0 {
            Self {
                blocks: 1,
                threads: 128,
            }
        } else {
            Self {
                blocks: 2 * gpu.multiprocessors(),
                threads: 512,
            }
        }
    }

    /// The emulator settings for a stream on this grid.
    fn settings(&self) -> EmulatorSettings {
        let mut settings = EmulatorSettings::default();
        settings.concurrent_blocks = 1;
        settings.fence_delay_us = if self.blocks > 1 { 200 } else { 0 };
        settings.tile_stall_ns = 20_000_000_000;
        settings
    }

    /// `device` as this grid runs on it: the emulator with the grid's settings (and counters of
    /// its own); a GPU as it is.
    fn on(&self, device: Device) -> Device {
        match device.emulator {
            Some(_) => emulated(self.settings()).expect("the emulator ran before"),
            None => device,
        }
    }
}

/// The emulator alone with `settings`, as a [`Device`].
fn emulated(settings: EmulatorSettings) -> Option<Device> {
    emulator(settings).map(|emu| Device {
        exec: Arc::clone(&emu) as Arc<dyn Executor>,
        emulator: Some(emu),
    })
}

/// Each rank's home bytes on the device.
fn upload_homes(exec: &dyn Executor, homes: &[Vec<u8>]) -> Arc<[DeviceBuffer]> {
    homes
        .iter()
        .map(|h| exec.upload(h))
        .collect::<Result<_, _>>()
        .unwrap()
}

/// Slot set `set` of every rank, checking that every other set stayed zero.
fn slot_set(exec: &dyn Executor, buffers: &RankBuffers, set: usize, sets: usize) -> Vec<Vec<u8>> {
    let len = buffers.set_bytes();
    (0..buffers.ranks())
        .map(|r| {
            let all = read_bytes(exec, buffers.slots(r).unwrap(), len * sets);
            for (s, bytes) in all.chunks(len.max(1)).enumerate() {
                if s != set {
                    assert!(
                        bytes.iter().all(|&b| b == 0),
                        "rank {r}: slot set {s} was written"
                    );
                }
            }
            all[set * len..(set + 1) * len].to_vec()
        })
        .collect()
}

/// Multi-block emulated runs of streams with relays, and how often their blocks waited for a
/// relay chunk: the check that the concurrent grid really exercised cross-block waits, not just
/// ran blocks that never met.
#[derive(Default)]
struct RelayGrids {
    runs: usize,
    backoffs: u64,
}

impl RelayGrids {
    fn count(&mut self, grid: Grid, stream: &TileStream, device: &Device) {
        let Some(emu) = &device.emulator else { return };
        if grid.blocks > 1 && stream.tasks.iter().any(|t| t.wait_flag >= 0) {
            self.runs += 1;
            self.backoffs += emu.backoffs();
        }
    }

    fn check(&self) {
        if Emulator::shared().is_none() {
            return;
        }
        eprintln!(
            "emulated tile_stream: {} multi-block runs with relays, {} relay-wait back-offs",
            self.runs, self.backoffs
        );
        assert!(
            self.runs >= 3,
            "only {} multi-block runs had relays",
            self.runs
        );
        assert!(
            self.backoffs > 0,
            "no block ever waited for a relay chunk in {} multi-block runs",
            self.runs
        );
    }
}

/// `tile_stream` launched directly over fresh slot buffers and ready counters for every rank
/// (what the host wrapper would refuse: a broken stream); returns the stall word.
fn launch_raw_stream(
    exec: &dyn Executor,
    stream: &TileStream,
    homes: &[DeviceBuffer],
    slot_len: usize,
    grid: Grid,
) -> u32 {
    let slots: Vec<DeviceBuffer> = homes.iter().map(|_| zeroed(exec, slot_len)).collect();
    let flags: Vec<DeviceBuffer> = stream
        .flags_per_rank
        .iter()
        .map(|&n| zeroed(exec, 4 * n as usize))
        .collect();
    let table = |bufs: &[DeviceBuffer]| {
        let ptrs: Vec<u64> = bufs.iter().map(DeviceBuffer::ptr).collect();
        upload_u64(exec, &ptrs)
    };
    let (home_table, slot_table, flag_table) = (table(homes), table(&slots), table(&flags));
    let tasks = exec.upload(&task_bytes(&stream.tasks)).unwrap();
    let dsts = exec.upload(&dst_bytes(&stream.dsts)).unwrap();
    let count = upload_u32(exec, &[stream.tasks.len() as u32]);
    let counter = zeroed(exec, 8);
    let args = [
        KernelArg::from(&tasks),
        KernelArg::from(&count),
        KernelArg::from(&dsts),
        KernelArg::from(&counter),
        KernelArg::from(&home_table),
        KernelArg::from(&slot_table),
        KernelArg::from(&flag_table),
        KernelArg::U32(stream.tile_bytes),
        KernelArg::Ptr(0),
        KernelArg::U64(0),
        KernelArg::U32(0),
        KernelArg::U32(homes.len() as u32),
    ];
    let launch = Launch {
        grid: [grid.blocks, 1, 1],
        block: grid.threads,
        shared_bytes: 2 * stream.tile_bytes,
    };
    // SAFETY: `tile_stream(tasks, task_count, dsts, next_task[2], home_base, slot_base,
    // flag_base, tile_bytes, landed_base, slot_bytes, src_lo, src_hi)`; every task of the stream (compiled,
    // then corrupted in a wait target only) stays inside the buffers the tables address.
    unsafe { exec.launch("tile_stream", launch, &args) }.unwrap();
    read_u32(exec, &counter, 2)[1]
}

/// A random layer for the streaming tests: a contiguous layout of 3 to 16 ranks with one hot
/// expert, planned by the quota planner; random expert bytes (some not multiples of 16), slot
/// sizes, home padding, tile and relay settings.
struct StreamCase {
    layout: Layout,
    plan: Plan,
    expert_bytes: u64,
    slot_bytes: u64,
    tile: u32,
    config: RelayConfig,
    weights: Vec<Vec<u8>>,
    homes: Vec<Vec<u8>>,
    home_offsets: Vec<u64>,
}

impl StreamCase {
    fn random(rng: &mut Rng) -> Self {
        let ranks = 3 + rng.below(14) as usize;
        let experts = ranks * (1 + rng.below(3) as usize);
        let slots = 1 + rng.below(2) as usize;
        let expert_bytes = 16 * (1 + rng.below(100)) + rng.below(2) * rng.below(16);
        let slot_bytes = expert_bytes + rng.below(2) * 16 + rng.below(2) * 3;
        let pad = [0u64, 16, 5][rng.below(3) as usize];
        let tile = 16 * (1 + rng.below(20)) as u32;
        let config = RelayConfig {
            threshold: rng.below(4) as usize,
            chunk_bytes: [0, 64, 100, 1 << 20][rng.below(4) as usize],
        };
        let layout = Layout::contiguous(ranks, experts, slots).unwrap();
        let hot = rng.below(experts as u64) as usize;
        let rows: Vec<Vec<u64>> = (0..ranks)
            .map(|_| {
                (0..experts)
                    .map(|e| {
                        if e == hot {
                            500 + rng.below(100)
                        } else {
                            rng.below(20)
                        }
                    })
                    .collect()
            })
            .collect();
        let load = LoadMatrix::from_rows(&rows).unwrap();
        let plan = QuotaPlanner::new(1).plan(&layout, &load).unwrap();
        let weights = expert_weights(rng, experts, expert_bytes);
        let (homes, home_offsets) = homes(&layout, &weights, pad);
        Self {
            layout,
            plan,
            expert_bytes,
            slot_bytes,
            tile,
            config,
            weights,
            homes,
            home_offsets,
        }
    }

    fn slot_len(&self) -> usize {
        self.layout.slots_per_rank() * self.slot_bytes as usize
    }
}

#[test]
fn tile_stream_fills_slots_like_the_cpu_executor_and_gives_up_on_a_broken_relay() {
    let mut stalled = 0;
    let mut relay_grids = RelayGrids::default();
    for case in 0..20u64 {
        let mut rng = Rng(case + 7);
        let c = StreamCase::random(&mut rng);
        let ranks = c.layout.ranks();
        let schedule = plan_transfers(&c.plan, c.expert_bytes, &c.config);
        let buffers = BufferLayout {
            expert_bytes: c.expert_bytes,
            home_offsets: &c.home_offsets,
            slot_bytes: c.slot_bytes,
        };
        let mut stream = tiles::compile(&c.plan, &schedule, &buffers, c.tile).unwrap();
        let slot_len = c.slot_len();
        let expected = cpu_slots(&c.plan, &schedule, &c.weights, c.slot_bytes, slot_len);
        // One slot set, or the second of two (the other must stay untouched).
        let sets = 1 + rng.below(2) as usize;
        let grid_seed = rng.next();
        for device in default_devices() {
            let gpu = (!device.emulated()).then_some(device.exec.as_ref());
            let grid = Grid::random(&mut Rng(grid_seed), gpu);
            let device = grid.on(device);
            let exec = device.exec.as_ref();
            let what = format!(
                "{} case {case}: tile {}, {:?}, expert_bytes {}, {grid:?}",
                device.name(),
                c.tile,
                c.config,
                c.expert_bytes
            );
            let homes = upload_homes(exec, &c.homes);
            let flags = &stream.flags_per_rank;
            let rank_buffers =
                RankBuffers::new(exec, Arc::clone(&homes), (slot_len, sets), flags).unwrap();
            // Landed bytes counted per `tile` bytes of slot buffer: every stored tile once per
            // destination, in the region it lands in.
            let regions = slot_len / c.tile as usize + 1;
            let landed = LandedBytes::new(exec, ranks, regions, u64::from(c.tile)).unwrap();
            let uploaded = DeviceTileStream::upload(exec, Stream::MAIN, &stream, ranks).unwrap();
            assert_eq!(uploaded.len(), stream.tasks.len());
            let set = sets - 1;
            let launch = (grid.blocks, grid.threads);
            uploaded
                .launch(
                    exec,
                    Stream::MAIN,
                    (&rank_buffers, set),
                    launch,
                    Some(&landed),
                )
                .unwrap();
            uploaded
                .finish(exec, Stream::MAIN)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            relay_grids.count(grid, &stream, &device);
            let got = slot_set(exec, &rank_buffers, set, sets);
            for (r, (got, want)) in got.iter().zip(&expected).enumerate() {
                assert!(got == want, "{what}: rank {r} differs");
            }
            let mut want = vec![0u32; ranks * regions];
            for t in &stream.tasks {
                for d in &stream.dsts[t.dst_begin as usize..(t.dst_begin + t.n_dst) as usize] {
                    let region = ((d.offset + t.tile_offset) / u64::from(c.tile)) as usize;
                    want[d.rank as usize * regions + region] += t.len;
                }
            }
            let got = landed.read(exec, Stream::MAIN).unwrap();
            assert_eq!(got, want, "{what}: landed bytes");
            let filled: u64 = want.iter().map(|&b| u64::from(b)).sum();
            assert_eq!(
                filled,
                c.plan.replicas() as u64 * c.expert_bytes,
                "{what}: every replica lands once"
            );
            // Slot buffers smaller than the tasks touch are refused before anything runs.
            if !stream.tasks.is_empty() {
                let short = c.expert_bytes as usize - 1;
                let small = RankBuffers::new(exec, homes, (short, 1), flags).unwrap();
                let refused = uploaded.launch(exec, Stream::MAIN, (&small, 0), (1, 128), None);
                assert!(
                    matches!(refused, Err(CudaError::BufferTooSmall { .. })),
                    "{what}: {refused:?}"
                );
            }
        }

        // A relay counter that can never reach its target (a broken stream): the host wrapper
        // refuses it; launched anyway, the kernel gives up after its stall limit and raises the
        // stall word instead of spinning forever, and with several blocks every one of them
        // stops (the launch returns). On the emulator only, whose stall limit is a setting.
        if let Some(waiting) = stream.tasks.iter_mut().find(|t| t.wait_flag >= 0) {
            waiting.wait_target += 1_000;
            if Emulator::shared().is_none() {
                continue;
            }
            let grid = Grid::random(&mut Rng(grid_seed), None);
            let mut settings = grid.settings();
            settings.tile_stall_ns = 50_000_000;
            let device = emulated(settings).unwrap();
            let exec = device.exec.as_ref();
            assert!(matches!(
                DeviceTileStream::upload(exec, Stream::MAIN, &stream, ranks),
                Err(CudaError::UnrunnableTask { .. })
            ));
            let homes = upload_homes(exec, &c.homes);
            let stall = launch_raw_stream(exec, &stream, &homes, slot_len, grid);
            assert_eq!(stall, 1, "case {case}, {grid:?}");
            stalled += 1;
        }
    }
    if Emulator::shared().is_some() {
        assert!(stalled >= 3, "only {stalled} cases had a relay to break");
    }
    relay_grids.check();
}

#[test]
fn plan_tiles_then_tile_stream_fill_slots_like_the_cpu_executor() {
    // plan_tiles, then tile_stream reading the task count where plan_tiles wrote it, through
    // the host wrappers as the data plane chains them (from the device solver's plan in place
    // for the quota planner), against the CPU executor over the host's relay schedule.
    let mut replicated = 0;
    for case in 0..12u64 {
        let mut rng = Rng(case + 9000);
        let layout = random_layout(&mut rng, 16, 40);
        let algo = [Algo::Quota, Algo::EplbExact, Algo::GreedyMove][case as usize % 3];
        let hot = 1 + rng.below(3) as usize;
        let load = skewed_load(&mut rng, layout.ranks(), layout.experts(), hot);
        let u_min = 1 + rng.below(4);
        let settings = Settings {
            u_min,
            ..Settings::default()
        };
        let plan = algo.build(&settings).plan(&layout, &load).unwrap();
        let expert_bytes = 16 * (1 + rng.below(40)) + rng.below(2) * rng.below(16);
        let geometry = TileGeometry {
            expert_bytes,
            slot_bytes: expert_bytes + rng.below(2) * 16,
            tile_bytes: 16 * (1 + rng.below(8)) as u32,
            relay: RelayConfig {
                threshold: rng.below(4) as usize,
                chunk_bytes: [0, 64, 100][rng.below(3) as usize],
            },
        };
        let weights = expert_weights(&mut rng, layout.experts(), expert_bytes);
        let (home_bytes, home_offsets) = homes(&layout, &weights, 8);
        let schedule = plan_transfers(&plan, expert_bytes, &geometry.relay);
        let buffers = BufferLayout {
            expert_bytes,
            home_offsets: &home_offsets,
            slot_bytes: geometry.slot_bytes,
        };
        let want = tiles::compile(&plan, &schedule, &buffers, geometry.tile_bytes).unwrap();
        let (n_slot, slot_len) = (
            layout.slots_per_rank(),
            layout.slots_per_rank() * geometry.slot_bytes as usize,
        );
        let expected = cpu_slots(&plan, &schedule, &weights, geometry.slot_bytes, slot_len);
        let grid_seed = rng.next();
        for device in default_devices() {
            let gpu = (!device.emulated()).then_some(device.exec.as_ref());
            let grid = Grid::random(&mut Rng(grid_seed), gpu);
            let device = grid.on(device);
            let exec = &device.exec;
            let what = format!(
                "{} case {case}: {algo:?} R={} E={} n_slot={n_slot}, {geometry:?}, {grid:?}",
                device.name(),
                layout.ranks(),
                layout.experts()
            );
            let planner = TilePlanner::new(
                Arc::clone(exec),
                &layout,
                &geometry,
                std::slice::from_ref(&home_offsets),
            )
            .unwrap();
            // Kept alive until the stream has run: the planner reads the plan where it lies.
            let (_solver, _uploaded);
            if algo == Algo::Quota {
                let mut solver =
                    DeviceQuotaSolver::new(Arc::clone(exec), &layout, u_min, TargetRule::BestFit)
                        .unwrap();
                solver.solve_on(Stream::MAIN, &load).unwrap();
                let guard = Some(solver.status());
                planner
                    .plan(Stream::MAIN, solver.device_plan(), guard, 0)
                    .unwrap();
                let (solved, _) = solver.download(Stream::MAIN, &load).unwrap();
                assert_eq!(solved, plan, "{what}: the device solver's plan");
                _solver = Some(solver);
            } else {
                let uploaded = DevicePlan::upload(exec.as_ref(), Stream::MAIN, &plan).unwrap();
                planner.plan(Stream::MAIN, &uploaded, None, 0).unwrap();
                _uploaded = Some(uploaded);
            }
            let flags = vec![planner.flag_capacity(); layout.ranks()];
            let homes = upload_homes(exec.as_ref(), &home_bytes);
            let sets = 2;
            let rank_buffers =
                RankBuffers::new(exec.as_ref(), homes, (slot_len, sets), &flags).unwrap();
            let landed =
                LandedBytes::new(exec.as_ref(), layout.ranks(), n_slot, geometry.slot_bytes)
                    .unwrap();
            let launch = (grid.blocks, grid.threads);
            planner
                .stream(Stream::MAIN, (&rank_buffers, 0), launch, Some(&landed))
                .unwrap();
            // Waits for every replica to land, as the expert GEMMs reading it do.
            for r in 0..layout.ranks() {
                for (s, expert) in plan.rank_slots(r).iter().enumerate() {
                    if expert.is_some() {
                        planner
                            .wait_for_slot(Stream::MAIN, &landed, (r, s), expert_bytes)
                            .unwrap();
                    }
                }
            }
            let counts = planner
                .finish(Stream::MAIN)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(counts.tasks as usize, want.tasks.len(), "{what}");
            assert_eq!(planner.download(Stream::MAIN).unwrap(), want, "{what}");
            let got = slot_set(exec.as_ref(), &rank_buffers, 0, sets);
            for (r, (got, want)) in got.iter().zip(&expected).enumerate() {
                assert!(got == want, "{what}: rank {r} differs");
            }
            let got = landed.read(exec.as_ref(), Stream::MAIN).unwrap();
            let want: Vec<u32> = (0..layout.ranks())
                .flat_map(|r| plan.rank_slots(r).iter())
                .map(|e| if e.is_some() { expert_bytes as u32 } else { 0 })
                .collect();
            assert_eq!(got, want, "{what}: landed bytes per slot");
        }
        replicated += usize::from(plan.replicas() > 0);
    }
    assert!(replicated >= 8, "only {replicated} of 12 cases replicate");
}

#[test]
fn a_slot_wait_gives_up_on_a_slot_that_never_fills() {
    // On the emulator only, whose stall limit is a setting (a GPU's is 5 s).
    let mut settings = EmulatorSettings::default();
    settings.tile_stall_ns = 50_000_000;
    let Some(device) = emulated(settings) else {
        return;
    };
    let exec = &device.exec;
    let layout = Layout::contiguous(4, 8, 2).unwrap();
    let plan = skewed_plan(&mut Rng(3), &layout, Algo::Quota);
    let geometry = TileGeometry {
        expert_bytes: 256,
        slot_bytes: 256,
        tile_bytes: 64,
        relay: RelayConfig::default(),
    };
    let weights = expert_weights(&mut Rng(4), 8, 256);
    let (home_bytes, home_offsets) = homes(&layout, &weights, 0);
    let planner = TilePlanner::new(
        Arc::clone(exec),
        &layout,
        &geometry,
        std::slice::from_ref(&home_offsets),
    )
    .unwrap();
    let uploaded = DevicePlan::upload(exec.as_ref(), Stream::MAIN, &plan).unwrap();
    planner.plan(Stream::MAIN, &uploaded, None, 0).unwrap();
    let flags = vec![planner.flag_capacity(); 4];
    let homes = upload_homes(exec.as_ref(), &home_bytes);
    let rank_buffers = RankBuffers::new(exec.as_ref(), homes, (512, 1), &flags).unwrap();
    let landed = LandedBytes::new(exec.as_ref(), 4, 2, 256).unwrap();
    planner
        .stream(Stream::MAIN, (&rank_buffers, 0), (1, 64), Some(&landed))
        .unwrap();
    let (rank, slot) = (0..4)
        .flat_map(|r| (0..2).map(move |s| (r, s)))
        .find(|&(r, s)| plan.rank_slots(r)[s].is_some())
        .expect("a replica");
    planner
        .wait_for_slot(Stream::MAIN, &landed, (rank, slot), 256)
        .unwrap();
    planner.finish(Stream::MAIN).unwrap();
    // One byte more than ever lands: the wait gives up and the replication reports a stall.
    planner
        .wait_for_slot(Stream::MAIN, &landed, (rank, slot), 257)
        .unwrap();
    assert!(matches!(
        planner.finish(Stream::MAIN),
        Err(CudaError::TileStreamStalled)
    ));
    // Lowered before the next replication, the stall word no longer fails it.
    planner.clear_stall(Stream::MAIN).unwrap();
    planner.finish(Stream::MAIN).unwrap();
    assert!(planner
        .wait_for_slot(Stream::MAIN, &landed, (rank, 2), 256)
        .is_err());
}
