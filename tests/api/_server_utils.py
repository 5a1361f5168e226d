"""The live test server of tests/api: a real uvicorn on loopback over one AsyncLLMEngine (tiny
hybrid model, 1 MiB arena), and helpers that read the engine in its own thread.

Its buckets are pinned to one batch size so that every step compiles to the same shapes:
concurrent and one-at-a-time greedy outputs are then bit-identical, and only two step shapes
compile.  conftest.py serves one for the whole package (`srv`).
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

MODEL = "tiny-test"
MAX_SEQS = 64


class LiveServer:
    """uvicorn in a thread on a socket bound to 127.0.0.1:<free port>; stopped by stop()."""

    def __init__(self, app):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self, timeout: float = 30.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


def engine_call(srv, fn, timeout=60):
    return srv.aeng.call(fn).result(timeout)


def wait_idle(srv, timeout=60.0) -> None:
    """Until the engine has nothing queued or in flight (aborts are applied between steps)."""
    deadline = time.monotonic() + timeout
    while engine_call(srv, lambda e: e.has_unfinished_requests()) or srv.aeng._tracked:
        assert time.monotonic() < deadline, "engine did not go idle"
        time.sleep(0.05)


def drained(srv) -> tuple[int, int, int]:
    """Wait for idle, drop the prefix cache (cached pages are held on purpose, not leaked), then
    -> live_memory: what is left is held by nobody."""
    wait_idle(srv)
    assert engine_call(srv, lambda e: e.reset_prefix_cache() if hasattr(e, "reset_prefix_cache") else True)
    return live_memory(srv)


def live_memory(srv) -> tuple[int, int, int]:
    """(live token pages, live state slots, live arena bytes), read in the engine thread."""
    return engine_call(srv, lambda e: (e.allocator.live_token_pages().size, e.allocator.live_state_slots().size,
                                       e.allocator.usage().live_bytes))


def sse_events(body: str) -> list[str]:
    assert body.endswith("\n\n"), "every event ends with a blank line"
    return [e for e in body.split("\n\n")[:-1]]


def client_aborts(srv) -> float:
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)}
    return sum(s.value for s in fams["umem:num_aborted_requests"].samples
               if s.name.endswith("_total") and s.labels["reason"] == "client")
