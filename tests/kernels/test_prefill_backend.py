"""Which paged prefill kernel impl="pallas" runs (paged_prefill.prefill_backend): the Mosaic GPU
kernel on Hopper with jax >= 0.11 where it covers the case, else Triton; UMEM_JAX_PREFILL forces
either.  The decision is pure (shapes, dtypes, a DeviceInfo), so every branch is checked on CPU
with made-up device info; the Mosaic kernel through the model on a real H200 is in
tests/gpu/test_prefill_gpu.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _prefill_utils import kv_view, make_case

from umem_jax.pallas_kernels import paged_prefill
from umem_jax.pallas_kernels.paged_prefill import (
    DEFAULT_BACKEND,
    PREFILL_ENV,
    DeviceInfo,
    paged_prefill_attention,
    paged_prefill_attention_reference,
    prefill_backend,
    prefill_config,
)

H200 = DeviceInfo("gpu", "9.0", (0, 11))
CPU = DeviceInfo("cpu", None, (0, 11))
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def q_of(view, Hq=None, T=64, B=2, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct((B, T, Hq or 4 * view.num_kv_heads, view.head_dim), dtype)


@pytest.fixture(autouse=True)
def _auto(monkeypatch):
    # The decision under test is "auto"'s; the unset default is checked on its own below.
    monkeypatch.setenv(PREFILL_ENV, "auto")


# --------------------------------------------------------------------------- the pure decision


@pytest.mark.parametrize("D", [64, 80, 96, 128, 256])
def test_hopper_bf16_picks_mgpu(D):
    view = kv_view(2, D, 16)
    assert prefill_backend(q_of(view), view, device=H200) == ("mgpu", "")
    for G in (3, 5, 6, 7):  # any GQA ratio: a CTA per q head
        assert prefill_backend(q_of(view, Hq=2 * G), view, device=H200) == ("mgpu", "")
    assert prefill_backend(q_of(view), view, device=DeviceInfo("gpu", "9.0", (1, 2))) == ("mgpu", "")
    assert prefill_backend(q_of(view), view, kv_dtype=jnp.float16, device=H200) == ("mgpu", "")
    assert prefill_backend(q_of(view, dtype=jnp.float32), view, device=H200) == ("mgpu", "")  # q is cast


@pytest.mark.parametrize("device,why", [
    (CPU, "not an NVIDIA GPU"),
    (DeviceInfo("gpu", None, (0, 11)), "not an NVIDIA GPU"),  # ROCm: no CUDA compute capability
    (DeviceInfo("gpu", "8.0", (0, 11)), "not Hopper"),  # A100
    (DeviceInfo("gpu", "8.9", (0, 11)), "not Hopper"),
    (DeviceInfo("gpu", "10.0", (0, 11)), "not Hopper"),  # Blackwell: no wgmma
    (DeviceInfo("gpu", "9.0", (0, 10)), "0.11"),
])
def test_device_or_jax_not_covered_picks_triton(device, why):
    view = kv_view(2, 128, 16)
    kernel, reason = prefill_backend(q_of(view), view, device=device)
    assert kernel == "triton" and why in reason


@pytest.mark.parametrize("what,why", [
    ("fp32_planes", "fp32"),
    ("mk2", "arena rows"),  # a token's K spans two rows (row_words < Hkv * D)
    ("head_dim_32", "multiple of 16 in [64, 256]"),
    ("head_dim_72", "multiple of 16 in [64, 256]"),  # no whole wgmma K step
    ("head_dim_512", "multiple of 16 in [64, 256]"),
    ("page_size_4", "page_size"),
])
def test_case_not_covered_picks_triton(what, why):
    kw, D, ps = {}, 128, 16
    if what == "fp32_planes":
        kw = dict(fp32=True)
    elif what == "mk2":
        kw = dict(row_words=128)  # 2 kv heads x 128 words
    elif what.startswith("head_dim_") and what != "head_dim_512":
        D = int(what.rsplit("_", 1)[1])
    elif what == "head_dim_512":
        D = 512
    elif what.startswith("page_size"):
        ps = int(what.rsplit("_", 1)[1])
    view = kv_view(2, D, ps, **kw)
    kernel, reason = prefill_backend(q_of(view), view, device=H200)
    assert kernel == "triton" and why in reason, reason


def test_default_device_on_this_host():
    """No GPU here: the probe says so and the decision is Triton (the reference stays the CPU
    default: impl=None never reaches the choice)."""
    if jax.default_backend() == "gpu":
        pytest.skip("checks what a host without a GPU decides; on the GPU machine test_hopper_* and "
                    "tests/gpu/test_prefill_gpu.py cover the GPU side")
    paged_prefill.device_info.cache_clear()
    info = paged_prefill.device_info()
    assert info.platform == jax.default_backend() and info.compute_capability is None
    view = kv_view(2, 128, 16)
    kernel, why = prefill_backend(q_of(view), view)
    assert kernel == "triton" and "not an NVIDIA GPU" in why


def test_mgpu_default_config_fits():
    """The measured (128, 2, ping-pong) where it fits shared memory and the page size, 64-token
    KV blocks otherwise (D=256: the 128-token ring would need 324 KiB)."""
    from umem_jax.pallas_kernels.paged_prefill_mgpu import MgpuConfig, default_mgpu_config

    assert default_mgpu_config(128, 16) == MgpuConfig(64, 128, 2, True)
    assert default_mgpu_config(64, 256) == MgpuConfig(64, 128, 2, True)
    assert default_mgpu_config(256, 16) == MgpuConfig(64, 64, 2, True)
    assert default_mgpu_config(256, 512) == MgpuConfig(64, 64, 2, True)  # a page holds whole blocks


# --------------------------------------------------------------------------- the override


def test_env_override(monkeypatch):
    view = kv_view(2, 128, 16)
    q = q_of(view)
    monkeypatch.setenv(PREFILL_ENV, "triton")
    assert prefill_backend(q, view, device=H200)[0] == "triton"
    monkeypatch.setenv(PREFILL_ENV, " MGPU ")
    assert prefill_backend(q, view, device=H200) == ("mgpu", "")
    with pytest.raises(NotImplementedError, match="not an NVIDIA GPU"):
        prefill_backend(q, view, device=CPU)  # forced, so no silent fallback
    fp32 = kv_view(2, 128, 16, fp32=True)
    with pytest.raises(NotImplementedError, match="fp32"):
        prefill_backend(q_of(fp32), fp32, device=H200)
    monkeypatch.setenv(PREFILL_ENV, "auto")
    assert prefill_backend(q, view, device=H200)[0] == "mgpu"
    assert prefill_backend(q, view, device=CPU)[0] == "triton"
    monkeypatch.setenv(PREFILL_ENV, "")
    assert DEFAULT_BACKEND == "auto"  # empty == unset: Mosaic on Hopper, Triton elsewhere
    assert prefill_backend(q, view, device=H200)[0] == "mgpu"
    assert prefill_backend(q, view, device=CPU)[0] == "triton"
    assert prefill_backend(q_of(fp32), fp32, device=H200)[0] == "triton"  # not covered: no error, Triton
    # The argument wins over the environment.
    monkeypatch.setenv(PREFILL_ENV, "mgpu")
    assert prefill_backend(q, view, backend="triton", device=H200)[0] == "triton"
    monkeypatch.setenv(PREFILL_ENV, "cudnn")
    with pytest.raises(ValueError, match=PREFILL_ENV):
        prefill_backend(q, view, device=H200)
    with pytest.raises(ValueError, match="backend"):
        prefill_backend(q, view, backend="fast", device=H200)


def test_wrapper_reads_env_per_call(monkeypatch):
    """The wrapper resolves the variable outside its own jit, so a change takes effect at the next
    trace with the same shapes instead of reusing its trace of the other kernel (a caller's
    jitted step keeps what it traced: set the variable before compiling).  On CPU a forced mgpu
    refuses; triton traces the Triton kernel (eval_shape: traced, not lowered)."""
    if jax.default_backend() == "gpu":
        pytest.skip("checks what a host without a GPU decides; on the GPU machine test_hopper_* and "
                    "tests/gpu/test_prefill_gpu.py cover the GPU side")
    view = kv_view(1, 64, 16, layer=0)
    q, arena, pt, q_lens, kv_lens = make_case(np.random.default_rng(0), view, [(3, 5)], T=8, P=2, Hq=2,
                                              q_dtype=jnp.bfloat16)
    def f(*a):  # a new function per trace: eval_shape caches traces by function
        return paged_prefill_attention(*a, view=view, impl="pallas")

    monkeypatch.setenv(PREFILL_ENV, "triton")
    assert jax.eval_shape(f, q, arena, pt, q_lens, kv_lens).shape == q.shape
    monkeypatch.setenv(PREFILL_ENV, "mgpu")
    with pytest.raises(NotImplementedError, match="Mosaic GPU prefill kernel was asked for"):
        jax.eval_shape(lambda *a: f(*a), q, arena, pt, q_lens, kv_lens)
    # interpret=True (the CPU test path) is the Triton kernel whatever the choice.
    out = paged_prefill_attention(q, arena, pt, q_lens, kv_lens, view=view, impl="pallas", interpret=True)
    ref = paged_prefill_attention_reference(q, arena, pt, q_lens, kv_lens, view=view)
    np.testing.assert_allclose(np.asarray(out[0, :5], np.float32), np.asarray(ref[0, :5], np.float32),
                               rtol=2e-2, atol=2e-2)
    # impl="reference" never consults the choice.
    monkeypatch.setenv(PREFILL_ENV, "mgpu")
    paged_prefill_attention(q, arena, pt, q_lens, kv_lens, view=view, impl="reference")


def test_old_jax_never_imports_mgpu_module():
    """With jax < 0.11 (real, or claimed by the device info) the decision and a traced call stop
    before importing paged_prefill_mgpu.  A fresh interpreter: other tests import it here."""
    code = textwrap.dedent("""
        import sys
        import jax, jax.numpy as jnp
        from umem_jax.memory.plan import KVView
        from umem_jax.pallas_kernels.paged_prefill import (DeviceInfo, paged_prefill_attention,
                                                           prefill_backend)
        view = KVView(rows_per_page=32, page_size=16, k_row=0, v_row=16, num_kv_heads=2, head_dim=128,
                      v_head_dim=128, row_words=256, planes=1)
        q = jax.ShapeDtypeStruct((1, 64, 8, 128), jnp.bfloat16)
        k, why = prefill_backend(q, view, device=DeviceInfo("gpu", "9.0", (0, 10)))
        assert k == "triton" and "0.11" in why, why
        k, why = prefill_backend(q, view)
        real = tuple(int(x) for x in jax.__version__.split(".")[:2])
        assert k == "triton", why
        if real < (0, 11):
            sds = jax.ShapeDtypeStruct
            i32 = lambda *s: sds(s, jnp.int32)
            jax.eval_shape(lambda *a: paged_prefill_attention(*a, view=view, impl="pallas"), q,
                           sds((64, 256), jnp.uint16), i32(1, 4), i32(1), i32(1))
        assert "umem_jax.pallas_kernels.paged_prefill_mgpu" not in sys.modules
        print("ok")
    """)
    env = {**os.environ, PREFILL_ENV: "auto"}  # the choice that would import it on a new jax
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_PLATFORMS"] = "cpu"  # also on the GPU machine: the check expects the CPU device
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


# --------------------------------------------------------------------------- Triton defaults


def test_triton_defaults_follow_the_sweep():
    """(rows 128, BK 128, 8 warps, 3 stages) on bf16 at D <= 128, as measured on the H200; smaller
    tiles and fp32 planes keep BK 64, D=256 keeps BK 32."""
    c = prefill_config(4096, 4, 128)
    assert (c.block_q * 4, c.block_k, c.num_warps, c.num_stages) == (128, 128, 8, 3)
    assert prefill_config(4096, 4, 64).block_k == 128
    assert prefill_config(4096, 4, 64, planes=2).block_k == 64
    # fp32 planes at D=128 on 128 rows: BK=64 would need 3 x 64 KiB K/V stages + a 64 KiB q tile
    # = 262656 B, over the H200's 232448 (RESOURCE_EXHAUSTED there, seen with G=5, D=80): BK=32.
    assert prefill_config(4096, 4, 128, planes=2).block_k == 32
    small = prefill_config(16, 4, 128)  # a 64-row tile on 4 warps: 64 measured faster
    assert (small.block_q * 4, small.num_warps, small.block_k) == (64, 4, 64)
    assert prefill_config(4096, 2, 256).block_k == 32
    assert prefill_config(4096, 4, 128, Dv=256).block_k == 32


def test_triton_defaults_trimmed_to_shared_memory():
    """A defaulted BK shrinks (then the stage count) until the K/V stages fit SMEM_BUDGET; values
    given explicitly are kept."""
    from umem_jax.pallas_kernels.paged_decode import SMEM_BUDGET

    c = prefill_config(4096, 4, 128, num_stages=4)  # 4 x 128 x 256 x 2 B = 256 KiB: too much
    assert (c.block_k, c.num_stages) == (64, 4)
    assert 4 * 64 * 256 * 2 <= SMEM_BUDGET
    c = prefill_config(4096, 4, 128, block_k=128, planes=2)  # explicit BK: the stages give way
    assert (c.block_k, c.num_stages) == (128, 2)
    c = prefill_config(4096, 4, 128, block_k=128, num_stages=4)
    assert (c.block_k, c.num_stages) == (128, 4)
    # The K/V stages and the q tile together stay under the CTA's 227 KiB (less 1 KiB), for any G
    # and head dim (80 and 96 count as 128-wide tiles).
    for G in (1, 3, 4, 5, 6, 7, 8):
        for D in (64, 80, 96, 128, 256):
            for planes in (1, 2):
                c = prefill_config(4096, G, D, planes=planes)
                Dt = 256 if D > 128 else 128 if D > 64 else 64
                need = c.num_stages * c.block_k * 2 * Dt * 2 * planes + c.block_rows * Dt * 2 * planes
                assert need <= 227 * 1024 - 1024, (G, D, planes, c)


# --------------------------------------------------------------------------- the dispatch, lowered


@pytest.mark.skipif(paged_prefill.device_info().jax_version < (0, 11),
                    reason="the dispatch takes the Mosaic GPU kernel only on jax >= 0.11 (plgpu.kernel's API there); "
                    "this jax has an older one")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("D,window,softcap", [(128, None, None), (256, 1024, 50.0), (80, 100, None), (96, None, 30.0)])
def test_wrapper_lowers_mgpu_on_hopper(monkeypatch, D, window, softcap):
    """With the device info of an H200, impl="pallas" through the public wrapper cross-lowers the
    Mosaic GPU kernel for CUDA (D=256 with its 64-token default blocks); with the Triton choice
    forced, the Triton kernel."""
    from _prefill_utils import abstract_gpu

    monkeypatch.setattr(paged_prefill, "device_info", lambda: H200)
    view = kv_view(2, D, 16, layer=0)
    sds = jax.ShapeDtypeStruct
    Hq = {80: 6, 96: 12}.get(D, 8)  # G = 3 and 6 with the head dims that are no multiple of 64
    args = (sds((2, 200 + D, Hq, D), jnp.bfloat16), sds((64 * view.rows_per_page, view.row_words), jnp.uint16),
            sds((2, 40), jnp.int32), sds((2,), jnp.int32), sds((2,), jnp.int32))

    def lowered():
        def f(*a):  # a new function per lowering: the choice is made when f is traced
            return paged_prefill_attention(*a, view=view, window=window, softcap=softcap, impl="pallas")

        with abstract_gpu():
            return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    text = lowered()
    assert "mosaic_gpu" in text and "triton" not in text
    monkeypatch.setenv(PREFILL_ENV, "triton")
    text = lowered()
    assert "__gpu$xla.gpu.triton" in text and "mosaic_gpu" not in text


@pytest.mark.skipif(paged_prefill.device_info().jax_version < (0, 11),
                    reason="the dispatch takes the Mosaic GPU kernel only on jax >= 0.11 (plgpu.kernel's API there); "
                    "this jax has an older one")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("D,G,window,softcap", [(128, 4, None, None), (256, 2, 1024, 50.0), (64, 6, 100, None)])
def test_wrapper_fp8_auto_lowers_mosaic_and_triton_when_asked(monkeypatch, D, G, window, softcap):
    """fp8 K/V with per-head scales through the public wrapper, with an H200's device info: "auto"
    cross-lowers the Mosaic GPU kernel (D = 256: one dequantised tile per consumer; D = 128:
    128-token blocks with one tile), UMEM_JAX_PREFILL=triton the Triton kernel."""
    from _prefill_utils import abstract_gpu

    monkeypatch.setattr(paged_prefill, "device_info", lambda: H200)
    view = kv_view(2, D, 16, fp8=True, layer=0)
    sds = jax.ShapeDtypeStruct
    args = (sds((2, 200, 2 * G, D), jnp.bfloat16), sds((64 * view.rows_per_page, view.row_words), jnp.bfloat16),
            sds((2, 40), jnp.int32), sds((2,), jnp.int32), sds((2,), jnp.int32), sds((2,), jnp.float32),
            sds((2,), jnp.float32))

    def lowered():
        def f(q, arena, pt, q_lens, kv_lens, ks, vs):  # a new function per lowering: the choice is made when traced
            return paged_prefill_attention(q, arena, pt, q_lens, kv_lens, view=view, window=window, softcap=softcap,
                                           k_scale=ks, v_scale=vs, impl="pallas")

        with abstract_gpu():
            return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    text = lowered()  # the fixture's "auto"
    assert "mosaic_gpu" in text and "triton" not in text
    monkeypatch.setenv(PREFILL_ENV, "triton")
    text = lowered()
    assert "__gpu$xla.gpu.triton" in text and "mosaic_gpu" not in text
