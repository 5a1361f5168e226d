"""Fused projections (Model.fuse_projections): same math as the separate ones, fewer matmuls.

For every family's committed tiny fixture and the built-in tiny hybrid: the fused model's
parameter tree has no separate q/k/v, gate/up or gated-DeltaNet input projections left (nor a
separate shared expert: the MoE families' join their routed experts, models/moe.py), holds the
same number of weights, and gives the same dense logits as the model it was made from; for Qwen3.5
(gated DeltaNet + gated attention) also the same arena-path greedy tokens and logits (fp32, chunked
prefill then decode).  The engine fuses by default, so every engine test serves a fused model.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _model_arena import generate

from umem_jax.memory import plan as make_plan
from umem_jax.models.layers import FusedLinear, Linear
from umem_jax.models.loader import load_model
from umem_jax.models.tiny import tiny_model

FIXTURES = Path(__file__).parents[1] / "fixtures"
SEPARATE = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b",
            "shared_expert", "shared_expert_gate"}


def _models():
    yield "tiny", lambda: tiny_model(seed=3, dtype="float32")
    for name in ("gemma3_tiny", "nemotron_h_tiny", "qwen3_5_tiny", "qwen3_5_moe_tiny", "nemotron_h_moe_tiny",
                 "qwen3_next_tiny"):
        yield name, lambda name=name: load_model(FIXTURES / name)


def _names(params) -> set[str]:
    return {str(k.key) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0] for k in path
            if hasattr(k, "key")}


@pytest.mark.parametrize("name,make", list(_models()), ids=[n for n, _ in _models()])
def test_fused_model_matches_separate(name, make):
    model = make()
    fused = model.fuse_projections()
    assert fused is not model
    names, before = _names(fused.params), _names(model.params)
    # NemotronH's MLP has up_proj alone (nothing to fuse it with)
    expect_gone = SEPARATE & before - ({"up_proj"} if "gate_proj" not in before else set())
    assert not names & expect_gone, f"separate projections left: {names & expect_gone}"
    assert names & {"qkv_proj", "gate_up", "in_proj"}
    count = lambda m: sum(x.size for x in jax.tree.leaves(m.params))
    assert count(fused) == count(model)

    rng = np.random.default_rng(7)
    vocab = model.config.vocab_size
    tokens = jnp.asarray(rng.integers(1, vocab, size=(2, 19)), jnp.int32)
    a = np.asarray(model.dense_logits(model.params, tokens))
    b = np.asarray(fused.dense_logits(fused.params, tokens))
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * np.abs(a).max())

    if name != "qwen3_5_tiny":  # the engine tests serve the tiny hybrid fused; the GDN layers only here
        return
    prompts = [rng.integers(1, vocab, size=n) for n in (13, 30)]
    plan = make_plan(model.decls(kv_dtype="float32"), page_size=4)
    ra = generate(model, plan, prompts, 6, chunk=8)
    rb = generate(fused, plan, prompts, 6, chunk=8)
    assert rb.tokens == ra.tokens
    for la, lb in zip(ra.logits, rb.logits):
        for (pa, xa), (pb, xb) in zip(la, lb):
            assert pa == pb
            np.testing.assert_allclose(xb, xa, rtol=1e-5, atol=1e-5 * np.abs(xa).max())


def test_fused_linear_splits_in_part_order():
    from flax import nnx

    rngs = nnx.Rngs(0)
    parts = [Linear(8, n, dtype=jnp.float32, rngs=rngs) for n in (5, 3, 7)]
    f = FusedLinear(parts)
    x = jax.random.normal(jax.random.key(1), (2, 4, 8))
    for got, p in zip(f(x), parts):
        np.testing.assert_allclose(got, p(x), rtol=1e-6, atol=1e-6)
    assert f.sizes == (5, 3, 7)
    parts[1].reduce_axis = "tp"
    with pytest.raises(ValueError, match="column-parallel"):
        FusedLinear(parts)



def test_fusing_twice_is_a_no_op():
    fused = tiny_model(seed=1).fuse_projections()
    assert fused.fuse_projections() is fused


def test_donated_fusion_deletes_the_parts():
    """donate=True (what the engine does with a model it loaded): each part's array is deleted as
    soon as its group is stacked, the fused model is the same model, the rest is untouched."""
    model = tiny_model(seed=2, dtype="float32")
    ref = model.fuse_projections()
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, model.config.vocab_size, size=(1, 11)), jnp.int32)
    want = np.asarray(ref.dense_logits(ref.params, tokens))
    donor = tiny_model(seed=2, dtype="float32")
    before = jax.tree_util.tree_flatten_with_path(donor.params)[0]
    fused = donor.fuse_projections(donate=True)
    keys = lambda path: [str(k.key) for k in path if hasattr(k, "key")]
    gone = {keys(p)[keys(p).index("weight") - 1] for p, x in before if x.is_deleted()}
    assert gone == {n for n in SEPARATE if n in _names(donor.params)}  # every part, nothing else
    np.testing.assert_array_equal(np.asarray(fused.dense_logits(fused.params, tokens)), want)
