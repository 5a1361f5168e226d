"""An MoE router's top-k in one kernel: scores, the k experts each token picks, and their weights.

    weights, experts = route_topk(logits, k=k, scoring=..., correction_bias=..., norm_topk_prob=..., scale=...)
    logits [N, E] fp32 (the router's x W^T), correction_bias [E] fp32 | None
        -> weights [N, k] fp32, experts [N, k] int32, best first
    logit_bias [E] (any float dtype): the router's own bias, added to the logits as they are
        loaded (an XLA add before the kernel was one more launch an MoE layer: gpt-oss)

    scoring "softmax":      s = softmax(logits)   pick top-k of s (+ correction_bias),  w = s[picked]
    scoring "sigmoid":      s = sigmoid(logits)   pick top-k of s (+ correction_bias),  w = s[picked]
    scoring "topk_softmax": pick top-k of logits,                w = softmax(logits[picked])  (gpt-oss)
    norm_topk_prob: w /= sum(w) (+ 1e-20 for sigmoid);   then w *= scale (routed_scaling_factor)

    shared=m: m more slots after the k picks name the shared experts' pseudo-ids E .. E+m-1 (an MoE
    whose shared expert runs in the expert GEMV, models/moe.py), each weighted 1, or with
    shared_gate sigmoid(logits[:, E]): the router's matmul then carries the shared expert's gate
    as one more column, which the pick never sees -> weights, experts [N, k + m]
    valid [N] bool: a row that is not valid (a padding token) gets ids -1 and weights 0 in every slot

Ties go to the lower expert id, as `jax.lax.top_k` breaks them.  Grouped selection (DeepSeek's
n_group / topk_group) is not here: models/moe.py masks the groups first and calls the reference.

Why a kernel: at one decode token XLA spends five launches on this (the softmax, a sort of E
values by one 64-thread block, a copy and two selects, ~8.5 us a layer on the H200 inside a
CUDA graph; benchmarks/RESULTS.md, session 18 traces), 0.26 ms of a 40-layer MoE model's
3.1 ms step.  Here one program holds a row (a decode batch: one program a token) or a block of
rows (a prefill) with all E scores in registers and takes the maximum k times, so the whole
router after its matmul is one launch (1.6-2.8 us a layer on an H100 for gpt-oss's 32 experts
to Qwen3.5-MoE's 256).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._compat import pltr, triton_params
from .launch import ANY, kernel_or_xla, pow2_ceil, pow2_floor

__all__ = ["MAX_EXPERTS", "ROUTE_ENV", "ROUTER_DOT_ENV", "SCORINGS", "route_backend", "route_topk",
           "route_topk_reference",
           "rows_per_program", "scores_of", "choice_of", "topk_weights", "with_shared"]

SCORINGS = ("softmax", "sigmoid", "topk_softmax")
BLOCK_ROWS = 16  # rows a program takes at most: [16, E] fp32 scores stay in registers up to E = 512 (8 warps)
# Programs to aim for before rows share one (about one per SM).  A row is an independent k-pass
# over its E scores, so a decode batch spreads one row a program: 16 rows a program left a B = 64
# step 4 programs, 22 us a Qwen3.5-MoE layer on the H200 (session 22 trace), where one row takes
# ~2-3 us.  Prefill batches still take 16 rows a program.
TARGET_PROGRAMS = 128
MAX_EXPERTS = 1024  # a row's scores live in registers; past this the router stays in XLA (moe.route)

# $UMEM_JAX_ROUTE: "pallas" (this kernel), "xla" (route_topk_reference), unset or "auto": the kernel
# on a GPU, XLA elsewhere (where the kernel would only be interpreted).  Read at trace time; the
# runner keys its steps on it (runner.TRACE_ENV).
ROUTE_ENV = "UMEM_JAX_ROUTE"
# $UMEM_JAX_ROUTER_DOT=reduce: models/router.py computes a decode batch's router logits as one XLA
# reduction instead of a GEMM (XLA's GEMM split K and padded both operands for it: four launches
# around the product); unset or "dot": the GEMM.  Being measured.  Read at trace time.
ROUTER_DOT_ENV = "UMEM_JAX_ROUTER_DOT"


def route_backend() -> str:
    """"pallas" or "xla": what a model's router runs now ($UMEM_JAX_ROUTE, else by backend)."""
    return kernel_or_xla(ROUTE_ENV)


def _check_scoring(scoring: str):
    if scoring not in SCORINGS:
        raise ValueError(f"route_topk: scoring {scoring!r}; known: {', '.join(SCORINGS)}")


def scores_of(logits: jax.Array, scoring: str) -> jax.Array:
    """[..., E] fp32 logits -> the scores the experts are picked by and weighted with (the logits
    themselves for topk_softmax)."""
    if scoring == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    return jax.nn.sigmoid(logits) if scoring == "sigmoid" else logits


def topk_weights(logits: jax.Array, experts: jax.Array, *, scoring: str, norm_topk_prob: bool,
                 scale: float) -> jax.Array:
    """The weights of the experts chosen: logits [..., E], experts [..., k] -> [..., k] fp32."""
    _check_scoring(scoring)
    logits = logits.astype(jnp.float32)
    if scoring == "topk_softmax":  # softmax over the k chosen logits alone
        return jax.nn.softmax(jnp.take_along_axis(logits, experts, axis=-1), axis=-1) * scale
    w = jnp.take_along_axis(scores_of(logits, scoring), experts, axis=-1)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + (1e-20 if scoring == "sigmoid" else 0.0))
    return w * scale


def with_shared(weights: jax.Array, experts: jax.Array, logits: jax.Array, *, num_experts: int, shared: int,
                shared_gate: bool) -> tuple[jax.Array, jax.Array]:
    """The routed choice [..., k] followed by the `shared` pseudo-experts' slots (ids E .., weight
    1 or sigmoid(logits[..., E]) with shared_gate) -> [..., k + shared]."""
    if not shared:
        return weights, experts
    lead = experts.shape[:-1]
    ids = jnp.broadcast_to(num_experts + jnp.arange(shared, dtype=jnp.int32), (*lead, shared))
    g = (jax.nn.sigmoid(logits[..., num_experts:num_experts + 1].astype(jnp.float32)) if shared_gate
         else jnp.ones((*lead, 1), jnp.float32))
    return (jnp.concatenate([weights, jnp.broadcast_to(g, (*lead, shared))], axis=-1),
            jnp.concatenate([experts, ids], axis=-1))


def _split_gate(logits: jax.Array, shared: int, shared_gate: bool) -> int:
    """The routed experts' count E of logits [..., E (+ 1 gate column)], checked."""
    if shared < 0 or (shared_gate and not shared):
        raise ValueError(f"route_topk: shared={shared} slots, shared_gate={shared_gate}: a gate needs slots")
    return logits.shape[-1] - int(bool(shared_gate))


def route_topk_reference(logits: jax.Array, *, k: int, scoring: str, correction_bias: jax.Array | None = None,
                         norm_topk_prob: bool = False, scale: float = 1.0, shared: int = 0,
                         shared_gate: bool = False, valid: jax.Array | None = None,
                         logit_bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The definition in XLA ops (jax.lax.top_k): logits [..., E] (with shared_gate [..., E + 1];
    logit_bias [E (+ 1)] added first) -> (weights [..., k + shared] fp32, experts [..., k + shared]
    int32)."""
    _check_scoring(scoring)
    E = _split_gate(logits, shared, shared_gate)
    full = logits.astype(jnp.float32)
    if logit_bias is not None:
        full = full + logit_bias.astype(jnp.float32)
    logits = full[..., :E]
    choice = scores_of(logits, scoring)
    if correction_bias is not None and scoring != "topk_softmax":
        choice = choice + correction_bias.astype(jnp.float32)
    experts = jax.lax.top_k(choice, k)[1].astype(jnp.int32)
    return choice_of(full, experts, scoring=scoring, norm_topk_prob=norm_topk_prob, scale=scale, shared=shared,
                     shared_gate=shared_gate, valid=valid)


def choice_of(logits: jax.Array, experts: jax.Array, *, scoring: str, norm_topk_prob: bool, scale: float,
              shared: int = 0, shared_gate: bool = False, valid: jax.Array | None = None):
    """The choice as route_topk gives it, for experts [..., k] picked from logits [..., E] (with
    shared_gate [..., E + 1]) by any rule: their weights (topk_weights), the shared slots
    (with_shared), then the padding tokens (not `valid` [...]) naming no expert (id -1, weight 0)."""
    E = _split_gate(logits, shared, shared_gate)
    weights = topk_weights(logits[..., :E], experts, scoring=scoring, norm_topk_prob=norm_topk_prob, scale=scale)
    weights, experts = with_shared(weights, experts, logits, num_experts=E, shared=shared, shared_gate=shared_gate)
    if valid is None:
        return weights, experts
    return jnp.where(valid[..., None], weights, 0.0), jnp.where(valid[..., None], experts, -1)


def _kernel(logits_ref, *refs, N, E, k, bn, ep, kp, scoring, norm, scale, has_bias, has_logit_bias, shared, gate,
            has_valid):
    refs = list(refs)
    logit_bias_ref = refs.pop(0) if has_logit_bias else None
    bias_ref = refs.pop(0) if has_bias else None
    valid_ref = refs.pop(0) if has_valid else None
    w_ref, e_ref = refs
    rows = pl.program_id(0) * bn + jnp.arange(bn, dtype=jnp.int32)
    cols = jnp.arange(ep, dtype=jnp.int32)
    row_ok, col_ok = rows < N, cols < E
    mask = row_ok[:, None] & col_ok[None, :]
    neg = jnp.float32(-jnp.inf)
    # Padding columns read -inf and padding rows 0: every row has a finite maximum, so no NaN is
    # formed (a row of -inf would make softmax 0/0); padding rows are never stored.
    x = pltr.load(logits_ref.at[rows[:, None], cols[None, :]], mask=mask, other=0.0)
    if has_logit_bias:
        x = x + pltr.load(logit_bias_ref.at[cols], mask=col_ok, other=0.0).astype(jnp.float32)[None, :]
    x = jnp.where(col_ok[None, :], x, neg)
    if scoring == "softmax":
        p = jnp.exp(x - jnp.max(x, axis=1, keepdims=True))
        s = p / jnp.sum(p, axis=1, keepdims=True)
    elif scoring == "sigmoid":
        s = 1.0 / (1.0 + jnp.exp(-x))  # padding columns: 1 / inf = 0
    else:
        s = x
    choice = s
    if has_bias:
        choice = choice + pltr.load(bias_ref.at[cols], mask=col_ok, other=0.0)[None, :]
    choice = jnp.where(col_ok[None, :], choice, neg)
    kcols = jnp.arange(kp, dtype=jnp.int32)
    w = jnp.zeros((bn, kp), jnp.float32)
    ids = jnp.zeros((bn, kp), jnp.int32)
    for j in range(k):  # k is small (4-10): unrolled, two row reductions each (three with a bias)
        best = jnp.max(choice, axis=1, keepdims=True)
        idx = jnp.min(jnp.where(choice == best, cols[None, :], ep), axis=1, keepdims=True)  # lowest id of a tie
        idx = jnp.minimum(idx, E - 1)  # a NaN row matches nothing: keep the id an expert's
        picked = cols[None, :] == idx
        # Without a correction bias the choice is the score itself: the maximum is the value.
        val = jnp.sum(jnp.where(picked, s, 0.0), axis=1, keepdims=True) if has_bias else best
        choice = jnp.where(picked, neg, choice)
        w = jnp.where(kcols[None, :] == j, val, w)
        ids = jnp.where(kcols[None, :] == j, idx, ids)
    live = kcols[None, :] < k
    if scoring == "topk_softmax":  # the first pick holds the largest logit
        first = jnp.sum(jnp.where(kcols[None, :] == 0, w, 0.0), axis=1, keepdims=True)
        w = jnp.where(live, jnp.exp(w - first), 0.0)
        w = w / jnp.sum(w, axis=1, keepdims=True)
    elif norm:
        w = w / (jnp.sum(jnp.where(live, w, 0.0), axis=1, keepdims=True) + (1e-20 if scoring == "sigmoid" else 0.0))
    w = w * scale
    if shared:  # the shared experts' slots k .. k+shared-1: pseudo-ids E.., weight 1 or the gate's sigmoid
        slot = (kcols >= k)[None, :]
        g = jnp.ones((bn,), jnp.float32)
        if gate:  # the gate's logit is the column after the experts' (never part of the pick above)
            gl = pltr.load(logits_ref.at[rows, E], mask=row_ok, other=0.0)
            if has_logit_bias:
                gl = gl + logit_bias_ref[E].astype(jnp.float32)
            g = 1.0 / (1.0 + jnp.exp(-gl))
        w = jnp.where(slot, g[:, None], w)
        ids = jnp.where(slot, E + kcols[None, :] - k, ids)
    if has_valid:  # a padding token names no expert (id -1, weight 0): its rows are never read
        ok = pltr.load(valid_ref.at[rows], mask=row_ok, other=0) != 0
        w = jnp.where(ok[:, None], w, 0.0)
        ids = jnp.where(ok[:, None], ids, -1)
    out_mask = row_ok[:, None] & (kcols < k + shared)[None, :]
    pltr.store(w_ref.at[rows[:, None], kcols[None, :]], w, mask=out_mask)
    pltr.store(e_ref.at[rows[:, None], kcols[None, :]], ids, mask=out_mask)


def _warps(elements: int) -> int:
    """One warp up to 1,024 scores (a decode token's row): its 2k + 2 row reductions are then warp
    shuffles with no shared-memory barrier (4 warps took 3.5 us a Qwen3.5-MoE layer on an H100)."""
    return 1 if elements <= 1024 else 4 if elements <= 4096 else 8


def rows_per_program(n: int) -> int:
    """Rows a program takes for n rows: one while n rows give at most TARGET_PROGRAMS programs,
    then more (powers of two) up to BLOCK_ROWS."""
    return min(BLOCK_ROWS, pow2_floor(max(n // TARGET_PROGRAMS, 1)))


@functools.partial(jax.jit, static_argnames=("k", "scoring", "norm_topk_prob", "scale", "shared", "shared_gate",
                                             "bn", "interpret"))
def _route_topk_2d(logits, logit_bias, correction_bias, valid, *, k, scoring, norm_topk_prob, scale, shared,
                   shared_gate, bn, interpret):
    N, W = logits.shape
    E = W - int(shared_gate)
    ep = max(16, pow2_ceil(E))
    kernel = functools.partial(_kernel, N=N, E=E, k=k, bn=bn, ep=ep, kp=max(2, pow2_ceil(k + shared)),
                               scoring=scoring, norm=norm_topk_prob, scale=float(scale),
                               has_bias=correction_bias is not None, has_logit_bias=logit_bias is not None,
                               shared=shared, gate=shared_gate, has_valid=valid is not None)
    operands = [logits.astype(jnp.float32)]
    if logit_bias is not None:  # in its own dtype: converted as the kernel loads it, not by an XLA op
        operands.append(logit_bias)
    if correction_bias is not None:
        operands.append(correction_bias.astype(jnp.float32))
    if valid is not None:
        operands.append(valid.astype(jnp.int32))
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(N, bn),),
        in_specs=[ANY] * len(operands),
        out_specs=(ANY, ANY),
        out_shape=(jax.ShapeDtypeStruct((N, k + shared), jnp.float32),
                   jax.ShapeDtypeStruct((N, k + shared), jnp.int32)),
        compiler_params=triton_params(num_warps=_warps(bn * ep), num_stages=1),
        interpret=interpret,
        name="umem_route_topk",
    )(*operands)


def route_topk(logits: jax.Array, *, k: int, scoring: str, correction_bias: jax.Array | None = None,
               norm_topk_prob: bool = False, scale: float = 1.0, shared: int = 0, shared_gate: bool = False,
               valid: jax.Array | None = None, logit_bias: jax.Array | None = None, block_rows: int | None = None,
               interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """The Pallas kernel: logits [..., E] (with shared_gate [..., E + 1]; any leading dims, fp32 or
    castable) -> (weights [..., k + shared] fp32, experts [..., k + shared] int32), as
    route_topk_reference gives them.  logit_bias [E (+ 1)]: added to the logits (the gate's column
    too) before anything else.  block_rows: rows a program takes, a power of two <= BLOCK_ROWS
    (default: `rows_per_program(rows)`)."""
    _check_scoring(scoring)
    *lead, W = logits.shape
    E = _split_gate(logits, shared, shared_gate)
    if not 1 <= k <= E:
        raise ValueError(f"route_topk: k={k} must be in [1, E={E}]")
    if E > MAX_EXPERTS:
        raise ValueError(f"route_topk: {E} experts; the kernel holds a row's scores in registers "
                         f"(E <= {MAX_EXPERTS}): use route_topk_reference")
    if logit_bias is not None and logit_bias.shape != (W,):
        raise ValueError(f"route_topk: logit_bias must be [{W}] (the logits' width), got {list(logit_bias.shape)}")
    if correction_bias is not None and correction_bias.shape != (E,):
        raise ValueError(f"route_topk: correction_bias must be [{E}], got {list(correction_bias.shape)}")
    if scoring == "topk_softmax":
        correction_bias = None  # selection on raw logits (gpt-oss has no correction bias)
    n = 1
    for d in lead:
        n *= d
    out = k + shared
    if n == 0:
        return jnp.zeros((*lead, out), jnp.float32), jnp.zeros((*lead, out), jnp.int32)
    bn = rows_per_program(n) if block_rows is None else int(block_rows)
    if bn < 1 or bn & (bn - 1) or bn > BLOCK_ROWS:
        raise ValueError(f"route_topk: block_rows={bn} must be a power of two in [1, {BLOCK_ROWS}]")
    if valid is not None and valid.shape != tuple(lead):
        raise ValueError(f"route_topk: valid must be {list(lead)} (the logits' leading dims), got {list(valid.shape)}")
    w, ids = _route_topk_2d(logits.reshape(n, W), logit_bias, correction_bias,
                            None if valid is None else valid.reshape(n),
                            k=k, scoring=scoring,
                            norm_topk_prob=bool(norm_topk_prob), scale=float(scale), shared=int(shared),
                            shared_gate=bool(shared_gate), bn=bn, interpret=interpret)
    return w.reshape(*lead, out), ids.reshape(*lead, out)
