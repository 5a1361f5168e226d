"""Qwen3.5-MoE on the committed tiny fixture (scripts/fixtures_qwen_moe.py, with transformers 5.23).

The fixture: 4 layers (gated DeltaNet x2, gated attention, gated DeltaNet), each with an MoE block
of 8 SwiGLU experts (intermediate 4), top-2 of a softmax router renormalised, a shared expert (8)
times its sigmoid gate; GDN 2 key heads serving 4 value heads of 8; attention 2 q heads / 1 kv
head of 16, RoPE on 4 dims; untied LM head; every parameter random; stored one tensor per expert
(transformers' save_pretrained).  Dense logits, arena greedy tokens and states against
transformers are in test_families.py; here: the config, the other checkpoint layouts, the
engine (chunked prefill, retraction, a prefix-cache hit) and the 35B-A3B-like shape.
"""

from __future__ import annotations

import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from _model_fixtures import FIXTURES, copy_fixture, model_fixture
from _qwen_moe_checks import engine_run, fuse_experts, fused_checkpoint

from umem_jax.memory import plan as make_plan
from umem_jax.models.loader import load_safetensors
from umem_jax.models.registry import build_random, from_hf_config, load_hf_config

NAME = "qwen3_5_moe_tiny"
FIXTURE = FIXTURES / NAME
model = model_fixture(NAME)


def test_config_fields(model):
    cfg = model.config
    assert cfg.architecture == "Qwen3_5MoeForCausalLM"
    assert cfg.layer_types == ("linear_attention", "linear_attention", "full_attention", "linear_attention")
    assert all(cfg.is_sparse(i) for i in range(4)) and not cfg.tie_word_embeddings
    m = cfg.moe
    assert (m.num_experts, m.top_k, m.intermediate_size, m.scoring, m.norm_topk_prob) == (8, 2, 4, "softmax", True)
    assert (m.shared_intermediate_size, m.shared_expert_gate, m.activation) == (8, True, "silu")
    assert cfg.rotary_dim == 4 and cfg.rope_for("full_attention").theta == 1e7
    experts = model.params["layers"][0]["mlp"]["experts"]
    assert experts["gate_up_proj"].shape == (8, 32, 8) and experts["down_proj"].shape == (8, 4, 32)


def test_hub_config_with_interval_and_top_level_rope():
    """A hub-style config.json (full_attention_interval, rope_theta / partial_rotary_factor at the top)."""
    d = json.loads((FIXTURE / "config.json").read_text())
    d = {k: v for k, v in d.items() if k not in ("layer_types", "rope_parameters")}
    d.update(full_attention_interval=3, rope_theta=1e7, partial_rotary_factor=0.25)
    assert from_hf_config(d) == load_hf_config(FIXTURE)


def test_unsupported_sparsity_fields_are_refused():
    d = json.loads((FIXTURE / "config.json").read_text())
    with pytest.raises(NotImplementedError, match="mlp_only_layers.*Qwen3-Next"):
        from_hf_config({**d, "mlp_only_layers": [1]})


def test_multimodal_hub_checkpoint_with_fused_experts(tmp_path, model):
    """The Qwen3.5-35B-A3B hub layout: Qwen3_5MoeForConditionalGeneration (text_config), weights
    under model.language_model.*, experts fused ([E, 2I, d] and [E, d, I]), model.visual.* and
    mtp.* skipped -> the same parameters as the per-expert fixture."""
    from safetensors.numpy import load_file, save_file

    d = copy_fixture(tmp_path, NAME)
    text = json.loads((d / "config.json").read_text())
    text.pop("architectures")
    outer = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
             "text_config": text, "tie_word_embeddings": False, "vision_config": {"depth": 2}}
    (d / "config.json").write_text(json.dumps(outer))
    t = fuse_experts(load_file(d / "model.safetensors"))
    t = {k.replace("model.", "model.language_model.", 1): v for k, v in t.items()}
    t["model.visual.blocks.0.attn.qkv.weight"] = np.zeros((3, 2), np.float32)
    t["mtp.layers.0.mlp.experts.0.up_proj.weight"] = np.zeros((2, 2), np.float32)
    save_file(t, d / "model.safetensors")
    m = load_safetensors(d)
    jax.tree.map(np.testing.assert_array_equal, m.params, model.params)


def test_missing_or_misshaped_experts_are_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    d = copy_fixture(tmp_path, NAME)
    t = load_file(d / "model.safetensors")
    gone = "model.layers.2.mlp.experts.5.up_proj.weight"
    save_file({k: v for k, v in t.items() if k != gone}, d / "model.safetensors")
    with pytest.raises(KeyError, match="missing 1 tensor.*layers.2.mlp.experts.5.up_proj.weight"):
        load_safetensors(d)
    fused = fuse_experts(t)
    fused["model.layers.1.mlp.experts.gate_up_proj"] = fused["model.layers.1.mlp.experts.gate_up_proj"][:6]
    save_file(fused, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"layers.1.mlp.experts.gate_up_proj \(6, 8, 32\).*\(8, 8, 32\)"):
        load_safetensors(d)
    fused = fuse_experts(t)  # the (in, out) orientation some exporters write is not transformers'
    fused["model.layers.0.mlp.experts.down_proj"] = np.swapaxes(fused["model.layers.0.mlp.experts.down_proj"], 1, 2)
    save_file(fused, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"layers.0.mlp.experts.down_proj \(8, 4, 32\).*\(8, 32, 4\)"):
        load_safetensors(d)


def test_no_shared_expert_drops_transformers_zero_width_one(tmp_path, model):
    """shared_expert_intermediate_size 0: transformers still saves a zero-width shared expert and
    its [1, d] gate (their product is 0).  They load as no shared expert, and the routed experts
    alone give the logits: the fixture's MoE layers with their shared expert's output removed.  A
    shared expert with weights under a config that has none is still refused."""
    from safetensors.numpy import load_file, save_file

    d = copy_fixture(tmp_path, NAME)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, shared_expert_intermediate_size=0)))
    t = load_file(d / "model.safetensors")
    empty = {k: np.zeros((0,) + v.shape[1:] if "down_proj" not in k else v.shape[:1] + (0,), v.dtype)
             for k, v in t.items() if ".shared_expert." in k}
    assert empty and any(".shared_expert_gate." in k for k in t)
    save_file({**t, **empty}, d / "model.safetensors")
    m = load_safetensors(d)
    assert m.config.moe.shared_intermediate_size == 0
    names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(m.params))}
    assert names and not any("shared_expert" in n for n in names)
    flat = nnx.to_flat_state(jax.tree.map(lambda x: x, model.params))  # the fixture, shared experts silenced
    for path, var in flat:
        if "shared_expert" in map(str, path) and "down_proj" in map(str, path):
            var.set_value(jnp.zeros_like(var.get_value()))
    ids = jnp.asarray([[3, 17, 5, 9, 2, 11]], jnp.int32)
    want = np.asarray(model.dense_logits(nnx.from_flat_state(flat), ids))
    got = np.asarray(m.dense_logits(m.params, ids))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(got, np.asarray(model.dense_logits(model.params, ids)), rtol=1e-3, atol=1e-3)
    save_file(t, d / "model.safetensors")  # the shared expert's real weights: unexpected for this config
    with pytest.raises(KeyError, match="unexpected tensor.*shared_expert"):
        load_safetensors(d)


def test_engine_greedy_through_retraction_and_a_prefix_hit():
    """32 greedy tokens per request equal transformers': prompts of 21 and 30 tokens prefilled in
    chunks of 16 beside decoding rows, one request retracted and recomputed, and a repeated
    prompt served from the prefix cache (state checkpoint + cached K/V)."""
    llm, e, outs, hit = engine_run(NAME)
    assert llm.llm_engine.scheduler.num_retractions > 0
    assert [o.outputs[0].token_ids for o in outs] == [e["short_greedy"].tolist(), e["long_greedy"].tolist()] * 2
    assert hit.num_cached_tokens > 0 and hit.outputs[0].token_ids == e["long_greedy"].tolist()
    llm.llm_engine.check_idle()


def test_35b_a3b_like_builds_abstractly_and_plans():
    """registry.build_random("qwen3.5-35b-a3b-like", abstract=True): 40 layers, 30 gated DeltaNet
    + 10 gated attention, 256 stacked experts per layer, about 34.7B text parameters; it plans into
    a state and a full sub-pool."""
    m = build_random("qwen3.5-35b-a3b-like", abstract=True)
    cfg = m.config
    assert (cfg.num_layers, cfg.layer_types.count("full_attention"), cfg.hidden_size) == (40, 10, 2048)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.shared_intermediate_size) == (256, 8, 512)
    experts = m.params["layers"][0]["mlp"]["experts"]
    assert experts["gate_up_proj"].shape == (256, 2048, 1024) and experts["down_proj"].shape == (256, 512, 2048)
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(m.params))
    assert 34.5e9 < n < 34.8e9
    assert {x.dtype for x in jax.tree.leaves(m.params)} == {jnp.dtype(jnp.bfloat16)}
    plan = make_plan(m.decls(), page_size=16)
    assert plan.names == ("state", "full")
    conv, rec = m.decls()[0].parts[0].geometry.tensors
    assert conv.shape == (3, 2 * 16 * 128 + 32 * 128) and rec.shape == (32, 128, 128)


_HAS_ORACLE = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None


@pytest.mark.skipif(not _HAS_ORACLE, reason="torch and transformers not installed")
def test_fused_layout_is_transformers_in_memory_layout(tmp_path):
    """fuse_experts builds exactly the gate_up_proj / down_proj transformers' Qwen3_5MoeExperts holds."""
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32)
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    fused = fuse_experts(load_file(FIXTURE / "model.safetensors"))
    for i in range(4):
        for p in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{p}"
            np.testing.assert_array_equal(fused[name], state[name])
    m = load_safetensors(fused_checkpoint(tmp_path, NAME))
    assert m.config.architecture == "Qwen3_5MoeForCausalLM"
