#!/usr/bin/env python3
"""Build rackfill's built-in model, models/builtin/ (what `rackfill serve` runs with no --model).

A tiny Qwen3-MoE (bf16, < 9 MB) with
  * a byte-level BPE tokenizer (vocab 4096) trained here, offline, on the committed corpus
    scripts/builtin_corpus.txt, with the special tokens <|endoftext|>, <|im_start|>, <|im_end|>
    and a ChatML chat template;
  * weights briefly trained on the same corpus (a few minutes on one CPU thread), so greedy
    generations are locally plausible text rather than noise;
  * routers deliberately skewed like a trained MoE's: a few experts per layer are hot (Zipf-like),
    so that at EP 8 the per-rank load before balancing has imbalance >= 1.5 on ordinary prompts.
    Construction: with u_l the direction along which layer l's router inputs are most
    consistently positive (cov^-1 mean, ridge-regularised, scaled to a mean projection of 1),
    router row e gets  + alpha_l * z_{pi_l(e)} * u_l  (a bias-like boost of ~alpha_l*z logits) where z_j = 1/(j+1)^ZIPF_S and pi_l is a
    per-layer seeded permutation (so the hot experts sit on different ranks in different layers);
    alpha_l is calibrated by bisection so the layer's imbalance on a corpus sample is ~TARGET
    (alpha_l <= ALPHA_MAX, so no router saturates: routing probabilities stay well above 0).

Outputs: models/builtin/{config.json, model.safetensors, generation_config.json, tokenizer.json,
tokenizer_config.json, skew.json, build_info.json} and models/tests/fixtures/builtin_reference.safetensors
(input_ids_{i} / logits_{i} for two of the skew prompts, computed from the saved checkpoint loaded in
float32 with eager attention, as for the conformance fixtures).

Deterministic (fixed seeds, torch.use_deterministic_algorithms(True), torch.set_num_threads(1))
and offline. Needs torch, transformers, tokenizers, safetensors.

    python3 scripts/make_builtin_model.py [--steps 360] [--finetune-steps 120]
"""

import argparse
import json
import math
import os
import shutil
import sys
import time

import torch
import transformers
import tokenizers
import safetensors
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from builtin_prompts import PROMPTS, REFERENCE_CANDIDATES  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CORPUS = os.path.join(HERE, "builtin_corpus.txt")
OUT = os.path.join(REPO, "models", "builtin")
REF_OUT = os.path.join(REPO, "models", "tests", "fixtures", "builtin_reference.safetensors")

SEED = 20240611
VOCAB = 4096
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2/Qwen3 pre-tokenizer split pattern.
SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

EP = 8
TARGET = 2.0          # calibration target for the per-layer imbalance on the corpus sample
ALPHA_MAX = 12.0      # cap on the skew (mean logit boost of the hottest expert): routers never saturate
MIN_OK = 1.5          # required on the skew prompts, every layer
ZIPF_S = 1.0
SEQ = 128
BATCH = 16


def versions():
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "safetensors": safetensors.__version__,
        "python": sys.version.split()[0],
    }


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- tokenizer

def train_tokenizer():
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train([CORPUS], trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    return tok


def write_tokenizer_files(tok, out):
    tok.save(os.path.join(out, "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    cfg = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(ids[s]): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False, "special": True}
            for s in SPECIALS
        },
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 4096,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
        f.write("\n")
    return ids


# --------------------------------------------------------------------------- model

def make_config(ids):
    return Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=64,
        intermediate_size=256,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        router_aux_loss_coef=0.01,
    )


def routers(model):
    return [layer.mlp.gate for layer in model.model.layers]


def lm_train(model, data, steps, lr, seed, aux, freeze_router):
    g = torch.Generator().manual_seed(seed)
    for r in routers(model):
        r.weight.requires_grad_(not freeze_router)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warm = max(1, steps // 12)
    model.train()
    t0 = time.time()
    for step in range(steps):
        f = (step + 1) / warm if step < warm else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / (steps - warm)))
        for group in opt.param_groups:
            group["lr"] = lr * f
        starts = torch.randint(0, len(data) - SEQ - 1, (BATCH,), generator=g)
        x = torch.stack([data[s:s + SEQ] for s in starts.tolist()])
        out = model(input_ids=x, labels=x, output_router_logits=aux, use_cache=False)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 40 == 0 or step == steps - 1:
            log(f"  step {step:4d}/{steps} loss {out.loss.item():.3f} ({time.time() - t0:.0f}s)")
    for r in routers(model):
        r.weight.requires_grad_(True)
    model.eval()


@torch.no_grad()
def route(model, seqs):
    """Per layer: expert counts [E] summed over seqs (each its own forward), per-seq counts,
    router inputs (list of [T, H]), and the minimal k-th/(k+1)-th router-logit gap per seq."""
    L, E = model.config.num_hidden_layers, model.config.num_experts
    k = model.config.num_experts_per_tok
    rec = {}

    def hook(li):
        def f(module, inputs, output):
            rec.setdefault(li, []).append((inputs[0].detach().reshape(-1, inputs[0].shape[-1]),
                                           output[0].detach().float()))
        return f

    hs = [r.register_forward_hook(hook(li)) for li, r in enumerate(routers(model))]
    try:
        for s in seqs:
            model(input_ids=s[None, :], use_cache=False)
    finally:
        for h in hs:
            h.remove()
    counts = torch.zeros(L, E, dtype=torch.int64)
    per_seq = torch.zeros(len(seqs), L, E, dtype=torch.int64)
    gaps = torch.full((len(seqs),), float("inf"))
    xs = [[] for _ in range(L)]
    for li in range(L):
        for si, (x, logits) in enumerate(rec[li]):
            p = torch.softmax(logits, dim=-1)
            sl = logits.sort(dim=-1, descending=True)[0]
            gaps[si] = min(gaps[si].item(), (sl[:, k - 1] - sl[:, k]).min().item())
            idx = p.topk(k, dim=-1)[1]
            c = torch.bincount(idx.flatten(), minlength=E)
            per_seq[si, li] = c
            counts[li] += c
            xs[li].append(x)
    return counts, per_seq, xs, gaps


def imbalance(counts, ep=EP):
    """counts [..., E] -> max rank load / mean rank load, expert e homed on rank e // (E/ep)."""
    E = counts.shape[-1]
    rank = counts.reshape(*counts.shape[:-1], ep, E // ep).sum(-1).double()
    return rank.max(-1)[0] / rank.mean(-1)


def zipf_weights(E, perm):
    z = torch.tensor([1.0 / (j + 1) ** ZIPF_S for j in range(E)])
    return z[perm]  # expert e gets z_{perm[e]}; perm[e] == 0 marks the hottest expert


@torch.no_grad()
def bias_directions(model, sample):
    """Per layer, the direction along which the router inputs are most consistently positive
    (ridge-regularised Fisher direction cov^-1 mean), scaled so the mean projection is 1: added
    to a router row it acts like a per-expert bias of alpha logits."""
    _, _, xs, _ = route(model, sample)
    dirs = []
    for li, inputs in enumerate(xs):
        x = torch.cat(inputs)
        cov = torch.cov(x.T)
        ridge = 0.05 * cov.diagonal().mean() * torch.eye(x.shape[1])
        u = torch.linalg.solve(cov + ridge, x.mean(0))
        u = u / (x @ u).mean()
        proj = x @ u
        log(f"  layer {li}: router input |x| {x.norm(dim=-1).mean():.2f}, x.u mean {proj.mean():.2f} std {proj.std():.2f}")
        dirs.append(u)
    return dirs


@torch.no_grad()
def calibrate(model, base_w, dirs, zs, sample, target):
    """Per layer (in order, since earlier layers shift later inputs), bisect alpha so the
    layer's imbalance on `sample` is ~target. Returns alphas."""
    alphas = []
    for li, r in enumerate(routers(model)):
        def set_alpha(a):
            r.weight.copy_(base_w[li] + a * zs[li][:, None] * dirs[li][None, :])

        def imb(a):
            set_alpha(a)
            counts, _, _, _ = route(model, sample)
            return imbalance(counts[li]).item()

        lo, hi = 0.0, 1.0
        while imb(hi) < target and hi < ALPHA_MAX:
            lo, hi = hi, hi * 2
        for _ in range(14):
            mid = 0.5 * (lo + hi)
            if imb(mid) < target:
                lo = mid
            else:
                hi = mid
        hi = min(hi, ALPHA_MAX)
        set_alpha(hi)
        alphas.append(hi)
        log(f"  layer {li}: alpha {hi:.4f} -> sample imbalance {imb(hi):.3f}")
    return alphas


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=360, help="LM warm-up steps (router trainable, aux loss)")
    ap.add_argument("--finetune-steps", type=int, default=120, help="steps after skewing (routers frozen)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--cache", help="(development) save/load the warm-up state here")
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(SEED)
    transformers.utils.logging.disable_progress_bar()

    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)

    log("training tokenizer")
    tok = train_tokenizer()
    ids = write_tokenizer_files(tok, OUT)
    with open(CORPUS, encoding="utf-8") as f:
        data = torch.tensor(tok.encode(f.read()).ids, dtype=torch.int64)
    log(f"corpus: {len(data)} tokens; special ids {ids}")

    cfg = make_config(ids)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    E = cfg.num_experts
    L = cfg.num_hidden_layers

    if args.cache and os.path.exists(args.cache):
        log(f"loading the LM warm-up result from {args.cache}")
        model.load_state_dict(torch.load(args.cache))
    else:
        log(f"LM warm-up: {args.steps} steps of {BATCH}x{SEQ} tokens")
        lm_train(model, data, args.steps, args.lr, SEED + 1, aux=True, freeze_router=False)
        if args.cache:
            torch.save(model.state_dict(), args.cache)
    model.eval()

    # Calibration sample: fixed windows of the corpus (not the skew prompts).
    g = torch.Generator().manual_seed(SEED + 2)
    sample = [data[s:s + 256] for s in torch.randint(0, len(data) - 257, (12,), generator=g).tolist()]
    prompt_ids = [torch.tensor(tok.encode(p).ids, dtype=torch.int64) for p in PROMPTS]

    counts0, _, _, _ = route(model, sample)
    log(f"before skew: sample imbalance per layer {[round(v, 3) for v in imbalance(counts0).tolist()]}")
    dirs = bias_directions(model, sample)

    gp = torch.Generator().manual_seed(SEED + 3)
    perms = [torch.randperm(E, generator=gp) for _ in range(L)]
    zs = [zipf_weights(E, perm) for perm in perms]
    base_w = [r.weight.detach().clone() for r in routers(model)]

    log("calibrating router skew")
    alphas = calibrate(model, base_w, dirs, zs, sample, TARGET)

    if args.finetune_steps:
        log(f"fine-tune with frozen routers: {args.finetune_steps} steps")
        lm_train(model, data, args.finetune_steps, args.lr * 0.5, SEED + 4, aux=False, freeze_router=True)
        log("re-calibrating router skew after fine-tune (directions of the fine-tuned inputs)")
        dirs = bias_directions(model, sample)
        alphas = calibrate(model, base_w, dirs, zs, sample, TARGET)

    # Save in bf16 and measure everything from the saved checkpoint, as Rust will see it.
    model.to(torch.bfloat16).save_pretrained(OUT)
    gen_cfg = {
        "bos_token_id": None,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "transformers_version": transformers.__version__,
    }
    with open(os.path.join(OUT, "generation_config.json"), "w") as f:
        json.dump(gen_cfg, f, indent=2)
        f.write("\n")

    ref, info = AutoModelForCausalLM.from_pretrained(
        OUT, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not any(v for k, v in info.items() if k != "error_msgs") and not info.get("error_msgs"), info
    ref.eval()

    counts, per_seq, _, gaps = route(ref, prompt_ids)
    imb = imbalance(counts).tolist()
    imb_per_prompt = imbalance(per_seq).tolist()
    sample_counts, _, _, _ = route(ref, sample)
    long_counts = per_seq[len(PROMPTS) - 1]
    log(f"skew prompts: imbalance per layer {[round(v, 3) for v in imb]}")
    log(f"corpus sample: imbalance per layer {[round(v, 3) for v in imbalance(sample_counts).tolist()]}")
    log(f"long prompt ({len(prompt_ids[-1])} tokens): min tokens per expert per layer {long_counts.min(-1)[0].tolist()}")
    if min(imb) < MIN_OK:
        raise SystemExit(f"imbalance below {MIN_OK}: {imb}")

    hot = []
    for li in range(L):
        order = counts[li].argsort(descending=True)[:4].tolist()
        hot.append([{"expert": e, "rank": e // (E // EP), "tokens": int(counts[li, e])} for e in order])
    skew = {
        "prompts": PROMPTS,
        "ep": EP,
        "imbalance_per_layer": [round(v, 4) for v in imb],
        "definition": "each prompt is one forward of its own (raw tokenizer.json encoding, no special tokens, "
                      "no chat template); per layer, count tokens routed to each expert over all prompts "
                      "(a token counts once per selected expert, top-k of softmax(router logits)); "
                      "home rank of expert e = e // (E/ep); imbalance = max rank load / mean rank load",
        "num_experts": E,
        "top_k": cfg.num_experts_per_tok,
        "prompt_token_counts": [len(p) for p in prompt_ids],
        "imbalance_per_prompt": [[round(v, 4) for v in row] for row in imb_per_prompt],
        "expert_counts_per_layer": counts.tolist(),
        "hottest_experts_per_layer": hot,
        "corpus_sample_imbalance_per_layer": [round(v, 4) for v in imbalance(sample_counts).tolist()],
        "long_prompt_min_tokens_per_expert": long_counts.min(-1)[0].tolist(),
        "construction": {
            "zipf_s": ZIPF_S, "calibration_target": TARGET, "alpha_per_layer": [round(a, 5) for a in alphas],
            "hot_permutation_per_layer": [p.tolist() for p in perms],
        },
        "measured_with": {"loaded_as": "float32 (from the bf16 checkpoint)", "attn_implementation": "eager",
                          "versions": versions()},
    }
    with open(os.path.join(OUT, "skew.json"), "w") as f:
        json.dump(skew, f, indent=1)
        f.write("\n")

    # Reference logits for two prompts without near-ties in routing.
    chosen = [i for i in REFERENCE_CANDIDATES if gaps[i] > 1e-3][:2]
    if len(chosen) < 2:
        raise SystemExit(f"no two reference prompts without routing near-ties: router-logit gaps {gaps.tolist()}")
    tensors = {}
    with torch.no_grad():
        for j, i in enumerate(chosen):
            x = prompt_ids[i]
            tensors[f"input_ids_{j}"] = x.contiguous()
            tensors[f"logits_{j}"] = ref(input_ids=x[None, :], use_cache=False).logits[0].float().contiguous()
    meta = {
        "model": "models/builtin", "prompt_indices_in_skew_json": json.dumps(chosen),
        "min_router_logit_gap": json.dumps([gaps[i].item() for i in chosen]),
        "loaded_as": "float32", "attn_implementation": "eager",
        "generator": "scripts/make_builtin_model.py", "versions": json.dumps(versions()),
    }
    save_file(tensors, REF_OUT, metadata=meta)
    log(f"reference prompts {chosen}, min router-logit gaps {[round(gaps[i].item(), 5) for i in chosen]}")

    # Sanity: tokenizer round trip through transformers, chat template, and a greedy sample.
    hf_tok = AutoTokenizer.from_pretrained(OUT)
    chat = hf_tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", repr(chat)
    assert hf_tok(PROMPTS[0])["input_ids"] == prompt_ids[0].tolist()
    samples = {}
    for text in ["The function returns", "To make a simple tomato soup,"]:
        x = torch.tensor([tok.encode(text).ids])
        with torch.no_grad():
            y = ref.generate(x, max_new_tokens=40, do_sample=False)
        samples[text] = tok.decode(y[0].tolist())
        log(f"sample: {samples[text]!r}")

    n_params = sum(p.numel() for p in ref.parameters())
    sizes = {f: os.path.getsize(os.path.join(OUT, f)) for f in sorted(os.listdir(OUT))}
    with open(os.path.join(OUT, "build_info.json"), "w") as f:
        json.dump({"versions": versions(), "seed": SEED, "steps": args.steps,
                   "finetune_steps": args.finetune_steps, "lr": args.lr, "batch": BATCH, "seq": SEQ,
                   "corpus_tokens": len(data), "parameters": n_params, "greedy_samples": samples},
                  f, indent=1)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(OUT, f)) for f in os.listdir(OUT))
    log(f"models/builtin: {total} bytes ({total / 1e6:.2f} MB), {n_params} parameters; files {sizes}")
    if total >= 9_000_000:
        raise SystemExit("built-in model is not under 9 MB")


if __name__ == "__main__":
    main()
