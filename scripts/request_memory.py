#!/usr/bin/env python3
"""Peak memory of `rackfill serve` under the costly requests of issue 20: one 4 MiB text prompt,
eight at once, one 24 MB prompt with the body limit raised, and 256 prompts of 4000 token ids
in one request.

    python3 scripts/request_memory.py [--wait 60] BINARY [BINARY...]

Every case runs on a fresh server (the built-in model, a free loopback port), so the server's
VmHWM (from /proc/PID/status, read once the case's responses are in or `--wait` seconds passed)
is that case's peak. Prints one row per binary and case: the statuses, the seconds until the
last response (or `>WAIT` when it had not come), and the peak resident memory in MB; `idle` is a
server that answered only its health check. Loopback only; needs nothing beyond Python 3.
"""

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

SENTENCE = "The quick brown fox jumps over the lazy dog. "


def text_of(n):
    return (SENTENCE * (n // len(SENTENCE) + 1))[:n]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vm_hwm_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def post(port, body, wait, out, i):
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=wait)
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        out[i] = response.status
    except Exception:  # a timeout: the request still runs
        out[i] = None


def start(binary, port, extra):
    server = subprocess.Popen(
        [binary, "serve", "--port", str(port), *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return server
        except OSError:
            pass
        time.sleep(0.2)
    server.kill()
    sys.exit(f"request_memory: {binary} did not become healthy on port {port}")


def stop(server):
    server.send_signal(signal.SIGINT)
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def run_case(binary, name, bodies, extra, wait):
    port = free_port()
    server = start(binary, port, extra)
    statuses = [None] * len(bodies)
    threads = [
        threading.Thread(target=post, args=(port, body, wait, statuses, i), daemon=True)
        for i, body in enumerate(bodies)
    ]
    began = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.0, wait - (time.time() - began)))
    seconds = time.time() - began
    done = all(s is not None for s in statuses)
    peak = vm_hwm_mb(server.pid)
    stop(server)
    shown = ",".join(sorted({str(s) if s is not None else "pending" for s in statuses}))
    elapsed = f"{seconds:.1f}" if done else f">{wait:.0f}"
    print(f"{os.path.basename(os.path.dirname(binary)) or binary:>10}  {name:<28} {shown:<10} {elapsed:>7} s  {peak:8.0f} MB", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binaries", nargs="+")
    ap.add_argument("--wait", type=float, default=60.0, help="seconds to wait for a case's responses")
    args = ap.parse_args()
    four_mib = json.dumps({"prompt": text_of((4 << 20) - 64), "max_tokens": 16}).encode()
    huge = json.dumps({"prompt": text_of(24_000_000), "max_tokens": 16}).encode()
    ids = json.dumps({"prompt": [[5] * 4000] * 256, "max_tokens": 16}, separators=(",", ":")).encode()
    cases = [
        ("idle", [], []),
        ("one 4 MiB prompt", [four_mib], []),
        ("eight 4 MiB prompts at once", [four_mib] * 8, []),
        ("one 24 MB prompt", [huge], ["--max-body-bytes", str(32 << 20)]),
        ("256 x 4000 token ids", [ids], []),
    ]
    print(f"{'binary':>10}  {'case':<28} {'status':<10} {'time':>9}  {'VmHWM':>11}")
    for binary in args.binaries:
        for name, bodies, extra in cases:
            run_case(os.path.abspath(binary), name, bodies, extra, args.wait)


if __name__ == "__main__":
    main()
