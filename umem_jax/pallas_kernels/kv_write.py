"""Write one step's new K/V rows into the page-major arena, in place; gather them back (tests).

Layout (umem_jax/memory/plan.py, KVView): the K row of token t (slot t) of physical page p is
the `mk` arena rows `p*rows_per_page + k_row + t*mk ... + mk`, holding the token's K as one
vector of `planes * Hkv * D` words, head-major (`[Hkv, D]` flattened); with 2 planes (fp32) the
vector is `[hi plane (Hkv*D) | lo plane (Hkv*D)]` (see words.py).  V likewise at `v_row` with Dv.

Contract (docs/kernel_contracts.md):
  write_kv(arena, k, v, pages, slots, *, view) -> arena
    k [T, Hkv, D], v [T, Hkv, Dv]; pages, slots int32 [T] (physical page, slot within page).
    Padding rows use page 0 (the sink; garbage may land there).  Real (page, slot) pairs are
    distinct.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._compat import pltr
from .launch import in_place_call, pow2_divisor, resolve_impl
from .words import check_arena, decode, encode, from_u16, kernel_dtype, kv_value_dtype, to_u16

__all__ = ["check_view", "head_slot", "read_kv_reference", "write_kv", "write_kv_reference"]


def check_view(arena, view) -> None:
    """Static checks that `view` describes whole arena rows of `arena`."""
    check_arena(arena, view.row_words)
    for name, dim, m in (("K", view.head_dim, view.mk), ("V", view.v_head_dim, view.mv)):
        words = view.planes * view.num_kv_heads * dim
        if words != m * view.row_words:
            raise ValueError(f"{name} row of {words} words is not a whole number of {view.row_words}-word arena rows")
    if view.rows_per_page > arena.shape[0]:
        raise ValueError(f"a page of {view.rows_per_page} rows does not fit an arena of {arena.shape[0]} rows")


def head_slot(view, which: str, head: int, plane: int = 0) -> tuple[int, int]:
    """(row offset within the token's rows, column) of `plane` of kv head `head` of K or V.

    The head's `dim` words are contiguous in the token vector; kernels need them inside one
    arena row, i.e. `column + dim <= row_words` (true when row_words is a multiple of dim).
    """
    dim = view.head_dim if which == "k" else view.v_head_dim
    off = plane * view.num_kv_heads * dim + head * dim
    return off // view.row_words, off % view.row_words


def _token_rows(pages, slots, base: int, m: int, rows_per_page: int):
    """int32 [T] pages/slots -> int32 [T, m] arena rows of one K (or V) token row."""
    return (pages[:, None] * rows_per_page + base + slots[:, None] * m
            + jnp.arange(m, dtype=jnp.int32)[None, :])


def _stored(x, planes: int, kv_dtype):
    """Cast the model's K/V to the dtype the arena stores (bf16 for 1 plane, f32 for 2)."""
    return x.astype(kv_value_dtype(planes, kv_dtype))


def _check_write(arena, k, v, pages, slots, view):
    check_view(arena, view)
    T = k.shape[0]
    if k.shape != (T, view.num_kv_heads, view.head_dim):
        raise ValueError(f"k must be [T, {view.num_kv_heads}, {view.head_dim}], got {k.shape}")
    if v.shape != (T, view.num_kv_heads, view.v_head_dim):
        raise ValueError(f"v must be [T, {view.num_kv_heads}, {view.v_head_dim}], got {v.shape}")
    for name, a in (("pages", pages), ("slots", slots)):
        if a.shape != (T,) or jnp.dtype(a.dtype) != jnp.int32:
            raise ValueError(f"{name} must be int32 [{T}], got {a.dtype}{list(a.shape)}")


@functools.partial(jax.jit, static_argnames=("view", "kv_dtype"))
def write_kv_reference(arena, k, v, pages, slots, *, view, kv_dtype=None):
    """Plain-JAX KV write (an XLA scatter of whole token rows)."""
    _check_write(arena, k, v, pages, slots, view)
    T = k.shape[0]
    # uint16 view throughout: XLA:CPU canonicalises bf16 NaN bit patterns in a bf16 scatter, and
    # fp32 lo planes (or other layers' words in the same array) are often such patterns.
    a = to_u16(arena)
    for x, base, m in ((k, view.k_row, view.mk), (v, view.v_row, view.mv)):
        words = encode(_stored(x, view.planes, kv_dtype).reshape(T, -1))  # uint16 [T, m*row_words]
        rows = _token_rows(pages, slots, base, m, view.rows_per_page)
        a = a.at[rows.reshape(-1)].set(words.reshape(T * m, view.row_words), mode="drop")
    return from_u16(a, arena.dtype)


@functools.partial(jax.jit, static_argnames=("view", "kv_dtype"))
def read_kv_reference(arena, page_table, *, view, kv_dtype=None):
    """Gather every token row the page table maps: page_table int32 [B, P] ->
    (k [B, P*page_size, Hkv, D], v [B, P*page_size, Hkv, Dv]) decoded to the stored dtype
    (bf16 for 1 plane, f32 for 2, or `kv_dtype`).  Sink/tombstone entries read page 0 as is."""
    check_view(arena, view)
    B, P = page_table.shape
    page_size = view.page_size
    dt = kv_value_dtype(view.planes, kv_dtype)
    pages = jnp.repeat(page_table.reshape(-1), page_size)                # [B*P*page_size]
    slots = jnp.tile(jnp.arange(page_size, dtype=jnp.int32), B * P)
    out = []
    for base, m, dim in ((view.k_row, view.mk, view.head_dim), (view.v_row, view.mv, view.v_head_dim)):
        rows = _token_rows(pages.astype(jnp.int32), slots, base, m, view.rows_per_page)
        words = to_u16(arena)[rows.reshape(-1)].reshape(B * P * page_size, m * view.row_words)
        out.append(decode(words, dt).reshape(B, P * page_size, view.num_kv_heads, dim))
    return tuple(out)


# --------------------------------------------------------------------------- Pallas kernel
#
# The new K/V of one step is a few KiB to a few MiB, so encoding it to words (bitcast, fp32
# planes) is a tiny XLA fusion in the wrapper; the kernel is then a row scatter: program
# (r, c) loads a [block_rows, block_cols] tile of the encoded words and stores it to the arena
# rows listed for those words, arena.at[rows, pl.ds(col, block_cols)] (vector row index, so
# Triton computes row * row_words itself, in int64 above 4 GiB).


def _write_kernel(rows_ref, words_ref, arena_in, arena_out, *, n, block_rows, block_cols):
    del arena_in  # aliased with arena_out
    r, c = pl.program_id(0), pl.program_id(1)
    idx = r * block_rows + jnp.arange(block_rows, dtype=jnp.int32)
    rows = pltr.load(rows_ref.at[pl.ds(r * block_rows, block_rows)])
    tile = pltr.load(words_ref.at[pl.ds(r * block_rows, block_rows), pl.ds(c * block_cols, block_cols)])
    mask = jnp.broadcast_to((idx < n)[:, None], (block_rows, block_cols))  # rows padded up to a whole block
    # Row gather as two broadcasting int indexers ([block_rows,1] rows x [1,block_cols] columns)
    # rather than rows x pl.ds: the same Triton pointer math, and interpret mode (which does not
    # take mixed array/slice indexers) runs it too.
    cols = c * block_cols + jnp.arange(block_cols, dtype=jnp.int32)
    pltr.store(arena_out.at[rows[:, None], cols[None, :]], tile, mask=mask)


@functools.partial(jax.jit, static_argnames=("view", "kv_dtype", "interpret", "block_words", "num_warps"))
def _write_kv_pallas(arena, k, v, pages, slots, *, view, kv_dtype=None, interpret: bool = False,
                     block_words: int = 4096, num_warps: int = 4):
    _check_write(arena, k, v, pages, slots, view)
    T, W = k.shape[0], view.row_words
    if T == 0:
        return arena
    words, rows = [], []
    for x, base, m in ((k, view.k_row, view.mk), (v, view.v_row, view.mv)):
        words.append(encode(_stored(x, view.planes, kv_dtype).reshape(T, -1)).reshape(T * m, W))
        rows.append(_token_rows(pages, slots, base, m, view.rows_per_page).reshape(-1))
    words = from_u16(jnp.concatenate(words), kernel_dtype(arena, interpret))
    rows = jnp.concatenate(rows)
    n = words.shape[0]
    block_cols = pow2_divisor(W, block_words)
    block_rows = max(1, min(block_words // block_cols, 1 << (n - 1).bit_length()))
    padded = pl.cdiv(n, block_rows) * block_rows
    words = jnp.pad(words, ((0, padded - n), (0, 0)))
    rows = jnp.pad(rows, (0, padded - n))
    kernel = functools.partial(_write_kernel, n=n, block_rows=block_rows, block_cols=block_cols)
    return in_place_call(kernel, arena, rows, words, grid=(padded // block_rows, W // block_cols),
                         name="umem_write_kv", interpret=interpret, num_warps=num_warps)


def write_kv(arena, k, v, pages, slots, *, view, kv_dtype=None, impl: str | None = None,
             interpret: bool = False, **tuning):
    """Write k [T, Hkv, D] / v [T, Hkv, Dv] into (pages[t], slots[t]) of `arena`; returns the arena.

    k/v are cast to the stored dtype (bf16 for a 1-plane view unless kv_dtype says f16; f32 for
    2 planes).  impl: "pallas" | "reference"; default pallas on GPU (or with interpret=True),
    else reference.  tuning: block_words, num_warps.
    """
    impl = resolve_impl(impl, interpret)
    if impl == "reference":
        return write_kv_reference(arena, k, v, pages, slots, view=view, kv_dtype=kv_dtype)
    return _write_kv_pallas(arena, k, v, pages, slots, view=view, kv_dtype=kv_dtype, interpret=interpret, **tuning)
