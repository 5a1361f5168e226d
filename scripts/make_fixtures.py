"""Generate the committed model fixtures with transformers (needs torch + transformers).

    python scripts/make_fixtures.py                 # tiny Gemma 3 (tests/fixtures/gemma3_tiny)
    python scripts/make_fixtures.py --real          # also the 270M expected greedy ids (slow: ~2 min)
    python scripts/make_fixtures.py --family nemotron_h   # tests/fixtures/nemotron_h_tiny (+ small-dt case)
    python scripts/make_fixtures.py --family qwen3_5      # tests/fixtures/qwen3_5_tiny
    python scripts/make_fixtures.py --family qwen_moe     # tests/fixtures/qwen3_5_moe_tiny, qwen3_next_tiny

The tiny Gemma 3 is random (fixed seeds) with every parameter re-randomised, norms included, so a
"(1 + w)" slip or a wrong scale shows in the logits.  CI reads the files; it needs no torch.

Pinned oracle: torch==2.13.0 (CPU wheel), transformers==5.23.0, accelerate (for GGUF).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from fixture_kit import FIXTURES, NEW_TOKENS, PROMPTS, build_tiny, expected_hybrid, small_dt_bias

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
# Fixed prompts for the real 270M model.
REAL_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
# Longer than the 512-token window, so the local layers' windows slide in the real model too.
_FRUITS = ["apples", "pears", "plums", "figs", "limes", "dates"]
LONG_PROMPT = "".join(f"Day {d}: I walked to the market and bought {d % 7 + 2} {_FRUITS[d % 6]}.\n"
                      for d in range(1, 41))
REAL_PROMPTS.append(LONG_PROMPT)


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
    import copy

    import torch

    rng = np.random.default_rng(7)
    arrays = {}
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    for name, n in PROMPTS.items():
        ids = torch.tensor(rng.integers(3, 128, size=(1, n)), dtype=torch.long)
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                                 eos_token_id=None, pad_token_id=0)
            full = model(gen, use_cache=False).logits[0].float().numpy()
        arrays[f"{name}_prompt"] = ids[0].numpy().astype(np.int32)
        arrays[f"{name}_greedy"] = gen[0, n:].numpy().astype(np.int32)
        arrays[f"{name}_logits"] = full.astype(np.float32)  # cache-free logits over prompt + greedy
        with torch.no_grad():  # the same sequence through the model cast to bf16 (the serving dtype)
            bf = bf16(gen, use_cache=False).logits[0].float().numpy()
        arrays[f"{name}_logits_bf16"] = bf.astype(np.float32)
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
    body = ",\n".join("  " + json.dumps(c) for c in cases)  # one case per line: readable diffs
    out_json.write_text('{\n "oracle": "transformers 5.23.0 fp32 CPU, GGUF loaded by transformers",\n'
                        f' "cases": [\n{body}\n ]\n}}\n')


# ----------------------------------------------------------------------------- hybrid state models
# NemotronH: every block kind (M Mamba2, * NoPE attention, - relu^2 MLP), 2 Mamba groups over 4
# heads, HF chunk_size 16 so its prefill scan crosses chunks.  The "small_dt" case is the same
# weights with some dt_bias pushed far negative: softplus(dt) < time_step_min, so transformers'
# prefill-only clamp (and its unclamped decode) is exercised.
TINY_NEMOTRON_H = dict(
    vocab_size=128, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, layers_block_type=["linear_attention", "mlp", "linear_attention", "full_attention",
                                    "linear_attention", "mlp"],
    mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16,
    time_step_min=1e-3, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    max_position_embeddings=512,
)
NEMOTRON_H_HUB_KEYS = dict(hybrid_override_pattern="M-M*M-", num_hidden_layers=6, mamba_n_groups=2, mamba_d_conv=4,
                           mamba_chunk_size=16, mamba_dt_min=1e-3, torch_dtype="float32")
# Qwen3.5: 3 gated DeltaNet : 1 gated attention, GDN GQA (2 key heads : 4 value heads), partial
# RoPE 0.25 of head_dim 16, tied embeddings (as the 0.8B).
TINY_QWEN3_5 = dict(
    vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, layer_types=["linear_attention", "linear_attention", "full_attention",
                                                     "linear_attention"],
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, tie_word_embeddings=True, max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                     "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


def make_nemotron_h(out: Path):
    import torch

    model = build_tiny("nemotron_h", TINY_NEMOTRON_H, out, 2024, NEMOTRON_H_HUB_KEYS)
    expected_hybrid(model, out / "expected.npz")
    small = small_dt_bias(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in small:
                p.copy_(torch.from_numpy(small[name]))
    expected_hybrid(model, out / "expected_small_dt.npz")
    # The small-dt weights differ only in dt_bias: keep those, not a second checkpoint.
    np.savez_compressed(out / "small_dt_bias.npz", **{k.replace("model.", "", 1): v for k, v in small.items()})


def make_qwen3_5(out: Path):
    model = build_tiny("qwen3_5_text", TINY_QWEN3_5, out, 2025)
    expected_hybrid(model, out / "expected.npz")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--real", action="store_true", help="also write the 270M expected greedy ids")
    ap.add_argument("--out", type=Path, default=FIXTURES)
    ap.add_argument("--family", choices=("gemma3", "nemotron_h", "qwen3_5", "gpt_oss", "nemotron_h_moe", "qwen_moe",
                                         "all"),
                    default="gemma3", help="which tiny fixture(s) to (re)write; default gemma3")
    args = ap.parse_args()
    if args.family in ("gemma3", "all"):
        tiny_dir = args.out / "gemma3_tiny"
        model = build_tiny_gemma3(tiny_dir)
        expected_tiny(model, tiny_dir)
        print("wrote", tiny_dir)
    if args.family in ("nemotron_h", "all"):
        make_nemotron_h(args.out / "nemotron_h_tiny")
        print("wrote", args.out / "nemotron_h_tiny")
    if args.family in ("qwen3_5", "all"):
        make_qwen3_5(args.out / "qwen3_5_tiny")
        print("wrote", args.out / "qwen3_5_tiny")
    if args.family in ("gpt_oss", "all"):  # scripts/fixtures_gpt_oss.py
        __import__("fixtures_gpt_oss").make_gpt_oss(args.out / "gpt_oss_tiny")
    if args.family in ("nemotron_h_moe", "all"):  # scripts/fixtures_nemotron_moe.py
        __import__("fixtures_nemotron_moe").make(args.out / "nemotron_h_moe_tiny")
    if args.family in ("qwen_moe", "all"):  # scripts/fixtures_qwen_moe.py: qwen3_5_moe_tiny, qwen3_next_tiny
        __import__("fixtures_qwen_moe").main(args.out)
    if args.real:
        real_expected(args.out / "gemma3_270m_expected.json")
        print("wrote", args.out / "gemma3_270m_expected.json")


if __name__ == "__main__":
    main()
