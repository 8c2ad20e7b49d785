#!/usr/bin/env bash
# Prefix cache on and off, side by side: three workloads (a Mooncake-structured shared-prefix
# trace, at its own rate and 20 times faster; multi-turn chats; evaluation-style scoring, every
# request sent at once) against `rackfill serve` on the built-in
# model, each on a fresh server so its metrics are the workload's own. Prints one markdown table:
# prefill tokens computed, TTFT mean/p99, request throughput, and the MoE imbalance before/after
# balancing (means over every layer of every step, from the server's histograms).
#
#   cargo build --release --features mpi --bin rackfill
#   scripts/prefix_cache_bench.sh [OUT_DIR] [extra `rackfill serve` flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${RACKFILL_BIN:-target/release/rackfill}
out=${1:-target/prefix-cache-bench}
shift || true
serve_flags=("$@")
mkdir -p "$out"
port=${PORT:-8431}
base="http://127.0.0.1:$port"

"$bin" bench serve-trace --out "$out/prefix.jsonl" --seed 1 > "$out/trace-stats.txt"

declare -A workloads=(
  [trace]="--dataset trace --dataset-path $out/prefix.jsonl --block-size 16"
  [trace-x20]="--dataset trace --dataset-path $out/prefix.jsonl --block-size 16 --trace-speedup 20"
  [multi-turn]="--dataset multi-turn --num-prompts 16 --max-concurrency 8 --multi-turn-turns 4 --multi-turn-system-len 256 --multi-turn-user-len 64 --multi-turn-output-len 16"
  [eval]="--dataset eval --num-prompts 32 --eval-context-len 512 --eval-continuations 4 --eval-continuation-len 16"
)

# Mean of a Prometheus histogram: its _sum over its _count.
histogram_mean() {
  python3 - "$1" "$2" <<'EOF'
import sys
name, path = sys.argv[1], sys.argv[2]
vals = {}
for line in open(path):
    if line.startswith(name + "_sum") or line.startswith(name + "_count"):
        key, value = line.rsplit(" ", 1)
        vals[key.split("{")[0]] = vals.get(key.split("{")[0], 0.0) + float(value)
count = vals.get(name + "_count", 0.0)
print(f"{vals.get(name + '_sum', 0.0) / count:.3f}" if count else "-")
EOF
}

json_field() {
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); v=d[sys.argv[2]]; print(f'{v:.{sys.argv[3]}f}' if isinstance(v, float) else v)" "$@"
}

echo "| workload | prefix cache | requests | prompt tokens | prefill computed | hit rate | TTFT mean (ms) | TTFT p99 (ms) | req/s | imbalance before | imbalance after |"
echo "|:--|:--|--:|--:|--:|--:|--:|--:|--:|--:|--:|"
for workload in trace trace-x20 multi-turn eval; do
  for mode in on off; do
    # Room for the whole trace in flight: a refused request would not measure the cache.
    flags=(--max-concurrent-requests 1024 "${serve_flags[@]}")
    [ "$mode" = off ] && flags+=(--no-prefix-cache)
    "$bin" serve --port "$port" "${flags[@]}" > "$out/serve-$workload-$mode.log" 2>&1 &
    server=$!
    for _ in $(seq 1 300); do
      curl -sf "$base/health" > /dev/null && break
      sleep 0.2
    done
    # shellcheck disable=SC2086
    "$bin" bench serve --base-url "$base" ${workloads[$workload]} --ignore-eos --no-progress \
      --output "$out/$workload-$mode.json" > "$out/$workload-$mode.txt"
    curl -sf "$base/metrics" > "$out/$workload-$mode.metrics"
    kill -TERM "$server"
    wait "$server" || true
    r="$out/$workload-$mode.json"
    before=$(histogram_mean 'rackfill:moe_imbalance_before' "$out/$workload-$mode.metrics")
    after=$(histogram_mean 'rackfill:moe_imbalance_after' "$out/$workload-$mode.metrics")
    echo "| $workload | $mode | $(json_field "$r" completed 0) | $(json_field "$r" total_input_tokens 0) | $(json_field "$r" total_prefill_tokens_computed 0) | $(json_field "$r" prefix_cache_hit_rate 3) | $(json_field "$r" mean_ttft_ms 1) | $(json_field "$r" p99_ttft_ms 1) | $(json_field "$r" request_throughput 2) | $before | $after |"
  done
done
