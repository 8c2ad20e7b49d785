#!/usr/bin/env python3
"""Checks that the workspace's `rust-version` is at least what every locked dependency needs.

Reads `cargo metadata --locked` for this host's platform and compares the workspace's declared
`rust-version` with the highest `rust-version` among the packages the build resolves. Exits 1
with one line naming the package that needs more.

    python3 scripts/check_msrv.py
"""

import json
import subprocess
import sys


def version(text):
    """`1.89` and `1.89.0` alike: three parts, missing ones zero."""
    parts = [int(part) for part in text.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def main():
    host = subprocess.run(["rustc", "-vV"], capture_output=True, text=True, check=True).stdout
    triple = next(l.split(": ", 1)[1] for l in host.splitlines() if l.startswith("host: "))
    meta = json.loads(
        subprocess.run(
            ["cargo", "metadata", "--format-version", "1", "--locked", "--filter-platform", triple],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    resolved = {node["id"] for node in meta["resolve"]["nodes"]}
    members = set(meta["workspace_members"])
    declared = {
        version(p["rust_version"])
        for p in meta["packages"]
        if p["id"] in members and p.get("rust_version")
    }
    if len(declared) != 1:
        print(f"workspace members declare {len(declared)} different rust-versions", file=sys.stderr)
        sys.exit(1)
    ours = declared.pop()
    needs = max(
        (version(p["rust_version"]), p["name"], p["version"])
        for p in meta["packages"]
        if p["id"] in resolved and p["id"] not in members and p.get("rust_version")
    )
    shown = ".".join(map(str, ours))
    if needs[0] > ours:
        need = ".".join(map(str, needs[0]))
        print(f"rust-version {shown} is too low: {needs[1]} {needs[2]} needs {need}", file=sys.stderr)
        sys.exit(1)
    print(f"rust-version {shown} covers every locked dependency (highest: {needs[1]} {needs[2]})")


if __name__ == "__main__":
    main()
