"""paged_prefill_attention on a real GPU: the compiled Triton kernel, and the Mosaic GPU kernel
(paged_prefill_mgpu.py, needs jax >= 0.11), vs the plain-JAX reference at real shapes, and a small
hybrid model's prefill through the "auto" kernel choice (opt-in) vs impl="reference" (skipped
without an NVIDIA GPU).  The Mosaic GPU kernel's fp8 (e4m3) path too (Hopper only): poisoned fp8
arenas written with random per-kv-head k/v scales, both of its tile modes, within the fp8 Triton
kernel's tolerance (1.5e-2 of the largest output), and the entry point running it when asked.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_prefill_gpu.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _prefill_utils import assert_close, kv_view, make_case, prefill_case  # same helpers as the CPU tests

from umem_jax.pallas_kernels._compat import silence_triton_deprecation
from umem_jax.pallas_kernels.paged_prefill import (
    PREFILL_ENV,
    paged_prefill_attention,
    paged_prefill_attention_reference,
    prefill_backend,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu",
                       reason="needs an NVIDIA GPU (compiled Triton / Mosaic GPU kernels)"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

# (name, Hkv, G, D, ps, fp32, window, softcap, sinks, T, P, rows, extra)
GPU_CASES = [
    # the benchmark geometry: 32 q / 8 kv heads, D=128, page 16; prefix 0, partial page, long
    # prefix; padding row.
    ("llama_gqa4_p16", 8, 4, 128, 16, False, None, None, False, 1024, 200,
     [(0, 1024), (1000, 1024), (2100, 777), (0, 0)], {}),
    # gpt-oss-like: GQA 8, window 128, sinks, page 64, tombstoned pages, decode-like chunk of 1.
    ("gptoss_gqa8_window_sinks", 8, 8, 64, 64, False, 128, None, True, 512, 40,
     [(1500, 512), (0, 300), (2000, 1)], {"tombstone": True}),
    # gemma-like: D=256, GQA 2, window 1024 + softcap, page 32.
    ("gemma_d256_window_softcap", 4, 2, 256, 32, False, 1024, 50.0, False, 512, 120,
     [(3000, 512), (10, 200)], {"tombstone": True}),
    # MHA, fp32 planes (IEEE fp32 dots on the GPU).
    ("mha_fp32_planes", 4, 1, 64, 16, True, None, None, False, 128, 30, [(200, 128), (5, 60)], {}),
    # GQA 1 in bf16 with a multi-row token vector (row_words = D) and a bf16 arena.
    ("mha_bf16_mk4", 4, 1, 128, 16, False, 300, None, False, 256, 60,
     [(600, 256), (0, 256)], {"row_words": 128, "arena_dtype": jnp.bfloat16, "tombstone": True}),
    # Any GQA ratio and head dim (issue 15): G = 3, 6 (flat (query, head) tiles in Triton, a CTA
    # per q head in Mosaic), D = 80, 96 (masked 128-wide Triton tiles, 32/64-byte swizzles).
    ("gqa_g3_d80_window_sinks", 4, 3, 80, 16, False, 256, None, True, 512, 80,
     [(700, 512), (0, 300), (1000, 1)], {"tombstone": True}),
    ("gqa_g6_d96_softcap", 2, 6, 96, 32, False, None, 30.0, False, 256, 40, [(900, 256), (5, 100)], {}),
    ("gqa_g6_d128_sinks", 8, 6, 128, 16, False, None, None, True, 512, 100, [(1000, 512), (0, 512)], {}),
    ("gqa_g5_d80_fp32_planes", 2, 5, 80, 16, True, 64, None, True, 128, 20, [(150, 128), (3, 60)], {}),
]


@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_kernel_matches_reference(case):
    silence_triton_deprecation()
    name, Hkv, G, D, ps, fp32, window, softcap, use_sinks, T, P, rows, extra = case
    q, arena, pt, q_lens, kv_lens, kw, ref = prefill_case(name, Hkv, G, D, ps, T, P, rows, fp32=fp32, window=window,
                                                          softcap=softcap, use_sinks=use_sinks, **extra)
    out = paged_prefill_attention(q, arena, pt, q_lens, kv_lens, **kw, impl="pallas", backend="triton")
    assert_close(out, ref, q_lens, fp32=fp32)


def test_gpu_kernel_arena_over_4gib():
    """Pages above the 4 GiB mark of a ~6 GiB arena: int64 offsets in the Triton kernel, and
    whatever the auto choice runs (the Mosaic GPU kernel's TMA coordinates on Hopper)."""
    silence_triton_deprecation()
    Hkv, G, D, ps = 8, 4, 128, 16
    view = kv_view(Hkv, D, ps, layer=0)
    page_bytes = view.rows_per_page * view.row_words * 2
    num_pages = (6 << 30) // page_bytes
    high = np.arange((5 << 30) // page_bytes, num_pages)  # every page lies past byte 5 GiB
    rng = np.random.default_rng(5)
    q, arena, pt, q_lens, kv_lens = make_case(rng, view, [(700, 300), (0, 512)], T=512, P=80, Hq=Hkv * G,
                                              q_dtype=jnp.bfloat16, num_pages=num_pages, page_pool=high)
    assert arena.nbytes > 2**32
    ref = paged_prefill_attention_reference(q, arena, pt, q_lens, kv_lens, view=view)
    for backend in ("triton", "auto"):
        out = paged_prefill_attention(q, arena, pt, q_lens, kv_lens, view=view, impl="pallas", backend=backend)
        assert_close(out, ref, q_lens, fp32=False)


def test_gpu_matches_cudnn_dense():
    """Prefix 0 chunk == cuDNN causal flash attention on the same contiguous tokens."""
    silence_triton_deprecation()
    from benchmarks.bench_prefill import build, rel_err

    d = build(jax.random.PRNGKey(1), B=2, T=2048, prefix=0, prefixes=[0, 1024], Hq=32, Hkv=8, D=128, ps=16,
              arena_gib=0.5)
    dense = jax.nn.dot_product_attention(d["q_full"], d["k_full"], d["v_full"], is_causal=True,
                                         implementation="cudnn")
    for backend in ("triton", "auto"):
        out = paged_prefill_attention(d["q"], d["arena"], d["page_table"], d["q_lens"], d["kv_lens"],
                                      view=d["view"], impl="pallas", backend=backend)
        assert rel_err(out[0], dense[0, :2048]) < 2e-2
        assert rel_err(out[1], dense[1, 1024:3072]) < 2e-2


# The Mosaic GPU (plgpu) kernel on the cases it covers: bf16 one-plane K/V, one arena row per token.
MGPU_CASES = [c for c in GPU_CASES if c[0] in ("llama_gqa4_p16", "gptoss_gqa8_window_sinks",
                                               "gemma_d256_window_softcap", "gqa_g3_d80_window_sinks",
                                               "gqa_g6_d96_softcap", "gqa_g6_d128_sinks")]


@pytest.mark.parametrize("case", MGPU_CASES, ids=[c[0] for c in MGPU_CASES])
def test_gpu_mgpu_kernel_matches_reference(case):
    from umem_jax.pallas_kernels.paged_prefill_mgpu import mgpu_available, paged_prefill_attention_mgpu

    ok, why = mgpu_available()
    if not ok:
        pytest.skip(why)
    name, Hkv, G, D, ps, fp32, window, softcap, use_sinks, T, P, rows, extra = case
    q, arena, pt, q_lens, kv_lens, kw, ref = prefill_case(name, Hkv, G, D, ps, T, P, rows, window=window,
                                                          softcap=softcap, use_sinks=use_sinks,
                                                          tombstone=extra.get("tombstone", False))
    for bkv, steps in ((128, 2), (64, 3)) if D <= 128 else ((64, 2),):
        out = paged_prefill_attention_mgpu(q, arena, pt, q_lens, kv_lens, **kw, block_kv=bkv,
                                           max_concurrent_steps=steps)
        assert_close(out, ref, q_lens, fp32=False)


# --------------------------------------------------------------------------- through a model


@pytest.mark.parametrize("D,softcap", [(64, None), (256, 50.0)], ids=["d64", "d256_softcap"])
def test_gpu_model_prefill_auto_matches_reference(D, softcap, monkeypatch):
    """The tiny hybrid model (sliding window 48, full attention and Mamba2 layers; bf16 weights
    and K/V, page 16) prefills two prompts (150 and 97 tokens) in 64-token chunks, a decoding row
    sharing the last chunks, then decodes: impl="pallas" with the "auto" kernel choice vs
    impl="reference", teacher-forced on the reference's tokens, logits within bf16 tolerance (the
    Triton kernel in interpret mode is 0.018-0.019 off the reference on the same case).  On an
    H100/H200 with jax >= 0.11 the forward must contain the Mosaic GPU kernel, else the Triton one."""
    from _model_arena import generate

    from umem_jax.arena import Arena
    from umem_jax.core.batch import make_batch
    from umem_jax.memory import plan as make_plan
    from umem_jax.models.tiny import tiny_model

    silence_triton_deprecation()
    monkeypatch.setenv(PREFILL_ENV, "auto")  # the Mosaic GPU kernel where it covers the case (opt-in)
    m = tiny_model(seed=4, hidden_size=128, head_dim=D, query_pre_attn_scalar=D, sliding_window=48,
                   attn_logit_softcapping=softcap, dtype="bfloat16")
    plan = make_plan(m.decls(kv_dtype="bfloat16"), page_size=16)
    rows, T = 16384, 64

    # Which kernel the model's attention layers get, and that the compiled step really holds it.
    views = [sp.kv_view(layer, model) for sp in plan.subpools if sp.kv for (model, layer) in sp.layers]
    q = jax.ShapeDtypeStruct((3, T, m.config.num_heads, D), jnp.bfloat16)
    kernels = {prefill_backend(q, v)[0] for v in views}
    assert len(kernels) == 1, kernels
    batch = make_batch(np.zeros((3, T)), np.full(3, T), np.full(3, T),
                       {n: np.zeros((3, 16)) for n in plan.names if n != "state"}, np.array([1, 2, 0]))
    text = m.jit_forward(impl="pallas").lower(m.params, Arena.abstract(plan, rows), batch).as_text()
    if kernels == {"mgpu"}:
        assert "mosaic_gpu" in text
    else:
        assert "mosaic_gpu" not in text
    from umem_jax.pallas_kernels.paged_prefill import device_info

    info = device_info()
    if info.compute_capability and info.compute_capability.startswith("9.") and info.jax_version >= (0, 11):
        assert kernels == {"mgpu"}, [prefill_backend(q, v) for v in views]

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 320, size=n) for n in (150, 97)]
    kw = dict(chunk=T, max_len=256, num_rows=rows)
    ref = generate(m, plan, prompts, 3, impl="reference", **kw)
    got = generate(m, plan, prompts, 3, impl="pallas", teacher=ref.tokens, **kw)
    for r, g in zip(ref.logits, got.logits):
        assert [p for p, _ in r] == [p for p, _ in g]
        for (_, want), (_, have) in zip(r, g):
            assert np.isfinite(have).all()
            err = float(np.abs(have - want).max() / np.abs(want).max())
            assert err <= 5e-2, err


@pytest.mark.parametrize("backend", ["mgpu"])
def test_gpu_engine_serves_with_mosaic_prefill(backend, monkeypatch):
    """The engine's step (metadata packed in one int32 buffer and sliced on the device) with the
    Mosaic GPU prefill forced: it runs (that kernel refuses inputs that are not 256-byte aligned;
    the runner's packing aligns every field), and its greedy tokens agree with the Triton kernel's on most sequences (bf16: a near-tie may flip
    a token; gpu_engine_smoke.py prints the margins)."""
    from umem_jax import LLM, SamplingParams
    from umem_jax.models.tiny import tiny_model
    from umem_jax.pallas_kernels.paged_prefill import device_info

    info = device_info()
    if not (info.compute_capability and info.compute_capability.startswith("9.") and info.jax_version >= (0, 11)):
        pytest.skip(f"the Mosaic GPU prefill needs a compute capability 9.x GPU and jax >= 0.11, here {info}")
    silence_triton_deprecation()
    m = tiny_model(seed=4, hidden_size=128, head_dim=64, query_pre_attn_scalar=64, sliding_window=48,
                   dtype="bfloat16")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 320, size=n).tolist() for n in (150, 97, 33, 260)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = {}
    for b in ("triton", backend):
        monkeypatch.setenv(PREFILL_ENV, b)
        llm = LLM(m, arena_bytes=64 << 20, max_num_batched_tokens=256)
        outs[b] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
        del llm
    same = sum(a == b for a, b in zip(outs["triton"], outs[backend]))
    assert same >= len(prompts) - 1, outs


# --------------------------------------------------------------------------- fp8 K/V, Mosaic GPU

# (name, Hkv, G, D, ps, window, softcap, sinks, T, P, rows, extra), as GPU_CASES without fp32
FP8_MGPU_CASES = [
    ("fp8_llama_gqa4_p16", 8, 4, 128, 16, None, None, False, 1024, 200,
     [(0, 1024), (1000, 1024), (2100, 777), (0, 0)], {}),
    ("fp8_gptoss_gqa8_window_sinks", 8, 8, 64, 64, 128, None, True, 512, 40,
     [(1500, 512), (0, 300), (2000, 1)], {"tombstone": True}),
    ("fp8_gemma_d256_window_softcap", 4, 2, 256, 32, 1024, 50.0, False, 512, 120,
     [(3000, 512), (10, 200)], {"tombstone": True}),
    ("fp8_g1_d128_window", 4, 1, 128, 16, 300, None, False, 256, 60, [(600, 256), (0, 256)], {"tombstone": True}),
    ("fp8_g3_d80_window_sinks", 4, 3, 80, 16, 256, None, True, 512, 80,
     [(700, 512), (0, 300), (1000, 1)], {"tombstone": True}),
    ("fp8_g6_d96_softcap", 2, 6, 96, 32, None, 30.0, False, 256, 40, [(900, 256), (5, 100)], {}),
    ("fp8_g6_d128_sinks", 8, 6, 128, 16, None, None, True, 512, 100, [(1000, 512), (0, 512)], {}),
    ("fp8_g2_d144_p128", 2, 2, 144, 128, None, None, False, 256, 12, [(1000, 256), (3, 40)], {}),
]


def _fp8_hopper():
    from umem_jax.pallas_kernels.backend import device_info, hopper_refusal

    why = hopper_refusal(device_info())
    if why:
        pytest.skip(f"the Mosaic GPU prefill kernel needs Hopper and jax >= 0.11: {why}")


def fp8_configs(D: int):
    """(block_kv, max_concurrent_steps) to run besides the default: both tile modes where D allows."""
    if D <= 112:
        return [(128, 2), (64, 3)]   # K and V tiles per consumer at both block sizes
    if D <= 208:
        return [(64, 2), (64, 4), (128, 2)]   # 128-token blocks: one tile per consumer
    return [(64, 2)]  # one tile per consumer


@pytest.mark.parametrize("case", FP8_MGPU_CASES, ids=[c[0] for c in FP8_MGPU_CASES])
def test_gpu_mgpu_fp8_kernel_matches_reference(case):
    """The compiled fp8 path on poisoned arenas (tombstoned pages and unwritten slots are NaN bytes)
    vs the reference on the same bytes and scales, at the default and the other tilings."""
    from umem_jax.pallas_kernels.paged_prefill_mgpu import paged_prefill_attention_mgpu

    _fp8_hopper()
    name, Hkv, G, D, ps, window, softcap, use_sinks, T, P, rows, extra = case
    q, arena, pt, q_lens, kv_lens, kw, ref = prefill_case(name, Hkv, G, D, ps, T, P, rows, fp8=True, window=window,
                                                          softcap=softcap, use_sinks=use_sinks,
                                                          tombstone=extra.get("tombstone", False),
                                                          arena_dtype=jnp.bfloat16)
    for cfg in [None] + fp8_configs(D):
        tiling = {} if cfg is None else dict(block_kv=cfg[0], max_concurrent_steps=cfg[1])
        out = paged_prefill_attention_mgpu(q, arena, pt, q_lens, kv_lens, **kw, **tiling)
        assert out.dtype == q.dtype
        assert_close(out, ref, q_lens, fp32=False, tol=1.5e-2)


def test_gpu_entry_point_runs_mgpu_fp8(monkeypatch):
    """fp8: backend "auto" (the default) and "mgpu" (argument or $UMEM_JAX_PREFILL) run the Mosaic
    kernel, with the scales, within fp8 tolerance of the Triton kernel's answer and of the
    reference."""
    _fp8_hopper()
    silence_triton_deprecation()
    q, arena, pt, q_lens, kv_lens, kw, ref = prefill_case("fp8_entry", 4, 6, 128, 16, 512, 90,
                                                          [(700, 512), (0, 300), (30, 0)], fp8=True, window=300,
                                                          softcap=20.0, use_sinks=True, arena_dtype=jnp.bfloat16)
    assert prefill_backend(q, kw["view"], backend="auto") == ("mgpu", "")
    assert prefill_backend(q, kw["view"], backend="mgpu") == ("mgpu", "")
    tri = paged_prefill_attention(q, arena, pt, q_lens, kv_lens, **kw, impl="pallas", backend="triton")
    mg = jax.jit(lambda *a: paged_prefill_attention(*a, **kw, impl="pallas", backend="mgpu"))(q, arena, pt, q_lens,
                                                                                              kv_lens)
    assert_close(mg, ref, q_lens, fp32=False, tol=1.5e-2)
    assert_close(mg, tri, q_lens, fp32=False, tol=1.5e-2)
    monkeypatch.setenv(PREFILL_ENV, "mgpu")
    text = jax.jit(lambda *a: paged_prefill_attention(*a, **kw, impl="pallas")).lower(q, arena, pt, q_lens,
                                                                                       kv_lens).as_text()
    assert "mosaic_gpu" in text
