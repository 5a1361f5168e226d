"""Exact reservation for fixed-length requests (scheduler/reservations.py): a request that only
its length ends (ignore_eos, no stop) reserves what it will take, so under memory pressure the
fixed-length requests finish without retraction where the ratio rule retracted them; where the
rule is not valid (speculation, a decode batch smaller than max_num_seqs) or the request may stop
early (stop strings, stop token ids, EOS), the ratio rule stays.

The scheduler runs on the host (real allocator and demand model); the engine case uses the shapes
of test_engine_memory.py (same arena, buckets and prompts), so nothing new compiles.
"""

from __future__ import annotations

import pytest
from _engine_utils import assert_idle_clean, dense_greedy, llm, prompts
from _scheduler_drive import emit, finish

from umem_jax import SamplingParams
from umem_jax.core.request import Request
from umem_jax.core.scheduled_batch import Buckets
from umem_jax.memory import ChainAllocator, size_arena
from umem_jax.memory import plan as make_plan
from umem_jax.memory.demand import Demand, DemandModel
from umem_jax.models.tiny import TinyHybrid, tiny_config
from umem_jax.scheduler import reservations
from umem_jax.scheduler.scheduler import Scheduler, SchedulerConfig

PS, CHUNK = 4, 32
FIXED = dict(ignore_eos=True)
BUCKETS = Buckets((1, 2, 4), (8, 16, 32), (64, 256))
LONG = prompts(5, 17, 40, 70, seed=4)  # test_engine_memory's


def scheduler(budget=150 << 10, *, exact=True, max_num_seqs=4, buckets=BUCKETS, spec=0, **kw) -> Scheduler:
    p = make_plan(TinyHybrid.decls(tiny_config(), "float32"), page_size=PS)
    rows = size_arena(p, budget).num_rows
    dm = DemandModel(p, chunk=CHUNK, empty=ChainAllocator(p, rows), decode_pass=1 + spec)
    cfg = SchedulerConfig(max_num_seqs, CHUNK, buckets, new_token_ratio=0.0, num_speculative_tokens=spec,
                          exact_fixed_length_reservation=exact, **kw)
    return Scheduler(cfg, ChainAllocator(p, rows), dm)


def request(sch: Scheduler, i: int, L: int, M: int, **params) -> Request:
    r = Request(str(i), None, [3 + (i * 7 + k) % 250 for k in range(L)], SamplingParams(max_tokens=M, **params),
                arrival=i, seed=0, max_tokens=sch.demand.clip(L, M), windows=tuple(n for n, _ in sch.demand.windows))
    r.stop_ids = [] if params.get("ignore_eos") else [1]  # the engine's: EOS unless ignore_eos, + stop_token_ids
    r.stop_ids += list(params.get("stop_token_ids", ()))
    sch.add(r)
    return r


def run(sch: Scheduler, reqs: list[Request], lag: int = 1) -> list:
    """Drive `sch` to the end as the engine does (lag 1: a request's last token is read, and the
    request finished, after the next step is scheduled) -> the steps' (kind, rows)."""
    steps, done = [], []
    while sch.has_work() or done:
        b = sch.schedule()
        finish(sch, done)
        if b is None:
            continue
        steps.append((b.kind, [(row.req.request_id, row.start, row.end) for row in b.rows]))
        emit(b, done)
        if not lag:
            finish(sch, done)
        sch.allocator.check_invariants()
        sch.allocator.take_moves()
    assert all(r.num_output == r.max_tokens for r in reqs)
    if sch.cache is not None:
        sch.cache.clear()  # what finished requests left cached: nothing else holds memory at the end
    assert not sch.allocator.leaks() and not sch.owner.held().size
    return steps


@pytest.mark.parametrize("lag", [0, 1])
@pytest.mark.parametrize("lengths", [(5, 17, 40, 70), (70, 3, 33, 12, 50, 9)])
def test_fixed_lengths_finish_without_retraction_where_the_ratio_retracted(lengths, lag):
    """new_token_ratio 0: the ratio rule reserves no outputs, so decode outgrows the arena and
    retracts; the exact rule reserves every fixed-length request's whole rest and never does."""
    ratio = scheduler(exact=False)
    run(ratio, [request(ratio, i, L, 50, **FIXED) for i, L in enumerate(lengths)], lag)
    assert ratio.num_retractions > 0
    exact = scheduler()
    assert exact.exact
    reqs = [request(exact, i, L, 50, **FIXED) for i, L in enumerate(lengths)]
    run(exact, reqs, lag)
    assert exact.num_retractions == 0 and all(r.metrics.num_retractions == 0 for r in reqs)


@pytest.mark.parametrize("params", [dict(ignore_eos=True, stop=["x"]), dict(ignore_eos=True, stop_token_ids=[999]),
                                    dict(ignore_eos=False)], ids=["stop", "stop_token_ids", "eos"])
def test_requests_that_may_stop_keep_the_ratio(params):
    """A request that may stop early keeps the ratio rule: the same steps, the same retractions
    as with the exact rule off (the run never stops them early: only the reservation differs)."""
    out = []
    for exact in (True, False):
        sch = scheduler(exact=exact)
        reqs = [request(sch, i, L, 50, **params) for i, L in enumerate((5, 17, 40, 70))]
        assert not any(reservations.fixed_length(r) for r in reqs)
        out.append((run(sch, reqs), sch.num_retractions))
    assert out[0] == out[1] and out[0][1] > 0


def test_a_batch_bucket_below_max_num_seqs_keeps_the_ratio():
    """Decode batches of at most 2 with 4 running: not every decoder steps every step, so who
    finishes when is not decode_peak's order; the ratio rule stays (the same steps as off)."""
    out = []
    for exact in (True, False):
        sch = scheduler(exact=exact, buckets=Buckets((1, 2), (8, 16, 32), (64, 256)))
        assert not sch.exact
        reqs = [request(sch, i, L, 50, **FIXED) for i, L in enumerate((5, 17, 40, 70))]
        out.append((run(sch, reqs), sch.num_retractions))
    assert out[0] == out[1]


def test_speculation_keeps_the_ratio():
    """A verify keeps 1..k+1 tokens: decode_peak's one token per step does not hold, so a
    fixed-length decoder reserves by the ratio, alone and among the running requests."""
    assert reservations.exact_applies(scheduler().cfg) and not reservations.exact_applies(scheduler(spec=2).cfg)
    for spec in (0, 2):
        sch = scheduler(1 << 20, spec=spec)
        reqs = [request(sch, i, L, 40, **FIXED) for i, L in enumerate((5, 9))]
        sch.schedule()  # one prefill admits both
        for r in reqs:
            r.output_token_ids.append(7)
        assert all(r.decode_ready for r in reqs)
        sch.ratio, sch._reserved = 0.5, None
        ratio = sum((sch.demand.reservation(r, 20) for r in reqs), Demand())  # ceil(0.5 * 39 left) each
        assert (sch._reservations() == ratio) == bool(spec)
        assert (sch._reserve_tokens(reqs[0]) == 20) == bool(spec)


def test_exact_reservation_is_the_rest_of_the_life():
    """At admission a fixed-length request reserves every token it will still compute (ratio 1):
    the rest of its prompt and every output but the last; decoding, what it has left."""
    sch = scheduler(1 << 20)
    r = request(sch, 0, 40, 10, **FIXED)
    assert sch._reserve_tokens(r, after=32) == 40 - 32 + 10 - 1
    sch.schedule()
    sch.schedule()  # the prompt's second chunk, which samples the first output
    r.output_token_ids.append(7)
    assert r.decode_ready and sch._reserve_tokens(r) == 9 == r.max_tokens - r.num_output


def _two_on_one_prompt(L: int, Ma: int, Mb: int) -> tuple[Scheduler, Request, Request]:
    """Fixed-length a (L tokens, Ma outputs) decoding, then b on the same prompt admitted on its
    cached pages (Mb outputs); both have sampled their first token."""
    sch = scheduler(1 << 20, enable_prefix_caching=True)
    a = request(sch, 0, L, Ma, **FIXED)
    sch.schedule()
    a.output_token_ids.append(7)
    b = request(sch, 1, L, Mb, **FIXED)
    b.prompt_token_ids = list(a.prompt_token_ids)
    sch.schedule()  # hands a's pages to the cache, admits b on them
    b.output_token_ids.append(7)
    return sch, a, b


def test_shared_pages_are_not_given_back_twice():
    """Two decoders sharing a prefix through the cache (as siblings of n samples do): the one
    finishing first gives back only what the other does not hold."""
    sch, a, b = _two_on_one_prompt(12, 5, 20)
    shared = set(a.pages) & set(b.pages)
    assert a.decode_ready and b.decode_ready and len(shared) == 2  # (12 - 1) // 4 pages resumed
    back = reservations.gives_back([a, b], [a, b], sch.demand)
    assert back[0].token_pages == len(a.pages) - 2 and back[1].token_pages == len(b.pages) - 2
    assert reservations.gives_back([a], [a], sch.demand) == [sch.demand.held(a)]  # alone: all it holds
    # the decoders' reservation counts what the first to finish frees for the other only once
    sch._reserved = None
    want = sch.demand.decode_peak([a, b], [4, 19], back, lag=1)
    assert sch._reservations() == want
    # b's 19 tokens from 12 take 5 pages; a gives back its 1 own page (not the 3 it holds) after 5 steps
    assert want.token_pages == 5 - 1 > sch.demand.decode_peak([a, b], [4, 19], lag=1).token_pages


def test_engine_fixed_lengths_finish_without_retraction_and_unchanged():
    """Through the engine (async scheduling), the case test_engine_memory retracts with the ratio
    rule (new_token_ratio 0): with the exact rule no retraction, the same greedy tokens."""
    tight = llm(new_token_ratio=0.0)
    outs = tight.generate(LONG, SamplingParams(temperature=0, max_tokens=70, ignore_eos=True))
    assert tight.llm_engine.scheduler.exact and tight.llm_engine.scheduler.num_retractions == 0
    assert all(o.metrics.num_retractions == 0 for o in outs)
    assert [o.outputs[0].token_ids for o in outs] == dense_greedy(LONG, 70)
    assert_idle_clean(tight)


def _siblings(budget: int, n: int = 4, L: int = 30, M: int = 40) -> tuple[Scheduler, list[Request]]:
    """n fixed-length requests on one prompt, the others queued once the first has computed it
    (as the engine queues n samples' siblings): they resume from its cached pages, so each
    holds the same last window pages of the prompt when it starts to decode."""
    sch = scheduler(budget, enable_prefix_caching=True)
    first = request(sch, 0, L, M, **FIXED)
    reqs, done = [first], []
    while sch.has_work() or done:
        b = sch.schedule()
        finish(sch, done)
        if b is None:
            continue
        emit(b, done)
        if first.decode_ready and len(reqs) < n:
            for i in range(1, n):
                reqs.append(request(sch, i, L, M, **FIXED))
                reqs[-1].prompt_token_ids = list(first.prompt_token_ids)
        sch.allocator.check_invariants()
        sch.allocator.take_moves()
    assert all(r.num_output == r.max_tokens == M for r in reqs)
    return sch, reqs


@pytest.mark.parametrize("budget", [112 << 10, 120 << 10])
def test_decoders_sharing_window_pages_finish_without_retraction(budget, monkeypatch):
    """Siblings decoding on a shared prompt hold its last window pages together, and passing one
    frees nothing until all have.  Priced as given back by each (the rule before), the joint
    peak came short and a sibling was retracted near its end; priced as not held, each shared
    page back when its last holder passes it (reservations.shared_window, shared_window_frees),
    none is."""
    sch, reqs = _siblings(budget)
    assert sch.num_retractions == 0
    assert sch.cache is not None and sch.cache.stats()["hit_tokens"] >= 3 * 28  # they did share the prompt
    # the rule before, on the same trace: the shared pages counted as each one's own
    monkeypatch.setattr(reservations, "shared_window", lambda req, *a, **k: {n: 0 for n in req.window_start})
    monkeypatch.setattr(reservations, "shared_window_frees", lambda *a, **k: {})
    before, _ = _siblings(budget)
    assert before.num_retractions >= 1


def test_shared_window_pages_come_back_when_the_last_holder_passes_them():
    """Two decoders holding the same 4 window pages (one prompt): each prices its window growth
    from the one page it holds alone, and the 4 come back once both have passed them, so the
    joint peak is 4 + 4 - 4, not the 0 + 0 of counting each shared page as its own."""
    sch, a, b = _two_on_one_prompt(30, 40, 40)
    (name, w), dm = sch.demand.windows[0], sch.demand
    assert a.decode_ready and b.decode_ready
    counts = reservations.window_holders([a, b], dm)
    shared = [reservations.shared_window(r, counts, dm) for r in (a, b)]
    assert shared == [{name: 4}, {name: 4}]  # pages 3..6: the prompt's tail both attend
    left = [a.max_tokens - a.num_output, b.max_tokens - b.num_output]
    frees = reservations.shared_window_frees([a, b], left, [a, b], dm, lag=1)[name]
    # page j comes back once the one behind has passed it too: c + t - w + 1 >= (j + 1) * PS
    behind = min(a.num_computed, b.num_computed)
    assert sorted(frees.tolist()) == [(j + 1) * PS + w - 1 - behind for j in (3, 4, 5, 6)]
    joint = dm.decode_peak([a, b], left, lag=1, shared_window=shared, shared_frees={name: frees})
    alone = dm.decode_peak([a], left[:1], lag=1, shared_window=shared[:1]).window_pages[name]
    assert alone == 4 and joint.window_pages[name] == 4 + 4 - 4
    assert dm.decode_peak([a, b], left, lag=1).window_pages[name] == 0  # the rule before


@pytest.mark.parametrize("lag,cache", [(0, False), (1, False), (1, True)])
def test_a_short_request_joins_the_decoders_peak(lag, cache):
    """Two fixed-length requests with 120 outputs to come, then one with 8: admitted against the
    decoders' joint peak it starts in the second step (it finishes long before their growth
    peaks, and what it gives back pays for that growth), where its own peak added to theirs made
    it wait for them to finish; no retraction either way, and at a tighter arena the whole run
    takes fewer steps.  With the prefix cache on (the engine's default) too: there a lookup that
    finds nothing is a Hit with nothing to resume, and the joint pricing took only `None` for a
    miss, so it never applied (sessions 23-33)."""
    def steps_of(budget, joint):
        sch = scheduler(budget << 10, joint_admission=joint, enable_prefix_caching=cache)
        reqs = [request(sch, 0, 30, 120, **FIXED), request(sch, 1, 30, 120, **FIXED), request(sch, 2, 30, 8, **FIXED)]
        steps = run(sch, reqs, lag)
        assert sch.num_retractions == 0
        return [i for i, (_, rows) in enumerate(steps) if any(row[0] == "2" for row in rows)][0], len(steps)

    (start, _), (start_before, _) = steps_of(170, True), steps_of(170, False)
    assert start <= 2 < 100 < start_before
    (_, total), (_, total_before) = steps_of(130, True), steps_of(130, False)
    assert total < total_before
