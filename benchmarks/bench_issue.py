"""What the host spends issuing one B = 1 decode step, and whether XLA re-records its CUDA graph.

    python3 -m benchmarks.bench_issue --families qwen35moe,gptoss --ctx 2048
    python3 -m benchmarks.bench_issue --small                 # CPU: tiny shapes (times mean nothing)

At B = 1 a decode step of the MoE presets is 400-600 kernels in one XLA command buffer (a CUDA
graph).  When an allocation the graph's nodes use moves between steps (the new logits, the temp
buffer), XLA updates those nodes before the launch, and a freshly updated graph is uploaded again
on launch: host work that grows with the node count.  Each calling pattern below runs the same
jitted step on the same batch:

  hold      `out = step(...)` in a loop: the last logits stay alive while the next step allocates
            (bench_models' loop before session 22, and a serving loop that reads the previous result)
  drop      the logits are dropped before the next call, so the allocator can hand their bytes back
  donate    the previous logits are donated into the step and the new ones written over them: the
            output keeps its address (jit aliases a donated input to an output of its shape)
  fresh     as drop, with a new host array sent along each step (the engine's packed metadata)
  io        the engine's pattern without a moving buffer: a small call writes the host array into a
            donated device buffer, the step reads it there and writes its sampled token back into
            it (its only outputs are donated inputs), and a small call copies the token out; the
            host keeps the last step's copy while the next step launches, as the engine does

Rows: issue ms (the host's time per call, the loop not waiting) and step ms (per call, synchronised
once per trial).  Run it with `TF_CPP_VMODULE=command_buffer_thunk=3 TF_CPP_MIN_LOG_LEVEL=0` to see
each update XLA makes ("Update command buffer ... updated_allocs=N").  Measured: RESULTS.md, "Whole
models", session 22 (hold 4.29 ms a step against drop 3.53 ms on an H100; the engine's own B = 1
ITL equals its device step).
"""

from __future__ import annotations

import argparse
import statistics
import warnings
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from umem_jax.pallas_kernels._compat import silence_triton_deprecation

from .bench_models import setup
from .families import FAMILIES
from .model_steps import Pager
from .timing import time_calls

MODES = ("hold", "drop", "donate", "fresh", "io")


def run_family(fam: str, a) -> list[dict]:
    cfg = FAMILIES[fam]["full"]("bfloat16")
    if a.small:
        cfg = FAMILIES[fam]["tiny"](cfg)
    model, plan, rows, run, _ = setup(cfg, SimpleNamespace(fuse=True, page_size=16, impl=None), a.arena_gib * 2**30)
    pager = Pager(plan, rows)
    req = pager.new()
    pager.extend(req, a.ctx - 1, a.ctx)
    batch = pager.batch([req], np.ones((1, 1), np.int64), [1], [a.ctx], -(-a.ctx // 16))
    forward = model.jit_forward()
    params = run.params

    fwd, treedef = model.forward_fn(), jax.tree.structure(model.params)
    unflat = lambda p: jax.tree.unflatten(treedef, p)
    vocab = model.config.vocab_size
    # keep_unused: the previous logits are donated only for their buffer (the new ones are written
    # where they were); jit would otherwise drop the unused argument and with it the aliasing
    jit_donated = jax.jit(lambda p, prev, arena, b: fwd(unflat(p), arena, b), donate_argnums=(1, 2),
                          keep_unused=True)
    # fresh: the engine's pattern, a new host array (its packed metadata) sent with every step
    jit_fresh = jax.jit(lambda p, arena, b, m: fwd(unflat(p), arena, b.replace(tokens=b.tokens + m[:1, None] * 0)),
                        donate_argnums=(1,))

    # io: the metadata written into a donated device buffer by a small call, the step reading it
    # from there and writing its token back into it (so the big step's buffers never move), and a
    # small call copying the token out for the host
    def io_step(p, arena, b, io):
        logits, arena = fwd(unflat(p), arena, b.replace(tokens=b.tokens + io[:1, None] * 0))
        return arena, io.at[1].set(jnp.argmax(logits.reshape(-1, logits.shape[-1])[0]).astype(jnp.int32) % vocab)

    jit_io = jax.jit(io_step, donate_argnums=(1, 3))
    jit_write = jax.jit(lambda io, m: io.at[: m.shape[0]].set(m), donate_argnums=(0,))
    jit_read = jax.jit(lambda io: io[1:2])
    meta = np.zeros((a.meta_words,), np.int32)

    state = {"arena": run.arena, "logits": None, "io": jnp.zeros((a.meta_words,), jnp.int32), "tok": None}

    def hold():
        logits, state["arena"] = forward(params, state["arena"], batch)
        return logits

    def drop():
        logits, state["arena"] = forward(params, state["arena"], batch)
        del logits
        return state["arena"].data

    def donate():
        if state["logits"] is None:
            state["logits"], state["arena"] = forward(params, state["arena"], batch)
        state["logits"], state["arena"] = jit_donated(params, state["logits"], state["arena"], batch)
        return state["logits"]

    def fresh():
        logits, state["arena"] = jit_fresh(params, state["arena"], batch, meta)
        del logits
        return state["arena"].data

    def io():
        state["io"] = jit_write(state["io"], meta)
        state["arena"], state["io"] = jit_io(params, state["arena"], batch, state["io"])
        tok, state["tok"] = state["tok"], jit_read(state["io"])  # the last step's token is read as the next launches
        del tok
        return state["tok"]

    out = []
    for mode in a.modes:
        t = time_calls(dict(hold=hold, drop=drop, donate=donate, fresh=fresh, io=io)[mode], iters=a.iters,
                       trials=a.trials)
        issue, step = statistics.median(t.issue), t.median
        row = dict(family=FAMILIES[fam]["name"], mode=mode, issue_ms=issue * 1e3, step_ms=step * 1e3)
        print(f"  {row['family']:<30} {mode:<7} issue {row['issue_ms']:7.3f} ms  step {row['step_ms']:7.3f} ms",
              flush=True)
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default="qwen35moe")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--arena-gib", type=float, default=4.0)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--meta-words", type=int, default=4096, help="the host array fresh/io send per step")
    ap.add_argument("--small", action="store_true")
    a = ap.parse_args(argv)
    a.modes = a.modes.split(",")
    if not a.small and jax.default_backend() != "gpu":
        print("no GPU: running --small", flush=True)
        a.small = True
    if a.small:
        a.ctx, a.arena_gib = min(a.ctx, 64), 1 / 32
    silence_triton_deprecation()
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    rows = []
    for fam in a.families.split(","):
        rows += run_family(fam, a)
    print("\nfamily                         mode     issue ms   step ms")
    for r in rows:
        print(f"{r['family']:<30} {r['mode']:<7} {r['issue_ms']:9.3f} {r['step_ms']:9.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
