"""Write one step's new K/V rows into the page-major arena, in place; gather them back (tests).

Layout (umem_jax/memory/plan.py, KVView): the K row of token t (slot t) of physical page p is
the `mk` arena rows `p*rows_per_page + k_row + t*mk ... + mk`, holding the token's K as one
vector of `planes * Hkv * D` words, head-major (`[Hkv, D]` flattened); with 2 planes (fp32) the
vector is `[hi plane (Hkv*D) | lo plane (Hkv*D)]` (see words.py).  V likewise at `v_row` with Dv.
An fp8 view (`view.fp8`) packs the vector as `Hkv*D/2` words, two e4m3 values each (words.py:
the bytes are the float8 array [Hkv, D]); K is stored as `k / k_scale[h]` saturated to +-448,
V as `v / v_scale[h]`.

Contract (docs/kernel_contracts.md):
  write_kv(arena, k, v, pages, slots, *, view) -> arena
    k [T, Hkv, D], v [T, Hkv, Dv]; pages, slots int32 [T] (physical page, slot within page).
    Padding rows use page 0 (the sink; garbage may land there).  Real (page, slot) pairs are
    distinct.  fp8 views also take k_scale, v_scale: f32 [Hkv] or scalars (default 1.0, vLLM's
    default when a checkpoint ships none).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._compat import pltr
from .launch import in_place_call, pow2_divisor, resolve_impl
from .words import (
    FP8,
    check_arena,
    decode,
    decode_fp8,
    encode,
    encode_fp8,
    from_u16,
    kernel_dtype,
    kv_value_dtype,
    to_u16,
)

__all__ = ["check_view", "head_slot", "kv_scales", "read_kv_reference", "write_kv", "write_kv_reference"]


def check_view(arena, view) -> None:
    """Static checks that `view` describes whole arena rows of `arena`."""
    check_arena(arena, view.row_words)
    for name, dim, m, words in (("K", view.head_dim, view.mk, view.k_words), ("V", view.v_head_dim, view.mv,
                                                                              view.v_words)):
        if words != m * view.row_words:
            raise ValueError(f"{name} row of {words} words is not a whole number of {view.row_words}-word arena rows")
        if view.fp8 and (dim % 2 or view.planes != 1):
            raise ValueError(f"an fp8 view needs one plane and even head dims, got planes={view.planes}, {name} dim {dim}")
    if view.rows_per_page > arena.shape[0]:
        raise ValueError(f"a page of {view.rows_per_page} rows does not fit an arena of {arena.shape[0]} rows")


def kv_scales(view, k_scale, v_scale):
    """The fp8 dequantisation scales as f32 [Hkv] each (None: 1.0; a scalar: every head), or
    (None, None) for a view that is not fp8 (where giving scales is an error)."""
    if not view.fp8:
        if k_scale is not None or v_scale is not None:
            raise ValueError("k_scale/v_scale apply to fp8 K/V only; this view stores "
                             f"{'fp32' if view.planes == 2 else '16-bit'} K/V")
        return None, None
    out = []
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        s = jnp.ones((), jnp.float32) if s is None else jnp.asarray(s, jnp.float32)
        if s.ndim > 1 or (s.ndim == 1 and s.shape[0] not in (1, view.num_kv_heads)):
            raise ValueError(f"{name} must be a scalar or [{view.num_kv_heads}] (one per kv head), got {s.shape}")
        out.append(jnp.broadcast_to(s.reshape(-1) if s.ndim else s, (view.num_kv_heads,)))
    return tuple(out)


def head_slot(view, which: str, head: int, plane: int = 0) -> tuple[int, int]:
    """(row offset within the token's rows, column) of `plane` of kv head `head` of K or V.

    The head's `dim` words (dim / 2 for fp8) are contiguous in the token vector; kernels need them
    inside one arena row, i.e. `column + words <= row_words` (true when row_words is a multiple of
    the head's words).
    """
    dim = view.head_words(view.head_dim if which == "k" else view.v_head_dim)
    off = plane * view.num_kv_heads * dim + head * dim
    return off // view.row_words, off % view.row_words


def _token_rows(pages, slots, base: int, m: int, rows_per_page: int):
    """int32 [T] pages/slots -> int32 [T, m] arena rows of one K (or V) token row."""
    return (pages[:, None] * rows_per_page + base + slots[:, None] * m
            + jnp.arange(m, dtype=jnp.int32)[None, :])


def _stored(x, planes: int, kv_dtype):
    """Cast the model's K/V to the dtype the arena stores (bf16 for 1 plane, f32 for 2)."""
    return x.astype(kv_value_dtype(planes, kv_dtype))


def _check_kv_dtype(view, kv_dtype) -> None:
    if view.fp8 and kv_dtype is not None and jnp.dtype(kv_dtype) != FP8:
        raise ValueError(f"an fp8 view stores {FP8}, kv_dtype says {jnp.dtype(kv_dtype)}")


def _token_words(x, view, kv_dtype, scale):
    """x [T, Hkv, dim] -> uint16 [T, row words] as the arena stores the token rows."""
    T = x.shape[0]
    if view.fp8:  # x / scale per kv head, saturated, two e4m3 values per word
        return encode_fp8(x, scale[:, None]).reshape(T, -1)
    return encode(_stored(x, view.planes, kv_dtype).reshape(T, -1))


def _token_values(words, view, kv_dtype, scale, dim):
    """uint16 words [N, row words] of token rows -> values [N, Hkv, dim] (fp8: times the scale)."""
    N = words.shape[0]
    if view.fp8:
        return decode_fp8(words.reshape(N, view.num_kv_heads, dim // 2), scale[:, None], jnp.float32)
    return decode(words, kv_value_dtype(view.planes, kv_dtype)).reshape(N, view.num_kv_heads, dim)


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
def write_kv_reference(arena, k, v, pages, slots, *, view, kv_dtype=None, k_scale=None, v_scale=None):
    """Plain-JAX KV write (an XLA scatter of whole token rows)."""
    _check_write(arena, k, v, pages, slots, view)
    _check_kv_dtype(view, kv_dtype)
    ks, vs = kv_scales(view, k_scale, v_scale)
    T = k.shape[0]
    # uint16 view throughout: XLA:CPU canonicalises bf16 NaN bit patterns in a bf16 scatter, and
    # fp32 lo planes (or other layers' words in the same array) are often such patterns.
    a = to_u16(arena)
    for x, base, m, scale in ((k, view.k_row, view.mk, ks), (v, view.v_row, view.mv, vs)):
        words = _token_words(x, view, kv_dtype, scale)  # uint16 [T, m*row_words]
        rows = _token_rows(pages, slots, base, m, view.rows_per_page)
        a = a.at[rows.reshape(-1)].set(words.reshape(T * m, view.row_words), mode="drop")
    return from_u16(a, arena.dtype)


@functools.partial(jax.jit, static_argnames=("view", "kv_dtype"))
def read_kv_reference(arena, page_table, *, view, kv_dtype=None, k_scale=None, v_scale=None):
    """Gather every token row the page table maps: page_table int32 [B, P] ->
    (k [B, P*page_size, Hkv, D], v [B, P*page_size, Hkv, Dv]) decoded to the stored dtype
    (bf16 for 1 plane, f32 for 2, or `kv_dtype`; fp8: f32 fp8 * scale, the dequantised values).
    Sink/tombstone entries read page 0 as is."""
    check_view(arena, view)
    _check_kv_dtype(view, kv_dtype)
    ks, vs = kv_scales(view, k_scale, v_scale)
    B, P = page_table.shape
    page_size = view.page_size
    pages = jnp.repeat(page_table.reshape(-1), page_size)                # [B*P*page_size]
    slots = jnp.tile(jnp.arange(page_size, dtype=jnp.int32), B * P)
    out = []
    for base, m, dim, scale in ((view.k_row, view.mk, view.head_dim, ks), (view.v_row, view.mv, view.v_head_dim, vs)):
        rows = _token_rows(pages.astype(jnp.int32), slots, base, m, view.rows_per_page)
        words = to_u16(arena)[rows.reshape(-1)].reshape(B * P * page_size, m * view.row_words)
        out.append(_token_values(words, view, kv_dtype, scale, dim).reshape(B, P * page_size, view.num_kv_heads, dim))
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
def _write_kv_pallas(arena, k, v, pages, slots, k_scale=None, v_scale=None, *, view, kv_dtype=None,
                     interpret: bool = False, block_words: int = 4096, num_warps: int = 4):
    _check_write(arena, k, v, pages, slots, view)
    _check_kv_dtype(view, kv_dtype)
    ks, vs = kv_scales(view, k_scale, v_scale)
    T, W = k.shape[0], view.row_words
    if T == 0:
        return arena
    words, rows = [], []
    # fp8: the quantisation (x / scale, saturate, e4m3, pack) is part of this small XLA fusion.
    for x, base, m, scale in ((k, view.k_row, view.mk, ks), (v, view.v_row, view.mv, vs)):
        words.append(_token_words(x, view, kv_dtype, scale).reshape(T * m, W))
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


def write_kv(arena, k, v, pages, slots, *, view, kv_dtype=None, k_scale=None, v_scale=None,
             impl: str | None = None, interpret: bool = False, **tuning):
    """Write k [T, Hkv, D] / v [T, Hkv, Dv] into (pages[t], slots[t]) of `arena`; returns the arena.

    k/v are cast to the stored dtype (bf16 for a 1-plane view unless kv_dtype says f16; f32 for
    2 planes; an fp8 view quantises k / k_scale and v / v_scale, f32 [Hkv] or scalars, default
    1.0).  impl: "pallas" | "reference"; default pallas on GPU (or with interpret=True), else
    reference.  tuning: block_words, num_warps.
    """
    impl = resolve_impl(impl, interpret)
    if impl == "reference":
        return write_kv_reference(arena, k, v, pages, slots, view=view, kv_dtype=kv_dtype, k_scale=k_scale,
                                  v_scale=v_scale)
    return _write_kv_pallas(arena, k, v, pages, slots, k_scale, v_scale, view=view, kv_dtype=kv_dtype,
                            interpret=interpret, **tuning)
