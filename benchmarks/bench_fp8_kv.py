"""fp8 (e4m3) against bf16 K/V: decode and prefill kernels on the same K/V values, one run.

  python3 -m benchmarks.bench_fp8_kv            # GPU: B=64 ctx=4096 32/8 heads D=128 decode (+ sweep), prefill
  python3 -m benchmarks.bench_fp8_kv --small    # CPU: tiny shapes in interpret mode (checks the script)

Both arenas hold the same random K/V (the fp8 one quantised, scales 1.0); every kernel is first
checked against its reference on the device, then timed (timing.time_calls, median).  Decode
bytes are the K/V bytes the kernel must read (fp8: half of bf16's); the goal is fp8 time <= 0.6x
bf16 time at B=64 ctx=4096.  Both dtypes get a tuning sweep (tokens per block, warps, stages;
fp8 also how its tiles reach the dots, paged_decode.FP8_DOTS); the best correct one of each is compared.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from umem_jax.memory import MHA, Full, LayerDecl, Part, Window, plan
from umem_jax.memory.declarations import FP8_E4M3
from umem_jax.pallas_kernels._compat import silence_triton_deprecation
from umem_jax.pallas_kernels.kv_write import write_kv_reference
from umem_jax.pallas_kernels.paged_decode import FP8_DOTS, paged_decode_attention, paged_decode_attention_reference
from umem_jax.pallas_kernels.paged_prefill import paged_prefill_attention

from .timing import time_calls


def view_of(Hkv, D, ps, dtype):
    decls = [LayerDecl(i, (Part(MHA(Hkv, D, dtype=dtype), Full()),)) for i in range(2)]
    decls.append(LayerDecl(2, (Part(MHA(Hkv, D, dtype=dtype), Window(128)),)))
    return plan(decls, page_size=ps).full.kv_view(1)


def arenas(key, *, B, ctx, Hkv, D, ps):
    """bf16 and fp8 arenas holding the same K/V for positions [0, ctx) of B rows (same pages)."""
    P = -(-ctx // ps)
    npages = 1 + B * P
    k1, k2, k3 = jax.random.split(key, 3)
    table = np.asarray(jax.random.permutation(k1, np.arange(1, npages, dtype=np.int32))).reshape(B, P)
    pos = np.arange(ctx)
    pages = jnp.asarray(table[:, pos // ps].reshape(-1))
    slots = jnp.asarray(np.tile(pos % ps, B).astype(np.int32))
    k = jax.random.normal(k2, (B * ctx, Hkv, D), jnp.bfloat16)
    v = jax.random.normal(k3, (B * ctx, Hkv, D), jnp.bfloat16)
    out = {}
    for name, dtype in (("bf16", "bfloat16"), ("fp8", FP8_E4M3)):
        view = view_of(Hkv, D, ps, dtype)
        arena = jnp.zeros((npages * view.rows_per_page, view.row_words), jnp.uint16)
        arena = jax.jit(lambda a, k, v, p, s, view=view: write_kv_reference(a, k, v, p, s, view=view))(
            arena, k, v, pages, slots)
        out[name] = (view, jax.lax.bitcast_convert_type(arena, jnp.bfloat16))
    return out, jnp.asarray(table)


def bench_decode(a, B, ctx, Hq, Hkv, D, ps):
    data, table = arenas(jax.random.PRNGKey(0), B=B, ctx=ctx, Hkv=Hkv, D=D, ps=ps)
    q = jax.random.normal(jax.random.PRNGKey(1), (B, Hq, D), jnp.bfloat16)
    lens = jnp.full((B,), ctx, jnp.int32)
    bf16_sweep = [{}] if a.small else [{}] + [{"block_tokens": b, "num_warps": w, "num_stages": s} for b, w, s in
                                             itertools.product((32, 64, 128, 256), (4, 8), (2, 3, 4))]
    # fp8: also how the tiles reach the dots (paged_decode FP8_DOTS: integer unpack to f16, or a convert)
    fp8_sweep = [{"fp8_dot": d} for d in FP8_DOTS] if a.small else [{}] + [
        {"fp8_dot": d, "block_tokens": b, "num_warps": w, "num_stages": s}
        for d, b, w, s in itertools.product(FP8_DOTS, (64, 128), (4,), (2, 3, 4))]
    rows = {}
    for name, (view, arena) in data.items():
        sweep = fp8_sweep if name == "fp8" else bf16_sweep
        ref = jax.jit(lambda q, ar, view=view: paged_decode_attention_reference(q, ar, table, lens, view=view))(
            q, arena)
        best = None
        for tune in sweep:
            try:
                f = jax.jit(lambda q, ar, view=view, tune=tune: paged_decode_attention(
                    q, ar, table, lens, view=view, impl="pallas", interpret=a.interpret, **tune))
                err = float(jnp.abs(f(q, arena).astype(jnp.float32) - ref.astype(jnp.float32)).max())
                t = time_calls(lambda f=f, arena=arena: f(q, arena), iters=a.iters, trials=a.trials).median
            except Exception as e:  # noqa: BLE001 - one config that does not compile must not end the run
                print(f"  {name} {tune}: FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            ok = err <= 2e-2
            print(f"  {name} {tune or 'default'}: {t * 1e6:.1f} us err={err:.2e}{'' if ok else ' WRONG'}", flush=True)
            if ok and (best is None or t < best[0]):
                best = (t, tune, err)
        nbytes = B * ctx * Hkv * 2 * D * (1 if name == "fp8" else 2)
        rows[name] = {"us": best[0] * 1e6, "tbps": nbytes / best[0] / 1e12, "tuning": best[1], "err": best[2]}
    rows["fp8_over_bf16"] = rows["fp8"]["us"] / rows["bf16"]["us"]
    return rows


def bench_prefill(a, T, Hq, Hkv, D, ps):
    data, table = arenas(jax.random.PRNGKey(2), B=1, ctx=T, Hkv=Hkv, D=D, ps=ps)
    q = jax.random.normal(jax.random.PRNGKey(3), (1, T, Hq, D), jnp.bfloat16)
    ql = kl = jnp.full((1,), T, jnp.int32)
    rows = {}
    for name, (view, arena) in data.items():
        ref = paged_prefill_attention(q, arena, table, ql, kl, view=view, impl="reference")
        f = jax.jit(lambda q, ar, view=view: paged_prefill_attention(q, ar, table, ql, kl, view=view, impl="pallas",
                                                                     interpret=a.interpret, backend="triton"))
        err = float(jnp.abs(f(q, arena).astype(jnp.float32) - ref.astype(jnp.float32)).max())
        t = time_calls(lambda f=f, arena=arena: f(q, arena), iters=a.iters, trials=a.trials).median
        flops = 4 * T * T / 2 * Hq * D
        rows[name] = {"us": t * 1e6, "tflops": flops / t / 1e12, "err": err}
        print(f"  prefill {name}: {t * 1e6:.1f} us {flops / t / 1e12:.1f} TFLOP/s err={err:.2e}", flush=True)
    rows["fp8_over_bf16"] = rows["fp8"]["us"] / rows["bf16"]["us"]
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes in interpret mode (CPU)")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--trials", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the results here (default $OUT/bench_fp8_kv.json if $OUT)")
    a = ap.parse_args(argv)
    silence_triton_deprecation()
    a.interpret = a.small or jax.default_backend() != "gpu"
    a.iters = a.iters or (2 if a.small else 20)
    a.trials = a.trials or (1 if a.small else 5)
    if a.small:
        out = {"decode": bench_decode(a, 2, 64, 8, 2, 64, 16), "prefill": bench_prefill(a, 32, 8, 2, 64, 16)}
    else:
        out = {"decode": bench_decode(a, 64, 4096, 32, 8, 128, 16), "prefill": bench_prefill(a, 4096, 32, 8, 128, 16)}
    d = out["decode"]
    print(f"decode {'(small shapes)' if a.small else 'B=64 ctx=4096'}: bf16 {d['bf16']['us']:.1f} us ({d['bf16']['tbps']:.2f} TB/s), fp8 "
          f"{d['fp8']['us']:.1f} us ({d['fp8']['tbps']:.2f} TB/s of fp8 bytes): fp8/bf16 = {d['fp8_over_bf16']:.3f} "
          "(goal <= 0.6)")
    print(f"prefill {'(small shapes)' if a.small else 'T=4096'}: fp8/bf16 = {out['prefill']['fp8_over_bf16']:.3f}")
    path = a.json or (os.path.join(os.environ["OUT"], "bench_fp8_kv.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as fh:
            json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind, **out}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
