"""Models whose GQA ratio G = Hq / Hkv is no power of two (issue 15): the tiny attention-only model
(Gemma 3 blocks, sliding-window and full layers) built with G = 3 and G = 6, one of them with a
head dim of 80, runs through the arena with the Pallas kernels in interpret mode (prefill in
chunks that mix prefilling and decoding rows, then decode steps) and must match the cache-free
dense forward within fp32 tolerance (fp32 K/V planes).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from _model_arena import generate

from umem_jax.memory import plan as make_plan
from umem_jax.models.tiny import tiny_model


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a) - b).max() / np.abs(b).max())


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(6, 2, 16), (6, 1, 80)], ids=["g3_d16", "g6_d80"])
def test_arena_pallas_matches_dense(num_heads, num_kv_heads, head_dim):
    m = tiny_model(seed=3, with_mamba=False, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   query_pre_attn_scalar=head_dim)
    assert m.config.num_heads // m.config.num_kv_heads in (3, 6)
    plan = make_plan(m.decls(kv_dtype="float32"), page_size=8)
    rng = np.random.default_rng(num_heads * 10 + num_kv_heads)
    prompts = [rng.integers(3, 320, size=n) for n in (23, 11)]  # 23 > the window of 16: pages retire
    run = generate(m, plan, prompts, 3, chunk=8, num_rows=1024, impl="pallas", interpret=True)
    assert run.freed_pages > 0
    for p, toks, logits in zip(prompts, run.tokens, run.logits):
        seq = np.concatenate([p, toks])
        ref = np.asarray(m.dense_logits(m.params, jnp.asarray(seq[None])))[0]
        assert toks == ref[len(p) - 1:-1].argmax(-1).tolist()
        assert max(rel_err(lg, ref[pos]) for pos, lg in logits) <= 1e-4
