"""The few-rows expert GEMM (an MoE decode step): each row times the matrix of the expert it names,
every chosen expert's matrix read once.

    y = expert_gemv(x, ids, w, bias)          x [R, K], ids [R] int32, w [E, K, N], bias [E, N] | None
    y[r] = x[r] @ w[ids[r]] (+ bias[ids[r]])  for 0 <= ids[r] < E
    y[r] = x[r] @ shared[ids[r] - E]          for E <= ids[r] < E + m  (shared=[m, K, N]: an MoE's
                                              shared expert as m pseudo-experts, no bias; or
                                              [K, m, N] with shared_axis=1, read in place)
                                              (repeat=k: x [R/k, K], row r reads x[r // k], as an
                                              MoE's k rows of one token do: no repeated copy of x)
    y[r] = 0                                  otherwise (padding rows: no expert is read for them)
    prologue=f (gated): x[r] is f(x[r, :K], x[r, K:]) as it is loaded (the MLP's activation)
                                                                            -> [R, N] fp32 accumulation

At one decode token an MoE layer must read exactly top_k experts' weights, and that read is the
whole cost.  The gather path (models/experts.py `_gathered`) copies the chosen matrices first (read,
write, read again) and the grouped GEMM (grouped_matmul.py) gives each expert one program per
column block, too few to keep HBM busy; both ran 4-8x the bytes on the H200.  This kernel puts
the matrix read itself on a wide grid, (row slot u, column block, K split):

* Slot u is live when row u names a valid expert that no earlier row names: it computes the
  product for *every* row naming that expert (rows sharing an expert are one [bm, bk] x [bk, bn]
  dot, so a matrix used by several tokens is read once).  Later rows of the same expert, and
  padding rows, leave their slots idle, so the grid is a static R and reads only the distinct
  experts.  Deciding this in the kernel (an R-wide compare of the ids) needs no sort and no extra
  XLA launch before it.
* Rows are padded to bm = max(16, pow2 >= R): 16 is the smallest Triton `dot`; the padding rows
  are masked loads, never issued.
* The K range is split over `k_splits` programs that write fp32 partial sums [S, R, N]; the sum
  over S is left to XLA, which fuses it into whatever consumes y (the bias add and activation
  of the next op), so the split costs no launch.  The bias is added once, by split 0.
* A padding row's slot stores its zeros (every split), so every output element is written
  exactly once and unwritten ones (NaN in interpret mode) fail the tests.

Offsets: every load indexes the 3-D weight ref by (expert, k, n), so Pallas does the address
multiply itself, in int64 once the array passes 4 GiB; nothing here forms a flat offset.  Expert
ids outside [0, E) never reach an address (the idle branch; the id is also clamped).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ._compat import pltr, triton_params
from .launch import ANY, pow2_ceil

__all__ = ["MAX_ROWS", "PROLOGUE_ENV", "default_config", "expert_gemv", "expert_gemv_partials", "expert_gemv_reference"]

MAX_ROWS = 64  # every live program holds all rows' tile ([bm, bk] and a [bm, bn] fp32 accumulator)
# Programs to aim for when choosing k_splits (about one per SM).  Measured inside a step-like chain
# of 40 calls (bench_moe --only chain, H100, 2026-12-05): at one token the six projections of
# gpt-oss-20b, Qwen3.5-35B-A3B and Nemotron-3-Nano ran as fast or faster without a K split
# (-7 to -11% for Qwen's down and both of Nemotron's) than at the 512 programs aimed for before.
TARGET_PROGRAMS = 128
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# $UMEM_JAX_EXPERT_PROLOGUE=1: models/experts.py runs the experts' activation as the down GEMV's
# prologue (off by default: see experts.FUSED_ACTIVATION).  Read at trace time (runner.TRACE_ENV).
PROLOGUE_ENV = "UMEM_JAX_EXPERT_PROLOGUE"


def expert_gemv_reference(x: jax.Array, ids: jax.Array, w: jax.Array, bias: jax.Array | None = None, *,
                          repeat: int = 1, shared: jax.Array | None = None, shared_axis: int = 0,
                          prologue=None, gated: bool = False, out_dtype=jnp.float32) -> jax.Array:
    """The definition, row by row in fp32: x[r // repeat] @ w[ids[r]] (+ bias[ids[r]]), with
    shared [m, K, N] (shared_axis 0) or [K, m, N] (1) ids E.. name shared's matrix ids[r] - E (no
    bias); zeros where ids[r] is outside [0, E + m).  With a prologue x is first prologue(gate,
    up) (gated: x = [gate | up]) rounded to w's dtype.  Gathers a [R, K, N] copy of the weights: small shapes only."""
    if prologue is not None:
        K = w.shape[1]
        x = prologue(x[:, :K].astype(jnp.float32), x[:, K:].astype(jnp.float32) if gated else None).astype(w.dtype)
    x = jnp.repeat(x, repeat, axis=0)
    if shared is not None:
        shared = jnp.moveaxis(shared, shared_axis, 0)
        if bias is not None:
            bias = jnp.concatenate([bias, jnp.zeros((shared.shape[0], bias.shape[1]), bias.dtype)])
        w = jnp.concatenate([w, shared.astype(w.dtype)])
    E = w.shape[0]
    valid = (ids >= 0) & (ids < E)
    safe = jnp.clip(ids, 0, E - 1)
    wr = jnp.take(w, safe, axis=0).astype(jnp.float32)
    y = jnp.einsum("rk,rkn->rn", x.astype(jnp.float32), wr, precision=lax.Precision.HIGHEST)
    if bias is not None:
        y = y + jnp.take(bias, safe, axis=0).astype(jnp.float32)
    return jnp.where(valid[:, None], y, 0.0).astype(out_dtype)


def _and(*masks):
    """The conjunction of the masks that are not None (None: nothing to mask)."""
    out = None
    for m in masks:
        if m is not None:
            out = m if out is None else out & m
    return out


def _load(ref, mask, **kw):
    """pltr.load with `other=0` only where there is a mask (Triton refuses `other` without one)."""
    return pltr.load(ref, **({} if mask is None else {"mask": mask, "other": 0}), **kw)


def _kernel(ids_ref, x_ref, w_ref, *refs, R, K, N, E, M, shared_axis, bm, bn, bk, chunks, repeat, has_bias, mask_k,
            mask_n, prologue, gated):
    refs = list(refs)
    s_ref = refs.pop(0) if M else None
    b_ref = refs.pop(0) if has_bias else None
    o_ref, = refs
    u, nb, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = jnp.arange(bm, dtype=jnp.int32)
    ids = pltr.load(ids_ref.at[rows], mask=rows < R, other=-1) if bm > R else pltr.load(ids_ref.at[rows])
    e = ids_ref[u]
    routed = (e >= 0) & (e < E)
    valid = (e >= 0) & (e < E + M)
    # The slot leads its expert when no earlier row names it (rows past R hold -1).
    earlier = jnp.sum(((ids == e) & (rows < u)).astype(jnp.int32))
    group = (ids == e) & (rows < R)  # the rows this slot computes
    x_rows = rows // repeat if repeat > 1 else rows  # the x row each output row reads
    cols = nb * bn + jnp.arange(bn, dtype=jnp.int32)
    col_ok = cols < N if mask_n else None

    precision = lax.Precision.HIGHEST if w_ref.dtype == jnp.float32 else None  # fp32: IEEE, not TF32

    def product(ref, idx, bias_ref, axis=0):
        """The group's rows times matrix idx of ref (on its axis 0, or 1: [K, m, N]) (+ bias_ref[idx]
        by split 0), stored."""
        def body(i, acc):
            ks = (s * chunks + i) * bk + jnp.arange(bk, dtype=jnp.int32)
            k_ok = ks < K if mask_k else None
            a_mask = _and(group[:, None], None if k_ok is None else k_ok[None, :])
            a = _load(x_ref.at[x_rows[:, None], ks[None, :]], a_mask)
            if prologue is not None:  # x is the previous projection's fp32 output: activate it here
                up = _load(x_ref.at[x_rows[:, None], K + ks[None, :]], a_mask) if gated else None
                a = prologue(a, up).astype(ref.dtype)
            # The weights are streamed once: evict them first so x and the ids stay in L2.
            at = ref.at[ks[:, None], idx, cols[None, :]] if axis else ref.at[idx, ks[:, None], cols[None, :]]
            b = _load(at,
                      _and(None if k_ok is None else k_ok[:, None], None if col_ok is None else col_ok[None, :]),
                      eviction_policy="evict_first")
            return acc + jnp.dot(a, b, preferred_element_type=jnp.float32, precision=precision)

        acc = lax.fori_loop(0, chunks, body, jnp.zeros((bm, bn), jnp.float32))
        if bias_ref is not None:
            bias = _load(bias_ref.at[idx, cols], col_ok).astype(jnp.float32)
            acc = acc + jnp.where(s == 0, bias, 0.0)[None, :]
        pltr.store(o_ref.at[s, rows[:, None], cols[None, :]], acc,
                   mask=_and(group[:, None], None if col_ok is None else col_ok[None, :]))

    @pl.when(routed & (earlier == 0))
    def _routed():
        # already in range here; the clamp keeps any hoisted address legal
        product(w_ref, jnp.clip(e, 0, E - 1), b_ref)

    if M:
        @pl.when(valid & ~routed & (earlier == 0))
        def _shared():
            product(s_ref, jnp.clip(e - E, 0, M - 1), None, shared_axis)

    @pl.when(~valid)
    def _padding():
        pltr.store(o_ref.at[s, u, cols], jnp.zeros((bn,), jnp.float32), mask=col_ok)


def default_config(rows: int, K: int, N: int, dtype) -> dict:
    """Block sizes and K splits (bench_moe.py --only chain times the alternatives; RESULTS.md).
    64-column blocks keep each weight row segment a 128-byte line in bf16 and give many programs;
    splits are added (powers of two, each keeping >= 2 K chunks) until `rows` live slots (the
    distinct experts of one decode token) times the column blocks reach TARGET_PROGRAMS."""
    bk = 128 if jnp.dtype(dtype).itemsize <= 2 else 64
    bn = 64
    tiles = pl.cdiv(N, bn)
    nk = pl.cdiv(K, bk)
    s = 1
    while rows * tiles * s < TARGET_PROGRAMS and s < 16 and pl.cdiv(nk, 2 * s) >= 2:
        s *= 2
    return {"block_n": bn, "block_k": bk, "k_splits": s, "num_warps": 4, "num_stages": 4}


def _check(x, ids, w, bias, repeat, shared=None, gated=False, shared_axis=0):
    R, K = x.shape[0] * repeat, x.shape[1] // (2 if gated else 1)
    E, K2, N = w.shape
    if K2 != K or (gated and x.shape[1] != 2 * K):
        raise ValueError(f"expert_gemv: x has K={x.shape[1]} columns{' (gate | up)' if gated else ''}, "
                         f"w has K={K2} rows")
    if ids.shape != (R,) or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"expert_gemv: ids must be int [{R}] (x's rows * repeat), "
                         f"got {ids.dtype}{list(ids.shape)}")
    if repeat < 1:
        raise ValueError(f"expert_gemv: repeat={repeat} must be >= 1")
    if not 1 <= R <= MAX_ROWS:
        raise ValueError(f"expert_gemv: R={R} rows; the few-rows kernel takes 1..{MAX_ROWS} (use grouped_matmul)")
    if w.dtype not in DTYPES:
        raise ValueError(f"expert_gemv: weights of {w.dtype}; supported: bf16, f16, f32")
    if bias is not None and bias.shape != (E, N):
        raise ValueError(f"expert_gemv: bias must be [{E}, {N}], got {list(bias.shape)}")
    if shared is not None:
        want = ("m", K, N) if shared_axis == 0 else (K, "m", N)
        got = tuple("m" if i == shared_axis else n for i, n in enumerate(shared.shape))
        if shared_axis not in (0, 1) or shared.ndim != 3 or got != want or shared.dtype != w.dtype:
            raise ValueError(f"expert_gemv: shared must be [{', '.join(map(str, want))}] {w.dtype} (shared_axis "
                             f"{shared_axis}), got {shared.dtype}{list(shared.shape)}")


@functools.partial(jax.jit, static_argnames=("repeat", "shared_axis", "prologue", "gated", "block_n", "block_k",
                                             "k_splits", "num_warps", "num_stages", "interpret"))
def expert_gemv_partials(x: jax.Array, ids: jax.Array, w: jax.Array, bias: jax.Array | None = None, *,
                         repeat: int = 1, shared: jax.Array | None = None, shared_axis: int = 0, prologue=None,
                         gated: bool = False,
                         block_n: int | None = None, block_k: int | None = None, k_splits: int | None = None,
                         num_warps: int | None = None, num_stages: int | None = None,
                         interpret: bool = False) -> jax.Array:
    """The kernel's raw output: fp32 partial sums [k_splits, R, N] (their sum over axis 0 is
    expert_gemv's result).  x is cast to w's dtype (the dot takes one input type), or with a
    prologue kept as it is (see expert_gemv)."""
    _check(x, ids, w, bias, repeat, shared, gated and prologue is not None, shared_axis)
    R, K = ids.shape[0], w.shape[1]
    E, _, N = w.shape
    cfg = default_config(R, K, N, w.dtype)
    given = {"block_n": block_n, "block_k": block_k, "k_splits": k_splits, "num_warps": num_warps,
             "num_stages": num_stages}
    cfg.update({k: v for k, v in given.items() if v is not None})
    bn, bk, S = cfg["block_n"], cfg["block_k"], cfg["k_splits"]
    if bn < 16 or bk < 16 or bn & (bn - 1) or bk & (bk - 1) or S < 1:
        raise ValueError(f"expert_gemv: block_n={bn}, block_k={bk} must be powers of two >= 16, k_splits >= 1")
    chunks = pl.cdiv(pl.cdiv(K, bk), S)  # K chunks per split; a split past K loads nothing
    kernel = functools.partial(
        _kernel, R=R, K=K, N=N, E=E, M=0 if shared is None else shared.shape[shared_axis], shared_axis=shared_axis,
        bm=max(16, pow2_ceil(R)), bn=bn,
        bk=bk, chunks=chunks, repeat=repeat, has_bias=bias is not None, mask_k=chunks * S * bk != K,
        mask_n=N % bn != 0, prologue=prologue, gated=bool(gated and prologue is not None))
    x = x if prologue is not None else x.astype(w.dtype)
    operands = [ids.astype(jnp.int32), x, w] + [a for a in (shared, bias) if a is not None]
    return pl.pallas_call(
        kernel,
        grid=(R, pl.cdiv(N, bn), S),
        in_specs=[ANY] * len(operands),
        out_specs=ANY,
        out_shape=jax.ShapeDtypeStruct((S, R, N), jnp.float32),
        compiler_params=triton_params(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
        interpret=interpret,
        name="umem_expert_gemv",
    )(*operands)


def expert_gemv(x: jax.Array, ids: jax.Array, w: jax.Array, bias: jax.Array | None = None, *, repeat: int = 1,
                shared: jax.Array | None = None, shared_axis: int = 0, prologue=None, gated: bool = False,
                out_dtype=jnp.float32, interpret: bool = False, **tuning) -> jax.Array:
    """x [R / repeat, K] (row r reads x[r // repeat]), ids [R] int (E.. name shared's matrices,
    shared [m, K, N], or [K, m, N] with shared_axis=1: a layout whose [K, m * N] view is one dense
    matrix; outside [0, E + m): a padding row, zeros out), w [E, K, N], bias [E, N] or None
    -> [R, N] in out_dtype (default fp32), fp32 accumulation.

    prologue: the activation between an MLP's two projections, done as x is loaded, so the first
    projection's fp32 output needs no launch of its own: x [R / repeat, 2K] (gated: gate | up)
    or [R / repeat, K] -> prologue(gate [bm, bk] fp32, up or None) rounded to w's dtype.  A
    function object that stays the same between traces (it keys the kernel's compile).
    `tuning`: block_n, block_k, k_splits, num_warps, num_stages (defaults: default_config).  Not
    jitted itself, so the sum over the K splits fuses into the caller's next op under the caller's jit."""
    parts = expert_gemv_partials(x, ids, w, bias, repeat=repeat, shared=shared, shared_axis=shared_axis,
                                 prologue=prologue, gated=gated, interpret=interpret, **tuning)
    y = parts[0] if parts.shape[0] == 1 else parts.sum(0)
    return y.astype(out_dtype)
