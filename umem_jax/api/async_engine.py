"""AsyncLLMEngine: the LLMEngine driven by ONE background thread, fed from asyncio.

    aeng = AsyncLLMEngine(LLMEngine(config), metrics=EngineMetrics("tiny"))
    aeng.start()                                    # engine thread: warm-up, then the step loop
    stream = await aeng.add_request("Hi", SamplingParams(max_tokens=8))   # ValueError -> HTTP 400
    async for delta in stream: print(delta.text, delta.finish_reason)
    aeng.abort(stream.request_id)                   # e.g. the client went away: frees its pages

Why one thread: the engine, its scheduler and its allocator are plain host objects that are not
thread-safe, and JAX dispatch wants one caller.  So every touch of the engine happens in the
engine thread.  Other threads talk to it through one inbox of commands (add, abort, call), each
answered through a concurrent Future; the thread drains the inbox between steps and sleeps on
it when there is nothing to run.

Streaming: `LLMEngine.step()` reports only finished requests, so after each step the thread
diffs every tracked request's output (tokens and detokenized text) against what it already
sent and posts a `StreamDelta` into the request's asyncio queue (loop.call_soon_threadsafe).
Text that could still turn out to be the start of a stop string is held back until it cannot.

Errors are decided before any byte is streamed: `add_request` returns only once the engine
thread has validated and queued the request -- or refused it (bad parameter or the memory clip:
ValueError; waiting queue over `max_waiting_requests`: EngineOverloaded).  Text is tokenized
before that, in the caller's event loop through a small thread pool, and checked against
max_model_len there (first by its length in characters, then in tokens), so a long prompt
never stalls the engine thread and one too long costs no tokenizing.  A caller that goes away
(its task is cancelled) while the engine adds its request has the request aborted right after.

A request whose own work raises (engine/isolation.py) ends alone: its last delta carries
`error`; the engine goes on.  If the engine itself fails, every open stream gets the error, new
requests get EngineDead, and `on_dead` (if set) is called with the reason.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time

from ..core.request import Request
from ..core.sampling_params import SamplingParams
from ..engine.engine import LLMEngine
from ..engine.prompt import check_prompt_len, check_text_len, truncate_prompt
from .metrics import EngineMetrics
from .stream import RequestStream, StreamDelta

log = logging.getLogger("umem_jax")

_STOP = object()


class EngineOverloaded(RuntimeError):
    """The waiting queue is over its limit (HTTP 503)."""


class EngineDead(RuntimeError):
    """The engine thread stopped (an error, or shutdown)."""


@dataclasses.dataclass
class _Track:
    """A request the thread streams: what it has sent so far and when."""

    req: Request
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float  # HTTP arrival (time.time()), the start of TTFT and e2e
    sent_tokens: int = 0
    sent_chars: int = 0
    last_token: float | None = None


class AsyncLLMEngine:
    """Owns the engine thread.  max_waiting_requests: queue length at which new requests get
    EngineOverloaded (None: no limit); metrics: where to count; warmup: run one short request
    before reporting ready (compiles the smallest prefill and decode shapes); warmup_shapes: before
    that, compile this many of the reachable step shapes, decode first (LLMEngine.warmup; None:
    all of them, 0: none), each in the sampler modes of warmup_sampling."""

    def __init__(self, engine: LLMEngine, *, max_waiting_requests: int | None = 1024,
                 metrics: EngineMetrics | None = None, warmup: bool = True, warmup_shapes: int | None = 0,
                 warmup_sampling=("greedy", "cuts"), metrics_interval_s: float = 0.25, tokenizer_threads: int = 2):
        self.engine = engine
        self.on_dead = None  # called (from the engine thread) with the reason when the engine fails
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(max(1, tokenizer_threads),
                                                                    thread_name_prefix="umem-tokenize")
        self.max_waiting_requests, self.metrics = max_waiting_requests, metrics
        self.metrics_interval_s = metrics_interval_s
        self.warmup, self.warmup_shapes, self.warmup_sampling = warmup, warmup_shapes, tuple(warmup_sampling)
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._inbox: queue.Queue = queue.Queue()
        self._tracked: dict[str, _Track] = {}
        self._thread: threading.Thread | None = None
        self._last_snapshot = 0.0
        if metrics is not None:
            metrics.bind(engine)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "AsyncLLMEngine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="umem-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, timeout: float = 30.0) -> None:
        if self._thread is not None:
            self._inbox.put(_STOP)
            self._thread.join(timeout)
            self._thread = None
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def ready(self) -> bool:
        """Warm and alive: what GET /health reports."""
        return self._ready.is_set() and self.error is None and self._thread is not None

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._ready.wait(timeout)
        return self.ready

    @property
    def tokenizer(self):
        """The engine's tokenizer (None: token ids only).  Fixed at build: safe from any thread."""
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        """The longest request (prompt + output), fixed at build."""
        return self.engine.max_model_len

    # ------------------------------------------------------------------ requests (any thread / event loop)
    async def add_request(self, prompt, params: SamplingParams, *, request_id: str, priority: int = 0,
                          q: asyncio.Queue | None = None, field: str = "prompt") -> RequestStream:
        """Queue one request -> the stream of its first sample (`add_samples` gives every one)."""
        return (await self.add_samples(prompt, params, request_id=request_id, priority=priority, q=q,
                                       field=field))[0]

    async def add_samples(self, prompt, params: SamplingParams, *, request_id: str, priority: int = 0,
                          q: asyncio.Queue | None = None, field: str = "prompt") -> list[RequestStream]:
        """Queue one request -> a stream per sample (params.best_of or n; engine/samples.py), in
        sample order.  Raises ValueError (bad input, or the prompt is over max_model_len --
        naming `field` -- or the memory budget), EngineOverloaded or EngineDead.  q: post deltas
        into this queue (several requests may share one; deltas carry their request_id)."""
        arrival = time.time()
        if self.error is not None or self._thread is None:
            raise EngineDead(self.dead_message())
        prompt = await self.tokenize(prompt, field, params.truncate_prompt_tokens)
        q = asyncio.Queue() if q is None else q
        rid = str(request_id)
        fut = self._submit("add", (prompt, params, rid, priority, asyncio.get_running_loop(), q, arrival))
        try:
            ids, prompt_tokens = await asyncio.wrap_future(fut)
        except asyncio.CancelledError:  # the caller went away: the add may have run already
            self.abort(rid)  # after the add in the inbox, so it finds the request (or nothing; samples go with it)
            raise
        return [RequestStream(i, prompt_tokens, q) for i in ids]

    async def tokenize(self, prompt, field: str = "prompt", truncate: int | None = None):
        """A text prompt -> {"prompt": text, "prompt_token_ids": ids}, tokenized in the pool;
        token ids as they are.  Either is checked against max_model_len first (ValueError
        naming `field`), after keeping its last `truncate` tokens if asked (truncate_prompt_tokens:
        then text of any length is tokenized); anything else is left to the engine's checks."""
        eng = self.engine
        if isinstance(prompt, str) and prompt and eng.tokenizer is not None:
            if truncate is None:
                check_text_len(prompt, eng.max_model_len, eng.max_token_chars, field)
            loop = asyncio.get_running_loop()
            ids = await loop.run_in_executor(self._tokenize_pool, eng.tokenizer.encode, prompt)
            prompt = {"prompt": prompt, "prompt_token_ids": ids}
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
        if isinstance(ids, list):
            ids = truncate_prompt(ids, truncate, eng.max_model_len)
            check_prompt_len(len(ids), eng.max_model_len, field)
            prompt = {**prompt, "prompt_token_ids": ids} if isinstance(prompt, dict) else ids
        return prompt

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> token ids in the pool, unchecked (/tokenize)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, self.engine.tokenizer.encode, text, add_special_tokens)

    async def tokenize_chat(self, conversation: list[dict], add_generation_prompt: bool = True,
                            check_len: bool = True, continue_final_message: bool = False,
                            template_kwargs: dict | None = None, truncate: int | None = None) -> list[int]:
        """Chat messages through the tokenizer's template, in the pool, checked against
        max_model_len (ValueError naming "messages") unless check_len is False (/tokenize); the
        rendered prompt's last `truncate` tokens only, if asked (truncate_prompt_tokens)."""
        eng = self.engine
        if check_len and truncate is None:
            check_text_len("".join(str(m.get("content", "")) for m in conversation), eng.max_model_len,
                           eng.max_token_chars, "messages")
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(self._tokenize_pool, eng.tokenizer.encode_chat, conversation,
                                         add_generation_prompt, continue_final_message, template_kwargs)
        ids = truncate_prompt(ids, truncate, eng.max_model_len)
        if check_len:
            check_prompt_len(len(ids), eng.max_model_len, "messages")
        return ids

    def abort(self, request_id: str) -> None:
        """Abort a request (if still running) and free its pages.  Never blocks."""
        if self._thread is not None:
            self._inbox.put(("abort", str(request_id), None))

    def call(self, fn) -> concurrent.futures.Future:
        """Run fn(engine) in the engine thread between two steps -> a Future of its result
        (tests use it for check_idle and allocator numbers)."""
        return self._submit("call", fn)

    def _submit(self, kind: str, payload) -> concurrent.futures.Future:
        fut = concurrent.futures.Future()
        if self.error is not None or self._thread is None:
            fut.set_exception(EngineDead(self.dead_message()))
        else:
            self._inbox.put((kind, payload, fut))
        return fut

    def dead_message(self) -> str:
        """Why the engine is not running (GET /health's 503 text)."""
        return f"engine is not running: {self.error!r}" if self.error is not None else "engine is not running"

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        try:
            if self.warmup:
                self._warm_up()
            self._ready.set()
            idle_reported = False
            while True:
                busy = self.engine.has_unfinished_requests()
                if not busy and not idle_reported:  # before sleeping: the idle numbers, exact
                    self._snapshot(force=True)
                    idle_reported = True
                for cmd in self._drain(block=not busy):
                    if cmd is _STOP:
                        self._fail_all("the server is shutting down")
                        return
                    self._do(*cmd)
                if self.engine.has_unfinished_requests():
                    self.engine.step()
                    self._publish()
                    idle_reported = False
                    self._snapshot(force=False)
        except BaseException as e:  # noqa: BLE001 - the engine cannot go on; report it everywhere
            log.exception("umem_jax engine thread failed")
            self.error = e
            self._ready.set()
            self._fail_all(f"engine error: {e!r}")
            for cmd in self._drain(block=False):
                if cmd is not _STOP and cmd[2] is not None:
                    cmd[2].set_exception(EngineDead(self.dead_message()))
            if self.on_dead is not None:
                self.on_dead(self.dead_message())

    def _drain(self, block: bool) -> list:
        out = [self._inbox.get()] if block else []
        while True:
            try:
                out.append(self._inbox.get_nowait())
            except queue.Empty:
                return out

    def _do(self, kind: str, payload, fut: concurrent.futures.Future | None) -> None:
        if fut is not None and not fut.set_running_or_notify_cancel():
            return
        try:
            if kind == "add":
                fut.set_result(self._add(*payload))
            elif kind == "abort":
                self._abort(payload)
            else:
                fut.set_result(payload(self.engine))
        except Exception as e:  # noqa: BLE001 - the caller gets it
            if fut is None:
                raise
            fut.set_exception(e)

    def _add(self, prompt, params, request_id, priority, loop, q, arrival) -> tuple[list[str], int]:
        eng = self.engine
        limit = self.max_waiting_requests
        if limit is not None and eng.num_waiting >= limit:
            raise EngineOverloaded(f"the server is overloaded: {eng.num_waiting} requests are waiting "
                                   f"(limit {limit}); retry later")
        req = eng.prepare(prompt, params, request_id=request_id, priority=priority)
        eng.enqueue(req)
        if req.finished:  # refused by the memory clip; step() reports it, nobody listens
            if self.metrics is not None:
                self.metrics.on_abort("budget")
            raise ValueError(req.error)
        for r in (req, *req.siblings):  # every sample streams on its own (siblings start once queued)
            self._tracked[r.request_id] = _Track(r, loop, q, arrival)
        if self.metrics is not None:
            self.metrics.on_admit(req.prompt_len)
        return [r.request_id for r in (req, *req.siblings)], req.prompt_len

    def _abort(self, request_id: str) -> None:
        t = self._tracked.pop(request_id, None)
        if t is None:  # finished already: nothing to free
            return
        self.engine.abort_request(request_id)
        if self.metrics is not None:
            self.metrics.on_abort("client")
        self._post(t, StreamDelta(request_id, "", [], "abort", None, t.req.prompt_len, t.sent_tokens))

    def _publish(self) -> None:
        """Post every tracked request's progress since the last step.  Making a request's delta
        (its text) may raise: that request fails alone (LLMEngine.fail_request)."""
        now = time.time()
        done = []
        for rid, t in self._tracked.items():
            try:
                delta = self._delta(t)
            except Exception as e:  # noqa: BLE001 - this request's failure, not the engine's
                self.engine.fail_request(t.req, e, "streaming its text")
                delta = self._delta(t)  # failed: finished, no new text
            if delta is None:
                continue
            req, n = t.req, delta.completion_tokens
            if self.metrics is not None and n > t.sent_tokens:
                first = t.sent_tokens == 0
                self.metrics.on_tokens(n - t.sent_tokens, ttft=now - t.arrival if first else None,
                                       gap=None if first else now - t.last_token)
            if n > t.sent_tokens:
                t.last_token = now
            t.sent_tokens, t.sent_chars = n, t.sent_chars + len(delta.text)
            self._post(t, delta)
            if delta.finish_reason is not None:
                done.append(rid)
                if self.metrics is not None and delta.error is not None:
                    self.metrics.on_abort("error")
                elif self.metrics is not None:
                    sched = req.metrics.first_scheduled_time
                    self.metrics.on_finish(req.finish_reason, now - t.arrival,
                                           None if sched is None else max(0.0, sched - t.arrival))
        for rid in done:
            del self._tracked[rid]

    @staticmethod
    def _delta(t: _Track) -> StreamDelta | None:
        """What `t`'s request produced since its last delta (None: nothing); a request that
        failed in the engine ends with its error."""
        req = t.req
        n = len(req.output_token_ids)
        finished = req.finished
        end = len(req.text)
        if not finished and req.params.stop:  # hold back what may become a stop string
            end = max(t.sent_chars, end - max(map(len, req.params.stop)) + 1)
        if n == t.sent_tokens and end == t.sent_chars and not finished:
            return None
        failed = finished and req.finish_reason == "abort" and req.error is not None
        return StreamDelta(t.req.request_id, req.text[t.sent_chars:end], req.output_token_ids[t.sent_tokens:n],
                           req.finish_reason if finished else None, req.stop_reason if finished else None,
                           req.prompt_len, n, error=req.error if failed else None,
                           logprobs=None if req.logprobs is None else req.logprobs[t.sent_tokens:n],
                           cached_tokens=req.num_cached_tokens,
                           prompt_logprobs=req.prompt_lp if t.sent_tokens == 0 else None)

    def _post(self, t: _Track, delta: StreamDelta) -> None:
        try:
            t.loop.call_soon_threadsafe(t.queue.put_nowait, delta)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _fail_all(self, message: str) -> None:
        for rid, t in list(self._tracked.items()):
            self._post(t, StreamDelta(rid, "", [], "abort", None, t.req.prompt_len, t.sent_tokens, error=message))
        self._tracked.clear()

    def _snapshot(self, force: bool) -> None:
        now = time.monotonic()
        if self.metrics is not None and (force or now - self._last_snapshot >= self.metrics_interval_s):
            self.metrics.snapshot(self.engine)
            self._last_snapshot = now

    def _warm_up(self) -> None:
        """One 2-token request straight through the engine: compiles the first prefill and
        decode shapes before /health says 200."""
        eng = self.engine
        t0 = time.perf_counter()
        if self.warmup_shapes != 0:
            eng.warmup(self.warmup_shapes, sampling=self.warmup_sampling)
        eng.add_request(list(range(1, 9)), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                        request_id="umem-warmup")
        while eng.has_unfinished_requests():
            eng.step()
        log.info("umem_jax: warm after %.1f s (%d step shapes compiled)", time.perf_counter() - t0,
                 eng.runner.num_compilations)


__all__ = ["AsyncLLMEngine", "EngineDead", "EngineOverloaded", "RequestStream", "StreamDelta"]
