#!/usr/bin/env bash
# The figures of docs/disaggregation.md, on one host: KV export over NIXL (UCX on loopback)
# against a memcpy of the same bytes; prefill TTFT with export on and off, side by side; and
# the peak KV a server holds for a decode tier that picks requests up late, under Poisson load.
#
#   bash scripts/kv_export_figures.sh [OUT_DIR]      # RACKFILL_BIN (default target/release/rackfill)
#
# Needs python3 with nixl (nixl-cu12), msgspec, pyzmq, numpy and safetensors (RACKFILL_NIXL_PYTHON
# to use another), as .ci/run installs them.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${RACKFILL_BIN:-target/release/rackfill}
python=${RACKFILL_NIXL_PYTHON:-python3}
out=${1:-target/kv-export-figures}
mkdir -p "$out"
servers=()
trap 'for s in "${servers[@]}"; do kill -TERM "$s" 2>/dev/null || true; done' EXIT

# serve PORT LOG FLAGS...: starts `rackfill serve` on the built-in model, waits for /health.
serve() {
  local port=$1 log=$2
  shift 2
  "$bin" serve --port "$port" "$@" > "$out/$log" 2>&1 &
  servers+=("$!")
  for _ in $(seq 1 240); do
    curl -fsS "http://127.0.0.1:$port/health" > /dev/null 2>&1 && return 0
    sleep 0.5
  done
  echo "rackfill serve on port $port did not start" >&2
  exit 1
}

stop_servers() {
  for s in "${servers[@]}"; do kill -TERM "$s" 2>/dev/null || true; wait "$s" 2>/dev/null || true; done
  servers=()
}

echo "== 1. export throughput: READ over UCX (loopback) against memcpy of the same bytes"
serve 18611 export-throughput.log --kv-export --kv-export-port 5711 --kv-tokens-per-rank 16384
for len in 512 1024 2048 4000; do
  prompt=$(python3 -c "import json; print(json.dumps([(7 + 13 * i) % 500 + 1 for i in range($len)]))")
  curl -fsS http://127.0.0.1:18611/v1/completions -H 'content-type: application/json' \
    -d "{\"prompt\": $prompt, \"max_tokens\": 1, \"kv_transfer_params\": {\"do_remote_decode\": true}}" \
    > "$out/export-$len.json"
  "$python" scripts/nixl_decode_standin.py --params "$out/export-$len.json" --model-dir models/builtin \
    --model-name rackfill-tiny-moe --repeat 30 | tee "$out/pull-$len.json"
done
stop_servers

echo "== 2. prefill TTFT, export off and on (with a decode side pulling at once), alternated"
serve 18612 ttft-off.log
serve 18613 ttft-on.log --kv-export --kv-export-port 5712
common=(--num-prompts 32 --random-input-len 1024 --random-output-len 1 --request-rate inf
        --max-concurrency 4 --no-progress)
for round in 1 2; do
  "$bin" bench serve --base-url http://127.0.0.1:18612 "${common[@]}" \
    --output "$out/ttft-off-$round.json" > "$out/ttft-off-$round.txt"
  "$bin" bench serve --base-url http://127.0.0.1:18613 "${common[@]}" --remote-decode \
    --output "$out/ttft-on-$round.json" > "$out/ttft-on-$round.txt"
  python3 - "$out" "$round" <<'PY'
import json, sys
out, r = sys.argv[1], sys.argv[2]
off, on = (json.load(open(f"{out}/ttft-{w}-{r}.json")) for w in ("off", "on"))
print(f"round {r}: mean TTFT off {off['mean_ttft_ms']:.1f} ms, on {on['mean_ttft_ms']:.1f} ms "
      f"(on/off {on['mean_ttft_ms'] / off['mean_ttft_ms']:.3f}); median off "
      f"{off['median_ttft_ms']:.1f}, on {on['median_ttft_ms']:.1f}")
PY
  grep "Remote decode" "$out/ttft-on-$round.txt"
done
stop_servers

echo "== 3. peak KV held for pickup, Poisson 2 req/s of 512 tokens, decode side late by D s"
for delay in 0 2 5; do
  serve 18614 peak-$delay.log --kv-export --kv-export-port 5713
  "$bin" bench serve --base-url http://127.0.0.1:18614 --num-prompts 40 --random-input-len 512 \
    --random-output-len 1 --request-rate 2 --seed 7 --remote-decode --remote-decode-delay "$delay" \
    --no-progress > "$out/peak-$delay.txt"
  echo "delay $delay s: $(grep 'Remote decode' "$out/peak-$delay.txt")"
  stop_servers
done
