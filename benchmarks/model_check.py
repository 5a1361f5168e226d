"""Correctness of a model's arena path: its logits against the dense cache-free forward.

Two requests run a T=64 prefill chunk, a T=64 chunk holding one row's last 16 prompt tokens
(prefix 64) beside the other row decoding inside the chunk, then a T=1 decode step, all through
the arena; each row's logits vs `model.dense_logits` on the same tokens: max|a - b| / max|b|.
"""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np

from umem_jax.arena import apply_moves

from .families import FAMILIES
from .model_steps import Pager, Stepper, rel_err

CHECK_LENS = (80, 50)  # prompt lengths of the two check requests; one more token each is decoded
CHECK_T = 64  # the chunk bucket of the check


def check_width(page_size: int) -> int:
    return -(-(CHECK_LENS[0] + 1) // page_size) + 1


def check_family(fam: str, model, run: Stepper, plan, num_rows: int, a, width: int) -> dict:
    """Arena path vs the dense cache-free forward, on `run`'s arena -> the check's row.
    a: the run's options (impl: kernels, tol: the largest relative error that passes)."""
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
    return dict(family=name, kind="check", B=2, T=CHECK_T, ctx=lens[0] + 1, ms=None, max_rel_err=max(errs),
                top1=agree, compared=len(errs), seconds=time.time() - t0, verdict="pass" if ok else "FAIL",
                note=note)
