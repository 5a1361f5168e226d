"""The OpenAI-compatible HTTP server: a FastAPI app over one AsyncLLMEngine.

    app = build_app(AsyncLLMEngine(LLMEngine(cfg), metrics=EngineMetrics("tiny")).start(), ["tiny"])
    uvicorn.run(app, host="127.0.0.1", port=8000)      # or serve(...), which does both

Endpoints
  POST /v1/completions        prompt: a string, token ids, or a list of either; SSE when stream=true
  POST /v1/chat/completions   messages through the tokenizer's chat template; SSE when stream=true
  GET  /v1/models             the served model name(s) with max_model_len
  GET  /health                503 until the engine is warm (and after it failed), then 200
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

import asyncio
import json
import logging
import re

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .async_engine import AsyncLLMEngine, EngineDead, EngineOverloaded, RequestStream, StreamDelta
from .guards import DEFAULT_MAX_REQUEST_BYTES, ApiKeyGuard, BodyLimit
from .protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    UsageInfo,
    error_body,
    random_id,
)

log = logging.getLogger("umem_jax")

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks whether its client is still there


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


_PARAM = re.compile(r"^(\w+)[=:]")


def _bad_request(e: ValueError) -> APIError:
    """ValueError from the engine / SamplingParams -> 400; "field=value: why" or "field: why"
    names the field."""
    msg = str(e)
    m = _PARAM.match(msg)
    return APIError(400, msg, m.group(1) if m else None)


def _sse(obj) -> str:
    return f"data: {obj.model_dump_json() if hasattr(obj, 'model_dump_json') else json.dumps(obj)}\n\n"


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
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.include_router(plain_routes)
    app.include_router(generation_routes)
    return app


# ------------------------------------------------------------------------------ errors


async def _api_error(_, e: APIError):
    return _error(e.status, e.message, e.param)


async def _validation_error(_, e: RequestValidationError):
    errs = e.errors()
    first = errs[0] if errs else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return _error(400, f"malformed JSON body: {first.get('msg', '')}")
    return _error(400, f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}", loc[0] if loc else None)


async def _http_error(_, e: StarletteHTTPException):
    return _error(e.status_code, str(e.detail))


async def _internal_error(_, e: Exception):
    log.exception("umem_jax: request failed")
    return _error(500, f"internal error: {e!r}")


# ------------------------------------------------------------------------------ plain endpoints

plain_routes = APIRouter()


@plain_routes.get("/health")
async def health(raw: Request):
    engine: AsyncLLMEngine = raw.app.state.engine
    if engine.ready:
        return Response(status_code=200)
    why = engine.dead_message() if engine.error is not None else "the engine is warming up"
    return _error(503, why)


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


# ------------------------------------------------------------------------------ generation

generation_routes = APIRouter()


@generation_routes.post("/v1/completions")
async def completions(body: CompletionRequest, raw: Request):
    engine: AsyncLLMEngine = raw.app.state.engine
    model = _check(body, raw.app.state.names)
    prompts = body.prompts()
    if not prompts:
        raise APIError(400, "prompt is empty", "prompt")
    rid = random_id("cmpl")
    streams, q = await _start(engine, prompts, body, rid)
    usage = lambda toks: UsageInfo.of(sum(s.prompt_tokens for s in streams), sum(toks))
    if body.stream:
        async def chunks():
            toks = [0] * len(streams)
            async for i, d in _deltas(streams, q, None):
                toks[i] = d.completion_tokens
                if d.text or d.finish_reason is not None:
                    yield CompletionChunk(id=rid, model=model, choices=[CompletionChoice(
                        index=i, text=d.text, finish_reason=d.finish_reason, stop_reason=d.stop_reason)])
            if body.include_usage:
                yield CompletionChunk(id=rid, model=model, choices=[], usage=usage(toks))

        return _event_stream(engine, streams, chunks())
    texts, toks, ends = [""] * len(streams), [0] * len(streams), [(None, None)] * len(streams)
    try:
        async for i, d in _deltas(streams, q, raw):
            texts[i] += d.text
            toks[i] = d.completion_tokens
            ends[i] = (d.finish_reason, d.stop_reason)
    finally:
        _abort_unfinished(engine, streams)
    choices = [CompletionChoice(index=i, text=texts[i], finish_reason=ends[i][0], stop_reason=ends[i][1])
               for i in range(len(streams))]
    return CompletionResponse(id=rid, model=model, choices=choices, usage=usage(toks))


@generation_routes.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, raw: Request):
    engine: AsyncLLMEngine = raw.app.state.engine
    model = _check(body, raw.app.state.names)
    tok = engine.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer, so no chat template: use /v1/completions with token ids")
    try:
        ids = await engine.tokenize_chat(body.conversation(), body.add_generation_prompt)
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None
    rid = random_id("chatcmpl")
    streams, q = await _start(engine, [ids], body, rid, field="messages")
    if body.stream:
        async def chunks():
            toks = 0
            yield ChatCompletionChunk(id=rid, model=model, choices=[ChatChunkChoice(
                index=0, delta=DeltaMessage(role="assistant", content=""))])
            async for _, d in _deltas(streams, q, None):
                toks = d.completion_tokens
                if d.text or d.finish_reason is not None:
                    yield ChatCompletionChunk(id=rid, model=model, choices=[ChatChunkChoice(
                        index=0, delta=DeltaMessage(content=d.text or None), finish_reason=d.finish_reason,
                        stop_reason=d.stop_reason)])
            if body.include_usage:
                yield ChatCompletionChunk(id=rid, model=model, choices=[],
                                          usage=UsageInfo.of(streams[0].prompt_tokens, toks))

        return _event_stream(engine, streams, chunks())
    text, toks, end = "", 0, (None, None)
    try:
        async for _, d in _deltas(streams, q, raw):
            text += d.text
            toks = d.completion_tokens
            end = (d.finish_reason, d.stop_reason)
    finally:
        _abort_unfinished(engine, streams)
    return ChatCompletionResponse(id=rid, model=model, choices=[ChatChoice(
        index=0, message=ChatResponseMessage(content=text), finish_reason=end[0], stop_reason=end[1])],
        usage=UsageInfo.of(streams[0].prompt_tokens, toks))


def _check(body, names: list[str]) -> str:
    """The model name to answer with; 404 for a name not served, 400 for unsupported fields."""
    if body.model is not None and body.model not in names:
        raise APIError(404, f"The model `{body.model}` does not exist.", "model")
    bad = body.unsupported()
    if bad is not None:
        raise APIError(400, f"{bad} is not supported by this server", bad)
    return body.model or names[0]


async def _start(engine: AsyncLLMEngine, prompts: list, body, rid: str,
                 field: str = "prompt") -> tuple[list[RequestStream], asyncio.Queue]:
    """Queue every prompt (all or none) -> their streams, sharing one queue."""
    try:
        params = body.sampling_params()
    except ValueError as e:
        raise _bad_request(e) from None
    q: asyncio.Queue = asyncio.Queue()
    streams: list[RequestStream] = []
    try:
        for i, p in enumerate(prompts):
            streams.append(await engine.add_request(p, params, request_id=f"{rid}-{i}", priority=body.priority, q=q,
                                                    field=field))
    except BaseException as e:
        for s in streams:  # (a cancelled add aborts its own request: AsyncLLMEngine.add_request)
            engine.abort(s.request_id)
        if isinstance(e, ValueError):
            raise _bad_request(e) from None
        if isinstance(e, (EngineOverloaded, EngineDead)):
            raise APIError(503, str(e)) from None
        raise
    return streams, q


async def _deltas(streams: list[RequestStream], q: asyncio.Queue, raw: Request | None):
    """(index, delta) until every stream finished.  With raw (non-streaming), checks every
    DISCONNECT_POLL_S whether the client is gone -- also while deltas keep coming, which they do
    every step -- and then stops; the caller's finally aborts what is left."""
    index = {s.request_id: i for i, s in enumerate(streams)}
    left = len(streams)
    clock = asyncio.get_running_loop().time
    check_at = clock() + DISCONNECT_POLL_S
    while left:
        if raw is None:
            d: StreamDelta = await q.get()
        else:
            try:
                d = q.get_nowait() if not q.empty() else await asyncio.wait_for(q.get(), max(0.0, check_at - clock()))
            except asyncio.TimeoutError:
                d = None
            if clock() >= check_at:
                if await raw.is_disconnected():
                    return
                check_at = clock() + DISCONNECT_POLL_S
            if d is None:
                continue
        if d.error is not None:
            raise APIError(500, d.error)
        i = index[d.request_id]
        streams[i].finished = d.finish_reason is not None
        left -= streams[i].finished
        yield i, d


def _abort_unfinished(engine: AsyncLLMEngine, streams: list[RequestStream]) -> None:
    for s in streams:
        if not s.finished:
            engine.abort(s.request_id)


class _EngineStream(StreamingResponse):
    """A StreamingResponse that aborts its unfinished requests however it ends -- also when the
    client left before the first event, when the body generator never starts (so its own
    `finally` never runs)."""

    def __init__(self, engine: AsyncLLMEngine, streams: list[RequestStream], events):
        super().__init__(events, media_type="text/event-stream")
        self.engine, self.streams = engine, streams

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            _abort_unfinished(self.engine, self.streams)


def _event_stream(engine: AsyncLLMEngine, streams: list[RequestStream], chunks) -> StreamingResponse:
    """SSE response of the `chunks` async generator (response models): an error mid-stream
    becomes an error event, whatever is unfinished is aborted (frees its pages) and the
    stream ends with [DONE] in every case."""
    async def events():
        try:
            async for chunk in chunks:
                yield _sse(chunk)
        except APIError as e:
            yield _sse(error_body(e.status, e.message))
        finally:
            _abort_unfinished(engine, streams)
        yield "data: [DONE]\n\n"

    return _EngineStream(engine, streams, events())


def serve(engine: AsyncLLMEngine, served_model_names: list[str], *, host: str = "127.0.0.1", port: int = 8000,
          model_root: str | None = None, log_level: str = "info", api_key: str | None = None,
          max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES) -> int:
    """Start the engine thread, serve until interrupted or the engine fails, stop the engine ->
    the exit code: 0, or 1 after an engine failure (open requests got its message first)."""
    import uvicorn

    app = build_app(engine, served_model_names, model_root=model_root, api_key=api_key,
                    max_request_bytes=max_request_bytes)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
    engine.on_dead = lambda why: setattr(server, "should_exit", True)  # graceful: open responses finish
    engine.start()
    try:
        server.run()
    finally:
        engine.shutdown()
    if engine.error is not None:
        log.error("umem_jax: the engine failed, the server stopped: %s", engine.dead_message())
        return 1
    return 0


__all__ = ["APIError", "build_app", "serve"]
