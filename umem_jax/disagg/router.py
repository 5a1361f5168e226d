"""The router in front of prefill and decode workers (`umem-jax router --prefill URL --decode URL`;
its OpenAI API: router_app.py).  Each request: tokenize (at the decode worker), reserve its pages at
the decode worker, prefill at the prefill worker (which sends the page envelopes to the decode
worker), then stream the decode worker's tokens back.

Workers go round-robin; a worker that refuses the connection (gone) or a decode worker with no
room for the reservation is passed over for the next one within the same attempt, since nothing
happened there yet.  A failed transfer (timed out, dropped, the decode worker gone) is retried
`retries` times with a new transfer id before any token reached the client, then answered 503
with the reason; so is a decode worker's stream lost before its first token (its GET is sent
again first, once, when the connection was lost under it: keepalive.py).
"""

from __future__ import annotations

import collections
import itertools
import json
import time
import uuid

import httpx

from ..api.errors import APIError
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
