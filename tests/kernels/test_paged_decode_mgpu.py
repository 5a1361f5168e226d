"""The Mosaic GPU paged decode kernel on CPU: which decode kernel impl="pallas" runs
(paged_decode.decode_backend, pure logic over a made-up DeviceInfo), the refusals and the default
tiling, the split combine against an independent float64 softmax, and the kernel cross-lowered for
CUDA through Mosaic GPU's lowering (jax 0.10 has the plgpu.kernel API too; only running it needs
0.11 and Hopper).  The fp8 path: the same (auto keeps Triton until the GPU has measured it, mgpu
runs it), its shared-memory budget, the byte ring's two aliased views, and its wrapper (k_scale
folded into q, v_scale into the output) around a stand-in for the kernel.  The compiled kernel
against the reference is tests/gpu/test_decode_mgpu_gpu.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _prefill_utils import kv_view

from umem_jax.memory import MHA, Full, LayerDecl, Part, Window, plan
from umem_jax.pallas_kernels import paged_prefill_mgpu
from umem_jax.pallas_kernels.backend import DeviceInfo
from umem_jax.pallas_kernels.paged_decode import DECODE_ENV, decode_backend, paged_decode_attention_reference
from umem_jax.pallas_kernels import paged_decode_mgpu
from umem_jax.pallas_kernels.paged_decode_mgpu import (_SMEM_LIMIT, DecodeMgpuConfig, check_decode_mgpu_supported,
                                                       combine_partials, combine_splits, default_decode_mgpu_config,
                                                       fp8_swizzle, paged_decode_attention_mgpu, q_columns, smem_bytes)

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
    # D = 80 / 96: narrower swizzles, measured no faster than Triton: auto takes Triton, mgpu still runs it.
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
    if D == 80:  # narrower-swizzled rows: a 2-slot ring, two CTAs an SM (measured faster)
        assert cfg.ring_slots == 2 and 2 * smem_bytes(D, cfg) <= 226 * 1024
    if D == 96:  # two CTAs would not fit even at 2 slots: as deep a ring as fits
        assert cfg.ring_slots >= 3
    if D >= 128 and cfg.block_kv == 128:  # bf16 128-token blocks: 2 slots (measured faster than 3 at D = 128)
        assert cfg.ring_slots == 2


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


def _lowered_for_cuda(case, view, arena_dtype, monkeypatch, scales: bool = False, consumers=None,
                      dequant_cols=None, transposed=None) -> str:
    """A LOWER / FP8_LOWER case of the kernel over `view`, lowered for CUDA through Mosaic GPU's
    lowering -> the StableHLO text (scales: pass per-head k/v scales, the fp8 path's; consumers:
    the config's consumer warpgroups, None its default)."""
    plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    if not hasattr(plgpu, "kernel"):
        pytest.skip(f"jax {jax.__version__} has no plgpu.kernel (the Mosaic GPU API the kernel is written in)")
    # The version gate guards running the kernel; lowering it for CUDA works on jax 0.10 as well.
    monkeypatch.setattr(paged_prefill_mgpu, "mgpu_available", lambda: (True, ""))
    Hkv, G, D, ps, window, softcap, sinks, bkv, slots, splits = case
    sds = jax.ShapeDtypeStruct
    args = (sds((3, Hkv * G, D), jnp.bfloat16), sds((40 * view.rows_per_page, view.row_words), arena_dtype),
            sds((3, 30), jnp.int32), sds((3,), jnp.int32)) + (sds((Hkv,), jnp.float32),) * (2 if scales else 0)
    kw = dict(view=view, window=window, softcap=softcap, block_kv=bkv, ring_slots=slots, num_splits=splits,
              consumers=consumers, dequant_cols=dequant_cols, transposed=transposed)
    if sinks:
        kw["sinks"] = jnp.zeros((Hkv * G,), jnp.float32)

    def f(q, arena, pt, ln, *kv_scales):
        extra = dict(zip(("k_scale", "v_scale"), kv_scales))
        return paged_decode_attention_mgpu(q, arena, pt, ln, **kw, **extra)

    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("case", LOWER, ids=[f"g{c[1]}_d{c[2]}_p{c[3]}" for c in LOWER])
def test_lowers_for_cuda(case, monkeypatch):
    """Mosaic GPU's lowering (layouts, transforms, barriers, TMA boxes) accepts the kernel for every
    geometry family: GQA 1-64, head dims 64-256 (32/64/128-byte swizzles), a page below, equal to
    and above the KV block, windows, soft-cap, sinks, the ring depths and fixed splits."""
    assert "mosaic_gpu" in _lowered_for_cuda(case, kv_view(case[0], case[2], case[3]), jnp.uint16, monkeypatch)


# --------------------------------------------------------------------------- fp8 K/V

FP8_DIMS = [64, 80, 96, 112, 128, 144, 160, 192, 224, 256]


def test_fp8_auto_keeps_triton_and_mgpu_runs_it(monkeypatch):
    """fp8 views: "auto" stays on Triton (the Mosaic fp8 path measured slower) and says why; "mgpu"
    (argument or $UMEM_JAX_DECODE) takes the Mosaic kernel; off Hopper "mgpu" still refuses."""
    monkeypatch.delenv(DECODE_ENV, raising=False)
    for Hkv, D, ps, G in ((8, 128, 16, 4), (2, 80, 16, 6), (1, 256, 64, 8)):
        view = fp8_view(Hkv, D, ps)
        assert decode_backend(q_of(view, G), view, device=H200)[0] == "triton"  # the default
        kernel, why = decode_backend(q_of(view, G), view, backend="auto", device=H200)
        assert kernel == "triton" and "fp8" in why and "measured slower" in why, why
        assert decode_backend(q_of(view, G), view, backend="mgpu", device=H200) == ("mgpu", "")
    view = fp8_view(8, 128, 16)
    monkeypatch.setenv(DECODE_ENV, "mgpu")
    assert decode_backend(q_of(view), view, device=H200) == ("mgpu", "")
    assert decode_backend(q_of(view), view, kv_dtype=jnp.float8_e4m3fn, device=H200) == ("mgpu", "")
    with pytest.raises(NotImplementedError, match="not an NVIDIA GPU"):
        decode_backend(q_of(view), view, device=CPU)
    with pytest.raises(NotImplementedError, match="kv_dtype"):  # an fp8 view read as bf16: refused
        decode_backend(q_of(view), view, kv_dtype=jnp.bfloat16, device=H200)


@pytest.mark.parametrize("case,why", [
    ("kv_dtype", "kv_dtype"),
    ("d72", "multiple of 16"),
    ("d288", "multiple of 16 in [64, 256]"),
    ("g65", "at most 64"),
    ("ps4", "page_size 4"),
    ("smem", "shared memory needed (fp8 K/V)"),
])
def test_fp8_refusals(case, why):
    D = {"d72": 72, "d288": 288}.get(case, 256 if case == "smem" else 128)
    view = fp8_view(2 if case == "d72" else 1, D, 4 if case == "ps4" else 16)  # 1 x 72 fp8: no 16-byte row
    cfg = DecodeMgpuConfig(128, 4) if case == "smem" else default_decode_mgpu_config(D, view.page_size, fp8=True)
    with pytest.raises(NotImplementedError, match=why.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        check_decode_mgpu_supported(q_of(view, 65 if case == "g65" else 4), view, cfg,
                                    jnp.bfloat16 if case == "kv_dtype" else None)


def test_fp8_passes_the_shared_tma_layout_check():
    """The TMA-layout check the decode shares with the prefill takes fp8 views (both kernels read
    them since the prefill learnt to, tests/kernels/test_paged_prefill_mgpu.py), read as e4m3 only."""
    view = fp8_view(2, 128, 16)
    assert paged_prefill_mgpu.tma_layout_refusal(128, view) is None
    assert paged_prefill_mgpu.tma_layout_refusal(128, view, jnp.float8_e4m3fn) is None
    assert "kv_dtype" in paged_prefill_mgpu.tma_layout_refusal(128, view, jnp.bfloat16)


@pytest.mark.parametrize("D", FP8_DIMS)
@pytest.mark.parametrize("ps", [8, 16, 32, 64, 128, 256])
def test_fp8_default_config_fits_shared_memory_and_the_page(D, ps):
    """The fp8 budget (a byte ring + the two 16-bit tiles each consumer dequantises into) fits 227 KiB
    with the default tiling: two consumers up to D = 128, else one with a ring at least as deep in
    tokens as the bf16 kernel's."""
    cfg = default_decode_mgpu_config(D, ps, fp8=True)
    assert smem_bytes(D, cfg, fp8=True) <= _SMEM_LIMIT and 2 <= cfg.ring_slots <= 4
    assert cfg.block_kv % ps == 0 or ps % cfg.block_kv == 0
    view = fp8_view(1, D, ps)
    check_decode_mgpu_supported(q_of(view), view, cfg)
    assert cfg.consumers == (2 if D <= 128 else 1)
    bf16 = default_decode_mgpu_config(D, ps)
    if cfg.consumers == 1:
        assert cfg.block_kv * cfg.ring_slots >= bf16.block_kv * bf16.ring_slots
    else:  # two consumers: the measured 128-token blocks in 2 slots, or 64-token ones in 4 (as many tokens)
        assert (cfg.block_kv, cfg.ring_slots) == ((128, 2) if bf16.block_kv == 128 else (64, 4))
    # the byte ring is half the bf16 ring; each consumer's dequantised K and V tiles come on top
    # (a bf16 pair of consumers has O tiles instead)
    o_tiles = 2 * 64 * D * 2 if cfg.consumers == 2 else 0
    assert smem_bytes(D, cfg, fp8=True) - smem_bytes(D, cfg) == \
        2 * cfg.block_kv * D * (2 * cfg.consumers - cfg.ring_slots) - o_tiles


def test_fp8_budget_per_head_dim():
    """The fp8 tilings the docstrings quote (page 16)."""
    got = {D: default_decode_mgpu_config(D, 16, fp8=True) for D in (64, 128, 192, 256)}
    assert got[64] == DecodeMgpuConfig(128, 2, None, 2)  # two consumers
    assert got[128] == DecodeMgpuConfig(128, 2, None, 2, 128)  # ... dequantising whole rows
    assert got[192] == DecodeMgpuConfig(128, 2)
    assert got[256] == DecodeMgpuConfig(64, 3)
    assert smem_bytes(128, got[128], fp8=True) == 16384 + 2 * (32768 + 2 * 32768) + 2 * 8192 + 1024
    assert default_decode_mgpu_config(128, 192, fp8=True) == DecodeMgpuConfig(64, 4, None, 2, 128)  # 64-token blocks


@pytest.mark.parametrize("D", [64, 80, 96, 128, 256])
def test_fp8_ring_views_alias_the_same_bytes(D):
    """Each fp8 ring is a RefUnion of a uint16 view (the TMA writes words) and a float8 view (the
    consumer reads values).  The kernel relies on both starting at byte 0 of the union, with equal
    sizes and the same tiling in bytes (8 rows x sw bytes, swizzled by sw); jax documents no such
    placement, so this pins what jax does."""
    plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    core = pytest.importorskip("jax._src.pallas.mosaic_gpu.core")
    # Not a skip: the kernel relies on this placement, so a jax that hides it must be checked by hand.
    assert hasattr(core, "flatten_ref_union"), (f"jax {jax.__version__} has no flatten_ref_union: check the fp8 "
                                                "ring's byte placement (fp8_ring) by hand, then update this test")
    union = paged_prefill_mgpu.fp8_ring(plgpu, 3, 128, D)  # the decode's and the prefill's rings
    words, values = jax.tree.leaves(core.flatten_ref_union(union.get_ref_aval()),
                                    is_leaf=lambda x: hasattr(x, "transforms"))
    (w_alias, *w_layout), (v_alias, *v_layout) = words.transforms, values.transforms
    assert w_alias.offset == v_alias.offset == 0
    assert (w_alias.dtype, v_alias.dtype) == (jnp.dtype(jnp.uint16), jnp.dtype(jnp.float8_e4m3fn))
    sw = fp8_swizzle(D)
    if sw is None:  # D % 32 == 16: plain rows in both views
        assert D % 32 == 16 and w_layout == v_layout == []
        assert (w_alias.shape, v_alias.shape) == ((3, 128, D // 2), (3, 128, D))
    else:  # the same tiles in the same order: [slot, row tile, column tile] of 8 rows x sw bytes
        assert w_alias.shape == (3, 16, D // sw, 8, sw // 2) and v_alias.shape == (3, 16, D // sw, 8, sw)
        assert [type(t).__name__ for t in w_layout] == [type(t).__name__ for t in v_layout]
        assert [getattr(t, "swizzle", None) for t in w_layout] == [getattr(t, "swizzle", None) for t in v_layout]
        assert sw in [getattr(t, "swizzle", None) for t in v_layout]


def _stand_in_kernel(view, calls):
    """A plgpu.kernel stand-in computing what the Mosaic kernel writes, in numpy: per (request, kv
    head) the G8 rows of O normalised by their sum (in the kernel's 16-bit dtype) and the max
    (log2 units) / sum, all in split 0 (the other splits empty).  It reads the fp8 values from the
    arena words it is given, unscaled, so the wrapper's scales are what is checked."""
    from umem_jax.pallas_kernels.kv_write import read_kv_reference

    def kernel(body, *, out_type, grid, **_):
        c = body.args[1]  # functools.partial(_kernel, plgpu, c)

        def run(lengths, page_table, qg, arena):
            calls.append((c, qg.dtype, arena.dtype))
            k, v = (np.asarray(x, np.float64) for x in read_kv_reference(arena, page_table, view=view))
            q = np.asarray(qg.astype(jnp.float32), np.float64)          # [B, Hkv, G8, D]
            B, Hkv = q.shape[:2]
            o = np.zeros(out_type[0].shape, np.float32)
            ml = np.zeros(out_type[1].shape, np.float32)
            ml[..., :16] = -1e30
            for b in range(B):
                n = min(int(lengths[b]), c.P * c.page_size)
                lo = 0 if c.window is None else max(0, n - c.window)
                if n == 0:
                    continue
                for h in range(Hkv):
                    s = q[b, h] @ k[b, lo:n, h].T                       # [G8, n - lo]
                    s = c.softcap * np.tanh(s * c.scale / c.softcap) if c.softcap else s * c.scale
                    x = s * LOG2E
                    m = x.max(-1)
                    p = np.exp2(x - m[:, None])
                    o[b, h, 0] = (p @ v[b, lo:n, h]) / p.sum(-1)[:, None]
                    ml[b, h, 0, :, :16], ml[b, h, 0, :, 16:] = m[:, None], p.sum(-1)[:, None]
            return jnp.asarray(o).astype(out_type[0].dtype), jnp.asarray(ml)

        return run

    return kernel


@pytest.mark.parametrize("window,softcap,sinks", [(None, None, False), (70, 20.0, True)])
def test_fp8_wrapper_scales_around_a_stand_in_kernel(monkeypatch, window, softcap, sinks):
    """paged_decode_attention_mgpu on an fp8 arena with per-head k/v scales, the kernel replaced by
    _stand_in_kernel: k_scale reaches q (f16), v_scale the output, the arena goes in as words,
    sinks and lengths 0 as in the reference; the result is the reference's within f16 rounding."""
    import types

    from umem_jax.pallas_kernels.kv_write import write_kv_reference

    Hkv, G, D, ps, P = 2, 3, 64, 16, 8
    view = fp8_view(Hkv, D, ps)
    rng = np.random.default_rng(5)
    lens = np.array([100, 1, 0, 37], np.int32)
    npages = 1 + len(lens) * P
    table = rng.permutation(np.arange(1, npages))[:len(lens) * P].reshape(len(lens), P).astype(np.int32)
    pos = [np.arange(n) for n in lens]
    pages = np.concatenate([table[b, p // ps] for b, p in enumerate(pos)]).astype(np.int32)
    slots = np.concatenate([p % ps for p in pos]).astype(np.int32)
    T = len(pages)
    ks = jnp.asarray(rng.uniform(0.05, 0.2, Hkv), jnp.float32)
    vs = jnp.asarray(rng.uniform(0.5, 2.0, Hkv), jnp.float32)
    arena = jnp.zeros((npages * view.rows_per_page, view.row_words), jnp.uint16)
    arena = write_kv_reference(arena, jnp.asarray(rng.standard_normal((T, Hkv, D)), jnp.float32),
                               jnp.asarray(rng.standard_normal((T, Hkv, D)), jnp.float32), jnp.asarray(pages),
                               jnp.asarray(slots), view=view, k_scale=ks, v_scale=vs)
    arena = jax.lax.bitcast_convert_type(arena, jnp.bfloat16)  # as the engine allocates it
    q = jnp.asarray(rng.standard_normal((len(lens), Hkv * G, D)), jnp.bfloat16)
    sk = jnp.asarray(rng.standard_normal(Hkv * G), jnp.float32) if sinks else None
    calls = []
    fake = types.SimpleNamespace(kernel=_stand_in_kernel(view, calls), CompilerParams=lambda **kw: None)
    monkeypatch.setattr(paged_decode_mgpu, "_plgpu", lambda: fake)
    kw = dict(view=view, window=window, softcap=softcap, sinks=sk, k_scale=ks, v_scale=vs)
    tbl, ln = jnp.asarray(table), jnp.asarray(lens)
    got = paged_decode_attention_mgpu.__wrapped__(q, arena, tbl, ln, **kw)
    ref = paged_decode_attention_reference(q, arena, tbl, ln, **kw)
    (c, q_dtype, arena_dtype), = calls
    assert c.fp8 and c.dtype == jnp.float16 and q_dtype == jnp.float16 and arena_dtype == jnp.uint16
    assert got.dtype == q.dtype and got.shape == ref.shape
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(ref).all() and (got[2] == 0).all()
    np.testing.assert_allclose(got, ref, rtol=1e-2, atol=1e-2 * np.abs(ref).max())
    with pytest.raises(ValueError, match="k_scale"):  # per-head scales of the wrong length
        paged_decode_attention_mgpu.__wrapped__(q, arena, tbl, ln, **{**kw, "k_scale": jnp.ones(3)})


FP8_LOWER = [
    # (Hkv, G, D, ps, window, softcap, sinks, block_kv, ring_slots, num_splits)
    (8, 4, 128, 16, None, None, False, None, None, None),   # the benchmark's shape: 4 slots of 128 tokens
    (2, 6, 128, 64, 200, None, True, None, None, None),     # G = 6, page 64, a window, sinks
    (2, 1, 64, 16, None, 30.0, False, None, None, 3),       # G = 1, D = 64 (64-byte ring swizzle), fixed splits
    (1, 8, 256, 16, 100, None, False, None, None, None),    # G = 8, D = 256: 64-token blocks, 3 slots
    (1, 8, 256, 64, None, 50.0, True, 64, 2, None),         # a page equal to the block
    (2, 6, 80, 16, 300, 5.0, True, None, None, None),       # D = 80: unswizzled byte rows, 32-byte 16-bit tiles
    (4, 3, 96, 32, None, None, False, 64, 4, None),         # D = 96: 32-byte ring swizzle
    (1, 2, 144, 16, None, None, False, None, None, None),   # unswizzled rows wider than a 64-value chunk
    (2, 64, 64, 256, 40, None, False, None, None, 1),       # a whole wgmma tile of q heads, a page > the block
]


@pytest.mark.parametrize("case", FP8_LOWER, ids=[f"g{c[1]}_d{c[2]}_p{c[3]}_w{c[4]}" for c in FP8_LOWER])
def test_fp8_lowers_for_cuda(case, monkeypatch):
    """Mosaic GPU's lowering accepts the fp8 kernel (the RefUnion byte rings, the word TMA boxes, the
    float8 chunk loads in WGMMA_8BIT layout, the e4m3 -> f16 converts, the 16-bit tile stores) for
    GQA 1-64, head dims 64-256 (64- / 32-byte / no ring swizzle), pages below, equal to and above
    the KV block, windows, soft-cap, sinks, ring depths and fixed splits (the arena in bf16, as the
    engine allocates it)."""
    view = fp8_view(case[0], case[2], case[3])
    assert "mosaic_gpu" in _lowered_for_cuda(case, view, jnp.bfloat16, monkeypatch, scales=True)


# --------------------------------------------------------------------------- two consumers

TWO_CONSUMERS = [
    # (Hkv, G, D, ps, window, softcap, sinks, block_kv, ring_slots, num_splits, fp8)
    (8, 4, 128, 16, None, None, False, 128, 2, None, False),   # bf16: an O tile per consumer
    (2, 6, 80, 32, 256, 5.0, True, 64, 4, None, False),        # D = 80, a window crossing blocks, sinks
    (8, 4, 128, 16, None, None, False, 128, 2, None, True),    # fp8: 224 KiB, the K tiles carry O out
    (2, 6, 128, 64, 200, None, True, 64, 4, 3, True),          # fp8, G = 6, a window, fixed splits
    (1, 1, 64, 16, None, 30.0, False, 64, 2, None, True),      # fp8, G = 1, D = 64 (64-byte ring swizzle)
]


@pytest.mark.parametrize("case", TWO_CONSUMERS, ids=[f"{'fp8' if c[-1] else 'bf16'}_g{c[1]}_d{c[2]}_p{c[3]}"
                                                     for c in TWO_CONSUMERS])
def test_two_consumers_lower_for_cuda(case, monkeypatch):
    """Two consumer warpgroups taking the split's blocks in turn (each its own softmax, written out as
    a split of its own; the producer is the third warpgroup): Mosaic GPU's lowering accepts them,
    bf16 and fp8, windows, sinks, soft-cap, fixed splits."""
    *geometry, fp8 = case
    view = fp8_view(case[0], case[2], case[3]) if fp8 else kv_view(case[0], case[2], case[3])
    text = _lowered_for_cuda(tuple(geometry), view, jnp.bfloat16 if fp8 else jnp.uint16, monkeypatch, scales=fp8,
                             consumers=2)
    assert "mosaic_gpu" in text


THREE_CONSUMERS = [
    # (Hkv, G, D, ps, window, softcap, sinks, block_kv, ring_slots, num_splits, fp8)
    (8, 4, 128, 16, None, None, False, 64, 3, None, False),   # bf16: an O tile per consumer
    (8, 4, 128, 16, None, None, False, 64, 3, None, True),    # fp8 at D = 128: 64-token blocks fit three
    (2, 6, 64, 32, 200, 5.0, True, 64, 3, 2, True),           # fp8, G = 6, a window, sinks, soft-cap, splits
]


@pytest.mark.parametrize("case", THREE_CONSUMERS, ids=[f"{'fp8' if c[-1] else 'bf16'}_g{c[1]}_d{c[2]}_p{c[3]}"
                                                       for c in THREE_CONSUMERS])
def test_three_consumers_lower_for_cuda(case, monkeypatch):
    """Three consumer warpgroups (152 registers a thread each; the producer is the fourth):
    Mosaic GPU's lowering accepts them, bf16 and fp8 (whole-row chunks at D = 128)."""
    *geometry, fp8 = case
    view = fp8_view(case[0], case[2], case[3]) if fp8 else kv_view(case[0], case[2], case[3])
    text = _lowered_for_cuda(tuple(geometry), view, jnp.bfloat16 if fp8 else jnp.uint16, monkeypatch, scales=fp8,
                             consumers=3, dequant_cols=case[2] if fp8 and case[2] == 128 else None)
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("D,consumers", [(128, 2), (64, 2), (128, 1)])
def test_whole_row_dequantisation_lowers_for_cuda(D, consumers, monkeypatch):
    """fp8 slots dequantised in whole-row register chunks (dequant_cols = D, the experiment beside
    the 64-column default): Mosaic GPU's lowering accepts the [64, D] loads and stores."""
    case = (2, 6, D, 16, 200, None, True, 128 if consumers == 2 else None, 2 if consumers == 2 else None, None)
    view = fp8_view(2, D, 16)
    text = _lowered_for_cuda(case, view, jnp.bfloat16, monkeypatch, scales=True, consumers=consumers,
                             dequant_cols=D)
    assert "mosaic_gpu" in text


def test_dequant_cols_checks():
    view, bf16 = fp8_view(2, 128, 16), kv_view(2, 128, 16)
    for cols in (64, 128):
        check_decode_mgpu_supported(q_of(view), view, DecodeMgpuConfig(128, 2, None, 2, cols))
    for cols in (32, 96, 256):
        with pytest.raises(NotImplementedError, match="dequant_cols"):
            check_decode_mgpu_supported(q_of(view), view, DecodeMgpuConfig(128, 2, None, 2, cols))
    with pytest.raises(NotImplementedError, match="fp8 K/V only"):
        check_decode_mgpu_supported(q_of(bf16), bf16, DecodeMgpuConfig(128, 2, None, 1, 128))
    d80 = fp8_view(2, 80, 16)  # plain byte rows: whole rows are already the default
    check_decode_mgpu_supported(q_of(d80), d80, DecodeMgpuConfig(64, 2, None, 1, 80))


def test_two_consumers_config_checks():
    """The ring's slots must split evenly between the consumers (each thread keeps one phase bit per
    barrier, so a consumer waits on every fill of the slots it owns), at most three consumers, and the
    shared-memory budget counts each consumer's tiles."""
    view = kv_view(8, 128, 16)
    q = q_of(view)
    check_decode_mgpu_supported(q, view, DecodeMgpuConfig(128, 2, None, 2))
    with pytest.raises(NotImplementedError, match="divide ring_slots"):
        check_decode_mgpu_supported(q, view, DecodeMgpuConfig(128, 3, None, 2))
    with pytest.raises(NotImplementedError, match="consumers"):
        check_decode_mgpu_supported(q, view, DecodeMgpuConfig(64, 4, None, 4))
    one, two = DecodeMgpuConfig(128, 2), DecodeMgpuConfig(128, 2, None, 2)
    assert smem_bytes(128, two) - smem_bytes(128, one) == 2 * 64 * 128 * 2 + 64 * 32 * 4  # O tiles, a max/sum tile
    assert smem_bytes(128, two, fp8=True) - smem_bytes(128, one, fp8=True) == 2 * 128 * 128 * 2 + 64 * 32 * 4
    assert smem_bytes(128, two, fp8=True) <= _SMEM_LIMIT  # the fp8 benchmark's tiling fits
    d256 = kv_view(2, 256, 16)
    with pytest.raises(NotImplementedError, match="shared memory"):
        check_decode_mgpu_supported(q_of(d256), d256, DecodeMgpuConfig(64, 2, None, 2))


# --------------------------------------------------------------------------- transposed scores (fp8)

TRANSPOSED = [
    # (Hkv, G, D, ps, window, softcap, sinks, block_kv, ring_slots, num_splits, consumers)
    (8, 4, 128, 16, None, None, False, 128, 2, None, 1),   # the benchmarked shape: 128-token blocks
    (8, 4, 128, 16, None, None, False, 128, 2, None, 2),   # ... two consumers
    (8, 4, 128, 16, None, None, False, 128, 4, None, 2),   # a deeper ring
    (2, 6, 128, 64, 200, 5.0, True, 64, 4, 2, 2),          # G = 6, a window, soft-cap, sinks, splits
    (1, 12, 64, 16, None, None, False, 64, 2, None, 1),    # N = 16 columns (a swizzled P^T tile), D = 64
    (2, 40, 256, 32, None, None, True, 64, 2, None, 1),    # N = 48, D = 256
    (1, 64, 128, 256, None, None, False, 64, 2, 1, 1),     # 64 q heads a kv head, a page over the block
]


@pytest.mark.parametrize("case", TRANSPOSED, ids=[f"g{c[1]}_d{c[2]}_p{c[3]}_c{c[-1]}" for c in TRANSPOSED])
def test_transposed_lowers_for_cuda(case, monkeypatch):
    """The transposed fp8 form (S^T = K Q^T with K converted into registers, O^T += V^T P^T) lowers:
    GQA 4 to 64 (16 to 64 q columns), head dims 64-256, one or two consumers."""
    if tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11):
        pytest.skip("jax 0.10's Mosaic GPU lowering cannot transpose a swizzled ref (the V^T load); the kernel "
                    "runs on jax >= 0.11, which lowers it (scripts/lower_on_jax011.sh runs this test there)")
    *geometry, consumers = case
    view = fp8_view(case[0], case[2], case[3])
    text = _lowered_for_cuda(tuple(geometry), view, jnp.bfloat16, monkeypatch, scales=True, consumers=consumers,
                             transposed=True)
    assert "mosaic_gpu" in text


def test_transposed_consumers_lower_with_their_own_reduction_scratch(monkeypatch):
    """The transposed form's max and sum reduce down S^T's rows, which the 4 warps share, through a
    shared-memory scratch that Mosaic GPU's lowering puts where the program's shared memory in use
    ends: without care, the same bytes for both consumers (they raced on the GPU: wrong sums, while
    jax's interpreter, which has no such scratch, passed).  Each consumer's reductions must get
    their own region, at least a reduction scratch apart."""
    if tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11):
        pytest.skip("jax 0.10's Mosaic GPU lowering cannot transpose a swizzled ref (the V^T load); the kernel "
                    "runs on jax >= 0.11, which lowers it (scripts/lower_on_jax011.sh runs this test there)")
    from jax._src.pallas.mosaic_gpu import lowering as mgpu_lowering

    offsets = []
    rule = mgpu_lowering._reduce_lowering_rule_wg

    def spy(ctx, *args, **kw):
        offsets.append(ctx.module_ctx.smem_used_bytes)
        return rule(ctx, *args, **kw)

    monkeypatch.setattr(mgpu_lowering, "_reduce_lowering_rule_wg", spy)
    view = fp8_view(2, 128, 16)  # G = 5: a geometry no other lowering test traces (jit caches lowerings)
    _lowered_for_cuda((2, 5, 128, 16, None, None, False, 128, 2, None), view, jnp.bfloat16, monkeypatch,
                      consumers=2, transposed=True)
    regions = sorted(set(offsets))
    assert len(regions) == 2, f"two consumers' reductions at {regions}"
    assert regions[1] - regions[0] >= paged_decode_mgpu._REDUCTION_SCRATCH


def test_transposed_default_takes_two_consumers(monkeypatch):
    """transposed=True with no consumers given: the wrapper takes the fp8 default's two consumers and
    whole-row chunks (two transposed consumers are right on the GPU since session 38, 1.2x one)."""
    from umem_jax.pallas_kernels import paged_decode_mgpu as mod

    seen = []
    monkeypatch.setattr(mod, "_paged_decode_mgpu", lambda q, *a, cfg, **k: seen.append(cfg) or q)
    view = fp8_view(2, 128, 16)
    q = jnp.zeros((1, 10, 128), jnp.bfloat16)  # a shape no other test traces (the wrapper is jitted)
    args = (jnp.zeros((8 * view.rows_per_page, view.row_words), jnp.uint16), jnp.zeros((1, 3), jnp.int32),
            jnp.ones((1,), jnp.int32))
    paged_decode_attention_mgpu(q, *args, view=view, transposed=True)
    paged_decode_attention_mgpu(q, *args, view=view)
    paged_decode_attention_mgpu(q, *args, view=view, transposed=True, consumers=1)
    assert [(c.consumers, c.transposed, c.dequant_cols) for c in seen] == \
        [(2, True, 128), (2, False, 128), (1, True, None)]


def test_transposed_config_checks():
    """The transposed form: fp8 K/V only, D a multiple of 64 (V^T's 64-row M tiles), one or two
    consumers; the q heads become 16-column multiples, and its shared memory counts each consumer's
    V, P^T, O^T and max/sum tiles and reduction scratch (no K tile, a Q tile of N rows)."""
    assert [q_columns(g) for g in (1, 4, 8, 16, 17, 40, 64)] == [16, 16, 16, 16, 32, 48, 64]
    view, bf16, d80 = fp8_view(8, 128, 16), kv_view(8, 128, 16), fp8_view(2, 80, 16)
    t1, t2 = DecodeMgpuConfig(128, 2, None, 1, None, True), DecodeMgpuConfig(128, 2, None, 2, None, True)
    check_decode_mgpu_supported(q_of(view), view, t1)
    check_decode_mgpu_supported(q_of(view), view, t2)
    check_decode_mgpu_supported(q_of(view, G=64), view, DecodeMgpuConfig(64, 2, None, 1, None, True))
    with pytest.raises(NotImplementedError, match="transposed scores: fp8"):
        check_decode_mgpu_supported(q_of(bf16), bf16, t1)
    with pytest.raises(NotImplementedError, match="multiple of 64"):
        check_decode_mgpu_supported(q_of(d80), d80, DecodeMgpuConfig(64, 2, None, 1, None, True))
    with pytest.raises(NotImplementedError, match="one or two consumers"):
        check_decode_mgpu_supported(q_of(view), view, DecodeMgpuConfig(64, 3, None, 3, None, True))
    N, D, bkv = 16, 128, 128
    per_consumer = 2 * bkv * D + 2 * bkv * N + 2 * D * N + 4 * 64 * N + 2048
    assert smem_bytes(D, t2, fp8=True, G=4) == 2 * N * D + 2 * 2 * bkv * D + 2 * per_consumer + 1024
    # no K tile per consumer: 64 KiB less than the untransposed pair's at the benchmark's tiling
    assert smem_bytes(D, t2, fp8=True, G=4) < smem_bytes(D, DecodeMgpuConfig(128, 2, None, 2), fp8=True) - 60 * 1024
    assert smem_bytes(D, DecodeMgpuConfig(128, 4, None, 2, None, True), fp8=True, G=4) <= _SMEM_LIMIT


@pytest.mark.parametrize("sinks", [False, True])
def test_combine_partials_matches_combine_splits(sinks):
    """The transposed form's partials (O^T and a max/sum tile, transposed back by the wrapper) merge
    through combine_partials exactly as the packed [G8, 32] tiles do through combine_splits."""
    rng = np.random.default_rng(3)
    B, Hkv, S, G, D = 2, 3, 4, 5, 64
    o = jnp.asarray(rng.standard_normal((B, Hkv, S, 8, D)), jnp.float32)
    m = rng.standard_normal((B, Hkv, S, 8)).astype(np.float32) * 3
    l = np.abs(rng.standard_normal((B, Hkv, S, 8))).astype(np.float32) + 0.1
    l[0, 0, 1] = 0.0  # an empty split
    ml = np.zeros((B, Hkv, S, 8, 32), np.float32)
    ml[..., 0], ml[..., 16] = m, l
    lengths = jnp.asarray([7, 0], jnp.int32)
    sk = jnp.asarray(rng.standard_normal(Hkv * G), jnp.float32) if sinks else None
    want = combine_splits(o, jnp.asarray(ml), lengths, sk, G, jnp.float32)
    got = combine_partials(o[:, :, :, :G], jnp.asarray(m[..., :G]), jnp.asarray(l[..., :G]), lengths, sk, jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
