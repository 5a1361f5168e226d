"""Whole-model steps at realistic shapes with random bf16 weights: ms per step against a bytes roofline.

  python benchmarks/bench_models.py                          # GPU: three families, --budget 420 s
  python benchmarks/bench_models.py --families gemma3 --ctx 2048
  python benchmarks/bench_models.py --small                  # CPU: tiny shapes, reference kernels, seconds

Families (configs built here, no checkpoint; weights made inside one jit on the device in bf16):
  gemma3     Gemma-3-4B-like: 34 layers (5 sliding w=1024 : 1 global), d 2560, 8 q / 4 kv heads x 256,
             GeGLU 10240, vocab 262144, tied
  nemotronh  NemotronH-8B-like: 52 blocks "M-M-M-M*-...", 24 Mamba2 (128 heads x 64, state 128, 8 groups),
             4 NoPE attention (32 q / 8 kv x 128), 24 relu^2 MLP 21504, d 4096, vocab 131072, untied
  qwen35     Qwen3.5-4B-like: 32 layers, 3 gated DeltaNet (16 k / 32 v heads x 128) : 1 gated attention
             (16 q / 4 kv x 256), d 2560, SwiGLU 9216, vocab 248320, tied

Per family, in this order:
  1. correctness at a reduced size: one layer of each kind the family has (real head and state
     geometry; vocab cut to 16384; Gemma's window cut to 32 so pages slide out of it; NemotronH's
     dt floor set to 0 so cached decode and the cache-free forward compute the same thing).  Two
     requests run a T=64 prefill chunk, a T=64 chunk holding one row's last 16 prompt tokens
     (prefix 64) beside the other row decoding inside the chunk, then a T=1 decode step, all
     through the arena; each row's logits vs `model.dense_logits` on the same tokens:
     max|a - b| / max|b| <= --tol (bf16 on both sides).
  2. the full model: plan(model.decls()) -> size_arena(--arena-gib) -> Arena.create.  For every
     measurement a fresh ChainAllocator hands out token pages and state slots as the engine does
     (a page gets a window page only if a query of the step can see it; older ones are born
     tombstoned) and translates them into the batch's physical page tables; the step is
     `model.jit_forward()` (arena donated), default kernels (Pallas on the GPU).
     Measurements, most important first: decode at B=64 then B=1 (--ctx 2048,8192: one compile
     per batch size, the page-table width fits the longest context), prefill of a 2048-token
     prompt at B=1, a chunk of 512 new tokens after a 1536-token prefix at B=8.

--small: tiny widths and a few layers of each family's pattern, reference kernels, on the CPU; the
check runs on the timed model itself and every bucket uses one page-table width (prefill at B=2),
so a family compiles two step shapes.  Its times mean nothing; it exercises the code path.

Timing: the first call (compile + run) is reported as first_call_s; then warmup, then --trials
runs of --iters steps dispatched back to back (the arena rebound each step) and synchronised
once; ms = per-step median over trials.

Roofline = bytes the step must move / copy bandwidth measured at the start of this run (an XLA
`x ^ 1` over a 4 GiB uint16 buffer, bytes read + written, best of several):
  weights  every parameter once (tied embeddings once, as the LM head; an untied input embedding
           counts only the B*T rows gathered)
  KV       per attention layer: read the K/V of every position the step's queries see (full: all
           kv_len; window w: from the first query's position - w + 1; the step's own new tokens
           included: the layer writes them first, then reads them back), written: the new tokens'
  state    per state layer and row: its tensors written, and read unless the row starts from zero
Not counted: activations, the fp32 logits, page tables.  Goal (the models issue): decode step at
B=64 <= 1.25x roofline.  Prefill rows also give TFLOP/s of the matmuls and attention (approximate).
The table comes last; rows go to $OUT/bench_models.json (or --json) after every row.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
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

from umem_jax.arena import Arena, apply_moves  # noqa: E402
from umem_jax.core.batch import make_batch  # noqa: E402
from umem_jax.memory import ChainAllocator, size_arena  # noqa: E402
from umem_jax.memory import plan as make_plan
from umem_jax.models.config import FULL, MAMBA, SLIDING, MambaConfig  # noqa: E402
from umem_jax.models.gemma3 import gemma3_4b_like  # noqa: E402
from umem_jax.models.model import Model  # noqa: E402
from umem_jax.models.nemotron_h import nemotron_h_8b_like  # noqa: E402
from umem_jax.models.qwen3_5 import qwen3_5_4b_like  # noqa: E402
from umem_jax.models.registry import build_random  # noqa: E402
from umem_jax.pallas_kernels._compat import silence_triton_deprecation  # noqa: E402

GIB = 2**30
ROWS: list[dict] = []
META: dict = {}
JSON_PATH: str | None = None


# =============================================================================== configs

MLP_BLOCK = "mlp"  # NemotronH's third block type


def _gemma_tiny(c):
    return dataclasses.replace(c, vocab_size=512, hidden_size=64, intermediate_size=128, num_heads=4,
                               num_kv_heads=2, head_dim=32, sliding_window=32, query_pre_attn_scalar=32,
                               layer_types=(SLIDING, SLIDING, FULL))


def _nemotron_tiny(c):
    return dataclasses.replace(c, vocab_size=512, hidden_size=64, intermediate_size=128, num_heads=4,
                               num_kv_heads=2, head_dim=16,
                               mamba=MambaConfig(num_heads=4, head_dim=16, state_size=16, n_groups=2,
                                                 conv_kernel=4, chunk_size=16),
                               layer_types=(MAMBA, MLP_BLOCK, MAMBA, FULL, MLP_BLOCK), time_step_min=0.0)


def _qwen_tiny(c):
    return dataclasses.replace(c, vocab_size=512, hidden_size=64, intermediate_size=128, num_heads=4,
                               num_kv_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=16, linear_value_head_dim=16,
                               layer_types=(MAMBA, MAMBA, FULL))


def _reduce(c, types, **kw):
    """The correctness model: one layer of each kind, the family's own geometry, a small vocab."""
    return dataclasses.replace(c, layer_types=types, vocab_size=min(c.vocab_size, 16384), **kw)


FAMILIES = {
    "gemma3": dict(name="gemma3-4b-like", full=gemma3_4b_like, tiny=_gemma_tiny,
                   check=lambda c: _reduce(c, (SLIDING, FULL), sliding_window=32)),
    "nemotronh": dict(name="nemotronh-8b-like", full=nemotron_h_8b_like, tiny=_nemotron_tiny,
                      check=lambda c: _reduce(c, (MAMBA, FULL, MLP_BLOCK), time_step_min=0.0)),
    "qwen35": dict(name="qwen3.5-4b-like", full=qwen3_5_4b_like, tiny=_qwen_tiny,
                   check=lambda c: _reduce(c, (MAMBA, FULL))),
}
ALIASES = {v["name"]: k for k, v in FAMILIES.items()}


def build_model(cfg, seed: int = 0) -> Model:
    """Random weights of `cfg` made on the default device (in cfg.dtype; nothing passes through the
    host), by registry.build_random: one jitted generator per distinct weight shape."""
    return build_random(cfg, cfg.dtype, seed=seed)


# =============================================================================== output


def _flush():
    if JSON_PATH:
        os.makedirs(os.path.dirname(os.path.abspath(JSON_PATH)), exist_ok=True)
        with open(JSON_PATH, "w") as f:
            json.dump(dict(META, rows=ROWS), f, indent=1, default=str)


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def record(**row) -> dict:
    row.setdefault("note", "")
    ROWS.append(row)
    _flush()
    print(f"  {row.get('family', ''):<18} {row['kind']:<8} B={_fmt(row.get('B'), 'd'):<3} "
          f"T={_fmt(row.get('T'), 'd'):<5} ctx={_fmt(row.get('ctx'), 'd'):<5} {_fmt(row.get('ms'), '.3f'):>9} ms  "
          f"roofline {_fmt(row.get('roofline_ms'), '.3f'):>8} ms  ratio {_fmt(row.get('ratio'), '.2f'):>5}  "
          f"first {_fmt(row.get('first_call_s'), '.1f')} s  {row.get('verdict', '')} {row['note']}", flush=True)
    return row


def fail(family, kind, exc, **kw):
    traceback.print_exc()
    return record(family=family, kind=kind, ms=None, verdict="FAILED",
                  note=f"FAILED: {type(exc).__name__}: {str(exc)[:300]}", **kw)


# =============================================================================== timing


def _block(x):
    return jax.block_until_ready(x)


def measure_copy(small: bool, trials: int) -> float:
    """Copy bandwidth (bytes/s, read + written) of an XLA elementwise `x ^ 1` over 4 GiB of uint16
    (4 MiB with --small); best of `trials` runs of 10 calls."""
    rows = (2**11) if small else (2**21)          # x 1024 u16 words: 4 MiB / 4 GiB
    x = jax.jit(lambda: jnp.zeros((rows, 1024), jnp.uint16))()
    f = jax.jit(lambda x: x ^ jnp.uint16(1))
    ok = int(jnp.max(f(x))) == 1 and int(jnp.min(f(x))) == 1
    iters, best = 10, float("inf")
    _block(f(x))
    for _ in range(trials):
        t = time.perf_counter()
        out = None
        for _ in range(iters):
            out = f(x)
        _block(out)
        best = min(best, (time.perf_counter() - t) / iters)
    nbytes = 2 * x.nbytes
    del x, out
    bw = nbytes / best
    record(family="-", kind="copy", B=None, T=None, ctx=None, ms=best * 1e3, bytes=nbytes, tbps=bw / 1e12,
           note=f"{nbytes / 2 / GIB:.3g} GiB u16 x^1: {bw / 1e12:.3f} TB/s (read + written, best of {trials})"
           + ("" if ok else " WRONG VALUES"))
    return bw


class Stepper:
    """Holds the newest arena and runs the donated step on it."""

    def __init__(self, step, params, arena):
        self.step, self.params, self.arena = step, params, arena

    def __call__(self, batch):
        logits, self.arena = self.step(self.params, self.arena, batch)
        return logits


def time_steps(run: Stepper, batch, *, iters: int, trials: int, warmup: int):
    """-> (median s per step, min s, first call s, logits of the first call)."""
    t = time.perf_counter()
    first = _block(run(batch))
    first_s = time.perf_counter() - t
    for _ in range(warmup):
        _block(run(batch))
    per = []
    for _ in range(trials):
        t = time.perf_counter()
        for _ in range(iters):
            run(batch)
        _block(run.arena)
        per.append((time.perf_counter() - t) / iters)
    return statistics.median(per), min(per), first_s, first


# =============================================================================== host allocation


class ArenaFull(RuntimeError):
    pass


class Pager:
    """Pages and slots for one step's requests through a ChainAllocator, as the engine takes them.

    A request holds a list of token page ids (virtual) and one state slot.  Before a step writes
    positions [start, end): pages up to `end` exist; a page gets a window page only if a query at
    a position >= start can see it (the earlier ones are born tombstoned, or released now).
    """

    def __init__(self, plan, num_rows: int):
        self.plan, self.ps = plan, plan.page_size
        self.alloc = ChainAllocator(plan, num_rows)

    def new(self) -> dict:
        slot = -1
        if self.plan.state is not None:
            got = self.alloc.alloc_state_slots(1)
            if got is None:
                raise ArenaFull(f"no state slot: {self.alloc.last_shortfall}")
            slot = int(got[0])
        return dict(pages=[], slot=slot, wfirst={sp.name: 0 for sp in self.plan.windows})

    def extend(self, req: dict, start: int, end: int) -> None:
        ps, pages = self.ps, req["pages"]
        first = {sp.name: max(0, start - sp.window + 1) // ps for sp in self.plan.windows}
        old = len(pages)
        for name, f in first.items():  # window pages no query from `start` on can see
            lo, hi = req["wfirst"][name], min(f, old)
            if hi > lo:
                self.alloc.release_window_pages(np.asarray(pages[lo:hi], np.int32), name)
                req["wfirst"][name] = hi
        need = -(-end // ps) - old
        if need <= 0:
            return
        dead = {name: min(need, max(0, f - old)) for name, f in first.items()}
        vids = self.alloc.alloc_token_pages(need, window_pages={n: need - d for n, d in dead.items()} or None)
        if vids is None:
            raise ArenaFull(str(self.alloc.last_shortfall))
        for name, d in dead.items():
            if d:
                req["wfirst"][name] = old + d
        pages.extend(int(v) for v in vids)

    def batch(self, reqs, tokens, q_lens, kv_lens, width: int):
        vids = np.full((len(reqs), width), -1, np.int64)
        for b, r in enumerate(reqs):
            vids[b, :len(r["pages"])] = r["pages"]
        tables = {sp.name: self.alloc.translate_pages(vids, sp.name, width) for sp in self.plan.token_pools}
        slots = None
        if self.plan.state is not None:
            slots = self.alloc.translate_slots(np.array([r["slot"] for r in reqs], np.int64))
        return make_batch(tokens, q_lens, kv_lens, tables, slots)


# =============================================================================== bytes and flops


def step_costs(cfg, plan, param_count: int, param_bytes: int, *, B: int, T: int, start: int) -> dict:
    """Bytes the step must move at least (see the module doc) and its matmul + attention FLOPs."""
    end = start + T
    wbytes = jnp.dtype(cfg.dtype).itemsize
    embed = cfg.vocab_size * cfg.hidden_size
    weights = param_bytes
    if not cfg.tie_word_embeddings:  # the input table is gathered, not streamed
        weights += -embed * wbytes + B * T * cfg.hidden_size * wbytes
    kv_read = kv_write = 0
    attn_flops = 0.0
    pos = np.arange(start, end, dtype=np.int64)
    for sp in plan.token_pools:
        g = sp.geometry
        per_tok = (g.k_words + g.v_words) * 2 * len(sp.layers)
        w = sp.window
        lo = 0 if w is None else max(0, start - w + 1)
        kv_read += B * (end - lo) * per_tok
        kv_write += B * T * per_tok
        seen = (pos + 1) if w is None else np.minimum(pos + 1, w)
        attn_flops += 4.0 * B * int(seen.sum()) * cfg.num_heads * cfg.head_dim * len(sp.layers)
    state_read = state_write = 0
    if plan.state is not None:
        per_slot = plan.state.geometry.words * 2 * len(plan.state.layers)
        state_write = B * per_slot
        state_read = B * per_slot if start > 0 else 0
    heads = embed * (1 if cfg.tie_word_embeddings else 2)
    flops = 2.0 * B * T * (param_count - heads) + 2.0 * B * embed + attn_flops
    return dict(weight_bytes=weights, kv_read_bytes=kv_read, kv_write_bytes=kv_write, state_read_bytes=state_read,
                state_write_bytes=state_write, total_bytes=weights + kv_read + kv_write + state_read + state_write,
                flops=flops)


# =============================================================================== correctness


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


CHECK_LENS = (80, 50)  # prompt lengths of the two check requests; one more token each is decoded
CHECK_T = 64           # the chunk bucket of the check


def check_width(page_size: int) -> int:
    return -(-(CHECK_LENS[0] + 1) // page_size) + 1


def check_family(fam: str, model: Model, run: "Stepper", plan, num_rows: int, a, width: int) -> dict:
    """Arena path vs the dense cache-free forward (see the module doc), on `run`'s arena."""
    name, cfg = FAMILIES[fam]["name"], model.config
    t0 = time.time()
    pager = Pager(plan, num_rows)
    rng = np.random.default_rng(0)
    lens = CHECK_LENS
    toks = rng.integers(1, cfg.vocab_size, size=(2, lens[0] + 1), dtype=np.int64)
    reqs = [pager.new(), pager.new()]
    # (start, end) of each row's new tokens per step: a prefill chunk; a chunk with a 64-token
    # prefix beside a row decoding inside it; a T=1 decode step.
    steps = [((0, 64), (0, 50)), ((64, 80), (50, 51)), ((80, 81), (51, 52))]
    got = []
    for spans in steps:
        T = 1 if all(e - s == 1 for s, e in spans) else CHECK_T
        tb = np.zeros((2, T), np.int64)
        for b, ((s, e), r) in enumerate(zip(spans, reqs)):
            pager.extend(r, s, e)
            tb[b, :e - s] = toks[b, s:e]
        run.arena = apply_moves(run.arena, pager.alloc.take_moves(), impl=a.impl)
        batch = pager.batch(reqs, tb, [e - s for s, e in spans], [e for _, e in spans], width)
        got.append(np.asarray(run(batch)))
    dense = np.asarray(model.dense_logits(model.params, jnp.asarray(toks, jnp.int32)))
    errs, agree = [], 0
    for spans, lg in zip(steps, got):
        for b, (_, e) in enumerate(spans):
            ref = dense[b, e - 1]
            errs.append(rel_err(lg[b], ref))
            agree += int(np.argmax(lg[b]) == np.argmax(ref))
    finite = all(np.isfinite(g).all() for g in got)
    ok = finite and max(errs) <= a.tol
    layers = ",".join(t.replace("_attention", "") for t in cfg.layer_types)
    note = (f"layers [{layers}] vocab {cfg.vocab_size}; rel err per (step,row) "
            + " ".join(f"{e:.1e}" for e in errs) + f"; top-1 {agree}/{len(errs)}; tol {a.tol}"
            + ("" if finite else "; NON-FINITE LOGITS"))
    return record(family=name, kind="check", B=2, T=CHECK_T, ctx=lens[0] + 1, ms=None, max_rel_err=max(errs),
                  top1=agree, compared=len(errs), seconds=time.time() - t0, verdict="pass" if ok else "FAIL",
                  note=note)


def setup(cfg, a, arena_bytes: int, seed: int = 0):
    """Random model, plan, arena of `arena_bytes` and the donated step -> (model, plan, rows, Stepper, counts)."""
    model = build_model(cfg, seed)
    if a.fuse:  # as the engine serves it (EngineConfig.fuse_projections)
        model = model.fuse_projections()
    _block(model.params)
    counts = dict(params=sum(x.size for x in jax.tree.leaves(model.params)),
                  param_bytes=sum(x.nbytes for x in jax.tree.leaves(model.params)))
    plan = make_plan(model.decls(), page_size=a.page_size)
    size = size_arena(plan, int(arena_bytes))
    arena = _block(Arena.create(plan, size.num_rows))
    return model, plan, size.num_rows, Stepper(model.jit_forward(impl=a.impl), model.params, arena), counts


def run_check(fam: str, cfg, a) -> None:
    """The GPU check: its own reduced model and arena, freed afterwards."""
    model, plan, rows, run, _ = setup(cfg, a, a.check_arena_mib * 2**20, seed=1)
    try:
        check_family(fam, model, run, plan, rows, a, check_width(a.page_size))
    finally:
        del run, model
        gc.collect()


# =============================================================================== measurements


def measurements(a) -> list[dict]:
    """Buckets in priority order; every bucket compiles once and may hold several contexts."""
    w = lambda tokens: a.width or -(-tokens // a.page_size)
    out = [dict(kind="decode", B=B, T=1, ctxs=list(a.ctx), width=w(max(a.ctx))) for B in a.decode_batches]
    pb, pt = a.prefill
    out.append(dict(kind="prefill", B=pb, T=pt, ctxs=[pt], width=w(pt)))
    cb, ct = a.chunk
    out.append(dict(kind="chunk", B=cb, T=ct, ctxs=[a.chunk_prefix + ct], width=w(a.chunk_prefix + ct)))
    return out


def run_bucket(fam, m, run: Stepper, model, plan, num_rows, a, copy_bw, counts) -> None:
    cfg, name = model.config, FAMILIES[fam]["name"]
    B, T = m["B"], m["T"]
    rng = np.random.default_rng(B * 7919 + T)
    for ctx in m["ctxs"]:
        start = ctx - T
        try:
            pager = Pager(plan, num_rows)
            reqs = [pager.new() for _ in range(B)]
            for r in reqs:
                pager.extend(r, start, ctx)
            assert not pager.alloc.take_moves()  # a fresh allocator packs without moving
            toks = rng.integers(1, cfg.vocab_size, size=(B, T), dtype=np.int64)
            batch = pager.batch(reqs, toks, [T] * B, [ctx] * B, m["width"])
            usage = pager.alloc.usage()
        except ArenaFull as e:
            record(family=name, kind=m["kind"], B=B, T=T, ctx=ctx, ms=None, verdict="skipped",
                   note=f"arena of {a.arena_gib} GiB too small: {e}")
            continue
        decode = T == 1
        iters = a.iters or (1 if a.small else (10 if decode else 3))
        trials = a.trials or (1 if a.small else 5)
        med, best, first, logits = time_steps(run, batch, iters=iters, trials=trials, warmup=0 if a.small else 2)
        finite = bool(np.isfinite(np.asarray(logits)).all())
        c = step_costs(cfg, plan, counts["params"], counts["param_bytes"], B=B, T=T, start=start)
        roof = c["total_bytes"] / copy_bw
        ratio = med / roof
        verdict = ""
        if decode and B >= a.goal_batch and not a.small:
            verdict = "met" if ratio <= a.goal else "MISSED"
        live = {k: (v.held, v.held_bytes) for k, v in usage.subpools.items()}
        note = "" if finite else "NON-FINITE LOGITS; "
        if not decode:
            note += f"{c['flops'] / med / 1e12:.0f} TFLOP/s (matmul+attn)"
        record(family=name, kind=m["kind"], B=B, T=T, ctx=ctx, prefix=start, ms=med * 1e3, ms_min=best * 1e3,
               first_call_s=first, roofline_ms=roof * 1e3, ratio=ratio, verdict=verdict,
               tokens_per_s=B * T / med, tflops=c["flops"] / med / 1e12, page_table_width=m["width"],
               held={k: dict(pages=v[0], bytes=v[1]) for k, v in live.items()}, iters=iters, trials=trials,
               finite=finite, note=note, **c)


def run_family(fam: str, a, copy_bw: float, fam_deadline: float, deadline: float) -> None:
    spec = FAMILIES[fam]
    name = spec["name"]
    cfg = spec["full"]("bfloat16")
    if a.small:
        cfg = spec["tiny"](cfg)  # already check-sized: the check runs on the timed model itself
    elif a.check:
        if time.time() > deadline:
            record(family=name, kind="check", ms=None, verdict="skipped", note="skipped: --budget reached")
        else:
            try:
                run_check(fam, spec["check"](cfg), a)
            except Exception as e:  # noqa: BLE001 - one family must not end a one-shot GPU run
                fail(name, "check", e)
    todo = measurements(a)
    if time.time() > deadline:
        for m in todo:
            record(family=name, kind=m["kind"], B=m["B"], T=m["T"], ms=None, verdict="skipped",
                   note="skipped: --budget reached")
        return
    try:
        t = time.time()
        model, plan, num_rows, run, counts = setup(cfg, a, a.arena_gib * GIB)
        arena_bytes = run.arena.nbytes
        record(family=name, kind="build", ms=None, seconds=time.time() - t, **counts, arena_bytes=arena_bytes,
               subpools=list(plan.names),
               note=f"{counts['params'] / 1e9:.2f} B params, {counts['param_bytes'] / GIB:.2f} GiB; arena "
                    f"{arena_bytes / GIB:.2f} GiB ({', '.join(plan.names)}); {time.time() - t:.1f} s")
    except Exception as e:  # noqa: BLE001
        fail(name, "build", e)
        return
    if a.small and a.check:
        try:
            check_family(fam, model, run, plan, num_rows, a, a.width)
        except Exception as e:  # noqa: BLE001
            fail(name, "check", e)
    for i, m in enumerate(todo):
        # The first (most important) bucket starts while the whole budget lasts; the others only
        # within this family's share, so a slow family cannot starve the next.
        if time.time() > (deadline if i == 0 else fam_deadline):
            record(family=name, kind=m["kind"], B=m["B"], T=m["T"], ms=None, verdict="skipped",
                   note="skipped: --budget reached")
            continue
        try:
            run_bucket(fam, m, run, model, plan, num_rows, a, copy_bw, counts)
        except Exception as e:  # noqa: BLE001
            fail(name, m["kind"], e, B=m["B"], T=m["T"])
            if getattr(run.arena.data, "is_deleted", lambda: False)():  # donated into a failed call
                run.arena = Arena.create(plan, num_rows)
    del run, model
    gc.collect()
    jax.clear_caches()
    live = sum(x.nbytes for x in jax.live_arrays())
    print(f"  [{name}] freed; live device bytes now {live / GIB:.2f} GiB", flush=True)


# =============================================================================== main


def table(rows) -> str:
    lines = [f"{'family':<18} {'kind':<8} {'B':>3} {'T':>5} {'ctx':>5} {'ms':>9} {'roofline ms':>11} {'ratio':>6}  "
             "verdict"]
    for r in rows:
        if r["kind"] == "build":
            continue
        extra = ""
        if r["kind"] == "check" and r.get("max_rel_err") is not None:
            extra = f"  (max rel err {r['max_rel_err']:.1e})"
        elif r.get("verdict") in ("skipped", "FAILED"):
            extra = f"  {r['note'][:90]}"
        lines.append(f"{r.get('family', ''):<18} {r['kind']:<8} {_fmt(r.get('B'), 'd'):>3} {_fmt(r.get('T'), 'd'):>5} "
                     f"{_fmt(r.get('ctx'), 'd'):>5} {_fmt(r.get('ms'), '.3f'):>9} "
                     f"{_fmt(r.get('roofline_ms'), '.3f'):>11} {_fmt(r.get('ratio'), '.2f'):>6}  "
                     f"{r.get('verdict', '')}{extra}")
    return "\n".join(lines)


def _ints(s):
    return [int(x) for x in str(s).split(",") if x]


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default=",".join(FAMILIES),
                    help=f"comma list of {','.join(FAMILIES)} (or {','.join(ALIASES)})")
    ap.add_argument("--budget", type=float, default=420.0,
                    help="seconds; no new measurement starts past it (each family also keeps to its share)")
    ap.add_argument("--small", action="store_true", help="tiny shapes, reference kernels (CPU, seconds)")
    ap.add_argument("--ctx", default=None, help="decode contexts (default 2048,8192; --small 64,128)")
    ap.add_argument("--decode-batches", default=None, help="decode batch sizes (default 64,1; --small 2)")
    ap.add_argument("--prefill", default=None, help="BxT of the prompt prefill (default 1x2048; --small 2x64)")
    ap.add_argument("--chunk", default=None, help="BxT of the chunk step (default 8x512; --small 2x64)")
    ap.add_argument("--chunk-prefix", type=int, default=None, help="cached tokens before the chunk (default 1536)")
    ap.add_argument("--width", type=int, default=None,
                    help="one page-table width for every bucket (default: each bucket its own; --small: one, "
                         "so the check and the timed steps share two compiled shapes)")
    ap.add_argument("--arena-gib", type=float, default=None, help="arena bytes (default 32 GiB; --small 1/32)")
    ap.add_argument("--check-arena-mib", type=float, default=None, help="arena of the correctness check (256; 16)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--no-fuse", dest="fuse", action="store_false",
                    help="keep q/k/v, gate/up and GDN input projections as separate matmuls")
    ap.add_argument("--iters", type=int, default=None, help="steps per timed trial (default decode 10, prefill 3)")
    ap.add_argument("--trials", type=int, default=None, help="timed trials, median (default 5)")
    ap.add_argument("--tol", type=float, default=5e-2, help="max rel err of the correctness check (bf16)")
    ap.add_argument("--no-check", dest="check", action="store_false", help="skip the correctness check")
    ap.add_argument("--impl", default=None, choices=("pallas", "reference"),
                    help="kernels (default: pallas on the GPU; --small: reference)")
    ap.add_argument("--goal", type=float, default=1.25, help="decode ms / roofline ms goal at the goal batch")
    ap.add_argument("--goal-batch", type=int, default=64)
    ap.add_argument("--json", default=None, help="rows here (default $OUT/bench_models.json if $OUT is set)")
    a = ap.parse_args(argv)
    if not a.small and jax.default_backend() != "gpu":
        print(f"no GPU ({jax.default_backend()}): running --small", flush=True)
        a.small = True
    s = a.small
    bxt = lambda v: tuple(int(x) for x in v.lower().split("x"))
    a.ctx = _ints(a.ctx or ("64,128" if s else "2048,8192"))
    a.decode_batches = _ints(a.decode_batches or ("2" if s else "64,1"))
    a.prefill = bxt(a.prefill or ("2x64" if s else "1x2048"))
    a.chunk = bxt(a.chunk or (f"2x{CHECK_T}" if s else "8x512"))
    a.chunk_prefix = a.chunk_prefix if a.chunk_prefix is not None else (32 if s else 1536)
    if s and a.width is None:
        a.width = max(-(-n // a.page_size) for n in (max(a.ctx), a.prefill[1], a.chunk_prefix + a.chunk[1]))
        a.width = max(a.width, check_width(a.page_size))
    a.arena_gib = a.arena_gib or (1 / 32 if s else 32.0)
    a.check_arena_mib = a.check_arena_mib or (16.0 if s else 256.0)
    if s and a.impl is None:
        a.impl = "reference"
    fams = []
    for f in a.families.split(","):
        f = ALIASES.get(f.strip(), f.strip())
        if f not in FAMILIES:
            ap.error(f"unknown family {f!r}; known: {', '.join(FAMILIES)}")
        fams.append(f)
    a.families = fams
    return a


def main(argv=None) -> int:
    global JSON_PATH
    a = parse(argv)
    silence_triton_deprecation()
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    ROWS.clear()
    META.clear()
    dev = jax.devices()[0]
    JSON_PATH = a.json or (os.path.join(os.environ["OUT"], "bench_models.json") if os.environ.get("OUT") else None)
    META.update(jax=jax.__version__, device=str(getattr(dev, "device_kind", dev.platform)), small=a.small,
                args={k: v for k, v in vars(a).items()})
    print(f"jax {jax.__version__} on {dev.platform} {getattr(dev, 'device_kind', '')}"
          f"{' (--small: tiny shapes, reference kernels)' if a.small else ''}; families {a.families}", flush=True)
    t0 = time.time()
    deadline = t0 + a.budget
    try:
        copy_bw = measure_copy(a.small, trials=3 if a.small else 5)
    except Exception as e:  # noqa: BLE001
        fail("-", "copy", e)
        copy_bw = float("nan")
    META["copy_bytes_per_s"] = copy_bw
    n = len(a.families)
    for i, fam in enumerate(a.families):
        share = t0 + a.budget * (i + 1) / n
        run_family(fam, a, copy_bw, share, deadline)
    META["seconds"] = time.time() - t0
    _flush()
    print(f"\n== bench_models ({META['seconds']:.0f} s; copy {copy_bw / 1e12:.3f} TB/s"
          f"{'; --small: times mean nothing' if a.small else ''}) ==")
    print(table(ROWS))
    bad = [r for r in ROWS if r.get("verdict") in ("FAILED", "FAIL") or r.get("finite") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
