//! What the `rackfill` binary's CLI tests share: running the binary, a temporary directory, and
//! reading the JSON report a successful run wrote. Each test file uses part of it.
#![allow(dead_code)]

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

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
