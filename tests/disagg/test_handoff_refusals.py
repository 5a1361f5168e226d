"""In-process handoff refusals and their bookkeeping: a reservation refuses what one engine of
the same config refuses (with the same reason), and an envelope set that does not match the
transfer plan (a truncated or corrupt payload) is refused before any byte is written, with the
reservation left to its owner to cancel and every page accounted for."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from _disagg_models import DECODE_ARENA, PREFILL_ARENA, engine

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


def _exported(prompt):
    P = engine("hybrid", PREFILL_ARENA)
    P.handoff.hold_after_prefill("x")
    P.add_request(prompt, _greedy(1), request_id="x")
    while "x" not in P.scheduler.held:
        P.step()
    env = P.handoff.export("x")
    P.handoff.release("x")
    P.check_idle()
    return env


def _bad_envelopes(env):
    """Envelope sets a truncated or corrupted payload could decode to: (what, envelopes)."""
    full, win = env.pages["full"], env.pages["window16"]
    yield "one page short", dataclasses.replace(env, pages={**env.pages, "full": full[:-1]})
    yield "one page only (would broadcast)", dataclasses.replace(env, pages={**env.pages, "full": full[:1]})
    yield "a sub-pool missing", dataclasses.replace(env, pages={"full": full})
    yield "no state slot", dataclasses.replace(env, state=None)
    yield "rows cut", dataclasses.replace(env, pages={**env.pages, "window16": win[:, :-1]})
    yield "another dtype", dataclasses.replace(env, pages={**env.pages, "full": full.astype(np.float32)})
    yield "a first token off the vocabulary", dataclasses.replace(env, first_token=10**6)


def test_envelopes_off_the_plan_are_refused_before_any_write():
    prompt = np.random.default_rng(8).integers(3, 300, 37).tolist()
    env = _exported(prompt)
    D = engine("hybrid", DECODE_ARENA)
    for what, bad in _bad_envelopes(env):
        D.handoff.reserve(prompt, _greedy(6), "r")
        before = np.asarray(D.runner.arena.data).copy()
        with pytest.raises(ValueError) as e:
            D.handoff.install("r", bad)
        assert "r" in D.scheduler.held, what  # still reserved: the caller fences and frees it
        assert np.array_equal(np.asarray(D.runner.arena.data).view(np.uint16), before.view(np.uint16)), what
        assert "envelope" in str(e.value) or "token" in str(e.value), (what, str(e.value))
        D.handoff.release("r")
        D.check_idle()
    # the good set still installs and decodes after all that
    req = D.handoff.reserve(prompt, _greedy(6), "ok")
    D.handoff.install("ok", env)
    while D.has_unfinished_requests():
        D.step()
    assert len(req.output_token_ids) == 6
    D.check_idle()
