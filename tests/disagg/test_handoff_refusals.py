"""In-process handoff refusals and their bookkeeping: a reservation refuses what one engine of
the same config refuses (with the same reason), and an envelope set that does not match the
transfer plan (a truncated or corrupt payload) is refused before any byte is written, with the
reservation left to its owner to cancel and every page accounted for."""

from __future__ import annotations


import numpy as np
import pytest
from _disagg_models import engine

from umem_jax.core.sampling_params import SamplingParams

SMALL_ARENA = 60 << 10  # holds a 30-token prompt and ~75 new tokens: max_model_len (256) is above it


def _greedy(max_tokens):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_reserve_refuses_max_tokens_beyond_the_arena_like_one_engine():
    """max_model_len set above what the decode arena holds: an explicit max_tokens that does not
    fit beside the prompt is refused naming how many do (as LLMEngine.enqueue does), not cut short
    under a 'length' finish; an unset max_tokens still takes what fits."""
    D = engine("hybrid", SMALL_ARENA)
    prompt = np.random.default_rng(4).integers(3, 300, 30).tolist()
    fits = D.demand.clip(len(prompt), 200)
    assert fits is not None and fits < 200
    rid = D.add_request(prompt, _greedy(200))  # one engine: refused at arrival with the reason
    (out,) = [o for o in D.step() if o.request_id == rid]
    assert out.outputs[0].finish_reason == "abort"
    with pytest.raises(ValueError, match=f"max_tokens=200 does not fit the arena.*at most {fits}"):
        D.handoff.reserve(prompt, _greedy(200), "big")
    assert not D.scheduler.held and "big" not in D._requests
    req = D.handoff.reserve(prompt, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True), "unset")
    assert req is not None and req.max_tokens == fits
    D.handoff.release("unset")
    D.check_idle()
