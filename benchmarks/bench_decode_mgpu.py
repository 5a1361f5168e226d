"""The Mosaic GPU paged decode kernel against the Triton one, cuDNN dense attention and the copy
limit, in one run (issue 17, item 4).

    python3 -m benchmarks.bench_decode_mgpu                  # the H200: every shape, a small sweep
    python3 -m benchmarks.bench_decode_mgpu --only main,b1 --no-sweep

Per shape: both kernels checked against the plain-JAX reference on the same arena (max error),
then timed (timing.time_calls: per-call median of --trials runs of --iters calls); the Mosaic
kernel at its default tiling and, with the sweep, at other (block_kv, ring_slots, num_splits).
Bandwidth = the K/V bytes of the visible positions / time.  Goals (issue 17): Mosaic >= Triton's
TB/s on every shape, >= 0.95x cuDNN dense on the same bytes at B=64 ctx 4096, >= 85% of the copy
limit measured at the start of the same run.  The table comes last; with $OUT the rows go to
$OUT/bench_decode_mgpu.json too.

The "fp8" shape (B=64 ctx 4096, 32/8 heads, D=128, page 16, e4m3 K/V with per-kv-head scales) times
four kernels in one call: the Triton and the Mosaic kernel on the fp8 arena (backend "triton" /
"mgpu"; auto keeps fp8 on Triton while the Mosaic kernel is slower on this row) and both on a bf16
arena of the same geometry; each checked against the reference on its own arena.  Its TB/s count the bytes read
(1 byte a value for fp8); the second table sets the fp8 kernels against each other and against bf16.

    python3 -m benchmarks.bench_decode_mgpu --only fp8          # that row alone (with its sweep)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from umem_jax.memory.plan import KVView
from umem_jax.pallas_kernels._compat import silence_triton_deprecation
from umem_jax.pallas_kernels.paged_decode import paged_decode_attention, paged_decode_attention_reference
from umem_jax.pallas_kernels.paged_decode_mgpu import DecodeMgpuConfig, paged_decode_attention_mgpu
from umem_jax.pallas_kernels.words import encode_fp8

from .copy_limit import copy_limit
from .decode_peers import cudnn_dense_call, decode_setup, head_major, kv_bytes, max_err
from .report import RowLog, fmt, format_table, json_path
from .timing import time_calls


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    B: int
    ctx: int
    Hq: int
    Hkv: int
    D: int
    ps: int = 16
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    fp8: bool = False  # e4m3 K/V (per-kv-head scales); the row also times bf16 K/V of the same geometry

    def label(self) -> str:
        extra = (f" w={self.window}" if self.window else "") + (" softcap" if self.softcap else "") + \
                (" sinks" if self.sinks else "") + (" fp8" if self.fp8 else "")
        return f"B={self.B} ctx={self.ctx} {self.Hq}/{self.Hkv}h D={self.D} ps={self.ps}{extra}"


SHAPES = (
    Shape("main", 64, 4096, 32, 8, 128),                      # bench_kernels' decode shape; cuDNN peer
    Shape("long", 8, 32768, 32, 8, 128),
    Shape("b1", 1, 16384, 32, 8, 128),                        # one request: split-K carries it
    Shape("window", 64, 32768, 32, 8, 128, window=512),
    Shape("gqa6", 64, 4096, 48, 8, 128),
    Shape("gqa6_d80", 64, 4096, 48, 8, 80),
    Shape("gptoss", 64, 4096, 64, 8, 64, window=128, sinks=True),  # gpt-oss's sliding layers
    Shape("d256_softcap", 64, 4096, 8, 4, 256, softcap=50.0),      # Gemma-like head dim
    Shape("page64", 64, 4096, 32, 8, 128, ps=64),
    Shape("fp8", 64, 4096, 32, 8, 128, fp8=True),            # the Mosaic fp8 path vs Triton's, and vs bf16
    # fp8 in 64-token pages: two TMA copies of 8 KB a block where 16-token pages take sixteen of 2 KB (does the
    # number of copies bound the Mosaic fp8 path?)
    Shape("fp8_p64", 64, 4096, 32, 8, 128, ps=64, fp8=True),
)
# Shapes timed against cuDNN dense attention on the same bytes too: the goal's shape, and D = 80, where both paged
# kernels reach a lower share of the copy limit than at D = 128 (is it the head dim or the paging?).
CUDNN_PEERS = ("main", "gqa6_d80")


def sweep_configs(D: int, fp8: bool = False, only: str | None = None) -> list[DecodeMgpuConfig]:
    """The Mosaic tilings timed besides the default (num_splits None: the wrapper's choice from the
    grid size; fixed 2 and 4 timed too).  Two consumer warpgroups (taking the blocks in turn) fit at
    D <= 128, three in 64-token blocks (more warps converting fp8 at once, 152 registers a thread);
    fp8's dequantisation in whole-row register chunks (dequant_cols = D) is the default at D = 128,
    64-column chunks timed beside it; fp8's transposed form (S^T = K Q^T with K converted into
    registers, one or two consumers) where D is a multiple of 64."""
    C = DecodeMgpuConfig
    if fp8:  # the default at D <= 128 is two consumers, (128, 2); one consumer, 64-token blocks, chunk widths
        if D > 128:
            return _only([C(64, 2)], only)
        out = []  # the newest experiments first, so that a sweep cut short by its budget still times them
        if D % 64 == 0:  # the transposed form, two consumers (each its own reduction scratch since session 38), one
            out += [C(128, 2, None, 2, D, True), C(128, 4, None, 2, D, True), C(64, 4, None, 2, D, True),
                    C(128, 2, None, 1, D, True)]
        out += [C(128, 4), C(128, 2), C(64, 4, None, 2), C(128, 2, None, 2, 64), C(64, 4, None, 2, D),
                C(64, 3, None, 3, D), C(64, 3, None, 3, 64)]
        return _only(out, only)
    out = [C(128, 2), C(64, 3), C(64, 4)]
    if D <= 128:
        out += [C(128, 3), C(128, 2, None, 2), C(64, 4, None, 2), C(64, 3, None, 3)]
    # More splits than the grid needs: more, shorter programs, so the last wave's idle SMs cost less.
    out += [C(128, 2, 2), C(128, 2, 4)]
    return _only(out, only)


def _only(configs: list[DecodeMgpuConfig], only: str | None) -> list[DecodeMgpuConfig]:
    """The configs `only` names ("128x2,64x4": block_kv x ring_slots, any splits and consumers)."""
    if not only:
        return configs
    keep = {tuple(int(x) for x in c.split("x")) for c in only.split(",")}
    return [c for c in configs if (c.block_kv, c.ring_slots) in keep]


def config_label(c: DecodeMgpuConfig) -> str:
    """A sweep row's name: the fields that differ from one untransposed consumer's."""
    return f"bkv={c.block_kv} slots={c.ring_slots}" + (f" consumers={c.consumers}" if c.consumers > 1 else "") + \
        (f" dequant_cols={c.dequant_cols}" if c.dequant_cols else "") + (" transposed" if c.transposed else "") + \
        f" splits={c.num_splits}"


def fp8_setup(key, s: Shape):
    """decode_setup's geometry with fp8 K/V: arena rows of Hkv * D / 2 words (e4m3 pairs) filled with
    random normal values (the sink too), random per-kv-head k/v scales, page tables of distinct
    pages in random order -> (view, arena, pt, lengths, q, k_scale, v_scale)."""
    P = -(-s.ctx // s.ps)
    npages, layers = 1 + s.B * P, 2
    W = s.Hkv * s.D // 2
    view = KVView(rows_per_page=layers * 2 * s.ps, page_size=s.ps, k_row=(layers - 1) * 2 * s.ps,
                  v_row=(layers - 1) * 2 * s.ps + s.ps, num_kv_heads=s.Hkv, head_dim=s.D, v_head_dim=s.D,
                  row_words=W, fp8=True)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    arena = jax.jit(lambda k: encode_fp8(jax.random.normal(k, (npages * view.rows_per_page, s.Hkv * s.D),
                                                           jnp.bfloat16)))(k1)
    perm = np.asarray(jax.random.permutation(k2, np.arange(1, npages, dtype=np.int32)))
    pt = jnp.asarray(perm.reshape(s.B, P))
    q = jax.random.normal(k3, (s.B, s.Hq, s.D), jnp.bfloat16)
    ks, vs = (jax.random.uniform(k, (s.Hkv,), jnp.float32, 0.5, 1.5) for k in jax.random.split(k4))
    return view, arena, pt, jnp.full((s.B,), s.ctx, jnp.int32), q, ks, vs


def shape_inputs(s: Shape, fp8: bool | None = None):
    """Shape s's inputs, the same in every run and script -> (paged_decode_attention's keyword
    arguments, arena, page table, lengths, q, the K/V bytes a call reads); fp8 (None: s.fp8): the
    e4m3 arena of fp8_setup with its scales (one byte a value), else decode_setup's bf16 one."""
    key = jax.random.PRNGKey(SHAPES.index(s))  # not hash(name): str hashes change from run to run
    sinks = jax.random.normal(jax.random.PRNGKey(5), (s.Hq,), jnp.float32) if s.sinks else None
    kw = dict(window=s.window, softcap=s.softcap, sinks=sinks)
    if s.fp8 if fp8 is None else fp8:
        view, arena, pt, ln, q, ks, vs = fp8_setup(key, s)
        kw.update(k_scale=ks, v_scale=vs)
    else:
        view, arena, pt, ln, q = decode_setup(key, B=s.B, ctx=s.ctx, Hq=s.Hq, Hkv=s.Hkv, D=s.D, page_size=s.ps,
                                              window=s.window)
    nbytes = kv_bytes(s.B, min(s.ctx, s.window or s.ctx), view) // (2 if view.fp8 else 1)
    return dict(view=view, **kw), arena, pt, ln, q, nbytes


def bench_shape(a, s: Shape):
    kw, arena, pt, ln, q, nbytes = shape_inputs(s)
    view = kw["view"]
    row = dict(name=s.name, shape=s.label(), bytes=nbytes)
    if s.fp8:  # bf16 K/V of the same geometry is timed too (bf16_*); the row's own kernels read the fp8 arena
        b_kw, b_arena, b_pt, b_ln, b_q, b_bytes = shape_inputs(s, fp8=False)
        bf16 = dict(kw=b_kw, arena=b_arena, q=b_q, pt=b_pt, ln=b_ln, bytes=b_bytes)
        del b_kw, b_arena, b_pt, b_ln, b_q
    ref = jax.jit(lambda q, a_, p, l: paged_decode_attention_reference(q, a_, p, l, **kw))(q, arena, pt, ln)

    def run(label, kw=kw, arena=arena, q=q, pt=pt, ln=ln, ref=ref, nbytes=nbytes, **extra):
        f = jax.jit(lambda q, a_, p, l: paged_decode_attention(q, a_, p, l, impl="pallas", **kw, **extra))
        try:
            err = max_err(f(q, arena, pt, ln), ref)
            t = time_calls(lambda: f(q, arena, pt, ln), iters=a.iters, trials=a.trials).median
        except Exception as e:  # noqa: BLE001 - one failure must not end a one-shot GPU run
            print(f"  {s.name} {label}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
            if a.verbose:
                traceback.print_exc()
            return None
        ok = err <= 2e-2
        print(f"  {s.name} {label}: {t * 1e6:.1f} us {nbytes / t / 1e12:.3f} TB/s err={err:.2e}"
              f"{'' if ok else ' WRONG'}", flush=True)
        return (t, err, label) if ok else None

    if s.fp8:  # bf16 K/V of the same geometry, in the same run: what fp8 is measured against
        b = bf16
        b_ref = jax.jit(lambda q, a_, p, l: paged_decode_attention_reference(q, a_, p, l, **b["kw"]))(
            b["q"], b["arena"], b["pt"], b["ln"])
        b_run = functools.partial(run, kw=b["kw"], arena=b["arena"], q=b["q"], pt=b["pt"], ln=b["ln"], ref=b_ref,
                                  nbytes=b["bytes"])
        b_tri, b_mg = b_run("bf16 triton", backend="triton"), b_run("bf16 mgpu", backend="mgpu")
        row.update(bf16_triton_us=b_tri and b_tri[0] * 1e6, bf16_mgpu_us=b_mg and b_mg[0] * 1e6)
        del b, b_ref, b_run, bf16  # the bf16 arena's memory back before the fp8 timings
    # Every variant compiled and checked first, then timed in --rounds interleaved rounds (the order
    # reversed every other round), each variant's figure the median of its rounds: neighbours in a
    # sweep differ by a few percent, about what one process drifts between its first and last timing.
    variants = []  # (label, the timed call)

    def add(label, fn, args=(q, arena, pt, ln)):
        try:
            err = max_err(fn(*args), ref)
        except Exception as e:  # noqa: BLE001 - one failure must not end a one-shot GPU run
            print(f"  {s.name} {label}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
            if a.verbose:
                traceback.print_exc()
            return
        if err > 2e-2:
            print(f"  {s.name} {label}: err={err:.2e} WRONG", flush=True)
            if not a.keep_wrong:
                return
            label += " WRONG"  # --keep-wrong: timed all the same, to know whether mending it would pay
        errs[label] = err
        variants.append((label, lambda: fn(*args)))

    errs = {}
    for backend in ("triton", "mgpu"):
        add("triton" if backend == "triton" else "mgpu default",
            jax.jit(lambda q, a_, p, l, b=backend: paged_decode_attention(q, a_, p, l, impl="pallas", backend=b, **kw)))
    if a.sweep:
        for cfg in sweep_configs(s.D, s.fp8, a.configs):
            if time.time() > a.deadline:
                break
            add(f"mgpu {config_label(cfg)}",
                jax.jit(lambda q, a_, p, l, cfg=cfg: paged_decode_attention_mgpu(q, a_, p, l, **kw,
                                                                               **dataclasses.asdict(cfg))))
    if s.name in CUDNN_PEERS and jax.default_backend() == "gpu":
        npages = arena.shape[0] // view.rows_per_page
        kp, vp = jax.block_until_ready(head_major(arena, view, npages))
        add("cudnn dense", *cudnn_dense_call(q, kp, vp, pt, s.ctx))
    times = {label: [] for label, _ in variants}
    for r in range(a.rounds):
        for label, call in (variants if r % 2 == 0 else variants[::-1]):
            times[label].append(time_calls(call, iters=a.iters, trials=a.trials).median)
    med = {label: float(np.median(ts)) for label, ts in times.items()}
    for label, t in med.items():
        rounds = "" if a.rounds == 1 else " (rounds: " + ", ".join(f"{x * 1e6:.1f}" for x in times[label]) + ")"
        print(f"  {s.name} {label}: {t * 1e6:.1f} us {nbytes / t / 1e12:.3f} TB/s err={errs[label]:.2e}{rounds}",
              flush=True)
    # --keep-wrong's variants are timed and printed, never the best
    mg = sorted((t, label.removeprefix("mgpu ")) for label, t in med.items()
                if label.startswith("mgpu") and not label.endswith(" WRONG"))
    best = mg[0] if mg else None
    row.update(triton_us=med.get("triton") and med["triton"] * 1e6, triton_err=errs.get("triton"),
               mgpu_default_us=med.get("mgpu default") and med["mgpu default"] * 1e6, mgpu_err=errs.get("mgpu default"),
               mgpu_best_us=best and best[0] * 1e6, mgpu_best=best and best[1], rounds=a.rounds,
               times_us={label: [x * 1e6 for x in ts] for label, ts in times.items()})
    if "cudnn dense" in med:
        row.update(cudnn_us=med["cudnn dense"] * 1e6, cudnn_err=errs["cudnn dense"])
    return a.log.add(row)


def fp8_table(rows) -> str:
    """The fp8 rows: Triton vs Mosaic on fp8 K/V, and each against bf16 K/V in the same run."""
    out = []
    for r in rows:
        if "bf16_mgpu_us" not in r:
            continue
        tb = lambda us: r["bytes"] / (us * 1e-6) / 1e12 if us else None
        tri, mg, b_tri, b_mg = (r.get(k) for k in ("triton_us", "mgpu_default_us", "bf16_triton_us", "bf16_mgpu_us"))
        ratio = lambda x, y: x / y if x and y else None
        out.append([r["name"], r["shape"], fmt(tri, ".1f"), fmt(tb(tri), ".3f"), fmt(mg, ".1f"), fmt(tb(mg), ".3f"),
                    fmt(ratio(tri, mg), ".3f"), fmt(b_tri, ".1f"), fmt(b_mg, ".1f"), fmt(ratio(b_mg, mg), ".3f"),
                    fmt(ratio(b_tri, tri), ".3f")])
    return format_table(["fp8", "", "triton us", "TB/s", "mgpu us", "TB/s", "mgpu speed-up", "bf16 triton us",
                         "bf16 mgpu us", "mgpu bf16/fp8", "triton bf16/fp8"], out, left=2)


def table(a, rows) -> str:
    lim = a.log.meta.get("copy_limit_tbps")
    out = []
    for r in rows:
        tb = lambda us: r["bytes"] / (us * 1e-6) / 1e12 if us else None
        tri, mgd, mgb = tb(r.get("triton_us")), tb(r.get("mgpu_default_us")), tb(r.get("mgpu_best_us"))
        ratio = mgd / tri if mgd and tri else None
        cud = r.get("cudnn_us")
        out.append([r["name"], r["shape"], fmt(r.get("triton_us"), ".1f"), fmt(tri, ".3f"),
                    fmt(r.get("mgpu_default_us"), ".1f"), fmt(mgd, ".3f"), fmt(ratio, ".3f"),
                    fmt(mgb, ".3f"), r.get("mgpu_best") or "-", fmt(mgd / lim if mgd and lim else None, ".3f"),
                    fmt(cud / r["mgpu_default_us"] if cud and r.get("mgpu_default_us") else None, ".3f")])
    return format_table(["shape", "", "triton us", "TB/s", "mgpu us", "TB/s", "mgpu/triton", "best TB/s", "best cfg",
                         "of copy limit", "vs cuDNN"], out, left=2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=None, help="comma list of shape names: " + ",".join(s.name for s in SHAPES))
    ap.add_argument("--no-sweep", dest="sweep", action="store_false")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--budget", type=float, default=400.0, help="seconds; later shapes are skipped past it")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every variant of a shape this many times, interleaved, and take the median")
    ap.add_argument("--configs", default=None,
                    help="the sweep's Mosaic tilings to time, e.g. 128x2,128x3 (block_kv x ring_slots; default all)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--verbose", action="store_true", help="tracebacks of failures")
    ap.add_argument("--keep-wrong", action="store_true",
                    help="time variants over the error tolerance too, labelled WRONG (never a result: a probe of "
                         "whether a fix would pay)")
    a = ap.parse_args(argv)
    silence_triton_deprecation()
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    if jax.default_backend() != "gpu":
        print("bench_decode_mgpu needs a Hopper GPU (the Mosaic GPU kernel has no CPU form)")
        return 0
    dev = jax.devices()[0]
    t0 = time.time()
    a.deadline = t0 + a.budget
    a.log = RowLog(json_path(a.json, "bench_decode_mgpu"), jax=jax.__version__, device=dev.device_kind)
    print(f"jax {jax.__version__} on {dev.device_kind}", flush=True)
    lim = copy_limit(4 << 30, iters=10, trials=5, torch_peer=False)  # bench_kernels' size
    a.log.meta.update(copy_limit_tbps=lim.tbps, copy_limit_variants=lim.variants)
    print(f"  copy limit: {lim.tbps:.3f} TB/s ({lim.fastest}; {lim.variants})", flush=True)
    names = set(a.only.split(",")) if a.only else None
    rows = []
    for s in SHAPES:
        if names and s.name not in names:
            continue
        if time.time() > a.deadline:
            print(f"  {s.name}: skipped (budget)", flush=True)
            continue
        rows.append(bench_shape(a, s))
    a.log.meta["seconds"] = time.time() - t0
    a.log.flush()
    print(f"\n== bench_decode_mgpu ({time.time() - t0:.0f} s; copy limit {lim.tbps:.3f} TB/s) ==")
    print(table(a, rows))
    if any("bf16_mgpu_us" in r for r in rows):
        print("\n" + fp8_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
