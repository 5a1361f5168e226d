"""An MoE block's routed experts: E stacked expert MLPs and the dispatch of each token's k choices.

    y = Experts(x, weights, experts, valid)    x [N, d], weights / experts [N, k] -> [N, d] fp32
    y_n = sum_j weights[n, j] * expert_{experts[n, j]}(x_n)

Expert weights are stacked leaves ([E, d, 2I] gate|up, [E, I, d] down; (in, out) layout, the
layout a grouped matmul takes), so a step has no per-expert Python loop and no shape that depends
on the routing.  The paths, by the number of (token, expert) rows:
  * few (a decode token): "rows", the Pallas expert GEMV (pallas_kernels/expert_gemv.py) reads
    each chosen expert's matrices once, in place; or "gather", each row's matrices gathered;
  * a decode batch on a GPU (up to dispatch_plan.MAX_ROWS): one launch of
    pallas_kernels/dispatch_plan.py orders the rows by expert, two grouped matmuls on its ranges;
  * more (a prefill): the rows sorted by expert, two grouped matmuls with the experts' row counts
    as group sizes (pallas_kernels/grouped_matmul.py on a GPU, jax.lax.ragged_dot elsewhere),
    each row weighted, un-sorted by the inverse permutation (a gather: deterministic), summed
    over k.  Padding rows get the sort key E: they fall outside every group and come back as zeros.
A fused MoE's shared expert joins the routed ones as pseudo-experts on the rows path and runs
dense elsewhere (moe.py).  Under tensor parallelism `reduce_axis` psums the partial sums, then
the down bias is added once; under expert parallelism each device computes its own experts' rows.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from flax import nnx

from ..pallas_kernels import dispatch_plan as plan
from ..pallas_kernels.expert_gemv import PROLOGUE_ENV, expert_gemv
from ..pallas_kernels.grouped_matmul import grouped_matmul
from ..parallel.collectives import reduce_sum
from .layers import fp32_precision, normal_init
from .moe_config import MoEConfig, activation_of, expert_activation

# Up to this many (token, expert) rows the dispatch gathers each row's expert weights instead of
# sorting and running the grouped matmul.  Measured on the H200 (benchmarks/bench_moe.py,
# 2026-12-03): at one decode token the gather was fastest (gpt-oss-20b 211 us vs 378 us Pallas;
# Qwen3.5-35B-A3B-like 104 us vs 561 us), at 64 tokens the slowest (8.2 ms / 0.93 ms vs 0.54 /
# 0.61 ms): it copies every row's expert matrices, so it only pays for a handful of rows.
GATHER_ROWS = 8
# The few-rows path: "gather" (above), "rows" (the Pallas expert GEMV of
# pallas_kernels/expert_gemv.py: each chosen expert's matrices read once, in place, on a grid wide
# enough to keep HBM busy; interpreted off the GPU), or None: "rows" on a GPU, "gather" elsewhere.
# Measured on the H200 (bench_moe --only decode, 2026-12-04, whole MoE block): up to 16 rows the
# kernel was fastest at every row count, gpt-oss-20b 97 / 100 / 162 us at 1 / 2 / 4 tokens (gather
# 190 / 298 / 563, the Pallas grouped matmul 112 / 124 / 190), Qwen3.5-35B-A3B-like 93 / 74 us at
# 1 / 2 tokens (gather 93 / 87, grouped 123 / 227); at 32 rows it was 3-4x slower than both
# (403 us vs 122 / 101), hence ROWS_MAX.
FEW_ROWS_PATH = None
# With FEW_ROWS_PATH = "rows": the rows path serves up to this many (token, expert) rows (the kernel
# takes up to expert_gemv.MAX_ROWS; it reads only the distinct experts, gather copies every row's).
ROWS_MAX = 16
# The grouped matmul of the sorted path: "pallas" (the Triton grouped GEMM of
# pallas_kernels/grouped_matmul.py) or "ragged" (jax.lax.ragged_dot); None: pallas on a GPU,
# ragged elsewhere.  On the H200 with jax 0.11.2, ragged_dot lowers to a dense matmul over all
# experts (24 TFLOP/s at gpt-oss-20b prefill shapes, 3 at Qwen3.5-35B-A3B-like, out of memory at
# 16384 tokens) where the Pallas kernel ran 390-555 and 157-445 TFLOP/s.
GROUPED_PATH = None
# The rows path's down GEMV may apply the experts' activation as it loads the gate_up output
# (expert_gemv's prologue) instead of a launch between the two: True / False, or None:
# $UMEM_JAX_EXPERT_PROLOGUE ("1" on; unset or "0" off; read at trace time).  Off: on an H100
# (2026-12-06) it made Qwen3.5-MoE's down GEMV 2x slower (0.78 vs 0.38 ms a B = 1 step: +12%
# on the step) and Nemotron's no faster, against the one launch it saves a layer.
FUSED_ACTIVATION = None

def grouped_path() -> str:
    """GROUPED_PATH, or its default for this backend."""
    if GROUPED_PATH is not None:
        return GROUPED_PATH
    return "pallas" if jax.default_backend() == "gpu" else "ragged"


def few_rows_path(rows: int) -> str | None:
    """The dispatch path for `rows` (token, expert) rows when they are few ("rows" or "gather"),
    else None (the grouped path)."""
    few = FEW_ROWS_PATH or ("rows" if jax.default_backend() == "gpu" else "gather")
    if few not in ("gather", "rows"):
        raise ValueError(f"FEW_ROWS_PATH {FEW_ROWS_PATH!r}; known: gather, rows, None")
    if few == "rows" and rows <= ROWS_MAX:
        return "rows"
    return "gather" if rows <= GATHER_ROWS else None


def _grouped_matmul(x, w, *, group_sizes, impl):
    """x [R, K] sorted by group, w [G, K, N] -> [R, N] in x.dtype (fp32 accumulation)."""
    if impl == "ragged":
        return jax.lax.ragged_dot(x, w, group_sizes, precision=fp32_precision(x, w))
    return grouped_matmul(x, w, group_sizes, interpret=jax.default_backend() != "gpu")


class Experts(nnx.Module):
    """E stacked expert MLPs: gate_up_proj [E, d, 2I] (or up_proj [E, d, I]), down_proj [E, I, d],
    optional biases [E, 2I] / [E, d], E = cfg.local_experts.  reduce_axis: the tp axis when the
    routed sum is split over devices (sharding.py), by I (tensor parallelism) or, with
    expert_axis also set, by expert (expert parallelism: device r holds experts
    [r*E, (r+1)*E) whole and computes only the (token, expert) pairs routed to them)."""

    def __init__(self, hidden: int, cfg: MoEConfig, *, dtype, rngs: nnx.Rngs):
        e, i = cfg.local_experts, cfg.intermediate_size
        first = i if cfg.expert_kind == "ungated" else 2 * i
        name = "up_proj" if cfg.expert_kind == "ungated" else "gate_up_proj"
        setattr(self, name, nnx.Param(normal_init(rngs, (e, hidden, first), dtype)))
        self.down_proj = nnx.Param(normal_init(rngs, (e, i, hidden), dtype))
        if cfg.expert_bias:
            setattr(self, name + "_bias", nnx.Param(jnp.zeros((e, first), dtype)))
            self.down_proj_bias = nnx.Param(jnp.zeros((e, hidden), dtype))
        self.first_name = name
        self.cfg = cfg
        self.reduce_axis = None
        self.expert_axis = None

    @property
    def first(self) -> jax.Array:
        return getattr(self, self.first_name)[...]

    def first_bias(self):
        return getattr(self, self.first_name + "_bias")[...] if self.cfg.expert_bias else None

    def __call__(self, x: jax.Array, weights: jax.Array, experts: jax.Array, valid: jax.Array | None = None,
                 *, path: str | None = None, shared: tuple | None = None, masked: bool = False):
        """x [N, d], weights/experts [N, k] (with shared: [N, k + m], the router's shared slots
        last), valid [N] bool or None -> [N, d] fp32: the weighted sum of each token's k experts
        and the shared expert's m pseudo-experts; zeros for invalid rows.

        shared: (first [d, m, F], down [m, I, d]) (MoE.fuse_projections): on the "rows" path its
        rows join the routed ones in the expert GEMV (ids E..E+m-1); elsewhere it runs dense.
        path: "ragged" / "pallas" (sort, then ragged_dot / the Pallas grouped matmul; "pallas" up
        to dispatch_plan.MAX_ROWS rows orders them by dispatch_plan instead, unless
        $UMEM_JAX_MOE_PLAN=xla), "gather" (each row's expert weights gathered), "rows" (the Pallas expert GEMV: each chosen expert
        read once); None: few_rows_path(N*k), else GROUPED_PATH (Pallas interpreted off a GPU).
        masked: the router gave invalid tokens ids -1 (Router's valid): the rows path takes them so."""
        n = x.shape[0]
        k, e = self.cfg.top_k, self.cfg.local_experts
        m = experts.shape[1] - k
        if (m > 0) != (shared is not None):
            raise ValueError(f"MoE experts: {experts.shape[1]} slots for top_k={k}, "
                             f"shared experts: {shared is not None}")
        routed_w, routed = (weights[:, :k], experts[:, :k]) if m else (weights, experts)
        if self.expert_axis is not None:
            routed_w, routed = self._local_choice(routed_w, routed)
        joined = m and (path or few_rows_path(n * (k + m))) == "rows"
        if path is None:
            path = few_rows_path(n * k) or grouped_path()
        if joined:
            if self.expert_axis is not None:  # this device's experts, then the shared slots renumbered after them
                experts = jnp.concatenate([jnp.where(routed < e, routed, -1),
                                           experts[:, k:] - self.cfg.num_experts + e], 1)
                weights = jnp.concatenate([routed_w, weights[:, k:]], 1)
            out = self._rows(x, weights, experts, None if masked else valid, shared=shared)
        elif path == "gather":
            out = self._gathered(x, routed_w, routed)
        elif path == "rows":
            out = self._rows(x, routed_w, routed, None if masked else valid)
        elif path == "pallas" and n * k <= plan.MAX_ROWS and plan.plan_backend() == "pallas":
            out = self._planned(x, routed_w, routed, valid)  # a decode batch: ordered by dispatch_plan
        elif path in ("ragged", "pallas"):
            out = self._sorted(x, routed_w, routed, valid, path)
        else:
            raise ValueError(f"MoE dispatch path {path!r}; known: ragged, pallas, gather, rows")
        if m and not joined:
            out = out + self.shared_dense(x, weights[:, k:], shared)
        return self._finish(out, routed_w, routed, valid)

    def _sorted(self, x, weights, experts, valid, impl):
        """The grouped path: the rows sorted by expert, two grouped matmuls -> [N, d] fp32 before _finish."""
        n, k = experts.shape
        e = self.cfg.local_experts
        key = experts.reshape(-1)
        if valid is not None:
            key = jnp.where(jnp.repeat(valid, k), key, e)  # padding sorts past the last group
        order = jnp.argsort(key, stable=True)  # [R]: sorted row -> flat assignment
        sorted_experts = key[order]
        group_sizes = jnp.zeros((e + 1,), jnp.int32).at[key].add(1)[:e]
        matmul = functools.partial(_grouped_matmul, group_sizes=group_sizes, impl=impl)
        xs = jnp.take(x, order // k, axis=0)  # [R, d]
        h = matmul(xs, self.first).astype(jnp.float32)
        bias = self.first_bias()
        if bias is not None:
            h = h + jnp.take(bias, jnp.minimum(sorted_experts, e - 1), axis=0).astype(jnp.float32)
        a = expert_activation(h, self.cfg).astype(self.down_proj.dtype)
        y = matmul(a, self.down_proj[...]).astype(jnp.float32)  # [R, d]
        # rows past the groups (padding, other devices' experts) may hold anything: select, not scale
        y = jnp.where((sorted_experts < e)[:, None], y * jnp.take(weights.reshape(-1), order)[:, None], 0.0)
        inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
        return jnp.take(y, inverse, axis=0).reshape(n, k, -1).sum(1)

    def _planned(self, x, weights, experts, valid):
        """The grouped path at a decode batch: dispatch_plan orders the rows (no sort, scatter or
        tile metadata), the first grouped matmul gathers each sorted row's token as it loads it
        and adds the bias, an XLA fusion applies the activation (in the matmul's epilogue it cost
        more than it saved, RESULTS.md session 24), the second gives the padding tail zeros, and
        one gather by `pos` un-sorts, weights and sums over k -> [N, d] fp32."""
        n, k = experts.shape
        interpret = jax.default_backend() != "gpu"
        pos, token, first, end = plan.dispatch_plan(experts.reshape(-1).astype(jnp.int32), self.cfg.local_experts,
                                                    valid, repeat=k, interpret=interpret)
        matmul = functools.partial(grouped_matmul, plan=(first, end), interpret=interpret)
        h = matmul(x, self.first, token=token, bias=self.first_bias(), out_dtype=jnp.float32)
        a = expert_activation(h, self.cfg).astype(self.down_proj.dtype)
        y = matmul(a, self.down_proj[...], out_dtype=jnp.float32)  # [R, d]
        # a row past the groups (padding, another device's expert) is a zero of the padding tail;
        # an invalid token's weights may be anything, and _finish zeroes its sum
        return (jnp.take(y, pos, axis=0) * weights.reshape(-1)[:, None]).reshape(n, k, -1).sum(1)

    def _gathered(self, x, weights, experts):
        """The few-rows path: every (token, expert) row reads its expert's weights by a gather."""
        n, k = experts.shape
        ids = jnp.minimum(experts.reshape(-1), self.cfg.local_experts - 1)  # id E (another device's): weight 0
        xs = jnp.repeat(x, k, axis=0)  # [R, d]
        w1 = jnp.take(self.first, ids, axis=0)
        h = jnp.einsum("rd,rdf->rf", xs, w1, precision=fp32_precision(xs, w1), preferred_element_type=jnp.float32)
        bias = self.first_bias()
        if bias is not None:
            h = h + jnp.take(bias, ids, axis=0).astype(jnp.float32)
        a = expert_activation(h, self.cfg).astype(self.down_proj.dtype)
        w2 = jnp.take(self.down_proj[...], ids, axis=0)
        y = jnp.einsum("ri,rid->rd", a, w2, precision=fp32_precision(a, w2), preferred_element_type=jnp.float32)
        return (y * weights.reshape(-1)[:, None]).reshape(n, k, -1).sum(1)

    def _rows(self, x, weights, experts, valid, *, shared=None):
        """The Pallas few-rows path: both projections by expert_gemv, which reads each distinct
        chosen expert's matrix once (and with shared, the shared expert's pseudo-experts, ids
        E..) and gives padding rows (any other id) zeros without a read."""
        n, k = experts.shape
        ids = experts.reshape(-1)
        if valid is not None:
            ids = jnp.where(jnp.repeat(valid, k), ids, -1)
        first, down = (None, None) if shared is None else shared
        gemv = functools.partial(expert_gemv, interpret=jax.default_backend() != "gpu")
        h = gemv(x, ids, self.first, self.first_bias(), repeat=k, shared=first, shared_axis=1)  # [R, F]: token r // k
        fused = FUSED_ACTIVATION if FUSED_ACTIVATION is not None else os.environ.get(PROLOGUE_ENV, "0") == "1"
        if fused:  # the down GEMV activates h as it loads it: no launch between the two
            y = gemv(h, ids, self.down_proj[...], shared=down, prologue=activation_of(self.cfg),
                     gated=self.cfg.expert_kind != "ungated")
        else:
            y = gemv(expert_activation(h, self.cfg).astype(self.down_proj.dtype), ids, self.down_proj[...], shared=down)
        # [R, d] fp32; the down bias is added once, in _finish
        return (y * weights.reshape(-1)[:, None]).reshape(n, k, -1).sum(1)

    def shared_dense(self, x, weights, shared):
        """The shared expert from its pseudo-experts, every token through all m: x [N, d],
        weights [N, m] (its gate) -> [N, d] fp32, this device's partial sum (before _finish)."""
        first, down = shared
        # [d, m F] and [m I, d] are dense matrices (an [m, d, F] stack cost a weight transpose a
        # layer); the gate goes before the (linear) down projection: the sum over m is its contraction
        (d, m, f), n = first.shape, x.shape[0]
        w1 = first.reshape(d, m * f)
        # XLA's dot merger joins this product with the router's (the same x) into one dot over a
        # weight concatenated every step: at Qwen3.5-MoE's B = 64, 11 us a layer for the concatenate
        # (H200, session 22 trace).  A barrier on x keeps the two dots apart.
        x = jax.lax.optimization_barrier(x)
        h = jnp.dot(x, w1, precision=fp32_precision(x, w1), preferred_element_type=jnp.float32).reshape(n, m, f)
        a = (expert_activation(h, self.cfg) * weights[:, :, None]).astype(down.dtype).reshape(n, -1)
        w2 = down.reshape(-1, down.shape[-1])
        return jnp.dot(a, w2, precision=fp32_precision(a, w2), preferred_element_type=jnp.float32)

    def _local_choice(self, weights, experts):
        """Expert parallelism: the global choice [N, k] -> this device's (weights, ids), ids local
        in [0, E) for its own experts and E (weight 0) for the pairs another device computes."""
        e = self.cfg.local_experts
        local = experts - jax.lax.axis_index(self.expert_axis) * e
        mine = (local >= 0) & (local < e)
        return jnp.where(mine, weights, 0.0), jnp.where(mine, local, e)

    def _finish(self, out, weights, experts, valid):
        """psum the partial sums over the tp axis and add the down bias once: sum_j w_j b_{e_j}
        (after the psum when every device holds every expert's bias; before it under expert
        parallelism, where each device adds its own experts' and id E adds nothing)."""
        def bias(out):
            e = self.cfg.local_experts
            b = jnp.take(self.down_proj_bias[...], jnp.minimum(experts, e - 1), axis=0).astype(jnp.float32)
            w = jnp.where(experts < e, weights, 0.0)
            return out + jnp.einsum("nk,nkd->nd", w, b, precision=fp32_precision(w, b))  # b: [N, k, d]

        if self.cfg.expert_bias and self.expert_axis is not None:
            out = bias(out)
        out = reduce_sum(out, self.reduce_axis)
        if self.cfg.expert_bias and self.expert_axis is None:
            out = bias(out)
        return out if valid is None else jnp.where(valid[:, None], out, 0.0)


__all__ = ["FEW_ROWS_PATH", "FUSED_ACTIVATION", "GATHER_ROWS", "GROUPED_PATH", "ROWS_MAX", "Experts", "few_rows_path",
           "grouped_path"]
