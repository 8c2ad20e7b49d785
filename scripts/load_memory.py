#!/usr/bin/env python3
"""Peak host memory of loading a checkpoint straight to the device (`GpuModel::load`).

Writes (offline, standard library only) a checkpoint with Qwen3-30B-A3B's shape (hidden 2048,
128 experts of moe_intermediate_size 768, 32 query / 4 KV heads of 128, vocab 151936) but few
layers (2 by default: 3.5 GiB), random bf16 weights, then runs
`cargo run -p rackfill-models --features cuda --example load_gpu` on it (the host emulator,
the home experts of rank 0 of EP 1: every expert) and samples the process's /proc/<pid>/status
every 2 ms. Reports the peak RssAnon (private anonymous memory: what a host copy of the weights
would show; the checkpoint's memory map is RssFile and the emulator's device memory, shared
anonymous mappings, RssShmem) against the bound 2 x the largest tensor + 300 MB, and exits 1 when
it is above.

    python3 scripts/load_memory.py [--layers 2] [--dir /tmp/rackfill-load-memory] [--release]

On a GPU host, `--gpu` loads onto GPU 0 instead, and `--binary PATH` runs a load_gpu built
elsewhere (no cargo needed there).
"""

import argparse
import json
import os
import random
import struct
import subprocess
import sys
import time
from pathlib import Path

from shard_rss import tensor_shapes  # scripts/: the same Qwen3-MoE tensor list

ROOT = Path(__file__).resolve().parent.parent

HIDDEN, EXPERTS, MOE_INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2048, 128, 768, 32, 4, 128, 151936


def config(layers):
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 6144,
        "moe_intermediate_size": MOE_INTER,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "num_experts": EXPERTS,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def tensors(layers):
    """(name, shape) of every tensor, as transformers names Qwen3-MoE's."""
    return tensor_shapes(config(layers))


def size(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def write_checkpoint(directory, layers):
    """config.json and model.safetensors (bf16: norms 1, the rest N(0, 0.02) drawn from a 4 MiB
    pool of random values, each tensor starting at a random place in it)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config(layers), indent=2))
    rng = random.Random(0)
    pool = b"".join(
        struct.pack("<f", rng.gauss(0.0, 0.02))[2:] for _ in range(2 * 1024 * 1024)
    )
    ones = struct.pack("<f", 1.0)[2:] * HIDDEN
    header, offset = {}, 0
    shapes = tensors(layers)
    for name, shape in shapes:
        nbytes = 2 * size(shape)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path = directory / "model.safetensors"
    with open(path.with_suffix(".tmp"), "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, shape in shapes:
            nbytes = 2 * size(shape)
            if name.endswith("norm.weight"):
                f.write(ones[:nbytes])
                continue
            at = rng.randrange(len(pool) // 2) * 2
            while nbytes > 0:
                chunk = pool[at : at + nbytes]
                f.write(chunk)
                nbytes -= len(chunk)
                at = 0
    os.replace(path.with_suffix(".tmp"), path)
    return offset


def build(release):
    """Builds the example; returns its path."""
    cmd = ["cargo", "build", "-p", "rackfill-models", "--features", "cuda", "--example", "load_gpu",
           "--message-format=json"]
    if release:
        cmd.append("--release")
    out = subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True).stdout
    for line in out.splitlines():
        message = json.loads(line)
        if message.get("reason") == "compiler-artifact" and message["target"]["name"] == "load_gpu":
            return message["executable"]
    sys.exit("cargo did not report the load_gpu example")


def status(pid):
    """The kB fields of /proc/<pid>/status we track, or None once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "RssShmem", "VmRSS"):
            fields[key] = int(value.split()[0])
    return fields


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/rackfill-load-memory"))
    parser.add_argument("--release", action="store_true", help="build the example with --release")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    parser.add_argument("--gpu", action="store_true", help="load onto GPU 0, not the emulator")
    parser.add_argument("--binary", help="a load_gpu example built already (skips cargo)")
    args = parser.parse_args()

    directory = args.dir / f"qwen3-30b-a3b-shape-{args.layers}-layers"
    expected = sum(2 * size(s) for _, s in tensors(args.layers))
    weights = directory / "model.safetensors"
    if not weights.is_file() or weights.stat().st_size < expected:
        print(f"writing {expected / 2**30:.2f} GiB of bf16 weights to {directory} ...", flush=True)
        start = time.time()
        write_checkpoint(directory, args.layers)
        print(f"  {time.time() - start:.0f} s", flush=True)
    largest = max(2 * size(s) for _, s in tensors(args.layers))
    binary = args.binary or build(args.release)

    cmd = [binary, str(directory), "1", "0"] + (["--gpu"] if args.gpu else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    peak = {}
    samples = 0
    while proc.poll() is None:
        fields = status(proc.pid)
        if fields:
            samples += 1
            for key, value in fields.items():
                peak[key] = max(peak.get(key, 0), value)
        time.sleep(0.002)
    out = proc.stdout.read()
    if proc.returncode != 0:
        sys.exit(f"load_gpu failed ({proc.returncode}): {out}")
    result = json.loads(out.strip().splitlines()[-1])
    mb = 1e6
    bound = 2 * largest + 300 * mb
    anon = peak.get("RssAnon", 0) * 1024
    print(f"checkpoint: {expected / 2**30:.2f} GiB ({args.layers} layers), largest tensor "
          f"{largest / mb:.1f} MB")
    written = result["bytes_written"]
    written = "" if written is None else f", {written / 2**30:.2f} GiB written to the device"
    print(f"load: {result['seconds']:.1f} s on {result['device']}{written} "
          f"({result['home_expert_bytes'] / 2**30:.2f} GiB of home experts)")
    print(f"peak over {samples} samples: RssAnon {anon / mb:.1f} MB, RssFile "
          f"{peak.get('RssFile', 0) * 1024 / mb:.1f} MB, RssShmem "
          f"{peak.get('RssShmem', 0) * 1024 / mb:.1f} MB, VmRSS "
          f"{peak.get('VmRSS', 0) * 1024 / mb:.1f} MB")
    print(f"bound: 2 x largest tensor + 300 MB = {bound / mb:.1f} MB: "
          f"{'within' if anon <= bound else 'EXCEEDED'}")
    if not args.keep:
        for name in ("model.safetensors", "config.json"):
            (directory / name).unlink(missing_ok=True)
        directory.rmdir()
    sys.exit(0 if anon <= bound else 1)


if __name__ == "__main__":
    main()
