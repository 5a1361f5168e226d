"""NemotronH with MoE blocks (Nemotron 3 Nano's kind) on the committed tiny fixture, and the
Nemotron 3 Nano 30B-A3B shape with random weights.

The fixture (scripts/fixtures_nemotron_moe.py, transformers 5.23 fp32): 6 blocks "ME*-ME", every
block kind; the MoE blocks have 8 relu^2 experts of 8, top-2, one shared expert of 16, sigmoid
routing with a random e_score_correction_bias (it changes the choice of most tokens), 4 groups of 2
of which 2 are kept (the grouping changes ~40% of the choices), routed_scaling_factor 2.5.  Its
checkpoint has the hub names: one tensor per expert.  The checks NemotronH MoE shares with the
other families (a missing tensor named, the arena updated in place, the live oracle) are in
test_families.py.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _model_fixtures import (
    FIXTURES,
    PROMPTS,
    RTOL,
    arena_run,
    copy_fixture,
    dense_logits,
    expected,
    model_fixture,
    rel_err,
)

from umem_jax import LLM, SamplingParams
from umem_jax.models.loader import load_safetensors
from umem_jax.models.registry import build_random, from_hf_config, load_hf_config

NAME = "nemotron_h_moe_tiny"
FIXTURE = FIXTURES / NAME
SHAPE = "nemotron-3-nano-30b-a3b-like"
model = model_fixture(NAME)


# ----------------------------------------------------------------------------- config


def test_config_fields(model):
    cfg = model.config
    assert cfg.layer_types == ("linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe")
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.shared_intermediate_size) == (8, 2, 8, 16)
    assert (moe.scoring, moe.score_correction_bias, moe.norm_topk_prob, moe.routed_scaling_factor) == (
        "sigmoid", True, True, 2.5)
    assert (moe.n_group, moe.topk_group, moe.expert_kind, moe.shared_expert_kind, moe.activation) == (
        4, 2, "ungated", "ungated", "relu2")
    assert [d.layer for d in model.decls()] == [0, 2, 4]  # MoE and MLP blocks keep no memory


def test_hub_keys_normalise_like_5x_keys():
    """hybrid_override_pattern "ME*-ME", mamba_* names, torch_dtype."""
    assert from_hf_config(json.loads((FIXTURE / "config_hub.json").read_text())) == load_hf_config(FIXTURE)


def test_moe_fields_default_as_transformers():
    """A pattern with "E" and no MoE fields: transformers' NemotronHConfig defaults (8 experts of
    7688, top-2, shared 7688, no grouping, scale 1)."""
    moe_keys = {"n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group",
                "moe_shared_expert_intermediate_size", "routed_scaling_factor", "norm_topk_prob"}
    d = {k: v for k, v in json.loads((FIXTURE / "config_hub.json").read_text()).items() if k not in moe_keys}
    moe = from_hf_config({**d, "hybrid_override_pattern": "M-E*", "num_hidden_layers": 4}).moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.shared_intermediate_size) == (8, 2, 7688, 7688)
    assert (moe.n_group, moe.topk_group, moe.routed_scaling_factor, moe.norm_topk_prob) == (1, 1, 1.0, True)


@pytest.mark.parametrize("key,value,match", [
    ("moe_latent_size", 16, "latent MoE .*moe_latent_size=16.*Nemotron 3 Super"),
    ("n_shared_experts", 2, "n_shared_experts=2"),
    ("n_group", 3, "n_group=3 must divide num_experts=8"),
])
def test_unsupported_moe_configs_are_named(key, value, match):
    d = json.loads((FIXTURE / "config.json").read_text())
    d[key] = value
    with pytest.raises((NotImplementedError, ValueError), match=match):
        from_hf_config(d)


# ----------------------------------------------------------------------------- checkpoint names


def test_per_expert_hub_tensors_are_stacked(model):
    """Expert j's up_proj.weight [I, d] is our experts.up_proj[j] transposed ([d, I]), and so on."""
    from safetensors.numpy import load_file

    t = load_file(FIXTURE / "model.safetensors")
    mixer = model.params["layers"][5]["mixer"]
    for j in (0, 7):
        up, down = (t[f"backbone.layers.5.mixer.experts.{j}.{p}.weight"] for p in ("up_proj", "down_proj"))
        np.testing.assert_array_equal(np.asarray(mixer["experts"]["up_proj"][...][j]), up.T)
        np.testing.assert_array_equal(np.asarray(mixer["experts"]["down_proj"][...][j]), down.T)
    np.testing.assert_array_equal(np.asarray(mixer["gate"]["e_score_correction_bias"][...]),
                                  t["backbone.layers.5.mixer.gate.e_score_correction_bias"])
    np.testing.assert_array_equal(np.asarray(mixer["shared_expert"]["up_proj"]["weight"][...]),
                                  t["backbone.layers.5.mixer.shared_experts.up_proj.weight"])


def test_bf16_load_keeps_the_correction_bias_fp32():
    """Served in bf16, the router's e_score_correction_bias stays the checkpoint's fp32 values
    (bf16 would round the small differences that pick experts); the weights become bf16."""
    from safetensors.numpy import load_file

    t = load_file(FIXTURE / "model.safetensors")
    m = load_safetensors(FIXTURE, dtype="bfloat16")
    gate = m.params["layers"][5]["mixer"]["gate"]
    bias = gate["e_score_correction_bias"][...]
    assert bias.dtype == jnp.float32 and gate["weight"][...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(bias), t["backbone.layers.5.mixer.gate.e_score_correction_bias"])


def test_fused_in_memory_names_load_too(tmp_path, model):
    """transformers' in-memory model: `model.*`, experts fused to up_proj [E, I, d] / down_proj [E, d, I]."""
    from safetensors.numpy import load_file, save_file

    d = copy_fixture(tmp_path, NAME)
    t = {k.replace("backbone.", "model.", 1): v for k, v in load_file(d / "model.safetensors").items()}
    for layer in (1, 5):
        for proj in ("up_proj", "down_proj"):
            names = [f"model.layers.{layer}.mixer.experts.{j}.{proj}.weight" for j in range(8)]
            t[f"model.layers.{layer}.mixer.experts.{proj}"] = np.stack([t.pop(n) for n in names])
    save_file(t, d / "model.safetensors")
    jax.tree.map(np.testing.assert_array_equal, load_safetensors(d).params, model.params)


def test_missing_expert_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    d = copy_fixture(tmp_path, NAME)
    t = load_file(d / "model.safetensors")
    del t["backbone.layers.1.mixer.experts.3.down_proj.weight"]
    save_file(t, d / "model.safetensors")
    with pytest.raises(KeyError, match=r"layers\.1\.mixer\.experts: down_proj of experts \[3\] missing"):
        load_safetensors(d)


# ----------------------------------------------------------------------------- parity with transformers


def test_dense_logits_match_transformers(model):
    e = expected(NAME)
    for name, lg in dense_logits(model, model.params, e).items():
        assert rel_err(lg, e[f"{name}_logits"]) <= RTOL, name


@pytest.mark.parametrize("page_size,chunk", [(4, 8), pytest.param(8, 5, marks=pytest.mark.slow)])
def test_arena_greedy_matches_transformers(model, page_size, chunk):
    """Chunked prefill (3-6 chunks, decode rows riding along), then T == 1 decode: 32 greedy tokens
    and the logits against transformers' cache-free and cached (step by step) logits."""
    e = expected(NAME)
    _, run = arena_run(model, e, page_size=page_size, chunk=chunk)
    for i, name in enumerate(PROMPTS):
        assert run.tokens[i] == e[f"{name}_greedy"].tolist()
        n = len(e[f"{name}_prompt"])
        full, step = e[f"{name}_logits"], e[f"{name}_step_logits"]
        assert max(rel_err(lg, full[pos]) for pos, lg in run.logits[i]) <= RTOL
        assert max(rel_err(lg, step[pos - n + 1]) for pos, lg in run.logits[i]) <= RTOL


def _dense_greedy(m, prompts, n: int) -> list[list[int]]:
    """Greedy by the cache-free forward (checked against transformers above), right-padded to the
    [2, 62] shape test_dense_logits_match_transformers compiled."""
    toks = np.zeros((2, 62), np.int32)
    lens = [len(p) for p in prompts]
    for i, p in enumerate(prompts):
        toks[i, :len(p)] = p
    out = [[], []]
    for _ in range(n):
        lg = np.asarray(m.dense_logits(m.params, jnp.asarray(toks)))
        for i in range(2):
            out[i].append(int(lg[i, lens[i] - 1].argmax()))
            toks[i, lens[i]] = out[i][-1]
            lens[i] += 1
    return out


def test_engine_retraction_and_prefix_cache_hit(model):
    """The engine (chunked prefill of 8, an arena too small for four requests' outputs, so some are
    retracted and recomputed), then a repeat that hits the prefix cache: transformers' greedy tokens
    for the fixture prompts, the dense forward's for the others."""
    e = expected(NAME)
    rng = np.random.default_rng(5)
    ps = [e[f"{n}_prompt"].tolist() for n in PROMPTS] + [rng.integers(3, 128, n).tolist() for n in (26, 17)]
    want = [e[f"{n}_greedy"].tolist() for n in PROMPTS] + _dense_greedy(model, ps[2:], 32)
    llm = LLM(model, arena_bytes=30 << 10, max_num_seqs=4, max_num_batched_tokens=8, page_size=4, max_model_len=128,
              batch_buckets=(4,), token_buckets=(8,), page_buckets=(32,), new_token_ratio=0.0,
              exact_fixed_length_reservation=False)  # fixed-length requests retract only under the ratio rule
    g = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(ps, g)
    st = llm.llm_engine.stats()
    assert st["num_retractions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.generate(ps[1], g)[0].outputs[0].token_ids == want[1]  # alone: its prefix and checkpoints cached
    again = llm.generate(ps[1], g)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == want[1]
    llm.llm_engine.check_idle()


# ----------------------------------------------------------------------------- the real shape


def test_nano_30b_shape_builds_abstractly_and_plans():
    from umem_jax.memory import plan as make_plan
    from umem_jax.memory.sizing import size_arena
    from umem_jax.models.presets import preset

    m = build_random(SHAPE, abstract=True)
    cfg = m.config
    assert 31.4e9 < sum(int(np.prod(x.shape)) for x in jax.tree.leaves(m.params)) < 31.8e9  # the published "30B"
    assert {t: cfg.layer_types.count(t) for t in set(cfg.layer_types)} == {
        "linear_attention": 23, "moe": 23, "full_attention": 6}
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.shared_intermediate_size,
            moe.routed_scaling_factor, moe.n_group) == (128, 6, 1856, 3712, 2.5, 1)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2688, 32, 2, 128)
    assert (cfg.mamba.num_heads, cfg.mamba.head_dim, cfg.mamba.state_size, cfg.mamba.n_groups) == (64, 64, 128, 8)
    experts = m.params["layers"][1]["mixer"]["experts"]
    assert experts["up_proj"].shape == (128, 2688, 1856) and experts["down_proj"].shape == (128, 1856, 2688)
    key = lambda decls: [(d.layer, [(p.geometry, type(p.lifetime)) for p in d.parts]) for d in decls]
    assert key(m.decls()) == key(preset(SHAPE)) and len(m.decls()) == 29
    p = make_plan(m.decls(), page_size=16)
    assert p.names == ("state", "full")
    assert size_arena(p, 16 << 30, max_model_len=262144).num_rows > 0
    # The whole forward traces at the real shape (shapes only: no weights, no compile).
    logits = jax.eval_shape(m.dense_logits, m.params, jax.ShapeDtypeStruct((1, 8), jnp.int32))
    assert logits.shape == (1, 8, 131072)
