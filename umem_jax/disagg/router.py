"""`umem-jax router --prefill URL --decode URL`: the OpenAI API in front of a prefill and a decode
worker.  Each request: tokenize (at the decode worker), reserve its pages at the decode worker,
prefill at the prefill worker (which sends the page envelopes to the decode worker), then stream
the decode worker's tokens back as OpenAI completions / chat completions (streamed or not).

Workers go round-robin; a worker that refuses the connection (gone) or a decode worker with no
room for the reservation is passed over for the next one within the same attempt, since nothing
happened there yet.  A failed transfer (timed out, dropped, the decode worker gone) is retried
`retries` times with a new transfer id before any token reached the client, then answered 503
with the reason; so is a decode worker's stream lost before its first token (its GET is sent
again first, once, when the connection was lost under it: keepalive.py).  Choices
carry `token_ids` besides the text.  Not supported yet (400 by name): n / best_of > 1, logprobs,
echo, prompt_logprobs, suffix, several prompts in one request.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import time
import uuid

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..api.errors import APIError, add_handlers, bad_request, error
from ..api.protocol import ChatCompletionRequest, CompletionRequest
from .keepalive import LOST, client_limits


class TransferFailed(RuntimeError):
    """This attempt failed before any token was sent: another attempt may succeed."""


class WorkerDown(TransferFailed):
    """The worker refused the connection (or none opened): nothing reached it, so the same step
    may go to another worker at once."""


DOWN_S = 5.0  # a worker that refused a connection is tried after the others for this long


class Router:
    """prefill / decode: worker base URLs (round-robin); timeout_s: a transfer's deadline (the
    decode worker's reservation and the prefill worker's wait for the ack); retries: attempts
    after the first; reserve_wait_s: how long a reservation may wait for room at the decode worker;
    transport: how the prefill workers send the envelopes ("http" / "shm" / "auto", wire.py; None:
    each worker's --disaggregation-transfer-backend)."""

    def __init__(self, prefill: list[str], decode: list[str], *, timeout_s: float = 30.0, retries: int = 1,
                 reserve_wait_s: float = 60.0, transport: str | None = None):
        self.prefill, self.decode = [u.rstrip("/") for u in prefill], [u.rstrip("/") for u in decode]
        self._p, self._d = itertools.cycle(self.prefill), itertools.cycle(self.decode)
        self.timeout_s, self.retries, self.reserve_wait_s = timeout_s, retries, reserve_wait_s
        self.transport = transport
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0), limits=client_limits())
        self.counts = {"requests": 0, "retries": 0, "failed": 0}
        self._down: dict[str, float] = {}  # worker URL -> time.monotonic() until which it is tried last
        self.errors: collections.deque[str] = collections.deque(maxlen=32)  # why recent attempts failed

    async def _post(self, url: str, **kw) -> httpx.Response:
        try:
            return await self.client.post(url, **kw)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise WorkerDown(f"{url}: {type(e).__name__} {e}") from None
        except httpx.HTTPError as e:
            raise TransferFailed(f"{url}: {type(e).__name__} {e}") from None

    def _order(self, urls: list[str], cycle) -> list[str]:
        """Every worker of `urls`, from the next one of the round robin on; those that refused a
        connection in the last DOWN_S seconds last (a gone worker does not take every other request)."""
        i = urls.index(next(cycle))
        now = time.monotonic()
        return sorted(urls[i:] + urls[:i], key=lambda u: self._down.get(u, 0.0) > now)

    def _went_down(self, url: str) -> None:
        self._down[url] = time.monotonic() + DOWN_S

    async def _any_decode(self, method: str, path: str, **kw) -> httpx.Response:
        """`method path` at the first decode worker that answers (any of them tokenizes and lists
        the model) -> its response; 503 naming why when none does."""
        why = []
        for url in self._order(self.decode, self._d):
            try:
                return await self.client.request(method, f"{url}{path}", **kw)
            except httpx.HTTPError as e:
                self._went_down(url)
                why.append(f"{url}: {type(e).__name__} {e}")
        raise APIError(503, f"no decode worker answered {path}: {'; '.join(why)}")

    async def tokenize(self, payload: dict) -> list[int]:
        r = await self._any_decode("POST", "/tokenize", json=payload)
        if r.status_code != 200:
            raise APIError(r.status_code, _message(r))
        return r.json()["tokens"]

    async def _reserve(self, tid: str, ids: list[int], params: dict) -> tuple[str, str, str | None]:
        """Reserve the prompt's pages at a decode worker -> (its URL, the generation, its plan
        fingerprint).  Workers are tried in turn (round robin): one that is gone or has no room now
        is passed over for the next; while none has room, try again until reserve_wait_s."""
        deadline = time.monotonic() + self.reserve_wait_s
        body = {"transfer_id": tid, "prompt_token_ids": ids, "params": params, "timeout_s": self.timeout_s,
                **({"transport": self.transport} if self.transport else {})}
        while True:
            why, full = [], False
            for url in self._order(self.decode, self._d):
                try:
                    r = await self._post(f"{url}/disagg/reserve", json=body)
                except WorkerDown as e:
                    self._went_down(url)
                    why.append(str(e))
                    continue
                if r.status_code == 200:
                    return url, r.json()["generation"], r.json().get("fingerprint")
                msg = _message(r)
                if r.status_code == 400:
                    raise APIError(400, msg)
                full |= r.status_code == 503
                why.append(f"{url}: {msg}")
            if not full or time.monotonic() > deadline:
                raise TransferFailed("; ".join(why))
            await _sleep(0.05)

    async def deltas(self, ids: list[int], params: dict, request_id: str | None = None):
        """The request's deltas ({text, token_ids, finish_reason, stop_reason, error}), first
        attempt or retried ones; raises APIError(503) when every attempt failed.  Transfer ids
        start with `request_id` when given (the body's extra field of that name)."""
        self.counts["requests"] += 1
        base, why = f"{request_id or 'req'}-{uuid.uuid4().hex[:12]}", ""
        for attempt in range(1 + self.retries):
            tid = base if attempt == 0 else f"{base}-r{attempt}"
            try:
                async for d in self._attempt(tid, ids, params):
                    yield d
                return
            except TransferFailed as e:
                why = str(e)
                self.errors.append(f"{tid}: {why}")
                self.counts["retries"] += attempt < self.retries
        self.counts["failed"] += 1
        raise APIError(503, f"the disaggregated request failed after {1 + self.retries} attempts: {why}")

    async def _prefill(self, body: dict) -> httpx.Response:
        """POST the prefill to a prefill worker: one that is gone is passed over for the next."""
        why = []
        for url in self._order(self.prefill, self._p):
            try:
                return await self._post(f"{url}/disagg/prefill", json=body)
            except WorkerDown as e:
                self._went_down(url)
                why.append(str(e))
        raise TransferFailed(f"no prefill worker answered: {'; '.join(why)}")

    async def _attempt(self, tid: str, ids: list[int], params: dict):
        d_url, gen, fingerprint = await self._reserve(tid, ids, params)
        try:
            r = await self._prefill({
                "transfer_id": tid, "generation": gen, "decode_url": d_url, "prompt_token_ids": ids,
                "params": params, "timeout_s": self.timeout_s, "fingerprint": fingerprint,
                **({"transport": self.transport} if self.transport else {})})
        except TransferFailed:
            await self._cancel(d_url, tid, gen)
            raise
        res = r.json() if r.status_code in (200, 400) else {}
        if r.status_code == 400:
            await self._cancel(d_url, tid, gen)
            raise APIError(400, res.get("error", {}).get("message", "bad request"))
        if res.get("status") != "sent":
            await self._cancel(d_url, tid, gen)
            if res.get("status") == "done":
                yield res
                return
            raise TransferFailed(res.get("error") or f"the prefill worker answered {r.status_code}: {_message(r)}")
        try:
            async for d in self._stream(d_url, tid):
                yield d
        except TransferFailed:  # nothing reached the client: its decoding (if it began) is aborted, then retried
            await self._cancel(d_url, tid, gen)
            raise

    async def _stream(self, url: str, tid: str):
        """The decode worker's deltas of `tid`.  Until the first one arrives nothing has reached
        the client, so a failure then raises TransferFailed (the attempt is cancelled and
        retried); a GET lost with its connection (keepalive.LOST: the worker may never have seen
        it) is sent once more first.  After the first delta a failure is the request's last delta,
        with its error."""
        for again in (True, False):
            started = False
            try:
                async with self.client.stream("GET", f"{url}/disagg/stream/{tid}") as r:
                    if r.status_code != 200:
                        raise TransferFailed(f"the decode worker has no stream for {tid}: {r.status_code}")
                    async for line in r.aiter_lines():
                        if line:
                            started = True
                            yield json.loads(line)
                return
            except httpx.HTTPError as e:
                why = f"{type(e).__name__} {e}"
                if started:
                    yield {"text": "", "token_ids": [], "finish_reason": "abort", "stop_reason": None,
                           "error": f"the decode worker went away mid-request: {why}"}
                    return
                if not (again and isinstance(e, LOST)):
                    raise TransferFailed(f"the decode worker's stream of {tid} failed before its first token: "
                                         f"{why}") from None

    async def check_workers(self) -> str | None:
        """Ask every worker its /disagg/status -> why this pairing cannot work (a URL in the wrong
        role, or workers of different memory plans: another model, page size or K/V dtype, whose
        envelopes the other side would refuse), or None.  A worker that does not answer is left out
        (each request checks again: a prefill worker computes nothing for a decode worker of another
        plan)."""
        seen, why = {}, []
        async with httpx.AsyncClient(timeout=10) as c:
            for role, urls in (("prefill", self.prefill), ("decode", self.decode)):
                for url in urls:
                    try:
                        r = await c.get(f"{url}/disagg/status")
                        st = r.json() if r.status_code == 200 else {}
                    except (httpx.HTTPError, ValueError):
                        continue
                    if st.get("mode") != role:
                        why.append(f"{url} is given as a {role} worker but is {st.get('mode') or 'not a worker'}")
                    else:
                        seen[url] = st.get("fingerprint")
        if len(set(seen.values())) > 1:
            why.append("the workers run different memory plans (model, page size or K/V dtype), so page envelopes "
                       "cannot move between them: " + ", ".join(f"{u} {f}" for u, f in seen.items()))
        return "; ".join(why) or None

    async def _cancel(self, url: str, tid: str, gen: str) -> None:
        for again in (True, False):  # a cancel is idempotent: one lost with its connection is sent again
            try:
                await self.client.post(f"{url}/disagg/cancel/{tid}", params={"generation": gen},
                                       timeout=self.timeout_s)
                return
            except LOST:
                if not again:
                    return
            except httpx.HTTPError:
                return  # the decode worker is gone, or its reservation expires by itself


def _message(r: httpx.Response) -> str:
    """A worker's error message (its OpenAI-style body), else its text."""
    try:
        return r.json().get("error", {}).get("message", r.text)
    except ValueError:
        return r.text[:300]


async def _sleep(s: float) -> None:
    import asyncio

    await asyncio.sleep(s)


def _asked(body, name: str) -> bool:
    """The request sets `name` (a field of its model, else an extra) to something but None / false."""
    value = getattr(body, name) if name in type(body).model_fields else (body.model_extra or {}).get(name)
    return value is not None and value is not False


def _refuse(body) -> None:
    # the router writes only the decode worker's tokens; the prompt's scores stay in the prefill
    # worker's passes (a handoff refuses prompt_logprobs), so neither echo nor them can be answered
    for name in ("prompt_logprobs", "echo"):
        if _asked(body, name):
            raise APIError(400, f"{name} is not supported by the disaggregated router (it returns no prompt text "
                           "or prompt logprobs); send such requests to a server that is not disaggregated", name)
    if body.n != 1 or (body.best_of or 1) != 1 or body.num_logprobs() is not None:
        raise APIError(400, "the disaggregated router supports n=1 without logprobs for now")
    bad = body.unsupported()
    if bad:
        raise APIError(400, f"{bad} is not supported", bad)


def build_router_app(router: Router, model_name: str = "umem-jax") -> FastAPI:
    app = FastAPI(title="umem_jax router", docs_url=None, redoc_url=None)
    add_handlers(app)

    @app.get("/health")
    async def health():
        for url in router.prefill + router.decode:
            try:
                if (await router.client.get(f"{url}/health", timeout=5)).status_code != 200:
                    return error(503, f"{url} is not ready")
            except httpx.HTTPError as e:
                return error(503, f"{url} is unreachable: {e}")
        return JSONResponse({})

    @app.get("/v1/models")
    async def models():
        r = await router._any_decode("GET", "/v1/models")
        return JSONResponse(r.json(), status_code=r.status_code)

    @app.get("/router/stats")
    async def stats():
        return {**router.counts, "errors": list(router.errors)}

    @app.post("/v1/completions")
    async def completions(raw: Request):
        body = CompletionRequest(**await raw.json())
        _refuse(body)
        prompts = body.prompts()
        if len(prompts) != 1:
            raise APIError(400, "the disaggregated router takes one prompt per request for now", "prompt")
        p = prompts[0]
        ids = p if isinstance(p, list) else await router.tokenize({"prompt": p})
        return await _respond(router, body, ids, "text_completion", body.model or model_name)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request):
        body = ChatCompletionRequest(**await raw.json())
        _refuse(body)
        template = {"add_generation_prompt": body.add_generation_prompt,  # rendered at the decode worker as asked
                    "continue_final_message": body.continue_final_message,
                    "chat_template_kwargs": _template_kwargs(body)}
        ids = await router.tokenize({"messages": body.conversation(), **template})
        return await _respond(router, body, ids, "chat.completion", body.model or model_name)

    return app


def _template_kwargs(body) -> dict | None:
    try:
        return body.template_kwargs()
    except ValueError as e:
        raise bad_request(e) from None


def _params(body) -> dict:
    try:
        return dataclasses.asdict(body.sampling_params())
    except ValueError as e:
        raise APIError(400, str(e)) from None


def _choice(kind: str, d: dict, stream: bool, role: str = "assistant") -> dict:
    out = {"index": 0, "finish_reason": d.get("finish_reason"), "stop_reason": d.get("stop_reason"),
           "token_ids": d.get("token_ids", [])}
    if kind == "text_completion":
        out["text"] = d.get("text", "")
    else:
        out["delta" if stream else "message"] = {"role": role, "content": d.get("text", "")}
    return out


async def _respond(router: Router, body, ids: list[int], kind: str, model: str):
    params, rid = _params(body), f"{'cmpl' if kind == 'text_completion' else 'chatcmpl'}-{uuid.uuid4().hex[:16]}"
    k = params.get("truncate_prompt_tokens")
    if k is not None and k > 0:  # cut here so the usage counts what the workers see (-1: theirs, by max_model_len)
        ids = ids[-k:]
    gen = router.deltas(ids, params, (body.model_extra or {}).get("request_id"))
    role = body.response_role() if kind != "text_completion" else "assistant"
    head = {"id": rid, "object": kind if not body.stream or kind == "text_completion" else "chat.completion.chunk",
            "created": int(time.time()), "model": model}
    if not body.stream:
        text, toks, last = "", [], {}
        async for d in gen:
            text, toks, last = text + d.get("text", ""), toks + d.get("token_ids", []), d
        if last.get("error"):
            raise APIError(500, last["error"])
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(toks), "total_tokens": len(ids) + len(toks)}
        return JSONResponse({**head, "choices": [_choice(kind, {**last, "text": text, "token_ids": toks}, False, role)],
                             "usage": usage})
    first = await anext(gen)  # errors before the first token are still an HTTP status

    async def events():
        d = first
        while True:
            if d.get("error"):
                yield f"data: {json.dumps({'error': {'message': d['error'], 'type': 'server_error', 'code': 500}})}\n\n"
                break
            yield f"data: {json.dumps({**head, 'choices': [_choice(kind, d, True, role)]})}\n\n"
            if d.get("finish_reason") is not None:
                break
            try:
                d = await anext(gen)
            except StopAsyncIteration:
                break
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def serve_router(router: Router, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> int:
    """Serve the router -> 0; 2 without serving when the workers that answer cannot work together
    (Router.check_workers: the reason is logged)."""
    import asyncio
    import logging

    import uvicorn

    why = asyncio.run(router.check_workers())
    if why is not None:
        logging.getLogger("umem_jax").error("umem-jax router: refusing to start: %s", why)
        return 2
    uvicorn.run(build_router_app(router), host=host, port=port, log_level=log_level)
    return 0
