"""The engine with the Pallas kernels against the plain-JAX references: the same greedy tokens?

    python3 -m benchmarks.bench_engine --parity                               # GPU: tiny hybrid + fixtures
    python3 -m benchmarks.bench_engine --parity --models tiny --interpret     # CPU, Pallas interpreted

For the built-in tiny hybrid (both memory modes) and the committed tiny fixtures (unified), the
offline engine generates 24 greedy tokens for 4 random prompts (5 to 130 tokens, chunked prefill
of 64, fp32 K/V) with the Pallas kernels and again with the references.  For every sequence that
diverges it prints the first diverging step, the reference and Pallas tokens there, and how close
the reference's choice was: the top-2 logits at that step, from a cache-free recompute of the
reference sequence (prompt + reference tokens) in full fp32 precision.  A margin at rounding
level (well under 1e-3 of the logit spread) with the Pallas token as the runner-up is a near-tie
that a different accumulation order may flip; a clear margin points at a kernel bug.
JSON rows go to $OUT/engine_parity.json (or --json).

    python3 -m benchmarks.bench_engine --parity --prefill auto --models qwen3.5-4b-like   # GPU
    python3 -m benchmarks.bench_engine --parity --prefill mgpu --small                     # CPU: the harness

With --prefill B: the two prefill kernels on a served trace (issue 17 item 4: the Mosaic GPU
prefill becomes the default on Hopper once it serves the shifting trace at 4B scale with Triton's
tokens).  For each random-weight model (bf16, bench_serving's trace sizes for it), the trace's
requests are generated greedily with their exact output lengths twice in one process, under
UMEM_JAX_PREFILL=triton and then =B (the runner keys its traced steps on the variable).  The
arrivals are ignored (offline generate), so both runs schedule the same batches and differ only
in the prefill kernel.  Each differing sequence is reported with its first differing step, and
for prompts up to --margin-max-len tokens the dense top-2 margin there, as above.

Exact agreement is not to be had from random bf16 weights: their logits are nearly flat (top-2
margins of 0.01-0.1 in a spread of 9 at 4B), and any change of rounding flips a near-tie within a
few tokens, after which the sequences part.  --null adds the yardstick: Triton again with half
its K/V block (16 instead of 32 at head dim 256, 64 instead of 128 at 128), the same kernel
summing every score in another order.  (Half the prefill chunk, session 26's first null, left
most of these short prompts' prefills bit-identical: a yardstick too lenient.)  Each run also
records its first token's logprob (the first token comes from the prefill alone, so its logprob
differs by the kernels' own error) and times the trace's prefill twice more, the second pass
warm, for the kernels' cost in the engine.  With the null and
another kernel, `rounding_verdict` says whether that kernel's differences stay within the null's
(LOGPROB_SLACK, SHARE_FLOOR); `--prefill triton --against JSON` judges an earlier run's kernel by
this run's null.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np

from .report import RowLog, json_path

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
PROMPT_LENS = (5, 23, 70, 130)
MAX_TOKENS = 24


def generate(model, impl: str, mode: str, interpret: bool = False):
    """-> (llm, [(prompt ids, generated ids)])."""
    from umem_jax import LLM, SamplingParams

    llm = LLM(model=model, kernel_impl=impl, interpret=interpret and impl == "pallas", memory_mode=mode,
              arena_bytes=32 << 20, kv_cache_dtype="float32", max_num_batched_tokens=64)
    rng = np.random.default_rng(0)
    vocab = llm.llm_engine.model.config.vocab_size
    prompts = [rng.integers(3, vocab - 1, n).tolist() for n in PROMPT_LENS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return llm, [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share (the first differing step where they differ)."""
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def divergence(model, prompt: list[int], ref: list[int], got: list[int]) -> dict | None:
    """The first step where the two greedy sequences differ, with the reference's top-2 margin there."""
    import jax
    import jax.numpy as jnp

    step = common_prefix(ref, got)
    if step == min(len(ref), len(got)):  # no token differs where both have one
        return None
    seq = jnp.asarray([prompt + ref], jnp.int32)
    with jax.default_matmul_precision("highest"):
        logits = np.asarray(model.dense_logits(model.params, seq))[0, len(prompt) + step - 1].astype(np.float64)
    top2 = np.argsort(logits)[::-1][:2]
    return dict(step=step, ref_token=int(ref[step]), pallas_token=int(got[step]),
                dense_argmax=int(top2[0]), runner_up=int(top2[1]),
                top1_logit=float(logits[top2[0]]), top2_logit=float(logits[top2[1]]),
                margin=float(logits[top2[0]] - logits[top2[1]]),
                ref_minus_pallas=float(logits[ref[step]] - logits[got[step]]),
                logit_spread=float(logits.max() - logits.min()), logit_std=float(logits.std()))


def compare(m: str, mode: str, interpret: bool, log: RowLog) -> bool:
    """One model in one memory mode -> every sequence identical?"""
    t0 = time.time()
    llm, ref = generate(m, "reference", mode, interpret)
    _, got = generate(m, "pallas", mode, interpret)
    same = sum(r[1] == g[1] for r, g in zip(ref, got))
    print(f"{Path(m).name:<16} {mode:<8} pallas == reference greedy: {same}/{len(ref)}  "
          f"({time.time() - t0:.0f} s)", flush=True)
    for i, ((prompt, r), (_, g)) in enumerate(zip(ref, got)):
        d = divergence(llm.llm_engine.model, prompt, r, g)
        row = dict(model=Path(m).name, mode=mode, prompt=i, prompt_len=len(prompt), same=d is None)
        if d is not None:
            row.update(d)
            print(f"    prompt {i} ({len(prompt)} tokens) diverges at step {d['step']}: "
                  f"reference {d['ref_token']}, pallas {d['pallas_token']}; "
                  f"reference top-2 {d['dense_argmax']} {d['top1_logit']:.6f} / "
                  f"{d['runner_up']} {d['top2_logit']:.6f}, margin {d['margin']:.3e} "
                  f"(logit spread {d['logit_spread']:.3f}, std {d['logit_std']:.3f}); "
                  f"logit(ref) - logit(pallas) {d['ref_minus_pallas']:.3e}", flush=True)
        log.add(row)
    return same == len(ref)


def trace_requests(name: str, workload: str, vocab: int, small: bool) -> tuple[list, list[int], dict]:
    """`workload`'s prompts and exact output lengths at bench_serving's sizes for model `name`
    (--small: its CPU trace), and the engine settings bench_serving gives them."""
    from umem_jax.bench.command import bucket_kwargs
    from umem_jax.bench.workload import Shape

    from .bench_serving import MODELS, max_model_len, workloads

    if small:
        spec, short, n_short, page, tokens = dict(arena_gib=1 / 64, long=(200, 8), n_long=3, n_long_phase=1), \
            Shape(24, 8), 16, 4, 64
    else:
        spec, short, n_short, page, tokens = MODELS[name], Shape(512, 128), 128, 16, 2048
    wl = workloads([workload], spec, short=short, n_short=n_short, phase_s=2.0, jitter=0.2, seed=0)[0]
    mml = max_model_len([wl], page)
    seqs = 8 if small else 64
    settings = dict(arena_bytes=int(spec["arena_gib"] * 2**30), max_num_seqs=seqs, max_num_batched_tokens=tokens,
                    page_size=page, max_model_len=mml, kernel_impl="pallas")
    if small:  # the harness alone (the references: interpreted kernels take minutes), one step shape
        settings.update(bucket_kwargs("single", seqs, tokens, mml, page), kernel_impl="reference")
    return wl.prompts(vocab), [r.output_len for r in wl.requests], settings


@dataclasses.dataclass(frozen=True)
class Arm:
    """One run of the trace: its name in the report, $UMEM_JAX_PREFILL, and the Triton kernel's
    K/V block ($UMEM_JAX_PREFILL_BLOCK_K; None: its default)."""
    name: str
    env: str
    block_k: int | None = None

    def environment(self) -> dict:
        from umem_jax.pallas_kernels.paged_prefill import BLOCK_K_ENV, PREFILL_ENV

        return {PREFILL_ENV: self.env, BLOCK_K_ENV: str(self.block_k or "")}


def null_block_k(config, chunk: int = 2048) -> int:
    """The null's K/V block for a model: half the Triton kernel's default for its attention at a
    full chunk (bf16: 128 -> 64 at head dims up to 128, 32 -> 16 at 256), at least 16."""
    from umem_jax.pallas_kernels.paged_prefill import prefill_config

    G = config.num_heads // config.num_kv_heads
    return max(16, prefill_config(chunk, G, config.head_dim).block_k // 2)


def arms(backend: str, null: bool, null_block: int = 64) -> list[Arm]:
    """Triton first (every other run is compared with it); the null (Triton with another K/V
    block, null_block: the same kernel, every score summed in another order) when asked for or
    when backend is triton itself; then backend."""
    out = [Arm("triton", "triton")]
    if null or backend == "triton":
        out.append(Arm(f"triton/bk{null_block}", "triton", null_block))
    if backend != "triton":
        out.append(Arm(backend, backend))
    return out


def prefill_parity(name: str, backend: str, workload: str, buckets: str | None, small: bool, margin_max_len: int,
                   log: RowLog, requests: int | None = None, null: bool = False, warm: bool = True) -> bool:
    """The trace generated under UMEM_JAX_PREFILL=triton and =`backend` -> every sequence identical?

    null (always with backend "triton"): one more run keeps the Triton kernel with another K/V
    block (null_block_k), so only the order of the attention's sums differs, in every prefill.
    Its agreement with the first is what two equally exact bf16 runs of a random-weight model
    reach: the yardstick for another kernel's.  Every run also records its first token's logprob
    (that token comes from the prefill alone) and times the trace's prefill twice more
    (max_tokens=1, no prefix cache), the second pass warm."""
    from umem_jax import LLM, SamplingParams
    from umem_jax.bench.sweep import load_bench_model
    from umem_jax.pallas_kernels import paged_prefill

    from .bench_serving import parse_buckets
    from .modes import environment

    model = load_bench_model("tiny" if small else name, "float32" if small else "bfloat16")
    prompts, outs, settings = trace_requests(name, workload, model.config.vocab_size, small)
    prompts, outs = prompts[:requests], outs[:requests]  # requests: the trace's first ones only (None: all)
    if buckets:
        settings.update(parse_buckets(buckets))
    settings["enable_prefix_caching"] = False  # the warm prefill pass computes every prompt again
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in outs]
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    runs, real_choice = {}, paged_prefill.prefill_backend
    chosen: dict[str, collections.Counter] = {}
    current = []

    def spy(*args, **kw):  # the kernel each traced prefill call took, and why not Mosaic where not
        choice = real_choice(*args, **kw)
        chosen[current[-1]][choice] += 1
        return choice

    paged_prefill.prefill_backend = spy
    try:
        for arm in arms(backend, null, null_block_k(model.config)):
            current.append(arm.name)
            chosen[arm.name] = collections.Counter()
            with environment(arm.environment()):
                llm = LLM(model=model, **settings)
                t0 = time.perf_counter()
                res = llm.generate(inputs, params)
                dt = time.perf_counter() - t0
                prefill_s = [0.0, 0.0]  # warm=False: not timed
                for _ in range(2 if warm else 0):  # the first pass may compile shapes the trace did not use
                    t0 = time.perf_counter()
                    again = llm.generate(inputs, first)
                    assert all(r.error is None for r in again), [r.error for r in again if r.error][:3]
                    prefill_s = prefill_s[1:] + [time.perf_counter() - t0]
            assert all(r.error is None for r in res), [r.error for r in res if r.error][:3]
            runs[arm.name] = dict(tokens=[list(r.outputs[0].token_ids) for r in res],
                                  first_logprob=[r.outputs[0].logprobs[0][r.outputs[0].token_ids[0]].logprob
                                                 for r in res])
            print(f"{name:<22} {workload} {arm.name:<10} (UMEM_JAX_PREFILL={arm.env}, block_k "
                  f"{arm.block_k or 'default'}): {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, "
                  f"{sum(outs)} out in {dt:.1f} s; the prefill again: {prefill_s[0]:.2f} s, warm {prefill_s[1]:.2f} s",
                  flush=True)
            llm.llm_engine.check_idle()
            del llm
            for (kernel, why), n in sorted(chosen[arm.name].items()):
                print(f"    {n} traced prefill call(s) ran {kernel}" + (f" ({why})" if why else ""), flush=True)
            log.add(dict(model=name, workload=workload, arm=arm.name, outputs=runs[arm.name]))  # for other runs
            kernels = [dict(kernel=k, why=w, traced_calls=n) for (k, w), n in sorted(chosen[arm.name].items())]
            log.add(dict(model=name, workload=workload, env=arm.env, arm=arm.name, block_k=arm.block_k, seconds=dt,
                         prefill_seconds=prefill_s[1], prefill_first_pass_seconds=prefill_s[0], kernels=kernels))
    finally:
        paged_prefill.prefill_backend = real_choice
    verdict = list(runs)[-1]  # the last arm decides: the backend's, or the null's when backend is triton
    summaries = {other: compare_runs(name, workload, prompts, runs["triton"], runs[other], other, model,
                                     margin_max_len, log) for other in list(runs)[1:]}
    ok = summaries[verdict]["same"] == summaries[verdict]["requests"]
    null_arm = next((a for a in summaries if a.startswith("triton/")), None)
    if null_arm is not None and verdict != null_arm:
        print_verdict(summaries[null_arm], summaries[verdict])
    # the same kernel twice proves nothing
    if backend != "triton" and not small and not any(kernel == "mgpu" for kernel, _ in chosen[verdict]):
        print(f"    the Mosaic GPU prefill never ran under {backend}: no parity shown", flush=True)
        ok = False
    return ok


# Written before the first run of the K/V-block null (session 26): another kernel's differences
# from Triton are rounding if they are no larger than the null's.  The first token comes from the
# prefill alone, so its logprob's difference is the kernels' own error; the share of an output
# before its first difference is how soon that error flips a near-tie.
LOGPROB_SLACK = 1.5  # the kernel's first-token |logprob difference|, median and max, <= this x the null's
SHARE_FLOOR = 0.8  # the kernel's mean share before its first difference >= this x the null's


def rounding_verdict(null: dict, other: dict) -> tuple[bool, list[str]]:
    """compare_runs' summaries of the null and of another kernel (each against its own process's
    Triton run) -> (the other's differences are no larger than the null's, the reasons)."""
    checks = [("first-token |logprob difference|, median", other["first_logprob_diff_median"],
               null["first_logprob_diff_median"] * LOGPROB_SLACK, "<="),
              ("first-token |logprob difference|, max", other["first_logprob_diff_max"],
               null["first_logprob_diff_max"] * LOGPROB_SLACK, "<="),
              ("mean share before the first difference", other["mean_agreeing_share"],
               null["mean_agreeing_share"] * SHARE_FLOOR, ">=")]
    reasons, ok = [], True
    for what, got, bound, op in checks:
        good = got <= bound if op == "<=" else got >= bound
        ok &= good
        reasons.append(f"{what}: {got:.3g} {op} {bound:.3g} ({'yes' if good else 'NO'})")
    return ok, reasons


def print_verdict(null: dict, other: dict) -> None:
    ok, reasons = rounding_verdict(null, other)
    print(f"rounding verdict, {other['backend']} against the null {null['backend']}: "
          + ("within the null's rounding" if ok else "LARGER than the null's rounding"), flush=True)
    for r in reasons:
        print(f"    {r}", flush=True)


def compare_runs(name, workload, prompts, ref: dict, new: dict, other: str, model, margin_max_len: int,
                 log: RowLog) -> dict:
    """Run `other` against the Triton run: sequences identical, the share of each output before
    its first difference, first tokens equal and their logprobs' difference, and each differing
    sequence's step (with the dense top-2 margin there for short sequences) -> the summary row."""
    a, b = ref["tokens"], new["tokens"]
    same = sum(x == y for x, y in zip(a, b))
    agree = [common_prefix(x, y) / max(1, len(x)) for x, y in zip(a, b)]
    first_same = [i for i, (x, y) in enumerate(zip(a, b)) if x[:1] == y[:1]]
    dlp = np.abs([ref["first_logprob"][i] - new["first_logprob"][i] for i in first_same]) if first_same else np.zeros(1)
    summary = dict(model=name, workload=workload, backend=other, same=same, requests=len(a),
                   mean_agreeing_share=float(np.mean(agree)), first_token_same=len(first_same),
                   first_logprob_diff_median=float(np.median(dlp)), first_logprob_diff_max=float(dlp.max()))
    print(f"{name:<22} {workload} {other} == triton greedy: {same}/{len(a)}; mean share of an output before its "
          f"first difference {summary['mean_agreeing_share']:.3f}; first tokens equal {len(first_same)}/{len(a)}, "
          f"their logprobs differ by {summary['first_logprob_diff_median']:.2e} (median), "
          f"{summary['first_logprob_diff_max']:.2e} (max)", flush=True)
    log.add(summary)
    for i, (p, r, g) in enumerate(zip(prompts, a, b)):
        row = dict(model=name, workload=workload, backend=other, prompt=i, prompt_len=len(p), same=r == g)
        if r != g:
            step = common_prefix(r, g)
            x, y = (r[step] if step < len(r) else None), (g[step] if step < len(g) else None)  # None: ended
            row.update(step=step, triton_token=x, other_token=y)
            d = divergence(model, p, r, g) if len(p) + len(r) <= margin_max_len else None
            if d is not None:
                row.update(margin=d["margin"], logit_spread=d["logit_spread"])
            print(f"    request {i} ({len(p)} tokens) differs at step {step}: triton {x}, {other} {y}"
                  + (f"; dense top-2 margin {d['margin']:.3e} (spread {d['logit_spread']:.3f})" if d else ""),
                  flush=True)
        log.add(row)
    return summary


def summaries(rows: list[dict]) -> list[dict]:
    """The compare_runs summary rows among a run's rows, in their order."""
    return [r for r in rows if "requests" in r and "backend" in r]


def summaries_in(path: str) -> list[dict]:
    """The compare_runs summaries of an earlier run's JSON (--json), in its order."""
    return summaries(json.loads(Path(path).read_text())["rows"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.bench_engine --parity",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=None, help="comma list: tiny and/or fixture directories (default: all); "
                    "with --prefill, random-weight shapes (default qwen3.5-4b-like)")
    ap.add_argument("--interpret", action="store_true", help="Pallas kernels in interpret mode (CPU)")
    ap.add_argument("--json", default=None, help="rows here (default $OUT/engine_parity.json if $OUT is set)")
    ap.add_argument("--prefill", default=None, metavar="BACKEND",
                    help="compare UMEM_JAX_PREFILL=BACKEND (auto, mgpu) with triton on a served trace; "
                    "'triton': the null, Triton against itself with another K/V block")
    ap.add_argument("--workload", default="shifting", help="with --prefill: the trace (bench_serving's sizes)")
    ap.add_argument("--buckets", default="1,4,64:512,2048:2048", help="with --prefill: B,..:T,..:P,.. step shapes")
    ap.add_argument("--requests", type=int, default=None, help="with --prefill: the trace's first N requests only")
    ap.add_argument("--against", default=None, metavar="JSON", help="with --prefill triton: also judge the "
                    "kernel of an earlier run's JSON (its last non-Triton summary) against this run's null")
    ap.add_argument("--no-warm", action="store_true", help="with --prefill: no second timing of the prefill")
    ap.add_argument("--null", action="store_true", help="with --prefill: also Triton with half its K/V block "
                    "(only the rounding differs), the yardstick for the other kernel's agreement")
    ap.add_argument("--margin-max-len", type=int, default=4096,
                    help="with --prefill: dense margins only for prompt + output up to this many tokens")
    ap.add_argument("--small", action="store_true", help="with --prefill: the tiny model on the CPU trace with "
                    "the reference kernels (a smoke test of the harness: no Mosaic GPU kernel on a CPU)")
    a = ap.parse_args(argv)
    if a.prefill:
        log = RowLog(json_path(a.json, "prefill_parity"))
        bad = sum(not prefill_parity(m, a.prefill, a.workload, None if a.small else a.buckets, a.small,
                                     a.margin_max_len, log, a.requests, a.null, not a.no_warm)
                  for m in (["tiny"] if a.small else (a.models or "qwen3.5-4b-like").split(",")))
        print("prefill parity:", "OK" if not bad else f"{bad} model(s) MISMATCHED")
        if a.against:  # this run's null against an earlier run's kernel (one model)
            null = next(r for r in summaries(log.rows) if r["backend"].startswith("triton/"))
            theirs = summaries_in(a.against)
            other = next(r for r in reversed(theirs) if not r["backend"].startswith("triton"))
            if (other["model"], other["workload"]) != (null["model"], null["workload"]):
                raise SystemExit(f"--against: {a.against} ran {other['model']} {other['workload']}, "
                                 f"this run {null['model']} {null['workload']}")
            print(f"(the other kernel's summary from {a.against})")
            print_verdict(null, other)
        return 1 if bad else 0
    if a.models:
        models = [m if m == "tiny" or os.path.isdir(m) else str(FIXTURES / m) for m in a.models.split(",")]
    else:
        models = ["tiny"] + [str(p) for p in (FIXTURES / "nemotron_h_tiny", FIXTURES / "qwen3_5_tiny",
                                               FIXTURES / "gemma3_tiny") if p.exists()]
    log = RowLog(json_path(a.json, "engine_parity"))
    bad = 0
    for m in models:
        for mode in ("unified", "static") if m == "tiny" else ("unified",):
            bad += not compare(m, mode, a.interpret, log)
    print("engine smoke:", "OK" if not bad else f"{bad} MISMATCHED")
    return 1 if bad else 0
