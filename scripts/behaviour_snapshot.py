"""Fingerprint of the engine's behaviour, for restructurings that must not change it.

    python3 scripts/behaviour_snapshot.py --out before.json     # before the change
    python3 scripts/behaviour_snapshot.py --out after.json      # after it
    diff before.json after.json                                 # must be empty

It serves fixed prompts greedily on every tiny family (the built-in tiny hybrids and the
transformers fixtures under tests/fixtures) through the engine, unified and static, under enough
pressure to chunk prompts, retract and hit the prefix cache, and records every token and the
engine's counters; then it runs the small unified-vs-static sweep with a fixed seed and records
each run's counts (requests, tokens, retractions, aborts). Timings are left out: they vary.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ["tiny", "tiny-attention", str(ROOT / "tests/fixtures/gemma3_tiny"),
            str(ROOT / "tests/fixtures/nemotron_h_tiny"), str(ROOT / "tests/fixtures/qwen3_5_tiny")]
SETTINGS = dict(arena_bytes=150 << 10, max_num_seqs=4, max_num_batched_tokens=32, page_size=4, max_model_len=256,
                batch_buckets=(4,), token_buckets=(32,), page_buckets=(64,))
COUNTERS = ("num_retractions", "num_preemptions", "prefix_cache_hit_tokens", "prefix_cache_query_tokens",
            "num_compactions", "num_moved_pages", "num_steps")


def _generate(source: str, memory_mode: str) -> dict:
    from umem_jax import LLM, SamplingParams
    from umem_jax.models.loader import load_model

    rng = np.random.default_rng(7)
    vocab = 120  # the fixtures have 128 tokens
    base = rng.integers(3, vocab, 40).tolist()
    prompts = [rng.integers(3, vocab, n).tolist() for n in (5, 70, 33, 120, 9, 64)]
    prompts += [base + [3, 4], base + [5, 6, 7]]  # a shared prefix: cache hits
    llm = LLM(load_model(source), memory_mode=memory_mode, seed=0, **SETTINGS)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(prompts, sp)
    again = llm.generate(prompts[-2:], sp)  # a repeat: served from the cache
    stats = llm.llm_engine.stats()
    llm.llm_engine.check_idle()
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs + again],
            "counters": {k: stats.get(k) for k in COUNTERS if k in stats}}


def _bench() -> list[dict]:
    from umem_jax.bench.sweep import load_bench_model, run_benchmark
    from umem_jax.bench.workload import make_all

    model = load_bench_model("tiny", "bfloat16", 0)
    workloads = make_all(["shifting"], scale=0.02, count_scale=0.2, max_len=None, rate=None, phase_s=0.2,
                         spread=False, jitter=0.0, seed=0)
    mml = -(-(max(w.max_len for w in workloads) + 4) // 4) * 4
    pages = -(-mml // 4)
    kw = dict(arena_bytes=400000, max_num_seqs=8, max_num_batched_tokens=64, page_size=4, max_model_len=mml,
              seed=0, batch_buckets=(8,), token_buckets=(64,), page_buckets=(1 << (pages - 1).bit_length(),))
    report = run_benchmark(model, workloads, engine_kwargs=kw, statics=None, out_dir=None, progress=False,
                           meta={"model": "tiny"})
    keep = ("workload", "config", "mode", "status", "requests", "finished", "aborted", "clipped", "output_tokens",
            "expected_output_tokens", "retractions", "preemptions", "peak_running")
    return [{k: r[k] for k in keep if k in r} for r in report["rows"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-bench", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    snap = {"generate": {}}
    for src in FAMILIES:
        name = Path(src).name
        for mode in ("unified", "static"):
            snap["generate"][f"{name}/{mode}"] = _generate(src, mode)
            print(name, mode, snap["generate"][f"{name}/{mode}"]["counters"], flush=True)
    if not args.no_bench:
        snap["bench"] = _bench()
    Path(args.out).write_text(json.dumps(snap, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
