"""The built-in tiny hybrid: declarations, save/load, and arena path == cache-free path."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _model_arena import generate

from umem_jax.memory import Full, State, Window
from umem_jax.memory import plan as make_plan
from umem_jax.models.loader import load_model, save_pretrained
from umem_jax.models.tiny import (
    CHECKPOINT_INTERVAL,
    TinyHybrid,
    tiny_config,
    tiny_config_from_dict,
    tiny_config_to_dict,
    tiny_model,
)


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a) - b).max() / np.abs(b).max())


@functools.lru_cache(maxsize=None)
def _seeded(seed: int, with_mamba: bool = True):
    """tiny_model(seed, with_mamba), one object for every parameter of a test: its jitted
    cache-free forward (the reference, the same shapes for each) compiled once."""
    return tiny_model(seed=seed, with_mamba=with_mamba)


def test_decls_cover_all_three_kinds():
    cfg = tiny_config()
    lifetimes = [d.parts[0].lifetime for d in TinyHybrid.decls(cfg)]
    st = State(CHECKPOINT_INTERVAL)  # decode checkpoints every 32 tokens for the prefix cache
    assert lifetimes == [Window(16), st, Window(16), Full(), Window(16), st]
    plan = make_plan(TinyHybrid.decls(cfg), page_size=8)
    assert plan.names == ("state", "window16", "full")
    assert {t.name for t in plan.state.geometry.tensors} == {"conv", "ssm"}


def test_config_dict_roundtrip():
    cfg = tiny_config()
    assert tiny_config_from_dict(tiny_config_to_dict(cfg)) == cfg
    with pytest.raises(ValueError, match="unknown tiny-model config keys"):
        tiny_config_from_dict({**tiny_config_to_dict(cfg), "bogus": 1})


def test_norms_are_randomised():
    m = tiny_model(with_mamba=False)
    norm = m.params["layers"][0]["input_layernorm"]["weight"][...]
    assert float(jnp.abs(norm).max()) > 0


def test_save_and_load_roundtrip(tmp_path):
    m = tiny_model(seed=3, with_mamba=False)
    back = load_model(save_pretrained(m, tmp_path / "tiny"))
    assert back.config == m.config
    for a, b in zip(jax.tree.leaves(m.params), jax.tree.leaves(back.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_gemma3_save_roundtrip(tmp_path):
    from pathlib import Path

    m = load_model(Path(__file__).parents[1] / "fixtures" / "gemma3_tiny")
    back = load_model(save_pretrained(m, tmp_path / "g3"))
    assert back.config == m.config
    toks = jnp.arange(20)[None] % m.config.vocab_size
    np.testing.assert_array_equal(np.asarray(m.dense_logits(m.params, toks)),
                                  np.asarray(back.dense_logits(back.params, toks)))


@pytest.mark.parametrize("page_size,chunk", [(8, 6), (4, 16)])
def test_arena_matches_dense(page_size, chunk):
    """Attention-only tiny model (window 16): prompts longer than the window, chunked prefill,
    page size below the window; greedy through the arena equals the cache-free argmax."""
    m = _seeded(1, with_mamba=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 320, size=n) for n in (20, 37)]
    plan = make_plan(m.decls(kv_dtype="float32"), page_size=page_size)
    run = generate(m, plan, prompts, 12, chunk=chunk)
    assert run.freed_pages > 0
    for p, toks, logits in zip(prompts, run.tokens, run.logits):
        seq = np.concatenate([p, toks])
        ref = np.asarray(m.dense_logits(m.params, jnp.asarray(seq[None])))[0]
        assert toks == ref[len(p) - 1:-1].argmax(-1).tolist()
        assert max(rel_err(lg, ref[pos]) for pos, lg in logits) <= 1e-4


@pytest.mark.parametrize("page_size,chunk", [(8, 6), (4, 16)])
def test_hybrid_arena_matches_dense(page_size, chunk):
    """All three kinds: Mamba2 state slots (prefill chunks carry the state across, then decode
    steps), window and full K/V.  Greedy through the arena equals the cache-free argmax."""
    m = _seeded(2)
    assert "linear_attention" in m.config.layer_types
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 320, size=n) for n in (20, 37)]
    plan = make_plan(m.decls(kv_dtype="float32"), page_size=page_size)
    run = generate(m, plan, prompts, 12, chunk=chunk)
    assert len(set(run.state_slots.values())) == len(prompts) and 0 not in run.state_slots.values()
    for p, toks, logits in zip(prompts, run.tokens, run.logits):
        seq = np.concatenate([p, toks])
        ref = np.asarray(m.dense_logits(m.params, jnp.asarray(seq[None])))[0]
        assert toks == ref[len(p) - 1:-1].argmax(-1).tolist()
        assert max(rel_err(lg, ref[pos]) for pos, lg in logits) <= 1e-4


def test_hybrid_forward_updates_arena_in_place():
    from umem_jax.arena import Arena, check_in_place
    from umem_jax.core.batch import make_batch

    m = tiny_model()
    plan = make_plan(m.decls(), page_size=8)
    arena = Arena.abstract(plan, 1 << 16)  # 4 MiB: big enough that activations are not mistaken for a copy
    for t in (1, 8):
        batch = make_batch(np.zeros((2, t)), np.full(2, t), np.full(2, t), {n: np.zeros((2, 4)) for n in plan.names
                                                                           if n != "state"}, np.array([1, 2]))
        check_in_place(m.jit_forward().lower(m.params, arena, batch).compile(), arena)
