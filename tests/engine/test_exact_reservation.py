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


def test_shared_pages_are_not_given_back_twice():
    """Two decoders sharing a prefix through the cache (as siblings of n samples do): the one
    finishing first gives back only what the other does not hold."""
    sch = scheduler(1 << 20, enable_prefix_caching=True)
    a = request(sch, 0, 12, 5, **FIXED)
    sch.schedule()
    a.output_token_ids.append(7)
    b = request(sch, 1, 12, 20, **FIXED)
    b.prompt_token_ids = list(a.prompt_token_ids)
    sch.schedule()  # hands a's pages to the cache, admits b on them
    b.output_token_ids.append(7)
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
