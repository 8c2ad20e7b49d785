#!/usr/bin/env bash
# Runs on a GPU host, in the repository root, with a bundle from scripts/gpu_bundle.sh: every
# executor test binary with a missing GPU made a failure (RACKFILL_REQUIRE_GPU=1), then the
# figures docs record. Writes to ${OUT:-target/gpu-session}: device.txt, tests.log,
# kernels-bench.txt; serve-*.txt and serve-bench.json (a generated Qwen3-30B-A3B-shaped
# checkpoint served with the defaults: device memory and prompt tokens/s); load-memory.txt;
# bench-forward-*.txt/json (the bench shape, Qwen3-30B-A3B's and DeepSeek-V3's first layers at
# real size, and transformers beside rackfill where torch runs), bench-attention.txt/json (every
# flash tile shape, 512 to 16k tokens, against cuBLAS + softmax + cuBLAS); sanitizer-*.txt; and
# DATE-CARD.md, the run's summary (scripts/gpu_report.py), also written to docs/gpu-runs/.
# Exits non-zero if any test binary, a benchmark, the serve check or a sanitizer run failed.
#
# RACKFILL_SESSION_STEPS picks the steps, in order (default: every one):
#   tests kernels serve group forward attention sanitizer
# `group` (bundles with rackfill-mpi): four ranks in four processes on one GPU under the
# bundled mpirun, their MoE layers crossing processes through peer memory (CUDA IPC) and through
# host buffers (`--moe-transport host`), beside one process holding all four ranks: prompt
# tokens/s and the MoE phases' device time (group-*.txt, group-bench-*.json).
# The speed set of issue 33 alone, within 8 minutes: RACKFILL_SESSION_STEPS="attention forward".
# RACKFILL_SESSION_QWEN_LAYERS (default 48, the whole model: 61 GB on the device) and
# RACKFILL_SESSION_DEEPSEEK_LAYERS (default 4: 3 dense layers and one MoE layer, 30 GB).
# Time bounds, for short leases: RACKFILL_SESSION_TEST_S (each test binary, default 300 s; a
# timeout counts as a failure), RACKFILL_SESSION_SANITIZER_S (each sanitizer tool, default
# 240 s), RACKFILL_SESSION_SANITIZERS (default memcheck racecheck synccheck); the serve check's
# checkpoint has RACKFILL_SESSION_LAYERS layers (default 4: about 5.7 GiB).
set -uo pipefail
cd "$(dirname "$0")/.."
bundle=$(mktemp -d)
tar -C "$bundle" -xJf "${1:-.gpu-bundle}/bundle.tar.xz" || exit 1
out=${OUT:-target/gpu-session}
mkdir -p "$out"
root=$(cat "$bundle/root")
if [ "$root" != "$PWD" ] && [ ! -e "$root" ]; then
  mkdir -p "$(dirname "$root")" && ln -s "$PWD" "$root"
fi
export RACKFILL_REQUIRE_GPU=1
steps=${RACKFILL_SESSION_STEPS:-tests kernels serve group forward attention sanitizer}
has() { [[ " $steps " == *" $1 "* ]]; }
# Waits up to 2 minutes for the server on port $1 (process $2) to answer /health.
wait_healthy() {
  for _ in $(seq 1 240); do
    curl -fsS "http://127.0.0.1:$1/health" > /dev/null 2>&1 && return
    kill -0 "$2" 2>/dev/null || return
    sleep 0.5
  done
}
{ nvidia-smi -L; "$bundle/rackfill" kernels probe; } 2>&1 | tee "$out/device.txt"
failed=()

if has tests; then
  for t in "$bundle"/tests/*; do
    echo "== $(basename "$t")" | tee -a "$out/tests.log"
    # ep_equivalence: its device tests only (the rest runs on the CPU, as in CI).
    filter=()
    [[ "$(basename "$t")" == ep_equivalence-* ]] && filter=(device)
    timeout "${RACKFILL_SESSION_TEST_S:-300}" "$t" --test-threads 1 "${filter[@]}" 2>&1 | tee -a "$out/tests.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("$(basename "$t")")
  done
fi

if has kernels; then
  "$bundle/rackfill" kernels bench --reps 50 --expert-bytes 8388608 2>&1 | tee "$out/kernels-bench.txt"
fi

if has serve; then
  # A Qwen3-30B-A3B-shaped checkpoint (random bf16 weights, few layers), loaded straight to the
  # GPU (peak host memory measured), then served with the defaults (--device auto: the GPU, EP 8,
  # quota, the ultraep schedule) and driven by bench serve: prompt tokens/s and device memory.
  layers=${RACKFILL_SESSION_LAYERS:-4}
  dir=/tmp/rackfill-session/qwen3-30b-a3b-shape-$layers-layers
  python3 scripts/load_memory.py --layers "$layers" --dir /tmp/rackfill-session --keep --gpu \
    --binary "$bundle/load_gpu" 2>&1 | tee "$out/load-memory.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("load-memory")
  cp models/builtin/tokenizer.json models/builtin/tokenizer_config.json "$dir/"
  port=18520
  "$bundle/rackfill" serve --model "$dir" --port "$port" > "$out/serve-log.txt" 2>&1 &
  server=$!
  wait_healthy "$port" "$server"
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv | tee "$out/serve-memory.txt"
  for len in 512 2048; do
    "$bundle/rackfill" bench serve --base-url "http://127.0.0.1:$port" --num-prompts 64 \
      --random-input-len "$len" --random-output-len 1 --ignore-eos --request-rate inf \
      --max-concurrency 32 --output "$out/serve-bench-$len.json" --no-progress 2>&1 \
      | tee "$out/serve-bench-$len.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("serve-bench-$len")
  done
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv | tee -a "$out/serve-memory.txt"
  kill -TERM "$server"
  wait "$server" || failed+=("serve")
  tail -5 "$out/serve-log.txt"
fi

if has group && [ -x "$bundle/rackfill-mpi" ]; then
  # Peer memory across processes on one GPU (CUDA IPC; NCCL refuses two ranks on one GPU): the
  # same checkpoint as `serve`, EP 4, served by one process holding every rank (`device`), by
  # four processes over peer memory (`peer`) and over host buffers and MPI (`host`).
  # shellcheck source=/dev/null
  source "$bundle/mpi/env.sh"
  layers=${RACKFILL_SESSION_LAYERS:-4}
  dir=/tmp/rackfill-session/qwen3-30b-a3b-shape-$layers-layers
  if [ ! -e "$dir/config.json" ]; then
    python3 scripts/load_memory.py --layers "$layers" --dir /tmp/rackfill-session --keep --gpu \
      --binary "$bundle/load_gpu" > /dev/null 2>&1
    cp models/builtin/tokenizer.json models/builtin/tokenizer_config.json "$dir/"
  fi
  port=18530
  for round in 1 2; do
    for mode in device peer host; do
      log="$out/group-$mode-serve.txt"
      if [ "$mode" = device ]; then
        "$bundle/rackfill" serve --model "$dir" --ep-size 4 --port "$port" > "$log" 2>&1 &
      else
        mpirun --allow-run-as-root --oversubscribe --bind-to none -np 4 "$bundle/rackfill-mpi" serve \
          --model "$dir" --device cuda --moe-transport "$mode" --port "$port" > "$log" 2>&1 &
      fi
      server=$!
      wait_healthy "$port" "$server"
      # One scored prompt (echo, logprobs): the three paths must agree (group-completion-*.json).
      curl -s "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' -d \
        '{"prompt": "The quick brown fox jumps over the lazy dog while the experts are streamed", "max_tokens": 4, "temperature": 0, "echo": true, "logprobs": 1}' \
        > "$out/group-completion-$mode.json"
      "$bundle/rackfill" bench serve --base-url "http://127.0.0.1:$port" --num-prompts 64 \
        --random-input-len 2048 --random-output-len 1 --ignore-eos --request-rate inf \
        --max-concurrency 32 --output "$out/group-bench-$mode.json" --no-progress > /dev/null 2>&1 \
        || failed+=("group-$mode")
      python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('round $round $mode', round(r['input_throughput']), 'tok/s, mean TTFT', round(r['mean_ttft_ms'], 1), 'ms,', r['completed'], 'completed')" \
        "$out/group-bench-$mode.json" 2>&1 | tee -a "$out/group.txt"
      curl -s "http://127.0.0.1:$port/metrics" | grep -E 'moe_data_path\{|moe_phase_seconds_(sum|count)|fabric_received_bytes |moe_replica_bytes_total|moe_layers_total' \
        | sed "s/^/round $round $mode /" >> "$out/group.txt"
      grep -m4 "MoE data path" "$log" | sed "s/^/round $round $mode /" >> "$out/group.txt"
      kill -TERM "$server"
      # mpirun ends its ranks on SIGTERM without a drain (a known limit): only one process's
      # exit status counts.
      if [ "$mode" = device ]; then wait "$server" || failed+=("group-device-exit"); else wait "$server"; fi
      sleep 1
    done
  done
fi

if has attention; then
  # Every flash tile shape against cuBLAS + softmax + cuBLAS on Qwen3-30B-A3B's attention (32
  # query heads, 4 KV heads, head_dim 128), causal chunks of 512 to 16k tokens, and a 2k chunk
  # over 8k cached tokens; then DeepSeek-V3's absorbed latent through the whole-model bench.
  "$bundle/rackfill" bench attention --device cuda --chunk 512,1024,2048,4096,8192,16384 --repeats 10 \
    --json "$out/bench-attention.json" 2>&1 | tee "$out/bench-attention.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("bench-attention")
  "$bundle/rackfill" bench attention --device cuda --context 8192 --chunk 2048 --repeats 10 \
    --json "$out/bench-attention-context.json" 2>&1 | tee "$out/bench-attention-context.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("bench-attention-context")
fi

if has forward; then
  # The whole model on the GPU (bf16): the bench shape, then Qwen3-30B-A3B (all 48 layers by
  # default) and DeepSeek-V3's first layers at real size with weights generated on the device:
  # tokens/s, model FLOP utilisation, time per phase. transformers in bf16 beside rackfill on the
  # same shapes where torch with CUDA is installed.
  "$bundle/rackfill" bench forward --device cuda --tokens 512,2048,4096 --repeats 5 \
    --json "$out/bench-forward-cuda.json" 2>&1 | tee "$out/bench-forward-cuda.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("bench-forward")
  qwen_layers=${RACKFILL_SESSION_QWEN_LAYERS:-48}
  deepseek_layers=${RACKFILL_SESSION_DEEPSEEK_LAYERS:-4}
  "$bundle/rackfill" bench forward --device cuda --model-shape qwen3-30b-a3b --layers "$qwen_layers" \
    --tokens 2048,4096,8192,16384 --repeats 3 --json "$out/bench-forward-qwen3.json" 2>&1 \
    | tee "$out/bench-forward-qwen3.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("bench-forward-qwen3")
  # The grouped expert kernels against one cuBLAS GEMM pair per expert, same model, 8k tokens.
  "$bundle/rackfill" bench forward --device cuda --model-shape qwen3-30b-a3b --layers "$qwen_layers" \
    --tokens 8192 --repeats 2 --expert-gemms per-expert --json "$out/bench-forward-qwen3-per-expert.json" \
    2>&1 | tee "$out/bench-forward-qwen3-per-expert.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("bench-forward-qwen3-per-expert")
  "$bundle/rackfill" bench forward --device cuda --model-shape deepseek-v3 --layers "$deepseek_layers" \
    --tokens 2048,8192 --repeats 3 --json "$out/bench-forward-deepseek.json" 2>&1 \
    | tee "$out/bench-forward-deepseek.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("bench-forward-deepseek")
  if python3 -c "import torch, transformers, safetensors; assert torch.cuda.is_available()" 2>/dev/null; then
    python3 scripts/bench_forward_hf.py --device cuda --rackfill "$bundle/rackfill" --repeats 5 \
      --json "$out/bench-forward-hf-cuda.json" 2>&1 | tee "$out/bench-forward-hf-cuda.txt"
    python3 scripts/bench_forward_hf.py --device cuda --rackfill "$bundle/rackfill" --repeats 2 \
      --model-shape qwen3-30b-a3b --layers "$qwen_layers" --tokens 2048,8192 \
      --json "$out/bench-forward-hf-qwen3.json" 2>&1 | tee "$out/bench-forward-hf-qwen3.txt"
  else
    echo "torch with CUDA or transformers missing: no transformers comparison" | tee -a "$out/bench-forward-cuda.txt"
  fi
fi

if has sanitizer; then
  # What the emulator cannot show (cp.async, concurrent blocks, cross-block memory ordering,
  # barriers): the tile-streaming tests under compute-sanitizer, when the host has it. Time-bounded;
  # a timeout is reported, not counted as a failure. The sanitizers slow kernels many times over,
  # so a relay wait gets a minute before tile_stream calls the stream broken.
  sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
  kernels=$(ls "$bundle"/tests/device_kernels-* 2>/dev/null | head -1)
  sanitizer_s=${RACKFILL_SESSION_SANITIZER_S:-240}
  if [ -n "$sanitizer" ] && [ -n "$kernels" ] && [ "$sanitizer_s" -gt 0 ]; then
    for tool in ${RACKFILL_SESSION_SANITIZERS:-memcheck racecheck synccheck}; do
      RACKFILL_TILE_STALL_MS=60000 timeout "$sanitizer_s" "$sanitizer" --tool "$tool" --error-exitcode 3 \
        "$kernels" --test-threads 1 tiles:: > "$out/sanitizer-$tool.txt" 2>&1
      status=$?
      echo "compute-sanitizer --tool $tool: exit $status$([ $status -eq 124 ] && echo ' (timed out)')" \
        | tee -a "$out/tests.log"
      [ "$status" -eq 0 ] || [ "$status" -eq 124 ] || failed+=("sanitizer-$tool")
    done
  else
    echo "compute-sanitizer not found or RACKFILL_SESSION_SANITIZER_S=0: the sanitizer runs are skipped" | tee -a "$out/tests.log"
  fi
fi

# The run's summary: figures with the card's name, beside the raw files.
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
python3 scripts/gpu_report.py "$out" --card "${card:-unknown GPU}" --failed "${failed[*]:-}" \
  --docs docs/gpu-runs 2>&1 | tail -2

if [ "${#failed[@]}" -ne 0 ]; then
  echo "failed: ${failed[*]}" | tee -a "$out/tests.log"
  exit 1
fi
