"""Gemma 3 parity on the committed tiny fixture (made by scripts/make_fixtures.py with transformers).

The fixture: 6 layers (5 local : 1 global), window 8, GQA 4:2, query_pre_attn_scalar 24 != head
dim, linear RoPE x8 on the global layer, every parameter (norms too) random.  CI needs no torch:
the expected logits and greedy ids are in expected.npz.  The checks Gemma 3 shares with the
other families (hub-era keys, a missing tensor, the arena updated in place, the live transformers
oracle) are in test_families.py.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _model_arena import generate
from _model_fixtures import FIXTURES, PROMPTS, RTOL, bf16_checkpoint, copy_fixture, model_fixture, rel_err
from _model_fixtures import expected as load_expected

from umem_jax.core.batch import make_batch
from umem_jax.memory import Full, Window
from umem_jax.memory import plan as make_plan
from umem_jax.models.gemma3 import gemma3_config_to_dict
from umem_jax.models.loader import load_safetensors
from umem_jax.models.registry import from_hf_config, load_hf_config

NAME = "gemma3_tiny"
FIXTURE = FIXTURES / NAME
model = model_fixture(NAME)


@pytest.fixture(scope="module")
def expected():
    return load_expected(NAME)


# ----------------------------------------------------------------------------- config


def test_config_fields(model):
    cfg = model.config
    assert cfg.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert cfg.sliding_window == 8 and cfg.attn_scale == pytest.approx(24 ** -0.5)
    assert cfg.rope_for("full_attention").rope_type == "linear" and cfg.rope_for("full_attention").factor == 8
    assert from_hf_config(gemma3_config_to_dict(cfg)) == cfg


def test_yarn_rope_parses_as_transformers_computes_it():
    """yarn on the global layers, in both spellings (5.x `rope_parameters` per layer type, the hub's
    `rope_scaling`): inv_freq and the cos/sin factor as transformers' _compute_yarn_parameters
    gives them (the cases gpt-oss's fixture recorded), and the config round-trips."""
    from umem_jax.models.layers import rope_inv_freq

    base = json.loads((FIXTURE / "config.json").read_text())
    base.pop("rope_scaling", None)
    for case in json.loads((FIXTURES / "gpt_oss_tiny" / "rope_cases.json").read_text()):
        params = dict(case["rope_parameters"])
        five = {**base, "max_position_embeddings": case["max_position_embeddings"],
                "rope_parameters": {"full_attention": params,
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
        hub = {**base, "max_position_embeddings": case["max_position_embeddings"], "rope_parameters": None,
               "rope_theta": params["rope_theta"], "rope_local_base_freq": 1e4,
               "rope_scaling": {k: v for k, v in params.items() if k != "rope_theta"}}
        for d in (five, hub):
            cfg = from_hf_config(d)
            rope = cfg.rope_for("full_attention")
            assert rel_err(np.asarray(rope_inv_freq(rope, case["head_dim"])), np.asarray(case["inv_freq"])) <= 1e-6
            assert rope.attention_scaling == pytest.approx(case["attention_scaling"], rel=1e-12)
            assert cfg.rope_for("sliding_attention").rope_type == "default"
            assert from_hf_config(gemma3_config_to_dict(cfg)) == cfg


def test_attention_softcap_is_ignored_as_transformers_does():
    """transformers' Gemma 3 reads attn_logit_softcapping but never applies it (Gemma 2 did), so a
    config that sets it computes as one that does not; the final logits' soft-cap does apply."""
    d = json.loads((FIXTURE / "config.json").read_text())
    cfg = from_hf_config({**d, "attn_logit_softcapping": 20.0, "final_logit_softcapping": 30.0})
    assert cfg.attn_logit_softcapping is None and cfg.final_logit_softcapping == 30.0


def test_multimodal_wrapper_config_reads_text_config():
    text = json.loads((FIXTURE / "config.json").read_text())
    wrapped = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text}
    assert from_hf_config(wrapped).layer_types == load_hf_config(FIXTURE).layer_types


def test_unknown_architecture_is_a_clear_error():
    with pytest.raises(NotImplementedError, match="LlamaForCausalLM.*supported"):
        from_hf_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    with pytest.raises(ValueError, match="names no architecture.*supported: .*Gemma3ForCausalLM"):
        from_hf_config({"hidden_size": 64})


# ----------------------------------------------------------------------------- loading


def test_unexpected_and_misshaped_tensors_are_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    d = copy_fixture(tmp_path, NAME)
    t = load_file(d / "model.safetensors")
    t["model.layers.9.mlp.up_proj.weight"] = np.zeros((2, 2), np.float32)
    save_file(t, d / "model.safetensors")
    with pytest.raises(KeyError, match="unexpected.*layers.9.mlp.up_proj"):
        load_safetensors(d)
    del t["model.layers.9.mlp.up_proj.weight"]
    t["model.norm.weight"] = np.zeros((7,), np.float32)
    save_file(t, d / "model.safetensors")
    with pytest.raises(ValueError, match="norm.weight has shape \\(7,\\)"):
        load_safetensors(d)


def test_bf16_checkpoint_loads_as_bf16(tmp_path, expected):
    d = bf16_checkpoint(tmp_path, NAME)
    m = load_safetensors(d)
    assert m.config.dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(m.params)} == {jnp.dtype(jnp.bfloat16)}
    toks = np.concatenate([expected["short_prompt"], expected["short_greedy"]])[None]
    lg = np.asarray(m.dense_logits(m.params, jnp.asarray(toks)))[0]
    # Against transformers running the same bf16 model: two bf16 pipelines round differently
    # (~2e-2 apart here, as far as each is from fp32), so this bounds gross errors only.
    assert rel_err(lg, expected["short_logits_bf16"]) < 5e-2
    # ...and an fp32 override of the same bf16 file computes in fp32.
    assert {x.dtype for x in jax.tree.leaves(load_safetensors(d, dtype="float32").params)} == {jnp.dtype(jnp.float32)}


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("name", PROMPTS)
def test_dense_logits_match_transformers(model, expected, name):
    toks = np.concatenate([expected[f"{name}_prompt"], expected[f"{name}_greedy"]])[None]
    lg = np.asarray(model.dense_logits(model.params, jnp.asarray(toks)))[0]
    assert rel_err(lg, expected[f"{name}_logits"]) <= RTOL


def test_decls_are_window_and_full(model):
    decls = model.decls()
    lifetimes = [d.parts[0].lifetime for d in decls]
    assert lifetimes == [Window(8)] * 5 + [Full()]
    assert [sp.name for sp in make_plan(decls, page_size=4).subpools] == ["window8", "full"]


@pytest.mark.parametrize("page_size,chunk", [(4, 5), (8, 3)])
def test_arena_greedy_matches_transformers(model, expected, page_size, chunk):
    """fp32 K/V in the arena: chunked prefill (chunks < window, prompts > window, windows across
    page boundaries, tombstoned and reused window pages, NaN-filled arena), then 32 decode steps."""
    plan = make_plan(model.decls(kv_dtype="float32"), page_size=page_size)
    run = generate(model, plan, [expected[f"{n}_prompt"] for n in PROMPTS], 32, chunk=chunk)
    assert run.freed_pages > 0  # windows slid: pages were tombstoned and reused
    for i, name in enumerate(PROMPTS):
        assert run.tokens[i] == expected[f"{name}_greedy"].tolist()
        ref = expected[f"{name}_logits"]
        assert max(rel_err(lg, ref[pos]) for pos, lg in run.logits[i]) <= RTOL


def test_arena_bf16_kv_teacher_forced(model, expected):
    """bf16 K/V (the serving default): the same steps, teacher-forced, logits close."""
    plan = make_plan(model.decls(), page_size=4)
    run = generate(model, plan, [expected[f"{n}_prompt"] for n in PROMPTS], 32, chunk=5,
                   teacher=[expected[f"{n}_greedy"] for n in PROMPTS])
    for i, name in enumerate(PROMPTS):
        ref = expected[f"{name}_logits"]
        assert max(rel_err(lg, ref[pos]) for pos, lg in run.logits[i]) <= 2e-2


def test_raw_array_arena_needs_plan(model):
    plan = make_plan(model.decls(), page_size=4)
    data = jnp.zeros((512, plan.row_words), jnp.uint16)
    batch = make_batch(np.ones((1, 1)), [1], [1], {n: np.array([[3, 0]]) for n in plan.names})
    logits, data2 = jax.jit(model.forward_fn(plan))(model.params, data, batch)
    assert logits.shape == (1, model.config.vocab_size) and data2.shape == data.shape
    with pytest.raises(ValueError, match="needs the plan"):
        model.forward_fn()(model.params, data, batch)


def test_pallas_kernels_interpreted_through_the_model(model, expected):
    """The model's calls into the Pallas kernels (interpret mode on CPU) agree with the references."""
    plan = make_plan(model.decls(kv_dtype="float32"), page_size=4)
    prompt = [expected["short_prompt"][:12]]
    got = generate(model, plan, prompt, 3, chunk=8, num_rows=1024, impl="pallas", interpret=True)
    ref = generate(model, plan, prompt, 3, chunk=8, num_rows=1024, impl="reference")
    assert got.tokens == ref.tokens
    assert max(rel_err(a, b) for (_, a), (_, b) in zip(got.logits[0], ref.logits[0])) <= 1e-4
