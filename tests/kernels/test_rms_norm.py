"""The RMSNorm kernels (pallas_kernels/rms_norm.py), interpreted on CPU (compiled on a GPU), against
their references: plain and zero-centred (1 + w) norms, the fused residual add, both gated norms
(Mamba2's gate first, DeltaNet's gate after), row lengths that are no power of two, row counts that
leave a partial block, bf16 / fp32; and the models' RMSNorm / GatedRMSNorm following $UMEM_JAX_NORM.
Fresh random data per case; interpret mode leaves unwritten outputs NaN, so every element is
checked."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _kernel_utils import cuda_lowering, no_triton_deprecation

from umem_jax.pallas_kernels.rms_norm import (NORM_ENV, gated_rms_norm, gated_rms_norm_reference, norm_backend,
                                              rms_norm, rms_norm_reference)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ON_GPU = jax.default_backend() == "gpu"


def rand(seed: int, shape, dtype, scale=1.0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32) * scale).astype(dtype)


def close(got, want, dtype):
    """bf16 outputs may differ by one rounding (the mean square's order of summation)."""
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == jnp.bfloat16 else dict(rtol=2e-5, atol=2e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)), **tol)


# (lead shape, D, dtype, offset): decode rows, prefill blocks, the hidden sizes of real models
CASES = [
    ((1,), 2048, jnp.bfloat16, 0.0),       # Qwen3.5-MoE decode at batch 1
    ((3, 5), 2880, jnp.bfloat16, 0.0),     # gpt-oss: D no power of two, leading dims
    ((37,), 2688, jnp.float32, 0.0),       # Nemotron 3 Nano, fp32, a partial block of rows
    ((2, 3), 640, jnp.bfloat16, 1.0),      # Gemma 3 270M: zero-centred weight
    ((9,), 7168, jnp.bfloat16, 1.0),       # wide rows: one row a program
    ((4,), 10, jnp.float32, 0.0),          # below the 16-column minimum tile
]


@pytest.mark.parametrize("lead,D,dtype,offset", CASES)
def test_rms_norm_matches_reference(lead, D, dtype, offset):
    seed = D + len(lead)
    x = rand(seed, (*lead, D), dtype, 3.0)
    w = rand(seed + 1, (D,), dtype, 0.5) + (0.0 if offset else 1.0)
    with no_triton_deprecation():
        got = rms_norm(x, w, eps=1e-6, offset=offset, interpret=not ON_GPU)
    close(got, rms_norm_reference(x, w, eps=1e-6, offset=offset), dtype)


@pytest.mark.parametrize("lead,D,dtype,offset", CASES[:4])
def test_residual_add_and_norm(lead, D, dtype, offset):
    """(norm(x + r), x + r): the sum exactly as XLA rounds `x + r` in x.dtype."""
    seed = 7 * D + len(lead)
    x, r = rand(seed, (*lead, D), dtype, 2.0), rand(seed + 1, (*lead, D), dtype, 2.0)
    w = rand(seed + 2, (D,), dtype, 0.5)
    with no_triton_deprecation():
        y, h = rms_norm(x, w, eps=1e-5, offset=offset, residual=r, interpret=not ON_GPU)
    y_ref, h_ref = rms_norm_reference(x, w, eps=1e-5, offset=offset, residual=r)
    np.testing.assert_array_equal(np.asarray(h.astype(jnp.float32)), np.asarray((x + r).astype(jnp.float32)))
    assert h.dtype == dtype
    close(y, y_ref, dtype)
    close(h, h_ref, dtype)


# (lead, D, group_size, norm_before_gate, dtype): Mamba2 (gate first, groups) and DeltaNet (per head)
GATED = [
    ((1,), 4096, 512, False, jnp.bfloat16),   # Nemotron 3 Nano's Mamba2 at decode: 8 groups
    ((3, 4), 768, 96, False, jnp.float32),    # groups of 96: padded to 128
    ((1, 32), 128, 128, True, jnp.bfloat16),  # Qwen3.5 DeltaNet: one head a group
    ((5,), 1024, 1024, True, jnp.float32),    # one group
]


@pytest.mark.parametrize("lead,D,gs,before,dtype", GATED)
def test_gated_rms_norm_matches_reference(lead, D, gs, before, dtype):
    seed = D + gs
    y, z = rand(seed, (*lead, D), dtype, 2.0), rand(seed + 1, (*lead, D), dtype, 2.0)
    w = rand(seed + 2, (D,), dtype, 0.3) + 1.0
    kw = dict(eps=1e-5, group_size=gs, norm_before_gate=before)
    with no_triton_deprecation():
        got = gated_rms_norm(y, z, w, interpret=not ON_GPU, **kw)
    close(got, gated_rms_norm_reference(y, z, w, **kw), dtype)


@pytest.mark.parametrize("before,shared", [(False, False), (True, True), (True, False)])
def test_gated_norm_reads_the_gate_in_place(before, shared):
    """z handed over as a projection's whole output [..., W] with the gate at z_offset (Mamba2's
    zxbcdt at 0, DeltaNet's fused qkv | z | b | a in the middle); shared: one [group_size] weight
    for every group (DeltaNet's heads).  The result is the norm of the slice."""
    lead, D, gs, off, W = (2, 3), 384, 64, 200, 1000
    y = rand(11, (*lead, D), jnp.bfloat16, 2.0)
    zs = rand(12, (*lead, W), jnp.bfloat16, 2.0)
    w = rand(13, (gs if shared else D,), jnp.bfloat16, 0.3) + 1.0
    kw = dict(eps=1e-6, group_size=gs, norm_before_gate=before)
    with no_triton_deprecation():
        got = gated_rms_norm(y, zs, w, z_offset=off, interpret=not ON_GPU, **kw)
    full_w = jnp.tile(w, D // gs) if shared else w
    close(got, gated_rms_norm_reference(y, zs[..., off:off + D], full_w, **kw), jnp.bfloat16)
    close(got, gated_rms_norm_reference(y, zs, w, z_offset=off, **kw), jnp.bfloat16)
    with pytest.raises(ValueError, match="z_offset"):
        gated_rms_norm(y, zs, w, z_offset=W - D + 1, **kw)


def test_bad_arguments_are_refused():
    x = jnp.zeros((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, jnp.ones(7), eps=1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, jnp.ones(8), eps=1e-6, residual=jnp.zeros((2, 8), jnp.bfloat16))
    with pytest.raises(ValueError, match="groups of 3"):
        gated_rms_norm(x, x, jnp.ones(8), eps=1e-6, group_size=3, norm_before_gate=True)


def test_models_follow_the_env_choice(monkeypatch):
    """RMSNorm (plain, zero-centred, with the residual add) and GatedRMSNorm give the same values
    under UMEM_JAX_NORM=pallas (interpreted here) as under =xla; bad values are refused."""
    from umem_jax.models.layers import RMSNorm
    from umem_jax.models.recurrent import GatedRMSNorm

    x, a = rand(1, (2, 3, 96), jnp.float32, 2.0), rand(2, (2, 3, 96), jnp.float32)
    got = {}
    for choice in ("pallas", "xla"):
        monkeypatch.setenv(NORM_ENV, choice)
        assert norm_backend() == choice
        out = []
        for offset in (0.0, 1.0):
            norm = RMSNorm(96, eps=1e-6, offset=offset, dtype=jnp.float32)
            norm.weight[...] = rand(3, (96,), jnp.float32, 0.2) + (1.0 - offset)
            with no_triton_deprecation():
                out += [norm(x), *norm.add(x, a)]
        gated = GatedRMSNorm(96, group_size=32, eps=1e-5, norm_before_gate=False, dtype=jnp.float32)
        with no_triton_deprecation():
            out.append(gated(x, a))
        got[choice] = out
    for p, r in zip(got["pallas"], got["xla"]):
        np.testing.assert_allclose(np.asarray(p), np.asarray(r), rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(np.asarray(got["xla"][1]), np.asarray(x + a))  # add() returns (h, norm(h))
    monkeypatch.setenv(NORM_ENV, "fused")
    with pytest.raises(ValueError, match="UMEM_JAX_NORM"):
        norm_backend()


def test_triton_kernel_lowers_for_cuda():
    """The kernels build for CUDA (Triton lowering errors show here on any machine)."""
    x = jnp.zeros((3, 2880), jnp.bfloat16)
    with no_triton_deprecation():
        text = cuda_lowering(lambda x, r: rms_norm(x, jnp.ones(2880, jnp.bfloat16), eps=1e-5, residual=r), x, x)
        if text is not None:
            text += cuda_lowering(lambda y, z: gated_rms_norm(y, z, jnp.ones(2880, jnp.bfloat16), eps=1e-5,
                                                              group_size=360, norm_before_gate=False), x, x)
    if text is None:
        pytest.skip("this jax cannot cross-lower for CUDA without a GPU (jax >= 0.11); the GPU run covers it")
    assert "umem_rms_norm" in text
