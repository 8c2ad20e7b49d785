#!/usr/bin/env python3
"""Summarise one GPU session (scripts/gpu_session.sh) as markdown: DATE-CARD.md.

Reads what the session wrote to its output folder (device.txt, tests.log, bench-attention*.json,
bench-forward-*.json, bench-forward-hf-*.json) and writes the figures with the card's name: the
flash attention sweep against the cuBLAS baseline (TFLOP/s, fraction of the dense bf16 peak),
each model's prefill tokens/s with model FLOP utilisation and time per phase, and transformers
beside rackfill. Missing files are skipped; nothing here measures anything.

    python3 scripts/gpu_report.py OUT --card "NVIDIA H100 80GB HBM3" [--docs docs/gpu-runs]
"""

import argparse
import datetime
import json
import os
import re


def load(out, name):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def attention_section(report, title):
    if not report:
        return []
    peak = report.get("peak_tflops")
    lines = [f"## {title}", "", f"Device: {report['device']}; dense bf16 peak: {peak or 'unknown'} TFLOP/s.", "",
             "| context | chunk | tiles | flash ms | TFLOP/s | of peak | baseline ms | baseline TFLOP/s | speedup | rel. L2 |",
             "|--:|--:|:--|--:|--:|--:|--:|--:|--:|--:|"]
    for t in report["timings"]:
        case = t["case"]
        best = min(t["flash"], key=lambda f: f["ms"]) if t["flash"] else None
        for f in t["flash"]:
            mark = " **(best)**" if f is best else ""
            lines.append(f"| {case['context']} | {case['chunk']} | {f['tiles']}{mark} | {f['ms']:.3f} | "
                         f"{f['tflops']:.1f} | {pct(f['tflops'] / peak if peak else None)} | {t['baseline_ms']:.3f} | "
                         f"{t['baseline_tflops']:.1f} | {f['speedup']:.2f}x | {f['rel_l2']:.1e} |")
    return lines + [""]


def forward_section(report, title):
    if not report:
        return []
    lines = [f"## {title}", "", f"{report['model']} on {report['device']}; dense bf16 peak: "
             f"{report.get('peak_tflops') or 'unknown'} TFLOP/s.", "",
             "| tokens | tokens/s | model TFLOP/s | MFU |", "|--:|--:|--:|--:|"]
    for r in report["results"]:
        lines.append(f"| {r['tokens']} | {r['tokens_per_s']:.0f} | {r['model_tflops']:.1f} | {pct(r.get('mfu'))} |")
    phased = [r for r in report["results"] if r.get("phases_ms")]
    if phased:
        phases = list(phased[0]["phases_ms"])
        lines += ["", "Device time per phase of one profiled prefill, ms:", "",
                  "| tokens | " + " | ".join(phases) + " | sum |", "|--:|" + "--:|" * (len(phases) + 1)]
        for r in phased:
            cells = " | ".join(f"{r['phases_ms'].get(p, 0):.2f}" for p in phases)
            lines.append(f"| {r['tokens']} | {cells} | {sum(r['phases_ms'].values()):.2f} |")
    return lines + [""]


def hf_section(report, title):
    if not report:
        return []
    lines = [f"## {title}", "", "| round | tokens | transformers tok/s | rackfill tok/s | rackfill / transformers |",
             "|--:|--:|--:|--:|--:|"]
    for i, entry in enumerate(report["rounds"]):
        hf, rf = entry["transformers"], entry.get("rackfill")
        for j, h in enumerate(hf["results"]):
            r = rf["results"][j]["tokens_per_s"] if rf else None
            ratio = f"{r / h['tokens_per_s']:.2f}x" if r else "-"
            lines.append(f"| {i} | {h['tokens']} | {h['tokens_per_s']:.0f} | {r or 0:.0f} | {ratio} |")
    versions = report["rounds"][0]["transformers"]
    return lines + ["", f"torch {versions.get('torch')}, transformers {versions.get('transformers')}.", ""]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the session's output folder")
    ap.add_argument("--card", required=True, help="the GPU's name")
    ap.add_argument("--failed", default="", help="what the session reported failed")
    ap.add_argument("--docs", help="also write the summary into this folder")
    args = ap.parse_args()
    date = datetime.date.today().isoformat()
    slug = re.sub(r"[^a-z0-9]+", "-", args.card.lower().replace("nvidia", "")).strip("-").split("-")[0] or "gpu"
    lines = [f"# GPU session, {args.card}, {date}", "",
             "Written by `scripts/gpu_report.py` from a run of `scripts/gpu_session.sh`; every figure was "
             "measured in that run, on this card.", ""]
    device = os.path.join(args.out, "device.txt")
    if os.path.exists(device):
        lines += ["## device.txt", "", "```text", open(device).read().rstrip(), "```", ""]
    tests = os.path.join(args.out, "tests.log")
    if os.path.exists(tests):
        results = [l for l in open(tests) if l.startswith(("== ", "test result", "compute-sanitizer", "failed"))]
        lines += ["## tests.log", "", "```text", "".join(results).rstrip(), "```", ""]
    lines += [f"Failed: {args.failed}", ""] if args.failed.strip() else []
    lines += attention_section(load(args.out, "bench-attention.json"), "Flash attention, causal chunks (bench attention)")
    lines += attention_section(load(args.out, "bench-attention-context.json"), "Flash attention over a cached context")
    for name, title in [("bench-forward-qwen3.json", "Qwen3-30B-A3B shape (bench forward --model-shape)"),
                        ("bench-forward-deepseek.json", "DeepSeek-V3 shape, first layers (bench forward --model-shape)"),
                        ("bench-forward-qwen3-per-expert.json",
                         "Qwen3-30B-A3B shape, per-expert cuBLAS GEMMs (the grouped kernels' baseline)"),
                        ("bench-forward-cuda.json", "Bench shape (bench forward)")]:
        lines += forward_section(load(args.out, name), title)
    lines += hf_section(load(args.out, "bench-forward-hf-qwen3.json"), "transformers beside rackfill, Qwen3-30B-A3B shape")
    lines += hf_section(load(args.out, "bench-forward-hf-cuda.json"), "transformers beside rackfill, bench shape")
    text = "\n".join(lines).rstrip() + "\n"
    name = f"{date}-{slug}.md"
    targets = [os.path.join(args.out, name)] + ([os.path.join(args.docs, name)] if args.docs else [])
    for path in targets:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    print(f"summary written to {', '.join(targets)}")


if __name__ == "__main__":
    main()
