"""The decode worker: reserves pages before the sender sends, installs page envelopes, streams.

    POST /disagg/reserve          {transfer_id, prompt_token_ids, params, timeout_s}
                                  -> {generation, fingerprint}; 503 while it has no room
    POST /disagg/transfer/{id}?generation=G[&transport=shm]   body: wire.pack(envelopes), or with
                                  shm the JSON reference of wire.pack_shm -> {acked}; 409 dropped,
                                  422 the segment is not on this host
    POST /disagg/cancel/{id}?generation=G     -> {acked, state}: fenced and freed before the reply
    GET  /disagg/stream/{id}      NDJSON deltas of the request ({text, token_ids, finish_reason, error})
    GET  /disagg/transfers        the latest writes: {transfer_id, transport, bytes (of the envelopes),
                                  body_bytes, ok, body_s, unpack_s (shm: attach + copy out), install_wait_s,
                                  install_s (the host call of the install)}

Ordering (ledger.py): every check-then-act runs in one AsyncLLMEngine.call on the engine thread.
A reservation that gets no bytes by its deadline is expired by a ticker (fenced and freed); a
cancel of an installed transfer aborts its decoding.  The reply to a cancel is the proof that the
pages are no longer touched: a write of that generation can no longer pass the ledger.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import time

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ..api.async_engine import _Track
from ..api.errors import error
from ..core.sampling_params import SamplingParams
from . import ledger as lg
from .faults import Faults
from .wire import NoSegment, unpack, unpack_shm

router = APIRouter()


class DecodeWorker:
    """The decode side's state beside its AsyncLLMEngine (app.state.disagg)."""

    def __init__(self, aeng, *, tick_s: float = 0.1):
        self.aeng = aeng
        self.ledger = lg.Ledger()
        self.queues: dict[str, asyncio.Queue] = {}  # a reservation's deltas until its stream is opened
        self.unopened_by: dict[str, float] = {}  # when a queue nobody opened is given up (sweep)
        self.faults = Faults()
        # the latest writes, timed (GET /disagg/transfers; benchmarks/bench_disagg.py reads them)
        self.transfers: collections.deque[dict] = collections.deque(maxlen=4096)
        self._ticker = threading.Thread(target=self._tick, args=(tick_s,), name="umem-disagg-expiry", daemon=True)
        self._ticker.start()

    def fence(self, eng, t: lg.Transfer, state: str) -> None:
        """End `t` (engine thread): its reservation freed or its decoding aborted, then no write
        of its generation passes the ledger."""
        if t.transfer_id in eng.scheduler.held:
            eng.handoff.release(t.transfer_id)
        elif t.state == lg.INSTALLED:
            eng.abort_request(t.transfer_id)
        self.ledger.end(t, state)
        self.aeng._publish()  # the request's last delta (its error) reaches the stream now

    def _tick(self, tick_s: float) -> None:
        def expire(eng):
            for t in self.ledger.due():
                self.fence(eng, t, lg.EXPIRED)
        while self.aeng.error is None:
            time.sleep(tick_s)
            if self.ledger.live():
                try:
                    self.aeng.call(expire).result(30)
                except Exception:  # noqa: BLE001 - the engine stopped: nothing left to expire
                    return

    def status(self, eng) -> dict:
        return {"mode": "decode", "epoch": self.ledger.epoch, "held": len(eng.scheduler.held),
                "live_transfers": self.ledger.live(), "counts": dict(self.ledger.counts),
                "fingerprint": eng.handoff.fingerprint}


def _worker(raw: Request) -> DecodeWorker:
    return raw.app.state.disagg


STREAM_GRACE_S = 60.0  # past a reservation's deadline, how long its stream may still be opened


def _sweep(w: DecodeWorker) -> None:
    """Give up the queues whose stream was never opened (the router gone after its transfer, or a
    reservation that expired): their deltas would pile up for nobody, and a request still decoding
    for nobody is aborted.  Event-loop thread, as every use of w.queues."""
    now = time.monotonic()
    for tid in [t for t, by in w.unopened_by.items() if by < now]:
        w.unopened_by.pop(tid, None)
        if w.queues.pop(tid, None) is not None:
            w.aeng.abort(tid)


@router.post("/disagg/reserve")
async def reserve(raw: Request):
    w, body = _worker(raw), await raw.json()
    tid, ids = str(body["transfer_id"]), [int(t) for t in body["prompt_token_ids"]]
    timeout_s = float(body.get("timeout_s", 30.0))
    _sweep(w)
    try:
        params = SamplingParams(**body.get("params", {}))
    except (TypeError, ValueError) as e:
        return error(400, f"params: {e}")
    loop, q = asyncio.get_running_loop(), asyncio.Queue()

    def take(eng):
        live = w.ledger.transfers.get(tid)
        if live is not None and live.state in (lg.RESERVED, lg.INSTALLED):
            raise ValueError(f"transfer {tid!r} is already {live.state}")
        req = eng.handoff.reserve(ids, params, tid)
        if req is None:
            return None
        w.aeng._tracked[tid] = _Track(req, loop, q, time.time())
        return w.ledger.new(tid, timeout_s).generation

    try:
        gen = await asyncio.wrap_future(w.aeng.call(take))
    except (ValueError, NotImplementedError) as e:
        return error(400, str(e))
    if gen is None:
        return error(503, f"the decode worker has no room for {len(ids)} prompt tokens now; retry later")
    w.queues[tid] = q
    w.unopened_by[tid] = time.monotonic() + timeout_s + STREAM_GRACE_S
    return {"transfer_id": tid, "generation": gen, "fingerprint": w.aeng.engine.handoff.fingerprint}


@router.post("/disagg/transfer/{tid}")
async def transfer(tid: str, raw: Request):
    w, gen = _worker(raw), raw.query_params.get("generation", "")
    t0 = time.perf_counter()
    body = await raw.body()
    rec = {"transfer_id": tid, "bytes": len(body), "body_s": time.perf_counter() - t0}
    await w.faults.sleep("stall_install_s", tid)
    t0 = time.perf_counter()
    shm = raw.query_params.get("transport", "http") == "shm"
    try:
        if shm:  # a reference to a segment on this host: attach, copy out, unlink (off the event loop)
            env = await asyncio.to_thread(unpack_shm, json.loads(body))
        else:
            env = unpack(body)
    except NoSegment as e:  # not on this host: the prefill worker sends the same transfer as a body
        return error(422, str(e))
    except ValueError as e:  # json.JSONDecodeError included
        return error(400, str(e))
    rec.update(transport="shm" if shm else "http", bytes=env.nbytes, body_bytes=len(body))  # envelope bytes, as sent
    rec["unpack_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()

    def install(eng):
        t1 = time.perf_counter()
        rec["install_wait_s"] = t1 - t0  # for the engine thread (its step in flight)
        t = w.ledger.writable(tid, gen)
        if isinstance(t, str):
            return t
        if tid not in eng.scheduler.held:  # its client went away: the reservation went with it
            w.ledger.end(t, lg.CANCELLED)
            w.ledger.counts["dropped_writes"] += 1
            return f"transfer {tid} was aborted"
        try:
            eng.handoff.install(tid, env)
            rec["install_s"] = time.perf_counter() - t1  # the host call: its copies may end inside the next step
        except ValueError as e:
            w.fence(eng, t, lg.CANCELLED)
            return f"refused: {e}"
        w.ledger.end(t, lg.INSTALLED)
        w.aeng._publish()  # the first token streams now
        return None

    why = await asyncio.wrap_future(w.aeng.call(install))
    w.transfers.append({**rec, "ok": why is None})
    if why is not None:
        return error(409, f"write dropped: {why}")
    await w.faults.sleep("ack_delay_s", tid)
    return {"acked": True, "transfer_id": tid, "generation": gen}


@router.post("/disagg/cancel/{tid}")
async def cancel(tid: str, raw: Request):
    w, gen = _worker(raw), raw.query_params.get("generation", "")

    def drop(eng):
        t = w.ledger.transfers.get(tid)
        if t is None or t.generation != gen:
            return "unknown"  # nothing of that generation is live here
        was = t.state
        if was in (lg.RESERVED, lg.INSTALLED):
            w.fence(eng, t, lg.CANCELLED)
        return was

    was = await asyncio.wrap_future(w.aeng.call(drop))
    w.queues.pop(tid, None)
    w.unopened_by.pop(tid, None)
    return {"acked": True, "transfer_id": tid, "state": was}


@router.get("/disagg/stream/{tid}")
async def stream(tid: str, raw: Request):
    w = _worker(raw)
    q = w.queues.pop(tid, None)
    w.unopened_by.pop(tid, None)
    if q is None:
        return error(404, f"no stream for transfer {tid!r}")

    async def lines():
        done = False
        try:
            while not done:
                d = await q.get()
                done = d.finish_reason is not None
                yield json.dumps({"text": d.text, "token_ids": d.token_ids, "finish_reason": d.finish_reason,
                                  "stop_reason": d.stop_reason, "error": d.error, "prompt_tokens": d.prompt_tokens,
                                  "completion_tokens": d.completion_tokens}) + "\n"
        finally:
            if not done:  # the router went away: stop decoding it
                w.aeng.abort(tid)

    return StreamingResponse(lines(), media_type="application/x-ndjson")
