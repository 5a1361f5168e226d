"""An MoE decode batch's dispatch plan in one launch: where each (token, expert) row goes once the
rows are ordered by expert, and each expert's row range.

    pos, token, first, end = dispatch_plan(ids, num_experts, valid=None, repeat=k)
    ids [R] int32 (a token's k choices are rows t*k .. t*k+k-1), valid [R // k] bool | None
    key[r] = ids[r] if 0 <= ids[r] < E and valid[r // k], else E (padding: after every expert)
    pos [R]        the row's place in the stable order by key (a permutation of 0 .. R-1)
    token [R]      token[pos[r]] = r // k: the token whose x the sorted row multiplies
    first, end [E + 1]   expert g's rows are pos in [first[g], end[g]); g = E: the padding tail
                                                                              -> all int32

This is what `jnp.argsort` of the keys plus XLA's group sizes, inverse permutation and tile
metadata compute (models/experts.py's prefill path).  At a decode batch those are eleven launches of
1-4 us each a layer (a sort, two scatters, cumsums, pads and selects: benchmarks/RESULTS.md,
session 22 traces), more than the kernel work they describe.  Here every answer is a count over
all R keys, so no program waits on another:

* a row program (`block` rows) counts, for each of its rows, the rows before it in the order:
  pos[r] = #{r' : key[r'] < key[r]} + #{r' < r : key[r'] == key[r]} (stable), then scatters
  token[pos[r]] = r // k;
* an expert program (`block` experts) counts first[g] = #{r : key[r] < g} and
  end[g] = #{r : key[r] <= g}.

Each compares its keys against all R in chunks of `chunk` ([block, chunk] int32 in registers),
so the work is R^2 + 2 R E compares: cheap up to MAX_ROWS, past which the sort in
XLA wins (a prefill's rows; models/experts.py keeps that path).  Rows past R carry key E + 1, after
every real row, and are never counted.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ._compat import pltr, triton_params
from .launch import ANY, kernel_or_xla, pow2_ceil

__all__ = ["MAX_ROWS", "PLAN_ENV", "dispatch_plan", "dispatch_plan_reference", "plan_backend"]

# Rows (tokens x k) up to which a batch takes this plan (models/experts.py): each program compares its
# block with all R keys, R / chunk passes of a [row_block, chunk] compare; and the grouped matmul
# then gives each expert one program for all its rows, which a prefill's skewed routing (hundreds
# of rows on one expert) would serialise.  1024: a decode batch of 128 tokens at top-8.
MAX_ROWS = 1024
CHUNK = 256
BLOCK = 32  # rows (or experts) a program
# $UMEM_JAX_MOE_PLAN: "pallas" (this kernel orders a decode batch's rows), "xla" (the argsort path),
# unset or "auto": the kernel on a GPU, XLA elsewhere.  Read at trace time (runner.TRACE_ENV).
PLAN_ENV = "UMEM_JAX_MOE_PLAN"


def plan_backend() -> str:
    """"pallas" or "xla": how models/experts.py orders a decode batch's rows now ($UMEM_JAX_MOE_PLAN)."""
    return kernel_or_xla(PLAN_ENV)


def _keys(ids: jax.Array, num_experts: int, valid: jax.Array | None, repeat: int) -> jax.Array:
    ok = (ids >= 0) & (ids < num_experts)
    if valid is not None:
        ok = ok & jnp.repeat(valid, repeat)
    return jnp.where(ok, ids, num_experts).astype(jnp.int32)


def dispatch_plan_reference(ids: jax.Array, num_experts: int, valid: jax.Array | None = None, *, repeat: int = 1):
    """The definition by a stable argsort: (pos, token, first, end), as dispatch_plan."""
    key = _keys(ids, num_experts, valid, repeat)
    R = key.shape[0]
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    pos = jnp.zeros((R,), jnp.int32).at[order].set(jnp.arange(R, dtype=jnp.int32))
    g = jnp.arange(num_experts + 1, dtype=jnp.int32)
    first = jnp.sum(key[None, :] < g[:, None], axis=1, dtype=jnp.int32)
    end = jnp.sum(key[None, :] <= g[:, None], axis=1, dtype=jnp.int32)
    return pos, order // repeat, first, end


def _kernel(*refs, R, E, repeat, row_programs, block, chunk, has_valid):
    if has_valid:
        ids_ref, valid_ref, pos_ref, token_ref, first_ref, end_ref = refs
    else:
        (ids_ref, pos_ref, token_ref, first_ref, end_ref), valid_ref = refs, None
    p = pl.program_id(0)

    def keys(r):  # [n] rows -> keys; rows past R: E + 1, after every real row
        ok = r < R
        k = pltr.load(ids_ref.at[r], mask=ok, other=0)
        k = jnp.where((k >= 0) & (k < E), k, E)
        if valid_ref is not None:
            k = jnp.where(pltr.load(valid_ref.at[r // repeat], mask=ok, other=0) != 0, k, E)
        return jnp.where(ok, k, E + 1)

    def over_keys(count, init):  # sum count(chunk rows, their keys) over every chunk of R
        def body(c, acc):
            rc = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
            return tuple(a + s for a, s in zip(acc, count(rc, keys(rc))))
        return lax.fori_loop(0, pl.cdiv(R, chunk), body, init)

    zeros = jnp.zeros((block,), jnp.int32)

    @pl.when(p < row_programs)
    def _rows():
        r = p * block + jnp.arange(block, dtype=jnp.int32)
        kr = keys(r)

        def before(rc, kc):  # rows ordered before r: a smaller key, or the same key earlier
            b = (kc[None, :] < kr[:, None]) | ((kc[None, :] == kr[:, None]) & (rc[None, :] < r[:, None]))
            return (jnp.sum(b.astype(jnp.int32), axis=1),)

        (pos,) = over_keys(before, (zeros,))
        ok = r < R
        pltr.store(pos_ref.at[r], pos, mask=ok)
        pltr.store(token_ref.at[pos], r // repeat, mask=ok)

    @pl.when(p >= row_programs)
    def _experts():
        g = (p - row_programs) * block + jnp.arange(block, dtype=jnp.int32)

        def below(rc, kc):
            del rc
            return (jnp.sum((kc[None, :] < g[:, None]).astype(jnp.int32), axis=1),
                    jnp.sum((kc[None, :] <= g[:, None]).astype(jnp.int32), axis=1))

        first, end = over_keys(below, (zeros, zeros))
        ok = g <= E
        pltr.store(first_ref.at[g], first, mask=ok)
        pltr.store(end_ref.at[g], end, mask=ok)


@functools.partial(jax.jit, static_argnames=("num_experts", "repeat", "block", "chunk", "num_warps", "interpret"))
def dispatch_plan(ids: jax.Array, num_experts: int, valid: jax.Array | None = None, *, repeat: int = 1,
                  block: int = BLOCK, chunk: int = CHUNK, num_warps: int = 4, interpret: bool = False):
    """ids [R] int32, valid [R // repeat] bool | None -> (pos [R], token [R], first [E + 1],
    end [E + 1]) int32 (module docstring).  block and chunk: powers of two."""
    (R,) = ids.shape
    E = int(num_experts)
    if ids.dtype != jnp.int32:
        raise ValueError(f"dispatch_plan: ids must be int32, got {ids.dtype}")
    if R % repeat:
        raise ValueError(f"dispatch_plan: {R} rows are not a whole number of tokens of {repeat} rows")
    if valid is not None and valid.shape != (R // repeat,):
        raise ValueError(f"dispatch_plan: valid {valid.shape}, expected ({R // repeat},)")
    if E < 1:
        raise ValueError(f"dispatch_plan: num_experts {E}")
    block, chunk = pow2_ceil(min(block, R)), pow2_ceil(min(chunk, R))
    row_programs = pl.cdiv(R, block)
    operands = [ids] if valid is None else [ids, valid.astype(jnp.int32)]
    kernel = functools.partial(_kernel, R=R, E=E, repeat=repeat, row_programs=row_programs, block=block,
                               chunk=chunk, has_valid=valid is not None)
    i32 = lambda n: jax.ShapeDtypeStruct((n,), jnp.int32)  # noqa: E731
    return tuple(pl.pallas_call(
        kernel,
        grid=(row_programs + pl.cdiv(E + 1, block),),
        in_specs=[ANY] * len(operands),
        out_specs=(ANY, ANY, ANY, ANY),
        out_shape=(i32(R), i32(R), i32(E + 1), i32(E + 1)),
        compiler_params=triton_params(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="umem_dispatch_plan",
    )(*operands))
