"""The engine soak: random workloads under memory pressure, each checked against the promise
that an admitted request finishes (issue 21).

A workload is a few requests arriving at random steps on one engine: prompts from a few tokens
to the memory clip's limit and past it, shared prefixes and exact repeats of earlier prompts
(cache hits, also across workloads: an engine keeps its cache for several), priorities (so
preemption), aborts in the middle of a prefill or a decode, sampling mixed with greedy, stop
token ids and stop strings, max_tokens over what the arena holds (clipped at arrival) and
scheduler knobs that force retraction (new_token_ratio 0).  After every workload (`check`):

  * every request ended exactly once: finished with its whole output (max_tokens as clipped,
    or a stop rule), refused at arrival with BUDGET_MESSAGE (only when even one token does not
    fit), or aborted by us (its tokens then a prefix of what it would have produced);
  * a clip at arrival (max_tokens unset: as many as fit) was reported (the engine's log line), never a
    silent short output; a max_tokens asked for over what fits was refused naming how many do;
  * a greedy request produced exactly what the same request produces alone in a large arena
    (`Family.reference`, one request at a time, memoised; without speculative decoding);
  * at idle the engine's leak / refcount / byte-conservation checks ran and passed, and the
    arena holds nothing but the prefix cache.

Engines of one (model, arena, page size) share their compiled step, so a family makes its
engines with random scheduler knobs at no compile cost (the knobs change no shape).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np

from umem_jax import LLM, SamplingParams
from umem_jax.core.request import RequestStatus
from umem_jax.engine.engine import BUDGET_MESSAGE
from umem_jax.engine.fit import ARENA_MAX_TOKENS_MESSAGE

BUCKETS = dict(max_num_seqs=4, batch_buckets=(4,), token_buckets=(32,))
MAX_PROMPT = 160  # longest prompt drawn (CPU time), below the clip limit of the roomy arenas


class SoakFailure(AssertionError):
    """A broken promise, with the seed that reproduces it."""


@dataclasses.dataclass
class Family:
    """One model and its two arena shapes.  small: the pressured arena; big: the roomy one (a
    workload may run there too; the references always run in an instance of their own)."""

    name: str
    model: Callable[[], object]
    small: dict  # LLM keyword arguments (arena_bytes, page_size, max_model_len, page_buckets, ...)
    big: dict
    sampling: tuple[str, ...] = ("small",)  # arenas that mix sampled requests in (each compiles the "random" mode)
    caching_off: bool = False  # some engines without the prefix cache (its step shape has no checkpoint columns)
    _ref: object = None
    _memo: dict = dataclasses.field(default_factory=dict)

    def engine(self, arena: str, rng: np.random.Generator) -> LLM:
        knobs = dict(new_token_ratio=float(rng.choice([0.0, 0.1, 0.5])),
                     max_prefill_streak=int(rng.choice([1, 4])),
                     enable_prefix_caching=not (self.caching_off and rng.random() < 0.15),
                     max_num_batched_tokens=int(rng.choice([16, 32, 32])))
        return LLM(self.model(), **BUCKETS, **(self.small if arena == "small" else self.big), **knobs)

    def reference(self, prompt: list[int], sp: SamplingParams):
        """What `prompt` with `sp` (greedy) gives alone in the big arena, without speculative
        decoding (a family that speculates is checked against the plain greedy tokens, and its
        reference engine compiles the plain step, not the draft's and the verify's) -> (token
        ids, finish reason, error)."""
        key = (tuple(prompt), sp.max_tokens, tuple(sp.stop or ()), tuple(sp.stop_token_ids or ()), sp.min_tokens)
        if key not in self._memo:
            if self._ref is None:
                plain = {k: v for k, v in self.big.items() if k != "speculative_config"}
                self._ref = LLM(self.model(), **BUCKETS, **plain, max_num_batched_tokens=32)
            out = self._ref.generate(prompt, sp)[0]
            self._memo[key] = (out.outputs[0].token_ids, out.outputs[0].finish_reason, out.error)
        return self._memo[key]


@dataclasses.dataclass
class Spec:
    prompt: list[int]
    params: SamplingParams
    priority: int = 0
    arrive: int = 0  # engine steps after the workload's start
    abort: str | None = None  # "prefill" | "decode": abort it there (if it gets there)
    rid: str | None = None


class ClipLog(logging.Handler):
    """Collects the request ids the engine reported clipping (engine.enqueue's log line)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.ids: set[str] = set()

    def emit(self, record):
        if "clipped to" in record.getMessage() and record.args:
            self.ids.add(str(record.args[0]))


# ------------------------------------------------------------------ workloads
def clip_limit(llm_obj) -> int:
    """The longest prompt the empty arena takes (one new token)."""
    e = llm_obj.llm_engine
    lo, hi = 1, e.max_model_len - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if e.demand.clip(mid, 1) is not None else (lo, mid - 1)
    return lo


def workload(rng: np.random.Generator, llm_obj, pool: list[list[int]], sampling: bool, most: int = 6) -> list[Spec]:
    """A random workload of 1..`most` requests for the engine `llm_obj`; `pool` holds earlier
    prompts (repeats and shared prefixes draw from it; new prompts join it)."""
    e = llm_obj.llm_engine
    mml, vocab, ps = e.max_model_len, e.model.config.vocab_size, e.config.page_size
    limit = clip_limit(llm_obj)
    if limit > MAX_PROMPT:  # a roomy arena: its pressure is concurrency, not one long prompt
        limit, mml = MAX_PROMPT, MAX_PROMPT + 2
    specs = []
    for i in range(int(rng.integers(1, most + 1))):
        kind = rng.choice(["short", "medium", "near", "over", "repeat", "prefix"], p=[.2, .2, .25, .05, .15, .15])
        if (kind in ("repeat", "prefix") and not pool) or (kind == "over" and limit + 1 >= mml - 1):
            kind = "near"
        if kind == "repeat":
            prompt = list(pool[int(rng.integers(len(pool)))])
        elif kind == "prefix":
            base = pool[int(rng.integers(len(pool)))]
            cut = int(rng.integers(1, len(base) + 1))
            prompt = base[:cut] + rng.integers(3, vocab, int(rng.integers(1, max(2, limit - cut)))).tolist()
        else:
            lo, hi = {"short": (1, 3 * ps), "medium": (3 * ps, max(3 * ps, limit // 2)),
                      "near": (max(1, int(0.7 * limit)), limit), "over": (limit + 1, min(mml - 1, limit + 3 * ps))}[kind]
            prompt = rng.integers(3, vocab, int(rng.integers(lo, hi + 1))).tolist()
        prompt = prompt[: mml - 1]
        pool.append(prompt)
        specs.append(Spec(prompt, _params(rng, e, prompt, sampling, most), priority=int(rng.choice([0, 0, 1, -1])),
                          arrive=int(rng.integers(0, 6)) if i else 0,
                          abort=rng.choice([None] * 12 + ["prefill", "decode"])))
    return specs


def _params(rng, e, prompt, sampling: bool, most: int) -> SamplingParams:
    room = e.max_model_len - len(prompt)
    cheap = most <= 4  # CI: shorter outputs
    want = int(rng.choice([1, 2, 5, 9, 17, 10_000] if cheap else [1, 2, 5, 9, 17, 24, 10_000]))
    clipped = e.demand.clip(len(prompt), room)
    if want == 10_000 and clipped is not None and clipped > (24 if cheap else 48):
        want = 17 if cheap else 33  # "as much as fits" only where that is cheap
    # "as much as fits": max_tokens unset (clipped to what fits, reported in the log) or the room
    # max_model_len leaves, asked for (refused at arrival where the arena holds fewer)
    asked = None if want == 10_000 and len(prompt) % 2 else min(want, room)
    kw = dict(max_tokens=asked, ignore_eos=True, temperature=0.0)
    if sampling and rng.random() < 0.3:
        kw.update(temperature=float(rng.choice([0.7, 1.0])), seed=int(rng.integers(1 << 30)))
    r = rng.random()
    if r < 0.1:
        kw.update(stop_token_ids=rng.integers(3, e.model.config.vocab_size, 3).tolist(),
                  min_tokens=min(asked or room, int(rng.integers(0, 3))))
    elif r < 0.2 and e.tokenizer is not None:
        kw.update(stop=[e.tokenizer.decode(rng.integers(35, 130, 1).tolist())])  # one printable byte (tiny models)
    return SamplingParams(**kw)


# ------------------------------------------------------------------ driving and checking
def drive(llm_obj, specs: list[Spec], seed) -> dict:
    """Run `specs` on the engine (arrivals and aborts as specified) -> {rid: RequestOutput}."""
    e = llm_obj.llm_engine
    outs, step, pending = {}, 0, sorted(specs, key=lambda s: s.arrive)
    work = sum(len(s.prompt) + (s.params.max_tokens or e.max_model_len - len(s.prompt)) for s in specs)
    bound = 200 + 8 * work  # retraction recomputes, but never forever
    while pending or e.has_unfinished_requests():
        while pending and pending[0].arrive <= step:
            s = pending.pop(0)
            s.rid = e.add_request(s.prompt, s.params, priority=s.priority)
        for s in specs:
            req = e._requests.get(s.rid) if s.rid is not None and s.abort else None
            if req is not None and not req.finished and req.status == RequestStatus.RUNNING and (
                    (s.abort == "prefill" and 0 < req.num_computed < req.prompt_len)
                    or (s.abort == "decode" and req.num_output >= 1)):
                e.abort_request(s.rid)
        try:
            for o in e.step():
                if o.request_id in outs:
                    raise SoakFailure(f"seed {seed}: request {o.request_id} finished twice")
                outs[o.request_id] = o
        except RuntimeError as err:
            raise SoakFailure(f"seed {seed}: {err}") from err
        step += 1
        if step > bound:
            raise SoakFailure(f"seed {seed}: no end after {step} steps: {e.scheduler.running} {e.scheduler.waiting}")
    return outs


def check(family: Family, llm_obj, specs: list[Spec], outs: dict, clips: ClipLog, seed, idle_checks: int) -> None:
    e = llm_obj.llm_engine
    fail = lambda msg: SoakFailure(f"seed {seed} ({family.name}): {msg}")
    for s in specs:
        o = outs.get(s.rid)
        if o is None:
            raise fail(f"request {s.rid} (prompt {len(s.prompt)}) never ended")
        comp, n = o.outputs[0], len(s.prompt)
        asked = s.params.max_tokens
        most_tokens = asked if asked is not None else e.max_model_len - n
        clipped = e.demand.clip(n, most_tokens)
        if clipped is None:
            if comp.finish_reason != "abort" or o.error != BUDGET_MESSAGE.format(n) or comp.token_ids:
                raise fail(f"prompt {n} over the budget not refused as documented: {comp.finish_reason} {o.error}")
            continue
        if o.error == BUDGET_MESSAGE.format(n):
            raise fail(f"prompt {n} refused though {clipped} tokens fit")
        if clipped < most_tokens and asked is not None:  # asked for more than fit: refused, naming how many do
            if (comp.finish_reason, comp.token_ids) != ("abort", []) or \
                    o.error != ARENA_MAX_TOKENS_MESSAGE.format(asked, n, clipped, e.max_model_len):
                raise fail(f"request {s.rid}: max_tokens {asked} over the {clipped} that fit not refused: "
                           f"{comp.finish_reason} {o.error}")
            continue
        if clipped < most_tokens and s.rid not in clips.ids:
            raise fail(f"request {s.rid}: max_tokens unset, clipped to {clipped} silently")
        greedy = s.params.temperature == 0
        want = family.reference(s.prompt, dataclasses.replace(s.params, max_tokens=clipped, min_tokens=min(s.params.min_tokens, clipped))) if greedy else None
        got = comp.token_ids
        if comp.finish_reason == "abort":
            if o.error != "aborted by the user" or not s.abort:
                raise fail(f"request {s.rid} aborted by the engine: {o.error}")
            if greedy and got != want[0][:len(got)]:
                raise fail(f"aborted request {s.rid}: {got} is no prefix of {want[0]}")
            continue
        if greedy and (got, comp.finish_reason) != want[:2]:
            raise fail(f"request {s.rid} (prompt {n}, hit {o.num_cached_tokens}): {got} {comp.finish_reason} "
                       f"!= alone {want[0]} {want[1]}")
        if comp.finish_reason == "length" and len(got) != clipped:
            raise fail(f"request {s.rid}: {len(got)} tokens, finish 'length', clipped max_tokens {clipped}")
        if comp.finish_reason == "stop" and not (s.params.stop or s.params.stop_token_ids):
            raise fail(f"request {s.rid} stopped with no stop rule")
    if e.num_idle_checks <= idle_checks:
        raise fail("the idle checks did not run")
    e.check_idle()  # leaks, refcounts, byte conservation (raises)
    st = e.stats()
    if st["held"] != {k: st["prefix_cache"]["held"].get(k, 0) for k in st["held"]}:
        raise fail(f"at idle the arena holds {st['held']} beyond the cache {st['prefix_cache']['held']}")


def soak(families: list[Family], workloads: int, seed: int = 0, per_engine: int = 4, most: int = 6,
         log=None, keep_going: bool = False, indexes=None) -> dict:
    """Workloads 0 .. `workloads` - 1 (or `indexes`) over `families` (round robin: workload w on
    families[w % len]), a fresh engine (random knobs, small or big arena) every `per_engine`
    of a family -> counters.  Raises SoakFailure naming the seed, or with `keep_going` lists
    the failures under "failures" (the engine that failed is replaced).  A failure names the
    workload its engine was made at: `replay` runs that engine's workloads again."""
    handler = ClipLog()
    logger = logging.getLogger("umem_jax")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    counts = dict(workloads=0, requests=0, refused=0, aborted=0, hits=0, retractions=0, preemptions=0, restarts=0,
                  failures=[])
    engines: dict = {}
    try:
        for w in range(workloads) if indexes is None else indexes:
            fam = families[w % len(families)]
            wseed = (seed, w)
            rng = np.random.default_rng(wseed)
            slot = engines.get(fam.name)
            if slot is None or slot[3] >= per_engine:
                arena = "small" if rng.random() < 0.85 else "big"
                slot = engines[fam.name] = [fam.engine(arena, rng), [], arena, 0, w]
            llm_obj, pool = slot[0], slot[1]
            slot[3] += 1
            specs = workload(rng, llm_obj, pool, slot[2] in fam.sampling, most)
            idle = llm_obj.llm_engine.num_idle_checks
            before, restarts = llm_obj.llm_engine.stats(), llm_obj.llm_engine.scheduler.num_restarts
            try:
                outs = drive(llm_obj, specs, wseed)
                check(fam, llm_obj, specs, outs, handler, wseed, idle)
            except Exception as err:  # a soak reports every failure with its seed
                if not keep_going:
                    raise
                counts["failures"].append(f"{wseed} {fam.name} (engine from workload {slot[4]}): "
                                          f"{type(err).__name__}: {str(err)[:300]}")
                del engines[fam.name]
                continue
            after = llm_obj.llm_engine.stats()
            counts["workloads"] += 1
            counts["requests"] += len(specs)
            counts["refused"] += sum(outs[s.rid].error is not None and "budget" in outs[s.rid].error for s in specs)
            counts["aborted"] += sum(outs[s.rid].error == "aborted by the user" for s in specs)
            counts["hits"] += sum(outs[s.rid].num_cached_tokens > 0 for s in specs)
            counts["retractions"] += after["num_retractions"] - before["num_retractions"]
            counts["preemptions"] += after["num_preemptions"] - before["num_preemptions"]
            counts["restarts"] += llm_obj.llm_engine.scheduler.num_restarts - restarts
            if log is not None and (w + 1) % 100 == 0:
                log(f"{w + 1} workloads: { {k: v for k, v in counts.items() if k != 'failures'} } "
                    f"{len(counts['failures'])} failures")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    return counts


def replay(families: list[Family], seed: int, first: int, last: int, most: int = 6) -> dict:
    """Workloads `first` (where the engine was made) .. `last` of one family, as soak ran them."""
    return soak(families, 0, seed=seed, most=most, indexes=range(first, last + 1, len(families)))
