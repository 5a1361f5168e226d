"""move_pages / zero_pages: Pallas (interpret) and reference against a numpy model, bit-exact.

Arenas are random 16-bit words with many NaN bit patterns (uint16 and bf16 arenas), so any
canonicalisation, missed row or stray write shows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _kernel_utils import as_np_u16, cuda_lowering, no_triton_deprecation, random_words
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from umem_jax.pallas_kernels.relocate import (
    check_moves,
    move_pages,
    move_pages_reference,
    zero_pages,
    zero_pages_reference,
)


def np_move(a, src, dst, rpp):
    out = a.copy()
    for s, d in zip(src, dst):
        out[d * rpp:(d + 1) * rpp] = a[s * rpp:(s + 1) * rpp]
    return out


def np_zero(a, pages, rpp):
    out = a.copy()
    for p in pages:
        out[p * rpp:(p + 1) * rpp] = 0
    return out


# ----------------------------------------------------------------------------- check_moves


def test_check_moves_accepts_valid_and_padding():
    check_moves([3, 5, 0, 0], [7, 1, 0, 0])
    check_moves([], [])
    check_moves(np.array([2], np.int32), np.array([9], np.int32), num_pages=10)


@pytest.mark.parametrize("src,dst,msg", [
    ([1, 2], [3, 3], "distinct"),
    ([1, 3], [3, 4], "both a source and a destination"),
    ([0], [2], "sink"),
    ([2], [0], "sink"),
    ([-1], [2], ">= 0"),
    ([1, 2], [3], "one length"),
    ([11], [2], "num_pages"),
])
def test_check_moves_refuses(src, dst, msg):
    with pytest.raises(ValueError, match=msg):
        check_moves(src, dst, num_pages=10)


# ----------------------------------------------------------------------------- moves

# (rows_per_page, row_words, block_words): whole tiles; masked tail rows (rpp not a multiple of
# the row block); rows that are not a power of two (several column blocks); one-row pages.
U16, BF16 = jnp.uint16, jnp.bfloat16
SHAPES = [(24, 16, 64, U16), (8, 64, 8192, BF16), (5, 24, 32, U16), (5, 24, 32, BF16), (1, 128, 64, U16),
          (48, 40, 4096, BF16)]


@pytest.mark.parametrize("rpp,W,bw,dtype", SHAPES)
def test_move_pages_pallas_exact(rpp, W, bw, dtype):
    rng = np.random.default_rng(rpp * 1000 + W)
    npages = 12
    a = random_words(rng, (npages * rpp + 3, W), dtype)   # +3 rows past the last page: untouched
    src = np.array([3, 0, 5, 11, 0], np.int32)
    dst = np.array([7, 0, 1, 2, 0], np.int32)
    check_moves(src, dst, num_pages=npages)
    want = np_move(as_np_u16(a), src, dst, rpp)
    with no_triton_deprecation():
        got = move_pages(a, jnp.asarray(src), jnp.asarray(dst), rows_per_page=rpp, impl="pallas", interpret=True,
                         block_words=bw)
    assert got.dtype == a.dtype and got.shape == a.shape
    np.testing.assert_array_equal(as_np_u16(got), want)
    ref = move_pages_reference(a, jnp.asarray(src), jnp.asarray(dst), rows_per_page=rpp)
    np.testing.assert_array_equal(as_np_u16(ref), want)


@pytest.mark.parametrize("rpp,W,bw,dtype", SHAPES[1:4])
def test_zero_pages_pallas_exact(rpp, W, bw, dtype):
    rng = np.random.default_rng(7 + rpp)
    a = random_words(rng, (10 * rpp + 1, W), dtype)
    pages = np.array([2, 9, 2, 0], np.int32)   # repeats allowed; the sink may be zeroed
    want = np_zero(as_np_u16(a), pages, rpp)
    with no_triton_deprecation():
        got = zero_pages(a, jnp.asarray(pages), rows_per_page=rpp, impl="pallas", interpret=True, block_words=bw)
    np.testing.assert_array_equal(as_np_u16(got), want)
    np.testing.assert_array_equal(as_np_u16(zero_pages_reference(a, jnp.asarray(pages), rows_per_page=rpp)), want)


def test_empty_batches_are_noops():
    a = random_words(np.random.default_rng(0), (32, 8))
    e = jnp.zeros((0,), jnp.int32)
    for impl in ("pallas", "reference"):
        np.testing.assert_array_equal(as_np_u16(move_pages(a, e, e, rows_per_page=4, impl=impl, interpret=True)),
                                      as_np_u16(a))
        np.testing.assert_array_equal(as_np_u16(zero_pages(a, e, rows_per_page=4, impl=impl, interpret=True)),
                                      as_np_u16(a))


@st.composite
def _move_sets(draw):
    npages = 16
    n_moves = draw(st.integers(0, 6))
    pages = draw(st.permutations(list(range(1, npages))))
    src, dst = pages[:n_moves], pages[n_moves:2 * n_moves]
    pad = 6 - n_moves
    return np.array(src + [0] * pad, np.int32), np.array(dst + [0] * pad, np.int32)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(moves=_move_sets(), seed=st.integers(0, 2**31 - 1))
def test_move_pages_random_valid_sets(moves, seed):
    # Fixed shapes (6 moves, padded with 0 -> 0), so the interpreted kernel compiles once.
    src, dst = moves
    check_moves(src, dst, num_pages=16)
    rpp, W = 6, 16
    a = random_words(np.random.default_rng(seed), (16 * rpp, W))
    with no_triton_deprecation():
        got = move_pages(a, jnp.asarray(src), jnp.asarray(dst), rows_per_page=rpp, impl="pallas", interpret=True,
                         block_words=32)
    np.testing.assert_array_equal(as_np_u16(got), np_move(as_np_u16(a), src, dst, rpp))


def test_default_impl_on_cpu_is_reference():
    a = random_words(np.random.default_rng(1), (16, 8))
    s, d = jnp.array([1], jnp.int32), jnp.array([3], jnp.int32)
    np.testing.assert_array_equal(as_np_u16(move_pages(a, s, d, rows_per_page=4)),
                                  np_move(as_np_u16(a), [1], [3], 4))


def test_shape_checks():
    a = jnp.zeros((16, 8), jnp.uint16)
    with pytest.raises(ValueError, match="int32"):
        move_pages(a, jnp.array([1], jnp.int16), jnp.array([2], jnp.int32), rows_per_page=4, impl="reference")
    with pytest.raises(ValueError, match="uint16 or bfloat16"):
        move_pages(a.astype(jnp.float32), jnp.array([1], jnp.int32), jnp.array([2], jnp.int32), rows_per_page=4,
                   impl="reference")
    with pytest.raises(ValueError, match="one shape"):
        move_pages(a, jnp.array([1, 2], jnp.int32), jnp.array([2], jnp.int32), rows_per_page=4, impl="pallas",
                   interpret=True)
    with pytest.raises(ValueError, match="impl"):
        move_pages(a, jnp.array([1], jnp.int32), jnp.array([2], jnp.int32), rows_per_page=4, impl="triton")


# ----------------------------------------------------------------------------- in place / lowering


def test_reference_is_in_place_under_donation():
    P, W = 1024, 256
    c = jax.jit(lambda a, s, d: move_pages_reference(a, s, d, rows_per_page=16), donate_argnums=0).lower(
        jax.ShapeDtypeStruct((P, W), jnp.uint16), jax.ShapeDtypeStruct((4,), jnp.int32),
        jax.ShapeDtypeStruct((4,), jnp.int32)).compile()
    m = c.memory_analysis()
    assert m.alias_size_in_bytes >= P * W * 2
    assert m.temp_size_in_bytes < P * W * 2 // 4
    assert not [l for l in c.as_text().splitlines() if " copy(" in l and f"[{P},{W}]" in l]


@pytest.mark.parametrize("dtype", [jnp.uint16, jnp.bfloat16])
def test_lowers_for_cuda_above_4gib(dtype):
    # 2**21 + 512 rows of 1024 words = 4 GiB + 1 MiB: Triton must use int64 offsets; the arena
    # is aliased (output_operand_aliases) and never bitcast as a whole.
    a = jax.ShapeDtypeStruct((2**21 + 512, 1024), dtype)
    i = jax.ShapeDtypeStruct((8,), jnp.int32)
    with no_triton_deprecation():
        mv = cuda_lowering(lambda a, s, d: move_pages(a, s, d, rows_per_page=512, impl="pallas"), a, i, i,
                           donate_argnums=0)
        zr = cuda_lowering(lambda a, p: zero_pages(a, p, rows_per_page=512, impl="pallas"), a, i, donate_argnums=0)
    if mv is None:
        pytest.skip("this jax cannot cross-lower Pallas Triton for CUDA without a GPU")
    for txt in (mv, zr):
        assert "__gpu$xla.gpu.triton" in txt and "output_operand_aliases" in txt
        assert "bitcast_convert" not in txt
