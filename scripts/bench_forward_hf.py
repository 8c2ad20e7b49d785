#!/usr/bin/env python3
"""Prefill tokens/s of HF transformers on the bench shape, side by side with `rackfill bench forward`.

With --device cuda both run on the GPU in bf16 (transformers: sdpa attention; rackfill: its
whole-model path, `bench forward --device cuda`), synchronised around every timed prefill.

Writes the issue's bench shape (Qwen3-MoE: hidden 1024, 4 layers, 16/4 heads of 64, 64 experts
top-8, moe_intermediate 256, vocab 32000) with seeded random weights (transformers' own init,
saved in bf16) to --dir, times transformers on it (float32, sdpa attention, --threads torch
threads, one warm-up then --repeats timed prefills per prompt length, median; last-position
logits only, as rackfill does), and, with --rackfill BIN, runs

    BIN bench forward --model DIR --tokens ... --repeats ... --json OUT

on the same checkpoint in the same round (rackfill first), round after round, so machine noise hits both.
Prints a table with the ratio and writes everything to --json.

    python3 scripts/bench_forward_hf.py --rackfill target/release/rackfill [--rounds 2]

With --model-shape qwen3-30b-a3b or deepseek-v3 (and --layers N), both build the real model's
shape with random weights where they run, no checkpoint on disk: rackfill runs first
(`bench forward --model-shape`), and its report's config.json is what transformers builds its
model from (`from_config`, bf16, on the GPU), so the two run the same shape. Only one model is
on the GPU at a time.

Needs torch, transformers, safetensors (not needed by CI).
"""

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

BENCH_SHAPE = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=64,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
)


def make_checkpoint(path, seed):
    if os.path.exists(os.path.join(path, "config.json")):
        return
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**BENCH_SHAPE)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(path)


def hf_model(path, config, dtype, device, seed):
    """The checkpoint at `path`, or a model of `config` (a config.json dict) with random weights."""
    if config is None:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device)
    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(**config)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")


def time_hf(path, lengths, repeats, threads, seed, device, config=None):
    torch.set_num_threads(threads)
    # On a GPU: bf16 weights and activations (what rackfill's --device cuda runs), else f32.
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = hf_model(path, config, dtype, device, seed)
    model.eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    results = []
    for n in lengths:
        ids = torch.randint(0, vocab, (1, n), generator=g).to(device)

        def once():
            if device != "cpu":
                torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.inference_mode():
                model(input_ids=ids, logits_to_keep=1)
            if device != "cpu":
                torch.cuda.synchronize()
            return time.perf_counter() - start

        once()
        seconds = [once() for _ in range(repeats)]
        results.append({"tokens": n, "tokens_per_s": n / statistics.median(seconds), "seconds": seconds})
    del model
    gc.collect()
    if device != "cpu":
        torch.cuda.empty_cache()
    return {"impl": "transformers", "device": device, "model": path if config is None else config["model_type"],
            "threads": threads, "torch": torch.__version__, "transformers": transformers.__version__,
            "results": results}


def time_rackfill(binary, path, lengths, repeats, seed, device, shape=None):
    """`shape`: (name, layers or None) for --model-shape, else the checkpoint at `path`."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        model = ["--model", path] if shape is None else ["--model-shape", shape[0]]
        if shape is not None and shape[1]:
            model += ["--layers", str(shape[1])]
        cmd = [binary, "bench", "forward", *model, "--tokens", ",".join(map(str, lengths)),
               "--repeats", str(repeats), "--seed", str(seed), "--json", out.name,
               "--device", device]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(out.name) as f:
            return json.load(f)


def print_summary(rounds, lengths):
    """Tokens/s over every timed run of every round: best (the least-disturbed run on a noisy
    machine) and median, with the rackfill / transformers ratio of each."""
    print(f"all {len(rounds)} rounds:")
    print(f"  {'tokens':>7} {'best: hf':>9} {'rackfill':>9} {'ratio':>6} {'median: hf':>11} {'rackfill':>9} {'ratio':>6}")
    for i, n in enumerate(lengths):
        stats = {}
        for impl in ("transformers", "rackfill"):
            seconds = [s for entry in rounds for s in entry[impl]["results"][i]["seconds"]]
            stats[impl] = (n / min(seconds), n / statistics.median(seconds))
        (hb, hm), (rb, rm) = stats["transformers"], stats["rackfill"]
        print(f"  {n:>7} {hb:>9.0f} {rb:>9.0f} {rb / hb:>5.2f}x {hm:>11.0f} {rm:>9.0f} {rm / hm:>5.2f}x")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "rackfill-bench-shape"),
                    help="where the bench-shape checkpoint is written (reused when present)")
    ap.add_argument("--tokens", default="512,2048,4096")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="alternating transformers/rackfill rounds")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rackfill", help="path of the rackfill binary to run side by side")
    ap.add_argument("--device", default="cpu",
                    help="cpu (f32, both) or cuda / cuda:N (bf16, both, on that GPU)")
    ap.add_argument("--model-shape", help="qwen3-30b-a3b or deepseek-v3: a real model's shape, random "
                    "weights on the device, no checkpoint (needs --rackfill)")
    ap.add_argument("--layers", type=int, help="with --model-shape: its first N decoder layers")
    ap.add_argument("--json", help="write all measurements here")
    args = ap.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]
    shape = (args.model_shape, args.layers) if args.model_shape else None
    if shape and not args.rackfill:
        ap.error("--model-shape needs --rackfill (rackfill's report gives the config)")

    if not shape:
        make_checkpoint(args.dir, args.seed)
    rounds = []
    for r in range(args.rounds):
        entry = {}
        if args.rackfill:
            entry["rackfill"] = time_rackfill(args.rackfill, args.dir, lengths, args.repeats, args.seed,
                                              args.device, shape)
        config = entry["rackfill"].get("config") if shape else None
        entry["transformers"] = time_hf(args.dir, lengths, args.repeats, args.threads, args.seed, args.device,
                                        config)
        rounds.append(entry)
        print(f"round {r}:")
        print(f"  {'tokens':>7} {'transformers tok/s':>19} {'rackfill tok/s':>15} {'ratio':>6}")
        for i, n in enumerate(lengths):
            hf = entry["transformers"]["results"][i]["tokens_per_s"]
            if args.rackfill:
                rf = entry["rackfill"]["results"][i]["tokens_per_s"]
                print(f"  {n:>7} {hf:>19.0f} {rf:>15.0f} {rf / hf:>5.2f}x")
            else:
                print(f"  {n:>7} {hf:>19.0f}")
        sys.stdout.flush()
    if args.rackfill:
        print_summary(rounds, lengths)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.model_shape or BENCH_SHAPE, "rounds": rounds}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
