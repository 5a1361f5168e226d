"""examples/byo_model.py: a user-defined NNX hybrid (window attention, Mamba2, full attention)
served by the engine.  Greedy engine output must equal a greedy loop over the module's cache-free
`dense` forward, and the engine must come back idle with its invariants intact."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax.numpy as jnp
import numpy as np


def _example():
    path = Path(__file__).resolve().parents[2] / "examples" / "byo_model.py"
    spec = importlib.util.spec_from_file_location("byo_model_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _dense_greedy(model, prompts, n):
    """Greedy continuation by the cache-free forward, one padded [B, L] shape (causal: the
    padding after each row's end does not change what comes before it)."""
    lens = [len(p) for p in prompts]
    toks = np.zeros((len(prompts), max(lens) + n), np.int32)
    for i, p in enumerate(prompts):
        toks[i, :len(p)] = p
    out = [[] for _ in prompts]
    for _ in range(n):
        logits = np.asarray(model.dense_logits(model.params, jnp.asarray(toks)))
        for i in range(len(prompts)):
            t = int(logits[i, lens[i] - 1].argmax())
            out[i].append(t)
            toks[i, lens[i]] = t
            lens[i] += 1
    return out


def test_byo_model_engine_matches_dense_greedy():
    ex = _example()
    model = ex.build()
    n = 12
    llm, tokens = ex.main(max_tokens=n, model=model)
    assert [len(t) for t in tokens] == [n] * len(ex.PROMPTS)
    assert tokens == _dense_greedy(model, ex.PROMPTS, n)
    # the plan holds all three kinds of memory: window + full K/V sub-pools and a state sub-pool
    plan = llm.llm_engine.plan
    assert plan.state is not None and len(plan.token_pools) == 2
    e = llm.llm_engine
    assert not e.has_unfinished_requests() and e.num_idle_checks >= 1
    e.check_idle()  # allocator invariants, no leaked pages / slots, refcounts
