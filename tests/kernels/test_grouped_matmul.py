"""The grouped matmul kernel (pallas_kernels/grouped_matmul.py), interpreted on CPU (and compiled
on a GPU), against its row-by-row reference and jax.lax.ragged_dot: empty groups, one group
holding every row, a padding tail, shapes that are no multiple of any block; the tile metadata
covers every row exactly once with tiles that never mix two groups."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from umem_jax.pallas_kernels.grouped_matmul import default_blocks, grouped_matmul, grouped_matmul_reference, tile_metadata

SMALL = {"block_m": 16, "block_n": 32, "block_k": 16, "interpret": True}


def case(seed, rows, K, N, sizes, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, K), np.float32)).astype(dtype)
    w = jnp.asarray(rng.standard_normal((len(sizes), K, N), np.float32) / np.sqrt(K)).astype(dtype)
    return x, w, jnp.asarray(sizes, jnp.int32)


def rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


@pytest.mark.parametrize("rows,K,N,sizes", [
    (41, 40, 72, [3, 0, 17, 1, 9]),        # empty group, padding tail of 11 rows, no multiples of blocks
    (33, 20, 36, [33, 0, 0]),              # one group holds every row; two empty groups
    (16, 32, 32, [0, 0, 0, 0]),            # nothing routed: all padding, zeros out
    (50, 16, 16, [5, 5, 5, 5, 5, 5, 5, 5, 5, 5]),  # every group a partial tile
    (7, 48, 24, [0, 2, 0, 0, 0, 4, 0]),    # decode-like: a few rows, most groups empty
])
def test_kernel_matches_reference_fp32(rows, K, N, sizes):
    x, w, g = case(rows, rows, K, N, sizes)
    got = grouped_matmul(x, w, g, **SMALL)
    want = grouped_matmul_reference(x, w, g)
    assert got.shape == (rows, N) and got.dtype == jnp.float32
    assert rel(got, want) < 1e-5
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.lax.ragged_dot(x, w, g)), rtol=1e-5, atol=1e-5)
    tail = int(sum(sizes))
    assert np.all(np.asarray(got)[tail:] == 0)  # the padding rows are zeros, as ragged_dot gives


def test_kernel_matches_reference_bf16_fp32_out():
    x, w, g = case(1, 64, 64, 48, [10, 0, 30, 20, 1], jnp.bfloat16)
    got = grouped_matmul(x, w, g, out_dtype=jnp.float32, **SMALL)
    want = grouped_matmul_reference(x, w, g, out_dtype=jnp.float32)  # the same bf16 inputs, fp32 products
    assert got.dtype == jnp.float32 and rel(got, want) < 1e-5
    low = grouped_matmul(x, w, g, **SMALL)
    assert low.dtype == jnp.bfloat16 and rel(low, want) < 1e-2  # one bf16 rounding of the output


def test_default_blocks_and_jit_with_traced_sizes():
    """Under jit the group sizes are traced values: one compile serves every routing."""
    x, w, _ = case(2, 40, 32, 32, [0, 0, 0])
    f = jax.jit(lambda x, w, g: grouped_matmul(x, w, g, interpret=True))
    for sizes in ([40, 0, 0], [0, 13, 20], [1, 1, 1]):
        g = jnp.asarray(sizes, jnp.int32)
        assert rel(f(x, w, g), grouped_matmul_reference(x, w, g)) < 1e-5


def test_default_tiles_follow_rows_a_group():
    """A decode batch's rows (up to 256, or 16 an expert on average: B = 64 over many experts) take
    the decode tiles, a prefill's the large ones."""
    small, large = default_blocks(64, 8, 8)["block_m"], default_blocks(16384, 8, 8, 32)["block_m"]
    assert (small, large) == (64, 128)
    assert default_blocks(64 * 8, 2048, 1024, 256)["block_m"] == small  # Qwen3.5-MoE, B = 64
    assert default_blocks(64 * 6, 2688, 1856, 128)["block_m"] == small  # Nemotron 3 Nano, B = 64
    assert default_blocks(4096 * 8, 2048, 1024, 256)["block_m"] == large  # a 4096-token prefill


_metadata = jax.jit(tile_metadata, static_argnums=(1, 2))
ROWS = 400  # fixed (and 9 groups): one compile per block_m, the sizes vary as traced values


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([0, 0, 1, 2, 15, 16, 17, 40]), min_size=9, max_size=9), st.sampled_from([1, 4, 16]))
def test_tiles_cover_every_row_once_within_one_group(sizes, block_m):
    extra = ROWS - sum(sizes)  # the padding tail
    group, first, end = (np.asarray(a) for a in _metadata(jnp.asarray(sizes, jnp.int32), ROWS, block_m))
    assert len(group) == -(-ROWS // block_m) + len(sizes) + 1  # the static bound
    ends = np.cumsum(sizes + [extra])
    starts = ends - np.asarray(sizes + [extra])
    covered = np.zeros(ROWS, int)
    for g, f, e in zip(group, first, end):
        if f >= e:
            continue  # a dead tile
        top = min(f + block_m, e)
        covered[f:top] += 1
        assert starts[g] <= f and top <= ends[g], (g, f, e)  # inside one group (G: the padding tail)
    assert covered.tolist() == [1] * ROWS


def test_shape_mismatch_is_refused():
    x, w, g = case(3, 8, 16, 8, [8])
    with pytest.raises(ValueError, match="K=16"):
        grouped_matmul(x[:, :12], w, g, **SMALL)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,sizes", [(4096, "random"), (6, [0, 1, 0, 3, 0, 0, 2, 0])])
def test_triton_kernel_on_gpu(rows, sizes):
    """The compiled Triton kernel (default blocks, prefill and decode tiles) against the reference."""
    E = 8
    if sizes == "random":
        ids = np.random.default_rng(0).integers(0, E, rows - 100)
        sizes = np.bincount(ids, minlength=E).tolist()  # 100 padding rows
    x, w, g = case(4, rows, 256, 192, sizes, jnp.bfloat16)
    got = grouped_matmul(x, w, g, out_dtype=jnp.float32)
    want = grouped_matmul_reference(x, w, g, out_dtype=jnp.float32)
    assert rel(got, want) < 1e-2
    assert np.all(np.asarray(got)[int(sum(sizes)):] == 0)
