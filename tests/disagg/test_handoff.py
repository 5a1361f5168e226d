"""In-process handoff: prefill on engine P, page envelopes to engine D (another arena size),
decode on D == one engine, for the window, state and hybrid tiny families; refusals; and every
page accounted for on both sides after success and after a cancelled reservation."""

from __future__ import annotations

import numpy as np
import pytest
from _disagg_models import DECODE_ARENA, FAMILIES, PREFILL_ARENA, engine

from umem_jax.core.sampling_params import SamplingParams

MAX_TOKENS = 10


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 300, int(rng.integers(5, 40))).tolist() for _ in range(n)]


def _greedy(max_tokens=MAX_TOKENS):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _run(eng):
    while eng.has_unfinished_requests():
        eng.step()


def _single(name, prompts):
    eng = engine(name, DECODE_ARENA)
    ids = [eng.add_request(p, _greedy()) for p in prompts]
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0].token_ids for o in eng.step()})
    return [outs[i] for i in ids]


def _disaggregated(P, D, prompts):
    """Prefill every prompt on P (held when done), move each one's envelopes to D as soon as it
    is held and release it on P, decode on D meanwhile -> D's tokens."""
    rids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts):
        P.handoff.hold_after_prefill(rid)
        P.add_request(p, _greedy(1), request_id=rid)
    reqs = {}
    while P.has_unfinished_requests() or P.scheduler.held or D.has_unfinished_requests():
        if P.has_unfinished_requests():
            P.step()
        for rid in list(P.scheduler.held):
            env = P.handoff.export(rid)
            reqs[rid] = D.handoff.reserve(prompts[rids.index(rid)], _greedy(), rid)
            assert reqs[rid] is not None
            D.handoff.install(rid, env)
            P.handoff.release(rid)
        if D.has_unfinished_requests():
            D.step()
    P.check_idle()
    D.check_idle()
    return [reqs[r].output_token_ids for r in rids]


@pytest.mark.parametrize("name", FAMILIES)
def test_prefill_then_decode_equals_one_engine(name):
    prompts = _prompts({"window": 1, "state": 2, "hybrid": 5}[name], 6)
    want = _single(name, prompts)
    P, D = engine(name, PREFILL_ARENA), engine(name, DECODE_ARENA)
    assert P.allocator.num_rows != D.allocator.num_rows
    got = _disaggregated(P, D, prompts)
    assert got == want
    # a second round reuses P's prefix cache (its pages stay usable after the transfers)
    got = _disaggregated(P, D, prompts[:3])
    assert got == want[:3]
    assert P.stats()["prefix_cache_hit_tokens"] > 0
    for eng in (P, D):
        assert not eng.scheduler.held
        eng.reset_prefix_cache()
        eng.check_idle()
        assert sum(eng.allocator.usage().subpools[k].held for k in eng.plan.names) == 0


def test_other_plan_is_refused_with_the_reason():
    P, D = engine("window", PREFILL_ARENA), engine("state", DECODE_ARENA)
    P.handoff.hold_after_prefill("x")
    P.add_request([5, 6, 7, 8, 9], _greedy(1), request_id="x")
    _run(P)
    env = P.handoff.export("x")
    D.handoff.reserve([5, 6, 7, 8, 9], _greedy(), "x")
    with pytest.raises(ValueError, match="another memory plan"):
        D.handoff.install("x", env)
    D.handoff.release("x")
    P.handoff.release("x")
    for eng in (P, D):
        eng.check_idle()


def test_cancelled_reservation_frees_everything():
    D = engine("hybrid", DECODE_ARENA)
    before = D.allocator.usage()
    req = D.handoff.reserve(list(range(3, 40)), _greedy(), "c")
    assert "c" in D.scheduler.held and len(req.pages) == 10 and len(req.slots) == 1
    D.check_idle()  # a held reservation is accounted for
    D.abort_request("c")  # the client went away: the reservation goes with it
    assert not D.scheduler.held and req.finished
    D.check_idle()
    assert D.allocator.usage().subpools == before.subpools
