#!/usr/bin/env python3
"""Generate the MoE conformance fixtures under models/tests/fixtures/<name>/.

For every model family rackfill supports this writes one tiny random checkpoint
(as HF `transformers` saves it), the saved `config.json`, and
`reference.safetensors` with, for prompt i, `input_ids_{i}` (I64 [T]) and
`logits_{i}` (F32 [T, vocab]) computed by HF transformers from the *saved*
checkpoint loaded back in float32 with eager attention (one forward over the
whole prompt, batch 1, no KV cache).

Weights are re-drawn so that logits vary by several units and, critically, so
that no top-k routing decision is a near-tie (gap between the k-th and (k+1)-th
routing score > GAP_MIN for every token, MoE layer and prompt; for DeepSeek-V3
also between the topk_group-th and (topk_group+1)-th group score). If a draw
has a near-tie the next seed is tried.

Deterministic and offline: configs are built in code, seeds are fixed, torch
runs single-threaded with deterministic algorithms.

Usage (needs torch + transformers + safetensors; CI does not, it only reads the
committed output):

    python3 scripts/make_conformance_fixtures.py [--out models/tests/fixtures] [--only NAME ...]
"""

import argparse
import hashlib
import json
import os
import shutil
import sys

import torch
import torch.nn.functional as F
import transformers
import tokenizers
import safetensors
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    MixtralConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

GAP_MIN = 1e-3
VOCAB = 256
PROMPT_LENS = (5, 11, 16)
MAX_ATTEMPTS = 200

# Initialisation scales (see README.md): linear weights N(0, W_STD); embeddings
# N(0, EMB_STD); lm_head N(0, HEAD_STD); norm weights 1 + U(-0.2, 0.2); router
# weights N(0, ROUTER_STD) (chosen so router logits have std ~2.5-3 at hidden 64:
# spread out, yet not so peaked that the 2nd..k-th experts' weights vanish, and
# not saturating DeepSeek's sigmoid into near-ties); biases N(0, BIAS_STD);
# DeepSeek e_score_correction_bias N(0, 0.1).
W_STD = 0.2
EMB_STD = 0.5
HEAD_STD = 0.3
ROUTER_STD = 0.35
BIAS_STD = 0.05
SCORE_BIAS_STD = 0.1


def versions():
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "safetensors": safetensors.__version__,
        "python": sys.version.split()[0],
    }


# --------------------------------------------------------------------------
# fixture definitions
# --------------------------------------------------------------------------

def cfg_qwen3_moe():
    return Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        intermediate_size=96,
        mlp_only_layers=[1],
        decoder_sparse_step=1,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
        bos_token_id=None,
        eos_token_id=None,
    )


def cfg_qwen3_moe_nonorm():
    return Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        intermediate_size=96,
        mlp_only_layers=[],
        decoder_sparse_step=2,
        norm_topk_prob=False,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        bos_token_id=None,
        eos_token_id=None,
    )


def cfg_qwen3_moe_attnbias():
    # attention_bias: q, k, v *and* o_proj carry biases; grouped-query with one KV head.
    return Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        intermediate_size=96,
        mlp_only_layers=[],
        decoder_sparse_step=1,
        norm_topk_prob=True,
        attention_bias=True,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
        bos_token_id=None,
        eos_token_id=None,
    )


def cfg_qwen2_moe():
    return Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        intermediate_size=96,
        norm_topk_prob=False,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
        bos_token_id=None,
        eos_token_id=None,
    )


def cfg_mixtral():
    return MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=48,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
        bos_token_id=None,
        eos_token_id=None,
    )


def _cfg_deepseek(q_lora_rank, yarn):
    kw = {}
    if yarn:
        kw["rope_parameters"] = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        }
    return DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        intermediate_size=96,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=4,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        num_mtp_layers=0,  # this transformers version has no MTP module; no layer-N weights are saved
        bos_token_id=None,
        eos_token_id=None,
        **kw,
    )


def cfg_deepseek_v3_linear_eps():
    # Linear RoPE scaling with mscale_all_dim (transformers scales the softmax by
    # yarn_get_mscale(factor, mscale_all_dim)^2 for every rope_type but "default", not only
    # YaRN) and rms_norm_eps far from 1e-6 (the q/kv latent norms keep eps 1e-6 regardless).
    return DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        moe_intermediate_size=32,
        intermediate_size=64,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=4,
        routed_scaling_factor=1.5,
        norm_topk_prob=True,
        rms_norm_eps=1e-2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        num_mtp_layers=0,
        bos_token_id=None,
        eos_token_id=None,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0, "mscale_all_dim": 1.0},
    )


FIXTURES = {
    # name: (config builder, on-disk dtype, save_pretrained kwargs, base seed)
    "qwen3_moe": (cfg_qwen3_moe, torch.float32, {}, 1000),
    "qwen3_moe_nonorm": (cfg_qwen3_moe_nonorm, torch.bfloat16, {}, 2000),
    "qwen3_moe_attnbias": (cfg_qwen3_moe_attnbias, torch.float32, {}, 7000),
    "qwen2_moe": (cfg_qwen2_moe, torch.bfloat16, {}, 3000),
    "mixtral": (cfg_mixtral, torch.float16, {"max_shard_size": "100KB"}, 4000),
    "deepseek_v3": (lambda: _cfg_deepseek(32, True), torch.float32, {}, 5000),
    "deepseek_v3_noqlora": (lambda: _cfg_deepseek(None, False), torch.bfloat16, {}, 6000),
    "deepseek_v3_linear_eps": (cfg_deepseek_v3_linear_eps, torch.bfloat16, {}, 8000),
}


# --------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------

def reinit_(model, seed):
    """Deterministically re-draw every parameter (and the DeepSeek score bias)."""
    g = torch.Generator().manual_seed(seed)

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=g, dtype=torch.float32) * std + mean

    tensors = list(model.named_parameters()) + [
        (n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")
    ]
    seen = set()
    with torch.no_grad():
        for name, p in tensors:
            if id(p) in seen:  # tied lm_head
                continue
            seen.add(id(p))
            shape = p.shape
            if name.endswith("e_score_correction_bias"):
                v = normal(shape, SCORE_BIAS_STD)
            elif name.endswith(".bias"):
                v = normal(shape, BIAS_STD)
            elif "norm" in name and p.dim() == 1:
                v = 1.0 + (torch.rand(shape, generator=g) * 2.0 - 1.0) * 0.2
            elif name.endswith("mlp.gate.weight") or name.endswith("block_sparse_moe.gate.weight"):
                v = normal(shape, ROUTER_STD)
            elif "embed_tokens" in name:
                v = normal(shape, EMB_STD)
            elif name.startswith("lm_head"):
                v = normal(shape, HEAD_STD)
            else:
                v = normal(shape, W_STD)
            p.copy_(v.to(p.dtype))


# --------------------------------------------------------------------------
# routing-gap check
# --------------------------------------------------------------------------

def router_modules(model):
    out = []
    for name, m in model.named_modules():
        cls = type(m).__name__
        if cls.endswith("TopKRouter") or cls.endswith("TopkRouter"):
            out.append((name, m))
    return out


def routing_gaps(module, logits):
    """Return (min expert gap, min group gap or None) over all tokens of one call."""
    logits = logits.detach().float().reshape(-1, logits.shape[-1])
    k = module.top_k
    if hasattr(module, "e_score_correction_bias"):  # DeepSeek-V3 sigmoid + group-limited routing
        s = logits.sigmoid() + module.e_score_correction_bias.float()
        n_group, topk_group = module.num_group, module.topk_group
        e = s.shape[-1]
        gs = s.view(-1, n_group, e // n_group).topk(2, dim=-1)[0].sum(-1)
        gs_sorted = gs.sort(dim=-1, descending=True)[0]
        ggap = (gs_sorted[:, topk_group - 1] - gs_sorted[:, topk_group]).min().item()
        gidx = gs.topk(topk_group, dim=-1)[1]
        gmask = torch.zeros_like(gs).scatter_(1, gidx, 1.0)
        smask = gmask.unsqueeze(-1).expand(-1, n_group, e // n_group).reshape(-1, e)
        sc = s.masked_fill(smask == 0, float("-inf")).sort(dim=-1, descending=True)[0]
        egap = (sc[:, k - 1] - sc[:, k]).min().item()
        return egap, ggap
    p = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)[0]
    return (p[:, k - 1] - p[:, k]).min().item(), None


def reference_forward(model, prompts):
    """One eager forward per prompt; returns logits list and min routing gaps."""
    gaps = {"expert": float("inf"), "group": None}
    per_layer = {}

    def make_hook(lname):
        def hook(module, inputs, output):
            eg, gg = routing_gaps(module, output[0])
            gaps["expert"] = min(gaps["expert"], eg)
            per_layer[lname] = min(per_layer.get(lname, float("inf")), eg)
            if gg is not None:
                gaps["group"] = gg if gaps["group"] is None else min(gaps["group"], gg)
        return hook

    handles = [m.register_forward_hook(make_hook(n)) for n, m in router_modules(model)]
    logits = []
    try:
        with torch.no_grad():
            for ids in prompts:
                out = model(input_ids=ids[None, :], use_cache=False)
                logits.append(out.logits[0].float().contiguous())
    finally:
        for h in handles:
            h.remove()
    return logits, gaps, per_layer


# --------------------------------------------------------------------------
# inspection helpers
# --------------------------------------------------------------------------

def st_files(d):
    return sorted(f for f in os.listdir(d) if f.endswith(".safetensors") and f != "reference.safetensors")


def saved_tensors(d):
    out = {}
    for f in st_files(d):
        with safe_open(os.path.join(d, f), "pt") as sf:
            for k in sf.keys():
                sl = sf.get_slice(k)
                out[k] = {"file": f, "dtype": sl.get_dtype(), "shape": list(sl.get_shape())}
    return dict(sorted(out.items()))


def expert_layout(keys):
    per = any(".experts.0." in k for k in keys)
    fused = any(k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj") for k in keys)
    if per and not fused:
        return "per_expert"
    if fused and not per:
        return "fused"
    return "mixed" if per and fused else "none"


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read())
    return h.hexdigest()


def dir_size(d):
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------

def make_prompts(name):
    seed = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g, dtype=torch.int64) for n in PROMPT_LENS]


def build_one(name, out_root):
    cfg_fn, dtype, save_kw, base_seed = FIXTURES[name]
    out = os.path.join(out_root, name)
    prompts = make_prompts(name)
    for attempt in range(MAX_ATTEMPTS):
        seed = base_seed + attempt
        torch.manual_seed(seed)
        cfg = cfg_fn()
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
        reinit_(model, seed)
        model = model.to(dtype)
        # Like the published DeepSeek-V3 checkpoints (and HF's _keep_in_fp32_modules_strict),
        # e_score_correction_bias stays float32 on disk even when the rest is 16-bit.
        for n, m in model.named_modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.data = m.e_score_correction_bias.data.float()
        model.eval()
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.makedirs(out)
        model.save_pretrained(out, **save_kw)

        ref, info = AutoModelForCausalLM.from_pretrained(
            out, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
        )
        bad = {k: v for k, v in info.items() if v and k != "error_msgs"} or (
            {"error_msgs": info["error_msgs"]} if info.get("error_msgs") else {}
        )
        if bad:
            raise RuntimeError(f"{name}: loading the saved checkpoint was not clean: {bad}")
        ref.eval()
        # The reloaded model must hold exactly the weights we drew (after the on-disk cast).
        src = dict(model.named_parameters())
        src.update({n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
        dst = dict(ref.named_parameters())
        dst.update({n: b for n, b in ref.named_buffers() if n.endswith("e_score_correction_bias")})
        assert src.keys() == dst.keys(), (name, set(src) ^ set(dst))
        for n in src:
            if not torch.equal(src[n].float(), dst[n].float()):
                raise RuntimeError(f"{name}: reloaded {n} differs from what was saved")

        logits, gaps, per_layer = reference_forward(ref, prompts)
        ok = gaps["expert"] > GAP_MIN and (gaps["group"] is None or gaps["group"] > GAP_MIN)
        print(f"[{name}] seed {seed}: min expert gap {gaps['expert']:.3e}, group gap {gaps['group']}", flush=True)
        if ok:
            break
    else:
        raise RuntimeError(f"{name}: no draw without near-ties in {MAX_ATTEMPTS} attempts")

    tensors = {}
    for i, (ids, lg) in enumerate(zip(prompts, logits)):
        tensors[f"input_ids_{i}"] = ids.contiguous()
        tensors[f"logits_{i}"] = lg
    save_file(tensors, os.path.join(out, "reference.safetensors"), metadata={"fixture": name})

    saved = saved_tensors(out)
    keys = list(saved)
    with open(os.path.join(out, "config.json")) as f:
        saved_cfg = json.load(f)
    all_logits = torch.cat([lg.flatten() for lg in logits])
    meta = {
        "name": name,
        "model_type": saved_cfg.get("model_type"),
        "architectures": saved_cfg.get("architectures"),
        "generator": "scripts/make_conformance_fixtures.py",
        "versions": versions(),
        "seed": seed,
        "attempts": attempt + 1,
        "saved_dtype": str(dtype).replace("torch.", ""),
        "tensor_dtypes": sorted({v["dtype"] for v in saved.values()}),
        "sharded": os.path.exists(os.path.join(out, "model.safetensors.index.json")),
        "safetensors_files": st_files(out),
        "expert_layout": expert_layout(keys),
        "reference": {
            "loaded_as": "float32",
            "attn_implementation": "eager",
            "batch": 1,
            "kv_cache": False,
            "prompt_lengths": [len(p) for p in prompts],
            "logits_std": round(all_logits.std().item(), 4),
            "logits_min": round(all_logits.min().item(), 4),
            "logits_max": round(all_logits.max().item(), 4),
        },
        "routing": {
            "gap_threshold": GAP_MIN,
            "min_expert_gap": gaps["expert"],
            "min_group_gap": gaps["group"],
            "min_expert_gap_per_router": per_layer,
            "score": "sigmoid(logits)+e_score_correction_bias, group-limited" if gaps["group"] is not None
            else "softmax(router_logits) probabilities",
        },
        "init": {
            "linear_std": W_STD, "embed_std": EMB_STD, "lm_head_std": HEAD_STD, "router_std": ROUTER_STD,
            "bias_std": BIAS_STD, "norm": "1 + U(-0.2, 0.2)", "e_score_correction_bias_std": SCORE_BIAS_STD,
        },
        "tensors": saved,
        "sha256": {f: sha256(os.path.join(out, f)) for f in sorted(os.listdir(out)) if f != "meta.json"},
    }
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print(f"[{name}] done: {dir_size(out)} bytes, layout {meta['expert_layout']}, "
          f"logits std {meta['reference']['logits_std']}", flush=True)
    return meta


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "..", "models", "tests", "fixtures"))
    ap.add_argument("--only", nargs="*", choices=sorted(FIXTURES), help="build only these fixtures")
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers.utils.logging.disable_progress_bar()

    os.makedirs(args.out, exist_ok=True)
    total = 0
    for name in args.only or list(FIXTURES):
        build_one(name, args.out)
        total += dir_size(os.path.join(args.out, name))
    print(f"total size of the generated fixture dirs: {total} bytes ({total / 1024:.1f} KiB)")


if __name__ == "__main__":
    main()
