"""Tensor-parallel decode throughput on one host: TP=1 against TP=N.

  python3 -m benchmarks.bench_tp --tp 2                      # GPU: nemotronh-8b-like, B=64,256, ctx 2048
  python3 -m benchmarks.bench_tp --family qwen35 --tp 4 --batches 128,512
  python3 -m benchmarks.bench_tp --family qwen35moe --tp 2 --batches 1,64 --expert-parallel   # MoE experts whole
  XLA_FLAGS=--xla_force_host_platform_device_count=4 python3 -m benchmarks.bench_tp --small --tp 2   # CPU

For TP=1, then TP=N: the family's shape with random weights (families.build_model; the TP run
splits those same weights with models.sharded_model.shard_model), the per-device plan and an arena of
--arena-gib PER DEVICE, B decode rows at ctx tokens paged by a ChainAllocator (a fresh zeroed
arena per batch size), `model.jit_forward()` timed as bench_models times it (timing.time_calls: median of
--trials runs of --iters steps dispatched back to back).

Per batch size: ms per step and tokens/s at each TP, speedup = tokens/s(TP=N) / tokens/s(TP=1),
and goal = speedup / N (goal: >= 0.85 at large batch, i.e. TP=2 decodes >= 1.7x faster than
one GPU); and whether the first step's greedy tokens at TP=N equal TP=1's, with the
largest relative logit difference (bf16 psums add the partial sums in another order).
--small: the tiny shapes of bench_models --small and reference kernels; its times mean nothing.
Rows go to $OUT/bench_tp.json (or --json).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import warnings

import jax
import numpy as np

from umem_jax.arena import Arena
from umem_jax.memory import plan as make_plan
from umem_jax.memory import size_arena
from umem_jax.models.sharded_model import shard_model
from umem_jax.pallas_kernels._compat import silence_triton_deprecation

from .families import FAMILIES, build_model, family_key
from .model_steps import Pager, Stepper, decode_batch, rel_err
from .report import RowLog, json_path
from .timing import time_calls

GIB = 2**30


def _decode_at(model, step, plan, size, B: int, a) -> dict:
    """B rows decoding at ctx on a fresh zeroed arena (freed on return) -> the row."""
    arena = jax.block_until_ready(Arena.create(plan, size.num_rows, mesh=getattr(model, "mesh", None)))
    run = Stepper(step, model.params, arena)
    batch = decode_batch(Pager(plan, size.num_rows), B, a.ctx, model.config.vocab_size, -(-a.ctx // a.page_size),
                         seed=B)
    start = time.perf_counter()
    logits = np.asarray(run(batch), np.float32)  # the first call (it compiles) on the fresh arena
    first_s = time.perf_counter() - start
    t = time_calls(lambda: run.advance(batch), iters=a.iters, trials=a.trials, warmup=a.warmup)
    return dict(ms=t.median * 1e3, ms_min=t.best * 1e3, first_call_s=first_s, tokens_per_s=B / t.median,
                logits=logits, arena_rows=size.num_rows, shard_bytes=size.nbytes)


def run_tp(model, a) -> dict:
    """Decode steps of `model` (a Model or a ShardedModel) at every batch size -> {B: row}."""
    plan = make_plan(model.decls(), page_size=a.page_size)
    size = size_arena(plan, int(a.arena_gib * GIB))
    step = model.jit_forward(impl=a.impl)
    out = {}
    for B in a.batches:
        out[B] = _decode_at(model, step, plan, size, B, a)
        gc.collect()
    return out


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="nemotronh", help=f"one of {', '.join(FAMILIES)}")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--expert-parallel", action="store_true", help="MoE families: experts split whole, not by width")
    ap.add_argument("--batches", default=None, help="decode batch sizes (default 64,256; --small 2,4)")
    ap.add_argument("--ctx", type=int, default=None, help="tokens in cache per row (default 2048; --small 64)")
    ap.add_argument("--arena-gib", type=float, default=None, help="arena bytes per device (default 24; --small 1/64)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--goal", type=float, default=0.85, help="speedup / tp goal at the largest batch")
    ap.add_argument("--impl", default=None, choices=("pallas", "reference"))
    ap.add_argument("--small", action="store_true", help="tiny shapes, reference kernels (CPU)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not a.small and jax.default_backend() != "gpu":
        print(f"no GPU ({jax.default_backend()}): running --small", flush=True)
        a.small = True
    family = family_key(a.family)
    if family is None:
        ap.error(f"unknown family {a.family!r}; known: {', '.join(FAMILIES)}")
    a.family = family
    a.batches = [int(x) for x in (a.batches or ("2,4" if a.small else "64,256")).split(",")]
    a.ctx = a.ctx or (64 if a.small else 2048)
    a.arena_gib = a.arena_gib or (1 / 64 if a.small else 24.0)
    if a.small:
        a.impl = a.impl or "reference"
        a.iters, a.trials, a.warmup = min(a.iters, 2), min(a.trials, 1), 0
    return a


def main(argv=None) -> int:
    a = parse(argv)
    silence_triton_deprecation()
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    spec = FAMILIES[a.family]
    cfg = spec["full"]()
    if a.small:
        cfg = spec["tiny"](cfg)
    if a.tp > len(jax.devices()):
        print(f"--tp {a.tp} needs {a.tp} devices, JAX sees {len(jax.devices())}", file=sys.stderr)
        return 2
    dev = jax.devices()[0]
    print(f"jax {jax.__version__}, {len(jax.devices())} x {getattr(dev, 'device_kind', dev.platform)}; "
          f"{spec['name']}{' (--small)' if a.small else ''}; TP=1 vs TP={a.tp}; B={a.batches}, ctx {a.ctx}", flush=True)
    model = build_model(cfg)
    jax.block_until_ready(model.params)
    t = time.time()
    one = run_tp(model.fuse_projections(), a)  # fused as the engine serves it
    print(f"TP=1 done in {time.time() - t:.0f} s", flush=True)
    t = time.time()
    sharded = shard_model(model, a.tp, expert_parallel=a.expert_parallel).fuse_projections()
    del model  # the unsplit weights leave device 0 before the split arena is made
    gc.collect()
    print(f"split over {a.tp} devices in {time.time() - t:.0f} s ({sharded.param_bytes / GIB:.2f} GiB of weights "
          "per device)", flush=True)
    many = run_tp(sharded, a)
    rows = []
    for B in a.batches:
        x, y = one[B], many[B]
        ref, got = x.pop("logits"), y.pop("logits")
        speedup = y["tokens_per_s"] / x["tokens_per_s"]
        rows.append(dict(family=spec["name"], B=B, ctx=a.ctx, tp=a.tp, ms_tp1=x["ms"], ms_tpn=y["ms"],
                         tokens_per_s_tp1=x["tokens_per_s"], tokens_per_s_tpn=y["tokens_per_s"], speedup=speedup,
                         goal_ratio=speedup / a.tp, greedy_equal=bool((ref.argmax(-1) == got.argmax(-1)).all()),
                         max_rel_logit_diff=rel_err(got, ref),
                         tp1=x, tpn=y))
    print(f"\n{'B':>5} {'ms TP=1':>9} {'ms TP=' + str(a.tp):>9} {'speedup':>8} {'/tp':>6}  greedy  max rel diff")
    for r in rows:
        print(f"{r['B']:>5} {r['ms_tp1']:>9.3f} {r['ms_tpn']:>9.3f} {r['speedup']:>8.2f} {r['goal_ratio']:>6.2f}  "
              f"{'same' if r['greedy_equal'] else 'DIFF':>6}  {r['max_rel_logit_diff']:.2e}")
    top = rows[-1]
    if not a.small:
        print(f"goal (speedup/tp >= {a.goal} at B={top['B']}): {'met' if top['goal_ratio'] >= a.goal else 'MISSED'}")
    log = RowLog(json_path(a.json, "bench_tp"), jax=jax.__version__,
                 device=str(getattr(dev, "device_kind", dev.platform)), small=a.small)
    log.rows = rows
    log.flush()
    return 0 if all(r["greedy_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
