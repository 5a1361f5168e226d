"""The arena: all per-request memory of a hybrid model in ONE device array, and its operations.

`Arena` is a registered JAX pytree.  Its one child is `data` [num_rows, row_words] of a 16-bit
dtype (uint16 by default, or bfloat16); its static aux data is the `Plan` (which says where every
layer's rows sit) and the dtype.  Because the plan is static, a jitted function taking an Arena
is specialised to it and every layout offset is a compile-time constant.

Every function here that writes the arena DONATES it: XLA then updates the one buffer in place
and the caller's old `Arena` is deleted, so always rebind (`arena = write_kv(arena, ...)`).
Readers (`read_kv`, `read_state`) do not donate; under your own jit call them on the newest
arena only (write first, then read): a read of the old buffer beside an in-place write of it
makes XLA copy the whole arena to keep both alive.

Using the arena in your own jitted function::

    import functools, jax
    from umem_jax import arena as am

    @functools.partial(jax.jit, donate_argnames=("arena",))
    def step(arena: am.Arena, k, v, pages, slots, page_table):
        arena = am.write_kv(arena, k, v, pages, slots, layer=0)    # inlined; in place
        k_all, v_all = am.read_kv(arena, page_table, layer=0)     # reads the NEW arena
        return arena, k_all.sum()

    arena = am.Arena.create(plan, size.num_rows)                   # zeros, on the device
    arena, s = step(arena, k, v, pages, slots, page_table)         # rebind: the old one is gone

Check your step with `check_in_place(step.lower(...).compile(), arena)`; tests/memory/test_arena.py
does that for every writer here.  Page ids are physical, page/slot 0 is the sink; row ids are
int32, which is why `num_rows < 2**31` (the element count may exceed 2**31).

Tensor parallelism (umem_jax.parallel): `Arena.create(plan, num_rows, mesh=mesh)` makes `data`
[tp, num_rows, row_words] sharded P("tp"): device r holds its heads' slice of every page, laid
out by the same per-device plan, so page and slot ids mean the same on every device.  Page moves
and zeroing run per shard under shard_map; the model writes K/V and state inside its own
shard_map (models/sharded_model.py); read_kv / read_state give every shard's rows [tp, ...].
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .memory.declarations import WORD_BYTES
from .memory.plan import KVView, Plan, StateView, SubPool
from .pallas_kernels import kv_write, relocate, state_io
from .pallas_kernels.words import WORD_DTYPES

__all__ = ["NAN_BITS", "Arena", "apply_moves", "check_in_place", "move_bucket", "move_pages", "read_kv", "read_state",
           "write_kv", "write_state", "zero_pages"]

NAN_BITS = 0x7FC0  # bf16 quiet NaN: the debug fill, so reads of never-written rows show as NaN
MAX_ROWS = 2**31 - 1  # row ids are int32


def _word_dtype(dtype) -> jnp.dtype:
    d = jnp.dtype(dtype)
    if d not in WORD_DTYPES:
        raise ValueError(f"arena dtype must be uint16 or bfloat16, got {d}")
    return d


@jax.tree_util.register_pytree_with_keys_class
class Arena:
    """One device array `data` [num_rows, row_words] (uint16 or bfloat16) laid out by `plan`.

    Build with `Arena.create`; `Arena.abstract` gives a shape-only one for `jit(...).lower`.
    Leaves may be any object during pytree transforms, so nothing here inspects `data` eagerly.
    """

    __slots__ = ("data", "dtype", "mesh", "plan")

    def __init__(self, data, plan: Plan, dtype=jnp.uint16, mesh=None):
        self.data = data
        self.plan = plan
        self.dtype = _word_dtype(dtype)
        self.mesh = mesh  # a "tp" Mesh: data is [tp, rows, words] split on its first axis

    # -- pytree: the array is the child; plan, dtype and mesh are static (part of the jit cache key)
    def tree_flatten_with_keys(self):
        return ((jax.tree_util.GetAttrKey("data"), self.data),), (self.plan, self.dtype, self.mesh)

    def tree_flatten(self):
        return (self.data,), (self.plan, self.dtype, self.mesh)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    # -- construction
    @classmethod
    def create(cls, plan: Plan, num_rows: int, dtype=jnp.uint16, debug_nan: bool = False, sharding=None,
               mesh=None) -> Arena:
        """Allocate [num_rows, plan.row_words] directly on the device (a jitted fill: no host copy);
        with a `mesh` ("tp" axis), [tp, num_rows, row_words] with each device filling its shard.

        debug_nan: fill with the bf16 NaN bit pattern 0x7FC0 instead of zeros, so any read of a
        row nobody wrote shows up as NaN.  sharding: `out_shardings` of the fill (e.g. a
        NamedSharding); default: the default device.
        NOTE: prefer uint16.  The plain-JAX kernels work on the uint16 view of a bf16 arena (so
        fp32 lo planes keep their bits), and XLA:CPU materialises that view as a whole copy.
        """
        dtype = _word_dtype(dtype)
        _check_rows(plan, num_rows)
        fill = NAN_BITS if debug_nan else 0
        shape = (int(num_rows), plan.row_words)
        if mesh is not None:
            shape, sharding = (_tp(mesh),) + shape, _sharded(mesh)
        data = _filler(shape, dtype.name, fill, sharding)()
        return cls(data, plan, dtype, mesh)

    @classmethod
    def abstract(cls, plan: Plan, num_rows: int, dtype=jnp.uint16, sharding=None, mesh=None) -> Arena:
        """An Arena whose `data` is a ShapeDtypeStruct: for AOT `lower(...)` and memory probes."""
        dtype = _word_dtype(dtype)
        _check_rows(plan, num_rows)
        shape = (int(num_rows), plan.row_words)
        if mesh is not None:
            shape, sharding = (_tp(mesh),) + shape, _sharded(mesh)
        kw = {"sharding": sharding} if sharding is not None else {}
        return cls(jax.ShapeDtypeStruct(shape, dtype, **kw), plan, dtype, mesh)

    def replace(self, data) -> Arena:
        """The same plan, dtype and mesh around new `data` (what every writer returns)."""
        return Arena(data, self.plan, self.dtype, self.mesh)

    # -- sizes (static: from the shape, never from the values)
    @property
    def tp(self) -> int:
        """Devices the arena is split over (1: not split)."""
        return 1 if self.mesh is None else _tp(self.mesh)

    @property
    def num_rows(self) -> int:
        return int(self.data.shape[-2])

    @property
    def row_words(self) -> int:
        return int(self.data.shape[-1])

    @property
    def shard_nbytes(self) -> int:
        """Bytes one device holds (all of them when not split)."""
        return self.num_rows * self.row_words * WORD_BYTES

    @property
    def nbytes(self) -> int:
        return self.tp * self.shard_nbytes

    def num_pages(self, subpool: str) -> int:
        """Pages of `subpool`'s grid that fit in the arena, page (slot) 0 included."""
        return self.plan[subpool].num_pages(self.num_rows)

    def __repr__(self) -> str:
        shape = getattr(self.data, "shape", None)
        return f"Arena({self.dtype.name}{list(shape) if shape is not None else '?'}, sub-pools={list(self.plan.names)})"


def _tp(mesh) -> int:
    from .parallel.collectives import TP_AXIS

    return int(mesh.shape[TP_AXIS])


def _sharded(mesh):
    from .parallel.mesh import arena_sharding

    return arena_sharding(mesh)


def _per_shard(arena: Arena, fn, *args):
    """fn(data [rows, words], *args) on every shard of a split arena, args replicated (page ids
    mean the same on every device); every array fn returns gets a leading [tp] axis (a writer's
    new data is the new [tp, rows, words] arena).  Plain fn(arena.data, *args) when not split."""
    if arena.mesh is None:
        return fn(arena.data, *args)
    from jax.sharding import PartitionSpec as P

    from .parallel.collectives import TP_AXIS
    from .parallel.mesh import shard_map

    body = lambda d, *a: jax.tree.map(lambda x: x[None], fn(d[0], *a))
    return shard_map(body, arena.mesh, in_specs=(P(TP_AXIS),) + (P(),) * len(args), out_specs=P(TP_AXIS))(
        arena.data, *args)


def _unsplit(arena: Arena, what: str) -> None:
    if arena.mesh is not None:
        raise NotImplementedError(f"{what} on a tensor-parallel arena: the model writes each device's heads "
                                  "inside its own shard_map (models/sharded_model.py)")


def _check_rows(plan: Plan, num_rows: int) -> None:
    if not 0 < num_rows <= MAX_ROWS:
        raise ValueError(f"num_rows={num_rows:,} must be in [1, {MAX_ROWS:,}]: row ids are int32 (widen "
                         "plan.row_words to fit more bytes)")
    if num_rows < plan.sink_rows:
        raise ValueError(f"num_rows={num_rows} is smaller than the sink ({plan.sink_rows} rows)")


@functools.cache
def _filler(shape: tuple[int, int], dtype: str, fill: int, sharding):
    """A jitted, argument-free fill of `shape`: XLA writes the buffer on the device itself."""

    def make():
        words = lax.full(shape, np.uint16(fill), jnp.uint16)
        return words if dtype == "uint16" else lax.bitcast_convert_type(words, jnp.dtype(dtype))

    return jax.jit(make, out_shardings=sharding) if sharding is not None else jax.jit(make)


# ------------------------------------------------------------------------- plan look-ups


def _attention_pool(plan: Plan, layer: int, model: str) -> SubPool:
    for sp in plan.subpools:
        if sp.kv and (model, layer) in sp.layers:
            return sp
    raise KeyError(f"no sub-pool holds attention rows of layer {model}:{layer}")


def _state_pool(plan: Plan, layer: int, model: str) -> SubPool:
    sp = plan.state
    if sp is None or (model, layer) not in sp.layers:
        raise KeyError(f"no state sub-pool holds layer {model}:{layer}")
    return sp


def kv_view(arena: Arena, layer: int, model: str = "target") -> KVView:
    """The static KVView of attention layer `layer` of `model` in `arena`'s plan."""
    return _attention_pool(arena.plan, layer, model).kv_view(layer, model)


def state_view(arena: Arena, layer: int, model: str = "target") -> StateView:
    """The static StateView of state layer `layer` of `model` in `arena`'s plan."""
    return _state_pool(arena.plan, layer, model).state_view(layer, model)


# ---------------------------------------------------------------------- device operations
# Static arguments (layer, model, subpool, impl, ...) pick the view from the plan at trace time.

_KV_STATIC = ("layer", "model", "kv_dtype", "impl", "interpret")


@functools.partial(jax.jit, donate_argnames=("arena",), static_argnames=_KV_STATIC)
def write_kv(arena: Arena, k, v, pages, slots, *, layer: int, model: str = "target", kv_dtype=None,
             impl: str | None = None, interpret: bool = False) -> Arena:
    """Write one step's K/V rows of attention layer `layer`; donates and returns the arena.

    k [T, Hkv, D], v [T, Hkv, Dv]; pages, slots int32 [T]: physical page (0 = sink, for padding
    rows) and slot within the page.  Dispatches to pallas_kernels.kv_write.write_kv.
    """
    _unsplit(arena, "write_kv")
    view = kv_view(arena, layer, model)
    data = kv_write.write_kv(arena.data, k, v, pages, slots, view=view, kv_dtype=kv_dtype, impl=impl,
                             interpret=interpret)
    return arena.replace(data)


@functools.partial(jax.jit, static_argnames=("layer", "model", "view", "kv_dtype"))
def read_kv(arena: Arena, page_table, *, layer: int | None = None, model: str = "target",
            view: KVView | None = None, kv_dtype=None):
    """Plain-JAX gather of every token row a page table maps (for tests; kernels read in place).

    page_table int32 [B, P] physical pages -> (k [B, P*page_size, Hkv, D], v [B, P*page_size,
    Hkv, Dv]) in the stored dtype (bf16, or f32 for 2-plane rows).  Give `layer` (looked up in
    the plan) or an explicit `view`.  A split arena gives every shard's heads: [tp, B, ...].
    """
    if view is None:
        if layer is None:
            raise ValueError("read_kv needs layer= or view=")
        view = kv_view(arena, layer, model)
    return _per_shard(arena, lambda d, t: kv_write.read_kv_reference(d, t, view=view, kv_dtype=kv_dtype), page_table)


@functools.partial(jax.jit, static_argnames=("layer", "model", "impl", "interpret"))
def read_state(arena: Arena, slots, *, layer: int, model: str = "target", impl: str | None = None,
               interpret: bool = False) -> dict:
    """State tensors of layer `layer` for physical slots int32 [B] -> {name: [B, *shape]} in each
    tensor's dtype (fp32 rebuilt from its two planes); a split arena gives every shard's:
    [tp, B, *shape].  Dispatches to state_io.read_state."""
    view = state_view(arena, layer, model)
    return _per_shard(arena, lambda d, s: state_io.read_state(d, s, view=view, impl=impl, interpret=interpret), slots)


@functools.partial(jax.jit, donate_argnames=("arena",), static_argnames=("layer", "model", "impl", "interpret"))
def write_state(arena: Arena, slots, tensors: dict, *, layer: int, model: str = "target", impl: str | None = None,
                interpret: bool = False) -> Arena:
    """Write {name: [B, *shape]} of layer `layer` into physical slots int32 [B] (0 = sink);
    donates and returns the arena.  Dispatches to state_io.write_state."""
    _unsplit(arena, "write_state")
    data = state_io.write_state(arena.data, slots, tensors, view=state_view(arena, layer, model), impl=impl,
                                interpret=interpret)
    return arena.replace(data)


@functools.partial(jax.jit, donate_argnames=("arena",), static_argnames=("subpool", "impl", "interpret"))
def move_pages(arena: Arena, src, dst, *, subpool: str, impl: str | None = None, interpret: bool = False) -> Arena:
    """Copy page envelopes src[i] -> dst[i] (int32 [N]) on `subpool`'s page grid (the state grid
    starts at the sink: its base_row); donates.

    Destinations distinct and disjoint from sources; 0 -> 0 pairs are padding
    (relocate.check_moves checks this on the host).  Dispatches to relocate.move_pages.
    """
    sp = arena.plan[subpool]
    move = lambda d, s, t: relocate.move_pages(d, s, t, rows_per_page=sp.rows_per_page, base_row=sp.base_row, impl=impl,
                                               interpret=interpret)
    return arena.replace(_per_shard(arena, move, src, dst))


@functools.partial(jax.jit, donate_argnames=("arena",), static_argnames=("subpool", "impl", "interpret"))
def zero_pages(arena: Arena, pages, *, subpool: str, impl: str | None = None, interpret: bool = False) -> Arena:
    """Zero the page envelopes `pages` (int32 [N]) of `subpool`'s grid; donates.  Dispatches to
    relocate.zero_pages."""
    sp = arena.plan[subpool]
    zero = lambda d, p: relocate.zero_pages(d, p, rows_per_page=sp.rows_per_page, base_row=sp.base_row, impl=impl,
                                            interpret=interpret)
    return arena.replace(_per_shard(arena, zero, pages))


# ---------------------------------------------------------------------------- move batches


def move_bucket(n: int, min_bucket: int = 16) -> int:
    """Padded length of a batch of n moves: the next power of two, at least `min_bucket`, so a
    run of batches compiles move_pages a handful of times instead of once per size."""
    return max(min_bucket, 1 << max(0, int(n) - 1).bit_length())


def apply_moves(arena: Arena, moves, plan: Plan | None = None, *, impl: str | None = None,
                interpret: bool = False, min_bucket: int = 16) -> Arena:
    """Apply the allocator's queued move batches in order; donates and returns the arena.

    moves: iterable of objects with .subpool (name), .src and .dst (int32 [N] physical pages),
    e.g. umem_jax.memory.tables.Move.  Within a batch, moves obey the move_pages contract (checked
    here on the host); a later batch sees the result of the earlier ones.  Each batch is padded
    with 0 -> 0 sink pairs to `move_bucket(N)`.  `plan`, if given, must be the arena's plan.
    """
    if plan is not None and plan != arena.plan:
        raise ValueError("apply_moves: the moves' plan is not the arena's plan")
    for m in moves:
        src = np.asarray(m.src, dtype=np.int32).reshape(-1)
        dst = np.asarray(m.dst, dtype=np.int32).reshape(-1)
        if src.size == 0:
            continue
        rows_per_page = getattr(m, "rows_per_page", None)
        if rows_per_page is not None and rows_per_page != arena.plan[m.subpool].rows_per_page:
            raise ValueError(f"move batch of {m.subpool} has pages of {rows_per_page} rows, the arena's plan says "
                             f"{arena.plan[m.subpool].rows_per_page}")
        relocate.check_moves(src, dst, num_pages=arena.num_pages(m.subpool))
        n = move_bucket(src.size, min_bucket)
        pad = np.zeros(n - src.size, np.int32)
        arena = move_pages(arena, np.concatenate([src, pad]), np.concatenate([dst, pad]), subpool=m.subpool,
                           impl=impl, interpret=interpret)
    return arena


# ------------------------------------------------------------------------------ copy checks


def _hlo_shapes(arena) -> tuple[str, ...]:
    """The arena's shapes as one device's HLO spells them (a split arena: that device's
    [1, rows, words], and the [rows, words] its shard_map body works on)."""
    short = {"uint16": "u16", "bfloat16": "bf16"}[jnp.dtype(arena.dtype).name]
    flat = f"{short}[{arena.num_rows},{arena.row_words}]"
    return (flat,) if arena.mesh is None else (flat, f"{short}[1,{arena.num_rows},{arena.row_words}]")


def check_in_place(compiled, arena: Arena, *, max_temp_bytes: int | None = None) -> dict:
    """Fail (AssertionError) if an AOT-compiled function copies the arena; return what was seen.

    Checks `compiled.memory_analysis()`: alias bytes >= arena bytes (donated and aliased) and
    temp bytes <= max_temp_bytes (default arena bytes // 8); and that `compiled.as_text()` has
    no `copy(`/`copy-start(` producing an arena-shaped buffer.  A split arena is checked per
    device (the compiled SPMD program is one device's): its shard's bytes and [1, rows, words].
    """
    m = compiled.memory_analysis()
    nbytes = arena.shard_nbytes
    limit = nbytes // 8 if max_temp_bytes is None else max_temp_bytes
    shapes = _hlo_shapes(arena)
    copies = [ln.strip() for ln in compiled.as_text().splitlines()
              if re.search(r"\b(copy|copy-start)\(", ln) and any(sh in ln.split("=", 1)[-1].split("(", 1)[0]
                                                                   for sh in shapes)]
    seen = {"alias_bytes": m.alias_size_in_bytes, "temp_bytes": m.temp_size_in_bytes, "arena_bytes": nbytes,
            "arena_copies": copies}
    assert m.alias_size_in_bytes >= nbytes, f"arena not aliased in -> out (not donated?): {seen}"
    assert m.temp_size_in_bytes <= limit, f"temporaries above {limit:,} B: the arena is probably copied: {seen}"
    assert not copies, f"arena-shaped copy in the compiled program: {seen}"
    return seen
