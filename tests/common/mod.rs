//! What the `rackfill` binary's CLI tests share: running the binary, a temporary directory,
//! reading the JSON report a successful run wrote, and a running server. Each test file uses
//! part of it.
#![allow(dead_code)]

use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Runs the `rackfill` binary built for these tests with `args`.
pub fn rackfill<S: AsRef<OsStr>>(args: &[S]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rackfill"))
        .args(args)
        .output()
        .expect("rackfill runs")
}

/// Runs `args`, which must succeed and write a JSON report to `report`; the report.
pub fn json_report<S: AsRef<OsStr> + std::fmt::Debug>(args: &[S], report: &Path) -> Value {
    let out = rackfill(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&std::fs::read(report).unwrap()).unwrap()
}

/// A fresh directory under the system's temporary directory, removed when dropped.
pub struct TempDir(PathBuf);

impl TempDir {
    /// `tag` names the test file and test, so parallel tests never share a directory.
    pub fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("rackfill-cli-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    pub fn file(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `rackfill serve` on the built-in model at a free port; killed when dropped.
pub struct Server {
    child: Child,
    addr: String,
}

impl Server {
    /// `rackfill serve --port 0` with `args`, once it listens.
    pub fn start(args: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_rackfill"))
            .args(["serve", "--port", "0"])
            .args(args)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("rackfill serve starts");
        let mut stderr = BufReader::new(child.stderr.take().unwrap());
        let mut log = String::new();
        let addr = loop {
            let mut line = String::new();
            if stderr.read_line(&mut line).unwrap() == 0 {
                let _ = child.kill();
                panic!("the server exited before listening:\n{log}");
            }
            log.push_str(&line);
            if let Some((_, rest)) = line.split_once("listening on http://") {
                break rest.split_whitespace().next().unwrap().to_string();
            }
        };
        // Keep draining the log so the server never blocks on a full pipe.
        std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
        Self { child, addr }
    }

    /// `host:port` it listens on.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// One HTTP/1.1 request; returns the status code and the body.
    pub fn request(&self, method: &str, path: &str, body: &str) -> (u16, String) {
        let mut stream = TcpStream::connect(&self.addr).unwrap();
        write!(
            stream,
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.addr,
            body.len()
        )
        .unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        let status = response[9..12].parse().unwrap();
        let body = response
            .split_once("\r\n\r\n")
            .map_or("", |(_, b)| b)
            .to_string();
        (status, body)
    }

    pub fn complete(&self, prompt: &str) {
        let body = format!("{{\"prompt\": \"{prompt}\", \"max_tokens\": 4, \"ignore_eos\": true}}");
        let (status, text) = self.request("POST", "/v1/completions", &body);
        assert_eq!(status, 200, "{text}");
    }

    /// The value of the unlabelled series `name` in `/metrics`, polled until `ready` holds.
    pub fn metric_when(&self, name: &str, ready: impl Fn(f64) -> bool) -> f64 {
        let started = Instant::now();
        loop {
            let (_, text) = self.request("GET", "/metrics", "");
            let value = text
                .lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok());
            if let Some(v) = value.filter(|&v| ready(v)) {
                return v;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "{name} never ready:\n{text}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
