"""The engine soak (issue 21): random workloads on every memory family's tiny model, each
checked against the promise that an admitted request finishes with its whole output (see
_soak.py for what a workload holds and what is checked).

CI runs 32 workloads on shapes the other engine tests compile anyway (the tiny hybrid at the
shared settings, tiny-attention and the Gemma 3 fixture at the prefix-cache tests' arenas;
test_soak_speculative.py runs 16 with speculative decoding);
`--long` runs 2,000 and more families, page sizes and arenas.  A failure names its seed:
`soak([family], 1, seed=...)` replays it.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import pytest
from _engine_utils import ARENA, tiny
from _options import long_tests_enabled
from _soak import Family, soak

FIXTURES = Path(__file__).parents[1] / "fixtures"


@functools.cache
def _model(name: str):
    from umem_jax.models.loader import load_model

    return tiny() if name == "tiny" else load_model(name if name.startswith("tiny") else str(FIXTURES / name))


def _pages(page_size: int, max_model_len: int) -> dict:
    return dict(page_size=page_size, max_model_len=max_model_len, page_buckets=(max_model_len // page_size,))


def families(long: bool = False) -> list[Family]:
    """window + state + full (tiny), window + full (tiny-attention, Gemma 3), state + full
    (NemotronH).  A dense attention-only model is refused by the plan (unified memory is for
    hybrid models), so it has no family here."""
    m = lambda name: functools.partial(_model, name)
    out = [
        Family("tiny", m("tiny"), dict(arena_bytes=ARENA, **_pages(4, 1024)), dict(arena_bytes=4 * ARENA, **_pages(4, 1024))),
        Family("tiny-attention", m("tiny-attention"), dict(arena_bytes=100000, **_pages(4, 1024)),
               dict(arena_bytes=1 << 21, **_pages(4, 1024)), sampling=()),
        Family("gemma3", m("gemma3_tiny"), dict(arena_bytes=64 << 10, max_model_len=256, page_size=4, page_buckets=(256,)),
               dict(arena_bytes=4 << 20, max_model_len=256, page_size=4, page_buckets=(256,)), sampling=()),
        # 64 KiB: a prompt of 124 tokens at most; 256 KiB (the prefix-cache tests' shape) holds any
        Family("nemotron_h", m("nemotron_h_tiny"), dict(arena_bytes=64 << 10, **_pages(4, 256)),
               dict(arena_bytes=256 << 10, **_pages(4, 256)), sampling=()),
    ]
    return out


def test_soak_ci():
    t0 = time.perf_counter()
    counts = soak(families(), 32, seed=0, most=4)
    assert counts["workloads"] == 32
    assert counts["restarts"] == 0  # the shortfall ladder's last rung: never needed while pricing holds
    print(f"soak: {counts} in {time.perf_counter() - t0:.1f} s")


def long_families() -> list[Family]:
    """The CI families with sampling in both arenas and some engines without the prefix cache,
    plus page size 8, Qwen3.5 (gated DeltaNet state + full) and gpt-oss (window + full, MoE)."""
    m = lambda name: functools.partial(_model, name)
    out = families()
    for f in out:
        f.sampling, f.caching_off = ("small", "big"), True
    out += [
        Family("tiny/8", m("tiny"), dict(arena_bytes=ARENA, **_pages(8, 1024)), dict(arena_bytes=4 * ARENA, **_pages(8, 1024)),
               sampling=("small",), caching_off=True),
        Family("tiny-attention/8", m("tiny-attention"), dict(arena_bytes=100000, **_pages(8, 1024)),
               dict(arena_bytes=1 << 21, **_pages(8, 1024))),
        Family("qwen3_5", m("qwen3_5_tiny"), dict(arena_bytes=64 << 10, **_pages(4, 256)),
               dict(arena_bytes=256 << 10, **_pages(4, 256))),
        Family("gpt_oss", m("gpt_oss_tiny"), dict(arena_bytes=48 << 10, **_pages(4, 256)),
               dict(arena_bytes=1 << 20, **_pages(4, 256))),
    ]
    return out


def test_soak_long(request):
    if not long_tests_enabled(request.config):
        pytest.skip("long-running: run with --long or UMEM_LONG_TESTS=1")
    t0 = time.perf_counter()
    counts = soak(long_families(), 2000, seed=1, most=6, keep_going=True, log=print)
    print(f"soak --long: {counts} in {time.perf_counter() - t0:.1f} s")
    assert not counts["failures"], "\n".join(counts["failures"])
