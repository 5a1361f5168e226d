"""write_kv: Pallas (interpret) == reference bit for bit; read-back returns what was written; no
other word of the arena changes.  read_kv_reference is checked against a hand-computed layout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _kernel_utils import as_np_u16, cuda_lowering, make_view, no_triton_deprecation, random_words

from umem_jax.pallas_kernels.kv_write import read_kv_reference, write_kv, write_kv_reference
from umem_jax.pallas_kernels.words import encode_np

CASES = [
    # (Hkv, D, Dv, ps, planes, row_words, arena dtype, value dtype)
    (2, 16, 16, 4, 1, None, jnp.uint16, jnp.bfloat16),      # mk == 1
    (2, 16, 16, 4, 2, None, jnp.bfloat16, jnp.float32),     # fp32 planes in a bf16 arena
    (4, 16, 32, 8, 1, 16, jnp.uint16, jnp.bfloat16),        # mk = 4, mv = 8 (rows narrower than K)
    (1, 64, 64, 16, 1, None, jnp.bfloat16, jnp.float16),    # f16 values, bf16 arena: bits only
]


def _expected(arena_u16, view, k, v, pages, slots, kv_dtype):
    """numpy model of the layout: token row = planes x [Hkv, D] words spread over m arena rows."""
    out = arena_u16.copy()
    W = view.row_words
    for x, base, m in ((k, view.k_row, view.mk), (v, view.v_row, view.mv)):
        words = encode_np(np.asarray(jnp.asarray(x).astype(kv_dtype)).reshape(len(pages), -1))
        for t, (p, s) in enumerate(zip(pages, slots)):
            r0 = p * view.rows_per_page + base + s * m
            out[r0:r0 + m] = words[t].reshape(m, W)
    return out


@pytest.mark.parametrize("Hkv,D,Dv,ps,planes,W,adt,vdt", CASES)
def test_write_kv_pallas_matches_layout(Hkv, D, Dv, ps, planes, W, adt, vdt):
    rng = np.random.default_rng(Hkv * 100 + D + planes)
    view = make_view(Hkv, D, Dv, ps, layers=2, layer=1, planes=planes, row_words=W)
    npages = 6
    arena = random_words(rng, (npages * view.rows_per_page + 2, view.row_words), adt)
    T = 7
    # Real tokens at distinct (page, slot); two padding tokens aimed at the sink (page 0).
    pages = np.array([3, 1, 3, 5, 0, 2, 0], np.int32)
    slots = np.array([0, ps - 1, 2, 1, 0, 0, 0], np.int32)
    k = jnp.asarray(rng.standard_normal((T, Hkv, D)), vdt)
    v = jnp.asarray(rng.standard_normal((T, Hkv, Dv)), vdt)
    kv_dtype = vdt if vdt == jnp.float16 else None
    want = _expected(as_np_u16(arena), view, k, v, pages, slots, vdt)
    sink = slice(0, view.rows_per_page)  # padding lanes may leave anything in the sink
    with no_triton_deprecation():
        got = write_kv(arena, k, v, jnp.asarray(pages), jnp.asarray(slots), view=view, kv_dtype=kv_dtype,
                       impl="pallas", interpret=True, block_words=32)
    ref = write_kv_reference(arena, k, v, jnp.asarray(pages), jnp.asarray(slots), view=view, kv_dtype=kv_dtype)
    assert got.dtype == arena.dtype and got.shape == arena.shape
    np.testing.assert_array_equal(as_np_u16(got)[view.rows_per_page:], want[view.rows_per_page:])
    np.testing.assert_array_equal(as_np_u16(ref)[view.rows_per_page:], want[view.rows_per_page:])
    np.testing.assert_array_equal(as_np_u16(got)[sink], as_np_u16(ref)[sink])

    # read back through a page table: written tokens come back exactly, in the stored dtype
    kr, vr = read_kv_reference(got, jnp.asarray([[3, 1, 5]], jnp.int32), view=view, kv_dtype=kv_dtype)
    assert kr.dtype == (vdt if planes == 2 or vdt == jnp.float16 else jnp.bfloat16)
    for t, (pos_page, slot) in {0: (0, 0), 1: (1, ps - 1), 2: (0, 2), 3: (2, 1)}.items():
        np.testing.assert_array_equal(np.asarray(kr[0, pos_page * ps + slot]), np.asarray(k[t]))
        np.testing.assert_array_equal(np.asarray(vr[0, pos_page * ps + slot]), np.asarray(v[t]))


def test_write_kv_casts_f32_to_bf16_for_one_plane():
    view = make_view(2, 16, 16, 4, layers=1, layer=0)
    arena = jnp.zeros((3 * view.rows_per_page, view.row_words), jnp.uint16)
    k = jnp.asarray(np.random.default_rng(0).standard_normal((1, 2, 16)), jnp.float32)
    pages, slots = jnp.array([1], jnp.int32), jnp.array([2], jnp.int32)
    with no_triton_deprecation():
        got = write_kv(arena, k, k, pages, slots, view=view, impl="pallas", interpret=True)
    kr, _ = read_kv_reference(got, jnp.array([[1]], jnp.int32), view=view)
    np.testing.assert_array_equal(np.asarray(kr[0, 2]), np.asarray(k[0].astype(jnp.bfloat16)))


def test_write_kv_shape_checks():
    view = make_view(2, 16, 16, 4)
    arena = jnp.zeros((4 * view.rows_per_page, view.row_words), jnp.uint16)
    k = jnp.zeros((3, 2, 16), jnp.bfloat16)
    i = jnp.zeros((3,), jnp.int32)
    with pytest.raises(ValueError, match="k must be"):
        write_kv(arena, k[:, :1], k, i, i, view=view, impl="reference")
    with pytest.raises(ValueError, match="pages must be int32"):
        write_kv(arena, k, k, i[:2], i, view=view, impl="pallas", interpret=True)
    with pytest.raises(ValueError, match="arena rows"):
        write_kv(arena[:, :8], k, k, i, i, view=view, impl="reference")


def test_lowers_for_cuda_above_4gib():
    view = make_view(8, 128, 128, 16, layers=4, layer=3)
    a = jax.ShapeDtypeStruct((2**21 + 512, view.row_words), jnp.bfloat16)
    kk = jax.ShapeDtypeStruct((64, 8, 128), jnp.bfloat16)
    ii = jax.ShapeDtypeStruct((64,), jnp.int32)
    with no_triton_deprecation():
        txt = cuda_lowering(lambda a, k, v, p, s: write_kv(a, k, v, p, s, view=view, impl="pallas"),
                            a, kk, kk, ii, ii, donate_argnums=0)
    if txt is None:
        pytest.skip("this jax cannot cross-lower Pallas Triton for CUDA without a GPU")
    assert "__gpu$xla.gpu.triton" in txt and "output_operand_aliases" in txt
    assert "tensor<2097664x1024xui16>" not in txt  # no whole-arena bitcast to uint16
