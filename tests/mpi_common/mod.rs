//! Starting `rackfill serve` under `mpirun` (or as one process) for the multi-process tests, and
//! talking to it over real HTTP. Each test file uses part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Prompt and token logprobs of the group and of one process agree this closely (f32 sums in a
/// different order on different ranks never differ by more).
pub const EQUAL_LOGPROBS: f64 = 1e-4;

/// How long a server may take to start, or to drain and exit.
pub const SERVE_TIMEOUT: Duration = Duration::from_secs(120);

const BIN: &str = env!("CARGO_BIN_EXE_rackfill");

/// Whether `mpirun` is installed; says why a test is skipped when it is not.
pub fn mpirun_available() -> bool {
    let found = Command::new("mpirun")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        eprintln!("skipped: mpirun not found (install openmpi-bin to run the multi-process tests)");
    }
    found
}

/// `mpirun` as root on one host, ranks oversubscribing its cores. Each launch gets its own
/// session directory: OpenMPI 4 launches started at the same moment (tests run in parallel)
/// otherwise race to create the shared `/tmp/ompi.HOST.UID` and one fails in `orte_init`.
fn mpirun() -> Command {
    let session = log_path("session").with_extension("d");
    std::fs::create_dir_all(&session).expect("session directory");
    let mut cmd = Command::new("mpirun");
    cmd.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "--bind-to",
        "none",
    ])
    .env("OMPI_MCA_orte_tmpdir_base", &session);
    cmd
}

/// Sends `signal` (`KILL`, `STOP`, `TERM`) to `pid`.
pub fn signal(pid: u32, signal: &str) {
    let _ = Command::new("kill")
        .args([format!("-{signal}"), pid.to_string()])
        .status();
}

fn log_path(tag: &str) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    std::env::temp_dir().join(format!("rackfill-mpi-{}-{tag}-{n}.log", std::process::id()))
}

/// A running server: `mpirun` with one process per rank ([`Group`]) or one process ([`Served`]).
pub struct Served {
    child: Mutex<Child>,
    log: PathBuf,
    port: u16,
    leader_pid: u32,
    runtime: tokio::runtime::Runtime,
}

/// A group's server: the same type, started under `mpirun`.
pub type Group = Served;

/// How a process run to its end finished.
pub struct Finished {
    pub status: ExitStatus,
    pub stderr: String,
}

impl Served {
    /// `mpirun -np N rackfill serve --port 0 FLAGS GROUP_FLAGS`, once the leader listens.
    pub fn start(np: usize, flags: &[&str], group_flags: &[&str]) -> Self {
        Self::start_with(&[], np, flags, group_flags)
    }

    /// [`Served::start`] with `MPIRUN_FLAGS` before `-np`.
    pub fn start_with(
        mpirun_flags: &[&str],
        np: usize,
        flags: &[&str],
        group_flags: &[&str],
    ) -> Self {
        let log = log_path("group");
        let mut cmd = mpirun();
        cmd.args(mpirun_flags)
            .args(["-np", &np.to_string(), BIN, "serve", "--port", "0"])
            .args(short_grace(flags, group_flags))
            .args(flags)
            .args(group_flags);
        Self::spawn(cmd, log, true)
    }

    /// `SCRIPT --port 0 FLAGS` (a launcher of the repository's `deploy/`, which runs `mpirun`
    /// with `np` ranks of this build), once the leader listens.
    pub fn launch_script(script: &str, np: usize, flags: &[&str]) -> Self {
        let log = log_path("script");
        let session = log_path("session").with_extension("d");
        std::fs::create_dir_all(&session).expect("session directory");
        let mut cmd = Command::new("bash");
        cmd.arg(Path::new(env!("CARGO_MANIFEST_DIR")).join(script))
            .args(["--port", "0"])
            .args(flags)
            .env("RACKFILL_BIN", BIN)
            .env("RACKFILL_RANKS", np.to_string())
            .env("OMPI_MCA_orte_tmpdir_base", &session);
        Self::spawn(cmd, log, true)
    }

    /// `rackfill serve --port 0 FLAGS` as one process, once it listens.
    pub fn single(flags: &[&str]) -> Self {
        Self::single_with_env(flags, &[])
    }

    /// [`Served::single`] with the environment variables `env` set.
    pub fn single_with_env(flags: &[&str], env: &[(&str, &str)]) -> Self {
        let log = log_path("single");
        let mut cmd = Command::new(BIN);
        cmd.args(["serve", "--port", "0"])
            .args(short_grace(flags, &[]))
            .args(flags)
            .envs(env.iter().copied());
        Self::spawn(cmd, log, false)
    }

    fn spawn(mut cmd: Command, log: PathBuf, group: bool) -> Self {
        let file = std::fs::File::create(&log).expect("log file");
        let child = cmd
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdout(file.try_clone().expect("log file"))
            .stderr(file)
            .spawn()
            .expect("the server starts");
        let child_pid = child.id();
        let mut served = Self {
            child: Mutex::new(child),
            log,
            port: 0,
            leader_pid: child_pid,
            runtime: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime"),
        };
        let started = Instant::now();
        loop {
            let text = served.log();
            if let Some(port) = listening_port(&text) {
                served.port = port;
                break;
            }
            if served.exited() || started.elapsed() > SERVE_TIMEOUT {
                served.kill();
                panic!("the server did not start:\n{text}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        if group {
            served.leader_pid = served.rank_pid(0);
        }
        served
    }

    /// Runs `mpirun -np N rackfill serve --port 0 FLAGS` to its end (it must fail at start).
    pub fn run_to_end(np: usize, flags: &[&str]) -> Finished {
        let mut cmd = mpirun();
        cmd.args(["-np", &np.to_string(), BIN, "serve", "--port", "0"])
            .args(flags);
        finish(cmd)
    }

    /// An MPMD launch: one process per entry, each `rackfill serve --port 0` with its flags.
    pub fn run_mpmd(ranks: &[&[&str]]) -> Finished {
        let mut cmd = mpirun();
        for (i, flags) in ranks.iter().enumerate() {
            if i > 0 {
                cmd.arg(":");
            }
            cmd.args(["-np", "1", BIN, "serve", "--port", "0"])
                .args(*flags);
        }
        finish(cmd)
    }

    /// Everything the processes printed so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The pid rank `rank` logged at start.
    pub fn rank_pid(&self, rank: usize) -> u32 {
        let started = Instant::now();
        loop {
            if let Some(pid) = logged_pid(&self.log(), rank) {
                return pid;
            }
            assert!(
                started.elapsed() < SERVE_TIMEOUT,
                "rank {rank} never logged its pid:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The launched process: `mpirun`, or the one server.
    pub fn launcher_pid(&self) -> u32 {
        self.child.lock().unwrap().id()
    }

    /// Whether the launched process (`mpirun`, or the one server) has exited.
    pub fn exited(&self) -> bool {
        self.child
            .lock()
            .unwrap()
            .try_wait()
            .ok()
            .flatten()
            .is_some()
    }

    /// Waits up to `limit` for the launched process to exit; how it ended and how long it took.
    pub fn wait_exit(&self, limit: Duration) -> (ExitStatus, Duration) {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.lock().unwrap().try_wait().expect("wait") {
                return (status, started.elapsed());
            }
            if started.elapsed() > limit {
                self.kill();
                panic!("still running after {limit:?}:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn kill(&self) {
        let mut child = self.child.lock().unwrap();
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Whether every rank that logged a pid is gone.
    pub fn all_ranks_gone(&self) -> bool {
        let log = self.log();
        (0..)
            .map_while(|rank| logged_pid(&log, rank))
            .all(|pid| !Path::new(&format!("/proc/{pid}")).exists() || is_zombie(pid))
    }

    /// SIGTERM to the leader: it drains, every process exits 0.
    pub fn stop_with_sigterm(self) {
        signal(self.leader_pid, "TERM");
        let (status, _) = self.wait_exit(SERVE_TIMEOUT);
        assert!(
            status.success(),
            "exit {status:?} after SIGTERM:\n{}",
            self.log()
        );
    }

    /// `http://127.0.0.1:PORT` and `path`.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// `/health`'s status, `None` when nothing answers.
    pub fn health(&self) -> Option<u16> {
        self.health_answer().map(|(status, _)| status)
    }

    /// `/health`'s status and body, `None` when nothing answers.
    pub fn health_answer(&self) -> Option<(u16, String)> {
        self.get(self.url("/health"))
    }

    /// A completion request's status and body, `None` when nothing answers (connection
    /// refused or reset).
    pub fn try_complete(&self, body: &Value) -> Option<(u16, String)> {
        let (url, body) = (self.url("/v1/completions"), body.clone());
        self.runtime.block_on(async move {
            let client = reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()
                .ok()?;
            let r = client.post(url).json(&body).send().await.ok()?;
            let status = r.status().as_u16();
            Some((status, r.text().await.ok()?))
        })
    }

    fn get(&self, url: String) -> Option<(u16, String)> {
        self.runtime.block_on(async move {
            let client = reqwest::Client::builder()
                .timeout(Duration::from_secs(2))
                .build()
                .ok()?;
            let r = client.get(url).send().await.ok()?;
            let status = r.status().as_u16();
            Some((status, r.text().await.ok()?))
        })
    }

    /// `/metrics` as text.
    pub fn metrics(&self) -> String {
        let url = self.url("/metrics");
        self.runtime.block_on(async move {
            reqwest::get(url)
                .await
                .expect("metrics")
                .text()
                .await
                .expect("metrics text")
        })
    }

    /// The value of `name{rank="R"}` in a `/metrics` text.
    pub fn metric(text: &str, name: &str, rank: usize) -> Option<f64> {
        let key = format!("{name}{{rank=\"{rank}\"}} ");
        text.lines()
            .find_map(|line| line.strip_prefix(&key))
            .and_then(|v| v.trim().parse().ok())
    }

    /// Posts every completion request at once; the JSON answers, in order (each must be 200).
    pub fn complete_all(&self, requests: &[Value]) -> Vec<Value> {
        let url = self.url("/v1/completions");
        let requests = requests.to_vec();
        self.runtime.block_on(async move {
            let client = reqwest::Client::new();
            let sends = requests.into_iter().map(|body| {
                let (client, url) = (client.clone(), url.clone());
                async move {
                    let r = client.post(url).json(&body).send().await.expect("send");
                    let status = r.status();
                    let body: Value = r.json().await.expect("json answer");
                    assert_eq!(status, 200, "{body}");
                    body
                }
            });
            futures_join_all(sends).await
        })
    }

    /// `n` streamed completions of `max_tokens` each sent at once on another thread; each ends
    /// as `finished` (its stream reached `[DONE]` after a finish reason), `error: EVENT` (it
    /// ended with an error event and `[DONE]`), `refused <status>`, or `lost: why`.
    pub fn background_load_of(&self, n: usize, max_tokens: u32) -> JoinHandle<Vec<String>> {
        let url = self.url("/v1/completions");
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async move {
                let client = reqwest::Client::new();
                let sends = (0..n).map(|i| {
                    let (client, url) = (client.clone(), url.clone());
                    async move {
                        let body = json!({
                            "prompt": format!("request {i}: the quick brown fox"),
                            "max_tokens": max_tokens, "ignore_eos": true, "stream": true,
                        });
                        let r = match client.post(url).json(&body).send().await {
                            Ok(r) => r,
                            Err(e) => return format!("lost: {e}"),
                        };
                        if r.status() != 200 {
                            return format!("refused {}", r.status());
                        }
                        match r.text().await {
                            Ok(text)
                                if text.contains("\"finish_reason\":\"length\"")
                                    && text.trim_end().ends_with("data: [DONE]") =>
                            {
                                "finished".into()
                            }
                            Ok(text) if text.trim_end().ends_with("data: [DONE]") => {
                                let last = text
                                    .lines()
                                    .rfind(|l| l.starts_with("data: {\"error\""))
                                    .map(str::to_owned);
                                last.map_or_else(
                                    || format!("lost: {text}"),
                                    |e| format!("error: {e}"),
                                )
                            }
                            Ok(text) => format!("lost: {text}"),
                            Err(e) => format!("lost: {e}"),
                        }
                    }
                });
                futures_join_all(sends).await
            })
        })
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if !self.exited() {
            self.kill();
        }
    }
}

/// Awaits every future, in order.
async fn futures_join_all<F>(futures: impl Iterator<Item = F>) -> Vec<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futures.map(tokio::spawn).collect();
    let mut out = Vec::with_capacity(handles.len());
    for handle in handles {
        out.push(handle.await.expect("request task"));
    }
    out
}

fn finish(mut cmd: Command) -> Finished {
    let log = log_path("finish");
    let file = std::fs::File::create(&log).expect("log file");
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(file)
        .spawn()
        .expect("mpirun starts");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if started.elapsed() > SERVE_TIMEOUT {
            let _ = child.kill();
            panic!(
                "still running:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Finished {
        status,
        stderr: std::fs::read_to_string(&log).unwrap_or_default(),
    }
}

/// `--health-grace 0.2` unless the flags set it: the tests' drains need not wait for a load
/// balancer.
fn short_grace(flags: &[&str], group_flags: &[&str]) -> Vec<&'static str> {
    match flags
        .iter()
        .chain(group_flags)
        .any(|f| *f == "--health-grace")
    {
        true => vec![],
        false => vec!["--health-grace", "0.2"],
    }
}

/// The port of the `rackfill listening on http://HOST:PORT` log line.
fn listening_port(log: &str) -> Option<u16> {
    let rest = log.split("rackfill listening on http://").nth(1)?;
    let addr = rest.split_whitespace().next()?;
    addr.rsplit(':').next()?.parse().ok()
}

/// The pid of the `rank R of N (pid P)` log line.
fn logged_pid(log: &str, rank: usize) -> Option<u32> {
    let marker = format!("rank {rank} of ");
    log.lines().find_map(|line| {
        let rest = &line[line.find(&marker)?..];
        let pid = rest.split("(pid ").nth(1)?;
        pid.split(')').next()?.parse().ok()
    })
}

fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.contains(") Z "))
        .unwrap_or(true)
}

/// A copy of a conformance checkpoint (`models/tests/fixtures/FAMILY`) with a word-level
/// tokenizer over its vocabulary, so `rackfill serve` can load it; and the vocabulary size.
pub fn tokenizer_fixture(family: &str) -> (PathBuf, u32) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models/tests/fixtures")
        .join(family);
    let dir = std::env::temp_dir().join(format!("rackfill-mpi-{}-{family}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("fixture dir");
    for entry in std::fs::read_dir(&src).expect("fixture") {
        let entry = entry.expect("fixture entry");
        std::fs::copy(entry.path(), dir.join(entry.file_name())).expect("copy fixture");
    }
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let vocab = config["vocab_size"].as_u64().expect("vocab_size") as u32;
    let words: serde_json::Map<String, Value> =
        (0..vocab).map(|i| (format!("w{i}"), json!(i))).collect();
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": words, "unk_token": "w0"},
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).expect("tokenizer");
    (dir, vocab)
}
