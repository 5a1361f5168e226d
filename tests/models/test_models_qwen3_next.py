"""Qwen3-Next on the committed tiny fixture (scripts/fixtures_qwen_moe.py, with transformers 5.23).

The fixture is the Qwen3.5-MoE one's shape (test_models_qwen3_5_moe.py) with Qwen3-Next's
differences: layer 1 a dense SwiGLU MLP (mlp_only_layers=[1], intermediate 24), the k router
weights not renormalised (norm_topk_prob=False), and the GDN projections fused per key head in
`in_proj_qkvz` / `in_proj_ba`, split into Qwen3.5's on load.  Dense logits, arena greedy tokens and
states against transformers are in test_families.py.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from _model_fixtures import FIXTURES, copy_fixture, model_fixture
from _qwen_moe_checks import engine_run, fused_checkpoint

from umem_jax.memory import plan as make_plan
from umem_jax.models.loader import load_safetensors
from umem_jax.models.qwen3_next import Qwen3NextForCausalLM, split_gdn_projections
from umem_jax.models.registry import SHAPES, from_hf_config

NAME = "qwen3_next_tiny"
FIXTURE = FIXTURES / NAME
model = model_fixture(NAME)


def test_config_fields(model):
    cfg = model.config
    assert cfg.architecture == "Qwen3NextForCausalLM"
    assert [cfg.is_sparse(i) for i in range(4)] == [True, False, True, True]
    assert (cfg.mlp_only_layers, cfg.decoder_sparse_step, cfg.intermediate_size) == ((1,), 1, 24)
    assert not cfg.moe.norm_topk_prob and cfg.moe.shared_expert_gate
    assert cfg.rope_for("full_attention").theta == 5e6 and cfg.rotary_dim == 4
    layer1 = model.params["layers"][1]["mlp"]
    assert layer1["gate_proj"]["weight"].shape == (24, 32) and "experts" not in layer1


@pytest.mark.parametrize("fields,sparse", [
    ({"decoder_sparse_step": 2, "mlp_only_layers": []}, [False, True, False, True]),
    ({"decoder_sparse_step": 2, "mlp_only_layers": [3]}, [False, True, False, False]),
    ({"num_experts": 0}, [False] * 4),  # transformers builds dense MLPs only
])
def test_sparse_layers_follow_transformers_rule(fields, sparse):
    d = {**json.loads((FIXTURE / "config.json").read_text()), **fields}
    cfg = from_hf_config(d)
    assert [cfg.is_sparse(i) for i in range(4)] == sparse


def _fused_rows(hk, hv, dk, dv):
    """Per key head g: q_g | k_g | v_g | z_g rows, as indices into Qwen3.5's [qkv; z] rows."""
    r = hv // hk
    key, value = hk * dk, hv * dv
    rows = []
    for g in range(hk):
        rows += list(range(g * dk, (g + 1) * dk)) + list(range(key + g * dk, key + (g + 1) * dk))
        rows += list(range(2 * key + g * r * dv, 2 * key + (g + 1) * r * dv))
        rows += list(range(2 * key + value + g * r * dv, 2 * key + value + (g + 1) * r * dv))
    return np.array(rows)


def test_gdn_split_inverts_the_per_key_head_fusion(model):
    """Fuse random Qwen3.5 projections the way Qwen3-Next lays them out; the split gives them back."""
    cfg, rng = model.config, np.random.default_rng(0)
    randn = lambda *shape: rng.standard_normal(shape, np.float32)  # noqa: E731
    hk, hv, dk, dv, d = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                         cfg.linear_value_head_dim, cfg.hidden_size)
    qkv, z, b, a = randn(2 * hk * dk + hv * dv, d), randn(hv * dv, d), randn(hv, d), randn(hv, d)
    r = hv // hk
    ba = np.concatenate([np.concatenate([b[g * r:(g + 1) * r], a[g * r:(g + 1) * r]]) for g in range(hk)])
    t = {"x.in_proj_qkvz.weight": np.concatenate([qkv, z])[_fused_rows(hk, hv, dk, dv)], "x.in_proj_ba.weight": ba}
    split_gdn_projections(t, "x.", cfg)
    for name, want in (("in_proj_qkv", qkv), ("in_proj_z", z), ("in_proj_b", b), ("in_proj_a", a)):
        np.testing.assert_array_equal(np.asarray(t[f"x.{name}.weight"]), want)
    assert set(t) == {f"x.{n}.weight" for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}


def test_missing_fused_projection_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    d = copy_fixture(tmp_path, NAME)
    t = load_file(d / "model.safetensors")
    del t["model.layers.3.linear_attn.in_proj_ba.weight"]
    save_file(t, d / "model.safetensors")
    with pytest.raises(KeyError, match="missing 1 tensor.*layers.3.linear_attn.in_proj_ba.weight"):
        load_safetensors(d)


def test_fused_expert_checkpoint_loads_the_same(tmp_path, model):
    m = load_safetensors(fused_checkpoint(tmp_path, NAME))
    jax.tree.map(np.testing.assert_array_equal, m.params, model.params)


def test_engine_greedy_through_retraction_and_a_prefix_hit():
    """As for Qwen3.5-MoE: 32 greedy tokens per request equal transformers' through chunked
    prefill, a retraction and a prefix-cache hit."""
    llm, e, outs, hit = engine_run(NAME)
    assert llm.llm_engine.scheduler.num_retractions > 0
    assert [o.outputs[0].token_ids for o in outs] == [e["short_greedy"].tolist(), e["long_greedy"].tolist()] * 2
    assert hit.num_cached_tokens > 0 and hit.outputs[0].token_ids == e["long_greedy"].tolist()
    llm.llm_engine.check_idle()


def test_80b_a3b_like_config_and_plan():
    """The 80B-A3B-like shape's config and plan (its abstract build and parameter count, ~79.7B, are
    test_families' realistic-shape check)."""
    cfg = SHAPES["qwen3-next-80b-a3b-like"]()
    assert (cfg.num_layers, cfg.layer_types.count("full_attention"), cfg.vocab_size) == (48, 12, 151936)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.norm_topk_prob, cfg.moe.shared_intermediate_size) == (
        512, 10, True, 512)
    assert all(cfg.is_sparse(i) for i in range(48)) and cfg.rotary_dim == 64
    assert make_plan(Qwen3NextForCausalLM.decls(cfg), page_size=16).names == ("state", "full")
