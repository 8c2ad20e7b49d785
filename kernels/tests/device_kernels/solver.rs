//! The quota solver (`quota_solver.cu`) against the CPU planner: launched directly with the
//! host's own shared-memory layout for any warp count, staged or not, and through
//! [`DeviceQuotaSolver`], the host wrapper the data plane uses.

use super::cuda_common::{
    default_devices, emulator, packs_keys, random_layout, read_u32, read_u64, skewed_load,
    upload_u32, upload_u64, zeroed, Rng,
};
use rackfill_balancer::quota::{QuotaPlanner, TargetRule};
use rackfill_balancer::{metrics, Balancer, Layout, LoadMatrix, Plan};
use rackfill_kernels::cuda::exec::{EmulatorSettings, Executor, KernelArg, Launch};
use rackfill_kernels::cuda::solver::{DeviceQuotaSolver, SolverShape};
use rackfill_kernels::cuda::PlanArrays;
use std::sync::Arc;

/// Entries of the kernel's status output (`ST_LEN`).
const STATUS_LEN: usize = 9;

/// What one direct launch of the solver produced.
struct KernelSolve {
    arrays: PlanArrays,
    /// Whether the probes picked targets by packed 32-bit keys (status word 8).
    packed_keys: bool,
}

/// Solves one layer with `quota_solve` launched directly: `warps` probe warps, the load staged in
/// shared memory or not, every buffer sized as the host wrapper sizes it.
fn launch_solver(
    exec: &dyn Executor,
    layout: &Layout,
    load: &LoadMatrix,
    (u_min, rule): (u64, TargetRule),
    (warps, stage): (u32, bool),
) -> KernelSolve {
    let shape = SolverShape::new(layout, u_min, rule, warps, stage).unwrap();
    let p = shape.params;
    let (r, e) = (layout.ranks(), layout.experts());
    let moves = p.max_moves as usize;
    let mut offsets = Vec::with_capacity(r + 1);
    let mut mains = Vec::with_capacity(e);
    for rank in 0..r {
        offsets.push(mains.len() as u32);
        mains.extend_from_slice(layout.main_experts(rank));
    }
    offsets.push(mains.len() as u32);
    let load_buf = upload_u64(exec, load.as_flat());
    let (offsets_buf, mains_buf) = (upload_u32(exec, &offsets), upload_u32(exec, &mains));
    let home = upload_u32(exec, layout.home_map());
    let status = zeroed(exec, 8 * STATUS_LEN);
    let slots = zeroed(exec, 4 * r * layout.slots_per_rank());
    let inst_offsets = zeroed(exec, 4 * (e + 1));
    let inst_rank = zeroed(exec, 4 * (e + moves));
    let inst_quota = zeroed(exec, 8 * (e + moves));
    let split_offsets = zeroed(exec, 4 * (e + 1));
    let cumulative = zeroed(exec, 8 * p.cumulative_capacity as usize);
    let args = [
        KernelArg::params(&p),
        KernelArg::from(&load_buf),
        KernelArg::from(&offsets_buf),
        KernelArg::from(&mains_buf),
        KernelArg::from(&home),
        KernelArg::from(&status),
        KernelArg::from(&slots),
        KernelArg::from(&inst_offsets),
        KernelArg::from(&inst_rank),
        KernelArg::from(&inst_quota),
        KernelArg::from(&split_offsets),
        KernelArg::from(&cumulative),
    ];
    let launch = Launch {
        grid: [1, 1, 1],
        block: warps * 32,
        shared_bytes: shape.shared_bytes as u32,
    };
    // SAFETY: `quota_solve`'s parameters one for one; every output is as large as the shape's
    // parameters promise the kernel (the sizes `DeviceQuotaSolver` allocates).
    unsafe { exec.launch("quota_solve", launch, &args) }.unwrap();
    let status = read_u64(exec, &status, STATUS_LEN);
    assert_eq!(status[0], 0, "solver status {status:?}");
    let inst_offsets = read_u32(exec, &inst_offsets, e + 1);
    let split_offsets = read_u32(exec, &split_offsets, e + 1);
    let (instances, cells) = (inst_offsets[e] as usize, split_offsets[e] as usize);
    let arrays = PlanArrays {
        slots: read_u32(exec, &slots, r * layout.slots_per_rank())
            .into_iter()
            .map(|s| s as i32)
            .collect(),
        inst_rank: read_u32(exec, &inst_rank, instances),
        inst_quota: read_u64(exec, &inst_quota, instances),
        cumulative: read_u64(exec, &cumulative, cells),
        inst_offsets,
        split_offsets,
    };
    KernelSolve {
        arrays,
        packed_keys: status[8] != 0,
    }
}

/// Solves one layer with a direct launch on `exec`, which must give the CPU planner's plan, and
/// packed keys exactly where `packed_allowed` and [`packs_keys`] say. Returns the CPU plan.
fn assert_kernel_plan(
    exec: &dyn Executor,
    layout: &Layout,
    load: &LoadMatrix,
    (u_min, rule): (u64, TargetRule),
    (warps, stage): (u32, bool),
    packed_allowed: bool,
    what: &str,
) -> (Plan, bool) {
    let cpu = QuotaPlanner::with_rule(u_min, rule)
        .plan(layout, load)
        .unwrap();
    let solve = launch_solver(exec, layout, load, (u_min, rule), (warps, stage));
    let got = solve.arrays.into_plan(layout, load, u_min).unwrap();
    let what = format!("{what}: u_min={u_min} {rule:?} warps={warps} staged={stage}");
    assert_eq!(got, cpu, "{what}");
    assert_eq!(
        solve.packed_keys,
        packed_allowed && packs_keys(layout, load),
        "{what}: packed keys"
    );
    (cpu, solve.packed_keys)
}

/// A random layer's load: one of five families (hot experts, uniform noise, cells beyond 2^32
/// for the split's 128-bit path and slacks too wide for packed keys, few distinct values for
/// ties, constant).
fn random_load(rng: &mut Rng, layout: &Layout) -> LoadMatrix {
    let experts = layout.experts();
    let hot: Vec<usize> = (0..3).map(|_| rng.below(experts as u64) as usize).collect();
    let family = rng.below(5);
    let rows: Vec<Vec<u64>> = (0..layout.ranks())
        .map(|_| {
            (0..experts)
                .map(|e| match (family, hot.contains(&e)) {
                    (0, true) => 200 + rng.below(400),
                    (0, false) => rng.below(30),
                    (1, _) => rng.below(50),
                    (2, true) => (1 << 40) + rng.below(1 << 30),
                    (2, false) => rng.below(1 << 36),
                    (3, true) => 64 + 8 * rng.below(4),
                    (3, false) => 8 * rng.below(3),
                    _ => 7,
                })
                .collect()
        })
        .collect();
    LoadMatrix::from_rows(&rows).unwrap()
}

/// An 8 x 16 load with one expert near 2^40 pairs per source: `d * c` overflows 64 bits in the
/// split, which takes the 128-bit path.
fn wide_load() -> LoadMatrix {
    let mut rows = vec![vec![1u64 << 20; 16]; 8];
    for (r, row) in rows.iter_mut().enumerate() {
        row[3] = (1 << 40) + r as u64 * 977;
    }
    LoadMatrix::from_rows(&rows).unwrap()
}

#[test]
fn the_solver_kernel_reproduces_the_cpu_planner_on_random_layers() {
    for device in default_devices() {
        let exec = device.exec.as_ref();
        let mut rng = Rng(2024);
        let (mut replicated, mut wide) = (0, 0);
        let cases = if device.emulated() { 40 } else { 200 };
        for case in 0..cases {
            let layout = random_layout(&mut rng, 20, 48);
            let load = random_load(&mut rng, &layout);
            let u_min = [1, 2, 5, 20][rng.below(4) as usize];
            let rule = if rng.below(2) == 0 {
                TargetRule::BestFit
            } else {
                TargetRule::LargestSlack
            };
            let launch = ([1, 2, 3, 4][rng.below(4) as usize], rng.below(2) == 0);
            let what = format!(
                "{} case {case}: R={} E={} n_slot={}",
                device.name(),
                layout.ranks(),
                layout.experts(),
                layout.slots_per_rank()
            );
            let (cpu, packed) =
                assert_kernel_plan(exec, &layout, &load, (u_min, rule), launch, true, &what);
            replicated += usize::from(cpu.replicas() > 0);
            wide += usize::from(!packed);
        }
        assert!(
            replicated >= cases * 3 / 10,
            "only {replicated} cases replicated"
        );
        assert!(
            (cases / 10..cases * 9 / 10).contains(&wide),
            "{wide} of {cases} cases too wide for packed keys: both pick paths must be covered"
        );
        // Right at the packing limit: R=4 keeps 2 bits for the rank, so the largest rank load must
        // stay below 2^30; one token-expert pair more and the solver takes the 64-bit path.
        let layout = Layout::contiguous(4, 8, 2).unwrap();
        for extra in [0, 1] {
            let mut rows = vec![vec![0u64; 8]; 4];
            rows[0][0] = (1 << 30) - 1 - 5 + extra;
            rows[1][0] = 5;
            rows[1][2] = 3;
            rows[2][4] = 2;
            let load = LoadMatrix::from_rows(&rows).unwrap();
            let what = format!("{}: rank load 2^30 - 1 + {extra}", device.name());
            let rule = (1, TargetRule::BestFit);
            let (cpu, packed) =
                assert_kernel_plan(exec, &layout, &load, rule, (2, true), true, &what);
            assert_eq!(packed, extra == 0, "{what}");
            assert!(cpu.replicas() > 0, "{what}");
        }
        let layout = Layout::contiguous(8, 16, 2).unwrap();
        let what = format!("{}: wide", device.name());
        let rule = (1, TargetRule::BestFit);
        let (cpu, _) =
            assert_kernel_plan(exec, &layout, &wide_load(), rule, (2, true), true, &what);
        assert!(cpu.replicas() > 0, "{what}");
    }
}

/// The paper's shape, load staged, as a GPU with large shared memory runs it: with packed keys
/// and forced onto the shuffle tree (an emulator setting). Both give the CPU plan; the packed
/// picks shorten the warp-level critical path (the figure docs/gpu.md quotes, printed here).
#[test]
fn packed_keys_shorten_the_solvers_critical_path_at_the_paper_shape() {
    let layout = Layout::contiguous(64, 256, 2).unwrap();
    let load = skewed_load(&mut Rng(64), 64, 256, 3);
    let rule = (1, TargetRule::BestFit);
    let mut replicas = 0;
    // The emulator's packed run is the first of the two below.
    for device in default_devices().into_iter().filter(|d| !d.emulated()) {
        let what = format!("{}: R=64 E=256", device.name());
        let (cpu, packed) = assert_kernel_plan(
            device.exec.as_ref(),
            &layout,
            &load,
            rule,
            (4, true),
            true,
            &what,
        );
        assert!(packed && cpu.replicas() > 0, "{what}");
        replicas = cpu.replicas();
    }
    let mut warp_ops = [0u64; 2];
    for (ops, packed_keys) in warp_ops.iter_mut().zip([1, 0]) {
        let mut settings = EmulatorSettings::default();
        settings.packed_keys = packed_keys;
        let Some(emu) = emulator(settings) else {
            return;
        };
        let what = format!("emulated R=64 E=256, packed keys {packed_keys}");
        let allowed = packed_keys == 1;
        let (cpu, packed) = assert_kernel_plan(
            emu.as_ref(),
            &layout,
            &load,
            rule,
            (4, true),
            allowed,
            &what,
        );
        assert!(packed == allowed && cpu.replicas() > 0, "{what}");
        replicas = cpu.replicas();
        *ops = emu.max_warp_ops();
    }
    let [fast, slow] = warp_ops;
    eprintln!(
        "emulated quota solver, R=64 E=256 n_slot=2, {replicas} replicas: {slow} \
         warp-synchronous operations on the longest path with the shuffle tree, {fast} with \
         packed keys"
    );
    assert!(
        fast * 2 < slow,
        "packed keys: {fast} warp operations, shuffle tree {slow}"
    );
}

/// [`DeviceQuotaSolver`] (its own shape for the device: the load staged with as many warps as
/// shared memory holds) plans `load` as the CPU planner does and reports matching statistics.
fn assert_same_plan(
    solver: &mut DeviceQuotaSolver,
    layout: &Layout,
    load: &LoadMatrix,
    (u_min, rule): (u64, TargetRule),
    what: &str,
) -> usize {
    let cpu = QuotaPlanner::with_rule(u_min, rule)
        .plan(layout, load)
        .unwrap();
    let (plan, stats) = solver.plan(load).unwrap();
    assert_eq!(
        plan, cpu,
        "{what}: the device plan differs from the CPU planner's"
    );
    assert_eq!(stats.replicas as usize, cpu.replicas(), "{what}");
    let bound = metrics::lower_bound(layout, &load.expert_totals());
    assert_eq!(stats.lower_bound, bound, "{what}");
    assert_eq!(stats.packed_keys, packs_keys(layout, load), "{what}");
    cpu.replicas()
}

fn solver(exec: &Arc<dyn Executor>, layout: &Layout, rule: (u64, TargetRule)) -> DeviceQuotaSolver {
    DeviceQuotaSolver::new(Arc::clone(exec), layout, rule.0, rule.1).unwrap()
}

#[test]
fn the_device_quota_solver_plans_like_the_cpu_planner() {
    for device in default_devices() {
        let exec = &device.exec;
        let name = device.name();
        let mut rng = Rng(11);
        // Few on the emulator: the device's configuration is 32 warps there, 1024 threads that
        // meet at every barrier (the kernel itself is checked above on many more layers).
        let cases = if device.emulated() { 4 } else { 200 };
        let mut replicated = 0;
        for case in 0..cases {
            let layout = random_layout(&mut rng, 40, 160);
            let hot = 1 + rng.below(4) as usize;
            let load = skewed_load(&mut rng, layout.ranks(), layout.experts(), hot);
            let u_min = [1, 2, 16, 200][rng.below(4) as usize];
            let rule = if rng.below(2) == 0 {
                TargetRule::BestFit
            } else {
                TargetRule::LargestSlack
            };
            let what = format!(
                "{name} case {case}: R={} E={} n_slot={} u_min={u_min} {rule:?}",
                layout.ranks(),
                layout.experts(),
                layout.slots_per_rank()
            );
            let mut s = solver(exec, &layout, (u_min, rule));
            replicated +=
                usize::from(assert_same_plan(&mut s, &layout, &load, (u_min, rule), &what) > 0);
        }
        assert!(
            replicated * 2 > cases,
            "only {replicated} cases replicated anything"
        );

        // The paper's shape with the device's own configuration, reused across layers.
        let rule = (1, TargetRule::BestFit);
        let layout = Layout::contiguous(64, 256, 2).unwrap();
        let mut paper = solver(exec, &layout, rule);
        let (warps, staged) = paper.config();
        assert!(
            staged && warps >= 8,
            "{name}: {warps} warps, staged {staged}"
        );
        let layers = if device.emulated() { 2 } else { 20 };
        for seed in 0..layers {
            let load = skewed_load(&mut rng, 64, 256, 1 + seed % 6);
            let what = format!("{name}: R=64 E=256 layer {seed}");
            assert!(assert_same_plan(&mut paper, &layout, &load, rule, &what) > 0);
        }
        assert!(
            paper.plan(&LoadMatrix::zeros(64, 257)).is_err(),
            "{name}: a mismatched load"
        );

        // Degenerate loads, 128-bit split arithmetic (on a GPU: its 32 search rounds take the
        // emulator's 1024 threads seconds; the direct launches above cover it there), no slots.
        let layout = Layout::contiguous(8, 16, 2).unwrap();
        let mut small = solver(exec, &layout, rule);
        for (what, value) in [("zeros", 0u64), ("uniform", 9)] {
            let load = LoadMatrix::from_rows(&vec![vec![value; 16]; 8]).unwrap();
            let what = format!("{name}: {what}");
            assert_eq!(assert_same_plan(&mut small, &layout, &load, rule, &what), 0);
        }
        let wide = wide_load();
        if !device.emulated() {
            let what = format!("{name}: wide");
            assert!(assert_same_plan(&mut small, &layout, &wide, rule, &what) > 0);
        }
        let bare = Layout::contiguous(8, 16, 0).unwrap();
        let what = format!("{name}: no slots");
        let mut none = solver(exec, &bare, rule);
        assert_eq!(assert_same_plan(&mut none, &bare, &wide, rule, &what), 0);
    }
}
