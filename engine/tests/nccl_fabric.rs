//! The NCCL fabric (features `cuda` and `mpi`). Without NCCL the probe must answer with one line
//! (never a panic) and `NcclFabric::new` must fail on every rank of an MPI world instead of
//! leaving one waiting. With NCCL and two or more GPUs, one process per GPU under `mpirun` (up to
//! 4, so relay trees forward chunks) must get from every collective exactly what the in-process
//! `LocalFabric` gives the same ranks for the same contributions (bytes equal, no tolerance: the fabric moves bytes, it computes
//! nothing). Tests that cannot run here print "skipped: <reason>" and pass.
#![cfg(all(feature = "cuda", feature = "mpi"))]

use std::process::Command;

use mpi::traits::Communicator;
use rackfill_balancer::relay::{plan_transfers, RelayConfig, TransferSchedule};
use rackfill_balancer::{Algo, Layout, LoadMatrix, Plan, Settings};
use rackfill_engine::fabric::{
    probe_nccl, Fabric, LocalFabric, Message, NcclFabric, ReplicaBuffers,
};

/// Set in the processes `mpirun` starts: the child tests run only there.
const CHILD_ENV: &str = "RACKFILL_NCCL_FABRIC_CHILD";
/// Processes of the test that runs without NCCL.
const RANKS: usize = 2;
const EXPERT_BYTES: usize = 200;

#[test]
fn the_probe_answers_in_one_line() {
    match probe_nccl() {
        Ok(info) => {
            assert!(info.version.0 >= 2, "{info}");
            assert!(!info.found_at.is_empty(), "{info}");
            println!("NCCL found: {info}");
        }
        Err(line) => {
            assert!(line.starts_with("NCCL not available: "), "{line}");
            assert!(!line.contains('\n'), "{line}");
            if line.contains("not found") {
                assert!(line.contains("libnccl.so.2"), "{line}");
                assert!(line.contains("--fabric mpi"), "{line}");
            }
            println!("probe: {line}");
        }
    }
}

/// `mpirun` on the path, or why the MPI tests skip.
fn mpirun() -> Result<(), String> {
    match Command::new("mpirun").arg("--version").output() {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => Err(format!("mpirun --version exited with {}", out.status)),
        Err(e) => Err(format!("mpirun not found ({e})")),
    }
}

/// Runs the child test `name` in `ranks` processes; returns their combined output.
fn run_under_mpirun(name: &str, ranks: usize) -> String {
    let exe = std::env::current_exe().expect("test binary path");
    let out = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np"])
        .arg(ranks.to_string())
        .arg(exe)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "1")
        .output()
        .expect("mpirun starts");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "mpirun {name} failed:\n{text}");
    text
}

fn is_child() -> bool {
    std::env::var_os(CHILD_ENV).is_some()
}

#[test]
fn new_fails_on_every_rank_without_nccl() {
    if is_child() {
        return;
    }
    if let Err(why) = mpirun() {
        return println!("skipped: {why}");
    }
    if probe_nccl().is_ok() && gpus() >= RANKS {
        return println!("skipped: NCCL and {RANKS} GPUs are here (the GPU test covers new)");
    }
    let text = run_under_mpirun("child_new_fails_everywhere", RANKS);
    for rank in 0..RANKS {
        let line = text
            .lines()
            .find(|l| l.contains(&format!("rank {rank} refused NCCL:")))
            .unwrap_or_else(|| panic!("rank {rank} did not report:\n{text}"));
        println!("{}", &line[line.find("rank").unwrap_or(0)..]);
    }
}

#[test]
fn child_new_fails_everywhere() {
    if !is_child() {
        return;
    }
    let universe = mpi::initialize().expect("MPI initialises once");
    let world = universe.world();
    let rank = world.rank();
    let err = NcclFabric::new(world.duplicate(), rank as usize)
        .expect_err("no NCCL or too few GPUs here")
        .to_string();
    // Every rank names the ranks that cannot run NCCL, itself included, in one line.
    assert!(err.contains("cannot run NCCL"), "{err}");
    assert!(!err.contains('\n'), "{err}");
    println!("rank {rank} refused NCCL: {err}");
}

/// CUDA devices the driver sees (0 without a driver).
fn gpus() -> usize {
    rackfill_kernels::cuda::probe().map_or(0, |info| info.devices)
}

#[test]
fn nccl_fabric_matches_the_local_fabric() {
    if is_child() {
        return;
    }
    if let Err(why) = probe_nccl() {
        return println!("skipped: {why}");
    }
    let found = gpus();
    if found < 2 {
        return println!("skipped: NCCL needs 2 GPUs (one per process), {found} visible");
    }
    if let Err(why) = mpirun() {
        return println!("skipped: {why}");
    }
    let ranks = found.min(4);
    let text = run_under_mpirun("child_collectives_match_local", ranks);
    for rank in 0..ranks {
        assert!(text.contains(&format!("rank {rank} matches")), "{text}");
    }
    println!("{ranks} processes, one GPU each: every collective matches the local fabric");
}

/// Rank `r`'s count row.
fn counts(r: usize) -> Vec<u64> {
    (0..5).map(|i| (r * 1000 + i * 7) as u64).collect()
}

/// Rank `src`'s message to `dst`: sizes vary by pair, some are empty.
fn message(src: usize, dst: usize) -> Message {
    let rows = (src * 3 + dst * 5) % 7;
    Message {
        rows: (0..rows * 4)
            .map(|i| (src * 100 + dst) as f32 + i as f32 / 8.0)
            .collect(),
        ids: (0..rows * 2)
            .map(|i| (src * 10_000 + dst * 100 + i) as u32)
            .collect(),
    }
}

/// `ranks` ranks, one expert each, one redundant slot; expert 0 hot enough to be replicated on
/// every other rank (over a relay tree from 3 replicas on), streamed in 64-byte chunks.
fn replicated(ranks: usize) -> (Plan, TransferSchedule, Vec<Vec<u8>>) {
    let experts = ranks;
    let layout = Layout::contiguous(ranks, experts, 1).unwrap();
    let mut row = vec![2u64; experts];
    row[0] = 60;
    let load = LoadMatrix::from_rows(&vec![row; ranks]).unwrap();
    let plan = Algo::Quota
        .build(&Settings::default())
        .plan(&layout, &load)
        .unwrap();
    assert!(plan.replicas() >= 1, "nothing to stream");
    let relay = RelayConfig {
        threshold: 1,
        chunk_bytes: 64,
    };
    let schedule = plan_transfers(&plan, EXPERT_BYTES as u64, &relay);
    let weights = (0..experts)
        .map(|e| (0..EXPERT_BYTES).map(|b| (b ^ (e * 37)) as u8).collect())
        .collect();
    (plan, schedule, weights)
}

/// Streams the replicas for `ranks` on `fabric`; returns the bytes received and the slots.
fn stream(fabric: &dyn Fabric, ranks: std::ops::Range<usize>) -> (Vec<u64>, Vec<Vec<u8>>) {
    let (plan, schedule, weights) = replicated(fabric.world_size());
    let slot_bytes = EXPERT_BYTES;
    let mut slots: Vec<Vec<u8>> = ranks
        .clone()
        .map(|_| vec![0u8; plan.slots_per_rank() * slot_bytes])
        .collect();
    let source = |e: u32| -> Vec<&[u8]> {
        let whole = &weights[e as usize];
        vec![&whole[..50], &whole[50..]]
    };
    let received = fabric
        .stream_replicas(
            &plan,
            &schedule,
            ReplicaBuffers {
                source: &source,
                slots: slots.iter_mut().map(|s| s.as_mut_slice()).collect(),
                slot_bytes,
                expert_bytes: EXPERT_BYTES,
            },
        )
        .unwrap();
    (received, slots)
}

#[test]
fn child_collectives_match_local() {
    if !is_child() {
        return;
    }
    let universe = mpi::initialize().expect("MPI initialises once");
    let world = universe.world();
    let (rank, ranks) = (world.rank() as usize, world.size() as usize);
    // One host: the local rank is the world rank.
    let fabric = NcclFabric::new(world.duplicate(), rank).unwrap();
    assert_eq!(
        (fabric.world_size(), fabric.local_ranks()),
        (ranks, rank..rank + 1)
    );
    let local = LocalFabric::new(ranks).unwrap();

    let all_rows: Vec<Vec<u64>> = (0..ranks).map(counts).collect();
    assert_eq!(
        fabric.all_gather(&[counts(rank)]).unwrap(),
        local.all_gather(&all_rows).unwrap()
    );

    let sends = |src: usize| (0..ranks).map(|dst| message(src, dst)).collect::<Vec<_>>();
    let got = fabric.all_to_all_v(vec![sends(rank)]).unwrap();
    let want = local.all_to_all_v((0..ranks).map(sends).collect()).unwrap();
    assert_eq!(got, vec![want[rank].clone()]);

    let (received, slots) = stream(&fabric, rank..rank + 1);
    let (all_received, all_slots) = stream(&local, 0..ranks);
    assert_eq!(received, vec![all_received[rank]]);
    assert_eq!(slots, vec![all_slots[rank].clone()]);

    // Bytes received from other ranks: the all-gather rows, the messages, the replica bytes.
    let rows = ((ranks - 1) * counts(0).len() * 8) as u64;
    let messages: u64 = (0..ranks)
        .filter(|&src| src != rank)
        .map(|src| message(src, rank).bytes())
        .sum();
    assert_eq!(fabric.bytes_moved(), rows + messages + received[0]);

    // A rank that refuses its contribution fails the call on every rank, and the group stops.
    let contribution = if rank == 1 {
        vec![]
    } else {
        vec![counts(rank)]
    };
    let err = fabric.all_gather(&contribution).unwrap_err().to_string();
    assert!(err.contains("rank 1 refused its all-gather rows"), "{err}");
    assert!(fabric.all_gather(&[counts(rank)]).is_err());
    println!("rank {rank} matches the local fabric");
}
