"""NemotronH parity on the committed tiny fixture (made by scripts/make_fixtures.py with transformers).

The fixture: 6 blocks "M-M*M-" (Mamba2, relu^2 MLP, NoPE attention), Mamba2 4 heads x 16 in 2
groups, state 16, HF chunk_size 16, every parameter random (norms, A_log, dt_bias, D too).  A
second case, expected_small_dt.npz, is the same weights with dt_bias of heads 1 and 3 pushed to
~-8 (small_dt_bias.npz): softplus(dt) < time_step_min, so transformers' prefill-only dt clamp
bites and its cached decode differs from a cache-free recompute by ~3e-3.  The arena path must
reproduce transformers' *cached* behaviour (clamped prefill, unclamped decode), the dense path
its cache-free one.  CI needs no torch: `test_live_transformers` re-checks against transformers
when it is installed.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _model_arena import generate
from flax import nnx

from umem_jax.arena import Arena, check_in_place, read_kv, read_state
from umem_jax.core.batch import make_batch
from umem_jax.memory import Full, State
from umem_jax.memory import plan as make_plan
from umem_jax.models.config import from_hf_config, load_hf_config
from umem_jax.models.loader import load_model, load_safetensors

FIXTURE = Path(__file__).parents[1] / "fixtures" / "nemotron_h_tiny"
PROMPTS = ("short", "long")
MAMBA_LAYERS = (0, 2, 4)
RTOL = 1e-4  # max |ours - transformers| / max |transformers|, fp32


@pytest.fixture(scope="module")
def model():
    m = load_model(FIXTURE)
    # One jitted step per kernel choice for the whole module: runs with the same plan and chunk
    # size then reuse its compilations (CI time is mostly XLA compiles on 2 cores).
    m.jit_forward = functools.lru_cache(m.jit_forward)
    return m


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


def _expected(case: str) -> dict:
    return dict(np.load(FIXTURE / f"{case}.npz"))


@pytest.fixture(scope="module")
def expected():
    return _expected("expected")


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a) - b).max() / np.abs(b).max())


# ----------------------------------------------------------------------------- config


def test_hub_keys_normalise_like_5x_keys():
    """hybrid_override_pattern, mamba_n_groups / mamba_d_conv / mamba_chunk_size / mamba_dt_min, torch_dtype."""
    assert from_hf_config(json.loads((FIXTURE / "config_hub.json").read_text())) == load_hf_config(FIXTURE)


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
    ("M-E*", NotImplementedError, "MoE blocks .*layers \\[2\\].*dense"),
    ("M-X*", ValueError, "unknown characters \\['X'\\]"),
])
def test_pattern_refusals(pattern, err, match):
    d = json.loads((FIXTURE / "config_hub.json").read_text())
    d["hybrid_override_pattern"] = pattern
    with pytest.raises(err, match=match):
        from_hf_config(d)


def test_decls_state_and_full(model):
    decls = model.decls()
    assert [d.layer for d in decls] == [0, 2, 3, 4]  # MLP blocks keep nothing
    assert [type(d.parts[0].lifetime) for d in decls] == [State, State, Full, State]
    conv, ssm = decls[0].parts[0].geometry.tensors
    assert (conv.shape, conv.dtype) == ((3, 64 + 2 * 2 * 16), "bfloat16")
    assert (ssm.shape, ssm.dtype) == ((4, 16, 16), "float32")
    assert make_plan(decls, page_size=4).names == ("state", "full")


# ----------------------------------------------------------------------------- loading


def _copy_fixture(tmp_path) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, d)
    return d


def test_missing_tensor_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    d = _copy_fixture(tmp_path)
    t = load_file(d / "model.safetensors")
    del t["backbone.layers.2.mixer.A_log"]
    save_file(t, d / "model.safetensors")
    with pytest.raises(KeyError, match="missing 1 tensor.*layers.2.mixer.A_log"):
        load_safetensors(d)


def test_in_memory_model_names_load_too(tmp_path, model, expected):
    """transformers' in-memory names (`model.*`, not the hub's `backbone.*`) map to the same params."""
    from safetensors.numpy import load_file, save_file

    d = _copy_fixture(tmp_path)
    t = load_file(d / "model.safetensors")
    save_file({k.replace("backbone.", "model.", 1): v for k, v in t.items()}, d / "model.safetensors")
    m = load_safetensors(d)
    jax.tree.map(np.testing.assert_array_equal, m.params, model.params)


def test_bf16_checkpoint_runs_close(tmp_path, expected):
    """bf16 weights, bf16 conv state and K/V in the arena (the serving default), teacher-forced."""
    from safetensors.flax import load_file, save_file

    d = _copy_fixture(tmp_path)
    t = load_file(str(d / "model.safetensors"))
    save_file({k: v.astype(jnp.bfloat16) for k, v in t.items()}, str(d / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (d / "config.json").write_text(json.dumps(cfg))
    m = load_safetensors(d)
    assert {x.dtype for x in jax.tree.leaves(m.params)} == {jnp.dtype(jnp.bfloat16)}
    run = generate(m, make_plan(m.decls(), page_size=4), [expected["short_prompt"]], 8, chunk=8,
                   teacher=[expected["short_greedy"]], num_rows=4096)  # bf16 rows are narrower: more of them
    assert max(rel_err(lg, expected["short_logits"][pos]) for pos, lg in run.logits[0]) <= 5e-2


# ----------------------------------------------------------------------------- parity


def _dense(model, params, e) -> dict:
    """Cache-free logits over prompt + greedy for both prompts in one batch (right-padded: causal,
    so the padding never reaches the real tokens; one compile)."""
    seqs = {n: np.concatenate([e[f"{n}_prompt"], e[f"{n}_greedy"]]) for n in PROMPTS}
    toks = np.zeros((len(seqs), max(map(len, seqs.values()))), np.int32)
    for i, s in enumerate(seqs.values()):
        toks[i, :len(s)] = s
    lg = np.asarray(model.dense_logits(params, jnp.asarray(toks)))
    return {n: lg[i, :len(s)] for i, (n, s) in enumerate(seqs.items())}


@pytest.mark.parametrize("case", ["expected", "expected_small_dt"])
def test_dense_logits_match_transformers(model, small_dt_model, case):
    """Cache-free forward (dt clamped everywhere, as transformers' cache-free scan) vs transformers."""
    params, e = (model if case == "expected" else small_dt_model).params, _expected(case)
    for name, lg in _dense(model, params, e).items():
        assert rel_err(lg, e[f"{name}_logits"]) <= RTOL, name


def _arena_run(m, e, *, page_size=4, chunk=8, n_new=32):
    plan = make_plan(m.decls(kv_dtype="float32"), page_size=page_size)
    return plan, generate(m, plan, [e[f"{n}_prompt"] for n in PROMPTS], n_new, chunk=chunk)


@pytest.mark.parametrize("page_size,chunk", [(4, 8), pytest.param(8, 5, marks=pytest.mark.slow)])
def test_arena_greedy_matches_transformers(model, expected, page_size, chunk):
    """fp32 state and K/V in a NaN-filled arena: chunked prefill (3-6 chunks per prompt, the state
    carried from chunk to chunk through the slot, decode rows riding in prefill chunks), then
    T == 1 decode steps reading and writing the slot; 32 greedy tokens."""
    _, run = _arena_run(model, expected, page_size=page_size, chunk=chunk)
    for i, name in enumerate(PROMPTS):
        assert run.tokens[i] == expected[f"{name}_greedy"].tolist()
        ref = expected[f"{name}_logits"]
        assert max(rel_err(lg, ref[pos]) for pos, lg in run.logits[i]) <= RTOL


def test_arena_small_dt_reproduces_the_prefill_only_clamp(small_dt_model):
    """The arena path matches transformers' cached generate (clamped prefill, unclamped decode)
    and, like it, departs from the cache-free logits."""
    e = _expected("expected_small_dt")
    _, run = _arena_run(small_dt_model, e)
    for i, name in enumerate(PROMPTS):
        assert run.tokens[i] == e[f"{name}_greedy"].tolist()
        n = len(e[f"{name}_prompt"])
        step, full = e[f"{name}_step_logits"], e[f"{name}_logits"]
        assert max(rel_err(lg, step[pos - n + 1]) for pos, lg in run.logits[i]) <= RTOL
        assert max(rel_err(lg, full[pos]) for pos, lg in run.logits[i]) > 5e-4  # the quirk is real


def test_state_after_chunked_prefill_matches_transformers_cache(model, expected):
    """conv window and SSM state in each request's slot after prefill (3-4 chunks of 8) vs
    transformers' cache (its conv keeps K columns, ours the last K-1)."""
    plan, run = _arena_run(model, expected, n_new=1)
    for i, name in enumerate(PROMPTS):
        slots = jnp.asarray([run.state_slots[i]], jnp.int32)
        for layer in MAMBA_LAYERS:
            st = read_state(run.arena, slots, layer=layer)
            conv_ref = expected[f"{name}_conv{layer}"][:, 1:].T       # [K-1, conv_dim]
            assert rel_err(st["conv"][0], conv_ref) <= 1e-5, (name, layer)
            assert rel_err(st["ssm"][0], expected[f"{name}_rec{layer}"]) <= RTOL, (name, layer)


@pytest.mark.parametrize("t", [1, 8])
def test_forward_updates_arena_in_place(model, t):
    plan = make_plan(model.decls(), page_size=4)
    arena = Arena.abstract(plan, 32768)  # big enough that the step's activations are not mistaken for a copy
    b, p = 2, 8
    batch = make_batch(np.zeros((b, t)), np.full(b, t), np.full(b, t), {"full": np.zeros((b, p))}, np.arange(1, b + 1))
    compiled = model.jit_forward().lower(model.params, arena, batch).compile()
    check_in_place(compiled, arena)


@pytest.mark.slow  # ~40 s of interpret-mode tracing on 2 cores; the kernels' own tests cover interpret in CI
def test_pallas_decode_step_interpret_mode(model, expected):
    """One T == 1 step through the Pallas kernels (interpret mode on CPU: Mamba2 decode, kv_write,
    paged decode) equals the reference kernels' step: logits, state and K/V."""
    plan = make_plan(model.decls(kv_dtype="float32"), page_size=4)
    arena = Arena.create(plan, 2048, debug_nan=True)
    tables, slots = {"full": jnp.asarray([[40, 41, 42]], jnp.int32)}, jnp.asarray([3], jnp.int32)
    prompt = expected["short_prompt"][:8]
    _, arena = model.jit_forward()(model.params, arena, make_batch(prompt[None], [8], [8], tables, slots))
    step = make_batch(np.array([[int(expected["short_greedy"][0])]]), [1], [9], tables, slots)
    ref_logits, ref_arena = model.jit_forward()(model.params, arena.replace(jnp.copy(arena.data)), step)
    logits, arena = model.jit_forward(interpret=True)(model.params, arena, step)
    assert rel_err(logits, np.asarray(ref_logits)) <= 1e-5
    for layer in MAMBA_LAYERS:
        got, want = read_state(arena, slots, layer=layer), read_state(ref_arena, slots, layer=layer)
        assert all(rel_err(got[k], np.asarray(want[k])) <= 1e-5 for k in ("conv", "ssm")), layer
    (k, v), (k_ref, v_ref) = read_kv(arena, tables["full"], layer=3), read_kv(ref_arena, tables["full"], layer=3)
    assert rel_err(k[:, :9], np.asarray(k_ref[:, :9])) <= 1e-5 and rel_err(v[:, :9], np.asarray(v_ref[:, :9])) <= 1e-5


# ----------------------------------------------------------------------------- random, real shapes


def test_realistic_random_shape_matches_its_preset():
    """registry.build_random("nemotronh-8b-like"): abstract (no memory) here; its memory is the preset's."""
    from umem_jax.models.presets import nemotronh_8b_like
    from umem_jax.models.registry import build_random

    m = build_random("nemotronh-8b-like", abstract=True)
    assert 7.9e+09 < sum(int(np.prod(x.shape)) for x in jax.tree.leaves(m.params)) < 8.3e+09
    assert {x.dtype for x in jax.tree.leaves(m.params)} == {jnp.dtype(jnp.bfloat16)}
    assert [m.config.layer_types.count(t) for t in ("linear_attention", "full_attention", "mlp")] == [24, 4, 24]
    key = lambda decls: [(d.layer, [(p.geometry, type(p.lifetime)) for p in d.parts]) for d in decls]
    assert key(m.decls()) == key(nemotronh_8b_like())


def test_build_random_makes_a_runnable_model(model):
    from umem_jax.models.registry import build_random

    m = build_random(model.config, "float32")
    assert jax.tree.structure(m.params) == jax.tree.structure(model.params)
    lg = np.asarray(model.dense_logits(m.params, jnp.arange(1, 9, dtype=jnp.int32)[None]))  # same graph
    assert lg.shape == (1, 8, 128) and np.isfinite(lg).all() and lg.std() > 0


# ----------------------------------------------------------------------------- live oracle

_HAS_ORACLE = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None


@pytest.mark.skipif(not _HAS_ORACLE, reason="torch and transformers not installed (CI uses the committed expected.npz)")
def test_live_transformers(model):
    """Load the fixture in transformers and compare on a fresh prompt, dense and greedy."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32, attn_implementation="eager").eval()
    p = np.random.default_rng(11).integers(3, 128, size=27)
    ids = torch.tensor(p[None], dtype=torch.long)
    with torch.no_grad():
        gen = hf.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
        ref = hf(gen, use_cache=False).logits[0].numpy()
    assert rel_err(model.dense_logits(model.params, jnp.asarray(gen.numpy()))[0], ref) <= RTOL
    run = generate(model, make_plan(model.decls(kv_dtype="float32"), page_size=4), [p], 16, chunk=8)
    assert run.tokens[0] == gen[0, len(p):].tolist()
