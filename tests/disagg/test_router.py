"""Router -> prefill worker -> decode worker, as three parts on loopback: the two workers are
`umem-jax serve --disaggregation-mode ...` processes (tiny hybrid: window, state and full memory;
arenas of different sizes), the router runs in this process.  Greedy outputs equal the decode
worker alone; injected faults (a late poisoned write after a reservation expired, a dropped and
a delayed acknowledgement, the decode worker killed mid-transfer and restarted) leave every page
accounted for on both sides, other requests unaffected, and the client a retried success or a
clear error; envelopes travel through shared memory (loopback workers, transport "auto") and as
HTTP bodies; 64 concurrent streams through the router finish with no error and no leak.  All of
it runs in CI (about 90 s with the workers' start)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np
import pytest

from umem_jax.disagg.router import Router
from umem_jax.disagg.router_app import build_router_app

FLAGS = ["--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--page-size", "4", "--max-model-len", "256",
         "--warmup-shapes", "0"]
ARENAS = {"prefill": 300_000, "decode": 400_000}
BODY_LIMIT = 4096  # the decode worker's --max-request-bytes: a 60-token prompt's envelopes are ~40 KB


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    def __init__(self, mode: str):
        self.mode, self.port = mode, _port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self) -> None:
        env = {**os.environ, "UMEM_JAX_DISAGG_FAULTS": "1", "JAX_PLATFORMS": "cpu"}
        cmd = [sys.executable, "-m", "umem_jax.cli", "serve", "tiny", "--disaggregation-mode", self.mode,
               "--port", str(self.port), "--arena-bytes", str(ARENAS[self.mode]), *FLAGS]
        if self.mode == "decode":  # below most transfers' bodies: the worker must raise it for them
            cmd += ["--max-request-bytes", str(BODY_LIMIT)]
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - its output, kept while it runs, shown if it fails
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait(self, timeout=600.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"the {self.mode} worker exited ({self.proc.returncode}): {self.tail()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"the {self.mode} worker did not get ready"
            time.sleep(0.5)

    def tail(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)


@pytest.fixture(scope="module")
def workers():
    ws = {m: Worker(m) for m in ("prefill", "decode")}
    try:
        for w in ws.values():
            w.start()
        for w in ws.values():
            w.wait()
        yield ws
    finally:
        for w in ws.values():
            w.stop()


@pytest.fixture(scope="module")
def warm(workers):
    asyncio.run(_warm(workers))
    return workers


async def _warm(ws) -> None:
    """Compile both workers' step shapes before the timed tests (a cold prefill worker can take
    longer than a short transfer deadline)."""
    async with _client(Router([ws["prefill"].url], [ws["decode"].url], timeout_s=600)) as c:
        rs = await asyncio.gather(*[c.post("/v1/completions", json=_body(p)) for p in _prompts(9, 8)])
    assert [r.status_code for r in rs] == [200] * 8, [r.text for r in rs]


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 250, int(rng.integers(6, 60))).tolist() for _ in range(n)]


def _body(p, max_tokens=12, **kw):
    return {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **kw}


async def _alone(decode_url: str, prompts, max_tokens=12) -> list[str]:
    """The decode worker serving each prompt by itself (no disaggregation): the reference."""
    async with httpx.AsyncClient(timeout=300) as c:
        rs = await asyncio.gather(*[c.post(f"{decode_url}/v1/completions", json=_body(p, max_tokens)) for p in prompts])
    return [r.json()["choices"][0]["text"] for r in rs]


async def _check_both(ws) -> None:
    """At idle, on both sides: the engine's leak and refcount checks pass and, with the prefix
    cache emptied, no page or slot is held."""
    async with httpx.AsyncClient(timeout=60) as c:
        for w in ws.values():
            for _ in range(200):
                r = (await c.post(f"{w.url}/disagg/check", json={"reset_prefix_cache": True})).json()
                if r["idle"]:
                    break
                await asyncio.sleep(0.1)
            assert r["idle"] and r["ok"], (w.mode, r)
            assert r["held"] == 0 and not any(r["usage"].values()), (w.mode, r)


def _client(router: Router) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_router_app(router)), base_url="http://router",
                             timeout=300)


async def _status(url) -> dict:
    async with httpx.AsyncClient(timeout=30) as c:
        return (await c.get(f"{url}/disagg/status")).json()


async def _faults(url, rules):
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(f"{url}/disagg/faults", json={"rules": rules})
    assert r.status_code == 200, r.text


def test_router_equals_one_engine(workers):
    async def go():
        prompts = _prompts(0, 6)
        want = await _alone(workers["decode"].url, prompts)
        router = Router([workers["prefill"].url], [workers["decode"].url], timeout_s=120)
        async with _client(router) as c:
            rs = await asyncio.gather(*[c.post("/v1/completions", json=_body(p)) for p in prompts])
            assert [r.status_code for r in rs] == [200] * 6, [r.text for r in rs]
            assert [r.json()["choices"][0]["text"] for r in rs] == want
            assert all(len(r.json()["choices"][0]["token_ids"]) == 12 for r in rs)
            async with c.stream("POST", "/v1/completions", json=_body(prompts[0], stream=True)) as s:
                events = [ln[6:] async for ln in s.aiter_lines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(ch["choices"][0]["text"] for ch in chunks) == want[0]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert router.counts == {"requests": 7, "retries": 0, "failed": 0}, list(router.errors)
        # The workers are on loopback, so "auto" sent those through shared memory; the same over HTTP bodies:
        via_http = Router([workers["prefill"].url], [workers["decode"].url], timeout_s=120, transport="http")
        async with _client(via_http) as c:
            rs = await asyncio.gather(*[c.post("/v1/completions", json=_body(p)) for p in prompts[:2]])
        assert [r.json()["choices"][0]["text"] for r in rs] == want[:2]
        await _check_both(workers)
        assert await _check_transfer_log(workers, 9) == ["shm"] * 7 + ["http"] * 2
        # chat: the template's options reach the decode worker's tokenizer (the answer's role too)
        chat = {"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "cd"}],
                "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True}
        async with httpx.AsyncClient(timeout=120) as c:
            alone = (await c.post(f"{workers['decode'].url}/v1/chat/completions", json=chat)).json()
        async with _client(router) as c:
            r = await c.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"] == alone["choices"][0]["message"]
        assert r.json()["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"]
        await _check_both(workers)

    asyncio.run(go())


async def _check_transfer_log(ws, n: int) -> list[str]:
    """GET /disagg/transfers on both sides: the latest n sends are timed, and each one's bytes are
    the bytes the decode side received for that transfer id, by the same transport -> the
    transports of those n sends, oldest first."""
    async with httpx.AsyncClient(timeout=30) as c:
        sent, got = [(await c.get(f"{ws[m].url}/disagg/transfers")).json() for m in ("prefill", "decode")]
    assert (sent["mode"], got["mode"]) == ("prefill", "decode")
    recv = {r["transfer_id"]: r for r in got["transfers"]}
    for r in sent["transfers"][-n:]:
        assert r["ok"] and r["bytes"] > 0 and r["tokens"] > 0, r
        assert min(r["export_s"], r["pack_s"], r["send_s"], r["export_wait_s"]) >= 0, r
        d = recv[r["transfer_id"]]
        assert d["ok"] and d["bytes"] == r["bytes"] and d["transport"] == r["transport"], (r, d)
        assert 0 <= d["install_s"] and 0 <= d["unpack_s"] and 0 <= d["install_wait_s"], d
    return [r["transport"] for r in sent["transfers"][-n:]]


def test_expired_reservation_drops_the_late_poisoned_write(warm):
    workers = warm
    """The decode side's reservation times out (the prefill worker stalls), its pages are freed
    and reused by other requests; the late write -- NaN bytes -- arrives and is dropped; the
    request is retried and succeeds, the others match the reference, and so do they again from
    the decode worker's prefix cache (which holds the reused pages now)."""
    async def go():
        P, D = workers["prefill"].url, workers["decode"].url
        prompts = _prompts(1, 5)
        want = await _alone(D, prompts, 24)
        router = Router([P], [D], timeout_s=8.0)
        async with _client(router) as c:
            await _faults(P, [{"match": "slow-", "stall_send_s": 14, "poison": 1, "times": 1}])
            before = (await _status(D))["counts"]
            slow = asyncio.create_task(c.post("/v1/completions", json=_body(prompts[0], 24, request_id="slow")))
            await asyncio.sleep(9.0)  # the reservation has expired: its pages are free for these
            rs = await asyncio.gather(*[c.post("/v1/completions", json=_body(p, 24)) for p in prompts[1:]])
            slow = await slow
            after = (await _status(D))["counts"]
            again = await _alone(D, prompts[1:], 24)
        assert slow.status_code == 200, slow.text
        assert slow.json()["choices"][0]["text"] == want[0]
        assert [r.status_code for r in rs] == [200] * 4, [r.text for r in rs]
        assert [r.json()["choices"][0]["text"] for r in rs] == want[1:] == again
        assert after.get("expired", 0) - before.get("expired", 0) == 1, (before, after)
        assert after.get("dropped_writes", 0) - before.get("dropped_writes", 0) == 1, (before, after)
        assert router.counts["retries"] == 1, list(router.errors)
        await _check_both(workers)

    asyncio.run(go())


def test_dropped_and_delayed_acks(warm):
    workers = warm
    """An acknowledgement that never comes in time: the prefill side cancels (the decode side
    fences and frees, aborting that decode), releases, and the router retries; a delayed one
    within the deadline is a plain success.  The other requests run unaffected."""
    async def go():
        P, D = workers["prefill"].url, workers["decode"].url
        prompts = _prompts(2, 4)
        want = await _alone(D, prompts)
        router = Router([P], [D], timeout_s=8.0)
        async with _client(router) as c:
            await _faults(D, [{"match": "drop-", "ack_delay_s": 20, "times": 1},
                                 {"match": "late-", "ack_delay_s": 1, "times": 1}])
            rs = await asyncio.gather(c.post("/v1/completions", json=_body(prompts[0], request_id="drop")),
                                      c.post("/v1/completions", json=_body(prompts[1], request_id="late")),
                                      *[c.post("/v1/completions", json=_body(p)) for p in prompts[2:]])
        assert [r.status_code for r in rs] == [200] * 4, [r.text for r in rs]
        assert [r.json()["choices"][0]["text"] for r in rs] == want
        assert router.counts["retries"] == 1, list(router.errors)
        await _check_both(workers)

    asyncio.run(go())


def test_decode_worker_killed_mid_transfer_then_restarted(warm):
    workers = warm
    async def go():
        P, D = workers["prefill"], workers["decode"]
        prompts = _prompts(3, 2)
        want = await _alone(D.url, prompts)
        router = Router([P.url], [D.url], timeout_s=10.0, reserve_wait_s=2.0)
        async with _client(router) as c:
            await _faults(D.url, [{"match": "kill-", "stall_install_s": 30, "times": 1}])
            task = asyncio.create_task(c.post("/v1/completions", json=_body(prompts[0], request_id="kill")))
            await asyncio.sleep(4.0)
            D.stop()  # mid-transfer: the bytes are in flight, the install has not run
            r = await task
            assert r.status_code == 503 and "failed after 2 attempts" in r.json()["error"]["message"], r.text
            await _check_both({"prefill": P})  # the prefill side released the transfer's pages
            D.start()
            D.wait()
            rs = await asyncio.gather(*[c.post("/v1/completions", json=_body(p)) for p in prompts])
        assert [r.json()["choices"][0]["text"] for r in rs] == want
        await _check_both(workers)

    asyncio.run(go())


def test_64_concurrent_streams(warm):
    workers = warm
    """64 streaming clients at once through the router: every stream ends with [DONE] and the
    single-engine text, no retries, no errors, no page left behind on either side."""
    async def go():
        prompts = _prompts(4, 64)
        want = await _alone(workers["decode"].url, prompts, 16)
        router = Router([workers["prefill"].url], [workers["decode"].url], timeout_s=120)

        async def one(c, p):
            async with c.stream("POST", "/v1/completions", json=_body(p, 16, stream=True)) as s:
                assert s.status_code == 200
                events = [ln[6:] async for ln in s.aiter_lines() if ln.startswith("data: ")]
            assert events[-1] == "[DONE]", events[-3:]
            return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])

        async with _client(router) as c:
            got = await asyncio.wait_for(asyncio.gather(*[one(c, p) for p in prompts]), 600)
        assert got == want
        assert router.counts == {"requests": 64, "retries": 0, "failed": 0}, list(router.errors)
        await _check_both(workers)

    asyncio.run(go())
