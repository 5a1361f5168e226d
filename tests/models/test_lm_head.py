"""The LM head's logits are accumulated and returned in fp32, not rounded to the weights' bf16.

bf16 logits tie exactly (steps of 1/32 near |8|); on the H200 a speculative verify and a plain
decode step then picked different tokens of such a tie (benchmarks/RESULTS.md, speculative
decoding, 2026-12-04).  fp32 logits leave only real near-ties.  And an fp32 model's dots run at full
fp32 precision, not the GPU's default TF32 (2026-12-05: the greedy paths parted at a 0.0005-nat tie).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from umem_jax.models.layers import Embedding
from umem_jax.models.tiny import tiny_model


def test_attend_is_fp32_and_not_bf16_rounded():
    vocab, d = 4096, 256
    emb = Embedding(vocab, d, dtype=jnp.bfloat16, rngs=nnx.Rngs(np.random.randint(1 << 30)))
    h = jax.random.normal(jax.random.key(np.random.randint(1 << 30)), (3, d), jnp.float32).astype(jnp.bfloat16)
    out = emb.attend(h)
    assert out.dtype == jnp.float32 and out.shape == (3, vocab)
    want = np.asarray(h, np.float32) @ np.asarray(emb.weight[...], np.float32).T
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    # Rounded to bf16, many logits would tie exactly; in fp32 the distinct values stay distinct.
    rounded = np.asarray(out.astype(jnp.bfloat16), np.float32)
    assert len(np.unique(rounded[0])) < len(np.unique(np.asarray(out[0])))
    assert not np.array_equal(rounded, np.asarray(out))



def _dot_precisions(fn, *args) -> list:
    """The precision of every dot in fn's jaxpr, nested jaxprs (jit, scan, cond bodies) included."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("dot_general", "ragged_dot_general"):
                p = eqn.params.get("precision")
                found.append(None if p is None else str(p[0] if isinstance(p, tuple) else p))
            for v in eqn.params.values():
                for sub in v if isinstance(v, (tuple, list)) else (v,):
                    if hasattr(sub, "eqns"):
                        walk(sub)
                    elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                        walk(sub.jaxpr)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp32_models_multiply_at_full_precision(dtype):
    """fp32 weights: every dot of the model asks for HIGHEST (a GPU's fp32 default is TF32, under which
    a decode step and a speculative verify parted greedy paths on the H200, 2026-12-05); a bf16 model
    keeps JAX's default for its projections."""
    model = tiny_model(np.random.randint(1 << 30), dtype=dtype)
    tokens = jnp.asarray(np.random.randint(3, 320, (2, 8)), jnp.int32)
    found = _dot_precisions(model.dense_logits, model.params, tokens)
    assert len(found) > 10
    if dtype == "float32":
        assert set(found) == {"HIGHEST"}, found
    else:
        assert found.count(None) > len(found) // 2  # the projections; the recurrences' own einsums stay exact


@pytest.mark.parametrize("path", ["gather", "ragged"])
def test_fp32_moe_block_multiplies_at_full_precision(path, monkeypatch):
    from umem_jax.models import experts as experts_lib
    from umem_jax.models.moe import MoE, MoEConfig, moe_reference

    monkeypatch.setattr(experts_lib, "GATHER_ROWS", 10**9 if path == "gather" else 0)
    monkeypatch.setattr(experts_lib, "GROUPED_PATH", None if path == "gather" else path)
    cfg = MoEConfig(num_experts=4, top_k=2, intermediate_size=16, shared_intermediate_size=8, expert_bias=True,
                    router_bias=True)
    block = MoE(16, cfg, dtype=jnp.float32, rngs=nnx.Rngs(np.random.randint(1 << 30)))
    x = jax.random.normal(jax.random.key(np.random.randint(1 << 30)), (3, 16), jnp.float32)
    for fn in (lambda x: block(x, None), lambda x: moe_reference(block, x)):
        found = _dot_precisions(fn, x)
        assert found and set(found) == {"HIGHEST"}, found
