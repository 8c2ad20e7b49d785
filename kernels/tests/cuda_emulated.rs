//! The real CUDA kernel sources, compiled as host C++ against a thread-per-CUDA-thread emulation
//! (kernels/emulator/emu.h), reproduce the CPU references on machines without a GPU: the
//! quota solver's plan equals the CPU planner's bit for bit (with the host's own shared-memory
//! layout), the permute / group / return / combine kernels are bitwise equal to the CPU data
//! plane, the device relay planner builds the host compiler's tile stream entry for entry, the
//! tile-streaming kernel fills every slot like the CPU executor (as a grid of up to four
//! concurrent blocks, relay chunks crossing blocks), and the gated activation between the expert
//! GEMMs computes `silu(gate) * up`.
//!
//! This is what keeps the GPU mirror of the planner honest in CI: change quota.rs without the
//! kernel and this fails. It cannot show cp.async, the GPU's weaker memory ordering or memory
//! across GPUs; the GPU tests (cuda_solver, cuda_permute, cuda_replicate) do. Needs a C++20
//! compiler (`$CXX`, else `c++`); without one it prints why and passes.

#![cfg(feature = "cuda")]

mod cuda_common;

use cuda_common::common::random_layout;
use cuda_common::Rng;
use rackfill_balancer::quota::{QuotaPlanner, TargetRule};
use rackfill_balancer::relay::{plan_transfers, RelayConfig, TransferSchedule};
use rackfill_balancer::{Algo, Balancer, Layout, LoadMatrix, Plan, Settings};
use rackfill_kernels::cuda::nvrtc;
use rackfill_kernels::cuda::solver::SolverShape;
use rackfill_kernels::cuda::tile_plan::{TileGeometry, TilePlanParams};
use rackfill_kernels::cuda::tiles::{self, BufferLayout, TileStream};
use rackfill_kernels::cuda::{PlanArrays, TilePlanFault};
use rackfill_kernels::{
    combine, distribute_replicas_sequential, group_by_instance, permute_tokens, scatter_pairs,
    DispatchBuffers, InstanceRouter,
};
use std::fmt::Write as _;
use std::io::Write as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{mpsc, OnceLock};
use std::time::Duration;

/// The kernel sources with the spellings a host compiler cannot take replaced; panics if a
/// replacement no longer applies (the kernel changed shape: update the emulation with it).
fn host_source() -> String {
    let replace = |text: &str, from: &str, to: &str| {
        assert!(
            text.contains(from),
            "emulation: '{from}' is gone from the kernels"
        );
        text.replace(from, to)
    };
    let mut src = nvrtc::QUOTA_SOLVER
        .program()
        .split_once("#line 1")
        .map(|(prelude, _)| prelude.to_string())
        .unwrap_or_default();
    // The solver's packed target keys can be switched off, to run both pick paths on one layer.
    src += &replace(
        nvrtc::QUOTA_SOLVER.source,
        "ctl.key_shift = packed_key_shift(R, hi0);",
        "ctl.key_shift = g_emu_packed_keys ? packed_key_shift(R, hi0) : NONE_U32;",
    );
    src += nvrtc::PERMUTE.source;
    src += nvrtc::EXPERTS.source;
    // Inline PTX has host stand-ins in the source (RACKFILL_HOST_EMULATOR); the stall limit is
    // the emulator's, set per run.
    src += "#define TILE_STALL_NS g_tile_stall_ns\n";
    src += nvrtc::REPLICATE.source;
    src += nvrtc::TILE_PLAN.source;
    src = replace(
        &src,
        "extern __shared__ __align__(16) u8 smem[];",
        "u8* smem = g_smem;",
    );
    src = replace(
        &src,
        "extern __shared__ u32 shm[];",
        "u32* shm = (u32*)g_smem;",
    );
    replace(&src, "extern \"C\" __global__", "")
}

/// Builds the emulator once per test binary; `None` (after printing why) without a compiler.
fn emulator() -> Option<&'static Path> {
    static BUILT: OnceLock<Option<PathBuf>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
            if Command::new(&cxx).arg("--version").output().is_err() {
                eprintln!("emulated kernels: skipped, no C++ compiler ({cxx})");
                return None;
            }
            let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cuda_emulator");
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("kernels.inc"), host_source()).unwrap();
            let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cuda_emulator");
            let header = Path::new(env!("CARGO_MANIFEST_DIR")).join("emulator");
            let exe = dir.join("emulator");
            let out = Command::new(&cxx)
                .args(["-std=c++20", "-O2", "-pthread", "-w", "-I"])
                .arg(&header)
                .arg("-I")
                .arg(&dir)
                .arg(here.join("emulator.cpp"))
                .arg("-o")
                .arg(&exe)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "the kernels do not build under the emulation:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            Some(exe)
        })
        .as_deref()
}

/// Runs one emulation of a single block; returns its named output lines.
fn run(exe: &Path, mode: &str, warps: u32, input: &str) -> Vec<(String, Vec<u64>)> {
    run_args(exe, &[mode, &warps.to_string()], input)
}

/// How `tile_stream` runs under the emulation: `blocks` concurrent blocks (forked processes
/// sharing the device memory) of `warps` warps, every system-scope fence held back
/// `fence_delay_us` so that relay consumers in other blocks find chunks still in flight, and a
/// relay wait declared stalled after `stall_ms`.
#[derive(Debug, Clone, Copy)]
struct Grid {
    warps: u32,
    blocks: u32,
    fence_delay_us: u32,
    stall_ms: u32,
}

impl Grid {
    /// One to four blocks of one to three warps; a grid of several blocks gets a fence delay.
    /// Blocks really wait for each other there, on a machine that may be busy with other
    /// tests: a healthy stream gets 20 s before a wait counts as a stall.
    fn random(rng: &mut Rng) -> Self {
        let blocks = 1 + rng.below(4) as u32;
        Self {
            warps: 1 + rng.below(3) as u32,
            blocks,
            fence_delay_us: if blocks > 1 { 200 } else { 0 },
            stall_ms: 20_000,
        }
    }

    /// The same grid for a stream that is broken on purpose: its stall is expected, soon.
    fn expecting_a_stall(self) -> Self {
        Self {
            stall_ms: 50,
            ..self
        }
    }
}

/// Runs `mode` (`replicate` or `distribute`) with `tile_stream` on `grid`.
fn run_grid(exe: &Path, mode: &str, grid: Grid, input: &str) -> Vec<(String, Vec<u64>)> {
    let args = [grid.warps, grid.blocks, grid.fence_delay_us, grid.stall_ms].map(|v| v.to_string());
    run_args(exe, &[mode, &args[0], &args[1], &args[2], &args[3]], input)
}

/// How long one emulation may run: a kernel that loops forever fails its test instead of
/// holding CI up (the slowest emulation takes a few seconds).
const EMULATION_LIMIT: Duration = Duration::from_secs(180);

fn run_args(exe: &Path, args: &[&str], input: &str) -> Vec<(String, Vec<u64>)> {
    let mode = args[0];
    // Its own process group, so that a kill also reaches the blocks it forked.
    let mut child = Command::new(exe)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    let group = child.id();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let (done, finished) = mpsc::channel();
    std::thread::spawn(move || done.send(child.wait_with_output()));
    let Ok(out) = finished.recv_timeout(EMULATION_LIMIT) else {
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{group}")])
            .status();
        panic!("emulator {mode} ran past {EMULATION_LIMIT:?}: a kernel loops forever");
    };
    let out = out.unwrap();
    assert!(out.status.success(), "emulator {mode} failed");
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|line| {
            let mut it = line.split_whitespace();
            let name = it.next().unwrap().to_string();
            // -1 (an empty slot) reads as u64::MAX and converts back with `as i32`.
            let value = |x: &str| {
                x.parse::<u64>()
                    .unwrap_or_else(|_| x.parse::<i64>().unwrap() as u64)
            };
            (name, it.map(value).collect())
        })
        .collect()
}

fn get<'a>(out: &'a [(String, Vec<u64>)], name: &str) -> &'a [u64] {
    &out.iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no '{name}' in {out:?}"))
        .1
}

fn join<T: std::fmt::Display>(v: &[T]) -> String {
    let mut s = String::new();
    for x in v {
        write!(s, "{x} ").unwrap();
    }
    s
}

fn bits(v: &[f32]) -> Vec<u64> {
    v.iter().map(|x| u64::from(x.to_bits())).collect()
}

fn widen(v: &[u32]) -> Vec<u64> {
    v.iter().map(|&x| u64::from(x)).collect()
}

/// How the emulated solver runs: `warps` probe warps, the load staged in shared memory or not,
/// and whether it may pick targets by packed keys (off: the shuffle tree, whatever the load).
#[derive(Debug, Clone, Copy)]
struct SolverLaunch {
    warps: u32,
    stage: bool,
    packed_keys: bool,
}

impl SolverLaunch {
    fn new(warps: u32, stage: bool) -> Self {
        Self {
            warps,
            stage,
            packed_keys: true,
        }
    }
}

/// What the emulated solver produced for one layer.
struct EmulatedSolve {
    arrays: PlanArrays,
    /// Whether the probes picked targets by packed 32-bit keys.
    packed_keys: bool,
    /// Warp-synchronous operations on the longest thread's path (a count, not a time).
    warp_ops: u64,
}

/// Solves one layer in the emulator with the host's layout for `launch`.
fn emulate_solver(
    exe: &Path,
    layout: &Layout,
    load: &LoadMatrix,
    u_min: u64,
    rule: TargetRule,
    launch: SolverLaunch,
) -> EmulatedSolve {
    let SolverLaunch { warps, stage, .. } = launch;
    let shape = SolverShape::new(layout, u_min, rule, warps, stage).unwrap();
    let p = shape.params;
    let mut input = format!(
        "{} {} {} {} {} {}\n{}\n{}\n",
        layout.ranks(),
        layout.experts(),
        layout.slots_per_rank(),
        p.u_min,
        p.rule,
        u8::from(stage),
        join(layout.home_map()),
        join(load.as_flat())
    );
    let offsets = [
        p.cumulative_capacity,
        p.sh_load,
        p.sh_totals,
        p.sh_main_quota,
        p.sh_rank_load,
        p.sh_main_offsets,
        p.sh_hottest,
        p.sh_by_load,
        p.sh_best,
        p.sh_sorted,
        p.sh_first_prefix,
        p.sh_distinct,
        p.sh_warps,
        p.warp_stride,
        p.w_a,
        p.w_b,
        p.w_c,
        p.w_free,
        p.w_quota,
        p.w_expert,
        p.w_rank,
    ];
    writeln!(input, "{}{}", join(&offsets), shape.shared_bytes).unwrap();
    let pack = u8::from(launch.packed_keys).to_string();
    let out = run_args(exe, &["solver", &warps.to_string(), &pack], &input);
    let status = get(&out, "status");
    assert_eq!(status[0], 0, "solver status");
    let packed_keys = status[8] != 0;
    let narrow = |name| {
        get(&out, name)
            .iter()
            .map(|&v| v as u32)
            .collect::<Vec<u32>>()
    };
    let arrays = PlanArrays {
        slots: get(&out, "slots").iter().map(|&v| v as i32).collect(),
        inst_offsets: narrow("inst_offsets"),
        inst_rank: narrow("inst_rank"),
        inst_quota: get(&out, "inst_quota").to_vec(),
        split_offsets: narrow("split_offsets"),
        cumulative: get(&out, "cumulative").to_vec(),
    };
    EmulatedSolve {
        arrays,
        packed_keys,
        warp_ops: get(&out, "warp_ops")[0],
    }
}

/// The emulated solver's plan for one layer, which must be the CPU planner's, and whether it
/// packed its keys: where `launch` allows them, exactly when [`cuda_common::packs_keys`] says.
/// Returns the CPU plan and what the emulation reported.
fn assert_emulated_plan(
    exe: &Path,
    layout: &Layout,
    load: &LoadMatrix,
    u_min: u64,
    rule: TargetRule,
    launch: SolverLaunch,
    what: &str,
) -> (Plan, EmulatedSolve) {
    let cpu = QuotaPlanner::with_rule(u_min, rule)
        .plan(layout, load)
        .unwrap();
    let solve = emulate_solver(exe, layout, load, u_min, rule, launch);
    let gpu = solve.arrays.clone().into_plan(layout, load, u_min).unwrap();
    assert_eq!(gpu, cpu, "{what}: u_min={u_min} {rule:?} {launch:?}");
    assert_eq!(
        solve.packed_keys,
        launch.packed_keys && cuda_common::packs_keys(layout, load),
        "{what}: packed keys"
    );
    (cpu, solve)
}

#[test]
fn emulated_solver_reproduces_the_cpu_planner() {
    let Some(exe) = emulator() else { return };
    let mut rng = Rng(2024);
    let (mut replicated, mut wide) = (0, 0);
    for case in 0..50 {
        let layout = random_layout(&mut rng, 20, 48);
        let (ranks, experts, slots) = (layout.ranks(), layout.experts(), layout.slots_per_rank());
        let hot: Vec<usize> = (0..3).map(|_| rng.below(experts as u64) as usize).collect();
        let family = rng.below(5);
        let rows: Vec<Vec<u64>> = (0..ranks)
            .map(|_| {
                (0..experts)
                    .map(|e| match (family, hot.contains(&e)) {
                        (0, true) => 200 + rng.below(400),
                        (0, false) => rng.below(30),
                        (1, _) => rng.below(50),
                        // Beyond 2^32 per cell: the split's 128-bit path, and slacks too wide
                        // for the packed target keys.
                        (2, true) => (1 << 40) + rng.below(1 << 30),
                        (2, false) => rng.below(1 << 36),
                        // Few distinct values: slacks that equal a move's need exactly, and
                        // ties between ranks, where the target rules' tie-breaks decide.
                        (3, true) => 64 + 8 * rng.below(4),
                        (3, false) => 8 * rng.below(3),
                        _ => 7,
                    })
                    .collect()
            })
            .collect();
        let load = LoadMatrix::from_rows(&rows).unwrap();
        let u_min = [1, 2, 5, 20][rng.below(4) as usize];
        let rule = if rng.below(2) == 0 {
            TargetRule::BestFit
        } else {
            TargetRule::LargestSlack
        };
        let launch = SolverLaunch::new([1, 2, 3, 4][rng.below(4) as usize], rng.below(2) == 0);
        let what = format!("case {case}: R={ranks} E={experts} n_slot={slots}");
        let (cpu, solve) = assert_emulated_plan(exe, &layout, &load, u_min, rule, launch, &what);
        replicated += usize::from(cpu.replicas() > 0);
        wide += usize::from(!solve.packed_keys);
    }
    assert!(replicated >= 15, "only {replicated} cases replicated");
    assert!(
        (5..45).contains(&wide),
        "{wide} of 50 cases too wide for packed keys: both pick paths must be covered"
    );
    // Right at the packing limit: R=4 keeps 2 bits for the rank, so the largest rank load must
    // stay below 2^30; one token-expert pair more and the solver takes the 64-bit path.
    let layout = Layout::contiguous(4, 8, 2).unwrap();
    for extra in [0, 1] {
        let mut rows = vec![vec![0u64; 8]; 4];
        // Expert 0 (rank 0's) takes 2^30 - 1 + extra pairs from two sources; a little elsewhere.
        rows[0][0] = (1 << 30) - 1 - 5 + extra;
        rows[1][0] = 5;
        rows[1][2] = 3;
        rows[2][4] = 2;
        let load = LoadMatrix::from_rows(&rows).unwrap();
        let what = format!("rank load 2^30 - 1 + {extra}");
        let launch = SolverLaunch::new(2, true);
        let (cpu, solve) =
            assert_emulated_plan(exe, &layout, &load, 1, TargetRule::BestFit, launch, &what);
        assert_eq!(solve.packed_keys, extra == 0, "{what}");
        assert!(cpu.replicas() > 0, "{what}");
    }
    // The paper's shape, load staged, as a GPU with large shared memory runs it: once with
    // packed keys and once forced onto the shuffle tree. Both give the CPU plan; the packed picks
    // shorten the warp-level critical path (the figure docs/gpu.md quotes, printed here).
    let layout = Layout::contiguous(64, 256, 2).unwrap();
    let load = cuda_common::skewed_load(&mut rng, 64, 256, 3);
    let packed = SolverLaunch::new(4, true);
    let tree = SolverLaunch {
        packed_keys: false,
        ..packed
    };
    let what = "R=64 E=256";
    let (cpu, fast) =
        assert_emulated_plan(exe, &layout, &load, 1, TargetRule::BestFit, packed, what);
    let (_, slow) = assert_emulated_plan(exe, &layout, &load, 1, TargetRule::BestFit, tree, what);
    assert!(fast.packed_keys && cpu.replicas() > 0);
    eprintln!(
        "emulated quota solver, R=64 E=256 n_slot=2, {} replicas: {} warp-synchronous operations \
         on the longest path with the shuffle tree, {} with packed keys",
        cpu.replicas(),
        slow.warp_ops,
        fast.warp_ops
    );
    assert!(
        fast.warp_ops * 2 < slow.warp_ops,
        "packed keys: {} warp operations, shuffle tree {}",
        fast.warp_ops,
        slow.warp_ops
    );
}

#[test]
fn emulated_permute_kernels_are_bitwise_equal_to_the_cpu_data_plane() {
    let Some(exe) = emulator() else { return };
    for case in 0..20u64 {
        let mut rng = Rng(case + 100);
        let ranks = 2 + rng.below(6) as usize;
        let experts = 4 + rng.below(20) as usize;
        let top_k = 1 + rng.below(4) as usize;
        let hidden = 1 + rng.below(9) as usize;
        let warps = 1 + rng.below(4) as u32;
        let layout = Layout::contiguous(ranks, experts, 2).unwrap();
        let mut batches = Vec::new();
        let mut load = LoadMatrix::zeros(ranks, experts);
        for r in 0..ranks {
            let tokens = rng.below(70) as usize;
            let mut ex = Vec::new();
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
                ex.extend(chosen);
            }
            for &e in &ex {
                *load.get_mut(r, e as usize) += 1;
            }
            let x: Vec<f32> = (0..tokens * hidden).map(|_| rng.unit()).collect();
            let w: Vec<f32> = (0..tokens * top_k).map(|_| rng.unit()).collect();
            batches.push((x, ex, w));
        }
        let plan = QuotaPlanner::new(1).plan(&layout, &load).unwrap();
        let router = InstanceRouter::new(&plan);
        let a = PlanArrays::from_plan(&plan).unwrap();
        let header = format!(
            "{ranks} {experts} {} {}\n{}\n{}\n{}\n{}\n",
            a.inst_rank.len(),
            a.cumulative.len(),
            join(&a.inst_offsets),
            join(&a.inst_rank),
            join(&a.split_offsets),
            join(&a.cumulative)
        );
        let mut sent: Vec<Vec<DispatchBuffers>> = Vec::new();
        for (r, (x, ex, w)) in batches.iter().enumerate() {
            let cpu = permute_tokens(r, x, hidden, top_k, ex, &router).unwrap();
            let input = format!(
                "{header}{hidden} {top_k} {r} {}\n{}\n{}\n{}\n",
                ex.len(),
                join(ex),
                join(&bits(x)),
                join(&bits(w))
            );
            let out = run(exe, "send", warps, &input);
            if !ex.is_empty() {
                // Two routed experts out of range: reported by the ranking by destination.
                let mut bad = ex.clone();
                bad[0] = experts as u32;
                bad[ex.len() - 1] = u32::MAX;
                let input = format!(
                    "{header}{hidden} {top_k} {r} {}\n{}\n{}\n{}\n",
                    bad.len(),
                    join(&bad),
                    join(&bits(x)),
                    join(&bits(w))
                );
                let want = if bad.len() == 1 { 1 } else { 2 };
                assert_eq!(get(&run(exe, "send", warps, &input), "bad"), &[want]);
            }
            let offsets = get(&out, "dest_offsets");
            for (d, want) in cpu.iter().enumerate() {
                let seg = offsets[d] as usize..offsets[d + 1] as usize;
                let what = format!("case {case} src {r} dst {d}");
                assert_eq!(
                    &get(&out, "pairs")[seg.clone()],
                    &widen(&want.pairs)[..],
                    "{what}"
                );
                assert_eq!(
                    &get(&out, "experts")[seg.clone()],
                    &widen(&want.experts)[..],
                    "{what}"
                );
                assert_eq!(
                    &get(&out, "instances")[seg.clone()],
                    &widen(&want.instances)[..],
                    "{what}"
                );
                let rows = &get(&out, "rows")[seg.start * hidden..seg.end * hidden];
                assert_eq!(rows, &bits(&want.rows)[..], "{what}");
            }
            // Combine with identity experts: each pair's output is its own row.
            let mut pair_outputs = vec![0f32; ex.len() * hidden];
            for want in &cpu {
                scatter_pairs(&mut pair_outputs, hidden, &want.pairs, &want.rows).unwrap();
            }
            let combined = combine(&pair_outputs, w, ex.len() / top_k, top_k, hidden).unwrap();
            assert_eq!(
                get(&out, "combined"),
                &bits(&combined)[..],
                "case {case} src {r} combine"
            );
            sent.push(cpu);
        }
        for dst in 0..ranks {
            let inbox: Vec<DispatchBuffers> = sent.iter().map(|s| s[dst].clone()).collect();
            let cpu = group_by_instance(dst, &inbox, hidden, &router).unwrap();
            let n: usize = inbox.iter().map(DispatchBuffers::len).sum();
            let ex: Vec<u32> = inbox.iter().flat_map(|b| b.experts.clone()).collect();
            let ins: Vec<u32> = inbox.iter().flat_map(|b| b.instances.clone()).collect();
            let rows: Vec<f32> = inbox.iter().flat_map(|b| b.rows.clone()).collect();
            let input = format!(
                "{header}{hidden} {dst} {n}\n{}\n{}\n{}\n",
                join(&ex),
                join(&ins),
                join(&bits(&rows))
            );
            let out = run(exe, "recv", warps, &input);
            let offsets = get(&out, "offsets");
            let mut groups = Vec::new();
            for e in 0..experts {
                for key in a.inst_offsets[e]..a.inst_offsets[e + 1] {
                    let (lo, hi) = (
                        offsets[key as usize] as usize,
                        offsets[key as usize + 1] as usize,
                    );
                    if hi > lo {
                        groups.push((e as u32, key - a.inst_offsets[e], lo..hi));
                    }
                }
            }
            let want: Vec<_> = cpu
                .groups()
                .iter()
                .map(|g| (g.expert, g.instance, g.rows.clone()))
                .collect();
            assert_eq!(groups, want, "case {case} dst {dst} groups");
            assert_eq!(
                get(&out, "grouped"),
                &bits(cpu.rows())[..],
                "case {case} dst {dst} grouped"
            );
            // Returning the grouped rows themselves must give back the received order.
            assert_eq!(
                get(&out, "back"),
                &bits(&rows)[..],
                "case {case} dst {dst} return"
            );
        }
    }
}

#[test]
fn emulated_tile_stream_fills_slots_like_the_cpu_executor_and_gives_up_on_a_broken_relay() {
    let Some(exe) = emulator() else { return };
    let mut stalled = 0;
    let mut relay_grids = RelayGrids::default();
    for case in 0..20u64 {
        let mut rng = Rng(case + 7);
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
        let grid = Grid::random(&mut rng);
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
        let weights: Vec<Vec<u8>> = (0..experts)
            .map(|_| (0..expert_bytes).map(|_| rng.next() as u8).collect())
            .collect();
        let mut offsets = vec![0u64; experts];
        let homes: Vec<Vec<u8>> = (0..ranks)
            .map(|r| {
                let mut b = vec![0xEE; pad as usize];
                for &e in layout.main_experts(r) {
                    offsets[e as usize] = b.len() as u64;
                    b.extend_from_slice(&weights[e as usize]);
                }
                b
            })
            .collect();
        let schedule = plan_transfers(&plan, expert_bytes, &config);
        let buffers = BufferLayout {
            expert_bytes,
            home_offsets: &offsets,
            slot_bytes,
        };
        let mut stream = tiles::compile(&plan, &schedule, &buffers, tile).unwrap();
        let slot_len = slots * slot_bytes as usize;
        let expected = cpu_slots(&plan, &schedule, &weights, slot_bytes, slot_len);
        let input = replicate_input(&stream, slot_len, &homes);
        let out = run_grid(exe, "replicate", grid, &input);
        assert_eq!(get(&out, "stalled"), [0], "case {case}, {grid:?}");
        relay_grids.count(grid, &stream, &out);
        let got = slot_buffers(&out);
        assert_eq!(got.len(), ranks);
        for (r, got) in got.iter().enumerate() {
            let want: Vec<u64> = expected[r].iter().map(|&b| u64::from(b)).collect();
            assert!(
                **got == want,
                "case {case} rank {r}: tile {tile}, {config:?}, expert_bytes {expert_bytes}, {grid:?}"
            );
        }
        // Every stored tile is counted once per destination, in the counter of the slot region
        // it lands in (the harness counts per `tile` bytes of slot buffer).
        let regions = slot_len / tile as usize + 1;
        let mut landed = vec![vec![0u64; regions]; ranks];
        for t in &stream.tasks {
            let dsts = &stream.dsts[t.dst_begin as usize..(t.dst_begin + t.n_dst) as usize];
            for d in dsts {
                let region = (d.offset + t.tile_offset) / u64::from(tile);
                landed[d.rank as usize][region as usize] += u64::from(t.len);
            }
        }
        let got: Vec<&Vec<u64>> = out
            .iter()
            .filter(|(name, _)| name == "landed")
            .map(|(_, v)| v)
            .collect();
        assert_eq!(got.len(), ranks, "case {case}");
        for (r, got) in got.iter().enumerate() {
            assert_eq!(**got, landed[r], "case {case} rank {r}: landed bytes");
        }
        let filled: u64 = landed.iter().flatten().sum();
        let replicas = (0..ranks)
            .map(|r| plan.rank_slots(r).iter().flatten().count() as u64)
            .sum::<u64>();
        assert_eq!(
            filled,
            replicas * expert_bytes,
            "case {case}: every replica lands once"
        );

        // A relay counter that can never reach its target (a broken stream): the kernel gives
        // up after its stall limit and raises the stall word instead of spinning forever, and
        // with several blocks every one of them stops (the emulation returns).
        if let Some(waiting) = stream.tasks.iter_mut().find(|t| t.wait_flag >= 0) {
            waiting.wait_target += 1_000;
            let input = replicate_input(&stream, slot_len, &homes);
            let out = run_grid(exe, "replicate", grid.expecting_a_stall(), &input);
            assert_eq!(get(&out, "stalled"), [1], "case {case}, {grid:?}");
            stalled += 1;
        }
    }
    assert!(stalled >= 3, "only {stalled} cases had a relay to break");
    relay_grids.check();
}

/// Multi-block runs of streams with relays, and how often their blocks waited for a relay chunk:
/// the check that the concurrent grid really exercised cross-block waits, not just ran blocks
/// that never met.
#[derive(Default)]
struct RelayGrids {
    runs: usize,
    backoffs: u64,
}

impl RelayGrids {
    fn count(&mut self, grid: Grid, stream: &TileStream, out: &[(String, Vec<u64>)]) {
        if grid.blocks > 1 && stream.tasks.iter().any(|t| t.wait_flag >= 0) {
            self.runs += 1;
            self.backoffs += get(out, "backoffs")[0];
        }
    }

    fn check(&self) {
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

/// The emulator's `replicate` input: the stream, then every rank's memory.
fn replicate_input(stream: &TileStream, slot_len: usize, homes: &[Vec<u8>]) -> String {
    let mut input = format!(
        "{} {} {} {}\n",
        stream.flags_per_rank.len(),
        stream.tasks.len(),
        stream.dsts.len(),
        stream.tile_bytes
    );
    for t in &stream.tasks {
        writeln!(
            input,
            "{} {} {} {} {} {} {} {} {}",
            t.src_offset,
            t.tile_offset,
            t.src_rank,
            t.src_kind,
            t.len,
            t.dst_begin,
            t.n_dst,
            t.wait_flag,
            t.wait_target
        )
        .unwrap();
    }
    for d in &stream.dsts {
        writeln!(input, "{} {} {}", d.offset, d.rank, d.ready_flag).unwrap();
    }
    input + &rank_memory_input(slot_len, &stream.flags_per_rank, homes)
}

/// Every rank's slot buffer as the emulator printed it.
fn slot_buffers(out: &[(String, Vec<u64>)]) -> Vec<&Vec<u64>> {
    out.iter()
        .filter(|(name, _)| name == "slots")
        .map(|(_, v)| v)
        .collect()
}

/// The CPU executor's slot buffers (`slot_len` bytes per rank) after `schedule` for `plan`, expert
/// `e`'s weights being `weights[e]`.
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
    distribute_replicas_sequential(
        plan,
        schedule,
        weights[0].len(),
        &source,
        &mut views,
        slot_bytes as usize,
    )
    .unwrap();
    slots
}

/// The emulator's `RankMemory` section: slot buffer length, then per rank its ready counters and
/// home bytes.
fn rank_memory_input(slot_len: usize, flags: &[u32], homes: &[Vec<u8>]) -> String {
    let mut input = format!("{slot_len}\n");
    for (home, n_flags) in homes.iter().zip(flags) {
        writeln!(input, "{n_flags} {} {}", home.len(), join(home)).unwrap();
    }
    input
}

/// The emulator's `TilePlan` section: `plan_tiles`'s parameters and the plan's arrays.
fn tile_plan_input(
    p: &TilePlanParams,
    guard: u64,
    arrays: &PlanArrays,
    home_offsets: &[u64],
) -> String {
    format!(
        "{} {} {} {} {} {} {} {} {} {} {} {} {} {}\n{guard} {}\n{}\n{}\n{}\n{}\n",
        p.expert_bytes,
        p.slot_bytes,
        p.chunk_bytes,
        p.n_chunks,
        p.tile_bytes,
        p.ranks,
        p.experts,
        p.n_slot,
        p.threshold,
        p.task_capacity,
        p.dst_capacity,
        p.flag_capacity,
        p.edge_capacity,
        p.arena_in_shared,
        p.arena_bytes(),
        join(&arrays.slots),
        join(&arrays.inst_offsets),
        join(&arrays.inst_rank),
        join(home_offsets)
    )
}

/// What `plan_tiles` wrote under the emulation: the status word, or the stream.
fn emulate_tile_planner(
    exe: &Path,
    params: &TilePlanParams,
    guard: u64,
    arrays: &PlanArrays,
    home_offsets: &[u64],
    warps: u32,
) -> Result<TileStream, TilePlanFault> {
    let input = tile_plan_input(params, guard, arrays, home_offsets);
    let out = run(exe, "tiles", warps, &input);
    let header = get(&out, "header");
    if header[0] != 0 {
        assert_eq!(&header[1..], &[0, 0, 0], "a failed plan reports no tasks");
        return Err(TilePlanFault::from_status(header[0] as u32));
    }
    let tasks = get(&out, "tasks")
        .chunks(9)
        .map(|f| tiles::TileTask {
            src_offset: f[0],
            tile_offset: f[1],
            src_rank: f[2] as u32,
            src_kind: f[3] as u32,
            len: f[4] as u32,
            dst_begin: f[5] as u32,
            n_dst: f[6] as u32,
            wait_flag: f[7] as i32,
            wait_target: f[8] as u32,
            reserved: 0,
        })
        .collect::<Vec<_>>();
    let dsts = get(&out, "dsts")
        .chunks(3)
        .map(|f| tiles::TileDst {
            offset: f[0],
            rank: f[1] as u32,
            ready_flag: f[2] as i32,
        })
        .collect::<Vec<_>>();
    assert_eq!(
        (tasks.len(), dsts.len()),
        (header[1] as usize, header[2] as usize)
    );
    Ok(TileStream {
        stored_bytes: tasks
            .iter()
            .map(|t| u64::from(t.len) * u64::from(t.n_dst))
            .sum(),
        tasks,
        dsts,
        flags_per_rank: get(&out, "flags").iter().map(|&f| f as u32).collect(),
        tile_bytes: params.tile_bytes,
    })
}

/// A plan from one of the shipped planners for a skewed load of `layout`: several hot experts,
/// so that fan-outs cross every relay threshold the test draws.
fn skewed_plan(rng: &mut Rng, layout: &Layout, algo: Algo) -> Plan {
    let hot = 1 + rng.below(3) as usize;
    let load = cuda_common::skewed_load(rng, layout.ranks(), layout.experts(), hot);
    let settings = Settings {
        u_min: 1 + rng.below(4),
        ..Settings::default()
    };
    algo.build(&settings).plan(layout, &load).unwrap()
}

#[test]
fn emulated_tile_planner_builds_the_host_compilers_stream() {
    let Some(exe) = emulator() else { return };
    let algos = [
        Algo::Quota,
        Algo::QuotaPaper,
        Algo::EplbExact,
        Algo::GreedyMove,
    ];
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
        let warps = 1 + rng.below(4) as u32;
        let got = emulate_tile_planner(exe, &params, 0, &arrays, &home_offsets, warps);
        let what = format!(
            "case {case}: R={} E={} n_slot={} replicas={} {geometry:?} warps={warps}",
            layout.ranks(),
            layout.experts(),
            layout.slots_per_rank(),
            plan.replicas()
        );
        assert_eq!(got.as_ref(), Ok(&want), "{what}");
        relayed += usize::from(!schedule.trees.is_empty());
    }
    assert!(relayed >= 12, "only {relayed} cases built relay trees");

    // The paper's shape: R=64, E=256, n_slot=2, a 1 MiB expert in 256 KiB chunks.
    let layout = Layout::contiguous(64, 256, 2).unwrap();
    let mut rng = Rng(77);
    let plan = skewed_plan(&mut rng, &layout, Algo::Quota);
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
    let params = TilePlanParams::new(&layout, &geometry).unwrap();
    let arrays = PlanArrays::from_plan(&plan).unwrap();
    let got = emulate_tile_planner(exe, &params, 0, &arrays, &home_offsets, 8);
    assert_eq!(got.as_ref(), Ok(&want), "R=64 E=256");
}

#[test]
fn emulated_tile_planner_refuses_what_it_cannot_plan_and_plans_nothing() {
    let Some(exe) = emulator() else { return };
    let layout = Layout::contiguous(12, 24, 2).unwrap();
    let mut rng = Rng(5);
    let plan = skewed_plan(&mut rng, &layout, Algo::Quota);
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
    let want = tiles::compile(
        &plan,
        &schedule,
        &BufferLayout {
            expert_bytes: 4096,
            home_offsets: &home_offsets,
            slot_bytes: 4096,
        },
        512,
    )
    .unwrap();
    let params = TilePlanParams::new(&layout, &geometry).unwrap();
    let arrays = PlanArrays::from_plan(&plan).unwrap();
    let emulate = |params: &TilePlanParams, guard: u64, arrays: &PlanArrays| {
        emulate_tile_planner(exe, params, guard, arrays, &home_offsets, 2)
    };
    assert_eq!(emulate(&params, 0, &arrays).as_ref(), Ok(&want));
    // The solver failed: its plan buffers are not read.
    assert_eq!(emulate(&params, 3, &arrays), Err(TilePlanFault::Solver));
    // Capacities one short of what this plan needs.
    let short = |edit: &dyn Fn(&mut TilePlanParams)| {
        let mut p = params;
        edit(&mut p);
        emulate(&p, 0, &arrays)
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
    assert!(short(&|p| p.task_capacity = tasks).is_ok());
    // Malformed plans: a replica whose rank has no slot for it, an expert twice on one rank,
    // instance offsets that run past the replicas a layout can have.
    let filled = arrays.slots.iter().position(|&s| s >= 0).unwrap();
    let mut no_slot = arrays.clone();
    no_slot.slots[filled] = -1;
    assert_eq!(emulate(&params, 0, &no_slot), Err(TilePlanFault::Plan));
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
    assert_eq!(emulate(&direct, 0, &twice), Err(TilePlanFault::Plan));
    let mut past = arrays.clone();
    past.inst_offsets[24] = 24 + params.edge_capacity + 1;
    assert_eq!(emulate(&params, 0, &past), Err(TilePlanFault::Plan));
}

#[test]
fn emulated_device_planned_distribution_fills_slots_like_the_cpu_executor() {
    let Some(exe) = emulator() else { return };
    // plan_tiles, then tile_stream reading the task count where plan_tiles wrote it: the chain
    // GpuMoe runs, against the CPU executor over the host's relay schedule.
    let mut replicated = 0;
    for case in 0..12u64 {
        let mut rng = Rng(case + 9000);
        let layout = random_layout(&mut rng, 16, 40);
        let algo = [Algo::Quota, Algo::EplbExact, Algo::GreedyMove][case as usize % 3];
        let plan = skewed_plan(&mut rng, &layout, algo);
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
        let weights: Vec<Vec<u8>> = (0..layout.experts())
            .map(|_| (0..expert_bytes).map(|_| rng.next() as u8).collect())
            .collect();
        let mut home_offsets = vec![0u64; layout.experts()];
        let homes: Vec<Vec<u8>> = (0..layout.ranks())
            .map(|r| {
                let mut b = vec![0xEE; 8];
                for &e in layout.main_experts(r) {
                    home_offsets[e as usize] = b.len() as u64;
                    b.extend_from_slice(&weights[e as usize]);
                }
                b
            })
            .collect();
        let schedule = plan_transfers(&plan, expert_bytes, &geometry.relay);
        let slot_len = layout.slots_per_rank() * geometry.slot_bytes as usize;
        let expected = cpu_slots(&plan, &schedule, &weights, geometry.slot_bytes, slot_len);
        let params = TilePlanParams {
            arena_in_shared: 1,
            ..TilePlanParams::new(&layout, &geometry).unwrap()
        };
        let arrays = PlanArrays::from_plan(&plan).unwrap();
        let flags = vec![params.flag_capacity; layout.ranks()];
        let input = tile_plan_input(&params, 0, &arrays, &home_offsets)
            + &rank_memory_input(slot_len, &flags, &homes);
        let grid = Grid::random(&mut rng);
        let out = run_grid(exe, "distribute", grid, &input);
        assert_eq!(get(&out, "header")[0], 0, "case {case}: status");
        assert_eq!(get(&out, "stalled"), [0], "case {case}, {grid:?}");
        let slots = slot_buffers(&out);
        assert_eq!(slots.len(), layout.ranks());
        for (r, got) in slots.iter().enumerate() {
            let want: Vec<u64> = expected[r].iter().map(|&b| u64::from(b)).collect();
            assert!(
                **got == want,
                "case {case} rank {r}: {geometry:?}, {grid:?}, {} replicas",
                plan.replicas()
            );
        }
        replicated += usize::from(plan.replicas() > 0);
    }
    assert!(replicated >= 8, "only {replicated} of 12 cases replicate");
}

#[test]
fn emulated_gated_activation_is_silu_of_the_gate_times_up() {
    let Some(exe) = emulator() else { return };
    for (case, (rows, inter, warps)) in
        [(1usize, 1usize, 1u32), (7, 5, 1), (13, 300, 4), (40, 64, 2)]
            .into_iter()
            .enumerate()
    {
        let mut rng = Rng(case as u64 + 900);
        // Gates across the range where silu bends, overflows exp, and saturates.
        let gate_up: Vec<f32> = (0..rows * 2 * inter)
            .map(|i| {
                if i % (2 * inter) < inter {
                    (rng.unit() - 0.5) * 40.0
                } else {
                    rng.unit() * 3.0 - 1.5
                }
            })
            .collect();
        let input = format!("{rows} {inter}\n{}\n", join(&bits(&gate_up)));
        let out = run(exe, "act", warps, &input);
        let got = get(&out, "act");
        assert_eq!(got.len(), rows * inter);
        for r in 0..rows {
            for j in 0..inter {
                let g = f64::from(gate_up[r * 2 * inter + j]);
                let up = f64::from(gate_up[r * 2 * inter + inter + j]);
                let want = g / (1.0 + (-g).exp()) * up;
                let got = f64::from(f32::from_bits(got[r * inter + j] as u32));
                assert!(
                    (got - want).abs() <= 1e-6 * (1.0 + want.abs()),
                    "row {r} column {j}: {got} vs {want}"
                );
            }
        }
    }
}
