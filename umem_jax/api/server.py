"""The OpenAI-compatible HTTP server: a FastAPI app over one AsyncLLMEngine.

    app = build_app(AsyncLLMEngine(LLMEngine(cfg), metrics=EngineMetrics("tiny")).start(), ["tiny"])
    uvicorn.run(app, host="127.0.0.1", port=8000)      # or serve(...), which does both

Endpoints
  POST /v1/completions        prompt: a string, token ids, or a list of either; SSE when stream=true
  POST /v1/chat/completions   messages through the tokenizer's chat template; SSE when stream=true
                              (both in generation.py: n / best_of samples, logprobs, usage)
  GET  /v1/models             the served model name(s) with max_model_len
  POST /tokenize, /detokenize vLLM's tokenizer endpoints (tokenize.py)
  GET  /health                503 until the engine is warm (and after it failed), then 200
  GET  /version               {"version": umem_jax's}, as vLLM's (open, like /health)
  GET  /metrics               Prometheus text (metrics.py)

Streams are `data: {json}\\n\\n` events ending with `data: [DONE]\\n\\n`; with
stream_options.include_usage the last event before [DONE] is a usage chunk with choices=[].
Errors are `{"error": {"message", "type", "param", "code"}}`: 400 for malformed JSON and bad
parameters (the memory-budget refusal included; a prompt over max_model_len names its field),
401 for /v1/* without the API key (when one is set: guards.py), 404 for an unknown model, 413
for a body over the size limit, 500 for a request that failed in the engine (the others go on:
engine/isolation.py), 503 when the waiting queue is over its limit or the engine is not
running.  Text is tokenized off the engine thread (AsyncLLMEngine.tokenize).  A client that
goes away -- mid-request, or while its request is being added -- has it aborted, which frees
its pages.
"""

from __future__ import annotations

import logging
import socket

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response

from . import generation, tokenize
from .async_engine import AsyncLLMEngine
from .errors import APIError, add_handlers, error
from .guards import DEFAULT_MAX_REQUEST_BYTES, ApiKeyGuard, BodyLimit
from .responses import ModelCard, ModelList

log = logging.getLogger("umem_jax")


def build_app(engine: AsyncLLMEngine, served_model_names: list[str], *, model_root: str | None = None,
              api_key: str | None = None, max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The FastAPI app.  The caller starts and stops `engine` (serve() does both).  api_key:
    required on /v1/* (None: open); max_request_bytes: the body limit (None: none)."""
    app = FastAPI(title="umem_jax", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    app.add_middleware(ApiKeyGuard, api_key=api_key)  # outermost: no body is read before the key
    app.state.engine = engine
    app.state.names = list(served_model_names)
    app.state.model_root = model_root
    add_handlers(app)
    app.include_router(plain_routes)
    app.include_router(generation.router)
    app.include_router(tokenize.router)
    return app


# ------------------------------------------------------------------------------ plain endpoints

plain_routes = APIRouter()


@plain_routes.get("/health")
async def health(raw: Request):
    engine: AsyncLLMEngine = raw.app.state.engine
    if engine.ready:
        return Response(status_code=200)
    why = engine.dead_message() if engine.error is not None else "the engine is warming up"
    return error(503, why)


@plain_routes.get("/version")
async def version():
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return {"version": installed("umem_jax")}
    except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        return {"version": "unknown"}


@plain_routes.get("/v1/models")
async def models(raw: Request):
    st = raw.app.state
    return ModelList(data=[ModelCard(id=n, root=st.model_root, max_model_len=st.engine.max_model_len)
                           for n in st.names])


@plain_routes.get("/metrics")
async def metrics(raw: Request):
    engine: AsyncLLMEngine = raw.app.state.engine
    if engine.metrics is None:
        raise APIError(404, "metrics are off")
    body, ctype = engine.metrics.render()
    return Response(body, media_type=ctype)


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not listening yet), or ValueError saying why not.  `serve`
    binds before the model loads, so a port in use or a bad address is refused at once, not after
    the weights loaded and the warm-up compiled (and never with a "ready" line for a server that
    is not there).  Port 0 takes a free port: getsockname() says which."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: a TCP port is 0..65535 (0: any free port)")
    sock = None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        # IPv4 first: "localhost" may resolve to ::1 first, and clients often try 127.0.0.1 only
        family, kind, proto, _, addr = sorted(infos, key=lambda i: i[0] != socket.AF_INET)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a TIME_WAIT port is reusable
        sock.bind(addr)
    except OSError as e:  # gaierror (unknown host) included
        if sock is not None:
            sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def serve(engine: AsyncLLMEngine, served_model_names: list[str], *, host: str = "127.0.0.1", port: int = 8000,
          model_root: str | None = None, log_level: str = "info", api_key: str | None = None,
          max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES, sock: socket.socket | None = None) -> int:
    """Start the engine thread, serve until interrupted or the engine fails, stop the engine ->
    the exit code: 0, or 1 after an engine failure (open requests got its message first).  sock:
    a socket from bind(host, port) (None: bound here)."""
    import uvicorn

    app = build_app(engine, served_model_names, model_root=model_root, api_key=api_key,
                    max_request_bytes=max_request_bytes)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
    engine.on_dead = lambda why: setattr(server, "should_exit", True)  # graceful: open responses finish
    sock = sock if sock is not None else bind(host, port)
    engine.start()
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
        sock.close()
    if engine.error is not None:
        log.error("umem_jax: the engine failed, the server stopped: %s", engine.dead_message())
        return 1
    return 0


__all__ = ["APIError", "bind", "build_app", "serve"]
