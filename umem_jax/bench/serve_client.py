"""The client of `umem-jax bench serve`: streamed OpenAI requests to any compatible server
(ours, vLLM's, SGLang's), sent on an arrival schedule under a concurrency cap (httpx, asyncio).

    outputs, duration, peak = asyncio.run(run_requests(api, samples, offsets, max_concurrency=8))

Each request streams (`stream_options.include_usage`): the time to first token is taken at the
first chunk that carries a choice, each later chunk adds one inter-token gap (as vLLM and SGLang
measure: a server that sends several tokens in one chunk shows one longer gap), the latency at
the end of the stream.  Token counts come from the final usage chunk; without one from the
tokenizer given, else the number of chunks (`output_tokens_source` says which).  Clocks are
perf_counter seconds from the run's start; latencies count from the request's send (after the
concurrency cap let it through), like vLLM's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time

from .datasets import SampleRequest
from .progress import progress_bar

REQUEST_TIMEOUT_S = 6 * 3600


@dataclasses.dataclass
class Api:
    """Where and how to send: the endpoint's URL, the served model, the request body's knobs."""

    url: str  # full endpoint URL: .../v1/completions or .../v1/chat/completions
    model: str
    chat: bool = False
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: dict = dataclasses.field(default_factory=dict)
    headers: dict = dataclasses.field(default_factory=dict)
    tokenizer: object | None = None  # ClientTokenizer: output tokens without the server's usage

    def body(self, s: SampleRequest) -> dict:
        if self.chat and not isinstance(s.prompt, str):
            raise ValueError("the chat endpoint takes text prompts: use --dataset-name sharegpt, or random with "
                             "--tokenizer (token-id prompts go to /v1/completions)")
        key = ("messages", [{"role": "user", "content": s.prompt}]) if self.chat else ("prompt", s.prompt)
        body = {"model": self.model, key[0]: key[1], "max_tokens": s.output_len, "temperature": self.temperature,
                "stream": True, "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        return {**body, **self.extra_body}


@dataclasses.dataclass
class RequestOutput:
    """One request as the client saw it.  Times in seconds."""

    prompt_len: int  # the sample's count (the server's usage replaces it when it reports one)
    output_len: int  # asked (max_tokens)
    success: bool = False
    error: str = ""
    generated_text: str = ""
    output_tokens: int = 0
    output_tokens_source: str = "usage"  # "usage" | "tokenizer" | "chunks"
    start: float = 0.0  # sent, from the run's start
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    chunk_times: list[float] = dataclasses.field(default_factory=list)  # from the run's start


def _text(choice: dict, chat: bool) -> str:
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def send(client, api: Api, s: SampleRequest, t0: float) -> RequestOutput:
    """Stream one request -> its RequestOutput (an HTTP error, an error event or a dropped
    connection gives success=False with the reason; the run goes on)."""
    out = RequestOutput(s.prompt_len, s.output_len)
    st = time.perf_counter()
    out.start = st - t0
    last, chunks, usage = st, 0, None
    try:
        async with client.stream("POST", api.url, json=api.body(s), headers=api.headers) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return out
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    out.error = str(err.get("message", err) if isinstance(err, dict) else err)
                    return out
                now = time.perf_counter()
                if chunk.get("choices"):
                    if chunks == 0:
                        out.ttft = now - st
                    else:
                        out.itl.append(now - last)
                    chunks, last = chunks + 1, now
                    out.chunk_times.append(now - t0)
                    out.generated_text += "".join(_text(c, api.chat) for c in chunk["choices"])
                if chunk.get("usage"):
                    usage = chunk["usage"]
        out.latency = last - st
    except Exception as e:  # noqa: BLE001 -- refused / reset / bad JSON: this request failed, the others go on
        out.error = f"{type(e).__name__}: {e}"
        return out
    if chunks == 0:
        out.error = "the stream ended without a token"
        return out
    out.success = True
    if usage and usage.get("completion_tokens") is not None:
        out.output_tokens = int(usage["completion_tokens"])
        out.prompt_len = int(usage.get("prompt_tokens") or out.prompt_len)
    elif api.tokenizer is not None:
        out.output_tokens, out.output_tokens_source = api.tokenizer.count(out.generated_text), "tokenizer"
    else:
        out.output_tokens, out.output_tokens_source = chunks, "chunks"
    return out


def _client(max_connections: int | None):
    import httpx

    return httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S),
                             limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=None))


async def initial_test(api: Api, s: SampleRequest, timeout_s: float = 0.0, say=None) -> RequestOutput:
    """One request before the run (not counted): the endpoint, model and flags work.  Retried
    every second until it succeeds or timeout_s passes (a server still warming up); say(line)
    tells of the first failure."""
    deadline = time.monotonic() + timeout_s
    async with _client(4) as client:
        while True:
            out = await send(client, api, s, time.perf_counter())
            if out.success or time.monotonic() >= deadline:
                return out
            if say is not None:  # once: retrying for minutes without a word looks like a hang
                say(f"the test request failed ({out.error}); retrying every second for up to {timeout_s:g} s "
                    "(--ready-check-timeout-sec)")
                say = None
            await asyncio.sleep(1.0)


async def run_requests(api: Api, samples: list[SampleRequest], offsets: list[float], *,
                       max_concurrency: int | None = None, progress: bool = True) -> tuple[list[RequestOutput], float,
                                                                                           int]:
    """Send samples[i] at offsets[i] seconds (waiting for a free slot under max_concurrency)
    -> (outputs in sample order, duration: start to the last request's end, peak requests in
    flight)."""
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    live = [0, 0]  # in flight now, peak

    async def one(client, s, at, t0, advance):
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        if gate is not None:
            await gate.acquire()
        live[0] += 1
        live[1] = max(live[1], live[0])
        try:
            return await send(client, api, s, t0)
        finally:
            live[0] -= 1
            if gate is not None:
                gate.release()
            advance(1)

    label = f"{len(samples)} requests"
    with progress_bar(len(samples), label, progress) as advance:
        async with _client(max_concurrency) as client:
            t0 = time.perf_counter()
            outputs = await asyncio.gather(*(one(client, s, at, t0, advance) for s, at in zip(samples, offsets)))
            duration = time.perf_counter() - t0
    return list(outputs), max(duration, 1e-9), live[1]


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


__all__ = ["Api", "RequestOutput", "initial_test", "rate_label", "run_requests", "send"]
