"""The Mosaic GPU paged decode kernel on CPU: which decode kernel impl="pallas" runs
(paged_decode.decode_backend, pure logic over a made-up DeviceInfo), the refusals and the default
tiling, the split combine against an independent float64 softmax, and the kernel cross-lowered for
CUDA through Mosaic GPU's lowering (jax 0.10 has the plgpu.kernel API too; only running it needs
0.11 and Hopper).  The compiled kernel against the reference is tests/gpu/test_decode_mgpu_gpu.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _prefill_utils import kv_view

from umem_jax.memory import MHA, Full, LayerDecl, Part, Window, plan
from umem_jax.pallas_kernels import paged_prefill_mgpu
from umem_jax.pallas_kernels.backend import DeviceInfo
from umem_jax.pallas_kernels.paged_decode import DECODE_ENV, decode_backend
from umem_jax.pallas_kernels.paged_decode_mgpu import (_SMEM_LIMIT, DecodeMgpuConfig, check_decode_mgpu_supported,
                                                       combine_splits, default_decode_mgpu_config,
                                                       paged_decode_attention_mgpu, smem_bytes)

H200 = DeviceInfo("gpu", "9.0", (0, 11))
CPU = DeviceInfo("cpu", None, (0, 10))
LOG2E = 1.4426950408889634


def q_of(view, G=4, B=3, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct((B, G * view.num_kv_heads, view.head_dim), dtype)


def fp8_view(Hkv, D, ps):
    decls = [LayerDecl(i, (Part(MHA(Hkv, D, dtype="float8_e4m3fn"), Full()),)) for i in range(2)]
    decls.append(LayerDecl(2, (Part(MHA(Hkv, D, dtype="float8_e4m3fn"), Window(64)),)))  # a hybrid plan
    return plan(decls, page_size=ps).full.kv_view(1)


# --------------------------------------------------------------------------- the choice


def test_default_is_triton_and_auto_takes_mgpu_on_hopper(monkeypatch):
    view = kv_view(2, 128, 16)
    monkeypatch.delenv(DECODE_ENV, raising=False)
    assert decode_backend(q_of(view), view, device=H200)[0] == "triton"
    for G in (1, 3, 6, 8, 64):  # any GQA ratio up to one wgmma tile of rows
        assert decode_backend(q_of(view, G), view, backend="auto", device=H200) == ("mgpu", "")
    for D in (64, 192, 256):
        assert decode_backend(q_of(kv_view(1, D, 16)), kv_view(1, D, 16), backend="auto", device=H200)[0] == "mgpu"
    # D = 80 / 96: narrower swizzles, measured slower than Triton: auto takes Triton, mgpu still runs it.
    d80 = kv_view(2, 80, 16)
    kernel, why = decode_backend(q_of(d80), d80, backend="auto", device=H200)
    assert kernel == "triton" and "swizzle" in why
    assert decode_backend(q_of(d80), d80, backend="mgpu", device=H200) == ("mgpu", "")
    assert decode_backend(q_of(view), view, backend="auto", device=CPU)[0] == "triton"
    monkeypatch.setenv(DECODE_ENV, " Auto ")
    assert decode_backend(q_of(view), view, device=H200) == ("mgpu", "")
    monkeypatch.setenv(DECODE_ENV, "mgpu")
    with pytest.raises(NotImplementedError, match="not an NVIDIA GPU"):
        decode_backend(q_of(view), view, device=CPU)  # insisted on: no silent fallback
    assert decode_backend(q_of(view), view, backend="triton", device=H200)[0] == "triton"  # the argument wins
    monkeypatch.setenv(DECODE_ENV, "cudnn")
    with pytest.raises(ValueError, match=DECODE_ENV):
        decode_backend(q_of(view), view, device=H200)


@pytest.mark.parametrize("case,why", [
    ("fp8", "fp8"),
    ("fp32", "fp32"),
    ("g65", "at most 64"),
    ("d72", "multiple of 16"),
    ("d288", "multiple of 16 in [64, 256]"),
    ("ps4", "page_size 4"),
    ("sm80", "not Hopper"),
    ("jax010", "0.11"),
])
def test_refusals_fall_back_to_triton_with_the_reason(case, why):
    view, G, dev = kv_view(2, 128, 16), 4, H200
    if case == "fp8":
        view = fp8_view(2, 128, 16)
    elif case == "fp32":
        view = kv_view(2, 128, 16, fp32=True)
    elif case == "g65":
        G = 65
    elif case == "d72":
        view = kv_view(2, 72, 16)
    elif case == "d288":
        view = kv_view(1, 288, 16)
    elif case == "ps4":
        view = kv_view(2, 128, 4)
    elif case == "sm80":
        dev = DeviceInfo("gpu", "8.0", (0, 11))
    elif case == "jax010":
        dev = DeviceInfo("gpu", "9.0", (0, 10))
    kernel, reason = decode_backend(q_of(view, G), view, backend="auto", device=dev)
    assert kernel == "triton" and why in reason, reason


@pytest.mark.parametrize("D", [64, 80, 96, 128, 160, 192, 256])
@pytest.mark.parametrize("ps", [8, 16, 32, 64, 128, 256, 512])
def test_default_config_fits_shared_memory_and_the_page(D, ps):
    cfg = default_decode_mgpu_config(D, ps)
    assert smem_bytes(D, cfg) <= _SMEM_LIMIT and 2 <= cfg.ring_slots <= 4
    assert cfg.block_kv % ps == 0 or ps % cfg.block_kv == 0
    check_decode_mgpu_supported(q_of(kv_view(1, D, ps)), kv_view(1, D, ps), cfg)
    if D <= 128 and (128 % ps == 0 or ps % 128 == 0):
        assert cfg.block_kv == 128


def test_config_refusals():
    view = kv_view(2, 128, 16)
    with pytest.raises(NotImplementedError, match="block_kv"):
        check_decode_mgpu_supported(q_of(view), view, DecodeMgpuConfig(block_kv=96))
    with pytest.raises(NotImplementedError, match="ring_slots"):
        check_decode_mgpu_supported(q_of(view), view, DecodeMgpuConfig(ring_slots=1))
    with pytest.raises(NotImplementedError, match="shared memory"):
        check_decode_mgpu_supported(q_of(view), view, DecodeMgpuConfig(block_kv=128, ring_slots=4))


# --------------------------------------------------------------------------- the split combine


@pytest.mark.parametrize("sinks", [False, True])
def test_combine_splits_matches_a_float64_softmax(sinks):
    """Partials made the way the kernel makes them (per split: max in log2 units, sum, O normalised
    by the split's own sum; an empty split: max -1e30, sum 0, O 0) combine to the softmax over all
    positions, the sinks in the denominator; a row of length 0 gives 0."""
    rng = np.random.default_rng(0)
    B, Hkv, G, D, n, S = 3, 2, 3, 16, 50, 4
    G8 = 8
    s = rng.standard_normal((B, Hkv, G, n)) * 3
    v = rng.standard_normal((B, Hkv, n, D))
    sk = rng.standard_normal(Hkv * G) * 2 if sinks else None
    bounds = [0, 13, 13, 40, n]  # split 1 is empty
    o = np.zeros((B, Hkv, S, G8, D), np.float32)
    ml = np.zeros((B, Hkv, S, G8, 32), np.float32)
    ml[..., :16] = -1e30
    for i in range(S):
        lo, hi = bounds[i], bounds[i + 1]
        if lo == hi:
            continue
        x = s[..., lo:hi] * LOG2E
        m = x.max(-1)
        p = np.exp2(x - m[..., None])
        l_ = p.sum(-1)
        o[:, :, i, :G] = np.einsum("bhgn,bhnd->bhgd", p, v[:, :, lo:hi]) / l_[..., None]
        ml[:, :, i, :G, :16] = m[..., None]
        ml[:, :, i, :G, 16:] = l_[..., None]
    lengths = jnp.asarray([n, n, 0], jnp.int32)
    got = combine_splits(jnp.asarray(o), jnp.asarray(ml), lengths, None if sk is None else jnp.asarray(sk), G,
                         jnp.float32)
    logits = s if sk is None else np.concatenate([s, sk.reshape(1, Hkv, G, 1).repeat(B, 0)], -1)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    want = np.einsum("bhgn,bhnd->bhgd", p[..., :n], v).reshape(B, Hkv * G, D)
    want[2] = 0.0
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


# --------------------------------------------------------------------------- lowering for CUDA

LOWER = [
    # (Hkv, G, D, ps, window, softcap, sinks, block_kv, ring_slots, num_splits)
    (8, 4, 128, 16, None, None, False, None, None, None),
    (2, 6, 80, 32, 256, 5.0, True, None, None, None),
    (1, 1, 256, 128, None, None, False, None, None, 3),
    (4, 3, 96, 16, 100, None, True, 64, 4, None),
    (2, 64, 64, 256, None, None, False, 128, 2, 1),
]


@pytest.mark.parametrize("case", LOWER, ids=[f"g{c[1]}_d{c[2]}_p{c[3]}" for c in LOWER])
def test_lowers_for_cuda(case, monkeypatch):
    """Mosaic GPU's lowering (layouts, transforms, barriers, TMA boxes) accepts the kernel for every
    geometry family: GQA 1-64, head dims 64-256 (32/64/128-byte swizzles), a page below, equal to
    and above the KV block, windows, soft-cap, sinks, the ring depths and fixed splits."""
    plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    if not hasattr(plgpu, "kernel"):
        pytest.skip(f"jax {jax.__version__} has no plgpu.kernel (the Mosaic GPU API the kernel is written in)")
    # The version gate guards running the kernel; lowering it for CUDA works on jax 0.10 as well.
    monkeypatch.setattr(paged_prefill_mgpu, "mgpu_available", lambda: (True, ""))
    Hkv, G, D, ps, window, softcap, sinks, bkv, slots, splits = case
    view = kv_view(Hkv, D, ps)
    sds = jax.ShapeDtypeStruct
    args = (sds((3, Hkv * G, D), jnp.bfloat16), sds((40 * view.rows_per_page, view.row_words), jnp.uint16),
            sds((3, 30), jnp.int32), sds((3,), jnp.int32))
    kw = dict(view=view, window=window, softcap=softcap, block_kv=bkv, ring_slots=slots, num_splits=splits)
    if sinks:
        kw["sinks"] = jnp.zeros((Hkv * G,), jnp.float32)
    f = jax.jit(functools.partial(paged_decode_attention_mgpu, **kw))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
