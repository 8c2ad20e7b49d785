#!/usr/bin/env python3
"""Write transformers references of the KV cache a vLLM 0.33.0 decode would hold for each
conformance fixture: models/tests/fixtures/<name>/kv_reference.safetensors.

For each fixture in FIXTURES this loads the saved checkpoint back in float32 with eager attention
(like scripts/make_conformance_fixtures.py), runs every reference prompt `input_ids_{i}` of
reference.safetensors once, batch 1, with use_cache=True, and stores for prompt i:

  input_ids_{i}        I64 [T]          copied from reference.safetensors
  k_{i}_{l}, v_{i}_{l} F32 [kv_heads, T, head_dim]   GQA models: past_key_values of layer l, i.e.
                       K after the projection bias, any k-norm and RoPE; V as projected. This is
                       what vLLM writes into its paged cache (FLASH_ATTN, neox RoPE).
  latent_{i}_{l}       F32 [T, kv_lora_rank + qk_rope_head_dim]   MLA (deepseek_v3): vLLM's MLA cache
                       row, concat(kv_a_layernorm(compressed_kv), k_pe after RoPE).

k_pe order ("kpe_order": "vllm-gptj" in the header): vLLM applies DeepSeek's RoPE GPT-J style
(is_neox_style=False, vllm/model_executor/models/deepseek_v2.py) on the checkpoint's raw,
pair-interleaved k_pe. transformers with `rope_interleave: true` de-interleaves and rotates neox
style, and caches t = [rotated evens | rotated odds]. The stored k_pe is re-interleaved to vLLM's
order: out[2j] = t[j], out[2j+1] = t[j + d/2].

Checks (the script fails if any does not hold):
  * the cached forward's logits equal reference.safetensors' logits_{i} (atol 1e-4);
  * GQA: K and V recomputed from each layer's input with the layer's own modules and vLLM's
    default RoPE (neox, inv_freq = theta^(-2j/d)) equal past_key_values (atol 1e-5);
  * MLA: the latent recomputed from each layer's input the vLLM way (RMSNorm with
    config.rms_norm_eps; GPT-J rotation of the raw k_pe with cos/sin of vLLM's
    DeepseekScalingRotaryEmbedding, deepseek_yarn) equals the stored, re-interleaved latent
    (atol 1e-5), and the not-re-interleaved transformers k_pe does not.

Usage (torch, transformers, safetensors, numpy; the fixtures were made with torch 2.15.0,
transformers 5.23.0, safetensors 0.8.0 — see meta.json; CI only reads the committed output):

    python3 -m venv /tmp/tfvenv
    /tmp/tfvenv/bin/pip install torch==2.15.0 transformers==5.23.0 safetensors==0.8.0 numpy
    /tmp/tfvenv/bin/python scripts/make_kv_references.py [--fixtures models/tests/fixtures] [--only NAME ...]
"""
import argparse
import json
import math
import os
import platform
import sys

import torch
import safetensors
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

FIXTURES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")
ATOL = 1e-5


def neox_rope(x, theta, positions):
    """vLLM RotaryEmbedding, is_neox_style=True, full rotary dim. x: [H, T, d]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([freqs.cos()] * 2, -1), torch.cat([freqs.sin()] * 2, -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def vllm_deepseek_yarn_cos_sin(rp, d, positions):
    """cos/sin of vLLM 0.33.0 DeepseekScalingRotaryEmbedding (rotary_embedding/deepseek_scaling_rope.py,
    common.py yarn helpers); rope_type "yarn" becomes "deepseek_yarn" in deepseek_v2.py."""
    base, factor = rp["rope_theta"], rp["factor"]
    orig = rp["original_max_position_embeddings"]
    beta_fast, beta_slow = rp.get("beta_fast", 32), rp.get("beta_slow", 1)
    mscale_of = lambda s, m: 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0
    mscale = mscale_of(factor, float(rp.get("mscale", 1))) / mscale_of(factor, float(rp.get("mscale_all_dim", 0)))
    corr = lambda rot: (d * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))
    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), d - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    mask = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - mask) + (1.0 / pos_freqs) * mask
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos() * mscale, freqs.sin() * mscale


def gptj_rope(x, cos, sin):
    """vLLM forward_static with is_neox_style=False: pairs (x[2j], x[2j+1]) rotate by angle j."""
    cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    rot = torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
    return x * cos + rot * sin


def to_vllm_order(t):
    """transformers' [rotated evens | rotated odds] -> out[2j] = t[j], out[2j+1] = t[j + d/2]."""
    d = t.shape[-1]
    return torch.stack((t[..., : d // 2], t[..., d // 2 :]), -1).flatten(-2)


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def close(a, b, what):
    err = (a - b).abs().max().item()
    if not err <= ATOL:
        raise AssertionError(f"{what}: max abs diff {err:.3e} > {ATOL}")
    return err


def save_canonical(tensors, path, metadata):
    """save_file, then rewrite the header with sorted metadata keys (safetensors keeps metadata in a
    hash map, so its order differs run to run) so that a re-run gives byte-identical files."""
    save_file(tensors, path, metadata=metadata)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header, data = json.loads(f.read(n)), f.read()
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + data)


def layer_kv(past, l):
    layer = past.layers[l]
    return layer.keys[0], layer.values[0]  # [H, T, d] (batch 1)


def run_fixture(name, root):
    d = os.path.join(root, name)
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    mla = cfg.get("kv_lora_rank") is not None
    attns = [layer.self_attn for layer in model.model.layers]
    inputs = {}
    hooks = [a.register_forward_pre_hook(
        lambda m, args, kw, l=l: inputs.__setitem__(l, (kw.get("hidden_states", args[0] if args else None))[0].detach()),
        with_kwargs=True) for l, a in enumerate(attns)]
    ref = safe_open(os.path.join(d, "reference.safetensors"), "pt")
    n_prompts = len([k for k in ref.keys() if k.startswith("input_ids_")])
    out, worst = {}, 0.0
    for i in range(n_prompts):
        ids = ref.get_tensor(f"input_ids_{i}")
        T = ids.shape[0]
        pos = torch.arange(T)
        inputs.clear()
        with torch.no_grad():
            res = model(ids[None], use_cache=True)
        close(res.logits[0], ref.get_tensor(f"logits_{i}"), f"{name} prompt {i} logits vs reference")
        out[f"input_ids_{i}"] = ids.contiguous()
        for l, a in enumerate(attns):
            keys, values = layer_kv(res.past_key_values, l)
            h = inputs[l]  # [T, hidden]
            with torch.no_grad():
                if mla:
                    rank, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
                    assert cfg.get("rope_interleave", True), "only rope_interleave checkpoints are handled"
                    kv_c, k_pe = keys[0], values[0]  # transformers caches [1, T, rank] and [1, T, rope]
                    latent = torch.cat([kv_c, to_vllm_order(k_pe)], -1)
                    raw = a.kv_a_proj_with_mqa(h)
                    cos, sin = vllm_deepseek_yarn_cos_sin(cfg["rope_parameters"], rope, pos)
                    want = torch.cat([rms_norm(raw[:, :rank], a.kv_a_layernorm.weight, cfg["rms_norm_eps"]),
                                      gptj_rope(raw[:, rank:], cos, sin)], -1)
                    worst = max(worst, close(latent, want, f"{name} prompt {i} layer {l} latent vs vLLM recompute"))
                    if torch.allclose(k_pe, want[:, rank:], atol=ATOL):
                        raise AssertionError(f"{name}: transformers' own k_pe order already equals vLLM's?")
                    out[f"latent_{i}_{l}"] = latent.contiguous()
                else:
                    H, hd = keys.shape[0], keys.shape[-1]
                    k = a.k_proj(h).view(T, H, hd).transpose(0, 1)
                    if getattr(a, "k_norm", None) is not None:
                        k = a.k_norm(k)
                    k = neox_rope(k, cfg["rope_parameters"]["rope_theta"], pos)
                    v = a.v_proj(h).view(T, H, hd).transpose(0, 1)
                    worst = max(worst, close(keys, k, f"{name} prompt {i} layer {l} K vs vLLM recompute"),
                                close(values, v, f"{name} prompt {i} layer {l} V vs vLLM recompute"))
                    out[f"k_{i}_{l}"] = keys.contiguous()
                    out[f"v_{i}_{l}"] = values.contiguous()
    for hk in hooks:
        hk.remove()
    meta = {
        "generator": "scripts/make_kv_references.py",
        "fixture": name,
        "versions": json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                                "safetensors": safetensors.__version__, "python": platform.python_version()}),
        "loaded_as": "float32",
        "attn_implementation": "eager",
        "layout": "latent_{i}_{l} [T, kv_lora_rank+qk_rope_head_dim]" if mla
        else "k_{i}_{l}, v_{i}_{l} [kv_heads, T, head_dim]",
        "max_abs_diff_vs_vllm_recompute": f"{worst:.3e}",
    }
    if mla:
        meta["kpe_order"] = "vllm-gptj"
    path = os.path.join(d, "kv_reference.safetensors")
    save_canonical(out, path, meta)
    print(f"[{name}] {n_prompts} prompts, {len(out)} tensors, {os.path.getsize(path)} bytes, "
          f"max |diff| vs vLLM recompute {worst:.2e} -> {path}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fixtures", default=os.path.join(os.path.dirname(__file__), "..", "models", "tests", "fixtures"))
    p.add_argument("--only", nargs="*", choices=FIXTURES)
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    for name in a.only or FIXTURES:
        run_fixture(name, os.path.normpath(a.fixtures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
