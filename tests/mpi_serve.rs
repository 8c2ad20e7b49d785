//! `rackfill serve` as one process per EP rank under a real `mpirun` (feature `mpi`): the served
//! numbers equal one process's, a mislaunched group fails at start with one line, a dead or
//! stalled rank stops the whole group within a bound, and SIGTERM to the leader drains and ends
//! every process with status 0. Skips, saying why, where `mpirun` is not installed.
#![cfg(feature = "mpi")]

mod mpi_common;

use std::time::{Duration, Instant};

use mpi_common::{
    mpirun_available, signal, tokenizer_fixture, Group, Served, EQUAL_LOGPROBS, SERVE_TIMEOUT,
};
use serde_json::{json, Value};

/// Prompts spread over the ranks (sent at once, so the leader hands them to different ranks):
/// echo scores every prompt position, greedy decoding adds four tokens.
fn scoring_requests(vocab: u32) -> Vec<Value> {
    (0..6u32)
        .map(|i| {
            let prompt: Vec<u32> = (0..9 + 5 * i)
                .map(|j| (7 + j * 13 + i * 31) % vocab)
                .collect();
            json!({
                "prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": true,
                "logprobs": 1, "ignore_eos": true,
            })
        })
        .collect()
}

/// `a` and `b` give the same tokens and logprobs within [`EQUAL_LOGPROBS`].
fn assert_same_completions(what: &str, a: &[Value], b: &[Value]) {
    assert_eq!(a.len(), b.len());
    for (i, (a, b)) in a.iter().zip(b).enumerate() {
        let (la, lb) = (&a["choices"][0]["logprobs"], &b["choices"][0]["logprobs"]);
        assert_eq!(
            la["tokens"], lb["tokens"],
            "{what}: request {i}: tokens differ"
        );
        let (pa, pb) = (
            la["token_logprobs"].as_array().unwrap(),
            lb["token_logprobs"].as_array().unwrap(),
        );
        assert_eq!(pa.len(), pb.len(), "{what}: request {i}");
        // Echo scored every prompt position, then four generated tokens.
        assert!(
            pa.len() >= 9 + 4,
            "{what}: request {i}: {} logprobs",
            pa.len()
        );
        for (j, (x, y)) in pa.iter().zip(pb).enumerate() {
            match (x.as_f64(), y.as_f64()) {
                (Some(x), Some(y)) => assert!(
                    (x - y).abs() <= EQUAL_LOGPROBS,
                    "{what}: request {i} position {j}: {x} vs {y}"
                ),
                _ => assert_eq!(x, y, "{what}: request {i} position {j}"),
            }
        }
    }
}

/// Every balancer the engine offers.
const BALANCERS: [&str; 5] = ["quota", "eplb-exact", "eplb-history", "greedy-move", "none"];

/// Serves `model` with `np` processes under each of `balancers`, and in one process at EP `np`
/// under the same balancer and at EP 1 (the dense reference, once): the scored prompts and
/// greedy tokens must agree.
fn group_equals_one_process(model: &str, vocab: u32, np: usize, balancers: &[&str]) {
    let requests = scoring_requests(vocab);
    let dense = Served::single(&["--model", model, "--ep-size", "1"]);
    let reference = dense.complete_all(&requests);
    dense.stop_with_sigterm();
    let np_flag = np.to_string();
    for balancer in balancers {
        let flags = [
            "--model",
            model,
            "--balancer",
            balancer,
            "--redundant-slots",
            "2",
        ];
        let group = Group::start(np, &flags, &[]);
        let spread = group.complete_all(&requests);
        let served = group.metrics();
        group.stop_with_sigterm();
        // Every rank reported its gauges to the leader.
        for rank in 0..np {
            let running = Served::metric(&served, "rackfill:rank_num_requests_running", rank);
            assert!(running.is_some(), "no gauge for rank {rank}:\n{served}");
        }
        let mut single = flags.to_vec();
        single.extend(["--ep-size", np_flag.as_str()]);
        let one = Served::single(&single);
        let same_ep = one.complete_all(&requests);
        one.stop_with_sigterm();
        let what = format!("{model} -np {np} {balancer}");
        assert_same_completions(
            &format!("{what} vs one process at EP {np}"),
            &spread,
            &same_ep,
        );
        assert_same_completions(
            &format!("{what} vs one process at EP 1"),
            &spread,
            &reference,
        );
    }
}

#[test]
fn four_and_three_processes_equal_one_on_the_builtin_model_for_every_balancer() {
    if !mpirun_available() {
        return;
    }
    group_equals_one_process("rackfill-tiny-moe", 512, 4, &BALANCERS);
    // 32 experts over 3 ranks: homes of 11, 11 and 10.
    group_equals_one_process("rackfill-tiny-moe", 512, 3, &BALANCERS);
}

#[test]
fn four_processes_equal_one_on_every_family_for_every_balancer() {
    if !mpirun_available() {
        return;
    }
    for family in ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3"] {
        let (dir, vocab) = tokenizer_fixture(family);
        group_equals_one_process(dir.to_str().unwrap(), vocab, 4, &BALANCERS);
    }
}

/// Two micro-batches a step across four processes (each process's collectives issued by one
/// micro-batch at a time, in the same order everywhere): the same tokens and logprobs as one
/// process at EP 1, under quota and eplb-exact, and with per-layer slots (resident replicas kept,
/// only new ones streamed over MPI); so do pipelined experts with one micro-batch; a schedule it
/// does not know is refused with one line.
#[test]
fn four_processes_with_every_schedule_equal_one_process() {
    if !mpirun_available() {
        return;
    }
    let model = "rackfill-tiny-moe";
    let requests = scoring_requests(512);
    let dense = Served::single(&["--model", model, "--ep-size", "1"]);
    let reference = dense.complete_all(&requests);
    dense.stop_with_sigterm();
    // Last, one micro-batch with pipelined experts: the replicas stream over MPI on the calling
    // thread while the main experts compute on another.
    for (balancer, schedule, slots) in [
        ("quota", "two-batch", "shared"),
        ("eplb-exact", "two-batch", "shared"),
        ("quota", "overlapped", "per-layer"),
        ("quota", "pipelined", "shared"),
    ] {
        let flags = [
            "--model",
            model,
            "--balancer",
            balancer,
            "--schedule",
            schedule,
            "--slot-memory",
            slots,
        ];
        let group = Group::start(4, &flags, &[]);
        let spread = group.complete_all(&requests);
        group.stop_with_sigterm();
        assert_same_completions(
            &format!("-np 4 {balancer}, {schedule}, {slots} slots, vs one process at EP 1"),
            &spread,
            &reference,
        );
    }
    let out = Group::run_to_end(2, &["--schedule", "three-batch"]);
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("unknown schedule 'three-batch'"),
        "{}",
        out.stderr
    );
}

/// The whole model and its MoE layers on a device in every process (`--device emulator`, the
/// host emulator running the CUDA kernels), each process reading its home experts from the
/// checkpoint: groups of two, three and four processes whose rows, outputs and replicas cross
/// between processes through peer memory (every rank's receive side a memfd mapped into every
/// process; the tile stream pushing replicas into other processes' slots), for every balancer,
/// with one and two micro-batches and shared or per-layer slots, give the same tokens and
/// logprobs (within [`EQUAL_LOGPROBS`]) as one process holding every rank on the device; so
/// does the host path (`--moe-transport host`). Every rank names its path at startup and the
/// leader's `/metrics` carries it; over peer memory the fabric carries only counts and control,
/// a fraction of what the host path moves.
#[test]
fn processes_on_devices_equal_one_process_on_a_device() {
    if !mpirun_available() || !emulator_available() {
        return;
    }
    let model = "rackfill-tiny-moe";
    let requests = scoring_requests(512);
    let device = ["--model", model, "--device", "emulator", "--ep-size", "3"];
    let single = Served::single(&device);
    let reference = single.complete_all(&requests);
    single.stop_with_sigterm();
    let mut fabric_bytes = Vec::new();
    for (np, transport, balancer, schedule, slots) in [
        (2, "peer", "quota-paper", "ultraep", "shared"),
        (3, "peer", "eplb-exact", "overlapped", "shared"),
        (3, "host", "quota", "overlapped", "shared"),
        (3, "peer", "quota", "overlapped", "shared"),
        (4, "peer", "eplb-history", "pipelined", "per-layer"),
        (4, "peer", "none", "two-batch", "shared"),
        (4, "peer", "quota", "overlapped", "per-layer"),
    ] {
        let flags = [
            "--model",
            model,
            "--device",
            "emulator",
            "--moe-transport",
            transport,
            "--balancer",
            balancer,
            "--schedule",
            schedule,
            "--slot-memory",
            slots,
        ];
        let what =
            format!("-np {np} on the emulator, {transport}, {balancer}, {schedule}, {slots} slots");
        let group = Group::start(np, &flags, &[]);
        let spread = group.complete_all(&requests);
        let metrics = group.metrics();
        let path = format!("rackfill:moe_data_path{{path=\"{transport}\"}} 1");
        assert!(metrics.contains(&path), "{what}: {metrics}");
        if balancer != "none" {
            assert!(
                metric(&metrics, "rackfill:moe_replicas_total") > 0.0,
                "{what}: no replica streamed: {metrics}"
            );
        }
        if np == 3 && balancer == "quota" {
            fabric_bytes.push((
                transport,
                metric(&metrics, "rackfill:fabric_received_bytes"),
            ));
        }
        let log = group.log();
        group.stop_with_sigterm();
        let named = log.matches("MoE data path (ranks ").count();
        assert_eq!(named, np, "{what}: every rank names its path: {log}");
        assert_same_completions(&what, &spread, &reference);
    }
    // The same requests and plans: over peer memory the fabric carries counts, not rows.
    let [(_, host), (_, peer)] = fabric_bytes[..] else {
        panic!("{fabric_bytes:?}");
    };
    assert!(peer * 4.0 < host, "fabric bytes: peer {peer}, host {host}");
}

/// The value of the unlabelled metric `name` in a Prometheus exposition (0 when absent).
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|line| {
            line.strip_prefix(name)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0.0)
}

/// Whether the host emulator can be built here (a C++ compiler).
fn emulator_available() -> bool {
    std::process::Command::new(std::env::var("CXX").unwrap_or_else(|_| "c++".into()))
        .arg("--version")
        .output()
        .is_ok()
}

/// Prompt `i` of the routing test: 50 tokens of its own, then `extra` more.
fn prefixed(i: u32, extra: u32) -> Value {
    let prompt: Vec<u32> = (0..50 + extra)
        .map(|j| (3 + j * 7 + i * 101) % 512)
        .collect();
    json!({
        "prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": true, "logprobs": 1,
        "ignore_eos": true,
    })
}

/// Each worker tells the leader which blocks its prefix cache holds, and the leader routes a
/// request to the rank holding its prefix: four prompts spread over four processes, then four
/// continuations sent at once each reuse their own prompt's three whole blocks on its rank (but
/// the last token: they echo), and answer what one process without the prefix cache answers.
#[test]
fn four_processes_route_each_prompt_to_the_rank_that_cached_its_prefix() {
    if !mpirun_available() {
        return;
    }
    let firsts: Vec<Value> = (0..4).map(|i| prefixed(i, 0)).collect();
    // In reverse: least-loaded routing alone would hand each to another prompt's rank.
    let seconds: Vec<Value> = (0..4).rev().map(|i| prefixed(i, 10)).collect();
    let group = Group::start(4, &["--model", "rackfill-tiny-moe"], &[]);
    let first = group.complete_all(&firsts);
    let second = group.complete_all(&seconds);
    let served = group.metrics();
    group.stop_with_sigterm();
    let cached = |r: &Value| r["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    let cached_all = |rs: &[Value]| rs.iter().map(cached).collect::<Vec<_>>();
    assert_eq!(cached_all(&first), [Some(0); 4]);
    assert_eq!(cached_all(&second), [Some(47); 4]);
    for rank in 0..4 {
        let hits = Served::metric(&served, "rackfill:prefix_cache_hits_total", rank);
        assert_eq!(hits, Some(1.0), "rank {rank}:\n{served}");
    }
    let one = Served::single(&["--model", "rackfill-tiny-moe", "--no-prefix-cache"]);
    let reference = one.complete_all(&seconds);
    one.stop_with_sigterm();
    assert_same_completions("-np 4 with prefix hits vs one process", &second, &reference);
}

#[test]
fn a_mislaunched_group_fails_at_start_with_one_line() {
    if !mpirun_available() {
        return;
    }
    let out = Group::run_to_end(2, &["--ep-size", "4"]);
    assert!(!out.status.success());
    assert!(
        out.stderr
            .contains("--ep-size 4 but the MPI world has 2 processes"),
        "{}",
        out.stderr
    );
    // Ranks that disagree on the balancer (an MPMD launch).
    let out = Group::run_mpmd(&[&[], &["--balancer", "none"]]);
    assert!(!out.status.success());
    assert!(
        out.stderr
            .contains("rank 1 disagrees with rank 0 on the balancer"),
        "{}",
        out.stderr
    );
}

#[test]
fn a_killed_worker_stops_the_group_within_the_bound() {
    if !mpirun_available() {
        return;
    }
    let group = Group::start(4, &[], &["--watchdog-timeout", "5"]);
    let ended = kill_rank_under_load(&group, 2);
    eprintln!("killed rank 2: the group ended {ended:?} later");
}

/// SIGKILLs rank `rank` of `group` while eight requests stream, and checks that the whole group
/// ends non-zero within a minute, no rank outliving it; returns how long it took.
fn kill_rank_under_load(group: &Group, rank: usize) -> Duration {
    let load = group.background_load(8);
    std::thread::sleep(Duration::from_millis(300));
    let victim = group.rank_pid(rank);
    let killed = Instant::now();
    signal(victim, "KILL");
    let (status, took) = group.wait_exit(Duration::from_secs(60));
    assert!(!status.success(), "mpirun exited 0 after a rank was killed");
    assert!(took <= Duration::from_secs(60), "took {took:?}");
    assert!(group.all_ranks_gone(), "a rank outlived the group");
    let _ = load.join();
    killed.elapsed()
}

/// A rank killed under load while every other process maps its peer memory (the emulator's
/// memfd windows) still ends the group within the bound: no rank hangs on a ready flag.
#[test]
fn a_killed_worker_with_peer_memory_mapped_stops_the_group() {
    if !mpirun_available() || !emulator_available() {
        return;
    }
    let flags = ["--model", "rackfill-tiny-moe", "--device", "emulator"];
    let group = Group::start(3, &flags, &["--watchdog-timeout", "5"]);
    assert!(
        group.log().contains("peer memory (memfd)"),
        "{}",
        group.log()
    );
    let ended = kill_rank_under_load(&group, 2);
    eprintln!("killed rank 2 of a peer-memory group: it ended {ended:?} later");
}

/// An idle group idles: its workers wait for the leader's next round without spinning in MPI
/// (measured: 2.8% of one core for all four ranks together, against 200% before), and still
/// answer the first request after the wait.
#[test]
fn an_idle_group_uses_almost_no_cpu() {
    if !mpirun_available() {
        return;
    }
    let group = Group::start(4, &[], &[]);
    let pids: Vec<u32> = (0..4).map(|rank| group.rank_pid(rank)).collect();
    std::thread::sleep(Duration::from_secs(2));
    let cpu_seconds = || -> f64 {
        let ticks: u64 = pids
            .iter()
            .map(|pid| {
                let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
                // utime and stime (fields 14 and 15, after the parenthesised command name), in
                // USER_HZ ticks: 1/100 s on Linux.
                let fields: Vec<&str> = stat
                    .rsplit_once(')')
                    .unwrap()
                    .1
                    .split_whitespace()
                    .collect();
                fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
            })
            .sum();
        ticks as f64 / 100.0
    };
    let (before, started) = (cpu_seconds(), Instant::now());
    std::thread::sleep(Duration::from_secs(3));
    let share = (cpu_seconds() - before) / started.elapsed().as_secs_f64();
    assert!(
        share < 0.3,
        "an idle group of four took {:.0}% of a core",
        share * 100.0
    );
    let answered = group.complete_all(&[json!({"prompt": "Hello", "max_tokens": 1})]);
    assert_eq!(answered.len(), 1);
    group.stop_with_sigterm();
}

#[test]
fn a_stalled_worker_turns_health_503_and_is_named() {
    if !mpirun_available() {
        return;
    }
    let group = Group::start(4, &[], &["--watchdog-timeout", "4"]);
    assert_eq!(group.health(), Some(200));
    let victim = group.rank_pid(3);
    signal(victim, "STOP");
    let stopped = Instant::now();
    let mut saw_503 = false;
    while stopped.elapsed() < Duration::from_secs(30) && !group.exited() {
        saw_503 |= group.health() == Some(503);
        std::thread::sleep(Duration::from_millis(100));
    }
    let (status, took) = group.wait_exit(Duration::from_secs(60));
    signal(victim, "KILL");
    assert!(!status.success());
    assert!(saw_503, "the leader's /health never answered 503");
    let log = group.log();
    assert!(
        log.contains("rank 3 stopped: no heartbeat"),
        "the stalled rank is not named:\n{log}"
    );
    eprintln!(
        "stalled rank 3: the group ended {:?} after SIGSTOP",
        took + stopped.elapsed()
    );
}

#[test]
fn sigterm_to_the_leader_drains_and_every_process_exits_zero() {
    if !mpirun_available() {
        return;
    }
    let group = Group::start(4, &[], &[]);
    let load = group.background_load(8);
    std::thread::sleep(Duration::from_millis(200));
    signal(group.rank_pid(0), "TERM");
    let (status, _) = group.wait_exit(SERVE_TIMEOUT);
    let outcomes = load.join().expect("load thread");
    assert!(status.success(), "mpirun exit {status:?}:\n{}", group.log());
    // Nothing in flight was lost: every request finished (or was refused before it started),
    // and the drain really had requests in flight to finish.
    assert!(
        outcomes.iter().any(|o| o == "finished"),
        "no request was in flight: {outcomes:?}"
    );
    for outcome in outcomes {
        assert!(
            outcome == "finished" || outcome.starts_with("refused"),
            "{outcome}"
        );
    }
}
