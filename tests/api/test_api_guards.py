"""The server's bounds and guards end to end, on the package's live server (`srv`): the body
limit (413), the API key (401 on /v1/*; /health and /metrics open), text tokenized off the
engine thread and refused by its length before any tokenizing, the priority range, stop-string
caps offline, and a client that goes away while its request is being added (aborted at once,
never left running to max_tokens unobserved)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from _server_utils import MODEL, LiveServer, client_aborts, drained, engine_call, wait_idle

from umem_jax import SamplingParams
from umem_jax.api.guards import DEFAULT_MAX_REQUEST_BYTES
from umem_jax.api.server import build_app, serve
from umem_jax.core.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS

KEY = "sekrit-key"
SMALL_LIMIT = 64 << 10


@pytest.fixture(scope="module")
def guarded(srv):
    """A second app over the same engine, with an API key and a small body limit."""
    server = LiveServer(build_app(srv.aeng, [MODEL], api_key=KEY, max_request_bytes=SMALL_LIMIT))
    server.start()
    yield server
    server.stop()


def _raw(port: int, head: bytes) -> bytes:
    """Send request headers only and read the whole answer (the server closes after a 413)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_a_body_over_the_limit_is_413_by_its_length_or_by_its_bytes(srv, guarded):
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {DEFAULT_MAX_REQUEST_BYTES + 1}\r\nConnection: close\r\n\r\n").encode()
    answer = _raw(srv.port, head)  # refused from the header alone: no byte of the body is sent
    status, _, body = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 413"), answer[:200]
    err = json.loads(body)["error"]
    assert err["code"] == 413 and "--max-request-bytes" in err["message"]
    assert f"{DEFAULT_MAX_REQUEST_BYTES + 1:,} bytes" in err["message"]
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    body = json.dumps({"model": MODEL, "prompt": "x" * SMALL_LIMIT}).encode()
    chunked = httpx.post(guarded.url + "/v1/completions", content=(body[i:i + 8192] for i in range(0, len(body), 8192)),
                         headers=auth, timeout=60)  # no Content-Length: counted as it arrives
    assert chunked.status_code == 413 and "--max-request-bytes" in chunked.json()["error"]["message"]
    under = httpx.post(guarded.url + "/v1/completions", headers=auth, timeout=60,
                       json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert under.status_code == 200, under.text


def test_the_api_key_guards_v1_and_leaves_health_and_metrics_open(guarded):
    url = guarded.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401, r.text
        assert r.headers["www-authenticate"] == "Bearer"
        r = httpx.post(url + "/v1/completions", headers=headers, json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 401
    ok = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(url + "/v1/models", headers=ok).status_code == 200
    r = httpx.post(url + "/v1/completions", headers=ok, timeout=60, json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/metrics").status_code == 200


def test_text_is_tokenized_off_the_engine_thread_and_long_text_refused_untokenized(srv, monkeypatch):
    tok = srv.aeng.tokenizer
    encode, threads = tok.encode, []

    def spy(text, *a, **kw):
        threads.append(threading.current_thread().name)
        return encode(text, *a, **kw)

    monkeypatch.setattr(tok, "encode", spy)
    assert srv.client.completions.create(model=MODEL, prompt="Hello there", max_tokens=2).usage.completion_tokens
    chat = srv.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert chat.usage.completion_tokens >= 1
    assert len(threads) == 2 and all(n.startswith("umem-tokenize") for n in threads), threads
    threads.clear()
    r = httpx.post(srv.url + "/v1/completions", timeout=60, json={"model": MODEL, "prompt": "y" * 10_000_000})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt" and "10,000,000 characters" in err["message"]
    assert "max_model_len=4096" in err["message"] and threads == []  # refused before tokenizing


def test_priority_outside_the_configured_range_is_400_naming_it(srv):
    cfg = srv.aeng.engine.config
    kept, cfg.priority_range = cfg.priority_range, (-10, 10)
    try:
        for priority, status in ((11, 400), (-11, 400), (10, 200), (-10, 200)):
            r = httpx.post(srv.url + "/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": "x", "max_tokens": 1, "priority": priority})
            assert r.status_code == status, r.text
            if status == 400:
                assert r.json()["error"]["param"] == "priority" and "[-10, 10]" in r.json()["error"]["message"]
    finally:
        cfg.priority_range = kept


def test_stop_caps_offline():
    SamplingParams(stop=["a"] * MAX_STOP_STRINGS, stop_token_ids=[1] * 256)
    SamplingParams(stop=["b" * MAX_STOP_CHARS])
    too_many = (dict(stop=["a"] * (MAX_STOP_STRINGS + 1)), dict(stop=["b" * (MAX_STOP_CHARS + 1)]),
                dict(stop=["c"] * 10**6), dict(stop_token_ids=[1] * 257))
    for kw in too_many:
        field = next(iter(kw))
        with pytest.raises(ValueError, match=f"^{field}=") as e:
            SamplingParams(**kw)
        assert len(str(e.value)) < 300  # a million stop strings are not echoed back


def test_serve_stops_and_exits_1_when_the_engine_fails():
    """serve() ends the HTTP server (gracefully) once the engine reports its failure."""

    class DyingEngine:  # what serve() and build_app touch of an AsyncLLMEngine
        error, on_dead, metrics = None, None, None

        def start(self):
            def die():
                time.sleep(0.5)
                self.error = RuntimeError("boom")
                self.on_dead(self.dead_message())

            threading.Thread(target=die, daemon=True).start()

        def shutdown(self):
            pass

        def dead_message(self):
            return f"engine is not running: {self.error!r}"

    t0 = time.monotonic()
    assert serve(DyingEngine(), [MODEL], port=0, log_level="warning") == 1
    assert time.monotonic() - t0 < 30


# ------------------------------------------------------------------------------ a client gone while it is added


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_gone_while_its_request_is_added_has_it_aborted(srv, stream):
    """The engine thread is busy, so the add waits in its inbox while the client hangs up; once
    added, the request is aborted (the stream's cleanup runs even though no event was sent; a
    non-streaming handler sees the disconnect) instead of running to max_tokens."""
    before = client_aborts(srv)
    assert drained(srv) == (0, 0, 0)
    busy = srv.aeng.call(lambda e: time.sleep(1.0))
    body = json.dumps({"model": MODEL, "prompt": "go on", "max_tokens": 3000, "ignore_eos": True, "temperature": 0,
                       "stream": stream}).encode()
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(0.3)  # parsed, waiting for the add
    busy.result(30)
    deadline = time.monotonic() + 10
    while client_aborts(srv) < before + 1:
        assert time.monotonic() < deadline, "the request was left running"
        time.sleep(0.05)
    wait_idle(srv, timeout=20)
    assert drained(srv) == (0, 0, 0)


def test_a_cancelled_add_aborts_the_request_it_added(srv, monkeypatch):
    """The caller's task is cancelled while the engine thread is adding its request: the add
    completes there, and the abort that follows it in the inbox ends the request."""
    eng = srv.aeng.engine
    prepare, inside = eng.prepare, threading.Event()

    def slow_prepare(*a, **kw):
        inside.set()
        time.sleep(0.5)
        return prepare(*a, **kw)

    decode_steps = engine_call(srv, lambda e: e.num_steps["decode"])
    monkeypatch.setattr(eng, "prepare", slow_prepare)

    async def main():
        params = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)
        task = asyncio.create_task(srv.aeng.add_request([5, 6, 7], params, request_id="cancelled-add"))
        while not inside.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    monkeypatch.undo()
    wait_idle(srv, timeout=20)
    assert engine_call(srv, lambda e: e.num_steps["decode"]) - decode_steps < 20  # not 3000 tokens
    assert drained(srv) == (0, 0, 0)
