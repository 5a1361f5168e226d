"""Recurrent-state decode bandwidth: Mamba2 and gated DeltaNet decode kernels vs the copy limit.

One decode step reads and writes every real request's state slot for one layer (conv window +
fp32 SSM / delta-rule matrix); the kernels are memory bound, so the figure of merit is
    achieved = 2 * B_real * state_bytes_per_request / step_time     (read + write)
against the device copy bandwidth measured in the same run on a buffer of the same size
(timing.copy_rate: `x ^ 1` over uint16 in place, read + write).  Goal: >= 70% of copy.

Shapes: NemotronH-8B-like Mamba2 (H=128, P=64, N=128, G=8, conv 4) and Qwen3.5-4B-like gated
DeltaNet (Hk=16, Hv=32, Dk=Dv=128, conv 4); 1024-word arena rows; bf16 activations; B = 64, 256
(one padding lane each).  A small sweep of tile sizes and num_warps picks the best per shape.

    python3 -m benchmarks.bench_state                 # GPU: full shapes
    python3 -m benchmarks.bench_state --small         # CPU: tiny shapes in interpret mode, seconds
    python3 -m benchmarks.bench_state --state-dtype bfloat16   # the 16-bit state (mamba_ssm_dtype)
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from umem_jax.memory import full_attention, gated_deltanet_state_tensors, mamba2_state_tensors, plan, recurrent_state
from umem_jax.memory.declarations import with_ssm_dtype
from umem_jax.pallas_kernels._compat import silence_triton_deprecation
from umem_jax.pallas_kernels.gated_deltanet import gdn_decode, gdn_dims
from umem_jax.pallas_kernels.mamba2 import mamba2_decode, mamba2_dims

from .report import RowLog, json_path
from .timing import Chain, copy_rate, time_calls

FULL = {
    "mamba2": dict(tensors=lambda: mamba2_state_tensors(128, 64, 128, 8, 4), row_words=1024,
                   sweep=[dict(block_p=bp, num_warps=w) for bp in (16, 32, 64) for w in (4, 8)]),
    "gdn": dict(tensors=lambda: gated_deltanet_state_tensors(16, 32, 128, 128, 4), row_words=1024,
                sweep=[dict(block_v=bv, num_warps=w) for bv in (16, 32, 64) for w in (4, 8)]),
}
SMALL = {
    "mamba2": dict(tensors=lambda: mamba2_state_tensors(4, 8, 16, 2, 4), row_words=64, sweep=[dict(block_p=4)]),
    "gdn": dict(tensors=lambda: gated_deltanet_state_tensors(2, 4, 16, 8, 4), row_words=64, sweep=[dict(block_v=4)]),
}


def _view(tensors, row_words, state_dtype: str = "float32"):
    decls = with_ssm_dtype([full_attention(0, 1, row_words), recurrent_state(1, tensors)], state_dtype)
    p = plan(decls, page_size=16, row_words=row_words)
    return p.state.state_view(1)


def _time(fn, carry, iters):
    """Steady-state seconds per step: warm up, then `iters` back-to-back steps that thread the
    donated arena through (as a serving loop does) -> (seconds, the newest carry)."""
    chain = Chain(fn, carry)
    t = time_calls(chain, iters=iters, trials=1, warmup=1)
    return t.median, chain.value


def _inputs(kind, view, B, rng, dtype):
    n = lambda *s, sc=1.0: jnp.asarray(rng.standard_normal(s) * sc, dtype)
    f32 = lambda *s, sc=1.0, off=0.0: jnp.asarray(rng.standard_normal(s) * sc + off, jnp.float32)
    if kind == "mamba2":
        d = mamba2_dims(view)
        return (n(B, d.conv_dim), n(B, d.heads), n(d.conv_dim, d.conv_kernel, sc=0.5), n(d.conv_dim, sc=0.1),
                f32(d.heads, sc=0.5), f32(d.heads, sc=0.5, off=-1.0), f32(d.heads))
    d = gdn_dims(view)
    return (n(B, d.conv_dim), n(B, d.v_heads), n(B, d.v_heads), n(d.conv_dim, d.conv_kernel, sc=0.5),
            f32(d.v_heads, sc=0.5), f32(d.v_heads, sc=0.5))


def bench_decode(kind, B, *, small=False, iters=20, impl="pallas", tuning=None, check=True, rng=None,
                 state_dtype="float32"):
    """Time one layer's decode step for B lanes (B-1 real, one padding lane), the recurrent
    tensor stored as `state_dtype`. Returns a dict."""
    cfg = (SMALL if small else FULL)[kind]
    view = _view(cfg["tensors"](), cfg["row_words"], state_dtype)
    rng = rng or np.random.default_rng(0)
    slots = np.concatenate([rng.permutation(np.arange(1, B)), [0]]).astype(np.int32)
    rng.shuffle(slots)
    slots = jnp.asarray(slots)
    rows = view.slot_row(B + 1)  # slots 1..B on the plan's grid (slot 1 starts at the sink)
    arena = jax.jit(lambda: jnp.zeros((rows, view.row_words), jnp.uint16))()
    x = _inputs(kind, view, B, rng, jnp.float32 if small else jnp.bfloat16)
    dec = mamba2_decode if kind == "mamba2" else gdn_decode
    kw = dict(view=view, impl=impl, interpret=small and impl == "pallas", **(tuning or {}))
    step = jax.jit(lambda a, *x: dec(a, *x, **kw), donate_argnums=0)
    err = None
    if check and impl == "pallas":
        ref = jax.jit(lambda a, *x: dec(a, *x, view=view, impl="reference"))
        y_ref, _ = ref(arena, slots, *x)
        y, arena = step(arena, slots, *x)
        y_ref = np.asarray(y_ref, np.float32)
        err = float(np.abs(np.asarray(y, np.float32) - y_ref).max() / max(np.abs(y_ref).max(), 1e-30))
    dt, arena = _time(lambda a: step(a, slots, *x)[1], arena, iters)
    state_bytes = sum(t.planes * t.rows_per_plane for t in view.tensors) * view.row_words * 2
    moved = 2 * (B - 1) * state_bytes
    return dict(kind=kind, B=B, impl=impl, state_dtype=state_dtype, tuning=tuning or {}, step_us=dt * 1e6,
                bytes_moved=moved,
                gbps=moved / dt / 1e9, max_rel_err=err)


def run(results, args):
    """Append one dict per (kind, B) (the best of the sweep, plus the reference) to `results` (a
    list) and return it.  args: argparse-like with optional attributes small (bool), batches
    (list of int), iters (int), no_sweep (bool), state_dtype (str)."""
    small = bool(getattr(args, "small", False))
    batches = getattr(args, "batches", None) or ([4] if small else [64, 256])
    iters = getattr(args, "iters", None) or (2 if small else 20)
    sweep = not getattr(args, "no_sweep", False)
    sd = getattr(args, "state_dtype", None) or "float32"
    silence_triton_deprecation()
    table = SMALL if small else FULL
    for kind in ("mamba2", "gdn"):
        for B in batches:
            tried = []
            configs = table[kind]["sweep"] if sweep else [{}]
            for i, tuning in enumerate(configs):
                try:
                    tried.append(bench_decode(kind, B, small=small, iters=iters, tuning=tuning, check=i == 0,
                                              state_dtype=sd))
                except Exception as e:  # a config that does not compile is reported, not fatal
                    tried.append(dict(kind=kind, B=B, impl="pallas", tuning=tuning, error=f"{type(e).__name__}: {e}"[:300]))
            ok = [r for r in tried if "gbps" in r]
            best = max(ok, key=lambda r: r["gbps"]) if ok else tried[0]
            ref = bench_decode(kind, B, small=small, iters=max(1, iters // 2), impl="reference", check=False,
                               state_dtype=sd)
            copy = copy_rate(best.get("bytes_moved", ref["bytes_moved"]) // 2, iters=iters, trials=1,
                             donate=True).bytes_per_s
            row = dict(bench="state_decode", kind=kind, B=B, state_dtype=sd, best=best, reference=ref,
                       copy_gbps=copy / 1e9,
                       frac_of_copy=(best.get("gbps", 0.0) * 1e9) / copy, sweep=tried)
            results.append(row)
            _print_row(row)
    return results


def _print_row(r):
    b, ref = r["best"], r["reference"]
    if "gbps" in b:
        print(f"{r['kind']:7s} {r['state_dtype']:8s} B={r['B']:4d}  pallas {b['gbps']:8.1f} GB/s "
              f"({b['step_us']:9.1f} us, {b['tuning']}, "
              f"err {b['max_rel_err']})  reference {ref['gbps']:8.1f} GB/s  copy {r['copy_gbps']:8.1f} GB/s  "
              f"-> {100 * r['frac_of_copy']:5.1f}% of copy", flush=True)
    else:
        print(f"{r['kind']:7s} B={r['B']:4d}  pallas FAILED: {b.get('error')}", flush=True)
    for s in r["sweep"]:
        if "gbps" in s:
            print(f"          sweep {s['tuning']}: {s['gbps']:8.1f} GB/s", flush=True)
        else:
            print(f"          sweep {s['tuning']}: {s['error']}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes in interpret mode (CPU, seconds)")
    ap.add_argument("--batches", type=int, nargs="*", default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--no-sweep", dest="no_sweep", action="store_true")
    ap.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="the recurrent tensor's stored dtype (engine option mamba_ssm_dtype)")
    ap.add_argument("--json", default=None, help="rows here (default $OUT/bench_state.json if $OUT is set)")
    args = ap.parse_args(argv)
    print("jax", jax.__version__, "backend", jax.default_backend(), flush=True)
    log = RowLog(json_path(args.json, "bench_state"), jax=jax.__version__, device=jax.devices()[0].device_kind)
    for row in run([], args):
        log.add(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
