"""Read and write whole recurrent-state tensors of request slots in the arena.

Layout (umem_jax/memory/plan.py, StateView): a state slot is `rows_per_slot` contiguous arena
rows.  Tensor `name` of a layer in physical slot s >= 1 is stored flattened row-major, plane by
plane: plane k (0 = hi or the only plane, 1 = lo) is the `rows_per_plane` arena rows starting at

    base_row + s * rows_per_slot + tensor_row + k * rows_per_plane

where base_row = sink_rows - rows_per_slot puts slot 1 right at the sink: slot 0 has no rows of
its own (they may start below row 0), so every row of slot 0 must be masked, never computed.

and element e of the flattened tensor sits in row `base + e // row_words`, column
`e % row_words`; the last row of a plane is zero-padded.  fp32 tensors are two planes of uint16
words (hi = bits >> 16, lo = bits & 0xffff; see words.py); 16-bit tensors are one plane.

Contract (docs/kernel_contracts.md):
  read_state(arena, slots, *, view) -> {name: [B, *shape]} in each tensor's dtype
  write_state(arena, slots, tensors, *, view) -> arena
    slots int32 [B] physical slot ids; 0 is the sink (padding lanes): read_state returns zeros
    for those lanes and write_state writes nothing for them.  Real slots are distinct.

The kernels address the 2-D arena by (row, column) only, so Triton does the row * row_words
multiply in 64 bits when the arena is over 4 GiB; all per-slot offsets stay far below 2**31.
The in-kernel block helpers (`block_fits`, `load_block`, `store_block`) are shared with the
causal conv, Mamba2 and gated DeltaNet kernels.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._compat import pltr, triton_params
from .launch import ANY, pow2_divisor, resolve_impl
from .words import check_arena, from_u16, join_planes, planes_of, split_planes, to_u16

__all__ = ["block_fits", "check_slots", "check_state_view", "load_block", "plane_row", "read_state",
           "read_state_reference", "state_dtype", "store_block", "write_state", "write_state_reference"]


# ----------------------------------------------------------------------------- helpers

# _U16_NOTE: every function here works on a uint16 view of the arena (a same-width bitcast, free
# and in place under donation).  A bf16 arena holds fp32 planes whose halves are often bf16 NaN
# bit patterns, and XLA:CPU canonicalises bf16 NaNs (0xFFFF -> 0xFFC0) in *every* element of an
# array a bf16 scatter touches; integer words are only ever moved.


def state_dtype(rows) -> jnp.dtype:
    """The dtype a StateRows' tensor decodes to."""
    return jnp.dtype(rows.tensor.dtype)


def check_state_view(arena, view) -> None:
    """Static checks that `view` fits `arena` [num_rows, row_words] of 16-bit words."""
    check_arena(arena, view.row_words)
    if view.rows_per_slot > arena.shape[0]:
        raise ValueError(f"a slot of {view.rows_per_slot} rows does not fit an arena of {arena.shape[0]} rows")
    for t in view.tensors:
        if planes_of(t.tensor.dtype) != t.planes:
            raise ValueError(f"state tensor {t.tensor.name}: {t.tensor.dtype} takes {planes_of(t.tensor.dtype)} "
                             f"planes, the view says {t.planes}")
        if t.rows_per_plane * view.row_words < t.tensor.numel:
            raise ValueError(f"state tensor {t.tensor.name}: {t.rows_per_plane} rows per plane cannot hold "
                             f"{t.tensor.numel} elements")
        if t.row + t.planes * t.rows_per_plane > view.rows_per_slot:
            raise ValueError(f"state tensor {t.tensor.name} runs past the end of its slot")


def check_slots(slots):
    """slots must be int32 [B] (physical slot ids, 0 = padding lane)."""
    if slots.ndim != 1 or jnp.dtype(slots.dtype) != jnp.int32:
        raise ValueError(f"slots must be int32 [B], got {slots.dtype}{list(slots.shape)}")


def plane_row(slot, view, rows, plane: int = 0):
    """First arena row of `plane` of the tensor `rows` (a StateRows) in real slot `slot` >= 1
    (int32, may be traced, also inside a kernel; callers skip slot 0, whose rows are not the
    arena's).  Fits int32 because num_rows < 2**31."""
    return slot * view.rows_per_slot + (view.base_row + rows.row + plane * rows.rows_per_plane)


def block_fits(view, n: int) -> bool:
    """Can a kernel move `n` consecutive elements (n a power of two, starting at a multiple of n)
    of a state tensor as one block?  Yes when the block is inside one arena row (n divides
    row_words) or is whole rows (row_words divides n, with row_words a power of two)."""
    W = view.row_words
    if n <= 0 or n & (n - 1):
        return False
    return W % n == 0 or (n % W == 0 and W & (W - 1) == 0)


def _block_refs(arena_ref, slot, view, rows, flat0, n):
    """Refs of each plane of elements [flat0, flat0 + n) of tensor `rows` in `slot` (in-kernel)."""
    W = view.row_words
    if W % n == 0:  # inside one row
        col = pl.multiple_of(flat0 % W, n)
        return [arena_ref.at[plane_row(slot, view, rows, k) + flat0 // W, pl.ds(col, n)]
                for k in range(rows.planes)]
    return [arena_ref.at[pl.ds(plane_row(slot, view, rows, k) + flat0 // W, n // W), :]  # whole rows
            for k in range(rows.planes)]


def load_block(arena_ref, slot, view, rows, flat0, shape, dtype=None):
    """In-kernel: elements [flat0, flat0 + prod(shape)) of tensor `rows` of `slot`, decoded to the
    tensor's dtype (fp32 rebuilt from its planes), cast to `dtype` if given, in `shape`.
    flat0 must be a multiple of the block size and `block_fits(view, size)` hold."""
    n = math.prod(shape)
    words = [pltr.load(r) for r in _block_refs(arena_ref, slot, view, rows, flat0, n)]
    x = from_u16(words[0], state_dtype(rows)) if rows.planes == 1 else join_planes(*words, state_dtype(rows))
    x = x.reshape(shape)
    return x if dtype is None else x.astype(dtype)


def store_block(arena_ref, slot, view, rows, flat0, x):
    """In-kernel inverse of load_block: store x (any shape, cast to the tensor's dtype)."""
    n = x.size
    refs = _block_refs(arena_ref, slot, view, rows, flat0, n)
    x = x.astype(state_dtype(rows))
    planes = (to_u16(x),) if rows.planes == 1 else split_planes(x)
    W = view.row_words
    shape = (n,) if W % n == 0 else (n // W, W)
    for r, p in zip(refs, planes):
        pltr.store(r, p.reshape(shape))


def _rows_of(slots, view, pad_row):
    """int32 [B] slots -> int32 [B, R] arena rows of every plane of every tensor of the view, in
    view order; padding lanes (slot 0) get `pad_row` in every column, since slot 0's would-be rows
    may be negative (an XLA gather / scatter would wrap them onto the arena's top rows)."""
    r = jnp.concatenate([t.row + jnp.arange(t.planes * t.rows_per_plane, dtype=jnp.int32) for t in view.tensors])
    rows = slots[:, None] * view.rows_per_slot + (view.base_row + r[None, :])
    return jnp.where((slots != 0)[:, None], rows, pad_row)


# --------------------------------------------------------------------------- references
# One gather and one scatter for all tensors of the layer: a decode step then has exactly one
# reader of the old arena, and its writer depends on that reader's output, so XLA updates the
# donated arena in place (two independent readers beside an in-place writer make XLA copy the
# whole arena).


def read_state_reference(arena, slots, *, view):
    """Plain-JAX read: slots int32 [B] -> {name: [B, *shape]} in each tensor's dtype (one XLA
    gather of whole rows).  Padding lanes (slot 0) read as zeros."""
    check_state_view(arena, view)
    check_slots(slots)
    B, W = slots.shape[0], view.row_words
    words = to_u16(arena)[_rows_of(slots, view, 0)]                          # [B, R, W]; padding reads row 0
    out, at = {}, 0
    for t in view.tensors:
        n = t.planes * t.rows_per_plane
        w = words[:, at:at + n].reshape(B, t.planes, t.rows_per_plane * W)[..., : t.tensor.numel]
        at += n
        dt = state_dtype(t)
        x = from_u16(w[:, 0], dt) if t.planes == 1 else join_planes(w[:, 0], w[:, 1], dt)
        x = jnp.where((slots != 0)[:, None], x, jnp.zeros((), dt))
        out[t.tensor.name] = x.reshape(B, *t.tensor.shape)
    return out


def _check_tensors(tensors, slots, view):
    names = {t.tensor.name for t in view.tensors}
    if set(tensors) != names:
        raise ValueError(f"write_state needs exactly the tensors {sorted(names)}, got {sorted(tensors)}")
    B = slots.shape[0]
    for t in view.tensors:
        x = tensors[t.tensor.name]
        if tuple(x.shape) != (B, *t.tensor.shape):
            raise ValueError(f"state tensor {t.tensor.name} must be [{B}, {', '.join(map(str, t.tensor.shape))}], "
                             f"got {list(x.shape)}")


def _padded_words(x, t, W):
    """[B, *shape] -> uint16 [B, planes * rows_per_plane, W]: the tensor cast to its stored
    dtype, flattened, split into planes and zero-padded to whole rows."""
    B = x.shape[0]
    x = x.astype(state_dtype(t)).reshape(B, -1)
    pad = t.rows_per_plane * W - t.tensor.numel
    planes = (to_u16(x),) if t.planes == 1 else split_planes(x)
    return jnp.stack([jnp.pad(p, ((0, 0), (0, pad))) for p in planes], axis=1).reshape(B, -1, W)


def write_state_reference(arena, slots, tensors, *, view):
    """Plain-JAX write: tensors {name: [B, *shape]} (cast to each tensor's stored dtype) into
    slots int32 [B] (one XLA scatter of whole rows; padding lanes write nothing)."""
    check_state_view(arena, view)
    check_slots(slots)
    _check_tensors(tensors, slots, view)
    W = view.row_words
    words = jnp.concatenate([_padded_words(tensors[t.tensor.name], t, W) for t in view.tensors], axis=1)
    # Padding lanes get an out-of-range row, which mode="drop" skips (never clamp onto a real row).
    rows = _rows_of(slots, view, arena.shape[0])
    words_arena = to_u16(arena).at[rows.reshape(-1)].set(words.reshape(-1, W), mode="drop")  # see _U16_NOTE
    return from_u16(words_arena, arena.dtype)


# --------------------------------------------------------------------------- Pallas kernels
# One pallas_call per direction for all tensors of the layer (one reader, one aliased writer).
# Program (b, r, c) moves words [c*chunk, (c+1)*chunk) of row r of every plane of every tensor
# that has a row r: grid (B, max rows_per_plane, row_words // chunk).  Planes are joined / split
# in registers.


def _read_kernel(slots_ref, arena_ref, *out_refs, view, chunk):
    b, r, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = slots_ref[b]
    col = pl.multiple_of(c * chunk, chunk)
    off = pl.multiple_of(r * view.row_words + c * chunk, chunk)
    for t, out_ref in zip(view.tensors, out_refs):
        dt = state_dtype(t)
        dst = out_ref.at[b, pl.ds(off, chunk)]

        @pl.when((r < t.rows_per_plane) & (slot == 0))
        def _():
            pltr.store(dst, jnp.zeros((chunk,), dt))

        @pl.when((r < t.rows_per_plane) & (slot != 0))
        def _():
            w = [pltr.load(arena_ref.at[plane_row(slot, view, t, k) + r, pl.ds(col, chunk)]) for k in range(t.planes)]
            pltr.store(dst, from_u16(w[0], dt) if t.planes == 1 else join_planes(w[0], w[1], dt))


def _write_kernel(slots_ref, *refs, view, chunk):
    x_refs, arena_ref = refs[:len(view.tensors)], refs[-1]  # refs[-2] is the aliased input
    b, r, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = slots_ref[b]
    col = pl.multiple_of(c * chunk, chunk)
    off = pl.multiple_of(r * view.row_words + c * chunk, chunk)
    for t, x_ref in zip(view.tensors, x_refs):
        @pl.when((r < t.rows_per_plane) & (slot != 0))
        def _():
            x = pltr.load(x_ref.at[b, pl.ds(off, chunk)])
            planes = (to_u16(x),) if t.planes == 1 else split_planes(x)
            for k, p in enumerate(planes):
                pltr.store(arena_ref.at[plane_row(slot, view, t, k) + r, pl.ds(col, chunk)], p)


def _grid(arena, slots, view, chunk):
    """Checks, then (chunk, grid): program (b, r, c) moves `chunk` words of row r of every plane."""
    check_state_view(arena, view)
    check_slots(slots)
    chunk = chunk or pow2_divisor(view.row_words)
    max_rows = max(t.rows_per_plane for t in view.tensors)
    return chunk, (slots.shape[0], max_rows, view.row_words // chunk)


@functools.partial(jax.jit, static_argnames=("view", "interpret", "chunk", "num_warps"))
def _read_state_pallas(arena, slots, *, view, interpret=False, chunk=None, num_warps=4):
    chunk, grid = _grid(arena, slots, view, chunk)
    B, W = slots.shape[0], view.row_words
    flats = pl.pallas_call(
        functools.partial(_read_kernel, view=view, chunk=chunk),
        grid=grid,
        in_specs=[ANY, ANY],
        out_specs=tuple(ANY for _ in view.tensors),
        out_shape=tuple(jax.ShapeDtypeStruct((B, t.rows_per_plane * W), state_dtype(t)) for t in view.tensors),
        compiler_params=triton_params(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="read_state",
    )(slots, to_u16(arena))  # see _U16_NOTE
    return {t.tensor.name: f[:, : t.tensor.numel].reshape(B, *t.tensor.shape) for t, f in zip(view.tensors, flats)}


@functools.partial(jax.jit, static_argnames=("view", "interpret", "chunk", "num_warps"))
def _write_state_pallas(arena, slots, tensors, *, view, interpret=False, chunk=None, num_warps=4):
    chunk, grid = _grid(arena, slots, view, chunk)
    _check_tensors(tensors, slots, view)
    B, W = slots.shape[0], view.row_words
    xs = [jnp.pad(tensors[t.tensor.name].astype(state_dtype(t)).reshape(B, -1),
                  ((0, 0), (0, t.rows_per_plane * W - t.tensor.numel))) for t in view.tensors]
    n = len(xs)
    words = pl.pallas_call(
        functools.partial(_write_kernel, view=view, chunk=chunk),
        grid=grid,
        in_specs=[ANY] * (n + 2),
        out_specs=ANY,
        out_shape=jax.ShapeDtypeStruct(arena.shape, jnp.uint16),
        input_output_aliases={n + 1: 0},
        compiler_params=triton_params(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="write_state",
    )(slots, *xs, to_u16(arena))  # see _U16_NOTE
    return from_u16(words, arena.dtype)


# --------------------------------------------------------------------------- public wrappers


def read_state(arena, slots, *, view, impl: str | None = None, interpret: bool = False, **tuning):
    """Read every state tensor of `view` for slots int32 [B] -> {name: [B, *shape]} in each
    tensor's dtype (fp32 rebuilt from its planes).  Padding lanes (slot 0) read as zeros.

    impl: "pallas" | "reference"; default pallas on GPU (or with interpret=True), else reference.
    """
    impl = resolve_impl(impl, interpret)
    if impl == "reference":
        return read_state_reference(arena, slots, view=view)
    return _read_state_pallas(arena, slots, view=view, interpret=interpret, **tuning)


def write_state(arena, slots, tensors, *, view, impl: str | None = None, interpret: bool = False, **tuning):
    """Write tensors {name: [B, *shape]} (every tensor of `view`, cast to its stored dtype) into
    slots int32 [B] of `arena`; returns the arena.  Padding lanes (slot 0) write nothing.

    Call it under a jit that donates the arena: the Pallas kernel aliases it in place.
    """
    impl = resolve_impl(impl, interpret)
    if impl == "reference":
        return write_state_reference(arena, slots, tensors, view=view)
    return _write_state_pallas(arena, slots, tensors, view=view, interpret=interpret, **tuning)
