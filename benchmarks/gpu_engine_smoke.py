"""The engine on the GPU with the Pallas kernels: same greedy tokens as with the plain-JAX
references, for the built-in tiny hybrid and the committed tiny fixtures, in both memory modes.

    PYTHONPATH=$PWD python3 benchmarks/gpu_engine_smoke.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from umem_jax import LLM, SamplingParams

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"


def run(model, impl: str, mode: str) -> list[list[int]]:
    llm = LLM(model=model, kernel_impl=impl, memory_mode=mode, arena_bytes=32 << 20, kv_cache_dtype="float32",
              max_num_batched_tokens=64)
    rng = np.random.default_rng(0)
    vocab = llm.llm_engine.model.config.vocab_size
    prompts = [rng.integers(3, vocab - 1, n).tolist() for n in (5, 23, 70, 130)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def main() -> int:
    models = ["tiny"] + [str(p) for p in (FIXTURES / "nemotron_h_tiny", FIXTURES / "qwen3_5_tiny",
                                           FIXTURES / "gemma3_tiny") if p.exists()]
    bad = 0
    for m in models:
        for mode in ("unified", "static") if m == "tiny" else ("unified",):
            t0 = time.time()
            ref, got = run(m, "reference", mode), run(m, "pallas", mode)
            same = sum(a == b for a, b in zip(ref, got))
            bad += same != len(ref)
            print(f"{Path(m).name:<16} {mode:<8} pallas == reference greedy: {same}/{len(ref)}  ({time.time() - t0:.0f} s)",
                  flush=True)
    print("engine smoke:", "OK" if not bad else f"{bad} MISMATCHED")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
