"""The prefill worker: computes a prompt, sends its page envelopes, frees them on the ack.

    POST /disagg/prefill {transfer_id, generation, decode_url, prompt_token_ids, params, timeout_s[, fingerprint]}
      (fingerprint: the decode worker's, from its reservation: another one fails at once, nothing computed)
      -> {status: "sent" | "done" | "failed", first token, text, finish_reason, error, bytes, send_s}
    GET  /disagg/transfers        the latest sends: {transfer_id, tokens, bytes, ok, export_wait_s,
                                  export_s (gather + device-to-host read), pack_s, send_s (POST to ack)}

The envelopes travel as wire.py says: "auto" (the default, `--disaggregation-transfer-backend`)
through a shared-memory segment when the decode worker is on a loopback address, else (or when it
cannot attach the segment) as an npz body; a request's JSON may name "http" or "shm" instead.

The request runs with max_tokens=1 and is held when that token is out (engine/handoff.py): its
pages stay allocated, unschedulable and unretractable until the decode worker answers.  Then:
  acked                 -> release (its pages go to the prefix cache, reusable)       "sent"
  timeout / error / 409 -> cancel at the decode worker; its reply (or a refused
                           connection: nobody left to touch them) -> release          "failed"
The request finishing on its first token (EOS, stop string) needs no decode: "done".
Only this process reads these pages (a device-to-host copy, finished before the send), so a
cancel that gets no answer is retried, then the peer is fenced (its generation recorded dead)
and the pages are released.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import time

import httpx
from fastapi import APIRouter, Request

from ..api.errors import error
from ..core.sampling_params import SamplingParams
from ..engine.handoff import plan_mismatch
from .faults import Faults
from .keepalive import client_limits
from .wire import NoSegment, SegmentPool, pack, pack_shm, transport_for

router = APIRouter()
CANCEL_TRIES = 3


class PrefillWorker:
    """The prefill side's state beside its AsyncLLMEngine (app.state.disagg)."""

    def __init__(self, aeng, *, transport: str = "auto"):
        self.aeng = aeng
        self.transport = transport  # wire.TRANSPORTS; a request's body may name another
        self.pool = SegmentPool()  # the shm transport's segments, reused
        transport_for(transport, "http://127.0.0.1")  # an unknown name fails at startup, not per request
        self.faults = Faults()
        self.fenced: set[str] = set()  # generations whose cancel was never answered
        self.counts = {"sent": 0, "done": 0, "failed": 0, "bytes": 0, "send_s": 0.0}
        # the latest sends, timed (GET /disagg/transfers; benchmarks/bench_disagg.py reads them)
        self.transfers: collections.deque[dict] = collections.deque(maxlen=4096)
        self.client = httpx.AsyncClient(limits=client_limits())  # idle connections given up before the worker's

    def status(self, eng) -> dict:
        return {"mode": "prefill", "held": len(eng.scheduler.held), "counts": dict(self.counts),
                "fenced": sorted(self.fenced), "fingerprint": eng.handoff.fingerprint}

    async def call(self, fn):
        return await asyncio.wrap_future(self.aeng.call(fn))

    async def send(self, url: str, tid: str, gen: str, body: bytes, timeout_s: float,
                   transport: str = "http") -> str | NoSegment | None:
        """POST the envelopes (http: the npz body; shm: the segment's reference) -> None when acked,
        a NoSegment when the decode worker cannot attach the segment (nothing was written: send
        again over http), else why not (after the cancel was settled)."""
        try:
            r = await self.client.post(f"{url}/disagg/transfer/{tid}", params={"generation": gen, "transport": transport},
                                       content=body, timeout=timeout_s)
            if r.status_code == 200:
                return None
            if r.status_code == 422 and transport == "shm":
                return NoSegment(r.text[:300])
            why = f"the decode worker answered {r.status_code}: {r.text[:300]}"
        except httpx.HTTPError as e:
            why = f"no acknowledgement from the decode worker: {type(e).__name__} {e}"
        await self.cancel(url, tid, gen, timeout_s)
        return why

    async def deliver(self, url: str, tid: str, gen: str, env, timeout_s: float,
                      transport: str) -> tuple[str, str | None, float, float]:
        """Send `env` by `transport` ("shm" or "http", wire.py) -> (the transport it went by, why it
        was not acknowledged or None, pack seconds, send seconds: the POST until the ack, the decode
        side's install included).  shm goes as an npz body instead when /dev/shm has no room for the
        segment or the decode worker cannot attach it."""
        if transport == "shm":
            t0 = time.perf_counter()
            try:
                seg, ref = pack_shm(env, self.pool)
            except OSError as e:
                logging.getLogger("umem_jax").warning("disaggregation: %s; sending over http", e)
            else:
                pack_s, settled = time.perf_counter() - t0, False
                try:
                    await self.faults.sleep("stall_send_s", tid)
                    t0 = time.perf_counter()
                    why = await self.send(url, tid, gen, json.dumps(ref).encode(), timeout_s, "shm")
                    settled = why is None or isinstance(why, NoSegment) or gen not in self.fenced
                finally:  # acked, not attached, or the cancel answered: nobody reads it any more, so
                    # it is reused; else (a fenced peer, or this send interrupted) a reader may map it still
                    (self.pool.give if settled else self.pool.drop)(seg)
                if not isinstance(why, NoSegment):
                    return "shm", why, pack_s, time.perf_counter() - t0
        t0 = time.perf_counter()
        payload = pack(env)
        pack_s = time.perf_counter() - t0
        await self.faults.sleep("stall_send_s", tid)
        t0 = time.perf_counter()
        why = await self.send(url, tid, gen, payload, timeout_s)
        return "http", why, pack_s, time.perf_counter() - t0

    async def cancel(self, url: str, tid: str, gen: str, timeout_s: float) -> None:
        for _ in range(CANCEL_TRIES):
            try:
                r = await self.client.post(f"{url}/disagg/cancel/{tid}", params={"generation": gen},
                                           timeout=timeout_s)
                if r.status_code == 200:
                    return
            except httpx.ConnectError:
                return  # nobody listens there any more: nothing can touch the transfer
            except httpx.HTTPError:
                pass
        self.fenced.add(gen)


def _worker(raw: Request) -> PrefillWorker:
    return raw.app.state.disagg


@router.post("/disagg/prefill")
async def prefill(raw: Request):
    w, body = _worker(raw), await raw.json()
    tid, gen, url = str(body["transfer_id"]), str(body["generation"]), str(body["decode_url"]).rstrip("/")
    ids, timeout_s = [int(t) for t in body["prompt_token_ids"]], float(body.get("timeout_s", 30.0))
    theirs, ours = body.get("fingerprint"), w.aeng.engine.handoff.fingerprint  # fixed at build: any thread
    if theirs is not None and theirs != ours:  # the decode worker could not take these envelopes: compute nothing
        return {"transfer_id": tid, "token_ids": [], "text": "", "finish_reason": None, "stop_reason": None,
                "status": "failed", "error": f"the decode worker refuses {plan_mismatch(ours, theirs)}"}
    try:
        params = SamplingParams(**_first_token_params(body.get("params", {})))
        transport = transport_for(str(body.get("transport") or w.transport), url)
        await w.call(lambda eng: (eng.handoff.check_supported(params), eng.handoff.hold_after_prefill(tid)))
        stream = await w.aeng.add_request(ids, params, request_id=tid)
    except (TypeError, ValueError, NotImplementedError) as e:
        return error(400, str(e))
    except Exception as e:  # noqa: BLE001 - overloaded or dead: the router may retry elsewhere
        return error(503, str(e))
    deltas = [d async for d in stream]
    last, toks = deltas[-1], [t for d in deltas for t in d.token_ids]
    out = {"transfer_id": tid, "token_ids": toks, "text": "".join(d.text for d in deltas),
           "finish_reason": last.finish_reason, "stop_reason": last.stop_reason, "error": last.error}
    held = await w.call(lambda eng: tid in eng.scheduler.held)
    if not held:  # stopped on its first token (or failed): nothing to decode
        w.counts["done"] += 1
        return {**out, "status": "failed" if last.error else "done"}
    t0 = time.perf_counter()
    try:  # the held pages go back however this ends (an error, the client gone): the envelope is a host copy
        env, export_s = await w.call(lambda eng: _timed(eng.handoff.export, tid))  # the D2H read is synchronous
        wait_s = time.perf_counter() - t0 - export_s  # for the engine thread (its step in flight)
        if w.faults.take("poison", tid):  # a test's late write: NaN bytes that must never land
            env = dataclasses.replace(env, pages={k: v | 0x7FC0 for k, v in env.pages.items()},
                                      state=None if env.state is None else env.state | 0x7FC0)
        transport, why, pack_s, send_s = await w.deliver(url, tid, gen, env, timeout_s, transport)
    finally:
        await w.call(lambda eng: eng.handoff.release(tid))
    w.counts["failed" if why else "sent"] += 1
    w.counts["bytes"] += env.nbytes
    w.counts["send_s"] += send_s
    w.transfers.append({"transfer_id": tid, "tokens": env.plan.computed, "bytes": env.nbytes, "ok": why is None,
                        "transport": transport, "export_wait_s": wait_s, "export_s": export_s, "pack_s": pack_s,
                        "send_s": send_s})
    return {**out, "status": "failed" if why else "sent", "error": why, "bytes": env.nbytes, "send_s": send_s,
            "transport": transport}


def _first_token_params(params: dict) -> dict:
    """The request's params for its first token only (max_tokens=1).  min_tokens is capped at 1
    (else the params are invalid): that still bans EOS and the stop ids from the first token, as
    the whole request would.  With min_tokens > 1 no stop string may end the request at its first
    token either, so none is checked here; the decode side applies every rule to the rest."""
    out = {**params, "max_tokens": 1}
    min_tokens = int(out.get("min_tokens") or 0)
    if min_tokens > 1:
        out.update(min_tokens=1, stop=None)
    return out


def _timed(fn, *args):
    """(fn(*args), seconds it took)."""
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0
