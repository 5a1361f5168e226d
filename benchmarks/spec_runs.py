"""The speculative benchmark's models and runs: the qwen3.5-4b-like target with one MTP layer, its
draft, engines of one plan, and one timed run of the offline engine (bench_speculative.py says
what each part measures)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time

import numpy as np

from .spec_harness import Harness

# ------------------------------------------------------------------------------ models


def target_config(args):
    """The target's config: qwen3.5-4b-like (or a tiny Qwen3.5 for --small) with one MTP layer."""
    from umem_jax.models.config import FULL
    from umem_jax.models.qwen3_5 import qwen3_5_4b_like, qwen3_5_config

    if not args.small:
        return dataclasses.replace(qwen3_5_4b_like(args.dtype), mtp_num_layers=1, mtp_layer_types=(FULL,))
    return qwen3_5_config({
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4, "tie_word_embeddings": True, "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        "mtp_num_hidden_layers": 1, "dtype": args.dtype})


def draft_config(cfg, args):
    """The draft of method "draft": the target's family, vocabulary and K/V geometry (heads, head
    dim: its pages fuse into the target's envelopes), full attention only, smaller."""
    from umem_jax.models.config import FULL

    layers, hidden, inter, heads = (2, 32, 64, cfg.num_heads) if args.small else (8, 1024, 3072, 8)
    return dataclasses.replace(cfg, layer_types=(FULL,) * layers, hidden_size=hidden, intermediate_size=inter,
                               num_heads=heads, mtp_num_layers=0, mtp_layer_types=())


def build_models(args):
    """(target, draft, MTP head), random weights on the default device, projections fused once
    (engines on them then share every compilation)."""
    from umem_jax.models import mtp
    from umem_jax.models.registry import build_random

    cfg = target_config(args)
    target = build_random(cfg, args.dtype, seed=args.seed).fuse_projections()
    draft = build_random(draft_config(cfg, args), args.dtype, seed=args.seed + 1).fuse_projections()
    head = mtp.random_head(target, seed=args.seed + 2).fuse_projections()
    return target, draft, head


def param_count(model) -> int:
    import jax

    return sum(int(x.size) for x in jax.tree.leaves(model.params))


# ------------------------------------------------------------------------------ engines and runs


def engine_kwargs(args) -> dict:
    """One set of shapes for every engine (equal arena bytes: engines of one plan share compiles):
    prefill one prompt per step (T = --prompt), decode at the --batches buckets, one page width,
    every prefill before any decode (max_prefill_streak), no prefix cache (each run prefills)."""
    return dict(arena_bytes=int(args.arena_gib * 2**30), max_num_seqs=max(args.batches),
                max_num_batched_tokens=args.prompt, token_buckets=(args.prompt,), batch_buckets=tuple(args.batches),
                page_size=args.page_size, max_model_len=args.max_model_len,
                page_buckets=(-(-args.max_model_len // args.page_size),), max_prefill_streak=1 << 30,
                enable_prefix_caching=False, **({"kernel_impl": args.kernel_impl} if args.kernel_impl else {}))


@contextlib.contextmanager
def engine(model, args, spec: dict | None = None):
    """An LLMEngine, dropped (its arena freed) on leaving."""
    from umem_jax import LLM

    llm = LLM(model, speculative_config=spec, **engine_kwargs(args))
    eng = llm.llm_engine
    try:
        yield eng
    finally:
        # Free the arena now: a caller's frame (a traceback) may keep the engine alive, and the
        # next engine's arena must not sit beside this one.
        with contextlib.suppress(Exception):
            eng.runner.arena.data.delete()
        del llm, eng
        gc.collect()


def run(eng, prompts, gen: int, expected=None, harness: Harness | None = None, mtp: bool = False):
    """All `prompts` at once to `gen` tokens each (greedy, ignore_eos) by LLMEngine.step ->
    (figures of the run, each request's output tokens).  expected: each prompt + its greedy
    continuation, for the harness; mtp: the harness replaces the head's drafts after each step.
    Decode window: from the last request's first token (its prefill read back) to the last token
    read back; tok_s = tokens after each request's first / window."""
    from umem_jax import SamplingParams
    from umem_jax.bench.driver import compile_count
    from umem_jax.engine.speculative import SpecStats

    sp = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    if eng.spec_stats is not None:
        eng.spec_stats = SpecStats(eng.spec_stats.k)  # this run's counters only
    retractions, steps = eng.scheduler.num_retractions, eng.num_steps["decode"]
    if harness is not None:
        harness.seconds, harness.calls = 0.0, 0
    c0 = compile_count()
    t0 = time.perf_counter()
    ids = []
    for i, p in enumerate(prompts):
        ids.append(eng.add_request(p, sp))
        if harness is not None:
            harness.expected[ids[-1]] = np.asarray(expected[i], np.int64)
    outs = {}
    while eng.has_unfinished_requests():  # (async: drains the last overlap row too)
        outs.update((o.request_id, o) for o in eng.step())
        if mtp:
            harness.after_step(eng)
    wall = time.perf_counter() - t0
    compiles = compile_count() - c0
    got = [outs[i] for i in ids]
    errors = [o.error for o in got if o.error is not None]
    if errors:
        raise RuntimeError(f"requests failed: {errors[:3]}")
    tokens = [list(o.outputs[0].token_ids) for o in got]
    start = max(o.metrics.first_token_time for o in got)
    end = max(o.metrics.finished_time for o in got)
    n = sum(len(t) for t in tokens)
    tpot = [(o.metrics.finished_time - o.metrics.first_token_time) / max(len(t) - 1, 1) for o, t in zip(got, tokens)]
    row = {"B": len(prompts), "gen": gen, "output_tokens": n, "window_s": end - start,
           "tok_s": (n - len(prompts)) / (end - start) if end > start else float("nan"),
           "wall_tok_s": n / wall, "tpot_ms": 1e3 * float(np.mean(tpot)),
           "decode_steps": eng.num_steps["decode"] - steps, "compiles": compiles,
           "retractions": eng.scheduler.num_retractions - retractions}
    if eng.spec_stats is not None:
        s = eng.spec_stats.as_dict()
        rows = max(s["num_verify_rows"], 1)
        steps = max(row["decode_steps"], 1)
        row.update({k: s[k] for k in ("mean_accepted_length", "mean_tokens_per_step", "acceptance_rate",
                                      "acceptance_per_position")}, verify_rows=rows,
                   # per decode step: the proposer's call (the harness, its device_put and wait), the
                   # verify's call to its result (an MTP step: all of it), and the rest of the window
                   # (host: scheduling, packing, applying the verify; the mtp harness's hook)
                   engine_draft_ms_per_step=1e3 * s["draft_time_s"] / steps,
                   engine_verify_ms_per_step=1e3 * s["verify_time_s"] / steps,
                   host_ms_per_step=1e3 * (row["window_s"] - s["draft_time_s"] - s["verify_time_s"]) / steps)
    if harness is not None:
        row["harness_us_per_call"] = 1e6 * harness.seconds / max(harness.calls, 1)
    return row, tokens


def timed(eng, prompts, gen: int, repeats: int, check, **kw):
    """`repeats` runs of `run` back to back -> (the first run's figures with tok_s, wall_tok_s the
    median over the runs and every run's tok_s in tok_s_runs, the first run's tokens); check(tokens)
    is called on every run's output."""
    rows = []
    for _ in range(repeats):
        row, toks = run(eng, prompts, gen, **kw)
        check(toks)
        rows.append((row, toks))
    row, toks = rows[0]
    runs = [r["tok_s"] for r, _ in rows]
    row.update(tok_s=float(np.median(runs)), tok_s_runs=runs,
               wall_tok_s=float(np.median([r["wall_tok_s"] for r, _ in rows])),
               compiles=sum(r["compiles"] for r, _ in rows), retractions=sum(r["retractions"] for r, _ in rows))
    return row, toks


def compare(got: list[list[int]], want: list[list[int]]) -> list[dict]:
    """Requests whose tokens differ -> [{request, first differing position, want, got there}]."""
    bad = []
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            j = next((j for j, (x, y) in enumerate(zip(g, w)) if x != y), min(len(g), len(w)))
            bad.append({"request": i, "position": j, "want": w[j:j + 4], "got": g[j:j + 4], "len": [len(w), len(g)]})
    return bad
