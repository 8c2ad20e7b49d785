#!/usr/bin/env bash
# Runs on a GPU host, in the repository root, with a bundle from scripts/gpu_bundle.sh: every
# CUDA test binary with a missing GPU made a failure (RACKFILL_REQUIRE_GPU=1), then the figures
# docs/gpu.md records, then the tile-streaming tests under compute-sanitizer. Writes device.txt,
# tests.log, kernels-bench.txt, bench-ep.txt and sanitizer-*.txt to ${OUT:-target/gpu-session};
# bench-forward-cuda.txt (and bench-forward-hf-cuda.txt where torch runs), bench-attention.txt;
# exits non-zero if any test binary or sanitizer run failed.
# Time bounds, for short leases: RACKFILL_SESSION_TEST_S (each test binary, default 300 s; a
# timeout counts as a failure) and RACKFILL_SESSION_SANITIZER_S (each sanitizer tool, default 240 s;
# 0 skips them); RACKFILL_SESSION_SANITIZERS lists the tools (default memcheck racecheck synccheck).
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
{ nvidia-smi -L; "$bundle/rackfill" kernels probe; } 2>&1 | tee "$out/device.txt"
failed=()
for t in "$bundle"/tests/*; do
  echo "== $(basename "$t")" | tee -a "$out/tests.log"
  timeout "${RACKFILL_SESSION_TEST_S:-300}" "$t" --test-threads 1 2>&1 | tee -a "$out/tests.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("$(basename "$t")")
done
"$bundle/rackfill" kernels bench --reps 50 --expert-bytes 8388608 2>&1 | tee "$out/kernels-bench.txt"
"$bundle/rackfill" bench ep --model rackfill-tiny-moe --prompts models/builtin/skew.json --ep-size 8 \
  --balancer quota,none --data-plane cpu,gpu 2>&1 | tee "$out/bench-ep.txt"
# The whole model on the GPU (bf16): prefill tokens/s of the bench shape, and beside it
# transformers in bf16 on the same GPU and checkpoint where torch with CUDA is installed.
"$bundle/rackfill" bench forward --device cuda --tokens 512,2048,4096 --repeats 5 \
  --json "$out/bench-forward-cuda.json" 2>&1 | tee "$out/bench-forward-cuda.txt"
if python3 -c "import torch, transformers, safetensors; assert torch.cuda.is_available()" 2>/dev/null; then
  python3 scripts/bench_forward_hf.py --device cuda --rackfill "$bundle/rackfill" --repeats 5 \
    --json "$out/bench-forward-hf-cuda.json" 2>&1 | tee "$out/bench-forward-hf-cuda.txt"
else
  echo "torch with CUDA or transformers missing: no transformers comparison" | tee -a "$out/bench-forward-cuda.txt"
fi
# The fused paged attention kernel against cuBLAS + softmax + cuBLAS on Qwen3-30B-A3B's attention
# shape (32 query heads, 4 KV heads, head_dim 128), 2048-token chunks over 0, 2048 and 6144 cached.
"$bundle/rackfill" bench attention --device cuda --context 0,2048,6144 --chunk 2048 --repeats 20 \
  --json "$out/bench-attention.json" 2>&1 | tee "$out/bench-attention.txt"
# What the emulator cannot show (cp.async, concurrent blocks, cross-block memory ordering,
# barriers): the tile-streaming and relay-planner GPU tests under compute-sanitizer, when the
# host has it. Last and time-bounded, so the figures above never wait on it; a timeout is
# reported, not counted as a failure. The sanitizers slow kernels many times over, so a relay wait
# gets a minute before tile_stream calls the stream broken (RACKFILL_TILE_STALL_MS; default 5 s).
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
replicate=$(ls "$bundle"/tests/cuda_replicate-* 2>/dev/null | head -1)
sanitizer_s=${RACKFILL_SESSION_SANITIZER_S:-240}
if [ -n "$sanitizer" ] && [ -n "$replicate" ] && [ "$sanitizer_s" -gt 0 ]; then
  for tool in ${RACKFILL_SESSION_SANITIZERS:-memcheck racecheck synccheck}; do
    RACKFILL_TILE_STALL_MS=60000 timeout "$sanitizer_s" "$sanitizer" --tool "$tool" --error-exitcode 3 "$replicate" --test-threads 1 gpu_ \
      > "$out/sanitizer-$tool.txt" 2>&1
    status=$?
    echo "compute-sanitizer --tool $tool: exit $status$([ $status -eq 124 ] && echo ' (timed out)')" \
      | tee -a "$out/tests.log"
    [ "$status" -eq 0 ] || [ "$status" -eq 124 ] || failed+=("sanitizer-$tool")
  done
else
  echo "compute-sanitizer not found or RACKFILL_SESSION_SANITIZER_S=0: the sanitizer runs are skipped" | tee -a "$out/tests.log"
fi
if [ "${#failed[@]}" -ne 0 ]; then
  echo "failed test binaries: ${failed[*]}" | tee -a "$out/tests.log"
  exit 1
fi
