"""NemotronH parity on the committed tiny fixture (made by scripts/make_fixtures.py with transformers).

The fixture: 6 blocks "M-M*M-" (Mamba2, relu^2 MLP, NoPE attention), Mamba2 4 heads x 16 in 2
groups, state 16, HF chunk_size 16, every parameter random (norms, A_log, dt_bias, D too).  A
second case, expected_small_dt.npz, is the same weights with dt_bias of heads 1 and 3 pushed to
~-8 (small_dt_bias.npz): softplus(dt) < time_step_min, so transformers' prefill-only dt clamp
bites and its cached decode differs from a cache-free recompute by ~3e-3.  The arena path must
reproduce transformers' *cached* behaviour (clamped prefill, unclamped decode), the dense path
its cache-free one.  The checks NemotronH shares with the other families are in test_families.py.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _model_arena import generate
from _model_fixtures import (
    FIXTURES,
    PROMPTS,
    RTOL,
    arena_run,
    bf16_checkpoint,
    copy_fixture,
    dense_logits,
    expected,
    model_fixture,
    rel_err,
)
from flax import nnx

from umem_jax.memory import plan as make_plan
from umem_jax.models.loader import load_safetensors
from umem_jax.models.registry import from_hf_config

NAME = "nemotron_h_tiny"
FIXTURE = FIXTURES / NAME
model = model_fixture(NAME)


@pytest.fixture(scope="module")
def small_dt_model(model):
    """The fixture's weights with small_dt_bias.npz's dt_bias (only those differ)."""
    over = dict(np.load(FIXTURE / "small_dt_bias.npz"))
    flat = nnx.to_flat_state(jax.tree.map(lambda x: x, model.params))
    for path, var in flat:
        name = ".".join(map(str, path))
        if name in over:
            var.set_value(jnp.asarray(over.pop(name)))
    assert not over, f"unused dt_bias overrides {sorted(over)}"
    m = dataclasses.replace(model, params=nnx.from_flat_state(flat))
    m.jit_forward = model.jit_forward  # same graph, same compiled steps
    return m


# ----------------------------------------------------------------------------- config


def test_config_fields(model):
    cfg = model.config
    assert cfg.architecture == "NemotronHForCausalLM"
    assert cfg.layer_types == ("linear_attention", "mlp", "linear_attention", "full_attention", "linear_attention",
                               "mlp")
    m = cfg.mamba
    assert (m.num_heads, m.head_dim, m.state_size, m.n_groups, m.conv_kernel) == (4, 16, 16, 2, 4)
    assert cfg.time_step_min == 1e-3 and cfg.use_conv_bias and not cfg.tie_word_embeddings
    assert cfg.attn_scale == pytest.approx(16 ** -0.5) and cfg.rms_norm_eps == 1e-5


@pytest.mark.parametrize("pattern,err,match", [
    ("M-X*", ValueError, "unknown characters \\['X'\\]"),  # "E" (MoE) parses: test_models_nemotron_h_moe.py
])
def test_pattern_refusals(pattern, err, match):
    d = json.loads((FIXTURE / "config_hub.json").read_text())
    d["hybrid_override_pattern"] = pattern
    with pytest.raises(err, match=match):
        from_hf_config(d)


# ----------------------------------------------------------------------------- loading


def test_in_memory_model_names_load_too(tmp_path, model):
    """transformers' in-memory names (`model.*`, not the hub's `backbone.*`) map to the same params."""
    from safetensors.numpy import load_file, save_file

    d = copy_fixture(tmp_path, NAME)
    t = load_file(d / "model.safetensors")
    save_file({k.replace("backbone.", "model.", 1): v for k, v in t.items()}, d / "model.safetensors")
    m = load_safetensors(d)
    jax.tree.map(np.testing.assert_array_equal, m.params, model.params)


def test_tie_word_embeddings_in_the_config_is_ignored(tmp_path, model):
    """transformers' NemotronH never ties its head to the embeddings, whatever the config says: it
    saves its own lm_head and computes with it.  A config with `tie_word_embeddings: true` loads the
    checkpoint's lm_head too (tying would silently give other logits)."""
    d = copy_fixture(tmp_path, NAME)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, tie_word_embeddings=True)))
    m = load_safetensors(d)
    assert not m.config.tie_word_embeddings
    jax.tree.map(np.testing.assert_array_equal, m.params, model.params)


def test_bf16_checkpoint_runs_close(tmp_path):
    """bf16 weights, bf16 conv state and K/V in the arena (the serving default), teacher-forced."""
    e = expected(NAME)
    m = load_safetensors(bf16_checkpoint(tmp_path, NAME))
    assert {x.dtype for x in jax.tree.leaves(m.params)} == {jnp.dtype(jnp.bfloat16)}
    run = generate(m, make_plan(m.decls(), page_size=4), [e["short_prompt"]], 8, chunk=8,
                   teacher=[e["short_greedy"]], num_rows=4096)  # bf16 rows are narrower: more of them
    assert max(rel_err(lg, e["short_logits"][pos]) for pos, lg in run.logits[0]) <= 5e-2


# ----------------------------------------------------------------------------- the dt clamp


def test_dense_logits_small_dt_match_transformers(model, small_dt_model):
    """Cache-free forward (dt clamped everywhere, as transformers' cache-free scan) vs transformers."""
    e = expected(NAME, "expected_small_dt")
    for name, lg in dense_logits(model, small_dt_model.params, e).items():
        assert rel_err(lg, e[f"{name}_logits"]) <= RTOL, name


def test_arena_small_dt_reproduces_the_prefill_only_clamp(small_dt_model):
    """The arena path matches transformers' cached generate (clamped prefill, unclamped decode)
    and, like it, departs from the cache-free logits."""
    e = expected(NAME, "expected_small_dt")
    _, run = arena_run(small_dt_model, e)
    for i, name in enumerate(PROMPTS):
        assert run.tokens[i] == e[f"{name}_greedy"].tolist()
        n = len(e[f"{name}_prompt"])
        step, full = e[f"{name}_step_logits"], e[f"{name}_logits"]
        assert max(rel_err(lg, step[pos - n + 1]) for pos, lg in run.logits[i]) <= RTOL
        assert max(rel_err(lg, full[pos]) for pos, lg in run.logits[i]) > 5e-4  # the quirk is real
