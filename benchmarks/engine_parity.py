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
"""

from __future__ import annotations

import argparse
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


def divergence(model, prompt: list[int], ref: list[int], got: list[int]) -> dict | None:
    """The first step where the two greedy sequences differ, with the reference's top-2 margin there."""
    import jax
    import jax.numpy as jnp

    step = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
    if step is None:
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.bench_engine --parity",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=None, help="comma list: tiny and/or fixture directories (default: all)")
    ap.add_argument("--interpret", action="store_true", help="Pallas kernels in interpret mode (CPU)")
    ap.add_argument("--json", default=None, help="rows here (default $OUT/engine_parity.json if $OUT is set)")
    a = ap.parse_args(argv)
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
