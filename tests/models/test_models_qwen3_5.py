"""Qwen3.5 text parity on the committed tiny fixture (made by scripts/make_fixtures.py with transformers).

The fixture: 4 layers (gated DeltaNet x2, gated attention, gated DeltaNet), GDN with 2 key heads
serving 4 value heads of 16, attention 4 q / 2 kv heads of 16 with partial RoPE (4 of 16 dims),
tied embeddings, every parameter random (the zero-centred norms, the GDN gated norm, A_log,
dt_bias too).  transformers' cache-free forward uses its chunked delta rule, its cached decode the
recurrent one; both agree with ours to ~1e-5.  The checks Qwen3.5 shares with the other families
are in test_families.py.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _model_arena import generate
from _model_fixtures import FIXTURES, bf16_checkpoint, copy_fixture, expected, model_fixture, rel_err

from umem_jax.memory import plan as make_plan
from umem_jax.models.loader import load_safetensors
from umem_jax.models.qwen3_5 import qwen3_5_config
from umem_jax.models.registry import from_hf_config, load_hf_config

NAME = "qwen3_5_tiny"
FIXTURE = FIXTURES / NAME
model = model_fixture(NAME)


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


def test_moe_variant_goes_to_the_moe_family():
    """Qwen3.5-MoE names reach their own parser (test_models_qwen3_5_moe.py); the dense parser
    will not read a config with experts as a dense model."""
    cfg = from_hf_config({"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text"})
    assert cfg.architecture == "Qwen3_5MoeForCausalLM" and cfg.moe.num_experts == 256
    with pytest.raises(ValueError, match="num_experts=256.*qwen3_5_moe_config"):
        qwen3_5_config({"model_type": "qwen3_5_text", "num_experts": 256})


# ----------------------------------------------------------------------------- loading


def test_multimodal_hub_checkpoint_loads_the_text_decoder(tmp_path, model):
    """Qwen3_5ForConditionalGeneration layout: config under text_config, weights under
    model.language_model.*, plus model.visual.* and mtp.* tensors that are skipped."""
    from safetensors.numpy import load_file, save_file

    d = copy_fixture(tmp_path, NAME)
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


def test_bf16_checkpoint_runs_close(tmp_path):
    """bf16 weights, bf16 conv state and K/V in the arena (the serving default), teacher-forced.

    The random tiny model amplifies rounding: transformers' own bf16 run is 0.42 (max rel) away
    from its fp32 logits on this prompt, so bf16 is checked for being close in shape, not value."""
    e = expected(NAME)
    m = load_safetensors(bf16_checkpoint(tmp_path, NAME))
    assert {x.dtype for x in jax.tree.leaves(m.params)} == {jnp.dtype(jnp.bfloat16)}
    run = generate(m, make_plan(m.decls(), page_size=4), [e["short_prompt"]], 8, chunk=8,
                   teacher=[e["short_greedy"]], num_rows=4096)  # bf16 rows are narrower: more of them
    for pos, lg in run.logits[0]:
        ref = e["short_logits"][pos]
        assert rel_err(lg, ref) <= 0.3 and np.corrcoef(lg, ref)[0, 1] > 0.97
