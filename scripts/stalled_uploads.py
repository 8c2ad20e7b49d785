#!/usr/bin/env python3
"""Server memory under stalled uploads: many connections each announce and send a large
completion body, all but its last byte, and stall.

    python3 scripts/stalled_uploads.py --binary target/release/rackfill \\
        [--connections 200] [--body-mib 4] [--key none|wrong|right]

Starts `BINARY serve --port P --api-key K` on a free loopback port (the built-in model), waits
for /health, opens the connections (Authorization: none, a wrong key or the right one), waits
until every upload was sent or the server stopped reading it, and prints the server's VmRSS
before and after and its VmHWM (peak), from /proc/PID/status, plus how many uploads the server
answered before their body was complete (a 401 from the head alone). Then it closes everything
and stops the server. Linux only.
"""

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

KEY = "stalled-uploads-key"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status_kib(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/{pid}/status")


def wait_healthy(port, server, seconds=120):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if server.poll() is not None:
            sys.exit(f"stalled uploads: the server exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    sys.exit("stalled uploads: the server never became healthy")


def upload(port, body_bytes, key, sockets, answered, lock):
    """Sends the head and all but the last byte of the body, then keeps the socket open."""
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(5)
    auth = f"authorization: Bearer {key}\r\n" if key else ""
    head = (
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"{auth}content-length: {body_bytes}\r\n\r\n"
    )
    chunk = b" " * 65536
    try:
        s.sendall(head.encode())
        left = body_bytes - 1
        while left > 0:
            n = min(left, len(chunk))
            s.sendall(chunk[:n])
            left -= n
    except OSError:
        pass  # the server stopped reading (or closed): the upload stalls here
    try:
        s.settimeout(0.5)
        if s.recv(12).startswith(b"HTTP/1.1 4"):
            with lock:
                answered[0] += 1
    except OSError:
        pass
    with lock:
        sockets.append(s)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", required=True)
    ap.add_argument("--connections", type=int, default=200)
    ap.add_argument("--body-mib", type=float, default=4)
    ap.add_argument("--key", choices=["none", "wrong", "right"], default="none")
    args = ap.parse_args()

    port = free_port()
    server = subprocess.Popen(
        [args.binary, "serve", "--port", str(port), "--api-key", KEY],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_healthy(port, server)
        time.sleep(1)
        before = status_kib(server.pid, "VmRSS")
        key = {"none": None, "wrong": "not-the-key", "right": KEY}[args.key]
        body_bytes = int(args.body_mib * (1 << 20))
        sockets, answered, lock = [], [0], threading.Lock()
        threads = [
            threading.Thread(target=upload, args=(port, body_bytes, key, sockets, answered, lock))
            for _ in range(args.connections)
        ]
        started = time.time()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(2)
        after = status_kib(server.pid, "VmRSS")
        peak = status_kib(server.pid, "VmHWM")
        print(
            f"{args.connections} uploads of {args.body_mib} MiB, key {args.key}: "
            f"VmRSS {before / 1024:.0f} MB before, {after / 1024:.0f} MB after, "
            f"VmHWM {peak / 1024:.0f} MB; {answered[0]} answered before the body was complete; "
            f"{time.time() - started:.1f} s"
        )
        for s in sockets:
            s.close()
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    main()
