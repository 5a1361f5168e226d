"""`umem-jax serve --disaggregation-mode prefill|decode`: the usual OpenAI server of one engine
(its own /v1 endpoints keep working) plus the endpoints of its side of a transfer.

    GET  /disagg/status   {mode, held, counts, fingerprint, ...}
    GET  /disagg/transfers  {mode, transfers: [...]}: the latest transfers, timed (prefill.py, decode.py)
    POST /disagg/check    at idle: the engine's leak and refcount checks -> {idle, ok, error, held,
                          usage}; with {"reset_prefix_cache": true} the cache is emptied first
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request

from ..api.server import build_app
from . import decode, faults, prefill
from .keepalive import server_config
from .wire import max_body_bytes

MODES = ("null", "prefill", "decode")
common = APIRouter()


@common.get("/disagg/status")
async def status(raw: Request):
    w = raw.app.state.disagg
    return await asyncio.wrap_future(w.aeng.call(w.status))


@common.get("/disagg/transfers")
async def transfers(raw: Request):
    w = raw.app.state.disagg
    return {"mode": "decode" if isinstance(w, decode.DecodeWorker) else "prefill", "transfers": list(w.transfers)}


@common.post("/disagg/check")
async def check(raw: Request):
    w = raw.app.state.disagg
    body = await raw.json() if await raw.body() else {}

    def run(eng):
        if eng.has_unfinished_requests() or w.aeng._tracked:
            return {"idle": False}
        if body.get("reset_prefix_cache"):
            eng.reset_prefix_cache()
        try:
            eng.check_idle()
            err = None
        except AssertionError as e:
            err = str(e)
        usage = {k: v.held for k, v in eng.allocator.usage().subpools.items()}
        return {"idle": True, "ok": err is None, "error": err, "held": len(eng.scheduler.held), "usage": usage}

    return await asyncio.wrap_future(w.aeng.call(run))


def build_worker_app(aeng, names: list[str], mode: str, *, transfer_backend: str = "auto", **kw):
    """The serving app of one engine, with the endpoints of `mode` ("prefill" or "decode").  A
    decode worker's body limit (max_request_bytes) is raised to the largest transfer it can take
    (wire.max_body_bytes of max_model_len tokens), else any prompt whose memory is over the limit
    (16 MiB by default: a 4B model's state slot alone is ~50 MB) would be refused.  transfer_backend:
    how a prefill worker sends (wire.TRANSPORTS: auto, http, shm)."""
    if mode not in ("prefill", "decode"):
        raise ValueError(f"--disaggregation-mode {mode!r}: use one of {list(MODES)}")
    limit = kw.get("max_request_bytes")
    if mode == "decode" and limit is not None:  # a transfer's body is a whole prompt's memory: let the longest in
        eng = aeng.engine
        kw["max_request_bytes"] = max(limit, max_body_bytes(eng.plan, eng.max_model_len))
    app = build_app(aeng, names, **kw)
    app.state.disagg = (decode.DecodeWorker(aeng) if mode == "decode"
                        else prefill.PrefillWorker(aeng, transport=transfer_backend))
    app.include_router(decode.router if mode == "decode" else prefill.router)
    app.include_router(common)
    app.include_router(faults.router)
    return app


def serve_worker(aeng, names: list[str], mode: str, *, host: str = "127.0.0.1", port: int = 8000,
                 log_level: str = "info", **kw) -> int:
    """As api.server.serve, with the worker's app -> 0, or 1 after an engine failure.  Idle
    connections stay open longer than its clients reuse them (keepalive.py)."""
    import uvicorn

    app = build_worker_app(aeng, names, mode, **kw)
    server = uvicorn.Server(server_config(app, host=host, port=port, log_level=log_level))
    aeng.on_dead = lambda why: setattr(server, "should_exit", True)
    aeng.start()
    try:
        server.run()
    finally:
        aeng.shutdown()
    if aeng.error is not None:
        logging.getLogger("umem_jax").error("umem_jax %s worker: the engine failed: %s", mode, aeng.dead_message())
        return 1
    return 0
