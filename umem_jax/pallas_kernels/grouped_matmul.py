"""Grouped matmul (the MoE expert GEMM): rows sorted by group, each group times its own matrix.

    out = grouped_matmul(x, w, group_sizes)      x [R, K], w [G, K, N], group_sizes [G] int32
    out[r] = x[r] @ w[g(r)]  for the rows r of group g (rows group_start[g] .. + group_sizes[g]),
    0 for the rows past sum(group_sizes) (padding)                               -> [R, N]

This is `jax.lax.ragged_dot`'s contract (grouped_matmul_reference computes it row by row).  The
Pallas (Triton) kernel tiles every group's rows on its own: group g has ceil(size_g / block_m)
row tiles that start at the group's first row (so a tile never mixes two groups' weights), and
the grid is a static upper bound on the tile count, cdiv(R, block_m) + G, times the column
blocks.  Tiles past the real count, and the groups with no rows, do no work and read nothing:
a decode step's few rows read only the experts they chose, and a prefill reads each expert's
matrix once per row tile.  The padding tail is one more "group" whose tiles store zeros.

Tile metadata (which group, first row, end row of every tile) is computed on the device from
group_sizes with a few cumsums: no host round trip, static shapes under jit.

Plan mode (a decode batch, models/experts.py): `plan=(first, end)` from dispatch_plan.py gives each
group's row range directly; the grid is one program a group (G + 1 with the padding tail) and
column block, and a program takes all its group's rows, block_m at a time, so nothing is computed
before the launch.  `token` gathers the sorted rows' inputs as they are loaded (x holds one row a
token, not one a (token, expert) pair) and `bias` is added in the epilogue: the gather and the
bias add are no launches of their own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ._compat import pltr, triton_params
from .launch import ANY

__all__ = ["grouped_matmul", "grouped_matmul_reference", "tile_metadata"]


def grouped_matmul_reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                             out_dtype=None) -> jax.Array:
    """The definition, row by row: each row times its group's matrix in fp32 (zeros past the
    groups).  Gathers a [R, K, N] copy of the weights: small shapes only."""
    R = x.shape[0]
    G = w.shape[0]
    ends = jnp.cumsum(group_sizes)
    group = jnp.searchsorted(ends, jnp.arange(R), side="right", method="compare_all")  # G: past the groups
    wr = jnp.take(w, jnp.minimum(group, G - 1), axis=0).astype(jnp.float32)
    y = jnp.einsum("rk,rkn->rn", x.astype(jnp.float32), wr, precision=lax.Precision.HIGHEST)
    y = jnp.where((group < G)[:, None], y, 0.0)
    return y.astype(out_dtype or x.dtype)


def tile_metadata(group_sizes: jax.Array, rows: int, block_m: int):
    """Per tile t of the static bound T = cdiv(rows, block_m) + G + 1: (group [T], first row [T],
    end row [T]) int32.  Group G is the padding tail (its tiles store zeros); tiles past the
    real count get first row == end row (no work)."""
    G = group_sizes.shape[0]
    gs = group_sizes.astype(jnp.int32)
    gs = jnp.concatenate([gs, jnp.maximum(rows - gs.sum(), 0)[None]])  # + the padding tail
    row_end = jnp.cumsum(gs)
    row_start = row_end - gs
    tiles = (gs + block_m - 1) // block_m
    tile_end = jnp.cumsum(tiles)
    tile_start = tile_end - tiles
    T = -(-rows // block_m) + G + 1
    t = jnp.arange(T, dtype=jnp.int32)
    # compare_all: one broadcast compare.  The default (a binary search loop) is an XLA while
    # loop, and a while loop on the GPU copies its predicate to the host every iteration.
    group = jnp.minimum(jnp.searchsorted(tile_end, t, side="right", method="compare_all"), G).astype(jnp.int32)
    first = row_start[group] + (t - tile_start[group]) * block_m
    live = t < tile_end[-1]
    first = jnp.where(live, first, 0).astype(jnp.int32)
    end = jnp.where(live, row_end[group], 0).astype(jnp.int32)
    return group, first, end


def _kernel(*refs, block_m, block_n, block_k, K, N, G, per_group, gather, has_bias):
    it = iter(refs)
    group_ref = None if per_group else next(it)
    first_ref, end_ref = next(it), next(it)
    token_ref = next(it) if gather else None
    x_ref, w_ref = next(it), next(it)
    bias_ref = next(it) if has_bias else None
    o_ref = next(it)
    t, nb = pl.program_id(0), pl.program_id(1)
    g = t if per_group else group_ref[t]
    first, end = first_ref[t], end_ref[t]
    cols = nb * block_n + jnp.arange(block_n, dtype=jnp.int32)
    col_ok = cols < N

    def block(r0):  # output rows r0 .. r0 + block_m (those below `end`) of group g
        rows = r0 + jnp.arange(block_m, dtype=jnp.int32)
        row_ok = rows < end
        out_mask = row_ok[:, None] & col_ok[None, :]

        @pl.when(g < G)
        def _matmul():
            src = pltr.load(token_ref.at[rows], mask=row_ok, other=0) if gather else rows

            def body(kb, acc):
                ks = kb * block_k + jnp.arange(block_k, dtype=jnp.int32)
                k_ok = ks < K
                a = pltr.load(x_ref.at[src[:, None], ks[None, :]], mask=row_ok[:, None] & k_ok[None, :], other=0)
                b = pltr.load(w_ref.at[g, ks[:, None], cols[None, :]], mask=k_ok[:, None] & col_ok[None, :], other=0)
                return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)

            acc = lax.fori_loop(0, pl.cdiv(K, block_k), body, jnp.zeros((block_m, block_n), jnp.float32))
            if has_bias:
                acc = acc + pltr.load(bias_ref.at[g, cols], mask=col_ok, other=0).astype(jnp.float32)[None, :]
            pltr.store(o_ref.at[rows[:, None], cols[None, :]], acc.astype(o_ref.dtype), mask=out_mask)

        @pl.when(g == G)
        def _padding():
            pltr.store(o_ref.at[rows[:, None], cols[None, :]], jnp.zeros((block_m, block_n), o_ref.dtype),
                       mask=out_mask)

    @pl.when(first < end)
    def _live():
        if per_group:  # all of the group's rows, block by block (a decode batch: mostly one block)
            lax.fori_loop(0, (end - first + block_m - 1) // block_m, lambda i, c: (block(first + i * block_m), c)[1], 0)
        else:  # one tile: block_m rows from `first`
            block(first)


def default_blocks(rows: int, K: int, N: int, groups: int = 1) -> dict:
    """Tile sizes: 128x256 tiles for prefill (the better of the two measured on the H200 at
    gpt-oss-20b and Qwen3.5-35B-A3B-like shapes, 4096 and 16384 tokens: 1.1-1.3x faster than
    128x128); 64x128 tiles for a decode batch's rows (up to 256, or 16 a group on average).

    A decode batch's expert GEMM is a weight read, and a tile reads its expert's matrix once, so
    the tile must hold all of an expert's rows: a random-weight router sends 64 tokens to a few
    experts (gpt-oss-20b-like: 8 of 32, 32 rows each), where 16-row tiles read each matrix twice
    or three times.  Measured on an H100 (bench_moe --only grouped, 64 tokens, 9 tilings, both
    projections of the three MoE families, uniform and skewed routing; benchmarks/RESULTS.md
    session 20): 64x128 (4 warps, 3 stages) was within 4% of the best tiling in 11 of 12 cases and
    -3 to -18% against 16x64; rows an expert holds cost little compute (128-row tiles over 2-3
    live rows were as fast)."""
    if rows <= 256 or rows <= 16 * groups:
        return {"block_m": 64, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 3}
    return {"block_m": 128, "block_n": 256, "block_k": 64, "num_warps": 8, "num_stages": 3}


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_m", "block_n", "block_k",
                                             "num_warps", "num_stages", "interpret"))
def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array | None = None, *,
                   plan: tuple[jax.Array, jax.Array] | None = None, token: jax.Array | None = None,
                   bias: jax.Array | None = None, out_dtype=None, block_m: int | None = None,
                   block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                   num_stages: int | None = None, interpret: bool = False) -> jax.Array:
    """x [R, K] (rows sorted by group), w [G, K, N], group_sizes [G] int32 (sum <= R) -> [R, N]
    in out_dtype (default x.dtype), fp32 accumulation.  Block sizes default by default_blocks.

    plan (first, end) [G + 1] int32 instead of group_sizes: group g's rows are [first[g], end[g])
    (g = G: the padding tail, zeros), one program a group and column block taking all its rows
    (dispatch_plan.py's ranges at a decode batch: no tile metadata to compute).
    token [R] int32: row r multiplies x[token[r]] (x [T, K]: the sorted rows gathered as loaded).
    bias [G, N]: added to each group's rows in fp32 before the output's rounding.  (The experts'
    activation in this epilogue was measured and dropped: +1.4% at gpt-oss-20b-like B = 64 on an
    H100, benchmarks/RESULTS.md session 24.)"""
    T, K = x.shape
    G, K2, N = w.shape
    R = T if token is None else token.shape[0]
    if K2 != K:
        raise ValueError(f"grouped_matmul: x has K={K} columns, w has K={K2} rows")
    if (group_sizes is None) == (plan is None):
        raise ValueError("grouped_matmul: give group_sizes or plan, not both")
    if plan is not None and any(a.shape != (G + 1,) for a in plan):
        raise ValueError(f"grouped_matmul: plan ranges {[a.shape for a in plan]}, expected ({G + 1},) each")
    if bias is not None and bias.shape != (G, N):
        raise ValueError(f"grouped_matmul: bias {bias.shape}, expected {(G, N)}")
    cfg = default_blocks(R, K, N, G)
    given = {"block_m": block_m, "block_n": block_n, "block_k": block_k, "num_warps": num_warps, "num_stages": num_stages}
    cfg.update({k: v for k, v in given.items() if v is not None})
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    tiles = list(plan) if plan is not None else list(tile_metadata(group_sizes, R, bm))
    operands = tiles + ([] if token is None else [token]) + [x, w] + ([] if bias is None else [bias])
    kernel = functools.partial(_kernel, block_m=bm, block_n=bn, block_k=bk, K=K, N=N, G=G,
                               per_group=plan is not None, gather=token is not None, has_bias=bias is not None)
    return pl.pallas_call(
        kernel,
        grid=(tiles[0].shape[0], pl.cdiv(N, bn)),
        in_specs=[ANY] * len(operands),
        out_specs=ANY,
        out_shape=jax.ShapeDtypeStruct((R, N), jnp.dtype(out_dtype or x.dtype)),
        compiler_params=triton_params(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
        interpret=interpret,
        name="umem_grouped_matmul",
    )(*operands)
