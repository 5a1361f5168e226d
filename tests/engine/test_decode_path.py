"""docs/architecture.md lists the files one decode step crosses: this traces a real one.

The step's model code runs in Python only while the step is traced, so the jit caches are cleared
first and the traced step is the one a cold start would run.  Every file of umem_jax that runs
must be in the document's two tables, and every file of its chain must run.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
FIXTURE = ROOT / "tests" / "fixtures" / "gemma3_tiny"


def _table(name: str) -> list[str]:
    text = DOC.read_text()
    block = text.split(f"<!-- {name} -->")[1].split(f"<!-- /{name} -->")[0]
    return re.findall(r"`(umem_jax/[\w/]+\.py)`", block)


def _trace_one_decode_step() -> set[str]:
    from umem_jax import LLM, SamplingParams
    from umem_jax.models.loader import load_model
    from umem_jax.runner import sampler

    llm = LLM(load_model(FIXTURE), arena_bytes=1 << 20, max_num_seqs=4, max_num_batched_tokens=32, page_size=4,
              max_model_len=128, batch_buckets=(4,), token_buckets=(32,), page_buckets=(64,))
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate([[5, 6, 7, 8, 9]], sp)  # compiles both step shapes
    engine = llm.llm_engine
    engine.add_request([5, 6, 7, 8, 9, 10, 11], sp)
    while not any(r.decode_ready for r in engine.scheduler.running):
        engine.step()  # the prefill pass
    jax.clear_caches()
    for f in (sampler.sample, sampler.sample_with_penalties):
        f.clear_cache()  # nested jits keep their own trace caches
    ran: set[str] = set()
    pkg = str(ROOT / "umem_jax")

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(pkg):
            ran.add(str(Path(frame.f_code.co_filename).relative_to(ROOT)))

    # The applications above the API (the benchmark's compile listeners, say) are reached only
    # through process-wide hooks that earlier tests in this process registered: not the step.
    apps = ("umem_jax/bench/", "umem_jax/cli.py", "umem_jax/demo.py", "umem_jax/arena_demo.py")

    sys.setprofile(profile)
    try:
        engine.step()  # a decode step: schedule, launch (traced again), read back
    finally:
        sys.setprofile(None)
    while engine.has_unfinished_requests():
        engine.step()
    return {f for f in ran if not f.startswith(apps)}


def test_decode_step_crosses_the_documented_files():
    chain, side = _table("decode-chain"), _table("decode-side")
    assert len(chain) == len(set(chain)) and not set(chain) & set(side)
    for path in chain + side:
        assert (ROOT / path).is_file(), f"docs/architecture.md names {path}, which does not exist"
    ran = _trace_one_decode_step()
    undocumented = ran - set(chain) - set(side)
    assert not undocumented, f"a decode step runs files docs/architecture.md does not list: {sorted(undocumented)}"
    entry = "umem_jax/api/llm.py"  # LLM.generate only loops over engine.step(), traced here from the engine
    missing = set(chain) - ran - {entry}
    assert not missing, f"docs/architecture.md lists files a decode step does not run: {sorted(missing)}"
    assert "engine.step()" in (ROOT / entry).read_text()
