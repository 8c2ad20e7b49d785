#!/usr/bin/env python3
"""One process holding every EP rank against one process per rank under mpirun, side by side in
one run, on the same model and the same `rackfill bench serve` workload:

    python3 scripts/mpi_bench.py [--binary target/release/rackfill] [--np 4] [--model SPEC]
        [--num-prompts 256] [--input-len 256] [--output-len 16] [--rounds 2] [--json out.json]

For each layout it starts the server (`rackfill serve --ep-size N`, then
`mpirun -np N rackfill serve`), runs the same closed-loop workload (`bench serve`, all prompts
at once, `--ignore-eos`), and reads from the leader's /metrics and /proc:

- tokens/s (prefill + decode tokens computed over the run) and requests/s from bench serve;
- engine steps and mean step time (`rackfill:step_seconds`);
- bytes the fabric delivered between ranks (`rackfill:fabric_received_bytes`): the in-process
  fabric copies between rank buffers, MPI moves the same payloads between processes;
- peak memory (VmHWM) of every process.

Rounds alternate the two layouts, so drift on a noisy machine hits both alike. Needs the binary
built with `--features mpi`, `mpirun` (OpenMPI) and nothing else.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request


def wait_listening(proc, log_path, timeout=300):
    started = time.time()
    while time.time() - started < timeout:
        text = open(log_path, errors="replace").read()
        m = re.search(r"rackfill listening on http://[0-9.]+:(\d+)", text)
        if m:
            return int(m.group(1)), text
        if proc.poll() is not None:
            sys.exit(f"mpi bench: the server exited:\n{text}")
        time.sleep(0.1)
    sys.exit("mpi bench: the server did not start")


def metrics(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        try:
            values[name] = float(value)
        except ValueError:
            pass
    return values


def vm_hwm_mib(pid):
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def rank_pids(log, np_):
    pids = []
    for rank in range(np_):
        m = re.search(rf"rank {rank} of {np_} \(pid (\d+)\)", log)
        pids.append(int(m.group(1)) if m else None)
    return pids


def run_layout(args, layout):
    log = tempfile.NamedTemporaryFile(prefix=f"rackfill-mpibench-{layout}-", suffix=".log", delete=False)
    serve = [args.binary, "serve", "--port", "0", "--model", args.model,
             "--max-waiting", "4096", "--max-concurrent-requests", "4096"]
    if layout == "one process":
        cmd = serve + ["--ep-size", str(args.np)]
    else:
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
               "-np", str(args.np)] + serve
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "RUST_LOG": "info"})
    try:
        port, text = wait_listening(proc, log.name)
        pids = [proc.pid] if layout == "one process" else rank_pids(text, args.np)
        before = metrics(port)
        out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
        subprocess.run(
            [args.binary, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
             "--num-prompts", str(args.num_prompts), "--random-input-len", str(args.input_len),
             "--random-output-len", str(args.output_len), "--ignore-eos", "--request-rate", "inf",
             "--output", out, "--no-progress"],
            check=True, stdout=subprocess.DEVNULL)
        bench = json.load(open(out))
        bench = bench[0] if isinstance(bench, list) else bench
        after = metrics(port)
        delta = lambda k: after.get(k, 0.0) - before.get(k, 0.0)
        steps = delta("rackfill:steps_total")
        tokens = delta("rackfill:step_tokens_sum")
        result = {
            "layout": layout,
            "completed": bench["completed"],
            "failed": bench["failed"],
            "duration_s": bench["duration"],
            "tokens_per_s": tokens / bench["duration"],
            "requests_per_s": bench["request_throughput"],
            "mean_ttft_ms": bench["mean_ttft_ms"],
            "steps": steps,
            "mean_step_ms": 1000 * delta("rackfill:step_seconds_sum") / max(steps, 1),
            "fabric_bytes": delta("rackfill:fabric_received_bytes"),
            "vm_hwm_mib": [vm_hwm_mib(pid) for pid in pids],
        }
    finally:
        if layout == "one process":
            proc.send_signal(signal.SIGTERM)
        else:
            leader = rank_pids(open(log.name).read(), args.np)[0]
            if leader:
                os.kill(leader, signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    if proc.returncode != 0:
        sys.exit(f"mpi bench: {layout} exited {proc.returncode}:\n{open(log.name).read()[-3000:]}")
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", default="target/release/rackfill")
    ap.add_argument("--model", default="rackfill-tiny-moe")
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    runs = []
    for _ in range(args.rounds):
        for layout in ["one process", f"mpirun -np {args.np}"]:
            runs.append(run_layout(args, layout))
            r = runs[-1]
            hwm = ", ".join(f"{m:.0f}" for m in r["vm_hwm_mib"] if m is not None)
            print(f"{r['layout']:>14}: {r['tokens_per_s']:8.0f} tok/s  {r['requests_per_s']:6.2f} req/s  "
                  f"{r['steps']:5.0f} steps of {r['mean_step_ms']:7.1f} ms  "
                  f"fabric {r['fabric_bytes'] / 1e6:8.2f} MB  VmHWM MiB [{hwm}]", flush=True)
    one = [r for r in runs if r["layout"] == "one process"]
    many = [r for r in runs if r["layout"] != "one process"]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)
    print(f"mpirun -np {args.np} / one process: tokens/s x{mean(many, 'tokens_per_s') / mean(one, 'tokens_per_s'):.2f}, "
          f"step time x{mean(many, 'mean_step_ms') / mean(one, 'mean_step_ms'):.2f}, "
          f"fabric bytes x{mean(many, 'fabric_bytes') / max(mean(one, 'fabric_bytes'), 1):.3f}")
    if args.json:
        json.dump(runs, open(args.json, "w"), indent=2)


if __name__ == "__main__":
    main()
