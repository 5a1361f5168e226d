"""Qwen3.5 text parity on the committed tiny fixture (made by scripts/make_fixtures.py with transformers).

The fixture: 4 layers (gated DeltaNet x2, gated attention, gated DeltaNet), GDN with 2 key heads
serving 4 value heads of 16, attention 4 q / 2 kv heads of 16 with partial RoPE (4 of 16 dims),
tied embeddings, every parameter random (the zero-centred norms, the GDN gated norm, A_log,
dt_bias too).  transformers' cache-free forward uses its chunked delta rule, its cached decode the
recurrent one; both agree with ours to ~1e-5.  CI needs no torch: `test_live_transformers`
re-checks against transformers when it is installed.
"""

from __future__ import annotations

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

from umem_jax.arena import Arena, check_in_place, read_kv, read_state
from umem_jax.core.batch import make_batch
from umem_jax.memory import Full, State
from umem_jax.memory import plan as make_plan
from umem_jax.models.config import from_hf_config, load_hf_config
from umem_jax.models.loader import load_model, load_safetensors

FIXTURE = Path(__file__).parents[1] / "fixtures" / "qwen3_5_tiny"
PROMPTS = ("short", "long")
GDN_LAYERS = (0, 1, 3)
RTOL = 1e-4  # max |ours - transformers| / max |transformers|, fp32


@pytest.fixture(scope="module")
def model():
    m = load_model(FIXTURE)
    # One jitted step per kernel choice for the whole module: runs with the same plan and chunk
    # size then reuse its compilations (CI time is mostly XLA compiles on 2 cores).
    m.jit_forward = functools.lru_cache(m.jit_forward)
    return m


@pytest.fixture(scope="module")
def expected():
    return dict(np.load(FIXTURE / "expected.npz"))


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a) - b).max() / np.abs(b).max())


# ----------------------------------------------------------------------------- config


def test_config_fields(model):
    cfg = model.config
    assert cfg.architecture == "Qwen3_5ForCausalLM"
    assert cfg.layer_types == ("linear_attention", "linear_attention", "full_attention", "linear_attention")
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim) == (2, 4, 16, 16, 4)
    assert cfg.rotary_dim == 4 and cfg.rope_for("full_attention").theta == 1e7 and cfg.tie_word_embeddings


def test_hub_style_config_normalises_like_5x():
    """full_attention_interval instead of layer_types, rope_theta / partial_rotary_factor at top level."""
    d = json.loads((FIXTURE / "config.json").read_text())
    d = {k: v for k, v in d.items() if k not in ("layer_types", "rope_parameters")}
    d.update(full_attention_interval=3, rope_theta=1e7, partial_rotary_factor=0.25, num_hidden_layers=4)
    cfg = from_hf_config(d)
    assert cfg.layer_types == ("linear_attention", "linear_attention", "full_attention", "linear_attention")
    assert cfg == load_hf_config(FIXTURE)


def test_moe_variant_is_refused():
    with pytest.raises(NotImplementedError, match="Qwen3.5 MoE.*dense"):
        from_hf_config({"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text"})


def test_decls_state_and_full(model):
    decls = model.decls()
    assert [type(d.parts[0].lifetime) for d in decls] == [State, State, Full, State]
    conv, rec = decls[0].parts[0].geometry.tensors
    assert (conv.shape, conv.dtype) == ((3, 2 * 2 * 16 + 4 * 16), "bfloat16")
    assert (rec.shape, rec.dtype) == ((4, 16, 16), "float32")
    assert make_plan(decls, page_size=4).names == ("state", "full")


# ----------------------------------------------------------------------------- loading


def _copy_fixture(tmp_path) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, d)
    return d


def test_multimodal_hub_checkpoint_loads_the_text_decoder(tmp_path, model, expected):
    """Qwen3_5ForConditionalGeneration layout: config under text_config, weights under
    model.language_model.*, plus model.visual.* and mtp.* tensors that are skipped."""
    from safetensors.numpy import load_file, save_file

    d = _copy_fixture(tmp_path)
    text = json.loads((d / "config.json").read_text())
    outer = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
             "tie_word_embeddings": True, "vision_config": {"depth": 2}}
    (d / "config.json").write_text(json.dumps(outer))
    t = load_file(d / "model.safetensors")
    t = {k.replace("model.", "model.language_model.", 1): v for k, v in t.items()}
    t["model.visual.blocks.0.attn.qkv.weight"] = np.zeros((3, 2), np.float32)
    t["mtp.layers.0.mlp.up_proj.weight"] = np.zeros((2, 2), np.float32)
    save_file(t, d / "model.safetensors")
    m = load_safetensors(d)
    jax.tree.map(np.testing.assert_array_equal, m.params, model.params)


def test_missing_tensor_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    d = _copy_fixture(tmp_path)
    t = load_file(d / "model.safetensors")
    del t["model.layers.1.linear_attn.dt_bias"]
    save_file(t, d / "model.safetensors")
    with pytest.raises(KeyError, match="missing 1 tensor.*layers.1.linear_attn.dt_bias"):
        load_safetensors(d)


def test_bf16_checkpoint_runs_close(tmp_path, expected):
    """bf16 weights, bf16 conv state and K/V in the arena (the serving default), teacher-forced.

    The random tiny model amplifies rounding: transformers' own bf16 run is 0.42 (max rel) away
    from its fp32 logits on this prompt, so bf16 is checked for being close in shape, not value."""
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
    for pos, lg in run.logits[0]:
        ref = expected["short_logits"][pos]
        assert rel_err(lg, ref) <= 0.3 and np.corrcoef(lg, ref)[0, 1] > 0.97


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


def test_dense_logits_match_transformers(model, expected):
    for name, lg in _dense(model, model.params, expected).items():
        assert rel_err(lg, expected[f"{name}_logits"]) <= RTOL, name


def _arena_run(m, e, *, page_size=4, chunk=8, n_new=32):
    plan = make_plan(m.decls(kv_dtype="float32"), page_size=page_size)
    return plan, generate(m, plan, [e[f"{n}_prompt"] for n in PROMPTS], n_new, chunk=chunk)


@pytest.mark.parametrize("page_size,chunk", [(4, 8), pytest.param(8, 5, marks=pytest.mark.slow)])
def test_arena_greedy_matches_transformers(model, expected, page_size, chunk):
    """fp32 state and K/V in a NaN-filled arena: chunked prefill (the state carried across 3-6
    chunks through the slot), then T == 1 decode steps; 32 greedy tokens, logits against both
    transformers' cache-free (chunked rule) and cached (recurrent rule) logits."""
    _, run = _arena_run(model, expected, page_size=page_size, chunk=chunk)
    for i, name in enumerate(PROMPTS):
        assert run.tokens[i] == expected[f"{name}_greedy"].tolist()
        n = len(expected[f"{name}_prompt"])
        full, step = expected[f"{name}_logits"], expected[f"{name}_step_logits"]
        assert max(rel_err(lg, full[pos]) for pos, lg in run.logits[i]) <= RTOL
        assert max(rel_err(lg, step[pos - n + 1]) for pos, lg in run.logits[i]) <= RTOL


def test_state_after_chunked_prefill_matches_transformers_cache(model, expected):
    """conv window and recurrent matrix in each request's slot after prefill vs transformers'
    cache (conv: HF keeps K columns, we the last K-1; recurrent: we store S^T, v-major)."""
    _, run = _arena_run(model, expected, n_new=1)
    for i, name in enumerate(PROMPTS):
        slots = jnp.asarray([run.state_slots[i]], jnp.int32)
        for layer in GDN_LAYERS:
            st = read_state(run.arena, slots, layer=layer)
            assert rel_err(st["conv"][0], expected[f"{name}_conv{layer}"][:, 1:].T) <= 1e-5, (name, layer)
            rec_ref = np.swapaxes(expected[f"{name}_rec{layer}"], -1, -2)   # [Hv, Dk, Dv] -> [Hv, Dv, Dk]
            assert rel_err(st["recurrent"][0], rec_ref) <= RTOL, (name, layer)


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
    """One T == 1 step through the Pallas kernels (interpret mode on CPU: GDN decode, kv_write,
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
    for layer in GDN_LAYERS:
        got, want = read_state(arena, slots, layer=layer), read_state(ref_arena, slots, layer=layer)
        assert all(rel_err(got[k], np.asarray(want[k])) <= 1e-5 for k in ("conv", "recurrent")), layer
    (k, v), (k_ref, v_ref) = read_kv(arena, tables["full"], layer=2), read_kv(ref_arena, tables["full"], layer=2)
    assert rel_err(k[:, :9], np.asarray(k_ref[:, :9])) <= 1e-5 and rel_err(v[:, :9], np.asarray(v_ref[:, :9])) <= 1e-5


# ----------------------------------------------------------------------------- random, real shapes


def test_realistic_random_shape_matches_its_preset():
    """registry.build_random("qwen3.5-4b-like"): abstract (no memory) here; its memory is the preset's."""
    from umem_jax.models.presets import qwen35_4b_like
    from umem_jax.models.registry import build_random

    m = build_random("qwen3.5-4b-like", abstract=True)
    assert 4.0e+09 < sum(int(np.prod(x.shape)) for x in jax.tree.leaves(m.params)) < 4.4e+09
    assert {x.dtype for x in jax.tree.leaves(m.params)} == {jnp.dtype(jnp.bfloat16)}
    assert m.config.layer_types.count("full_attention") == 8 and m.config.num_layers == 32
    key = lambda decls: [(d.layer, [(p.geometry, type(p.lifetime)) for p in d.parts]) for d in decls]
    assert key(m.decls()) == key(qwen35_4b_like())


@pytest.mark.slow  # ~15 s (random init traced op by op); NemotronH's twin runs in CI
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
