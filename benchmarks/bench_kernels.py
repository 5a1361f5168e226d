"""Benchmarks of the arena kernels against their baselines, in one run.

  python benchmarks/bench_kernels.py            # GPU: everything, with a small decode tuning sweep
  python benchmarks/bench_kernels.py --small    # CPU: tiny shapes in interpret mode, in seconds
  python benchmarks/bench_kernels.py --only decode,relocate --no-sweep

Every benchmark first checks its kernel against the plain-JAX reference on the same device (max
error; exact for byte moves), then times it: warmup, then `--trials` runs of `--iters` calls
dispatched back to back and synchronised once (block_until_ready), per-call median.  Bandwidth is
bytes the operation must move / time:
  copy      bytes read + written by a large device-to-device copy (the roofline)
  decode    K and V bytes of the visible positions (each read once per kv head)
  relocate  page bytes read + written
  kv_write  K/V bytes written (+ the same read from the step's new K/V)
The table comes last; with $OUT (or --json) set, the rows are also written as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
import warnings

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from umem_jax.memory.plan import KVView  # noqa: E402
from umem_jax.pallas_kernels._compat import silence_triton_deprecation  # noqa: E402
from umem_jax.pallas_kernels.kv_write import write_kv, write_kv_reference  # noqa: E402
from umem_jax.pallas_kernels.paged_decode import paged_decode_attention, paged_decode_attention_reference  # noqa: E402
from umem_jax.pallas_kernels.relocate import move_pages, move_pages_reference  # noqa: E402

GROUPS = ("copy", "decode", "decode_long", "window", "baselines", "relocate", "kv_write", "bitcast_probe")
ROWS: list[dict] = []
JSON_PATH: str | None = None
DEADLINE = float("inf")  # time.time() after which sweeps stop early and groups are skipped
META: dict = {}


def _flush():
    """Rewrite the JSON after every row, so a run cut short still leaves its numbers."""
    if JSON_PATH:
        with open(JSON_PATH, "w") as f:
            json.dump(dict(META, rows=ROWS), f, indent=1, default=str)


def over_budget(reserve=0.0):
    return time.time() > DEADLINE - reserve


# ----------------------------------------------------------------------------- timing helpers


def _block(x):
    return jax.block_until_ready(x)


def time_calls(fn, *, iters, trials, warmup=2):
    """Median seconds per call of fn() (no arguments; it may carry state between calls)."""
    for _ in range(warmup):
        _block(fn())
    per = []
    for _ in range(trials):
        t = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn()
        _block(out)
        per.append((time.perf_counter() - t) / iters)
    return statistics.median(per)


def record(name, shape, seconds, nbytes, goal="", err=None, note="", **extra):
    row = dict(name=name, shape=shape, us=None if seconds is None else seconds * 1e6,
               tbps=None if not seconds else nbytes / seconds / 1e12, bytes=nbytes, goal=goal,
               max_err=None if err is None else float(err), note=note, **extra)
    ROWS.append(row)
    _flush()
    tb = "-" if row["tbps"] is None else f"{row['tbps']:.3f}"
    us = "-" if row["us"] is None else f"{row['us']:.1f}"
    print(f"  {name:<34} {shape:<34} {us:>10} us {tb:>7} TB/s  err={row['max_err']}  {note}", flush=True)
    return row


def fail(name, shape, exc):
    traceback.print_exc()
    ROWS.append(dict(name=name, shape=shape, us=None, tbps=None, bytes=0, goal="", max_err=None,
                     note=f"FAILED: {type(exc).__name__}: {str(exc)[:160]}"))
    _flush()


# ----------------------------------------------------------------------------- data


def decode_setup(key, *, B, ctx, Hq, Hkv, D, ps, layers=2, window=None, dtype=jnp.bfloat16):
    """Arena of `layers`-layer KV envelopes filled with finite random values (the sink too), page
    tables of distinct pages in random order; with a window, pages wholly before it are
    tombstoned (0) and never allocated, as the engine does."""
    P = -(-ctx // ps)
    first_live = 0 if window is None else max(0, ctx - window) // ps
    live = P - first_live
    npages = 1 + B * live
    W = Hkv * D
    view = KVView(rows_per_page=layers * 2 * ps, page_size=ps, k_row=(layers - 1) * 2 * ps,
                  v_row=(layers - 1) * 2 * ps + ps, num_kv_heads=Hkv, head_dim=D, v_head_dim=D, row_words=W)
    k1, k2, k3 = jax.random.split(key, 3)
    arena = jax.jit(lambda k: jax.lax.bitcast_convert_type(
        jax.random.normal(k, (npages * view.rows_per_page, W), dtype), jnp.uint16))(k1)
    perm = np.asarray(jax.random.permutation(k2, np.arange(1, npages, dtype=np.int32)))
    pt = np.zeros((B, P), np.int32)
    pt[:, first_live:] = perm.reshape(B, live)
    q = jax.random.normal(k3, (B, Hq, D), dtype)
    lengths = jnp.full((B,), ctx, jnp.int32)
    return view, arena, jnp.asarray(pt), lengths, q


def head_major(arena, view, npages):
    """The same K/V in jax paged_attention's layout: [Hkv, pages, page_size, D] each."""
    ps, Hkv, D = view.page_size, view.num_kv_heads, view.head_dim
    a = jax.lax.bitcast_convert_type(arena, jnp.bfloat16).reshape(npages, view.rows_per_page, view.row_words)
    k = a[:, view.k_row:view.k_row + ps].reshape(npages, ps, Hkv, D).transpose(2, 0, 1, 3)
    v = a[:, view.v_row:view.v_row + ps].reshape(npages, ps, Hkv, D).transpose(2, 0, 1, 3)
    return k, v


def max_err(a, b):
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


# ----------------------------------------------------------------------------- benchmarks


def bench_copy(a):
    n = (2 << 20) if a.small else (2 << 30)   # 4 MiB / 4 GiB of uint16
    x = jnp.zeros((n // 1024, 1024), jnp.uint16)
    f = jax.jit(lambda x: x ^ jnp.uint16(1))   # a pure stream: read n*2 bytes, write n*2 bytes
    ok = int(jnp.max(f(x))) == 1
    t = time_calls(lambda: f(x), iters=a.iters, trials=a.trials)
    return record("copy_roofline", f"{n * 2 >> 20} MiB u16 xor", t, 2 * n * 2, note="" if ok else "WRONG")


def _decode_fn(view, window=None, **tuning):
    return jax.jit(lambda q, arena, pt, ln: paged_decode_attention(q, arena, pt, ln, view=view, window=window,
                                                                   impl="pallas", interpret=INTERPRET, **tuning))


def _kv_bytes(B, visible, view):
    return B * visible * view.num_kv_heads * (view.head_dim + view.v_head_dim) * 2


def bench_decode_one(a, label, *, B, ctx, Hq, Hkv, D, ps, window=None, goal="", tunings=({},), key=0):
    shape = f"B={B} ctx={ctx} {Hq}/{Hkv}h D={D} ps={ps}" + (f" w={window}" if window else "")
    view, arena, pt, ln, q = decode_setup(jax.random.PRNGKey(key), B=B, ctx=ctx, Hq=Hq, Hkv=Hkv, D=D, ps=ps,
                                          window=window)
    ref = jax.jit(lambda q, arena, pt, ln: paged_decode_attention_reference(q, arena, pt, ln, view=view,
                                                                            window=window))(q, arena, pt, ln)
    visible = min(ctx, window or ctx)
    nbytes = _kv_bytes(B, visible, view)
    best = None
    for i, tune in enumerate(tunings):
        if i and best is not None and over_budget(reserve=120):
            print(f"    sweep {label}: time budget reached, stopping after {i} configs", flush=True)
            break
        try:
            f = _decode_fn(view, window, **tune)
            err = max_err(f(q, arena, pt, ln), ref)
            t = time_calls(lambda: f(q, arena, pt, ln), iters=a.iters, trials=a.trials)
            if len(tunings) > 1:
                print(f"    sweep {label} {tune}: {t * 1e6:.1f} us {nbytes / t / 1e12:.3f} TB/s err={err:.2e}",
                      flush=True)
            if err <= 2e-2 and (best is None or t < best[0]):
                best = (t, tune, err)
        except Exception as e:  # noqa: BLE001 - one bad config must not end a one-shot GPU run
            print(f"    sweep {label} {tune}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
    if best is None:
        raise RuntimeError(f"{label}: no configuration was correct")
    t, tune, err = best
    row = record(label, shape, t, nbytes, goal=goal, err=err, note=str(tune) if tune else "", tuning=tune)
    return row, (view, arena, pt, ln, q, ref)


def decode_tunings(a):
    """Default first, then tokens per block x warps x pipeline stages.  Shared memory is about
    (stages - 1) * 2 tiles * block_tokens * D * 2 bytes; configs over the SM's 227 KiB fail to
    launch and are reported as such."""
    if a.small or not a.sweep:
        return ({},)
    out = [{}]
    for bt in (32, 64, 128):
        for nw in (4, 8):
            for ns in (2, 3, 4):
                out.append(dict(block_tokens=bt, num_warps=nw, num_stages=ns))
    return tuple(out)


def bench_decode(a):
    if a.small:
        return bench_decode_one(a, "decode", B=2, ctx=64, Hq=8, Hkv=2, D=32, ps=16, goal=">=3.4 TB/s")
    return bench_decode_one(a, "decode", B=64, ctx=4096, Hq=32, Hkv=8, D=128, ps=16, goal=">=3.4 TB/s",
                            tunings=decode_tunings(a))


def bench_decode_long(a, best_tune):
    if a.small:
        return bench_decode_one(a, "decode_long", B=1, ctx=256, Hq=4, Hkv=1, D=32, ps=16, goal=">=2.5 TB/s")
    base = dict(best_tune or {})
    tunings = [base] + ([dict(base, num_splits=s) for s in (4, 8, 16, 32)] if a.sweep else [])
    return bench_decode_one(a, "decode_long", B=8, ctx=32768, Hq=32, Hkv=8, D=128, ps=16, goal=">=2.5 TB/s",
                            tunings=tuple(tunings), key=1)


def bench_window(a, best_tune):
    tune = (dict(best_tune or {}),)
    if a.small:
        kw = dict(B=2, Hq=4, Hkv=1, D=32, ps=16)
        w, ctx = 32, 256
    else:
        kw = dict(B=64, Hq=32, Hkv=8, D=128, ps=16)
        w, ctx = 512, 32768
    rw, _ = bench_decode_one(a, "window_decode", ctx=ctx, window=w, goal="<=1.2x full@w", tunings=tune, key=2, **kw)
    rf, _ = bench_decode_one(a, "full_decode_same_tokens", ctx=w, tunings=tune, key=3, **kw)
    if rw["us"] and rf["us"]:
        rw["note"] = (rw["note"] + f" ratio_vs_full={rw['us'] / rf['us']:.2f}x").strip()
        rw["ratio_vs_full"] = rw["us"] / rf["us"]


def bench_baselines(a, decode_ctx):
    """jax's shipped Triton paged_attention (its own head-major layout) and cuDNN dense attention
    on the same K/V bytes as the main decode shape."""
    view, arena, pt, ln, q, ref = decode_ctx
    B, Hq, D = q.shape
    ctx = int(ln[0])
    shape = f"B={B} ctx={ctx} {Hq}/{view.num_kv_heads}h D={D} ps={view.page_size}"
    nbytes = _kv_bytes(B, ctx, view)
    npages = arena.shape[0] // view.rows_per_page
    k_pages, v_pages = head_major(arena, view, npages)
    k_pages, v_pages = _block(k_pages), _block(v_pages)
    ours = next(r for r in ROWS if r["name"] == "decode" and r.get("us"))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    except Exception as e:  # noqa: BLE001 - deprecated upstream; may be gone in a later jax
        paged_attention = None
        ROWS.append(dict(name="jax_paged_attention(best)", shape=shape, us=None, tbps=None, bytes=nbytes, goal="",
                         max_err=None, note=f"unavailable: {type(e).__name__}: {str(e)[:100]}"))
    try:
        if paged_attention is None:
            raise LookupError
        best = None
        P = pt.shape[1]
        qs = (q.astype(jnp.float32) / math.sqrt(D)).astype(q.dtype)  # it does not scale q itself
        for ks in (16, 8, 4, 1):
            if P % ks:
                continue
            f = jax.jit(lambda q, k, v, pt, ln, ks=ks: paged_attention(q, k, v, pt, ln, k_splits=ks,
                                                                       interpret=INTERPRET))
            try:
                err = max_err(f(qs, k_pages, v_pages, pt, ln), ref)
                t = time_calls(lambda: f(qs, k_pages, v_pages, pt, ln), iters=a.iters, trials=a.trials)
                print(f"    jax paged_attention k_splits={ks}: {t * 1e6:.1f} us err={err:.2e}", flush=True)
                if best is None or t < best[0]:
                    best = (t, ks, err)
            except Exception as e:  # noqa: BLE001
                print(f"    jax paged_attention k_splits={ks}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        if best:
            t, ks, err = best
            r = record("jax_paged_attention(best)", shape, t, nbytes, goal="ours >=2x faster", err=err,
                       note=f"k_splits={ks}; ours {t / (ours['us'] * 1e-6):.2f}x faster")
            r["speedup_ours"] = t / (ours["us"] * 1e-6)
    except LookupError:
        pass
    except Exception as e:  # noqa: BLE001
        fail("jax_paged_attention(best)", shape, e)

    if jax.default_backend() != "gpu":
        ROWS.append(dict(name="cudnn_dense", shape=shape, us=None, tbps=None, bytes=nbytes, goal="",
                         max_err=None, note="skipped: needs a GPU"))
        return
    try:
        # Dense [B, S, Hkv, D] K/V holding the same values (gathered once, outside the timing).
        kd = k_pages[:, pt].transpose(1, 2, 3, 0, 4).reshape(B, ctx, view.num_kv_heads, D)
        vd = v_pages[:, pt].transpose(1, 2, 3, 0, 4).reshape(B, ctx, view.num_kv_heads, D)
        f = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q[:, None], k, v, implementation="cudnn")[:, 0])
        err = max_err(f(q, kd, vd), ref)
        t = time_calls(lambda: f(q, kd, vd), iters=a.iters, trials=a.trials)
        record("cudnn_dense", shape, t, nbytes, err=err, note=f"ours {t / (ours['us'] * 1e-6):.2f}x faster")
    except Exception as e:  # noqa: BLE001
        fail("cudnn_dense", shape, e)


def bench_relocate(a):
    W = 1024
    sizes = (16 << 10, 64 << 10, 256 << 10, 1 << 20)
    total = (1 << 20) if a.small else (512 << 20)
    if a.small:
        sizes = (16 << 10, 64 << 10)
    for page_bytes in sizes:
        rpp = page_bytes // (2 * W)
        n = max(1, total // page_bytes)
        shape = f"{n} x {page_bytes >> 10} KiB pages"
        try:
            npages = 1 + 2 * n
            arena = jax.jit(lambda k: jax.random.bits(k, (npages * rpp, W), jnp.uint16))(jax.random.PRNGKey(4))
            perm = np.random.default_rng(0).permutation(np.arange(1, npages, dtype=np.int32))
            src, dst = jnp.asarray(perm[:n]), jnp.asarray(perm[n:])
            ours = jax.jit(lambda ar, s, d: move_pages(ar, s, d, rows_per_page=rpp, impl="pallas",
                                                       interpret=INTERPRET), donate_argnums=0)
            xla = jax.jit(lambda ar, s, d: move_pages_reference(ar, s, d, rows_per_page=rpp), donate_argnums=0)
            want = xla(arena.copy(), src, dst)
            got = ours(arena, src, dst)
            exact = bool(jnp.array_equal(got, want))
            del want
            state = [got]

            def run(f):
                state[0] = f(state[0], src, dst)
                return state[0]

            nbytes = 2 * n * page_bytes
            t = time_calls(lambda: run(ours), iters=a.iters, trials=a.trials)
            record("relocate_pallas", shape, t, nbytes, goal=">=3.4 TB/s", err=0.0 if exact else 1.0,
                   note="exact" if exact else "MISMATCH")
            t = time_calls(lambda: run(xla), iters=a.iters, trials=a.trials)
            record("relocate_xla_scatter", shape, t, nbytes)
            del state[0], arena
        except Exception as e:  # noqa: BLE001
            fail("relocate_pallas", shape, e)


def bench_kv_write(a):
    Hkv, D, ps = (2, 32, 16) if a.small else (8, 128, 16)
    view = KVView(rows_per_page=4 * ps, page_size=ps, k_row=2 * ps, v_row=3 * ps, num_kv_heads=Hkv, head_dim=D,
                  v_head_dim=D, row_words=Hkv * D)
    for T in ((8, 64) if a.small else (64, 8192)):
        shape = f"T={T} {Hkv}h D={D} ps={ps}"
        try:
            npages = 1 + max(T // ps, 1) * 2
            arena = jnp.zeros((npages * view.rows_per_page, view.row_words), jnp.uint16)
            key = jax.random.PRNGKey(5)
            k = jax.random.normal(key, (T, Hkv, D), jnp.bfloat16)
            v = jax.random.normal(jax.random.fold_in(key, 1), (T, Hkv, D), jnp.bfloat16)
            pos = np.random.default_rng(1).permutation((npages - 1) * ps)[:T]
            pages = jnp.asarray(1 + pos // ps, jnp.int32)
            slots = jnp.asarray(pos % ps, jnp.int32)
            ours = jax.jit(lambda ar, k, v, p, s: write_kv(ar, k, v, p, s, view=view, impl="pallas",
                                                           interpret=INTERPRET), donate_argnums=0)
            xla = jax.jit(lambda ar, k, v, p, s: write_kv_reference(ar, k, v, p, s, view=view), donate_argnums=0)
            want = xla(arena.copy(), k, v, pages, slots)
            got = ours(arena, k, v, pages, slots)
            exact = bool(jnp.array_equal(got, want))
            state = [got]

            def run(f):
                state[0] = f(state[0], k, v, pages, slots)
                return state[0]

            nbytes = 2 * T * Hkv * 2 * D * 2
            t = time_calls(lambda: run(ours), iters=a.iters, trials=a.trials)
            record("kv_write_pallas", shape, t, nbytes, err=0.0 if exact else 1.0, note="exact" if exact else "MISMATCH")
            t = time_calls(lambda: run(xla), iters=a.iters, trials=a.trials)
            record("kv_write_xla_scatter", shape, t, nbytes)
        except Exception as e:  # noqa: BLE001
            fail("kv_write_pallas", shape, e)


def bench_bitcast_probe(a):
    """Is a whole-arena same-width view (uint16 -> bf16 -> uint16 around an aliased kernel) free
    on this backend?  Times one small page move on a 2 GiB arena with and without the view and
    reads the compiled temp bytes.  (XLA:CPU emits the view as an elementwise pass + a temp the
    size of the arena; the kernels here never view the whole arena, other modules may.)"""
    rows = (1 << 20) // 1024 if a.small else (1 << 30) // 1024   # 2 MiB / 2 GiB of uint16
    arena = jnp.zeros((rows, 1024), jnp.uint16)
    s_, d_ = jnp.array([1], jnp.int32), jnp.array([2], jnp.int32)
    mv = lambda x: move_pages(x, s_, d_, rows_per_page=8, impl="pallas", interpret=INTERPRET)
    plain = jax.jit(mv, donate_argnums=0)
    viewed = jax.jit(lambda x: jax.lax.bitcast_convert_type(
        mv(jax.lax.bitcast_convert_type(x, jnp.bfloat16)), jnp.uint16), donate_argnums=0)
    shape = f"{rows * 2048 >> 20} MiB arena, one 16 KiB move"
    state = [arena]
    for name, f in (("move_plain", plain), ("move_with_bf16_view", viewed)):
        temp = f.lower(state[0]).compile().memory_analysis().temp_size_in_bytes

        def run(f=f):
            state[0] = f(state[0])
            return state[0]

        t = time_calls(run, iters=a.iters, trials=a.trials)
        record(f"bitcast_probe:{name}", shape, t, 2 * 16384, note=f"temp={temp / 2**20:.1f} MiB")


# ----------------------------------------------------------------------------- main


def verdict(r):
    """met / MISSED for the rows that carry a goal (empty when there is none or no number)."""
    name, tb = r["name"], r.get("tbps")
    if name in ("decode", "relocate_pallas") and tb:
        return "met" if tb >= 3.4 else "MISSED"
    if name == "decode_long" and tb:
        return "met" if tb >= 2.5 else "MISSED"
    if name == "window_decode" and r.get("ratio_vs_full"):
        return "met" if r["ratio_vs_full"] <= 1.2 else "MISSED"
    if name.startswith("jax_paged_attention") and r.get("speedup_ours"):
        return "met" if r["speedup_ours"] >= 2.0 else "MISSED"
    return ""


def table(rows):
    lines = [f"{'benchmark':<28} {'shape':<36} {'us':>10} {'TB/s':>7} {'max_err':>9}  {'goal':<18} {'':<6} note"]
    for r in rows:
        us = "-" if r["us"] is None else f"{r['us']:.1f}"
        tb = "-" if r["tbps"] is None else f"{r['tbps']:.3f}"
        err = "-" if r["max_err"] is None else f"{r['max_err']:.1e}"
        r["verdict"] = "" if META.get("small") else verdict(r)  # interpret-mode times mean nothing
        lines.append(f"{r['name']:<28} {r['shape']:<36} {us:>10} {tb:>7} {err:>9}  {r['goal']:<18} "
                     f"{r['verdict']:<6} {r['note']}")
    return "\n".join(lines)


INTERPRET = False


def main(argv=None):
    global INTERPRET, JSON_PATH, DEADLINE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes in interpret mode (CPU, seconds)")
    ap.add_argument("--only", default=",".join(GROUPS), help=f"comma list of {','.join(GROUPS)}")
    ap.add_argument("--iters", type=int, default=None, help="calls per timed trial")
    ap.add_argument("--trials", type=int, default=None, help="timed trials (median)")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the decode tuning sweep")
    ap.add_argument("--json", default=None, help="write rows here (default $OUT/bench_kernels.json if $OUT)")
    ap.add_argument("--budget", type=float, default=420.0,
                    help="seconds; sweeps stop early and later groups are skipped past it (default 420)")
    a = ap.parse_args(argv)
    silence_triton_deprecation()
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    INTERPRET = a.small or jax.default_backend() != "gpu"
    a.small = a.small or jax.default_backend() != "gpu"
    a.iters = a.iters or (2 if a.small else 20)
    a.trials = a.trials or (1 if a.small else 5)
    only = set(a.only.split(","))
    unknown = only - set(GROUPS)
    if unknown:
        ap.error(f"unknown groups {sorted(unknown)}")
    dev = jax.devices()[0]
    print(f"jax {jax.__version__} on {dev.platform} {getattr(dev, 'device_kind', '')}"
          f"{' (interpret mode, tiny shapes)' if a.small else ''}", flush=True)

    decode_ctx, best_tune = None, {}
    t0 = time.time()
    DEADLINE = t0 + a.budget
    JSON_PATH = a.json or (os.path.join(os.environ["OUT"], "bench_kernels.json") if os.environ.get("OUT") else None)
    META.update(jax=jax.__version__, device=str(getattr(dev, "device_kind", dev.platform)), small=a.small)

    def want(group):
        if group not in only:
            return False
        if over_budget():
            ROWS.append(dict(name=group, shape="", us=None, tbps=None, bytes=0, goal="", max_err=None,
                             note="skipped: --budget reached"))
            return False
        return True

    if want("copy"):
        try:
            bench_copy(a)
        except Exception as e:  # noqa: BLE001
            fail("copy_roofline", "", e)
    if only & {"decode", "baselines"} and not over_budget():
        try:
            row, decode_ctx = bench_decode(a)
            best_tune = row.get("tuning") or {}
        except Exception as e:  # noqa: BLE001
            fail("decode", "", e)
    if decode_ctx is not None and want("baselines"):
        bench_baselines(a, decode_ctx)
    decode_ctx = None
    if want("decode_long"):
        try:
            bench_decode_long(a, best_tune)
        except Exception as e:  # noqa: BLE001
            fail("decode_long", "", e)
    if want("window"):
        try:
            bench_window(a, best_tune)
        except Exception as e:  # noqa: BLE001
            fail("window_decode", "", e)
    if want("relocate"):
        bench_relocate(a)
    if want("kv_write"):
        bench_kv_write(a)
    if want("bitcast_probe"):
        try:
            bench_bitcast_probe(a)
        except Exception as e:  # noqa: BLE001
            fail("bitcast_probe", "", e)

    text = table(ROWS)
    META["seconds"] = time.time() - t0
    _flush()
    print(f"\n== bench_kernels ({time.time() - t0:.0f} s) ==")
    print(text)
    return 0 if not any("FAILED" in r["note"] or "MISMATCH" in r["note"] for r in ROWS) else 1


if __name__ == "__main__":
    sys.exit(main())
