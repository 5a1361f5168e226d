"""The three tiny families of the disaggregation tests (window + full, state + full, window +
state + full) and the engine settings they share: one arena shape per side and one bucket per
dimension, so each family compiles a prefill and a decode step (plus the envelope copies)."""

from __future__ import annotations

import functools

SETTINGS = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=4, max_model_len=256,
                batch_buckets=(4,), token_buckets=(32,), page_buckets=(64,))
PREFILL_ARENA = 160 << 10  # the two sides differ on purpose: the transfer must not care
DECODE_ARENA = 224 << 10


@functools.cache
def family(name: str):
    from umem_jax.models.config import FULL, RECURRENT, SLIDING
    from umem_jax.models.tiny import tiny_model

    types = {"window": (SLIDING, FULL, SLIDING, FULL), "state": (RECURRENT, FULL, RECURRENT, FULL),
             "hybrid": (SLIDING, RECURRENT, FULL, SLIDING)}[name]
    return tiny_model(seed=7, layer_types=types)


FAMILIES = ("window", "state", "hybrid")


def engine(name: str, arena: int, **overrides):
    from umem_jax.engine.config import EngineConfig
    from umem_jax.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model=family(name), arena_bytes=arena, **{**SETTINGS, **overrides}))
