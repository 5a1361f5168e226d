"""Keep-alive between the parts (router -> workers, prefill worker -> decode worker).

A client reuses pooled HTTP/1.1 connections; a server closes the ones idle past its keep-alive
timeout.  A request sent on a connection that the server is closing at that moment is lost:
httpx reads "Server disconnected without sending a response" (RemoteProtocolError) or a reset
(ReadError), and the client cannot tell whether the server saw it.  uvicorn closes idle
connections after 5 s and httpx reuses them for up to 5 s, so with both defaults a request sent
on a connection idle for about 5 s races the server's timer: a narrow window at the 5 s mark,
which a loaded machine widens (a request reused after 4.81 s was lost so, on 2 busy cores).

So the client gives a connection up first, always: a worker keeps an idle connection for
WORKER_KEEP_ALIVE_S (its uvicorn timeout_keep_alive), and the router's and prefill worker's
clients reuse one only while it has been idle less than CLIENT_IDLE_S.  A connection the worker
closes otherwise (it stopped, or restarted) is the worker going away, as before.
"""

from __future__ import annotations

import httpx

WORKER_KEEP_ALIVE_S = 65  # how long a worker keeps an idle connection open
CLIENT_IDLE_S = 5.0  # how long a client reuses an idle connection: well under WORKER_KEEP_ALIVE_S

# Lost with the connection under the request (the peer closed or reset it): the same request sent
# again on a fresh connection can pass.  (ConnectError is another matter: nobody listens there.)
LOST = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


def client_limits() -> httpx.Limits:
    """httpx's default pool sizes, idle connections given up after CLIENT_IDLE_S."""
    return httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=CLIENT_IDLE_S)


def server_config(app, *, host: str, port: int, log_level: str = "info"):
    """A worker's uvicorn.Config: idle connections kept WORKER_KEEP_ALIVE_S."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=WORKER_KEEP_ALIVE_S)
