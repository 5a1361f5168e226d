"""The engine soak (_soak.py) with speculative decoding: a draft model proposes, and each decode
step is launched before the previous one is read back (its rows shifted on the device by the
accepted counts).  Same checks as test_soak.py: every request ends exactly once with its whole
output, greedy ones with the tokens the roomy arena gives without speculation, aborted ones with
a prefix of them, and the idle leak checks pass."""

from __future__ import annotations

import functools
import time

from _engine_utils import noisy_copy, tiny
from _soak import Family, soak
from test_soak import _model, _pages


@functools.cache
def _window_full():
    """Window + full attention at one layer each: tiny-attention's kinds (and sizes) at a third of
    its six layers.  A draft step is k + 1 draft forwards, so the draft's layers set most of this
    soak's compile and step time."""
    from umem_jax.models.config import FULL, SLIDING
    from umem_jax.models.tiny import tiny_model

    return tiny_model(with_mamba=False, layer_types=(SLIDING, FULL))


def speculative_families() -> list[Family]:
    """Speculation with a draft model, its steps overlapped (each launched before the previous
    one is read back): window + full drafted by a noisy copy of itself, and the tiny hybrid
    (state) drafted by an attention-only model (window + full) of its vocabulary, under pressure.
    The small arenas give the clip limits the six-layer attention models gave in 160,000 bytes
    and 260 KiB (48 and 200 tokens): the first holds the KV of a third of the layers in about a
    third of the bytes.  max_model_len 256 (64-page tables; no prompt here is longer than 200):
    a step's attention reads the whole table, 1,024 positions at max_model_len 1024, 2-3x the
    decode step's time on the CPU."""
    from umem_jax.models.config import FULL, SLIDING
    from umem_jax.models.tiny import tiny_model

    spec = lambda draft: {"method": "draft", "model": draft, "num_speculative_tokens": 3, "min_acceptance": 0.0}
    attn = spec(noisy_copy(_window_full(), 0.2))
    hybrid = spec(tiny_model(seed=3, with_mamba=False, vocab_size=tiny().config.vocab_size,
                             layer_types=(SLIDING, FULL)))
    return [Family("window+full+draft", _window_full, dict(arena_bytes=54 << 10, speculative_config=attn,
                                                           **_pages(4, 256)),
                   dict(arena_bytes=1 << 21, speculative_config=attn, **_pages(4, 256))),
            Family("tiny+draft", functools.partial(_model, "tiny"),
                   dict(arena_bytes=200 << 10, speculative_config=hybrid, **_pages(4, 256)),
                   dict(arena_bytes=2 << 20, speculative_config=hybrid, **_pages(4, 256)))]


def test_soak_speculative_ci():
    """Greedy requests end with the tokens the roomy arena gives without speculation
    (Family.reference: a plain engine, so the references compile the plain step, not a second
    draft and verify per family: 97 -> 56 s alone), through retraction, preemption, aborts and
    cache hits while steps overlap."""
    t0 = time.perf_counter()
    counts = soak(speculative_families(), 16, seed=1, most=4)
    assert counts["workloads"] == 16 and counts["restarts"] == 0
    assert counts["retractions"] + counts["preemptions"] > 0 and counts["aborted"] > 0, counts
    print(f"soak with speculation: {counts} in {time.perf_counter() - t0:.1f} s")
