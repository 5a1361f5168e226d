"""GPU-only: the Mamba2 and gated DeltaNet decode kernels (Triton) against their references at
realistic shapes, in place on a donated arena over 4 GiB (64-bit offsets), slots near its top.

Shapes: NemotronH-8B-like Mamba2 (H=128, P=64, N=128, G=8, conv 4) and Qwen3.5-4B-like gated
DeltaNet (Hk=16, Hv=32, Dk=Dv=128, conv 4), 1024-word arena rows, bf16 activations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _state_utils import BF16_TOL, F32_TOL, rel_err, state_view

from umem_jax.memory import gated_deltanet_state_tensors, mamba2_state_tensors
from umem_jax.pallas_kernels._compat import silence_triton_deprecation
from umem_jax.pallas_kernels.gated_deltanet import gdn_decode, gdn_dims, gdn_prefill
from umem_jax.pallas_kernels.mamba2 import mamba2_decode, mamba2_dims
from umem_jax.pallas_kernels.state_io import read_state, read_state_reference, write_state, write_state_reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU (Triton kernels)")]

ARENA_BYTES = 5 << 30  # over 4 GiB: Triton switches to 64-bit offsets


def _arena(view):
    rows = ARENA_BYTES // (view.row_words * 2)
    num_slots = (rows - view.base_row) // view.rows_per_slot  # slot 0 included (no rows of its own)
    arena = jax.jit(lambda: jnp.full((rows, view.row_words), 0xFFFF, jnp.uint16))()
    return arena, num_slots


def _slots(rng, num_slots, B):
    # half the lanes in the top slots (past 2**31 words from the start), a padding lane, rest random
    top = np.arange(num_slots - B // 2, num_slots)
    low = rng.choice(np.arange(1, num_slots - B // 2), size=B - B // 2 - 1, replace=False)
    s = np.concatenate([top, low, [0]])
    rng.shuffle(s)
    return jnp.asarray(s, jnp.int32)


def _check_in_place(fn, arena, *args):
    c = jax.jit(fn, donate_argnums=0).lower(arena, *args).compile()
    m = c.memory_analysis()
    assert m is None or m.alias_size_in_bytes >= arena.nbytes
    shape = f"u16[{arena.shape[0]},{arena.shape[1]}]"
    assert not [l for l in c.as_text().splitlines() if " copy(" in l and shape in l]
    p0 = arena.unsafe_buffer_pointer()
    out = c(arena, *args)
    new = out[-1] if isinstance(out, tuple) else out
    assert new.unsafe_buffer_pointer() == p0, "the arena moved: not updated in place"
    return out


def _read(arena, view, slots):
    return jax.jit(lambda a, s: read_state_reference(a, s, view=view))(arena, slots)


def _compare_states(got, want, real):
    for k in got:
        g, w = np.asarray(got[k], np.float32)[real], np.asarray(want[k], np.float32)[real]
        tol = F32_TOL if got[k].dtype == jnp.float32 else BF16_TOL
        assert rel_err(g, w) <= tol, k


def _seed_states(arena, view, slots, rng):
    st = {t.tensor.name: jnp.asarray(rng.standard_normal((slots.shape[0], *t.tensor.shape)) * 0.3,
                                     jnp.dtype(t.tensor.dtype)) for t in view.tensors}
    return jax.jit(lambda a, s, x: write_state_reference(a, s, x, view=view), donate_argnums=0)(arena, slots, st)


def _mamba2_inputs(rng, d, B, n):
    """NemotronH-8B-like Mamba2 decode inputs: (xbc, dt), (conv weight, conv bias, A_log, dt_bias, D)."""
    f32 = lambda sc=1.0, off=0.0: jnp.asarray(rng.standard_normal(d.heads) * sc + off, jnp.float32)
    return (n(B, d.conv_dim), n(B, d.heads)), (n(d.conv_dim, 4, sc=0.5), n(d.conv_dim, sc=0.1), f32(0.5),
                                                f32(0.5, -1.0), f32())


def _gdn_inputs(rng, d, B, n):
    """Qwen3.5-4B-like gated DeltaNet decode inputs: (qkv, a, b), (conv weight, A_log, dt_bias)."""
    f32 = lambda: jnp.asarray(rng.standard_normal(d.v_heads) * 0.5, jnp.float32)
    return (n(B, d.conv_dim), n(B, d.v_heads), n(B, d.v_heads)), (n(d.conv_dim, 4, sc=0.5), f32(), f32())


# family: (state tensors, dims, decode, inputs, seed offset)
FAMILIES = {
    "mamba2_nemotronh_8b": (lambda: mamba2_state_tensors(128, 64, 128, 8, 4), mamba2_dims, mamba2_decode,
                            _mamba2_inputs, 0),
    "gdn_qwen35_4b": (lambda: gated_deltanet_state_tensors(16, 32, 128, 128, 4), gdn_dims, gdn_decode,
                      _gdn_inputs, 100),
}


@pytest.mark.parametrize("B", [8, 64])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_decode_at_model_shape(family, B):
    """The Pallas decode, in place on a donated 5 GiB arena, vs the reference: output within bf16
    tolerance (it is bf16), states within their dtype's tolerance."""
    silence_triton_deprecation()
    tensors, dims, decode, make_inputs, seed = FAMILIES[family]
    rng = np.random.default_rng(seed + B)
    view = state_view(tensors(), row_words=1024, layers=2)
    d = dims(view)
    arena, num_slots = _arena(view)
    slots = _slots(rng, num_slots, B)
    arena = _seed_states(arena, view, slots, rng)
    n = lambda *s, sc=1.0: jnp.asarray(rng.standard_normal(s) * sc, jnp.bfloat16)
    inputs, params = make_inputs(rng, d, B, n)
    ref = jax.jit(lambda ar, *x: decode(ar, *x, view=view, impl="reference"))
    out_ref, a_ref = ref(arena, slots, *inputs, *params)
    out_ref, st_ref = np.asarray(out_ref, np.float32), _read(a_ref, view, slots)
    del a_ref
    pal = lambda ar, *x: decode(ar, *x, view=view, impl="pallas")
    out_pal, arena = _check_in_place(pal, arena, slots, *inputs, *params)
    assert np.isfinite(np.asarray(out_pal, np.float32)).all()
    assert rel_err(np.asarray(out_pal, np.float32), out_ref) <= BF16_TOL
    _compare_states(_read(arena, view, slots), st_ref, np.asarray(slots) != 0)


def test_state_io_pallas_matches_reference_on_gpu():
    silence_triton_deprecation()
    rng = np.random.default_rng(7)
    view = state_view(mamba2_state_tensors(128, 64, 128, 8, 4), row_words=1024, layers=2)
    arena, num_slots = _arena(view)
    slots = _slots(rng, num_slots, 8)
    x = {t.tensor.name: jnp.asarray(rng.standard_normal((8, *t.tensor.shape)), jnp.dtype(t.tensor.dtype))
         for t in view.tensors}
    arena = _check_in_place(lambda a, s, x: write_state(a, s, x, view=view, impl="pallas"), arena, slots, x)
    got = read_state(arena, slots, view=view, impl="pallas")
    want = read_state_reference(arena, slots, view=view)
    real = np.asarray(slots) != 0
    for k in x:
        g = np.asarray(got[k]).view(np.uint16 if got[k].dtype.itemsize == 2 else np.uint32)
        np.testing.assert_array_equal(g, np.asarray(want[k]).view(g.dtype))
        np.testing.assert_array_equal(g[real], np.asarray(x[k]).view(g.dtype)[real])


def test_prefill_then_decode_on_gpu():
    """Prefill (plain JAX, Pallas state io) then a Pallas decode == a one-token-longer prefill."""
    silence_triton_deprecation()
    rng = np.random.default_rng(9)
    # fp32 conv state: with the default bf16 one, the decode sees rounded inputs the long prefill does not
    view = state_view(gated_deltanet_state_tensors(16, 32, 128, 128, 4, conv_dtype="float32"), row_words=1024, layers=1)
    d = gdn_dims(view)
    rows = view.slot_row(64)
    arena = jnp.zeros((rows, 1024), jnp.uint16)
    B, T = 4, 33
    slots = jnp.array([5, 0, 17, 40], jnp.int32)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    qkv, a, b = f(B, T + 1, d.conv_dim), f(B, T + 1, d.v_heads), f(B, T + 1, d.v_heads)
    p = (f(d.conv_dim, 4) * 0.5, f(d.v_heads) * 0.5, f(d.v_heads) * 0.5)
    reset = jnp.ones((B,), bool)
    q = jnp.full((B,), T, jnp.int32)
    pre = jax.jit(lambda ar: gdn_prefill(ar, slots, qkv[:, :T], a[:, :T], b[:, :T], q, *p, view=view, reset=reset))
    _, a1 = pre(arena)
    o_dec, a1 = jax.jit(lambda ar: gdn_decode(ar, slots, qkv[:, T], a[:, T], b[:, T], *p, view=view))(a1)
    o_long, a2 = jax.jit(lambda ar: gdn_prefill(ar, slots, qkv, a, b, q + 1, *p, view=view, reset=reset))(arena)
    real = np.asarray(slots) != 0
    assert rel_err(np.asarray(o_dec)[real], np.asarray(o_long)[real, T]) <= 1e-4
    _compare_states(_read(a1, view, slots), _read(a2, view, slots), real)
