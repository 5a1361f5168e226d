"""The checks every transformers-made fixture family passes alike: Gemma 3, NemotronH, Qwen3.5.

Loading (hub-era keys, a missing tensor named), the arena updated in place, and for the two
recurrent families (NemotronH: Mamba2; Qwen3.5: gated DeltaNet) parity with transformers: dense
logits, greedy tokens and logits through the arena, the state left in each request's slot, one
Pallas decode step in interpret mode, and the realistic random shapes.  What a family alone has
stays in its test_models_<family>.py.  CI needs no torch: `test_live_transformers` re-checks
against transformers when it is installed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
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
    copy_fixture,
    dense_logits,
    expected,
    fixture_model,
    rel_err,
)

from umem_jax.arena import Arena, check_in_place, read_kv, read_state
from umem_jax.core.batch import make_batch
from umem_jax.memory import Full, State
from umem_jax.memory import plan as make_plan
from umem_jax.models.loader import load_safetensors
from umem_jax.models.registry import build_random, from_hf_config, load_hf_config


@dataclasses.dataclass(frozen=True)
class Family:
    fixture: str
    missing: tuple[str, str]  # a checkpoint tensor, and the parameter the error must name
    in_place_steps: tuple[int, ...]  # T of the steps whose compiled arena update is checked
    in_place_rows: int  # arena rows: big enough that the step's activations are not mistaken for a copy
    live: tuple[tuple[int, ...], int, int]  # live oracle: prompt lengths, new tokens, chunk


@dataclasses.dataclass(frozen=True)
class Recurrent:
    """A fixture family with recurrent layers (the state checks)."""

    family: str
    state_layers: tuple[int, ...]
    attention_layer: int
    conv_dim: int
    state: str  # the second state tensor: Mamba2's "ssm", gated DeltaNet's "recurrent"
    hf_state_layout: bool  # stored as transformers' cache has it (else transposed: v-major)
    decl_layers: tuple[int, ...]
    shape: str  # registry.build_random name
    shape_params: tuple[float, float]
    shape_layer_types: dict
    shape_layers: int
    state_shape: tuple[int, ...] = (4, 16, 16)  # one layer's recurrent state


FAMILIES = {
    "gemma3": Family("gemma3_tiny", ("model.layers.5.self_attn.k_norm.weight", "layers.5.self_attn.k_norm.weight"),
                     (1, 4), 32768, ((13, 27), 32, 6)),
    "nemotron_h": Family("nemotron_h_tiny", ("backbone.layers.2.mixer.A_log", "layers.2.mixer.A_log"),
                         (1, 8), 32768, ((27,), 16, 8)),
    "qwen3_5": Family("qwen3_5_tiny", ("model.layers.1.linear_attn.dt_bias", "layers.1.linear_attn.dt_bias"),
                      (1, 8), 32768, ((27,), 16, 8)),
    "nemotron_h_moe": Family("nemotron_h_moe_tiny", ("backbone.layers.1.mixer.gate.e_score_correction_bias",
                                                     "layers.1.mixer.gate.e_score_correction_bias"),
                             (1, 8), 32768, ((27,), 16, 8)),
    "gpt_oss": Family("gpt_oss_tiny", ("model.layers.1.self_attn.sinks", "layers.1.self_attn.sinks"),
                      (1, 4), 32768, ((13, 27), 32, 6)),
    "qwen3_5_moe": Family("qwen3_5_moe_tiny", ("model.layers.2.mlp.experts.5.up_proj.weight",
                                               "layers.2.mlp.experts.5.up_proj.weight"), (1, 8), 32768, ((27,), 16, 8)),
    "qwen3_next": Family("qwen3_next_tiny", ("model.layers.1.mlp.down_proj.weight", "layers.1.mlp.down_proj.weight"),
                         (1, 8), 32768, ((27,), 16, 8)),
}
# NemotronH: Mamba2 4 heads x 16 in 2 groups, state 16; MLP blocks 1 and 5 keep nothing.
# Qwen3.5: gated DeltaNet 2 key heads of 16 serving 4 value heads of 16.
RECURRENT = {
    "nemotron_h": Recurrent("nemotron_h", (0, 2, 4), 3, 64 + 2 * 2 * 16, "ssm", True, (0, 2, 3, 4),
                            "nemotronh-8b-like", (7.9e+09, 8.3e+09),
                            {"linear_attention": 24, "full_attention": 4, "mlp": 24}, 52),
    "qwen3_5": Recurrent("qwen3_5", (0, 1, 3), 2, 2 * 2 * 16 + 4 * 16, "recurrent", False, (0, 1, 2, 3),
                         "qwen3.5-4b-like", (4.0e+09, 4.4e+09), {"full_attention": 8}, 32),
    # Qwen3.5-MoE / Qwen3-Next: gated DeltaNet 2 key heads of 8 serving 4 value heads of 8.
    "qwen3_5_moe": Recurrent("qwen3_5_moe", (0, 1, 3), 2, 2 * 2 * 8 + 4 * 8, "recurrent", False, (0, 1, 2, 3),
                             "qwen3.5-35b-a3b-like", (34.5e+09, 34.8e+09), {"full_attention": 10}, 40, (4, 8, 8)),
    "qwen3_next": Recurrent("qwen3_next", (0, 1, 3), 2, 2 * 2 * 8 + 4 * 8, "recurrent", False, (0, 1, 2, 3),
                            "qwen3-next-80b-a3b-like", (79.5e+09, 79.9e+09), {"full_attention": 12}, 48, (4, 8, 8)),
}


def _model(family: str):
    return fixture_model(FAMILIES[family].fixture)


def _expected(family: str, case: str = "expected") -> dict:
    return expected(FAMILIES[family].fixture, case)


# ----------------------------------------------------------------------------- loading


@pytest.mark.parametrize("family", ["gemma3", "nemotron_h"])
def test_hub_keys_normalise_like_5x_keys(family):
    """Gemma 3: sliding_window_pattern, rope_theta / rope_local_base_freq / rope_scaling,
    torch_dtype.  NemotronH: hybrid_override_pattern, mamba_n_groups / mamba_d_conv /
    mamba_chunk_size / mamba_dt_min, torch_dtype."""
    d = FIXTURES / FAMILIES[family].fixture
    assert from_hf_config(json.loads((d / "config_hub.json").read_text())) == load_hf_config(d)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_missing_tensor_is_named(tmp_path, family):
    from safetensors.numpy import load_file, save_file

    hf_name, ours = FAMILIES[family].missing
    d = copy_fixture(tmp_path, FAMILIES[family].fixture)
    t = load_file(d / "model.safetensors")
    del t[hf_name]
    save_file(t, d / "model.safetensors")
    with pytest.raises(KeyError, match=f"missing 1 tensor.*{ours}"):
        load_safetensors(d)


@pytest.mark.parametrize("family,t", [(f, t) for f in FAMILIES for t in FAMILIES[f].in_place_steps])
def test_forward_updates_arena_in_place(family, t):
    model = _model(family)
    plan = make_plan(model.decls(), page_size=4)
    arena = Arena.abstract(plan, FAMILIES[family].in_place_rows)
    b, p = 2, 8
    tables = {sp.name: np.zeros((b, p)) for sp in plan.subpools if sp.kind != "state"}
    slots = np.arange(1, b + 1) if plan.state is not None else None
    batch = make_batch(np.zeros((b, t)), np.full(b, t), np.full(b, t), tables, slots)
    compiled = model.jit_forward().lower(model.params, arena, batch).compile()
    check_in_place(compiled, arena)


# ----------------------------------------------------------------------------- recurrent families


@pytest.mark.parametrize("family", list(RECURRENT))
def test_decls_state_and_full(family):
    spec = RECURRENT[family]
    decls = _model(family).decls()
    assert [d.layer for d in decls] == list(spec.decl_layers)
    assert [type(d.parts[0].lifetime) for d in decls] == [State, State, Full, State]
    conv, state = decls[0].parts[0].geometry.tensors
    assert (conv.shape, conv.dtype) == ((3, spec.conv_dim), "bfloat16")
    assert (state.name, state.shape, state.dtype) == (spec.state, spec.state_shape, "float32")
    assert make_plan(decls, page_size=4).names == ("state", "full")


@pytest.mark.parametrize("family", list(RECURRENT))
def test_dense_logits_match_transformers(family):
    model, e = _model(family), _expected(family)
    for name, lg in dense_logits(model, model.params, e).items():
        assert rel_err(lg, e[f"{name}_logits"]) <= RTOL, name


@pytest.mark.parametrize("page_size,chunk", [(4, 8), pytest.param(8, 5, marks=pytest.mark.slow)])
@pytest.mark.parametrize("family", list(RECURRENT))
def test_arena_greedy_matches_transformers(family, page_size, chunk):
    """fp32 state and K/V in a NaN-filled arena: chunked prefill (the state carried across 3-6
    chunks through the slot, decode rows riding in prefill chunks), then T == 1 decode steps
    reading and writing the slot; 32 greedy tokens, logits against both transformers' cache-free
    and cached (step by step) logits."""
    e = _expected(family)
    _, run = arena_run(_model(family), e, page_size=page_size, chunk=chunk)
    for i, name in enumerate(PROMPTS):
        assert run.tokens[i] == e[f"{name}_greedy"].tolist()
        n = len(e[f"{name}_prompt"])
        full, step = e[f"{name}_logits"], e[f"{name}_step_logits"]
        assert max(rel_err(lg, full[pos]) for pos, lg in run.logits[i]) <= RTOL
        assert max(rel_err(lg, step[pos - n + 1]) for pos, lg in run.logits[i]) <= RTOL


@pytest.mark.parametrize("family", list(RECURRENT))
def test_state_after_chunked_prefill_matches_transformers_cache(family):
    """conv window and SSM state / recurrent matrix in each request's slot after prefill (3-4
    chunks of 8) vs transformers' cache (its conv keeps K columns, ours the last K-1; gated
    DeltaNet's recurrent matrix is stored S^T, v-major)."""
    spec, e = RECURRENT[family], _expected(family)
    _, run = arena_run(_model(family), e, n_new=1)
    for i, name in enumerate(PROMPTS):
        slots = jnp.asarray([run.state_slots[i]], jnp.int32)
        for layer in spec.state_layers:
            st = read_state(run.arena, slots, layer=layer)
            conv_ref = e[f"{name}_conv{layer}"][:, 1:].T       # [K-1, conv_dim]
            assert rel_err(st["conv"][0], conv_ref) <= 1e-5, (name, layer)
            ref = e[f"{name}_rec{layer}"]
            ref = ref if spec.hf_state_layout else np.swapaxes(ref, -1, -2)   # [Hv, Dk, Dv] -> [Hv, Dv, Dk]
            assert rel_err(st[spec.state][0], ref) <= RTOL, (name, layer)


@pytest.mark.slow  # ~40 s of interpret-mode tracing on 2 cores; the kernels' own tests cover interpret in CI
@pytest.mark.parametrize("family", list(RECURRENT))
def test_pallas_decode_step_interpret_mode(family):
    """One T == 1 step through the Pallas kernels (interpret mode on CPU: the state decode kernel,
    kv_write, paged decode) equals the reference kernels' step: logits, state and K/V."""
    spec, model, e = RECURRENT[family], _model(family), _expected(family)
    plan = make_plan(model.decls(kv_dtype="float32"), page_size=4)
    arena = Arena.create(plan, 2048, debug_nan=True)
    full, slot = next(sp for sp in plan.subpools if sp.kind == "full"), 3
    while slot * plan.state.rows_per_page < 43 * full.rows_per_page:  # the slot's rows lie above pages 40-42
        slot += 1
    tables, slots = {"full": jnp.asarray([[40, 41, 42]], jnp.int32)}, jnp.asarray([slot], jnp.int32)
    prompt = e["short_prompt"][:8]
    _, arena = model.jit_forward()(model.params, arena, make_batch(prompt[None], [8], [8], tables, slots))
    step = make_batch(np.array([[int(e["short_greedy"][0])]]), [1], [9], tables, slots)
    ref_logits, ref_arena = model.jit_forward()(model.params, arena.replace(jnp.copy(arena.data)), step)
    logits, arena = model.jit_forward(interpret=True)(model.params, arena, step)
    assert rel_err(logits, np.asarray(ref_logits)) <= 1e-5
    for layer in spec.state_layers:
        got, want = read_state(arena, slots, layer=layer), read_state(ref_arena, slots, layer=layer)
        assert all(rel_err(got[k], np.asarray(want[k])) <= 1e-5 for k in ("conv", spec.state)), layer
    layer, table = spec.attention_layer, tables["full"]
    (k, v), (k_ref, v_ref) = read_kv(arena, table, layer=layer), read_kv(ref_arena, table, layer=layer)
    assert rel_err(k[:, :9], np.asarray(k_ref[:, :9])) <= 1e-5 and rel_err(v[:, :9], np.asarray(v_ref[:, :9])) <= 1e-5


# ----------------------------------------------------------------------------- random, real shapes


@pytest.mark.parametrize("family", list(RECURRENT))
def test_realistic_random_shape_matches_its_preset(family):
    """registry.build_random(name): abstract (no memory) here; its memory is the preset's."""
    from umem_jax.models.presets import preset

    spec = RECURRENT[family]
    m = build_random(spec.shape, abstract=True)
    low, high = spec.shape_params
    assert low < sum(int(np.prod(x.shape)) for x in jax.tree.leaves(m.params)) < high
    assert {x.dtype for x in jax.tree.leaves(m.params)} == {jnp.dtype(jnp.bfloat16)}
    assert {t: m.config.layer_types.count(t) for t in spec.shape_layer_types} == spec.shape_layer_types
    assert m.config.num_layers == spec.shape_layers
    key = lambda decls: [(d.layer, [(p.geometry, type(p.lifetime)) for p in d.parts]) for d in decls]
    assert key(m.decls()) == key(preset(spec.shape))


@pytest.mark.parametrize("family", ["nemotron_h", pytest.param("qwen3_5", marks=pytest.mark.slow)])  # ~15 s each
def test_build_random_makes_a_runnable_model(family):
    model = _model(family)
    m = build_random(model.config, "float32")
    assert jax.tree.structure(m.params) == jax.tree.structure(model.params)
    lg = np.asarray(model.dense_logits(m.params, jnp.arange(1, 9, dtype=jnp.int32)[None]))  # same graph
    assert lg.shape == (1, 8, 128) and np.isfinite(lg).all() and lg.std() > 0


# ----------------------------------------------------------------------------- live oracle

_HAS_ORACLE = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None


@pytest.mark.skipif(not _HAS_ORACLE, reason="torch and transformers not installed (CI uses the committed expected.npz)")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_live_transformers(family):
    """Load the fixture in transformers and compare on fresh prompts, dense and greedy."""
    import torch
    from transformers import AutoModelForCausalLM

    model, (lengths, n_new, chunk) = _model(family), FAMILIES[family].live
    hf = AutoModelForCausalLM.from_pretrained(FIXTURES / FAMILIES[family].fixture, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    rng = np.random.default_rng(11)
    for p in [rng.integers(3, 128, size=n) for n in lengths]:
        ids = torch.tensor(p[None], dtype=torch.long)
        with torch.no_grad():
            gen = hf.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
            ref = hf(gen, use_cache=False).logits[0].numpy()
        assert rel_err(model.dense_logits(model.params, jnp.asarray(gen.numpy()))[0], ref) <= RTOL
        run = generate(model, make_plan(model.decls(kv_dtype="float32"), page_size=4), [p], n_new, chunk=chunk)
        assert run.tokens[0] == gen[0, len(p):].tolist()
