"""The MoE block's grouped matmuls and decode dispatch against their ceilings, in one run.

  python3 -m benchmarks.bench_moe            # GPU: gpt-oss-20b and Qwen3.5-35B-A3B-like shapes
  python3 -m benchmarks.bench_moe --small    # CPU: tiny shapes, in seconds

prefill  the two grouped matmuls of models/experts.py (jax.lax.ragged_dot over tokens sorted by
         expert, random top-k routing) in TFLOP/s, against a dense bf16 matmul of the same rows
         and FLOPs ([R, d] @ [d, F]) in the same run (goal: ragged >= 0.6x dense), and the whole
         routed block (sort, gather, both matmuls, un-sort) for the total time
decode   Experts.__call__ at N tokens (1, 2, 4, 64) by each dispatch path ("ragged", "pallas",
         "gather", and "rows": the Pallas expert GEMV of pallas_kernels/expert_gemv.py, up to its
         MAX_ROWS rows): time against the bytes of the experts the tokens actually touch over the
         copy limit measured here (bound_us; of_bound = bound / time), rows also against gather
         (vs_gather = gather time / rows time); then the expert GEMV alone on each projection
         (decode_rows_gate_up / _down) under a few tunings, the fastest kept with its config
grouped  (--only grouped) the Pallas grouped matmul at a decode batch's rows (--grouped-tokens, default
         64 tokens x k), both projections of each family, under a grid of tile shapes, with the
         tokens routed uniformly and "skewed" (over a quarter of the experts, as a random-weight
         router concentrates them): time against the bytes of the experts touched over the copy
         limit.  Tiles of block_m rows read an expert's matrix once per tile, and every tile does
         block_m rows of MACs however few are live: the mode ranks block_m for a batch's rows.
chain    (--only chain) the expert GEMV as a model step runs it: --chain L calls in one jit, each
         on other experts of one large stack (no call finds its weights in L2), launched as one
         CUDA graph as XLA does for a decode step, per call = total / L, for a grid of tunings on
         each projection of each family's shape at --chain-tokens tokens (decode_chain_gate_up / _down).
         A call timed alone pays the launch and the host's dispatch (tens of us against the ~10 us
         a Qwen3.5-MoE projection takes inside the step), so only this mode can rank tunings.
Every timed function is first checked against moe_reference-style math on the same device.
The table comes last; with $OUT (or --json) set, the rows are also written as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from umem_jax.models.moe import Experts, MoEConfig, expert_activation
from umem_jax.pallas_kernels._compat import silence_triton_deprecation
from umem_jax.pallas_kernels.expert_gemv import (MAX_ROWS, default_config, expert_gemv, expert_gemv_partials,
                                                 expert_gemv_reference)
from umem_jax.pallas_kernels.grouped_matmul import grouped_matmul

from .report import RowLog, fmt, format_table, json_path
from .copy_limit import copy_limit
from .timing import time_calls


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    E: int
    k: int
    d: int
    I: int


GPT_OSS = Shape("gpt-oss-20b", 32, 4, 2880, 2880)
QWEN = Shape("qwen3.5-35b-a3b-like", 256, 8, 2048, 512)
NEMOTRON = Shape("nemotron-3-nano-30b-a3b-like", 128, 6, 2688, 1856)  # ungated relu^2 experts
SMALL = (Shape("small-a", 8, 2, 64, 32), Shape("small-b", 16, 4, 32, 16))


def experts_of(shape: Shape, kind: str = "swiglu", dtype=jnp.bfloat16) -> Experts:
    cfg = MoEConfig(shape.E, shape.k, shape.I, expert_kind=kind)
    return Experts(shape.d, cfg, dtype=dtype, rngs=nnx.Rngs(0))


def random_routing(key, n: int, shape: Shape):
    """Top-k of random logits: about n*k/E rows per expert, some more, some fewer."""
    logits = jax.random.normal(key, (n, shape.E), jnp.float32)
    top, ids = jax.lax.top_k(logits, shape.k)
    return jax.nn.softmax(top, axis=-1), ids.astype(jnp.int32)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def timed(a, fn, iters: int | None = None) -> float:
    return time_calls(fn, iters=iters or a.iters, trials=a.trials).median


def decode_iters(a) -> int:
    """Calls per trial at decode size: tens of microseconds each, so more of them back to back
    keep the device ahead of the host's dispatch."""
    return 4 * a.iters


def row(a, **r) -> dict:
    a.log.add(r)
    print("  " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)
    return r


# ----------------------------------------------------------------------------- prefill


def lowering(compiled) -> str:
    """What XLA made of a compiled function: its custom-call targets."""
    targets = sorted(set(re.findall(r'custom_call_target="([^"]+)"', compiled.as_text())))
    return ",".join(targets) if targets else "no custom call"


def sample_reference(xs, w, group_sizes, n: int = 32):
    """(row ids, their products) for n rows spread over the sorted rows: x[r] @ w[group(r)], fp32."""
    rows = np.linspace(0, int(group_sizes.sum()) - 1, n).astype(np.int32)
    group = np.searchsorted(np.cumsum(np.asarray(group_sizes)), rows, side="right")
    wr = jnp.take(w, jnp.asarray(group), axis=0)
    return rows, jnp.einsum("rk,rkn->rn", xs[rows], wr, preferred_element_type=jnp.float32)


PALLAS_TUNINGS = ({}, {"block_m": 128, "block_n": 256, "block_k": 64, "num_warps": 8, "num_stages": 3})


def best_tuning(label: str, configs, attempt):
    """Each config through attempt(config) -> (seconds, relative error, what to print), printed
    (a config that fails is printed, not fatal) -> (seconds, config, error) of the fastest with
    error < 2e-2, or None."""
    best = None
    for cfg in configs:
        try:
            t, err, say = attempt(cfg)
            print(f"    {label} {cfg}: {say} err={err:.2e}", flush=True)
            if err < 2e-2 and (best is None or t < best[0]):
                best = (t, cfg, err)
        except Exception as e:  # noqa: BLE001 - one failing tuning must not end a one-shot GPU run
            print(f"    {label} {cfg}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    return best


def bench_matmul_pair(a, shape: Shape, tokens: int, which: str, xs, w, group_sizes):
    """One grouped matmul (ragged_dot and the Pallas kernel, bf16 out) vs the dense matmul of
    the same FLOPs ([R, K] @ [K, F] with one group's matrix)."""
    rows, kdim = xs.shape
    f = w.shape[-1]
    flops = 2 * rows * kdim * f
    ragged = jax.jit(lambda x, w, g: jax.lax.ragged_dot(x, w, g))
    dense = jax.jit(lambda x, w: jnp.dot(x, w))
    rows_checked, want = sample_reference(xs, w, group_sizes)
    t_dense = timed(a, lambda: dense(xs, w[0]))
    out = {"shape": f"{shape.name} T={tokens} R={rows} K={kdim} F={f}", "dense_us": t_dense * 1e6,
               "dense_tflops": flops / t_dense / 1e12, "goal": ">=0.6"}
    try:
        compiled = ragged.lower(xs, w, group_sizes).compile()
        err = rel_err(compiled(xs, w, group_sizes)[rows_checked], want)
        t = timed(a, lambda: compiled(xs, w, group_sizes))
        row(a, case=f"prefill_{which}_ragged_dot", us=t * 1e6, tflops=flops / t / 1e12, ratio=t_dense / t, err=err,
            note=lowering(compiled), **out)
    except Exception as e:  # noqa: BLE001 - one failing variant must not end a one-shot GPU run
        traceback.print_exc()
        row(a, case=f"prefill_{which}_ragged_dot", note=f"FAILED {type(e).__name__}: {e}"[:200], **out)
    def attempt(tune):
        fn = jax.jit(functools.partial(grouped_matmul, interpret=a.interpret, **tune))
        err = rel_err(fn(xs, w, group_sizes)[rows_checked], want)
        t = timed(a, lambda: fn(xs, w, group_sizes))
        return t, err, f"{t * 1e6:.1f} us {flops / t / 1e12:.1f} TFLOP/s"

    best = best_tuning("pallas", PALLAS_TUNINGS if not a.small else ({},), attempt)
    if best:
        t, tune, err = best
        row(a, case=f"prefill_{which}_pallas", us=t * 1e6, tflops=flops / t / 1e12, ratio=t_dense / t, err=err,
            note=str(tune), **out)


def bench_prefill(a, shape: Shape, tokens: int):
    ex = experts_of(shape)
    key = jax.random.key(tokens)
    x = (jax.random.normal(key, (tokens, shape.d), jnp.float32)).astype(jnp.bfloat16)
    weights, ids = random_routing(jax.random.key(tokens + 1), tokens, shape)
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=shape.E).astype(jnp.int32)
    xs = jnp.take(x, order // shape.k, axis=0)
    bench_matmul_pair(a, shape, tokens, "gate_up", xs, ex.gate_up_proj[...], group_sizes)
    hs = jax.random.normal(jax.random.key(7), (xs.shape[0], shape.I), jnp.float32).astype(jnp.bfloat16)
    bench_matmul_pair(a, shape, tokens, "down", hs, ex.down_proj[...], group_sizes)
    # The whole routed block as the model runs it.
    g, st = nnx.split(ex)
    flops = 2 * tokens * shape.k * shape.d * 3 * shape.I
    for path in ("ragged", "pallas"):
        block = jax.jit(lambda st, x, w, e, path=path: nnx.merge(g, st)(x, w, e, path=path))
        try:
            t = timed(a, lambda block=block: block(st, x, weights, ids))
            row(a, case=f"prefill_block_{path}", shape=f"{shape.name} T={tokens}", us=t * 1e6, tflops=flops / t / 1e12)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row(a, case=f"prefill_block_{path}", shape=f"{shape.name} T={tokens}", note=f"FAILED {e}"[:200])


# ----------------------------------------------------------------------------- decode


def touched_bytes(ex: Experts, ids) -> int:
    """Weight bytes of the distinct experts `ids` names (gate_up + down, biases aside)."""
    per_expert = (ex.first[0].size + ex.down_proj[0].size) * ex.first.dtype.itemsize
    return len(np.unique(np.asarray(ids))) * per_expert


def decode_reference(ex: Experts, x, weights, ids):
    """Per token, per chosen expert, in fp32 on the device: the definition the paths must match."""
    w1 = jnp.take(ex.first, ids, axis=0)
    h = jnp.einsum("nd,nkdf->nkf", x, w1, preferred_element_type=jnp.float32)
    a_ = expert_activation(h, ex.cfg).astype(x.dtype)
    y = jnp.einsum("nki,nkid->nkd", a_, jnp.take(ex.down_proj[...], ids, axis=0), preferred_element_type=jnp.float32)
    return jnp.einsum("nk,nkd->nd", weights, y)


def bench_decode(a, shape: Shape, n: int, rate):
    ex = experts_of(shape)
    x = jax.random.normal(jax.random.key(n), (n, shape.d), jnp.float32).astype(jnp.bfloat16)
    weights, ids = random_routing(jax.random.key(n + 100), n, shape)
    nbytes = touched_bytes(ex, ids)
    bound = nbytes / rate.bytes_per_s
    want = jax.jit(decode_reference)(ex, x, weights, ids)
    g, st = nnx.split(ex)
    times = {}
    rows_fit = n * shape.k <= MAX_ROWS
    for path in ("ragged", "pallas", "gather") + (("rows",) if rows_fit else ()):
        fn = jax.jit(lambda st, x, w, e, path=path: nnx.merge(g, st)(x, w, e, path=path))
        try:
            err = rel_err(fn(st, x, weights, ids), want)
            t = times[path] = timed(a, lambda fn=fn: fn(st, x, weights, ids), decode_iters(a))
            extra = {"vs_gather": times["gather"] / t} if path == "rows" and "gather" in times else {}
            row(a, case=f"decode_{path}", shape=f"{shape.name} N={n}", us=t * 1e6, touched_mib=nbytes / 2**20,
                bound_us=bound * 1e6, of_bound=bound / t, err=err,
                all_experts_mib=(ex.first.nbytes + ex.down_proj.nbytes) / 2**20, **extra)
        except Exception as e:  # noqa: BLE001 - one failing path must not end a one-shot GPU run
            traceback.print_exc()
            row(a, case=f"decode_{path}", shape=f"{shape.name} N={n}", note=f"FAILED {type(e).__name__}: {e}"[:200])
    if rows_fit:
        flat = ids.reshape(-1)
        hs = jax.random.normal(jax.random.key(n + 7), (flat.shape[0], shape.I), jnp.float32).astype(jnp.bfloat16)
        bench_rows_kernel(a, shape, n, "gate_up", x, flat, ex.first, rate, repeat=shape.k)  # as the model calls it
        bench_rows_kernel(a, shape, n, "down", hs, flat, ex.down_proj[...], rate)


# Tried on each projection; the first is default_config's choice.  Keys override it.
ROWS_TUNINGS = ({}, {"block_n": 128}, {"block_n": 32}, {"block_k": 64}, {"num_stages": 3}, {"num_stages": 6},
                {"block_n": 128, "num_warps": 8}, {"k_splits": 1})


def bench_rows_kernel(a, shape: Shape, n: int, which: str, x, ids, w, rate, repeat: int = 1):
    """expert_gemv alone on one projection (x [R / repeat, K] bf16, ids [R], w [E, K, F]) under
    each tuning, against the bytes of the distinct chosen experts' matrices over the copy limit."""
    rows, kdim = ids.shape[0], x.shape[1]
    f = w.shape[-1]
    nbytes = len(np.unique(np.asarray(ids))) * kdim * f * w.dtype.itemsize
    bound = nbytes / rate.bytes_per_s
    want = jax.jit(functools.partial(expert_gemv_reference, repeat=repeat))(x, ids, w)
    label = f"{shape.name} N={n} R={rows} K={kdim} F={f}"
    def attempt(cfg):
        fn = jax.jit(functools.partial(expert_gemv, repeat=repeat, interpret=a.interpret, **cfg))
        err = rel_err(fn(x, ids, w), want)
        t = timed(a, lambda: fn(x, ids, w), decode_iters(a))
        return t, err, f"{t * 1e6:.1f} us ({bound / t:.2f} of bound)"

    base = default_config(rows, kdim, f, w.dtype)
    tunings = ROWS_TUNINGS if not a.small else ROWS_TUNINGS[:2]
    best = best_tuning(f"rows {which}", [{**base, **tune} for tune in tunings], attempt)
    if best:
        t, cfg, err = best
        row(a, case=f"decode_rows_{which}", shape=label, us=t * 1e6, touched_mib=nbytes / 2**20, bound_us=bound * 1e6,
            of_bound=bound / t, err=err, note=str(cfg))


# The tiles the grouped mode tries (the default first).
GROUPED_TUNINGS = tuple([{}] + [{"block_m": bm, "block_n": bn, "block_k": bk, "num_warps": w, "num_stages": s}
                                for bm, bn, bk, w, s in ((16, 64, 128, 4, 4), (32, 64, 128, 4, 4), (32, 128, 64, 4, 4),
                                                         (64, 64, 64, 4, 4), (64, 128, 64, 4, 3), (64, 128, 64, 8, 3),
                                                         (128, 128, 64, 8, 3), (128, 256, 64, 8, 3))])


def bench_grouped(a, shape: Shape, n: int, rate):
    """Both grouped matmuls of n decode tokens, uniform and skewed routing, under GROUPED_TUNINGS."""
    kind = "ungated" if shape is NEMOTRON else "swiglu"
    ex = experts_of(shape, kind)
    for routing in ("uniform", "skewed"):
        key = jax.random.key(n + (0 if routing == "uniform" else 1))
        if routing == "uniform":
            _, ids = random_routing(key, n, shape)
        else:  # every token picks k of the same E/4 experts (at least k of them)
            sub_e = max(shape.E // 4, shape.k)
            experts = jax.random.permutation(jax.random.key(7), shape.E)[:sub_e]
            _, pick = jax.lax.top_k(jax.random.normal(key, (n, sub_e)), shape.k)
            ids = experts[pick].astype(jnp.int32)
        flat = ids.reshape(-1)
        group_sizes = jnp.zeros((shape.E,), jnp.int32).at[flat].add(1)  # rows are random: no sort needed
        distinct = len(np.unique(np.asarray(flat)))
        rows = flat.shape[0]
        for which, w in (("gate_up", ex.first), ("down", ex.down_proj[...])):
            K, F = w.shape[1], w.shape[2]
            xs = jax.random.normal(jax.random.key(3), (rows, K), jnp.float32).astype(jnp.bfloat16)
            rows_checked, want = sample_reference(xs, w, group_sizes)
            bound = distinct * K * F * w.dtype.itemsize / rate.bytes_per_s
            label = f"{shape.name} N={n} R={rows} K={K} F={F} {routing} experts={distinct}"

            def attempt(tune, xs=xs, w=w, group_sizes=group_sizes, rows_checked=rows_checked, want=want, bound=bound):
                fn = jax.jit(functools.partial(grouped_matmul, interpret=a.interpret, **tune))
                err = rel_err(fn(xs, w, group_sizes)[rows_checked], want)
                t = timed(a, lambda: fn(xs, w, group_sizes), decode_iters(a))
                return t, err, f"{t * 1e6:.1f} us ({bound / t:.2f} of bound)"

            tunings = GROUPED_TUNINGS if not a.small else GROUPED_TUNINGS[:2]
            best = best_tuning(f"grouped {which} {routing}", tunings, attempt)
            if best:
                t, cfg, err = best
                row(a, case=f"decode_grouped_{which}", shape=label, us=t * 1e6, bound_us=bound * 1e6,
                    of_bound=bound / t, err=err, note=str(cfg))


# The grid the chain mode tries on every projection (default_config's choice first).
CHAIN_TUNINGS = tuple([{}] + [{"block_n": bn, "k_splits": s} for bn in (32, 64, 128) for s in (1, 2, 4, 8)]
                      + [{"num_stages": 2}, {"num_warps": 8, "block_n": 128}])


def bench_chain(a, shape: Shape, n: int, rate):
    """Both projections of n tokens, each as a.chain back-to-back calls in one jit (see the module
    docstring), under every CHAIN_TUNINGS config."""
    kind = "ungated" if shape is NEMOTRON else "swiglu"
    width = shape.I if kind == "ungated" else 2 * shape.I
    rng = np.random.default_rng(n)
    per_call = min(n * shape.k, shape.E)
    stack = a.chain * per_call  # distinct experts: each call reads its own
    key = jax.random.key(n)
    x = jax.random.normal(key, (n, shape.d), jnp.float32).astype(jnp.bfloat16)
    h = jax.random.normal(key, (n * shape.k, shape.I), jnp.float32).astype(jnp.bfloat16)
    for which, xin, K, F, repeat in (("gate_up", x, shape.d, width, shape.k), ("down", h, shape.I, shape.d, 1)):
        w = (jax.random.normal(jax.random.key(1), (stack, K, F), jnp.float32) * K ** -0.5).astype(jnp.bfloat16)
        # each token picks k distinct experts of its call's share (tokens may share experts)
        ids = np.stack([np.concatenate([c * per_call + rng.permutation(per_call)[:shape.k] for _ in range(n)])
                        for c in range(a.chain)]).astype(np.int32)  # [L, R]
        ids = jnp.asarray(ids)
        distinct = sum(len(np.unique(np.asarray(i))) for i in ids)
        bound = distinct * K * F * 2 / rate.bytes_per_s / a.chain
        want = expert_gemv_reference(xin, ids[0], w, repeat=repeat)
        label = f"{shape.name} N={n} R={n * shape.k} K={K} F={F} x{a.chain}"

        def attempt(cfg):
            one = functools.partial(expert_gemv_partials, repeat=repeat, interpret=a.interpret, **cfg)
            err = rel_err(one(xin, ids[0], w).sum(0), want)
            fn = jax.jit(lambda xin, ids, w: [one(xin, ids[c], w) for c in range(a.chain)])
            t = timed(a, lambda: fn(xin, ids, w)) / a.chain
            return t, err, f"{t * 1e6:.2f} us a call ({bound / t:.2f} of bound)"

        base = default_config(n * shape.k, K, F, w.dtype)
        tunings = CHAIN_TUNINGS if not a.small else CHAIN_TUNINGS[:2]
        best = best_tuning(f"chain {which}", [{**base, **tune} for tune in tunings], attempt)
        if best:
            t, cfg, err = best
            row(a, case=f"decode_chain_{which}", shape=label, us=t * 1e6, bound_us=bound * 1e6, of_bound=bound / t,
                err=err, note=str(cfg))
        del w


# ----------------------------------------------------------------------------- main


def parse(argv):
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.bench_moe", description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--only", default="prefill,decode", help="comma list of: prefill, decode, grouped, chain")
    p.add_argument("--grouped-tokens", default="64", help="decode tokens of the grouped mode, comma list")
    p.add_argument("--chain", type=int, default=None, help="calls per jit in the chain mode (default 40, small 3)")
    p.add_argument("--chain-tokens", default="1", help="decode tokens of the chain mode, comma list")
    p.add_argument("--decode-tokens", default="1,2,4,64", help="decode batch sizes (tokens), comma list")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--trials", type=int, default=None)
    p.add_argument("--json", default=None, help="write the rows here (default $OUT/bench_moe.json when $OUT is set)")
    a = p.parse_args(argv)
    a.interpret = jax.default_backend() != "gpu"
    a.decode_tokens = [int(t) for t in a.decode_tokens.split(",")]
    a.chain_tokens = [int(t) for t in a.chain_tokens.split(",")]
    a.grouped_tokens = [int(t) for t in a.grouped_tokens.split(",")]
    a.iters = a.iters or (2 if a.small else 5)
    a.trials = a.trials or (2 if a.small else 3)
    a.chain = a.chain or (3 if a.small else 40)
    return a


def main(argv=None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    silence_triton_deprecation()
    dev = jax.devices()[0]
    a.log = RowLog(json_path(a.json, "bench_moe"), jax=jax.__version__, device=str(dev.device_kind))
    print(f"jax {jax.__version__} on {dev.device_kind}", flush=True)
    only = set(a.only.split(","))
    rate = copy_limit((4 << 20) if a.small else (4 << 30), iters=a.iters, trials=a.trials)
    row(a, case="copy", shape=f"{rate.nbytes >> 20} MiB", tbps=rate.tbps, exact=rate.exact)
    shapes = SMALL if a.small else (GPT_OSS, QWEN)
    token_counts = (64, 256) if a.small else (4096, 16384)
    for shape in shapes:  # per shape: the largest prefill, decode, the other prefills (a cut run keeps the first)
        counts = sorted(token_counts, reverse=True) if "prefill" in only else []
        for i, tokens in enumerate(counts or [None]):
            if tokens is not None:
                try:
                    bench_prefill(a, shape, tokens)
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    row(a, case="prefill", shape=f"{shape.name} T={tokens}", note=f"FAILED {type(e).__name__}: {e}"[:200])
            for n in a.decode_tokens if i == 0 and "decode" in only else ():
                bench_decode(a, shape, n, rate)
    modes = (("grouped", bench_grouped, (GPT_OSS, NEMOTRON, QWEN), a.grouped_tokens),
             ("chain", bench_chain, (QWEN, GPT_OSS, NEMOTRON), a.chain_tokens))
    for mode, bench, real_shapes, counts in modes:
        for shape in (SMALL if a.small else real_shapes) if mode in only else ():
            for n in counts:
                try:
                    bench(a, shape, n, rate)
                except Exception as e:  # noqa: BLE001 - one failing shape must not end a one-shot GPU run
                    traceback.print_exc()
                    row(a, case=f"decode_{mode}", shape=f"{shape.name} N={n}",
                        note=f"FAILED {type(e).__name__}: {e}"[:200])
    keys = ["case", "shape", "us", "tflops", "dense_tflops", "ratio", "bound_us", "of_bound", "vs_gather",
            "err"]
    print(format_table(keys, [[r.get("case"), r.get("shape")] + [fmt(r.get(k), ".3g") for k in keys[2:]]
                              for r in a.log.rows], left=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
