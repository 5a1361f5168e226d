"""The generation endpoints: POST /v1/completions and POST /v1/chat/completions.

Every prompt is drawn as best_of (else n) samples that share its prefill (engine/samples.py);
sample j of prompt i is choice i * n + j (vLLM's numbering).  With best_of > n (not streamed)
the n samples of highest mean token logprob are returned, indexed by that rank.  Streams are
SSE events of each choice's new text (and its tokens' logprobs when asked), by index, ending
with `data: [DONE]`; with stream_options.include_usage a usage chunk (choices=[]) comes last, and with
continuous_usage_stats as well every chunk carries the usage so far (vLLM's option).
Usage counts a prompt once (its samples share it), the completion tokens of every sample drawn,
and in prompt_tokens_details.cached_tokens the prompt tokens the prefix cache served (for the
prompt's first sample: the one that computed it).  Completions' echo, max_tokens 0 and
prompt_logprobs: echo.py.

A client that goes away -- mid-request, or while its request is being added -- has its
requests aborted, which frees their pages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ..engine.samples import best_order
from .async_engine import AsyncLLMEngine, EngineDead, EngineOverloaded, RequestStream, StreamDelta
from .errors import APIError, bad_request
from .echo import ChoiceWriter, prompt_logprobs_json
from .logprobs import chat_logprobs
from .protocol import ChatCompletionRequest, CompletionRequest, error_body, random_id
from .responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
    DeltaMessage,
    UsageInfo,
)

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks whether its client is still there

router = APIRouter()


@dataclasses.dataclass(eq=False)
class _Sample:
    """One sample's output so far, gathered from its deltas."""

    stream: RequestStream
    prompt: int  # which prompt of the request
    sample: int  # which of its samples
    text: str = ""
    tokens: int = 0
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    finish: tuple = (None, None)  # (finish_reason, stop_reason)
    cached: int = 0

    def apply(self, d: StreamDelta) -> None:
        self.text += d.text
        self.tokens = d.completion_tokens
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs or []
        self.finish = (d.finish_reason, d.stop_reason)
        self.cached = d.cached_tokens


class _Run:
    """Every sample of one HTTP request, k = best_of (else n) per prompt.  counted: usage counts
    the completion tokens (not those drawn for max_tokens 0 with echo)."""

    def __init__(self, streams: list[RequestStream], k: int, n: int, q: asyncio.Queue):
        self.samples = [_Sample(s, i // k, i % k) for i, s in enumerate(streams)]
        self.streams, self.k, self.n, self.q = streams, k, n, q
        self.counted = True
        self.prompt_lp: dict = {}  # prompt index -> its PromptLogprobs, from its primary's first delta

    def index(self, s: _Sample) -> int:
        return s.prompt * self.n + s.sample

    def usage(self) -> UsageInfo:
        first = [s for s in self.samples if s.sample == 0]
        return UsageInfo.of(sum(s.stream.prompt_tokens for s in first),
                            sum(s.tokens for s in self.samples) if self.counted else 0, sum(s.cached for s in first))

    def final(self) -> list[tuple[int, _Sample]]:
        """(choice index, sample) of the returned choices, by index: best_of keeps the n best."""
        if self.k == self.n:
            return [(self.index(s), s) for s in self.samples]
        out = []
        for p in range(len(self.samples) // self.k):
            group = self.samples[p * self.k:(p + 1) * self.k]
            order = best_order([sum(e[0] for e in s.logprobs) for s in group], [len(s.logprobs) for s in group])
            out += [(p * self.n + rank, group[i]) for rank, i in enumerate(order[: self.n])]
        return out

    async def deltas(self, raw: Request | None, hold: bool = False):
        """(sample, delta) until every sample finished (see _deltas).  hold: a prompt's other
        samples wait for its primary's first delta, which carries the prompt's scores that every
        choice starts with (the primary computes the prompt, so it usually draws first -- not
        after a retraction, nor without a prefix cache, where the siblings prefill beside it)."""
        held: dict[int, list] = {}
        seen: set[int] = set()  # prompts whose primary posted a delta
        async for i, d in _deltas(self.streams, self.q, raw):
            s = self.samples[i]
            s.apply(d)
            if d.prompt_logprobs is not None:
                self.prompt_lp[s.prompt] = d.prompt_logprobs
            if hold and s.sample and s.prompt not in seen:
                held.setdefault(s.prompt, []).append((s, d))
                continue
            seen.add(s.prompt)
            yield s, d
            for x in held.pop(s.prompt, ()):
                yield x
        for waiting in held.values():  # the primary never posted (it was aborted): unscored
            for x in waiting:
                yield x

    async def collect(self, engine: AsyncLLMEngine, raw: Request) -> None:
        try:
            async for _ in self.deltas(raw):
                pass
        finally:
            _abort_unfinished(engine, self.streams)


# ------------------------------------------------------------------------------ completions


@router.post("/v1/completions")
async def completions(body: CompletionRequest, raw: Request):
    engine: AsyncLLMEngine = raw.app.state.engine
    model = check(body, raw.app.state.names)
    prompts = body.prompts()
    if not prompts:
        raise APIError(400, "prompt is empty", "prompt")
    rid = random_id("cmpl")
    run = await _start(engine, prompts, body, rid)
    run.counted = not body.echo_only
    out = ChoiceWriter(body, engine.tokenizer, prompts)
    if body.stream:
        def chunk(choice: CompletionChoice) -> CompletionChunk:
            return CompletionChunk(id=rid, model=model, choices=[choice],
                                   usage=run.usage() if body.continuous_usage else None)

        async def chunks():
            started = set()
            async for s, d in run.deltas(None, hold=out.scored):
                head = None if s in started else out.first(run.index(s), s, run.prompt_lp.get(s.prompt))
                started.add(s)
                for choice in (head, out.delta(run.index(s), s, d)):
                    if choice is not None:
                        yield chunk(choice)
            if body.include_usage:
                yield CompletionChunk(id=rid, model=model, choices=[], usage=run.usage())

        return _event_stream(engine, run.streams, chunks())
    await run.collect(engine, raw)
    choices = [out.whole(i, s, run.prompt_lp.get(s.prompt)) for i, s in run.final()]
    return CompletionResponse(id=rid, model=model, choices=choices, usage=run.usage())


# ------------------------------------------------------------------------------ chat


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, raw: Request):
    engine: AsyncLLMEngine = raw.app.state.engine
    model = check(body, raw.app.state.names)
    tok = engine.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer, so no chat template: use /v1/completions with token ids")
    try:
        ids = await engine.tokenize_chat(body.conversation(), body.add_generation_prompt,
                                         continue_final_message=body.continue_final_message,
                                         template_kwargs=body.template_kwargs(),
                                         truncate=body.truncate_prompt_tokens)
    except ValueError as e:
        raise APIError(400, str(e), bad_request(e).param or "messages") from None
    rid = random_id("chatcmpl")
    run = await _start(engine, [ids], body, rid, field="messages")
    want, role, echoed = bool(body.logprobs), body.response_role(), body.echoed()
    shown = None if body.return_tokens_as_token_ids else tok  # logprobs' tokens as "token_id:N" (vLLM's)
    if body.stream:
        async def chunks():
            for i in range(body.n):
                yield ChatCompletionChunk(id=rid, model=model, choices=[ChatChunkChoice(
                    index=i, delta=DeltaMessage(role=role, content=""))],
                    usage=run.usage() if body.continuous_usage else None)
            for i in range(body.n if echoed else 0):  # echo: the continued message, before what is generated
                yield ChatCompletionChunk(id=rid, model=model, choices=[ChatChunkChoice(
                    index=i, delta=DeltaMessage(content=echoed))], usage=run.usage() if body.continuous_usage else None)
            async for s, d in run.deltas(None):
                lp = chat_logprobs(shown, d.token_ids, d.logprobs) if want and d.token_ids else None
                if d.text or lp is not None or d.finish_reason is not None:
                    yield ChatCompletionChunk(id=rid, model=model, choices=[ChatChunkChoice(
                        index=run.index(s), delta=DeltaMessage(content=d.text or None), logprobs=lp,
                        finish_reason=d.finish_reason, stop_reason=d.stop_reason)],
                        usage=run.usage() if body.continuous_usage else None)
            if body.include_usage:
                yield ChatCompletionChunk(id=rid, model=model, choices=[], usage=run.usage())

        return _event_stream(engine, run.streams, chunks())
    await run.collect(engine, raw)
    choices = [ChatChoice(index=i, message=ChatResponseMessage(role=role, content=echoed + s.text),
                          finish_reason=s.finish[0], stop_reason=s.finish[1],
                          logprobs=chat_logprobs(shown, s.token_ids, s.logprobs) if want else None)
               for i, s in run.final()]
    pl = run.prompt_lp.get(0)
    extra = None if pl is None or body.prompt_logprobs is None else prompt_logprobs_json(tok, pl, body.prompt_logprobs)
    return ChatCompletionResponse(id=rid, model=model, choices=choices, usage=run.usage(), prompt_logprobs=extra)


# ------------------------------------------------------------------------------ shared


def check(body, names: list[str]) -> str:
    """The model name to answer with; 404 for a name not served, 400 for unsupported fields."""
    if body.model is not None and body.model not in names:
        raise APIError(404, f"The model `{body.model}` does not exist.", "model")
    bad = body.unsupported()
    if bad is not None:
        raise APIError(400, f"{bad} is not supported by this server", bad)
    why = body.refused_format()
    if why is not None:
        raise APIError(400, why, "response_format")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
    return body.model or names[0]


async def _start(engine: AsyncLLMEngine, prompts: list, body, rid: str, field: str = "prompt") -> _Run:
    """Queue every prompt's samples (all or none) -> the run, its streams sharing one queue."""
    try:
        params = body.sampling_params()
    except ValueError as e:
        raise bad_request(e) from None
    q: asyncio.Queue = asyncio.Queue()
    streams: list[RequestStream] = []
    try:
        for i, p in enumerate(prompts):
            streams += await engine.add_samples(p, params, request_id=f"{rid}-{i}", priority=body.priority, q=q,
                                                field=field)
    except BaseException as e:
        for s in streams:  # (a cancelled add aborts its own request: AsyncLLMEngine.add_samples)
            engine.abort(s.request_id)
        if isinstance(e, ValueError):  # a prompt's own error names no field: it is the prompt's
            err = bad_request(_in_request_terms(e, body))
            err.param = err.param or field
            raise err from None
        if isinstance(e, (EngineOverloaded, EngineDead)):
            raise APIError(503, str(e)) from None
        raise
    return _Run(streams, params.num_samples, params.n, q)


def _in_request_terms(e: ValueError, body) -> ValueError:
    """The engine names the output limit max_tokens; a request that set it as max_completion_tokens
    (chat) or max_new_tokens gets the error under that name (its 400's param)."""
    field = body._max_tokens()[0]
    msg = str(e)
    if field == "max_tokens" or not msg.startswith("max_tokens="):
        return e
    return ValueError(re.sub(r"\bmax_tokens\b", field, msg))


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
            except TimeoutError:
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


def _sse(obj) -> str:
    return f"data: {obj.model_dump_json() if hasattr(obj, 'model_dump_json') else json.dumps(obj)}\n\n"


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


__all__ = ["DISCONNECT_POLL_S", "check", "router"]
