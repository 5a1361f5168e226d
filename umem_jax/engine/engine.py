"""LLMEngine: requests in, one scheduled step at a time, outputs out.

    engine = LLMEngine(EngineConfig(model="tiny", arena_bytes=8 << 20))
    engine.add_request("Hello", SamplingParams(temperature=0, max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...

A request crosses: engine.add_request (tokenize, validate, memory clip) -> scheduler.schedule
(batch + memory) -> runner.launch (one jitted step: model -> kernels -> arena, then sampler)
-> engine._process (stop checks, detokenize) -> RequestOutput.  The parts are made by
build.py, in dependency order.

Overlap: `step()` launches step N+1 before reading step N's tokens, so the host schedules
while the device computes; decode rows take their input token from step N's device output.
The price: a request that stops on a token (EOS, stop string) is found out one step late and
that step's row for it is wasted; one that step N ends by length gives its memory to step N+1
before N is read back (Scheduler.release_ending).  Batches that use penalties read back first
(their counts need every output token on the host).  Speculative decode steps overlap too: the next one is
placed for the worst case of the accepted counts still on the device and reads them there
(overlap.py says when a step stays in flight).

Prefix caching (on by default, as in vLLM; `enable_prefix_caching=False` turns it off): a
request whose prompt starts with cached pages shares them and computes only the rest; see
scheduler/prefix_cache.py for what is cached of each kind of memory and scheduler/scheduler.py
for when.

Failures (isolation.py): an exception one request's work raises -- in its admission, in a
launch (bisected to the rows that fail alone), in applying its token -- fails that request
alone (finish_reason "abort", `error`), its memory given back; the others run on.  A failure
that is not one request's (a probe request fails too, a device error, anything else in a step)
raises EngineDeadError, and so does every call after it.

At idle (nothing queued, nothing in flight) the engine checks the allocator's invariants and
that every allocated page / slot is held by a live request or the prefix cache (refcounts
included), and raises on any violation.
"""

from __future__ import annotations

import itertools
import logging
import time

import numpy as np

from ..core.request import Request, RequestOutput, RequestStatus
from ..core.sampling_params import SamplingParams, seed_word
from ..runner.runner import Launched
from ..runner.speculative import SpecLaunched
from .bands import band_usage
from .build import build
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer, find_stop
from .fit import fit_max_tokens
from .handoff import Handoff
from . import overlap
from .isolation import EngineDeadError, FailureIsolation
from .samples import Samples
from .speculative import SpecStats, apply_verify
from .stats import engine_stats
from .warmup import warm_up
from .prompt import (check_priority, check_prompt_len, check_vocab_fields, max_token_chars, prompt_ids,
                     truncate_prompt)

log = logging.getLogger("umem_jax")

BUDGET_MESSAGE = "Request prompt exceeds the KV memory budget: input_len={}."
# max_tokens that cannot fit beside the prompt (vLLM's 400): max_tokens, max_model_len, prompt tokens
MAX_TOKENS_MESSAGE = ("max_tokens={0} is too large: the prompt ({2} tokens) and max_tokens must fit max_model_len={1}, "
                      "so at most {3} here (or leave max_tokens unset: up to the room left)")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = cfg = config
        parts = build(cfg)
        self.model, self.plan, self.max_model_len = parts.model, parts.plan, parts.max_model_len
        self.size, self.regions, self.allocator = parts.size, parts.regions, parts.allocator
        self.buckets, self.demand, self.scheduler = parts.buckets, parts.demand, parts.scheduler
        self.tokenizer, self.eos_ids, self.runner = parts.tokenizer, parts.eos_ids, parts.runner
        self.max_token_chars = max_token_chars(self.tokenizer)  # the early length check of text prompts
        self._requests: dict[str, Request] = {}
        self._aborted: list[Request] = []  # refused at arrival or aborted, reported by the next step()
        self._inflight: Launched | None = None  # the launched step whose tokens are not read yet
        self._arrivals = itertools.count()
        self.num_steps = {"prefill": 0, "decode": 0}
        self.num_idle_checks = 0
        self.isolation = FailureIsolation(self)
        self.samples = Samples(self)  # n / best_of: a prompt's samples forked from its prefill
        self.dead: str | None = None  # why the engine stopped (every later call raises EngineDeadError)
        spec = cfg.speculative_config
        self.draft = parts.draft
        self.spec_stats = SpecStats(spec.num_speculative_tokens) if spec is not None else None
        self.handoff = Handoff(self)  # export / import of a request's pages (disaggregation)
        log.info("umem_jax engine: %s mode\n%s\n%s", cfg.memory_mode, self.plan.table(),
                 self.size.summary(self.regions))

    # ------------------------------------------------------------------ requests
    def prepare(self, prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
                priority: int = 0) -> Request:
        """Validate and tokenize one request -> a Request not yet queued.  Raises ValueError for
        bad input, touching nothing else."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        k = params.truncate_prompt_tokens
        text, ids = prompt_ids(prompt, self.tokenizer, self.max_model_len, None if k else self.max_token_chars)
        if not ids:
            raise ValueError("empty prompt: give at least one token")
        ids = truncate_prompt(ids, k, self.max_model_len)  # the text stays the prompt as given (vLLM's too)
        check_prompt_len(len(ids), self.max_model_len)
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of the vocabulary [0, {vocab}): {bad[:8]}")
        check_vocab_fields(params, vocab)
        if self.spec_stats is not None:  # the verify's acceptance reads unbiased, unmasked rows
            for name in ("logit_bias", "allowed_token_ids"):
                if getattr(params, name):
                    raise ValueError(f"{name}: not supported with speculative decoding yet")
        if params.stop and self.tokenizer is None:  # no text is made, so none could ever match
            raise ValueError("stop strings need a tokenizer, and this model has none: use stop_token_ids")
        if params.min_tokens and len(set(self.eos_ids) | set(params.stop_token_ids)) > self.runner.banned_per_row:
            raise ValueError(f"min_tokens with more than {self.runner.banned_per_row} stop token ids (the model's EOS "
                             f"ids included: {len(self.eos_ids)}) is not supported")
        stops = set() if params.ignore_eos else set(self.eos_ids)
        if params.min_tokens and params.allowed_token_ids and set(params.allowed_token_ids) <= stops | set(
                params.stop_token_ids):  # min_tokens would ban every id the row may draw
            raise ValueError("allowed_token_ids: every allowed id is a stop token that min_tokens bans")
        check_priority(priority, self.config.priority_range)
        if request_id is not None and (str(request_id) in self._requests or str(request_id) in self.samples.groups):
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = next(self._arrivals)
        rid = str(request_id) if request_id is not None else str(arrival)
        while rid in self._requests or rid in self.samples.groups:
            rid += "+"
        room = self.max_model_len - len(ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(MAX_TOKENS_MESSAGE.format(params.max_tokens, self.max_model_len, len(ids), room))
        max_tokens = room if params.max_tokens is None else params.max_tokens
        seed = params.seed if params.seed is not None else (self.config.seed * 1_000_003 + arrival)
        req = Request(rid, text, ids, params, arrival=arrival, seed=seed_word(int(seed)), max_tokens=max_tokens,
                      priority=priority, windows=tuple(n for n, _ in self.demand.windows))
        req.stop_ids = ([] if params.ignore_eos else sorted(self.eos_ids)) + list(params.stop_token_ids)
        self.samples.fork(req)  # the logprobs it records, and its siblings of n / best_of (samples.py)
        return req

    def add_request(self, prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
                    priority: int = 0) -> str:
        """Queue one request -> its id.  Bad input raises ValueError and changes nothing."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        return self.enqueue(self.prepare(prompt, params, request_id=request_id, priority=priority))

    def enqueue(self, req: Request) -> str:
        """Apply the memory clip and queue a prepared request (or refuse it: see BUDGET_MESSAGE)."""
        self._requests[req.request_id] = req
        clipped = self.demand.clip(req.prompt_len, req.max_tokens)
        why = (BUDGET_MESSAGE.format(req.prompt_len) if clipped is None
               else fit_max_tokens(req, clipped, self.max_model_len))
        if why is not None:  # refused: the whole group (n / best_of samples) is reported, each with why
            for r in [req, *self.samples.refuse(req)]:
                r.mark_finished(RequestStatus.FINISHED_ABORTED, error=why)
                self._aborted.append(r)
            return req.request_id
        if self.tokenizer is not None:
            req.detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.params.skip_special_tokens)
        self.scheduler.add(req)
        self.samples.hold(req)
        return req.request_id

    def abort_request(self, request_id: str) -> None:
        req = self._requests.get(str(request_id))
        if req is not None and not req.finished:
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            req.mark_finished(RequestStatus.FINISHED_ABORTED, error="aborted by the user")
            self._aborted.append(req)
        for s in self.samples.rest(str(request_id)):  # a primary's samples go with it, finished or not
            self.abort_request(s.request_id)

    def fail_request(self, req: Request, error: BaseException, where: str) -> None:
        """End a request whose own work raised outside step() (e.g. streaming its text): its
        memory back (if it still holds any), finish_reason "abort" with the error (isolation.py)."""
        self.isolation.fail(req, error, where)

    def has_unfinished_requests(self) -> bool:
        return bool(self._aborted) or self.scheduler.has_work() or self._inflight is not None or bool(self.samples.held)

    @property
    def has_inflight(self) -> bool:
        """A launched step's tokens are not read back yet (the overlap: see step())."""
        return self._inflight is not None

    @property
    def num_waiting(self) -> int:
        """Requests queued and not admitted (retracted ones included)."""
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        """Requests holding arena memory (prefilling or decoding)."""
        return len(self.scheduler.running)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Schedule and launch the next step, then finish the previous one -> outputs of the
        requests that finished (requests that failed included: see isolation.py).  Raises
        EngineDeadError when the engine cannot go on, and on every call after that."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        try:
            outs = self._step()
            return self.isolation.after_step(outs) if self.isolation.probing else outs
        except BaseException as e:
            self.dead = str(e) if isinstance(e, EngineDeadError) else f"the engine failed: {e!r}"
            raise

    @property
    def probing(self) -> bool:
        """A probe (sent after a request failed) has not finished yet."""
        return self.isolation.probing

    def _step(self) -> list[RequestOutput]:
        idle_before = self._inflight is None
        failed_before = self.isolation.num_failed
        outs = [r.output() for r in self._aborted]
        for r in self._aborted:
            self._requests.pop(r.request_id, None)
        self._aborted = []
        self.samples.release()
        if self._inflight is not None and overlap.needs_sync(self, self._inflight):
            outs += self._process(self._inflight)
            self._inflight = None
        if self._inflight is not None:  # requests it ends give their memory to the next step now
            self.scheduler.release_ending(keep=self.handoff.keeps)
        batch = self.scheduler.schedule()
        for req, e in self.scheduler.take_failed():
            self.isolation.report(req, e, "admission")
        launched = None
        if batch is not None:
            self.runner.apply_moves(self.allocator.take_moves())
            try:
                launched = self.runner.launch(batch)
            except Exception as e:  # noqa: BLE001 - isolated: the parts that run are read back now
                outs += self.isolation.relaunch(batch, e)
            self.num_steps[batch.kind] += 1
        if self._inflight is not None:
            outs += self._process(self._inflight)
        self._inflight = launched
        if launched is not None and not overlap.may_overlap(self, launched):
            outs += self._process(launched)
            self._inflight = None
        if self._inflight is None and not self.scheduler.has_work():
            if self.config.check_at_idle:
                self.check_idle()
        elif batch is None and idle_before and self.isolation.num_failed == failed_before and not self.scheduler.held:
            raise RuntimeError(f"scheduler stalled with work queued: waiting={self.scheduler.waiting} "
                               f"running={self.scheduler.running}")
        return self.samples.merge(outs)

    def _process(self, launched: Launched) -> list[RequestOutput]:
        """Read back `launched`'s tokens and apply them -> outputs of the requests that finished."""
        if isinstance(launched, SpecLaunched):
            return apply_verify(self, launched)
        try:
            tokens = np.asarray(launched.tokens).tolist()  # waits for that step only
            lp = None if launched.logprobs is None else [np.asarray(x) for x in launched.logprobs]
            scores = None if launched.prompt_logprobs is None else [np.asarray(x) for x in launched.prompt_logprobs]
        except Exception as e:
            raise EngineDeadError(f"a step's tokens could not be read back (a device error): {e!r}") from e
        outs = []
        now = time.time()
        for i, row in enumerate(launched.batch.rows):
            if scores is not None and row.req.prompt_lp is not None:  # its chunk scored (core/prompt_logprobs.py)
                row.req.prompt_lp.add(scores, i, row.start, row.end)
            if not row.sample:
                continue
            req = row.req
            req.read_pending()
            if req.finished:  # stopped a step ago; this row was a wasted overlap row
                continue
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            try:
                if req.logprobs is not None:
                    req.add_logprobs(lp, i)
                self._append(req, tokens[i])
                if req.finished:
                    req.metrics.finished_time = now
                    outs.append(req.output())
                    self._requests.pop(req.request_id, None)
            except Exception as e:  # noqa: BLE001 - this request's failure, not the step's
                self.isolation.fail(req, e, "applying its token")
        return outs

    def _append(self, req: Request, t: int) -> None:
        """Append a sampled token and apply the stop rules (vLLM's order: stop tokens, then stop
        strings, then length)."""
        req.output_token_ids.append(t)
        p = req.params
        n = len(req.output_token_ids)
        if n >= req.min_tokens:  # before min_tokens no stop rule applies (stop ids were banned too)
            if (t in self.eos_ids and not p.ignore_eos) or t in p.stop_token_ids:
                req.text_tokens = n if p.include_stop_str_in_output else req.text_tokens  # vLLM: its text stays
                return self._finish(req, RequestStatus.FINISHED_STOPPED, t if t in p.stop_token_ids else None)
        req.text_tokens = n  # the text covers this token (not a stop token: see above)
        if p.stop and req.detok is not None:  # stop strings need the text now; else it is made when read
            new = req.sync_text()
            if new and n >= req.min_tokens:
                hit = find_stop(req.text, len(new), p.stop)
                if hit is not None:
                    req.text = req.text[: hit[0] + (len(hit[1]) if p.include_stop_str_in_output else 0)]
                    return self._finish(req, RequestStatus.FINISHED_STOPPED, hit[1])
        if n >= req.max_tokens or req.prompt_len + n >= self.max_model_len:
            self._finish(req, RequestStatus.FINISHED_LENGTH, None)

    def _finish(self, req: Request, status: RequestStatus, stop_reason) -> None:
        if not self.handoff.finish(req, status):  # a prefill kept for its page transfer: held
            self.scheduler.finish(req, status)
        req.mark_finished(status, stop_reason)

    # ------------------------------------------------------------------ compilation
    def reachable_shapes(self) -> list[tuple[int, int, int, int]]:
        """Every (B, T, P, checkpoint columns) step shape the scheduler can launch, decode first."""
        cfg = self.config
        return self.buckets.reachable(cfg.max_num_batched_tokens, cfg.page_size, self.scheduler.cfg.max_num_seqs,
                                      self.runner.checkpoints_per_row)

    def warmup(self, max_shapes: int | None = None, threads: int | None = None, sampling=("greedy",)) -> int:
        """Compile step shapes before serving -> how many compilations: the first `max_shapes`
        (None: all reachable) in start order (warmup.py: decode first on a GPU, a short prompt's
        shapes first on a CPU), each in every sampler mode of `sampling` ("greedy", "random",
        "cuts": the last covers any request, the first is the fastest), reported to the start-up
        progress.  Shapes left out compile on first use (`num_compilations` counts launched ones)."""
        t0 = time.perf_counter()
        n = warm_up(self, max_shapes, threads, sampling)
        log.info("umem_jax: %d step shapes compiled in %.1f s", n, time.perf_counter() - t0)
        return n

    # ------------------------------------------------------------------ checks and numbers
    def check_idle(self) -> None:
        """Allocator invariants + no leaks: at idle every page and slot is free or held by the
        prefix cache, and refcounts (pages, window pages) match what the holders hold.  Raises."""
        self.allocator.check_invariants()
        pages, slots = self.scheduler.held_ids()
        leaks = self.allocator.leaks(token_pages=pages, state_slots=slots)
        if leaks:
            raise AssertionError(f"arena leaks at idle: { {k: v[:16].tolist() for k, v in leaks.items()} }")
        bad = self.scheduler.check_refs()
        if bad:
            raise AssertionError("page refcounts wrong at idle:\n  " + "\n  ".join(bad))
        cache = self.scheduler.cache
        held = {k: v.held for k, v in self.allocator.usage().subpools.items()}
        want = cache.held_by_subpool() if cache is not None else {}
        if not self.scheduler.held and any(held[k] != want.get(k, 0) for k in held):  # held: not the cache's
            raise AssertionError(f"arena holds {held} at idle, the prefix cache {want}")
        self.allocator.flush()  # compact while idle (moves apply before the next step)
        self.num_idle_checks += 1

    def reset_prefix_cache(self) -> bool:
        """Evict every cache entry no request holds -> whether the cache is now empty (vLLM's)."""
        cache = self.scheduler.cache
        return True if cache is None else cache.clear()

    def evictable_bytes(self) -> int:
        """Bytes of live pages (slots) only the prefix cache holds: eviction frees them on demand,
        so they are live but not held by requests (usage figures leave them out)."""
        cache = self.scheduler.cache
        if cache is None:
            return 0
        return sum(n * self.plan[k].page_bytes for k, n in cache.evictable_by_subpool().items())

    def stats(self) -> dict:
        """The engine's numbers: memory, queues, steps, compilations, moves, cache (stats.py)."""
        return engine_stats(self)

    def bands(self) -> dict[str, dict]:
        """Each band in its own pages and bytes: held by requests, by the cache (evictable),
        available to it alone (bands.py)."""
        cache = self.scheduler.cache
        return band_usage(self.allocator, cache.evictable_by_subpool() if cache is not None else {})


__all__ = ["BUDGET_MESSAGE", "MAX_TOKENS_MESSAGE", "EngineConfig", "EngineDeadError", "LLMEngine"]
