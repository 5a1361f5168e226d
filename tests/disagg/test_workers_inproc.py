"""The router in front of in-process prefill and decode workers (_inproc.py, tiny hybrid family):
request options that must reach the decode side unchanged, faults of the pair, leaks."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from _inproc import InProcWorker, assert_no_leaks, reference

from umem_jax.disagg.router import Router, build_router_app


@pytest.fixture(scope="module")
def pair():
    ws = {"prefill": InProcWorker("prefill"), "decode": InProcWorker("decode")}
    try:
        yield ws
    finally:
        for w in ws.values():
            w.stop()


def _client(router: Router) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_router_app(router)), base_url="http://router",
                             timeout=300)


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 250, n).tolist()


def _got(r: httpx.Response):
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    return ch["token_ids"], ch["finish_reason"]


@pytest.mark.parametrize("min_tokens", [2, 7])
def test_min_tokens_above_one(pair, min_tokens):
    """The prefill worker runs the first token alone (max_tokens=1): a min_tokens > 1 must not
    make its params invalid (it was a 400), and the output equals one engine's."""
    p = _prompt(min_tokens, 21)
    want = reference("hybrid", p, temperature=0.0, max_tokens=9, min_tokens=min_tokens)

    async def go():
        async with _client(Router([pair["prefill"].url], [pair["decode"].url], timeout_s=120)) as c:
            r = await c.post("/v1/completions", json={"prompt": p, "max_tokens": 9, "min_tokens": min_tokens,
                                                      "temperature": 0})
        assert _got(r) == want
        await assert_no_leaks(*pair.values())

    asyncio.run(go())
