//! The MPI fabric between real MPI processes. Each `launches_*` test re-runs this test binary
//! under `mpirun -np N` (N = 4, and 3 for an uneven split), in child mode, on one `child_*` test;
//! every child process is one EP rank and checks its own part against what the in-process
//! [`LocalFabric`] computes for the same contributions (which the child computes itself):
//! collectives equal, replica slots equal byte for byte, EP logits equal the dense path's within
//! [`TOLERANCE`]. A failing child fails the launch, whose message carries every child's output;
//! a launch running past [`LAUNCH_TIMEOUT`] (a deadlock) is killed and fails. Without `mpirun`
//! the launches skip with a printed reason.
#![cfg(feature = "mpi")]

use std::fs::File;
use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mpi::collective::CommunicatorCollectives;
use mpi::environment::{Threading, Universe};
use mpi::topology::{Communicator, SimpleCommunicator};

use rackfill_balancer::relay::{plan_transfers, RelayConfig, TransferSchedule};
use rackfill_balancer::{Algo, Layout, LoadMatrix, Plan, Settings};
use rackfill_engine::fabric::{Fabric, LocalFabric, Message, MpiFabric, ReplicaBuffers};
use rackfill_engine::{EpConfig, EpRuntime};
use rackfill_models::{KvCache, LogitsFor, ModelBundle, MoeModel, SequenceInput};

/// Set (to the child test's name) in the environment of the processes `mpirun` starts.
const CHILD_ENV: &str = "RACKFILL_MPI_FABRIC_CHILD";

/// Printed by every child that passed; a launch needs one per process.
const PASSED: &str = "mpi-fabric child passed:";

/// Beyond this a launch is a deadlock: `mpirun` is stopped and the test fails.
const LAUNCH_TIMEOUT: Duration = Duration::from_secs(120);

/// Max abs difference between EP logits over MPI and the dense path's (f32 on the CPU; the
/// combine sums in top-k order as the dense path does).
const TOLERANCE: f32 = 1e-4;

/// One launch at a time: every process of a launch polls while it waits, and cores are few.
static LAUNCHES: Mutex<()> = Mutex::new(());

// ---------------------------------------------------------------------------------------------
// Parent side: launching the children.

fn mpirun_found() -> bool {
    Command::new("mpirun")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// Runs child test `child` as `np` MPI processes and fails unless every one passed in time.
fn launch(child: &str, np: usize) {
    if !mpirun_found() {
        eprintln!("skipping {child} on {np} processes: mpirun not found (install openmpi-bin)");
        return;
    }
    let _alone = LAUNCHES
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let output = tempfile::NamedTempFile::new().expect("output file");
    let exe = std::env::current_exe().expect("test binary");
    let mut mpirun = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np"])
        .arg(np.to_string())
        .args(["-x", CHILD_ENV])
        .arg(exe)
        .args([child, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, child)
        .stdin(Stdio::null())
        .stdout(output.reopen().expect("output file"))
        .stderr(output.reopen().expect("output file"))
        .spawn()
        .expect("mpirun starts");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = mpirun.try_wait().expect("mpirun status") {
            break Some(status);
        }
        if started.elapsed() > LAUNCH_TIMEOUT {
            // SIGTERM lets mpirun stop its processes; SIGKILL if it does not go.
            let _ = Command::new("kill")
                .args(["-TERM", &mpirun.id().to_string()])
                .status();
            std::thread::sleep(Duration::from_secs(5));
            let _ = mpirun.kill();
            let _ = mpirun.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut text = String::new();
    File::open(output.path())
        .and_then(|mut file| file.read_to_string(&mut text))
        .expect("children's output");
    // Lines of several processes may interleave: count the markers wherever they are.
    let passed = text.matches(&format!("{PASSED} {child} rank ")).count();
    match status {
        None => panic!(
            "{child} on {np} processes ran past {LAUNCH_TIMEOUT:?} (deadlock?); output:\n{text}"
        ),
        Some(status) if !status.success() || passed != np => panic!(
            "{child} on {np} processes: mpirun {status}, {passed} of {np} children passed; \
             output:\n{text}"
        ),
        Some(_) => println!("{text}"),
    }
}

#[test]
fn launches_collectives() {
    launch("child_collectives", 4);
    launch("child_collectives", 3);
}

#[test]
fn launches_replica_streams() {
    launch("child_replica_streams", 4);
    launch("child_replica_streams", 3);
}

#[test]
fn launches_ep_runtime() {
    launch("child_ep_runtime", 4);
    launch("child_ep_runtime", 3);
}

// ---------------------------------------------------------------------------------------------
// Child side: one MPI process, one rank.

/// This process's MPI world when it runs as child `name`; `None` in a plain test run.
fn child(name: &str) -> Option<(Universe, SimpleCommunicator)> {
    if std::env::var(CHILD_ENV).ok()? != name {
        return None;
    }
    let (universe, level) =
        mpi::initialize_with_threading(Threading::Multiple).expect("MPI initialises once");
    assert_eq!(
        level,
        Threading::Multiple,
        "the MPI library does not provide MPI_THREAD_MULTIPLE"
    );
    // A failing child stops the whole job at once: unwinding would finalise MPI while the other
    // ranks still wait in a collective for this one.
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |panic| {
        report(panic);
        SimpleCommunicator::world().abort(101);
    }));
    let world = universe.world();
    Some((universe, world))
}

fn passed(name: &str, world: &SimpleCommunicator) {
    println!("{PASSED} {name} rank {} of {}", world.rank(), world.size());
}

/// Every rank's value of `mine`, in rank order.
fn gather(world: &SimpleCommunicator, mine: u64) -> Vec<u64> {
    let mut all = vec![0u64; world.size() as usize];
    world.all_gather_into(&mine, &mut all[..]);
    all
}

/// Rank `rank`'s counts row.
fn counts_row(rank: usize, round: usize) -> Vec<u64> {
    (0..5)
        .map(|j| (1000 * round + 100 * rank + j) as u64)
        .collect()
}

/// Rank `src`'s message to `dst`: 0 to 2 rows of 3 floats with 2 ids each (some empty).
fn message(src: usize, dst: usize, round: usize) -> Message {
    let rows = (src + 2 * dst + round) % 3;
    Message {
        rows: (0..rows * 3)
            .map(|k| (src * 100 + dst * 10 + k) as f32 + 0.25 * round as f32)
            .collect(),
        ids: (0..rows * 2)
            .map(|k| (src * 1000 + dst * 100 + k + round) as u32)
            .collect(),
    }
}

#[test]
fn child_collectives() {
    let name = "child_collectives";
    let Some((_universe, world)) = child(name) else {
        return;
    };
    let (rank, n) = (world.rank() as usize, world.size() as usize);
    let fabric = MpiFabric::new(world.duplicate()).unwrap();
    assert_eq!(
        (fabric.world_size(), fabric.local_ranks()),
        (n, rank..rank + 1)
    );
    let reference = LocalFabric::new(n).unwrap();
    for round in 0..2 {
        let rows: Vec<Vec<u64>> = (0..n).map(|r| counts_row(r, round)).collect();
        let gathered = fabric.all_gather(&rows[rank..rank + 1]).unwrap();
        assert_eq!(gathered, reference.all_gather(&rows).unwrap(), "all-gather");

        let send = |src: usize| (0..n).map(|dst| message(src, dst, round)).collect();
        let received = fabric.all_to_all_v(vec![send(rank)]).unwrap();
        let want = reference.all_to_all_v((0..n).map(send).collect()).unwrap();
        assert_eq!(received, want[rank..rank + 1], "all-to-all");
    }
    // Every rank counts what it received from the others: together, what the in-process fabric
    // counts for all of them.
    let moved = gather(&world, fabric.bytes_moved());
    assert_eq!(moved.iter().sum::<u64>(), reference.bytes_moved());
    assert!(moved[rank] > 0);

    // A wrong shape on one rank fails the call on every rank alike, and nothing waits.
    let last = n - 1;
    let mut row = counts_row(rank, 0);
    if rank == last {
        row.push(7);
    }
    let err = fabric.all_gather(&[row]).unwrap_err().to_string();
    assert!(
        err.contains(&format!("rank {last} contributed 6 counts, rank 0 5")),
        "{err}"
    );
    let addressed = if rank == 1 { n - 1 } else { n };
    let err = fabric
        .all_to_all_v(vec![vec![Message::default(); addressed]])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!("rank 1 addressed {} ranks of {n}", n - 1)),
        "{err}"
    );
    let err = fabric
        .all_gather(&vec![counts_row(rank, 0); usize::from(rank != 0)])
        .unwrap_err()
        .to_string();
    assert!(err.contains("rank 0 gave 0 rows for its one rank"), "{err}");
    // The group is still in step afterwards.
    let rows: Vec<Vec<u64>> = (0..n).map(|r| counts_row(r, 2)).collect();
    assert_eq!(fabric.all_gather(&rows[rank..rank + 1]).unwrap(), rows);
    passed(name, &world);
}

/// Bytes per expert in most streaming tests.
const EXPERT_BYTES: usize = 200;

/// `n` ranks, `2n` experts of `expert_bytes`, 2 slots per rank; experts 0 and 1 hot enough for
/// quota to replicate them widely, streamed in `chunk_bytes` chunks over relay trees (threshold
/// 1).
fn streamed(n: usize, expert_bytes: usize, chunk_bytes: u64) -> (Plan, TransferSchedule) {
    let layout = Layout::contiguous(n, 2 * n, 2).unwrap();
    let row = |_| {
        let mut row = vec![2u64; 2 * n];
        row[0] = 90;
        row[1] = 50;
        row
    };
    let load = LoadMatrix::from_rows(&(0..n).map(row).collect::<Vec<_>>()).unwrap();
    let plan = Algo::Quota
        .build(&Settings::default())
        .plan(&layout, &load)
        .unwrap();
    let relay = RelayConfig {
        threshold: 1,
        chunk_bytes,
    };
    let schedule = plan_transfers(&plan, expert_bytes as u64, &relay);
    (plan, schedule)
}

/// Expert `e`'s weights: bytes that differ between experts and positions.
fn expert_weights(e: usize, bytes: usize) -> Vec<u8> {
    (0..bytes)
        .map(|b| (b * 7 + e * 31 + b / 251) as u8)
        .collect()
}

/// Streams `schedule` with `fabric` into slot buffers of `slot_len` bytes for its local ranks
/// (slots of one expert), reading each home expert as two segments; returns the slot buffers and
/// the call's result.
fn stream(
    fabric: &dyn Fabric,
    (plan, schedule): (&Plan, &TransferSchedule),
    expert_bytes: usize,
    slot_len: impl Fn(usize) -> usize,
) -> (Vec<Vec<u8>>, rackfill_engine::Result<Vec<u64>>) {
    let experts: Vec<Vec<u8>> = (0..plan.experts())
        .map(|e| expert_weights(e, expert_bytes))
        .collect();
    let local = fabric.local_ranks();
    let homes: Vec<u32> = (0..plan.experts())
        .map(|e| plan.instances(e)[0].rank)
        .collect();
    let source = |e: u32| -> Vec<&[u8]> {
        let home = homes[e as usize] as usize;
        assert!(local.contains(&home), "expert {e} read off its home rank");
        let whole = &experts[e as usize];
        vec![&whole[..expert_bytes / 4], &whole[expert_bytes / 4..]]
    };
    let mut slots: Vec<Vec<u8>> = local.clone().map(|r| vec![0u8; slot_len(r)]).collect();
    let result = fabric.stream_replicas(
        plan,
        schedule,
        ReplicaBuffers {
            source: &source,
            slots: slots.iter_mut().map(Vec::as_mut_slice).collect(),
            slot_bytes: expert_bytes,
            expert_bytes,
        },
    );
    (slots, result)
}

#[test]
fn child_replica_streams() {
    let name = "child_replica_streams";
    let Some((_universe, world)) = child(name) else {
        return;
    };
    let (rank, n) = (world.rank() as usize, world.size() as usize);
    let fabric = MpiFabric::new(world.duplicate()).unwrap();
    let reference = LocalFabric::new(n).unwrap();
    // 64-byte chunks; then 1-byte chunks of bigger experts, a schedule longer than the tags MPI
    // guarantees.
    for (expert_bytes, chunk_bytes) in [(EXPERT_BYTES, 64), (16_384, 1)] {
        let full = |_| 2 * expert_bytes;
        let (plan, schedule) = streamed(n, expert_bytes, chunk_bytes);
        assert!(plan.replicas() >= n, "quota replicated the hot experts");
        assert!(
            schedule.transfers.iter().any(|t| t.stage == 2),
            "relays forward chunks"
        );
        if chunk_bytes == 1 {
            assert!(schedule.transfers.len() > 32_768, "tags wrap");
        }
        let case = (&plan, &schedule);
        let (want_slots, want) = stream(&reference, case, expert_bytes, full);
        let want = want.unwrap();
        let (slots, got) = stream(&fabric, case, expert_bytes, full);
        assert_eq!(got.unwrap(), want[rank..rank + 1], "bytes received");
        assert!(
            slots[0] == want_slots[rank],
            "rank {rank}'s slots differ from the in-process fabric's"
        );
        for (slot, expert) in plan.rank_slots(rank).iter().enumerate() {
            if let Some(e) = expert {
                let held = &slots[0][slot * expert_bytes..(slot + 1) * expert_bytes];
                assert!(
                    held == expert_weights(*e as usize, expert_bytes),
                    "slot {slot}"
                );
            }
        }
    }
    let moved = gather(&world, fabric.bytes_moved());
    assert_eq!(moved.iter().sum::<u64>(), reference.bytes_moved());

    let full = |_| 2 * EXPERT_BYTES;
    let (plan, schedule) = streamed(n, EXPERT_BYTES, 64);
    let untouched = |slots: &[Vec<u8>]| slots[0].iter().all(|&b| b == 0);
    // A schedule every rank refuses: a relay forwarding a chunk before it has it.
    let mut bad = schedule.clone();
    let forward = bad.transfers.iter().position(|t| t.stage == 2).unwrap();
    let early = bad.transfers.remove(forward);
    bad.transfers.insert(0, early);
    let (slots, result) = stream(&fabric, (&plan, &bad), EXPERT_BYTES, full);
    let err = result.unwrap_err().to_string();
    assert!(err.contains("it has not received"), "{err}");
    assert!(untouched(&slots), "nothing moved");
    // One rank's buffer too small: that rank refuses, and every rank fails with its reason.
    let last = n - 1;
    let short = |r| {
        if r == last {
            EXPERT_BYTES
        } else {
            2 * EXPERT_BYTES
        }
    };
    let (slots, result) = stream(&fabric, (&plan, &schedule), EXPERT_BYTES, short);
    let err = result.unwrap_err().to_string();
    assert!(
        err.contains(&format!("rank {last}'s slot buffer has 200 bytes")),
        "{err}"
    );
    assert!(untouched(&slots), "nothing moved");
    // Ranks holding different schedules: refused before a chunk moves.
    let chunk_bytes = if rank == 0 { 32 } else { 64 };
    let other = streamed(n, EXPERT_BYTES, chunk_bytes).1;
    let (slots, result) = stream(&fabric, (&plan, &other), EXPERT_BYTES, full);
    let err = result.unwrap_err().to_string();
    assert!(
        err.contains("rank 1's plan or schedule differs from rank 0's"),
        "{err}"
    );
    assert!(untouched(&slots), "nothing moved");
    // And the group streams correctly afterwards.
    let (slots, got) = stream(&fabric, (&plan, &schedule), EXPERT_BYTES, full);
    let (want_slots, want) = stream(&reference, (&plan, &schedule), EXPERT_BYTES, full);
    assert_eq!(got.unwrap(), want.unwrap()[rank..rank + 1]);
    assert!(slots[0] == want_slots[rank]);
    passed(name, &world);
}

/// Prompt lengths of rank `rank` of `n`: assorted on most ranks; the last rank's all fit in one
/// step, so it has no tokens at all in the later steps and must still join them.
fn prompt_lens(rank: usize, n: usize) -> Vec<usize> {
    if rank == n - 1 {
        return vec![9, 3];
    }
    [vec![40, 7], vec![30, 19], vec![50]][rank % 3].clone()
}

/// Tokens of rank `rank`'s prompt `seq` (deterministic, different on every rank).
fn prompt(vocab: usize, rank: usize, seq: usize, len: usize) -> Vec<u32> {
    (0..len)
        .map(|j| ((rank * 7919 + seq * 613 + j * 104_729 + j * j * 31) % vocab) as u32)
        .collect()
}

/// Tokens per sequence per step.
const CHUNK: usize = 24;

/// What a runtime computed over all steps.
struct Run {
    /// `logits[rank][seq]`: every position's logits, for the runtime's local ranks.
    logits: Vec<Vec<Vec<Vec<f32>>>>,
    /// Bytes the fabric moved in each step (all local ranks together).
    step_bytes: Vec<u64>,
    replicas: usize,
}

/// Runs every rank's prompts, `CHUNK` tokens per sequence per step, for as many steps as the
/// longest prompt of any rank needs: a runtime steps with the group even when its ranks are idle.
fn run_steps(runtime: &mut EpRuntime, model: &MoeModel, prompts: &[Vec<Vec<u32>>]) -> Run {
    let local = runtime.local_ranks();
    let longest = prompts.iter().flatten().map(Vec::len).max().unwrap_or(0);
    let mut caches: Vec<Vec<KvCache>> = prompts
        .iter()
        .map(|seqs| seqs.iter().map(|_| model.new_cache()).collect())
        .collect();
    let mut run = Run {
        logits: local
            .clone()
            .map(|r| vec![Vec::new(); prompts[r].len()])
            .collect(),
        step_bytes: Vec::new(),
        replicas: 0,
    };
    for start in (0..longest).step_by(CHUNK) {
        let mut members: Vec<Vec<(usize, usize)>> = vec![Vec::new(); local.len()];
        let mut batches: Vec<Vec<SequenceInput<'_>>> = local.clone().map(|_| Vec::new()).collect();
        let held = caches
            .iter_mut()
            .enumerate()
            .skip(local.start)
            .take(local.len());
        for (rank, rank_caches) in held {
            for (seq, cache) in rank_caches.iter_mut().enumerate() {
                let tokens = &prompts[rank][seq];
                if start >= tokens.len() {
                    continue;
                }
                let end = (start + CHUNK).min(tokens.len());
                batches[rank - local.start].push(SequenceInput {
                    tokens: &tokens[start..end],
                    cache,
                });
                members[rank - local.start].push((seq, end - start));
            }
        }
        let which: Vec<Vec<LogitsFor>> = batches
            .iter()
            .map(|b| vec![LogitsFor::AllPositions; b.len()])
            .collect();
        let before = runtime.bytes_moved();
        let step = runtime.forward(&mut batches, &which).unwrap();
        run.step_bytes.push(runtime.bytes_moved() - before);
        run.replicas += step
            .layers
            .iter()
            .map(|l| l.metrics.replicas)
            .sum::<usize>();
        for (i, (logits, members)) in step.logits.iter().zip(&members).enumerate() {
            assert_eq!(logits.is_none(), members.is_empty(), "logits iff tokens");
            let Some(logits) = logits else { continue };
            let mut rows = logits.to_vec2::<f32>().unwrap().into_iter();
            for &(seq, len) in members {
                run.logits[i][seq].extend(rows.by_ref().take(len));
            }
        }
    }
    run
}

#[test]
fn child_ep_runtime() {
    let name = "child_ep_runtime";
    let Some((_universe, world)) = child(name) else {
        return;
    };
    let (rank, n) = (world.rank() as usize, world.size() as usize);
    let model = Arc::new(ModelBundle::builtin().unwrap().model);
    let vocab = model.config().vocab_size;
    let prompts: Vec<Vec<Vec<u32>>> = (0..n)
        .map(|r| {
            let lens = prompt_lens(r, n);
            lens.iter()
                .enumerate()
                .map(|(seq, &len)| prompt(vocab, r, seq, len))
                .collect()
        })
        .collect();
    let dense: Vec<Vec<Vec<f32>>> = prompts[rank]
        .iter()
        .map(|tokens| {
            let mut cache = model.new_cache();
            let mut batch = [SequenceInput {
                tokens,
                cache: &mut cache,
            }];
            model
                .forward(&mut batch, LogitsFor::AllPositions)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap()
        })
        .collect();
    let longest = prompts.iter().flatten().map(Vec::len).max().unwrap_or(0);
    assert!(
        prompts[n - 1].iter().all(|p| p.len() <= CHUNK) && longest > CHUNK,
        "the last rank has no tokens in the later steps"
    );
    for balancer in [Algo::Quota, Algo::EplbExact, Algo::None] {
        let config = EpConfig {
            ep_size: n,
            redundant_slots: 2,
            balancer,
            verify_plans: true,
            ..EpConfig::default()
        };
        let fabric = MpiFabric::new(world.duplicate()).unwrap();
        let mut runtime =
            EpRuntime::with_fabric(Arc::clone(&model), config, Box::new(fabric)).unwrap();
        let run = run_steps(&mut runtime, &model, &prompts);
        if balancer == Algo::Quota {
            assert!(run.replicas > 0, "quota streamed replicas");
        }
        let mut worst = 0f32;
        for (got, want) in run.logits[0].iter().zip(&dense) {
            assert_eq!(got.len(), want.len(), "positions");
            for (a, b) in got.iter().flatten().zip(want.iter().flatten()) {
                worst = worst.max((a - b).abs());
            }
        }
        assert!(
            worst <= TOLERANCE,
            "rank {rank}, {balancer}: max abs logit difference {worst} from dense"
        );

        // Together the processes move what one process holding every rank moves, step by step.
        let steps = run.step_bytes.len();
        let mut everyone = vec![0u64; steps * n];
        world.all_gather_into(&run.step_bytes[..], &mut everyone[..]);
        if rank == 0 {
            let mut local = EpRuntime::new(Arc::clone(&model), config).unwrap();
            let in_process = run_steps(&mut local, &model, &prompts);
            let over_mpi: Vec<u64> = (0..steps)
                .map(|s| (0..n).map(|r| everyone[r * steps + s]).sum())
                .collect();
            println!(
                "EP {n} {balancer}: bytes moved per step: MpiFabric {over_mpi:?}, \
                 LocalFabric {:?}",
                in_process.step_bytes
            );
            assert_eq!(
                over_mpi, in_process.step_bytes,
                "{balancer}: bytes per step"
            );
        }
        world.barrier();
    }
    passed(name, &world);
}
