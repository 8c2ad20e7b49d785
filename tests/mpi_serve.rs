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
/// ends non-zero within a minute, no rank outliving it, that the leader named the rank and
/// answered `/health` 503 before the end, and that every stream still open ended with an error
/// event naming the rank and `[DONE]`; returns how long it took.
fn kill_rank_under_load(group: &Group, rank: usize) -> Duration {
    let load = group.background_load_of(8, 4000);
    std::thread::sleep(Duration::from_millis(500));
    let victim = group.rank_pid(rank);
    let killed = Instant::now();
    signal(victim, "KILL");
    let mut first_503 = None;
    while !group.exited() && killed.elapsed() < Duration::from_secs(60) {
        if let Some((503, body)) = group.health_answer() {
            first_503.get_or_insert((killed.elapsed(), body));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let (status, _) = group.wait_exit(Duration::from_secs(60));
    let ended = killed.elapsed();
    assert!(!status.success(), "mpirun exited 0 after a rank was killed");
    // mpirun may return while the kernel still tears a SIGKILLed rank down (its mappings).
    let gone = Instant::now();
    while !group.all_ranks_gone() && gone.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(group.all_ranks_gone(), "a rank outlived the group by 5 s");
    let named = format!("rank {rank} (pid {victim}) exited or was killed");
    let log = group.log();
    assert!(log.contains(&named), "the killed rank is not named:\n{log}");
    let (at, body) = first_503.expect("/health never answered 503");
    assert!(body.contains(&named), "{body}");
    eprintln!("killed rank {rank}: /health 503 after {at:?}, the group ended after {ended:?}");
    for outcome in load.join().expect("load thread") {
        assert!(
            outcome.starts_with("error: ") && outcome.contains(&named),
            "a stream did not end with an error naming the rank: {outcome}"
        );
    }
    ended
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

/// A worker whose engine thread alone is stopped (a debugger's ptrace on that one thread: the
/// process, its watchdog thread included, still runs and beats): the leader names it from its
/// heartbeats' stalled progress and its process state at `--watchdog-timeout`, not a healthy
/// rank waiting for it.
#[test]
fn a_worker_whose_engine_thread_alone_is_stopped_is_named() {
    if !mpirun_available() || !python_ptrace_available() {
        return;
    }
    let group = Group::start(3, &[], &["--watchdog-timeout", "4", "--health-grace", "1"]);
    let load = group.background_load_of(6, 4000);
    std::thread::sleep(Duration::from_millis(500));
    // A worker's engine loop runs on its main thread (thread id = process id).
    let victim = group.rank_pid(2);
    let mut tracer = std::process::Command::new("python3")
        .args(["-c", PTRACE_STOP, &victim.to_string()])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3");
    let mut said = String::new();
    let stdout = tracer.stdout.take().expect("tracer stdout");
    let _ = std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut said);
    if said.trim() != "stopped" {
        // No ptrace here (a container without CAP_SYS_PTRACE, Yama's ptrace_scope 3).
        eprintln!("skipped: cannot ptrace-stop one thread here");
        let _ = tracer.wait();
        return;
    }
    let stopped = Instant::now();
    let (status, _) = group.wait_exit(Duration::from_secs(60));
    let ended = stopped.elapsed();
    let _ = tracer.kill();
    let _ = tracer.wait();
    assert!(!status.success());
    let log = group.log();
    let stops: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("stopping the group"))
        .collect();
    assert!(
        !stops.is_empty(),
        "no rank said why the group stopped:\n{log}"
    );
    for line in &stops {
        assert!(
            line.contains(&format!("rank 2 (pid {victim}) made no progress")),
            "rank 2 is not the one named: {line}\n{log}"
        );
    }
    for outcome in load.join().expect("load thread") {
        assert!(
            outcome.starts_with("error: ") && outcome.contains("rank 2 (pid"),
            "a stream did not end with an error naming rank 2: {outcome}"
        );
    }
    eprintln!("engine thread of rank 2 stopped under load: the group ended after {ended:?}");
}

/// Stops one thread (`argv[1]`, a thread id) with `PTRACE_SEIZE` + `PTRACE_INTERRUPT`, as a
/// debugger does, and keeps it stopped until this process is killed.
const PTRACE_STOP: &str = r#"
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
tid = int(sys.argv[1])
for request in (0x4206, 0x4207):  # PTRACE_SEIZE, PTRACE_INTERRUPT
    if libc.ptrace(request, tid, None, None) != 0:
        sys.exit(f"ptrace {request:#x} on {tid}: errno {ctypes.get_errno()}")
print("stopped", flush=True)
time.sleep(300)
"#;

/// Whether `python3` can run the ptrace helper (it needs ctypes; ptrace itself needs the
/// permission a test running as the servers' user has).
fn python_ptrace_available() -> bool {
    let found = std::process::Command::new("python3")
        .args(["-c", "import ctypes; ctypes.CDLL(None).ptrace"])
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        eprintln!("skipped: python3 with ctypes is needed to stop one thread");
    }
    found
}

/// On the device path a rank stopped under load holds the others in a peer-memory wait inside
/// a layer: their step fails within `RACKFILL_PEER_WAIT_MS` with an error naming the stopped
/// rank, and the leader answers every open request with it and stops the group, long before
/// the heartbeat timeout. (Stopped between two layers' kernels instead, the others wait in a
/// collective and the heartbeats name it; the test says which happened.)
#[test]
fn a_rank_stopped_mid_layer_on_the_device_path_fails_the_step_and_is_named() {
    if !mpirun_available() || !emulator_available() {
        return;
    }
    let flags = ["--model", "rackfill-tiny-moe", "--device", "emulator"];
    let group = Group::start_with(
        &["-x", "RACKFILL_PEER_WAIT_MS=1000"],
        3,
        &flags,
        &["--watchdog-timeout", "8", "--health-grace", "1"],
    );
    let load = group.background_load_of(6, 4000);
    std::thread::sleep(Duration::from_millis(1000));
    let victim = group.rank_pid(2);
    signal(victim, "STOP");
    let stopped = Instant::now();
    let mut failure = None;
    while !group.exited() && stopped.elapsed() < Duration::from_secs(60) {
        if let Some((503, body)) = group.health_answer() {
            // Past the suspicion ("... unless it resumes"): the failure.
            if !body.contains("unless it resumes") {
                failure.get_or_insert((stopped.elapsed(), body));
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let (status, _) = group.wait_exit(Duration::from_secs(60));
    let ended = stopped.elapsed();
    signal(victim, "KILL");
    assert!(!status.success());
    let (at, body) = failure.unwrap_or_else(|| {
        panic!(
            "/health never answered 503 with the group's failure (ended after {ended:?}):\n{}",
            group.log()
        )
    });
    let named = match body.contains("engine step failed") {
        true => "rank 2 stalled or died",
        false => "rank 2 (pid",
    };
    assert!(body.contains(named), "{body}");
    for outcome in load.join().expect("load thread") {
        assert!(
            outcome.starts_with("error: ") && outcome.contains(named),
            "a stream did not end with an error naming rank 2: {outcome}"
        );
    }
    eprintln!(
        "SIGSTOP on rank 2 of a device group: failed after {at:?} ({}), ended after {ended:?}",
        match named {
            "rank 2 stalled or died" => "a peer-memory wait failed the step",
            _ => "the heartbeats named it",
        }
    );
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

/// A worker stopped (SIGSTOP) under load: the leader, not a healthy rank blocked waiting for
/// it, names it; `/health` answers 503 naming it from the moment it is suspected until the group
/// goes; every open stream ends with an error event naming it and `[DONE]`, and an open
/// non-streamed request gets a 503 naming it, before the processes end.
#[test]
fn a_stopped_worker_under_load_is_named_and_every_request_gets_the_error() {
    if !mpirun_available() {
        return;
    }
    let grace = 2.0;
    let group = Group::start(4, &[], &["--watchdog-timeout", "4", "--health-grace", "2"]);
    assert_eq!(group.health(), Some(200));
    let streams = group.background_load_of(6, 4000);
    let plain = {
        let url_group = &group;
        let body = json!({"prompt": "one more", "max_tokens": 4000, "ignore_eos": true});
        std::thread::scope(|scope| {
            let answer = scope.spawn(|| url_group.try_complete(&body));
            std::thread::sleep(Duration::from_millis(500));
            let victim = group.rank_pid(3);
            signal(victim, "STOP");
            let stopped = Instant::now();
            let mut first_503 = None;
            let mut verdict = None;
            let mut bodies = Vec::new();
            while !group.exited() && stopped.elapsed() < Duration::from_secs(60) {
                if let Some((503, body)) = group.health_answer() {
                    first_503.get_or_insert(stopped.elapsed());
                    if body.contains("no heartbeat") {
                        verdict.get_or_insert(stopped.elapsed());
                    }
                    bodies.push(body);
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let (status, _) = group.wait_exit(Duration::from_secs(60));
            let ended = stopped.elapsed();
            signal(victim, "KILL");
            assert!(!status.success());
            let first_503 = first_503.expect("/health never answered 503");
            eprintln!(
                "SIGSTOP on rank 3 under load: /health 503 (suspected) after {first_503:?}, the \
                 verdict after {verdict:?}, the group ended after {ended:?} (--watchdog-timeout \
                 4 --health-grace 2)"
            );
            assert!(
                ended - first_503 >= Duration::from_secs_f64(grace),
                "503 for only {:?} before the end",
                ended - first_503
            );
            assert!(
                bodies.iter().all(|b| b.contains("rank 3")),
                "a 503 does not name rank 3: {bodies:?}"
            );
            answer.join().expect("request thread")
        })
    };
    let log = group.log();
    let stops: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("stopping the group"))
        .collect();
    assert!(
        !stops.is_empty(),
        "no rank said why the group stopped:\n{log}"
    );
    for line in &stops {
        assert!(
            line.contains("rank 3 (pid") && line.contains("stopped: no heartbeat"),
            "a rank other than 3 is blamed: {line}\n{log}"
        );
    }
    let (status, body) = plain.expect("the non-streamed request got no answer");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("rank 3"), "{body}");
    for outcome in streams.join().expect("load thread") {
        assert!(
            outcome.starts_with("error: ") && outcome.contains("rank 3"),
            "a stream did not end with an error naming rank 3: {outcome}"
        );
    }
}

/// A drain under load, however it was asked for: every request in flight finishes, new ones
/// get 503 (not a refused connection) while the listener stays open, `/health` answers 503,
/// and every process exits 0. `ask` signals the group; `--health-grace 3` keeps the listener
/// open long enough to look.
fn drains_under_load(group: Group, ask: impl FnOnce(&Group)) {
    let load = group.background_load_of(8, 128);
    std::thread::sleep(Duration::from_millis(300));
    let asked = Instant::now();
    ask(&group);
    let mut refused_new = None;
    let mut health = None;
    while asked.elapsed() < Duration::from_secs(2) && (refused_new.is_none() || health.is_none()) {
        std::thread::sleep(Duration::from_millis(100));
        if let Some((503, body)) = group.try_complete(&json!({"prompt": "late", "max_tokens": 1})) {
            refused_new.get_or_insert(body);
        }
        if let Some((503, body)) = group.health_answer() {
            health.get_or_insert(body);
        }
    }
    let (status, _) = group.wait_exit(SERVE_TIMEOUT);
    let drained = asked.elapsed();
    let outcomes = load.join().expect("load thread");
    assert!(status.success(), "exit {status:?}:\n{}", group.log());
    let refused_new = refused_new.expect("a new request during the drain got no 503");
    assert!(refused_new.contains("shutting down"), "{refused_new}");
    let health = health.expect("/health never answered 503 during the drain");
    assert!(health.contains("shutting down"), "{health}");
    // Nothing in flight was lost, and the drain really had requests in flight to finish.
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
    eprintln!("drained and exited 0 in {drained:?} (--health-grace 3)");
}

/// What `srun` on `scancel` and pods' runtimes do: SIGTERM to every process at once. The workers
/// pass it on to the leader, which drains the group.
#[test]
fn sigterm_to_every_rank_drains_the_group_and_every_process_exits_zero() {
    if !mpirun_available() {
        return;
    }
    let group = Group::start(4, &[], &["--health-grace", "3"]);
    drains_under_load(group, |group| {
        for rank in (0..4).rev() {
            signal(group.rank_pid(rank), "TERM");
        }
    });
}

/// Bare `mpirun`: it forwards SIGUSR1 to every rank at once (SIGTERM it turns into killing
/// them), and the group drains on it.
#[test]
fn sigusr1_to_mpirun_drains_the_group_and_mpirun_exits_zero() {
    if !mpirun_available() {
        return;
    }
    let group = Group::start(4, &[], &["--health-grace", "3"]);
    assert!(group
        .log()
        .contains("to drain this group: SIGUSR1 to mpirun"));
    drains_under_load(group, |group| signal(group.launcher_pid(), "USR1"));
}

/// The launcher the project ships (`deploy/one-host.sh`, a container's entry point): SIGTERM to
/// it drains the group and it exits 0.
#[test]
fn sigterm_to_the_one_host_launcher_drains_the_group_and_it_exits_zero() {
    if !mpirun_available() {
        return;
    }
    let group = Group::launch_script("deploy/one-host.sh", 4, &["--health-grace", "3"]);
    drains_under_load(group, |group| signal(group.launcher_pid(), "TERM"));
}
