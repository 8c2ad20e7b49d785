"""How far transformers in bf16 is from its own f32 KV cache, per layer, on the conformance
fixtures: the bound a bf16 path's exported KV is held to (tests/kv_export.rs,
`the_device_path_exports_kv_no_further_from_f32_than_transformers_bf16`).

    python3 scripts/kv_bf16_error.py qwen3_moe [qwen2_moe mixtral]   # needs torch + transformers

Prints the largest absolute difference of K and V, per layer, over the reference prompts of
`kv_reference.safetensors` (scripts/make_kv_references.py), between transformers' bf16
`past_key_values` and its f32 ones.
"""
import sys, torch, numpy as np
from transformers import AutoModelForCausalLM
from safetensors.numpy import load_file
torch.manual_seed(0)
for name in sys.argv[1:]:
    d = f"models/tests/fixtures/{name}"
    ref = load_file(f"{d}/kv_reference.safetensors")
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16, attn_implementation="eager").eval()
    worst = {}
    for i in range(3):
        ids = torch.tensor(ref[f"input_ids_{i}"]).unsqueeze(0)
        with torch.no_grad():
            out = m(ids, use_cache=True)
        pkv = out.past_key_values
        L = m.config.num_hidden_layers
        for l in range(L):
            if f"k_{i}_{l}" in ref:
                k = pkv.layers[l].keys[0].float().numpy(); v = pkv.layers[l].values[0].float().numpy()
                e = max(np.abs(k - ref[f"k_{i}_{l}"]).max(), np.abs(v - ref[f"v_{i}_{l}"]).max())
                worst[l] = max(worst.get(l, 0), float(e))
    print(name, "transformers bf16 vs f32, max abs KV error per layer:", {l: round(e, 4) for l, e in worst.items()})
