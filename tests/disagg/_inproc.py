"""Prefill and decode workers in this process: each an AsyncLLMEngine over a tiny family's
engine (_disagg_models) behind its own uvicorn server on loopback, in a thread.  Much cheaper
than the `umem-jax serve` processes of test_router.py (no second JAX start, no CLI), so the
HTTP paths of the workers and the router can be checked case by case; the reference is one
engine of the same family, stepped in the test."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
from _disagg_models import DECODE_ARENA, PREFILL_ARENA, engine

from umem_jax.core.sampling_params import SamplingParams


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class InProcWorker:
    def __init__(self, mode: str, family: str = "hybrid", arena: int | None = None, **overrides):
        import uvicorn

        from umem_jax.api.async_engine import AsyncLLMEngine
        from umem_jax.disagg.keepalive import server_config
        from umem_jax.disagg.worker import build_worker_app

        self.mode = mode
        self.eng = engine(family, arena or (PREFILL_ARENA if mode == "prefill" else DECODE_ARENA), **overrides)
        self.aeng = AsyncLLMEngine(self.eng, warmup=False).start()
        self.app = build_worker_app(self.aeng, ["tiny"], mode)
        self.url = f"http://127.0.0.1:{_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self.server = uvicorn.Server(server_config(self.app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.aeng.shutdown()
        if self.mode == "prefill":
            self.app.state.disagg.pool.close()


def reference(family: str, prompt: list[int], **params) -> tuple[list[int], str]:
    """One engine's (token ids, finish reason) for `prompt`: what the pair must give."""
    eng = engine(family, DECODE_ARENA)
    rid = eng.add_request(prompt, SamplingParams(**params))
    out = None
    while eng.has_unfinished_requests():
        out = next((o.outputs[0] for o in eng.step() if o.request_id == rid), out)
    return list(out.token_ids), out.finish_reason


async def idle_check(url: str) -> dict:
    """POST /disagg/check at idle (prefix cache emptied) -> its answer."""
    async with httpx.AsyncClient(timeout=60) as c:
        for _ in range(300):
            r = (await c.post(f"{url}/disagg/check", json={"reset_prefix_cache": True})).json()
            if r["idle"]:
                return r
            await asyncio.sleep(0.1)
    return r


async def assert_no_leaks(*workers) -> None:
    for w in workers:
        r = await idle_check(w.url)
        assert r["idle"] and r["ok"] and r["held"] == 0 and not any(r["usage"].values()), (w.mode, r)
