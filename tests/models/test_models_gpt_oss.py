"""gpt-oss parity on the committed tiny fixture (made by scripts/fixtures_gpt_oss.py with transformers).

The fixture: 2 layers (sliding window 8, full attention), 4 q / 2 kv heads of 16 with q/k/v/o
biases and sinks, yarn RoPE as gpt-oss-20b has it, 4 experts top-2 (clamped SwiGLU, biases, gate/up
interleaved in the checkpoint), untied LM head, every parameter random.  mxfp4.npz holds the same
experts quantised to MXFP4 as the hub stores them and transformers' logits after it dequantised
them; rope_cases.json transformers' yarn frequencies.  CI needs no torch.  The checks gpt-oss
shares with the other families (a missing tensor named, the arena updated in place, the live
oracle) are in test_families.py.
"""

from __future__ import annotations

import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _model_arena import generate
from _model_fixtures import FIXTURES, PROMPTS, RTOL, copy_fixture, dense_logits, model_fixture, rel_err
from _model_fixtures import expected as load_expected

from umem_jax import LLM, SamplingParams
from umem_jax.memory import MHA, Full, Window
from umem_jax.memory import plan as make_plan
from umem_jax.models.gpt_oss import _rope
from umem_jax.models.layers import rope_inv_freq
from umem_jax.models.loader import load_safetensors
from umem_jax.models.mxfp4 import FP4_VALUES, dequantize_mxfp4, quantize_mxfp4
from umem_jax.models.registry import build_random, from_hf_config, load_hf_config

NAME = "gpt_oss_tiny"
FIXTURE = FIXTURES / NAME
model = model_fixture(NAME)
_HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None


@pytest.fixture(scope="module")
def expected():
    return load_expected(NAME)


@pytest.fixture(scope="module")
def mxfp4():
    return dict(np.load(FIXTURE / "mxfp4.npz"))


# ----------------------------------------------------------------------------- config


def test_config_fields(model):
    cfg = model.config
    assert cfg.architecture == "GptOssForCausalLM"
    assert cfg.layer_types == ("sliding_attention", "full_attention") and cfg.sliding_window == 8
    assert cfg.attn_scale == pytest.approx(16 ** -0.5) and cfg.attention_bias and not cfg.tie_word_embeddings
    rope = cfg.rope_for("sliding_attention")
    assert rope == cfg.rope_for("full_attention")
    assert (rope.rope_type, rope.theta, rope.factor, rope.original_max_position_embeddings, rope.truncate) == (
        "yarn", 150000.0, 32.0, 4096, False)
    assert rope.attention_scaling == pytest.approx(0.1 * np.log(32) + 1)
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.scoring, moe.expert_kind) == (
        4, 2, 32, "topk_softmax", "gpt_oss")
    assert moe.router_bias and moe.expert_bias and (moe.swiglu_limit, moe.swiglu_alpha) == (7.0, 1.702)


def test_hub_style_config_normalises_like_5x():
    """The hub's config.json (transformers 4.55): rope_scaling + rope_theta, experts_per_token, no
    layer_types (transformers' default alternation), torch_dtype."""
    d = json.loads((FIXTURE / "config.json").read_text())
    rope = dict(d.pop("rope_parameters"))
    d.pop("layer_types"), d.pop("num_experts_per_tok"), d.pop("dtype")
    d.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope, experts_per_token=2, torch_dtype="float32")
    assert from_hf_config(d) == load_hf_config(FIXTURE)


# gpt-oss-20b's config.json on the hub (transformers 4.55 era: rope_scaling, no dtype)
HUB_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False,
    "pad_token_id": 199999, "quantization_config": {"modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
        "quant_method": "mxfp4"}, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}


def test_hub_20b_config_is_the_20b_like_shape():
    """The real config.json parses to registry's gpt-oss-20b-like, in bf16 (the hub file names no
    dtype; its tensors are bf16 and MXFP4)."""
    from umem_jax.models.gpt_oss import gpt_oss_20b_like

    assert from_hf_config(HUB_20B) == gpt_oss_20b_like("bfloat16")


def test_unsupported_configs_are_refused():
    base = json.loads((FIXTURE / "config.json").read_text())
    with pytest.raises(NotImplementedError, match="quantization 'fp8'"):
        from_hf_config({**base, "quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(NotImplementedError, match="rope_type 'dynamic'"):
        from_hf_config({**base, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}})
    with pytest.raises(NotImplementedError, match="per layer type"):
        from_hf_config({**base, "rope_parameters": {"full_attention": {"rope_type": "default"}}})
    with pytest.raises(ValueError, match="layer types must be"):
        from_hf_config({**base, "layer_types": ["sliding_attention", "linear_attention"]})


def test_yarn_matches_transformers():
    """inv_freq and the cos/sin factor of transformers' _compute_yarn_parameters: gpt-oss's own
    (untruncated), the truncated default, mscale / mscale_all_dim, an explicit attention_factor."""
    for case in json.loads((FIXTURE / "rope_cases.json").read_text()):
        rope = _rope({"rope_parameters": case["rope_parameters"],
                      "max_position_embeddings": case["max_position_embeddings"]})
        inv = np.asarray(rope_inv_freq(rope, case["head_dim"]))
        assert rel_err(inv, np.asarray(case["inv_freq"])) <= 1e-6, case["rope_parameters"]
        assert rope.attention_scaling == pytest.approx(case["attention_scaling"], rel=1e-12)


# ----------------------------------------------------------------------------- MXFP4


def test_mxfp4_dequant_matches_transformers(mxfp4):
    """Random bytes, 3 blocks a row, against transformers' convert_moe_packed_tensors ([E, in, out]),
    in fp32 and bf16 (the bit-pattern path), and in fp16 (the fp32 path)."""
    want = mxfp4["random_dequant"]
    for dtype in (np.float32, jnp.bfloat16, np.float16):
        with np.errstate(over="ignore"):  # fp16: values past 65504 are inf on both sides
            got = dequantize_mxfp4(mxfp4["random_blocks"], mxfp4["random_scales"], dtype)
            ref = want.astype(dtype).astype(np.float32)
        assert got.dtype == np.dtype(dtype) and got.shape == want.shape == (2, 96, 4)
        np.testing.assert_array_equal(got.astype(np.float32), ref)


def test_mxfp4_round_trip_and_range():
    """quantize_mxfp4 (tests, fixtures) picks the OCP MX scale 2^e: every value comes back within
    2 * 2^e (e2m1's widest gap, 4 to 6, halved; or the clamp of (6, 8) to 6), and dequantised
    values re-quantise to the same bytes.  Scales past the normal range (2^-127 and 2^127) take
    the fp32 path and match it."""
    w = np.random.default_rng(0).standard_normal((3, 96, 5)).astype(np.float32) * np.float32(3.0)
    blocks, scales = quantize_mxfp4(w)  # w [E, in, out]
    assert blocks.shape == (3, 5, 3, 16) and scales.shape == (3, 5, 3)
    back = dequantize_mxfp4(blocks, scales, np.float32)
    unit = np.ldexp(np.float32(1), scales.astype(np.int32) - 127)  # [E, out, G]: 2^e of each block
    err = np.abs(back - w).reshape(3, 3, 32, 5).max(2)  # [E, G, out]
    assert (err <= 2 * np.swapaxes(unit, 1, 2)).all() and (err > 0).any()
    b2, s2 = quantize_mxfp4(back)
    np.testing.assert_array_equal(b2, blocks)
    np.testing.assert_array_equal(s2, scales)
    extreme = scales.copy()
    extreme[0, 0, 0], extreme[1, 2, 1] = 0, 254  # 2^-127 and 2^127
    codes = np.stack([blocks & 0x0F, blocks >> 4], -1).reshape(3, 5, 3, 32)  # [E, out, G, 32]
    exact = FP4_VALUES[codes].astype(np.float64) * 2.0 ** (extreme.astype(np.float64) - 127)[..., None]
    with np.errstate(over="ignore"):
        want = np.swapaxes(exact.reshape(3, 5, 96), 1, 2).astype(jnp.bfloat16)
        got = dequantize_mxfp4(blocks, extreme, jnp.bfloat16)
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
    assert np.isinf(got.astype(np.float32)).any()  # 6 * 2^127 overflows, as transformers' ldexp does


@pytest.mark.skipif(not _HAS_TORCH, reason="torch and transformers not installed (CI checks the committed bytes)")
def test_mxfp4_dequant_live_transformers():
    """Random data quantised here, dequantised by ours and by transformers' convert_moe_packed_tensors."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = np.random.default_rng(1).standard_normal((4, 160, 6)).astype(np.float32) * np.float32(0.02)
    blocks, scales = quantize_mxfp4(w)
    for dtype, tdtype in ((np.float32, torch.float32), (jnp.bfloat16, torch.bfloat16)):
        hf = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=tdtype)
        np.testing.assert_array_equal(dequantize_mxfp4(blocks, scales, dtype).astype(np.float32), hf.float().numpy())


def _mxfp4_checkpoint(tmp_path, mxfp4):
    """The fixture as the hub stores gpt-oss: experts as MXFP4 blocks/scales, quantization_config."""
    from safetensors.numpy import load_file, save_file

    d = copy_fixture(tmp_path, NAME)
    t = {k: v for k, v in load_file(d / "model.safetensors").items()
         if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    t.update({k: v for k, v in mxfp4.items() if k.endswith(("_blocks", "_scales")) and k.startswith("model.")})
    save_file(t, d / "model.safetensors")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_mxfp4_checkpoint_matches_transformers(tmp_path, mxfp4, expected):
    """Loaded (dequantised into the model dtype, gate/up de-interleaved, transposed to (in, out)):
    logits equal transformers' after it loaded the same MXFP4 checkpoint; a bf16 load holds the
    very same expert values (e2m1 times a power of two is exact in bf16)."""
    d = _mxfp4_checkpoint(tmp_path, mxfp4)
    m = load_safetensors(d)
    toks = np.concatenate([expected["short_prompt"], expected["short_greedy"]])[None]
    lg = np.asarray(m.dense_logits(m.params, jnp.asarray(toks)))[0]
    assert rel_err(lg, mxfp4["short_logits"]) <= RTOL
    bf = load_safetensors(d, dtype="bfloat16")
    for layer in range(2):
        ex, ex_bf = m.params["layers"][layer]["mlp"]["experts"], bf.params["layers"][layer]["mlp"]["experts"]
        for name in ("gate_up_proj", "down_proj"):
            np.testing.assert_array_equal(np.asarray(ex_bf[name][...], np.float32), np.asarray(ex[name][...]))


def test_half_an_mxfp4_pair_is_named(tmp_path, mxfp4):
    from safetensors.numpy import load_file, save_file

    d = _mxfp4_checkpoint(tmp_path, mxfp4)
    t = load_file(d / "model.safetensors")
    del t["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(t, d / "model.safetensors")
    with pytest.raises(KeyError, match="layers.1.mlp.experts.down_proj.*down_proj_blocks and down_proj_scales"):
        load_safetensors(d)


def test_checkpoint_layout_is_converted(model):
    """Router renamed to gate; the experts' interleaved gate/up columns (and bias) concatenated."""
    from safetensors.numpy import load_file

    t = load_file(FIXTURE / "model.safetensors")
    mlp = model.params["layers"][1]["mlp"]
    hf = t["model.layers.1.mlp.experts.gate_up_proj"]
    np.testing.assert_array_equal(np.asarray(mlp["experts"]["gate_up_proj"][...]),
                                  np.concatenate([hf[..., ::2], hf[..., 1::2]], -1))
    hb = t["model.layers.1.mlp.experts.gate_up_proj_bias"]
    np.testing.assert_array_equal(np.asarray(mlp["experts"]["gate_up_proj_bias"][...]),
                                  np.concatenate([hb[..., ::2], hb[..., 1::2]], -1))
    np.testing.assert_array_equal(np.asarray(mlp["gate"]["bias"][...]), t["model.layers.1.mlp.router.bias"])


# ----------------------------------------------------------------------------- parity


def test_dense_logits_match_transformers(model, expected):
    for name, lg in dense_logits(model, model.params, expected).items():
        assert rel_err(lg, expected[f"{name}_logits"]) <= RTOL, name


def test_fused_projections_keep_the_biases(model):
    """q|k|v fused into one matmul (the engine's default): the three biases concatenated with the weights."""
    from flax import nnx

    fused = model.fuse_projections()
    attn, ref = (nnx.merge(m.graphdef, m.params).layers[0].self_attn for m in (fused, model))
    assert attn.qkv_proj.bias[...].shape == ((4 + 2 + 2) * 16,)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 32)), jnp.float32)
    for got, want in zip(attn.project_qkv(x), ref.project_qkv(x)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_decls_are_window_and_full(model):
    decls = model.decls()
    assert [d.parts[0].lifetime for d in decls] == [Window(8), Full()]
    assert [sp.name for sp in make_plan(decls, page_size=4).subpools] == ["window8", "full"]


def test_arena_greedy_matches_transformers(model, expected):
    """fp32 K/V in a NaN-filled arena, pages of 4: chunked prefill (chunks of 5 < window 8 <
    prompts), windows across page boundaries with tombstoned pages reused, sinks through the
    prefill and decode kernels; 32 greedy tokens and their logits."""
    plan = make_plan(model.decls(kv_dtype="float32"), page_size=4)
    run = generate(model, plan, [expected[f"{n}_prompt"] for n in PROMPTS], 32, chunk=5)
    assert run.freed_pages > 0
    for i, name in enumerate(PROMPTS):
        assert run.tokens[i] == expected[f"{name}_greedy"].tolist()
        ref = expected[f"{name}_logits"]
        assert max(rel_err(lg, ref[pos]) for pos, lg in run.logits[i]) <= RTOL


@pytest.mark.slow  # ~17 s of compiles for a second (bf16) model; the fp32 paths run in CI
def test_bf16_arena_agrees_with_bf16_dense(expected):
    """bf16 weights and K/V (the serving default), teacher-forced through the arena, against the
    same bf16 model's cache-free forward.  No fp32 bound: on this random tiny model bf16 rounding
    flips expert choices (transformers' fp32 logits are 0.7 away, max rel), so the two bf16 paths
    are held to each other, typically 1e-2 apart."""
    m = load_safetensors(FIXTURE, dtype="bfloat16")
    assert {x.dtype for x in jax.tree.leaves(m.params)} == {jnp.dtype(jnp.bfloat16)}
    run = generate(m, make_plan(m.decls(), page_size=4), [expected["short_prompt"]], 8, chunk=5,
                   teacher=[expected["short_greedy"]], num_rows=4096)
    toks = np.concatenate([expected["short_prompt"], expected["short_greedy"]])[None]
    dense = np.asarray(m.dense_logits(m.params, jnp.asarray(toks)))[0]
    errs = [rel_err(lg, dense[pos]) for pos, lg in run.logits[0]]
    assert np.isfinite([lg for _, lg in run.logits[0]]).all() and np.median(errs) <= 3e-2 and max(errs) <= 0.1


@pytest.mark.slow  # ~40 s of interpret-mode tracing on 2 cores; the kernels' own tests cover sinks in interpret mode
def test_pallas_kernels_interpreted_through_the_model(model, expected):
    """The model's calls into the Pallas kernels with sinks (interpret mode on CPU) agree with the references."""
    plan = make_plan(model.decls(kv_dtype="float32"), page_size=4)
    prompt = [expected["long_prompt"][:12]]
    got = generate(model, plan, prompt, 3, chunk=8, num_rows=1024, impl="pallas", interpret=True)
    ref = generate(model, plan, prompt, 3, chunk=8, num_rows=1024, impl="reference")
    assert got.tokens == ref.tokens
    assert max(rel_err(a, b) for (_, a), (_, b) in zip(got.logits[0], ref.logits[0])) <= 1e-5


def test_engine_retraction_and_prefix_hit_match_transformers(model, expected):
    """The engine (fused projections, fp32 K/V): chunked prefill of 8 and a tight arena that retracts
    a request; then each prompt prefilled alone and asked again, which resumes from the prefix cache
    where the window pages are still held.  Every 32-token run gives transformers' tokens."""
    llm = LLM(model, arena_bytes=28 << 10, max_num_seqs=2, max_num_batched_tokens=8, page_size=4,
              max_model_len=64, new_token_ratio=0.0, batch_buckets=(2,), token_buckets=(8,), page_buckets=(16,),
              exact_fixed_length_reservation=False)  # fixed-length requests retract only under the ratio rule
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731
    prompts = [expected[f"{n}_prompt"].tolist() for n in PROMPTS]
    want = [expected[f"{n}_greedy"].tolist() for n in PROMPTS]
    outs = llm.generate(prompts, greedy(32))
    e = llm.llm_engine
    assert e.scheduler.num_retractions > 0
    assert [o.outputs[0].token_ids for o in outs] == want
    for p, w in zip(prompts, want):
        assert llm.generate([p], greedy(1))[0].outputs[0].token_ids == w[:1]
        hit = llm.generate([p], greedy(32))[0]
        assert hit.outputs[0].token_ids == w and hit.num_cached_tokens == len(p) // 4 * 4
    e.check_idle()


# ----------------------------------------------------------------------------- the real shape


def test_gpt_oss_20b_like_builds_abstractly():
    """registry.build_random("gpt-oss-20b-like", abstract=True): gpt-oss-20b's 20.9B parameters, its
    memory 12 window(128) and 12 full K/V layers of 8 kv heads x 64, as the preset declares it."""
    from umem_jax.models.presets import preset

    m = build_random("gpt-oss-20b-like", abstract=True)
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(m.params))
    assert 20.8e9 < n < 21.0e9
    assert {x.dtype for x in jax.tree.leaves(m.params)} == {jnp.dtype(jnp.bfloat16)}
    ex = m.params["layers"][0]["mlp"]["experts"]
    assert ex["gate_up_proj"].shape == (32, 2880, 5760) and ex["down_proj"].shape == (32, 2880, 2880)
    assert m.params["layers"][0]["self_attn"]["sinks"].shape == (64,)
    decls = m.decls()
    assert [d.parts[0].lifetime for d in decls] == [Window(128), Full()] * 12
    assert {d.parts[0].geometry for d in decls} == {MHA(8, 64, dtype="bfloat16")}
    key = lambda ds: [(d.layer, [(p.geometry, type(p.lifetime)) for p in d.parts]) for d in ds]
    assert key(decls) == key(preset("gpt-oss-20b-like"))
    assert make_plan(decls, page_size=16).names == ("window128", "full")
