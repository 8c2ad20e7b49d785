#!/usr/bin/env bash
# rackfill on one host, one process per EP rank:
#
#   deploy/one-host.sh [rackfill serve arguments]        e.g. --model /models/qwen3 --port 8000
#
# is `mpirun -np $RACKFILL_RANKS rackfill serve ...` (4 ranks unless RACKFILL_RANKS says otherwise)
# plus a graceful Ctrl-C / SIGTERM (a container's stop): it becomes SIGUSR1 to mpirun, which
# passes it to every rank; the group drains the requests in flight (--shutdown-timeout) and shuts
# every rank down, exit 0. Plain mpirun turns Ctrl-C or SIGTERM into killing the ranks (SIGTERM
# after OpenMPI's odls_base_sigkill_timeout, 1 s by default, SIGKILL after twice that) and exits
# 1, so nothing drains. The binary must be built with `cargo build --release --features mpi`;
# RACKFILL_BIN names it (default: target/release/rackfill when present, else rackfill on PATH).
# Ranks share the host's GPUs by local rank; without GPUs every rank serves on the CPU.
set -euo pipefail

deploy=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ranks=${RACKFILL_RANKS:-4}
[[ "$ranks" =~ ^[1-9][0-9]*$ ]] || { echo "one-host.sh: RACKFILL_RANKS must be a positive integer, not '$ranks'" >&2; exit 2; }
if [[ -z "${RACKFILL_BIN:-}" && -x "$deploy/../target/release/rackfill" ]]; then
  RACKFILL_BIN="$deploy/../target/release/rackfill"
fi
export RACKFILL_BIN=${RACKFILL_BIN:-rackfill}
export RACKFILL_RUN_DIR=${RACKFILL_RUN_DIR:-$(mktemp -d -t rackfill-run.XXXXXX)}
command -v mpirun > /dev/null || { echo "one-host.sh: mpirun not found (apt-get install openmpi-bin)" >&2; exit 2; }

# A failing group answers its open requests and /health 503 for --health-grace (5 s) before its
# ranks end; when a rank dies, mpirun kills the others only after odls_base_sigkill_timeout, so
# make that outlast the grace.
export OMPI_MCA_odls_base_sigkill_timeout=${OMPI_MCA_odls_base_sigkill_timeout:-10}
args=(-np "$ranks" --bind-to none -x RACKFILL_BIN -x RACKFILL_RUN_DIR)
[[ "$(id -u)" == 0 ]] && args+=(--allow-run-as-root)
# More ranks than cores is allowed (slow, but it runs); OpenMPI refuses it by default.
(($(nproc) < ranks)) && args+=(--oversubscribe)

# mpirun in its own session: the terminal's Ctrl-C reaches this script only, which turns it into
# a drain (rackfill-await).
setsid mpirun "${args[@]}" "$deploy/bin/rackfill-rank" "$@" &
# shellcheck source=bin/rackfill-await
. "$deploy/bin/rackfill-await"
rackfill_await $!
