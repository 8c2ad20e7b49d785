#!/usr/bin/env python3
"""Peak memory (VmHWM) of `rackfill serve` loading a checkpoint with many experts: one process
holding every EP rank (it loads every routed expert) against one process per rank under mpirun
(each loads only its ranks' home experts: sharded loading).

The checkpoint is generated here, offline and deterministically, as a real safetensors file
(Qwen3-MoE, bf16, by default 128 experts x 4 layers, hidden 512, moe_intermediate 256: ~0.4 GB
on disk, ~0.8 GB as f32) with the built-in model's tokenizer, so the script needs nothing beyond
the Python standard library and the binary.

Each server runs until its leader logs "listening" (the model is loaded and the engine started),
then until every process's VmHWM has stopped growing; the figures are read from
/proc/PID/status and the group is stopped (SIGTERM, then SIGKILL).

Usage (from the repository root, after `cargo build --release`):

    python3 scripts/shard_rss.py                       # single process, EP 4 and 8
    python3 scripts/shard_rss.py --mpi                 # also mpirun -np 4 and -np 8
    python3 scripts/shard_rss.py --model DIR --keep    # reuse / keep a generated checkpoint
    python3 scripts/shard_rss.py --json rss.json       # the figures as JSON too

Commands run:
    BINARY serve --model DIR --ep-size N --port 0
    mpirun --allow-run-as-root --oversubscribe -np N BINARY serve --model DIR --port 0
"""

import argparse
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILTIN = os.path.join(ROOT, "models", "builtin")
READY = "listening on http://"
VOCAB = 4096  # the built-in tokenizer's vocabulary


def config_json(experts, layers, hidden, moe_intermediate):
    """A Qwen3-MoE config.json of this shape (8 heads of 64, 4 KV heads, top-8)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": VOCAB,
        "hidden_size": hidden,
        "intermediate_size": 4 * hidden,
        "moe_intermediate_size": moe_intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "num_experts": experts,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    }


def tensor_shapes(cfg):
    """Every tensor of a Qwen3-MoE checkpoint of `cfg`, as (name, shape)."""
    h, v, e, i = (cfg["hidden_size"], cfg["vocab_size"], cfg["num_experts"],
                  cfg["moe_intermediate_size"])
    d = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = [("model.embed_tokens.weight", [v, h]), ("model.norm.weight", [h])]
    if not cfg.get("tie_word_embeddings", False):
        shapes.append(("lm_head.weight", [v, h]))
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        shapes += [
            (f"{p}.input_layernorm.weight", [h]),
            (f"{p}.post_attention_layernorm.weight", [h]),
            (f"{p}.self_attn.q_proj.weight", [q, h]),
            (f"{p}.self_attn.k_proj.weight", [kv, h]),
            (f"{p}.self_attn.v_proj.weight", [kv, h]),
            (f"{p}.self_attn.o_proj.weight", [h, q]),
            (f"{p}.self_attn.q_norm.weight", [d]),
            (f"{p}.self_attn.k_norm.weight", [d]),
            (f"{p}.mlp.gate.weight", [e, h]),
        ]
        for x in range(e):
            shapes += [
                (f"{p}.mlp.experts.{x}.gate_proj.weight", [i, h]),
                (f"{p}.mlp.experts.{x}.up_proj.weight", [i, h]),
                (f"{p}.mlp.experts.{x}.down_proj.weight", [h, i]),
            ]
    return shapes


# bf16 high byte: the random sign bit, exponent bits 7..1 = 60 (with the random low exponent
# bit, magnitudes in [2^-7, 2^-5)): finite weights of std ~0.02 from random bytes alone.
HIGH_BYTE = bytes((b & 0x80) | 60 for b in range(256))
BF16_ONE = struct.pack("<H", 0x3F80)


def tensor_bytes(rng, name, count):
    """bf16 bytes: norms 1, everything else small random values."""
    if name.endswith("norm.weight"):
        return BF16_ONE * count
    data = bytearray(rng.randbytes(2 * count))
    data[1::2] = bytes(data[1::2]).translate(HIGH_BYTE)
    return data


def write_checkpoint(out, experts, layers, hidden, moe_intermediate, seed=0):
    """config.json, model.safetensors (bf16) and the built-in tokenizer files in `out`."""
    os.makedirs(out, exist_ok=True)
    cfg = config_json(experts, layers, hidden, moe_intermediate)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(BUILTIN, name), os.path.join(out, name))
    shapes = tensor_shapes(cfg)
    header, offset = {}, 0
    for name, shape in shapes:
        size = 2 * prod(shape)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    rng = random.Random(seed)
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape in shapes:
            f.write(tensor_bytes(rng, name, prod(shape)))
    return cfg


def prod(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def status(pid):
    """VmHWM and VmRSS of `pid` in KiB (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["VmHWM"].split()[0]), int(fields["VmRSS"].split()[0])
    except (OSError, KeyError, ValueError):
        return None


def descendants(root):
    """Every live process below `root`, as {pid: parent}."""
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = ppid
                frontier.append(pid)
    return found


def rank_processes(root, binary):
    """The processes at or below `root` running `binary`."""
    real = os.path.realpath(binary)
    pids = [root] + sorted(descendants(root))
    out = []
    for pid in pids:
        try:
            if os.path.realpath(f"/proc/{pid}/exe") == real:
                out.append(pid)
        except OSError:
            continue
    return out


def run_until_loaded(command, binary, expected, timeout):
    """Starts `command`, waits for READY in its output and for `expected` processes of `binary`
    whose peak memory has settled; returns [(pid, hwm_kib, rss_kib)] and the output's tail."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines, ready = [], threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line.rstrip())
            if READY in line:
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.time() + timeout
    try:
        while not ready.is_set():
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(
                    f"{' '.join(command)}: never listened (exit {proc.poll()}):\n"
                    + "\n".join(lines[-20:]))
            time.sleep(0.2)
        last, steady, figures = None, 0, []
        while steady < 4 and time.time() < deadline:
            pids = rank_processes(proc.pid, binary)
            figures = [(pid, *status(pid)) for pid in pids if status(pid)]
            key = [(pid, hwm) for pid, hwm, _ in figures]
            steady = steady + 1 if key == last and len(figures) == expected else 0
            last = key
            time.sleep(0.5)
        if len(figures) != expected:
            raise RuntimeError(f"{' '.join(command)}: {len(figures)} processes of {binary}, "
                               f"expected {expected}")
        return figures, lines[-5:]
    finally:
        stop(proc)


def stop(proc):
    """SIGTERM to the whole session, SIGKILL after 30 s."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue


def mib(kib):
    return kib / 1024


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--binary", default=os.path.join(ROOT, "target/release/rackfill"))
    parser.add_argument("--model", help="checkpoint directory: used if it holds model.safetensors, "
                        "else generated there (and kept)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the checkpoint generated without --model (its path is printed)")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--moe-intermediate", type=int, default=256)
    parser.add_argument("--ep", default="4,8", help="EP sizes (comma list)")
    parser.add_argument("--mpi", action="store_true", help="also run one process per rank")
    parser.add_argument("--mpirun", default="mpirun")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per server start")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()

    binary = os.path.abspath(args.binary)
    if not os.access(binary, os.X_OK):
        sys.exit(f"{binary}: not an executable (cargo build --release first)")
    if args.mpi and shutil.which(args.mpirun) is None:
        sys.exit(f"--mpi: {args.mpirun} not found (apt-get install openmpi-bin)")
    ep_sizes = [int(x) for x in args.ep.split(",")]

    temporary = None
    model = args.model
    if model is None or not os.path.isfile(os.path.join(model, "model.safetensors")):
        if model is None:
            temporary = tempfile.mkdtemp(prefix="rackfill-shard-rss-")
            model = temporary
        started = time.time()
        write_checkpoint(model, args.experts, args.layers, args.hidden, args.moe_intermediate)
        size = os.path.getsize(os.path.join(model, "model.safetensors"))
        print(f"wrote {model}/model.safetensors: {size / 2**20:.0f} MiB bf16 "
              f"({args.experts} experts x {args.layers} layers, hidden {args.hidden}, "
              f"moe_intermediate {args.moe_intermediate}) in {time.time() - started:.1f} s",
              flush=True)
    rows = []
    try:
        for ep in ep_sizes:
            command = [binary, "serve", "--model", model, "--ep-size", str(ep), "--port", "0"]
            figures, _ = run_until_loaded(command, binary, 1, args.timeout)
            rows.append({"mode": "single process", "ep": ep, "command": " ".join(command),
                         "processes": [{"pid": p, "vm_hwm_kib": h, "vm_rss_kib": r}
                                       for p, h, r in figures]})
            print(f"single process, --ep-size {ep}: VmHWM {mib(figures[0][1]):.0f} MiB", flush=True)
            if args.mpi:
                command = [args.mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(ep),
                           binary, "serve", "--model", model, "--port", "0"]
                figures, _ = run_until_loaded(command, binary, ep, args.timeout)
                rows.append({"mode": "mpirun", "ep": ep, "command": " ".join(command),
                             "processes": [{"pid": p, "vm_hwm_kib": h, "vm_rss_kib": r}
                                           for p, h, r in figures]})
                hwms = [h for _, h, _ in figures]
                print(f"mpirun -np {ep}: VmHWM per process {mib(min(hwms)):.0f}-"
                      f"{mib(max(hwms)):.0f} MiB", flush=True)
    finally:
        if temporary and not args.keep:
            shutil.rmtree(temporary, ignore_errors=True)
        elif temporary:
            print(f"kept the checkpoint in {temporary}")

    print()
    print("| mode | EP | processes | VmHWM per process (MiB) | of the single process |")
    print("|:--|--:|--:|--:|--:|")
    single = {r["ep"]: r["processes"][0]["vm_hwm_kib"] for r in rows if r["mode"] != "mpirun"}
    for r in rows:
        hwms = [p["vm_hwm_kib"] for p in r["processes"]]
        span = (f"{mib(max(hwms)):.0f}" if min(hwms) == max(hwms)
                else f"{mib(min(hwms)):.0f}-{mib(max(hwms)):.0f}")
        ratio = max(hwms) / single[r["ep"]]
        print(f"| {r['mode']} | {r['ep']} | {len(hwms)} | {span} | {ratio:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": {"experts": args.experts, "layers": args.layers,
                                 "hidden": args.hidden, "moe_intermediate": args.moe_intermediate}
                       if args.model is None else args.model, "runs": rows}, f, indent=2)


if __name__ == "__main__":
    main()
