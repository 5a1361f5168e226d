"""The disaggregated router refuses what it cannot answer -- echo and prompt logprobs (the
prompt's scores stay in the prefill worker's passes) -- with a 400 naming the field, before it
contacts any worker (none runs here: the URLs point nowhere)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from umem_jax.disagg.router import Router
from umem_jax.disagg.router_app import build_router_app

NOWHERE = "http://127.0.0.1:9"  # the discard port: nothing listens


async def _post(path: str, body: dict) -> httpx.Response:
    app = build_router_app(Router([NOWHERE], [NOWHERE], timeout_s=1))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
        return await c.post(path, json=body)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": [5, 6, 7], "echo": True, "logprobs": 2}, "echo"),
    ("/v1/completions", {"prompt": [5, 6, 7], "echo": True, "max_tokens": 0}, "echo"),
    ("/v1/completions", {"prompt": [5, 6, 7], "prompt_logprobs": 0}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1},
     "prompt_logprobs"),
])
def test_echo_and_prompt_logprobs_are_refused_by_name(path, body, param):
    r = asyncio.run(_post(path, body))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and f"{param} is not supported by the disaggregated router" in err["message"]
