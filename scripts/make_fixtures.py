"""Generate the committed model fixtures with transformers (needs torch + transformers).

    python scripts/make_fixtures.py                 # tiny Gemma 3 (tests/fixtures/gemma3_tiny)
    python scripts/make_fixtures.py --real          # also the 270M expected greedy ids (slow: ~2 min)

The tiny Gemma 3 is random (fixed seeds) with every parameter re-randomised, norms included, so a
"(1 + w)" slip or a wrong scale shows in the logits.  CI reads the files; it needs no torch.

Pinned oracle: torch==2.13.0 (CPU wheel), transformers==5.23.0, accelerate (for GGUF).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"

# Small, but with everything that can go wrong: 5 local : 1 global, window 8 over page size 4,
# GQA 4:2, query_pre_attn_scalar != head_dim, linear RoPE scaling on the global layer.
TINY_GEMMA3 = dict(
    vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=24, max_position_embeddings=512,
    rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 8.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
    bos_token_id=2, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True,
)
# The same model as a hub-era config.json would spell it (legacy keys); the loader must agree.
TINY_GEMMA3_HUB_KEYS = dict(
    sliding_window_pattern=6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
    rope_scaling={"rope_type": "linear", "factor": 8.0}, torch_dtype="float32",
)
PROMPTS = {"short": 21, "long": 30}  # prompt lengths, both longer than the window
NEW_TOKENS = 32

# Fixed prompts for the real 270M model.
REAL_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def build_tiny_gemma3(out: Path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gemma3_text", **TINY_GEMMA3)
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(5678)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 0.3 if "norm" in name else 0.15
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    hub = {k: v for k, v in json.loads((out / "config.json").read_text()).items()
           if k not in ("rope_parameters", "layer_types", "dtype")}
    hub.update(TINY_GEMMA3_HUB_KEYS)
    (out / "config_hub.json").write_text(json.dumps(hub, indent=2, sort_keys=True))
    return model


def expected_tiny(model, out: Path):
    import torch

    rng = np.random.default_rng(7)
    arrays = {}
    for name, n in PROMPTS.items():
        ids = torch.tensor(rng.integers(3, 128, size=(1, n)), dtype=torch.long)
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                                 eos_token_id=None, pad_token_id=0)
            full = model(gen, use_cache=False).logits[0].float().numpy()
        arrays[f"{name}_prompt"] = ids[0].numpy().astype(np.int32)
        arrays[f"{name}_greedy"] = gen[0, n:].numpy().astype(np.int32)
        arrays[f"{name}_logits"] = full.astype(np.float32)  # cache-free logits over prompt + greedy
    np.savez_compressed(out / "expected.npz", **arrays)


def real_expected(out_json: Path):
    """Greedy ids of the 270M GGUF under transformers fp32, for the torch-free CI check."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from umem_jax.models.loader import fetch_default_model

    gguf_path = fetch_default_model()
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                 dtype=torch.float32).eval()
    cases = []
    for prompt in REAL_PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                 min_new_tokens=NEW_TOKENS)
        cases.append({"prompt": prompt, "prompt_ids": ids[0].tolist(), "greedy_ids": gen[0, ids.shape[1]:].tolist()})
    out_json.write_text(json.dumps({"oracle": "transformers 5.23.0 fp32 CPU", "cases": cases}, indent=1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--real", action="store_true", help="also write the 270M expected greedy ids")
    ap.add_argument("--out", type=Path, default=FIXTURES)
    args = ap.parse_args()
    tiny_dir = args.out / "gemma3_tiny"
    model = build_tiny_gemma3(tiny_dir)
    expected_tiny(model, tiny_dir)
    print("wrote", tiny_dir)
    if args.real:
        real_expected(args.out / "gemma3_270m_expected.json")
        print("wrote", args.out / "gemma3_270m_expected.json")


if __name__ == "__main__":
    main()
