"""Page relocation and zeroing inside the arena, in place.

A page envelope is `rows_per_page` contiguous arena rows, so moving or zeroing a page is one
contiguous copy.  Physical page p of a sub-pool is rows `[base_row + p * rows_per_page,
base_row + (p + 1) * rows_per_page)`: base_row is 0 for paged grids and the state grid's offset
(memory/plan.py: slot 1 starts at the sink, so slot 0 has no rows of its own and may start below
row 0).  On an offset grid (base_row != 0) page 0 is skipped: padding pairs copy nothing and
zeroing it writes nothing.  On a grid from row 0 page 0 is the sink's rows.

Contract for `move_pages(arena, src, dst, *, rows_per_page, base_row=0)` (docs/kernel_contracts.md):
  src, dst: int32 [N].  Page src[i] is copied to page dst[i] for every i.  Destinations are
  distinct, and no destination is a source (the moves of one call run in any order and in
  parallel).  The pair 0 -> 0 is padding and is allowed any number of times (the sink copies onto
  itself).  Chains such as A -> B, B -> C must be split into two calls.  `check_moves` checks this
  on the host; violating it on the device gives unspecified bytes in the pages involved (never
  outside them).

Each function takes the arena first and returns the new arena; call it under a jit that donates
the arena so XLA updates it in place (the Pallas kernels alias it with `input_output_aliases`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from ._compat import pltr
from .launch import in_place_call, pow2_divisor, pow2_floor, resolve_impl
from .words import check_arena, from_u16, kernel_dtype, to_u16

__all__ = ["check_moves", "move_pages", "move_pages_reference", "zero_pages", "zero_pages_reference"]


# --------------------------------------------------------------------------- host-side checks


def check_moves(src, dst, *, num_pages: int | None = None) -> None:
    """Raise ValueError unless (src, dst) is a valid batch of moves for one `move_pages` call.

    Valid: same length, 1-D, ids >= 0 (and < num_pages if given); destinations distinct; no
    destination is also a source.  0 -> 0 pairs are padding and ignored by the checks; any other
    pair touching page 0 (the sink) is refused.
    """
    src = np.asarray(src)
    dst = np.asarray(dst)
    if src.ndim != 1 or src.shape != dst.shape:
        raise ValueError(f"src and dst must be 1-D of one length, got {src.shape} and {dst.shape}")
    if src.size == 0:
        return
    if (src < 0).any() or (dst < 0).any():
        raise ValueError("page ids must be >= 0")
    if num_pages is not None and ((src >= num_pages).any() or (dst >= num_pages).any()):
        raise ValueError(f"page ids must be < num_pages={num_pages}")
    pad = (src == 0) & (dst == 0)
    s, d = src[~pad], dst[~pad]
    if (s == 0).any() or (d == 0).any():
        raise ValueError("a move to or from the sink (page 0) other than the 0 -> 0 padding pair")
    uniq, counts = np.unique(d, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"destinations must be distinct; repeated: {uniq[counts > 1][:8].tolist()}")
    both = np.intersect1d(s, d)
    if both.size:
        raise ValueError(
            f"pages {both[:8].tolist()} are both a source and a destination in one call; "
            "split chains (A->B, B->C) into separate calls")


def _check_args(arena, rows_per_page, *ids):
    check_arena(arena)
    if rows_per_page <= 0 or rows_per_page > arena.shape[0]:
        raise ValueError(f"rows_per_page={rows_per_page} must be in [1, {arena.shape[0]}]")
    for a in ids:
        if a.ndim != 1 or jnp.dtype(a.dtype) != jnp.int32:
            raise ValueError(f"page ids must be int32 [N], got {a.dtype}{list(a.shape)}")
    if len({a.shape for a in ids}) > 1:
        raise ValueError(f"src and dst must have one shape, got {[a.shape for a in ids]}")


# --------------------------------------------------------------------------- references


def _page_rows(pages, rows_per_page, base_row, pad_row):
    """int32 [N] pages -> int32 [N * rows_per_page] row ids (row ids fit int32: num_rows < 2**31).
    On an offset grid (base_row != 0) page 0's rows are `pad_row` instead: its would-be rows may
    be negative, which an XLA gather or scatter would wrap onto the arena's top rows."""
    r = jnp.arange(rows_per_page, dtype=jnp.int32)
    rows = base_row + pages[:, None] * rows_per_page + r[None, :]
    if base_row:
        rows = jnp.where((pages != 0)[:, None], rows, pad_row)
    return rows.reshape(-1)


@functools.partial(jax.jit, static_argnames=("rows_per_page", "base_row"))
def move_pages_reference(arena, src, dst, *, rows_per_page: int, base_row: int = 0):
    """Plain-JAX move: arena rows of page dst[i] := rows of page src[i] (read before any write)."""
    _check_args(arena, rows_per_page, src, dst)
    # Work on the uint16 view (a free same-width bitcast): XLA:CPU canonicalises bf16 NaN bit
    # patterns in arrays a bf16 scatter touches, and fp32 lo planes are often such patterns.
    a = to_u16(arena)
    rows = a[_page_rows(src, rows_per_page, base_row, 0)]  # an offset grid's padding reads row 0 ...
    # ... and writes nowhere: mode="drop" skips out-of-range rows instead of clamping onto the last page.
    a = a.at[_page_rows(dst, rows_per_page, base_row, a.shape[0])].set(rows, mode="drop")
    return from_u16(a, arena.dtype)


@functools.partial(jax.jit, static_argnames=("rows_per_page", "base_row"))
def zero_pages_reference(arena, pages, *, rows_per_page: int, base_row: int = 0):
    """Plain-JAX zeroing of whole page envelopes."""
    _check_args(arena, rows_per_page, pages)
    rows = _page_rows(pages, rows_per_page, base_row, arena.shape[0])
    a = to_u16(arena).at[rows].set(jnp.uint16(0), mode="drop")
    return from_u16(a, arena.dtype)


# --------------------------------------------------------------------------- Pallas kernels
#
# Grid (move i, row block r, column block c): each program copies one [block_rows, block_cols]
# tile of page src[i] to page dst[i].  The tile is a 2-D window of the arena ref addressed as
# arena.at[pl.ds(row0, block_rows), pl.ds(col0, block_cols)]: the Triton lowering multiplies
# the row by the row stride itself, in int64 once the arena is over 4 GiB, and the contiguous
# column run lets it emit 16-byte vector loads/stores.  Rows past the page end (when
# rows_per_page is not a multiple of block_rows) are masked off.


@dataclasses.dataclass(frozen=True)
class _Tiles:
    """One page envelope cut into [block_rows, block_cols] tiles: grid axes 1 and 2."""

    block_rows: int
    block_cols: int
    row_blocks: int
    col_blocks: int
    masked: bool  # rows_per_page is not a multiple of block_rows: the last row block is masked


def _tiles(rows_per_page: int, row_words: int, block_words: int) -> _Tiles:
    # Columns: a power-of-two divisor of the row (Triton blocks are powers of two; rows are a
    # multiple of 8 words, so this is >= 8).  Rows: enough to make block_words per tile.
    block_cols = pow2_divisor(row_words, block_words)
    block_rows = min(pow2_floor(max(block_words // block_cols, 1)), 1 << (rows_per_page - 1).bit_length())
    return _Tiles(block_rows, block_cols, pl.cdiv(rows_per_page, block_rows), row_words // block_cols,
                  rows_per_page % block_rows != 0)


def _tile(page_ref, i, r, c, *, rows_per_page, base_row, tiles: _Tiles):
    """(rows, cols, mask) of tile (r, c) of page page_ref[i]; mask None when every row is in the page."""
    off = r * tiles.block_rows
    rows = pl.ds(base_row + page_ref[i] * rows_per_page + off, tiles.block_rows)
    mask = None
    if tiles.masked:  # only the last row block of a page can run past it
        in_page = off + jnp.arange(tiles.block_rows, dtype=jnp.int32) < rows_per_page
        mask = jnp.broadcast_to(in_page[:, None], (tiles.block_rows, tiles.block_cols))
    return rows, pl.ds(c * tiles.block_cols, tiles.block_cols), mask


def _unless_padding(page_ref, i, base_row, body):
    """Run `body` -- unless the grid is offset (base_row != 0) and page_ref[i] is page 0, which
    then has no rows of its own (a 0 -> 0 padding pair, or a padding lane)."""
    if base_row:
        pl.when(page_ref[i] != 0)(body)
    else:
        body()


def _move_kernel(src_ref, dst_ref, arena_in, arena_out, *, rows_per_page, base_row, tiles: _Tiles):
    i, r, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    def body():
        src_rows, cols, mask = _tile(src_ref, i, r, c, rows_per_page=rows_per_page, base_row=base_row, tiles=tiles)
        dst_rows, _, _ = _tile(dst_ref, i, r, c, rows_per_page=rows_per_page, base_row=base_row, tiles=tiles)
        # pltr.store, not `ref[...] = x`: ref assignment lowers to a swap, which also loads the old tile.
        pltr.store(arena_out.at[dst_rows, cols], pltr.load(arena_in.at[src_rows, cols], mask=mask), mask=mask)

    _unless_padding(src_ref, i, base_row, body)


def _zero_kernel(pages_ref, arena_in, arena_out, *, rows_per_page, base_row, tiles: _Tiles, dtype):
    del arena_in  # aliased with arena_out
    i, r, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    def body():
        rows, cols, mask = _tile(pages_ref, i, r, c, rows_per_page=rows_per_page, base_row=base_row, tiles=tiles)
        pltr.store(arena_out.at[rows, cols], jnp.zeros((tiles.block_rows, tiles.block_cols), dtype), mask=mask)

    _unless_padding(pages_ref, i, base_row, body)


def _pages_call(kernel, arena, *pages, rows_per_page, base_row, interpret, block_words, num_warps, name,
                **kernel_args):
    """One program per (page in `pages`, tile of the page), in place; no pages: the arena as is."""
    _check_args(arena, rows_per_page, *pages)
    n = pages[0].shape[0]
    if n == 0:
        return arena
    tiles = _tiles(rows_per_page, arena.shape[1], block_words)
    kernel = functools.partial(kernel, rows_per_page=rows_per_page, base_row=base_row, tiles=tiles, **kernel_args)
    return in_place_call(kernel, arena, *pages, grid=(n, tiles.row_blocks, tiles.col_blocks), name=name,
                         interpret=interpret, num_warps=num_warps)


_PALLAS_STATIC = ("rows_per_page", "base_row", "interpret", "block_words", "num_warps")


@functools.partial(jax.jit, static_argnames=_PALLAS_STATIC)
def _move_pages_pallas(arena, src, dst, *, rows_per_page: int, base_row: int = 0, interpret: bool = False,
                       block_words: int = 8192, num_warps: int = 4):
    return _pages_call(_move_kernel, arena, src, dst, rows_per_page=rows_per_page, base_row=base_row,
                       interpret=interpret, block_words=block_words, num_warps=num_warps, name="umem_move_pages")


@functools.partial(jax.jit, static_argnames=_PALLAS_STATIC)
def _zero_pages_pallas(arena, pages, *, rows_per_page: int, base_row: int = 0, interpret: bool = False,
                       block_words: int = 8192, num_warps: int = 4):
    return _pages_call(_zero_kernel, arena, pages, rows_per_page=rows_per_page, base_row=base_row,
                       interpret=interpret, block_words=block_words, num_warps=num_warps, name="umem_zero_pages",
                       dtype=kernel_dtype(arena, interpret))


# --------------------------------------------------------------------------- public wrappers


def move_pages(arena, src, dst, *, rows_per_page: int, base_row: int = 0, impl: str | None = None,
               interpret: bool = False, **tuning):
    """Copy page envelopes src[i] -> dst[i] of `arena` [num_rows, row_words]; returns the arena.

    src, dst: int32 [N] physical page ids (see the module docstring for the contract; check it
    on the host with `check_moves`); base_row: row of page 0 on this grid (SubPool.base_row).
    impl: "pallas" | "reference"; default pallas on GPU (or with interpret=True), else reference.
    tuning: block_words (words per tile, default 8192), num_warps.
    """
    impl = resolve_impl(impl, interpret)
    if impl == "reference":
        return move_pages_reference(arena, src, dst, rows_per_page=rows_per_page, base_row=base_row)
    return _move_pages_pallas(arena, src, dst, rows_per_page=rows_per_page, base_row=base_row, interpret=interpret,
                              **tuning)


def zero_pages(arena, pages, *, rows_per_page: int, base_row: int = 0, impl: str | None = None,
               interpret: bool = False, **tuning):
    """Zero the page envelopes `pages` (int32 [N], repeats allowed) of `arena`; returns the arena."""
    impl = resolve_impl(impl, interpret)
    if impl == "reference":
        return zero_pages_reference(arena, pages, rows_per_page=rows_per_page, base_row=base_row)
    return _zero_pages_pallas(arena, pages, rows_per_page=rows_per_page, base_row=base_row, interpret=interpret,
                              **tuning)
