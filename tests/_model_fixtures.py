"""The committed model fixtures (made by scripts/make_fixtures.py with transformers) and the
helpers the family tests compare against them with.

Each fixture directory holds a tiny random checkpoint (config.json, model.safetensors) and
expected.npz: per prompt ("short", "long") the prompt, transformers' greedy continuation, its
cache-free logits over prompt + continuation, and for the recurrent families its cached decode's
step logits and the state after prefill.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from _model_arena import generate

from umem_jax.memory import plan as make_plan

FIXTURES = Path(__file__).parent / "fixtures"
PROMPTS = ("short", "long")
RTOL = 1e-4  # max |ours - transformers| / max |transformers|, fp32


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a) - b).max() / np.abs(b).max())


@functools.cache
def fixture_model(name: str):
    """The fixture's Model, loaded once per process.  One jitted step per kernel choice for all
    the tests: runs with the same plan and chunk size reuse its compilations (CI time is mostly
    XLA compiles on 2 cores)."""
    from umem_jax.models.loader import load_model

    m = load_model(FIXTURES / name)
    m.jit_forward = functools.lru_cache(m.jit_forward)
    return m


def model_fixture(name: str):
    """A module-scoped pytest fixture `model`: the fixture's shared Model (`model = model_fixture(NAME)`)."""
    return pytest.fixture(scope="module", name="model")(lambda: fixture_model(name))


def expected(name: str, case: str = "expected") -> dict:
    return dict(np.load(FIXTURES / name / f"{case}.npz"))


def copy_fixture(tmp_path, name: str) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / name, d)
    return d


def bf16_checkpoint(tmp_path, name: str) -> Path:
    """A copy of the fixture with bf16 weights and config.json saying so."""
    from safetensors.flax import load_file, save_file

    d = copy_fixture(tmp_path, name)
    t = load_file(str(d / "model.safetensors"))
    save_file({k: v.astype(jnp.bfloat16) for k, v in t.items()}, str(d / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def dense_logits(model, params, e) -> dict:
    """Cache-free logits over prompt + greedy for both prompts in one batch (right-padded: causal,
    so the padding never reaches the real tokens; one compile)."""
    seqs = {n: np.concatenate([e[f"{n}_prompt"], e[f"{n}_greedy"]]) for n in PROMPTS}
    toks = np.zeros((len(seqs), max(map(len, seqs.values()))), np.int32)
    for i, s in enumerate(seqs.values()):
        toks[i, :len(s)] = s
    lg = np.asarray(model.dense_logits(params, jnp.asarray(toks)))
    return {n: lg[i, :len(s)] for i, (n, s) in enumerate(seqs.items())}


def arena_run(m, e, *, page_size=4, chunk=8, n_new=32):
    """Both prompts greedily through the arena (fp32 K/V and state) -> (plan, Run)."""
    plan = make_plan(m.decls(kv_dtype="float32"), page_size=page_size)
    return plan, generate(m, plan, [e[f"{n}_prompt"] for n in PROMPTS], n_new, chunk=chunk)
