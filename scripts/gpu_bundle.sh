#!/usr/bin/env bash
# Builds what a GPU host without a Rust toolchain needs for rackfill's GPU checks and figures:
# the release binary and the test binaries with GPU tests (rackfill-kernels' cuda_* and exec_*,
# rackfill-models' gpu_* and rackfill-engine's ep_equivalence, built with feature cuda), stripped and packed with xz into
# one file in a folder (default .gpu-bundle, git-ignored; its size is printed at the end) to copy
# or carry there. Then, on the GPU host, in a copy of this repository:
# `bash scripts/gpu_session.sh .gpu-bundle` (docs/gpu.md "On a GPU host").
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.gpu-bundle}
rm -rf "$out"
stage=$(mktemp -d)
mkdir -p "$stage/tests" "$out"
json=$(mktemp)
cargo build --release --locked --bin rackfill --message-format=json >"$json"
cargo test --release --locked --features cuda -p rackfill-kernels -p rackfill-models -p rackfill-engine --no-run \
  --message-format=json >>"$json"
# The executables cargo reports: the binary, then each test target.
python3 - "$json" "$stage" <<'PY'
import json, shutil, sys
src, out = sys.argv[1], sys.argv[2]
for line in open(src):
    m = json.loads(line)
    exe = m.get("executable") if m.get("reason") == "compiler-artifact" else None
    if not exe:
        continue
    name = m["target"]["name"]
    if m["profile"]["test"] and (name.startswith(("cuda_", "gpu_", "exec_")) or name == "ep_equivalence"):
        shutil.copy(exe, f"{out}/tests/")
    elif m["target"]["name"] == "rackfill":
        shutil.copy(exe, f"{out}/rackfill")
PY
rm -f "$json"
strip "$stage/rackfill" "$stage"/tests/*
# Tests find their fixtures through paths compiled in (CARGO_MANIFEST_DIR): the session script
# links this checkout's path to wherever the repository lands on the GPU host.
pwd >"$stage/root"
tar -C "$stage" -cJf "$out/bundle.tar.xz" .
rm -rf "$stage"
du -h "$out/bundle.tar.xz"
