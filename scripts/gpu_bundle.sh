#!/usr/bin/env bash
# Builds what a GPU host without a Rust toolchain needs for rackfill's GPU checks and figures:
# the release binary, the load_gpu example and the test binaries that run on every executor
# (rackfill-kernels' device_*, exec_* and cuda_nvrtc, rackfill-models' gpu_* and fp8,
# rackfill-engine's ep_equivalence, built with feature cuda), stripped and packed with xz into
# one file in a folder (default .gpu-bundle, git-ignored; its size is printed at the end) to copy
# or carry there. Then, on the GPU host, in a copy of this repository:
# `bash scripts/gpu_session.sh .gpu-bundle` (docs/gpu.md "On a GPU host"). Where Open MPI is
# installed here, the bundle also holds `rackfill-mpi` (built with `--features mpi`) and this
# host's Open MPI runtime (`scripts/mpi_runtime.sh`): the session's `group` step runs ranks in
# several processes on one GPU with them, on hosts that have no MPI.
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
cargo build --release --locked --features cuda -p rackfill-models --example load_gpu \
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
    if m["profile"]["test"] and (
        name.startswith(("cuda_", "gpu_", "exec_", "device_")) or name in ("ep_equivalence", "fp8")
    ):
        shutil.copy(exe, f"{out}/tests/")
    elif name in ("rackfill", "load_gpu"):
        shutil.copy(exe, f"{out}/{name}")
PY
rm -f "$json"
if command -v ompi_info >/dev/null; then
  cargo build --release --locked --features mpi --bin rackfill
  cp target/release/rackfill "$stage/rackfill-mpi"
  strip "$stage/rackfill-mpi"
  bash scripts/mpi_runtime.sh "$stage/mpi"
  # The plain binary again, so target/release/rackfill is what the rest of the bundle holds.
  cargo build --release --locked --bin rackfill
fi
strip "$stage/rackfill" "$stage/load_gpu" "$stage"/tests/*
# Tests find their fixtures through paths compiled in (CARGO_MANIFEST_DIR): the session script
# links this checkout's path to wherever the repository lands on the GPU host.
pwd >"$stage/root"
tar -C "$stage" -cJf "$out/bundle.tar.xz" .
rm -rf "$stage"
du -h "$out/bundle.tar.xz"
