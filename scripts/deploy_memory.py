#!/usr/bin/env python3
"""Weights and KV cache per GPU for docs/deploy.md: Qwen3-235B-A22B and DeepSeek-V3 at EP 64 and
72 with 2 redundant slots per rank, from the models' published config.json values.

A rank holds: the replicated part (embedding, LM head, every layer's attention, norms, router,
shared expert, dense MLPs: attention is data-parallel, every rank runs whole sequences), its home
experts of every MoE layer (Layout::contiguous: ceil(E/R) on the first E % R ranks, floor(E/R) on
the others), and n_slot redundant slots of one expert each, shared by all layers (one layer's
replicas at a time, docs/engine.md). Prints Markdown tables (GB = 1e9 bytes).
"""

HBM_GB = 13.4e12 / 72 / 1e9  # GB200 NVL72: 13.4 TB of HBM3e over 72 GPUs
SLOTS = 2

QWEN3 = dict(name="Qwen3-235B-A22B", layers=94, dense_layers=0, experts=128, hidden=4096,
             moe_inter=1536, shared_inter=0, dense_inter=0, vocab=151936, tied=False,
             attn=dict(kind="gqa", q_heads=64, kv_heads=4, head_dim=128))
DEEPSEEK_V3 = dict(name="DeepSeek-V3", layers=61, dense_layers=3, experts=256, hidden=7168,
                   moe_inter=2048, shared_inter=2048, dense_inter=18432, vocab=129280, tied=False,
                   attn=dict(kind="mla", heads=128, q_lora=1536, kv_lora=512, nope=128, rope=64, v=128))


def attention_params(m):
    a, h = m["attn"], m["hidden"]
    if a["kind"] == "gqa":
        q, kv = a["q_heads"] * a["head_dim"], a["kv_heads"] * a["head_dim"]
        return h * q + 2 * h * kv + q * h + 2 * a["head_dim"]  # q, k, v, o; q_norm, k_norm
    qk = a["nope"] + a["rope"]
    return (h * a["q_lora"] + a["q_lora"] + a["q_lora"] * a["heads"] * qk  # q_a, norm, q_b
            + h * (a["kv_lora"] + a["rope"]) + a["kv_lora"]  # kv_a_proj_with_mqa, norm
            + a["kv_lora"] * a["heads"] * (a["nope"] + a["v"])  # kv_b
            + a["heads"] * a["v"] * h)  # o


def kv_bytes_per_token(m, dtype_bytes=2, expanded=False):
    a = m["attn"]
    if a["kind"] == "gqa":
        return m["layers"] * 2 * a["kv_heads"] * a["head_dim"] * dtype_bytes
    if expanded:  # per-head keys and values, as rackfill's MLA cache holds them today
        return m["layers"] * a["heads"] * (a["nope"] + a["rope"] + a["v"]) * dtype_bytes
    return m["layers"] * (a["kv_lora"] + a["rope"]) * dtype_bytes  # compressed latent + rope key


def breakdown(m, ranks, dtype_bytes=2):
    h = m["hidden"]
    moe_layers = m["layers"] - m["dense_layers"]
    expert = 3 * h * m["moe_inter"]
    per_layer = attention_params(m) + 2 * h
    replicated = (m["layers"] * per_layer
                  + moe_layers * (m["experts"] * h + m["experts"] * (m["attn"]["kind"] == "mla")  # router (+ bias)
                                  + 3 * h * m["shared_inter"])
                  + m["dense_layers"] * 3 * h * m["dense_inter"]
                  + m["vocab"] * h * (1 if m["tied"] else 2) + h)
    most = -(-m["experts"] // ranks)
    fewest = m["experts"] // ranks
    gb = dtype_bytes / 1e9
    return dict(replicated=replicated * gb, expert_mb=expert * dtype_bytes / 1e6,
                most=most, fewest=fewest, ranks_with_most=m["experts"] % ranks or ranks,
                home=most * moe_layers * expert * gb, home_fewest=fewest * moe_layers * expert * gb,
                slots=SLOTS * expert * gb, total_params=(replicated + m["experts"] * moe_layers * expert) / 1e9)


def main():
    print(f"| model, EP | experts/rank (ranks) | replicated | home experts | {SLOTS} slots | weights | HBM left of {HBM_GB:.0f} GB | KV tokens in it |")
    print("|:--|:--|--:|--:|--:|--:|--:|--:|")
    for m in (QWEN3, DEEPSEEK_V3):
        for ranks in (64, 72):
            b = breakdown(m, ranks)
            weights = b["replicated"] + b["home"] + b["slots"]
            left = HBM_GB - weights
            per = "%d" % b["most"] if b["most"] == b["fewest"] else \
                "%d (%d ranks), %d (%d)" % (b["most"], b["ranks_with_most"], b["fewest"], ranks - b["ranks_with_most"])
            kv = kv_bytes_per_token(m)
            home = f"{b['home']:.2f} GB" + ("" if b["most"] == b["fewest"] else f" ({b['home_fewest']:.2f})")
            print(f"| {m['name']}, EP {ranks} | {per} | {b['replicated']:.2f} GB | {home} | "
                  f"{b['slots']:.3f} GB | {weights:.2f} GB | {left:.0f} GB | {left * 1e9 / kv / 1e3:,.0f}k |")
    print()
    for m in (QWEN3, DEEPSEEK_V3):
        b = breakdown(m, 64)
        print(f"- {m['name']}: {b['total_params']:.1f}B parameters; one expert {b['expert_mb']:.1f} MB in bf16; "
              f"KV {kv_bytes_per_token(m) / 1024:.1f} KiB per token in bf16"
              + (f" (rackfill's expanded f32 MLA cache with --device cpu: {kv_bytes_per_token(m, 4, True) / 2**20:.2f} MiB)"
                 if m["attn"]["kind"] == "mla" else ""))
    print()
    print("With --device cpu (f32, host memory), per rank:")
    print()
    print("| model, EP | home experts + slots | replicated weights (plus KV) |")
    print("|:--|--:|--:|")
    for m in (QWEN3, DEEPSEEK_V3):
        for ranks in (64, 72):
            b = breakdown(m, ranks, dtype_bytes=4)
            print(f"| {m['name']}, EP {ranks} | {b['home'] + b['slots']:.2f} GB | {b['replicated']:.2f} GB |")


if __name__ == "__main__":
    main()
