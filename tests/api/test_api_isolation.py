"""A request that fails inside the engine, over HTTP under concurrent load (engine/isolation.py):
it alone gets a 500 -- an error event when streaming -- with the engine's message; every other
request gets exactly its one-at-a-time greedy output; the engine stays up, its arena clean.

Injected for one marked prompt: the runner's decode step raises for any batch holding it (the
engine bisects the launch to find it), or its detokenizer raises while the async engine
streams its text (outside LLMEngine.step)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from _engine_utils import fail_step_when
from _server_utils import MODEL, drained, engine_call

from umem_jax.engine.detokenizer import IncrementalDetokenizer

PROMPTS = [f"Prompt {k}: tell me" for k in range(8)]
MARKED = PROMPTS[3]
KW = {"model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True}


class Injected(RuntimeError):
    pass


def _in_decode_step(monkeypatch, eng) -> None:
    marked = lambda b: b.kind == "decode" and any(r.req.prompt == MARKED and r.req.num_output >= 2 for r in b.rows)
    fail_step_when(monkeypatch, eng.runner, marked, Injected("decode step"))


def _in_streamed_text(monkeypatch, eng) -> None:
    step = IncrementalDetokenizer.step

    def failing(self, token_id):
        if len(self.ids) > 7 and any(r.detok is self for r in eng._requests.values() if r.prompt == MARKED):
            raise Injected("detokenizer")
        return step(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "step", failing)


async def _one(client: httpx.AsyncClient, prompt: str, stream: bool):
    """-> (prompt, status, text, error message or None)."""
    body = {**KW, "prompt": prompt, "stream": stream}
    if not stream:
        r = await client.post("/v1/completions", json=body)
        j = r.json()
        return prompt, r.status_code, j["choices"][0]["text"] if r.status_code == 200 else "", j.get("error")
    text, error = "", None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
            else:
                text += event["choices"][0]["text"]
        return prompt, r.status_code, text, error


@pytest.mark.parametrize("inject", [_in_decode_step, _in_streamed_text], ids=["decode step", "streamed text"])
def test_a_failing_request_gets_500_and_the_others_their_outputs(srv, monkeypatch, inject):
    ref = {p: srv.client.completions.create(prompt=p, **{k: v for k, v in KW.items() if k != "ignore_eos"},
                                            extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS}
    assert drained(srv) == (0, 0, 0)
    engine_call(srv, lambda e: inject(monkeypatch, e))  # in the engine thread, between two steps

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
            return await asyncio.wait_for(asyncio.gather(*(
                _one(client, PROMPTS[i % 8], stream=i % 2 == 0) for i in range(32))), 240)

    try:
        results = asyncio.run(main())
    finally:
        engine_call(srv, lambda e: monkeypatch.undo())
    failed = [r for r in results if r[0] == MARKED]
    assert len(failed) == 4
    for prompt, status, text, error in failed:
        assert status in (200, 500) and error is not None  # 200: a stream that had started, then its error event
        assert error["code"] == 500 and "request failed in the engine" in error["message"]
        assert "Injected" in error["message"]
    for prompt, status, text, error in results:
        if prompt != MARKED:
            assert (status, error, text) == (200, None, ref[prompt]), prompt
    assert srv.aeng.error is None and httpx.get(srv.url + "/health").status_code == 200
    assert drained(srv) == (0, 0, 0)
    engine_call(srv, lambda e: e.check_idle())
    again = srv.client.completions.create(prompt=MARKED, **{k: v for k, v in KW.items() if k != "ignore_eos"},
                                          extra_body={"ignore_eos": True})
    assert again.choices[0].text == ref[MARKED]
