"""Correctness of a model's arena path: its logits against the dense cache-free forward.

Two requests run a T=64 prefill chunk, a T=64 chunk holding one row's last 16 prompt tokens
(prefix 64) beside the other row decoding inside the chunk, then a T=1 decode step, all through
the arena; each row's logits vs `model.dense_logits` on the same tokens: max|a - b| / max|b|.

An MoE model's dense forward takes the experts the arena path chose (recorded per block and token,
their weights from the dense path's own router logits).  In bf16 a router's top-k can flip at its
boundary between two paths that round differently, and gpt-oss's softmax over its 4 chosen logits
gives the flipped expert a large weight: that is precision, not a kernel fault (session 7 found the
same layer passing at 3e-6 in fp32).  The row counts the flips, and the error compares like with like.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from umem_jax.arena import apply_moves
from umem_jax.models.moe import route

from .families import FAMILIES
from .model_steps import Pager, RouterRecorder, Stepper, rel_err, routers_replaced

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
    moe = getattr(cfg, "moe", None)
    got, chosen = [], []  # chosen: per step, each MoE block's experts [2 * T, k] in layer order
    recorder = RouterRecorder()
    forward = model.jit_forward(impl=a.impl) if moe is not None else None
    for spans in steps:
        T = 1 if all(e - s == 1 for s, e in spans) else CHECK_T
        tb = np.zeros((2, T), np.int64)
        for b, ((s, e), r) in enumerate(zip(spans, reqs)):
            pager.extend(r, s, e)
            tb[b, :e - s] = toks[b, s:e]
        run.arena = apply_moves(run.arena, pager.alloc.take_moves(), impl=a.impl)
        batch = pager.batch(reqs, tb, [e - s for s, e in spans], [e for _, e in spans], width)
        if moe is None:
            got.append(np.asarray(run(batch)))
            continue
        # the same forward, traced with each router's choice sent to the host
        with recorder.recording() as seen:
            logits, run.arena = forward(model.params, run.arena, batch)
            got.append(np.asarray(logits))
        chosen.append([c.reshape(2, T, -1) for c in seen])
    flips = None
    if moe is None:
        dense = np.asarray(model.dense_logits(model.params, jnp.asarray(toks, jnp.int32)))
    else:
        forced = _forced(chosen, steps, toks.shape[1], moe.top_k)
        dense, flips = _dense_forced(model, toks, forced)
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
            + ("" if flips is None else f"; the arena's experts forced on the dense forward ({flips[0]} of "
               f"{flips[1]} token-block choices differed)")
            + ("" if finite else "; NON-FINITE LOGITS"))
    return dict(family=name, kind="check", B=2, T=CHECK_T, ctx=lens[0] + 1, ms=None, max_rel_err=max(errs),
                top1=agree, compared=len(errs), seconds=time.time() - t0, verdict="pass" if ok else "FAIL",
                routing_flips=None if flips is None else flips[0], note=note)


def _forced(chosen, steps, length: int, k: int) -> list[np.ndarray]:
    """The arena's choices as each block's [2, length, k] experts by absolute position (-1: not run)."""
    forced = [np.full((2, length, k), -1, np.int32) for _ in chosen[0]]
    for spans, blocks in zip(steps, chosen):
        for f, c in zip(forced, blocks):
            for b, (s, e) in enumerate(spans):
                f[b, s:e] = c[b, :e - s]
    return forced


def _dense_forced(model, toks: np.ndarray, forced: list[np.ndarray]):
    """The dense forward with each block's experts taken from `forced` where set -> (logits [2, S, V],
    (choices that differed from the dense router's own, choices compared))."""
    blocks = iter(range(len(forced)))
    own: list[np.ndarray] = []

    def call(router, x, valid=None):
        full = router.logits(x)
        logits = full[..., :router.cfg.num_experts]  # without a joined shared expert's gate column
        bias = None if router.e_score_correction_bias is None else router.e_score_correction_bias[...]
        _, mine = route(logits, router.cfg, bias)
        f = jnp.asarray(forced[next(blocks)].reshape(mine.shape))
        jax.debug.callback(lambda e: own.append(np.asarray(e)), mine, ordered=True)
        experts = jnp.where(f >= 0, f, mine)
        return router.choice(full, experts, valid)

    graphdef = model.graphdef
    with routers_replaced(call):
        dense = jax.jit(lambda p, t: nnx.merge(graphdef, p).dense(t))(model.params, jnp.asarray(toks, jnp.int32))
        dense = np.asarray(dense)
        jax.effects_barrier()
    differ = total = 0
    for f, mine in zip(forced, own):
        f, mine = f.reshape(-1, f.shape[-1]), mine.reshape(-1, mine.shape[-1])
        ran = f[:, 0] >= 0
        differ += int((np.sort(f[ran], -1) != np.sort(mine[ran], -1)).any(-1).sum())
        total += int(ran.sum())
    return dense, (differ, total)
