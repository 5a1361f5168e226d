"""A request that the step in flight ends by length gives its memory to the next step
(Scheduler.release_ending): under async scheduling the engine reads step N back only after
scheduling N+1, so without it a finished request's pages stay idle for one more step while the
waiting queue cannot use them (on the GPU, Gemma 3's live share under load was 0.96 where the
host simulation, which finishes at once, gave 0.97).

Engine cases use test_engine.py's arena and buckets (nothing new compiles); the host cases drive
a Scheduler with the real allocator and demand model.
"""

from __future__ import annotations

from _engine_utils import assert_idle_clean, llm, prompts
from _scheduler_drive import TOKEN

from umem_jax import SamplingParams
from umem_jax.core.request import Request, RequestStatus
from umem_jax.core.scheduled_batch import Buckets
from umem_jax.memory import ChainAllocator, size_arena
from umem_jax.memory import plan as make_plan
from umem_jax.memory.demand import DemandModel
from umem_jax.models.tiny import TinyHybrid, tiny_config
from umem_jax.scheduler.scheduler import Scheduler, SchedulerConfig

# Two prompts that do not fit the 150 KiB arena together with their outputs (each one pass long,
# so neither starts early): the second waits for the first's memory.  Priced apart: jointly with
# the first (joint admission) the second fits, as it finishes one step after the first.
PAIR = prompts(30, 30, seed=3)
LONG_OUT = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


def _schedules(e) -> list:
    """Record every schedule: (kind or None, request ids of its rows, ids in `ending` then)."""
    log, schedule = [], e.scheduler.schedule

    def recording():
        batch = schedule()
        rows = [] if batch is None else [r.req.request_id for r in batch.rows]
        log.append((None if batch is None else batch.kind, rows, [r.request_id for r in e.scheduler.ending]))
        return batch

    e.scheduler.schedule = recording
    return log


def _run_pair(release: bool) -> tuple[list, list]:
    x = llm(joint_admission=False)
    e = x.llm_engine
    if not release:
        e.scheduler.release_ending = lambda keep=None: None
    log = _schedules(e)
    ids = [e.add_request(p, LONG_OUT) for p in PAIR]
    outs = {}
    while e.has_unfinished_requests():
        for o in e.step():
            outs[o.request_id] = o.outputs[0].token_ids
    assert_idle_clean(x)
    assert not e.scheduler.ending
    return log, [outs[i] for i in ids]


def test_the_next_step_runs_in_the_memory_of_a_request_the_step_in_flight_ends():
    log, got = _run_pair(release=True)
    kinds = [k for k, _, _ in log]
    a = log[0][1][0]
    start = next(i for i, (k, rows, _) in enumerate(log) if k == "prefill" and a not in rows)
    b = log[start][1][0]
    assert not any(a in rows and b in rows for _, rows, _ in log)  # they never ran together: memory bound
    assert log[start][2] == [a]  # the first was released while its last token was in flight ...
    assert kinds[start - 1] == "decode" and log[start - 1][1] == [a]  # ... launched by the schedule before
    assert None not in kinds[:-1]  # no schedule came back empty while the second waited (the last: all done)
    base_log, want = _run_pair(release=False)
    assert got == want  # same tokens; without the release one schedule finds nothing to run
    assert [k for k, _, _ in base_log].count(None) == 2 and len(base_log) == len(log) + 1


def test_shared_pages_and_samples_come_out_the_same_with_the_release():
    """Prompts sharing a prefix (prefix-cache hits on pages a released request handed over), n
    samples finishing together (siblings' shared pages) and retraction (no output reserved: the
    ratio rule at 0): every token the same with the release as without it (seeded sampling), and
    the arena clean at idle."""
    base = prompts(24, seed=9)[0]
    work = [base + p for p in prompts(6, 14, 3, 9, seed=10)]
    params = [SamplingParams(temperature=0.8, seed=40 + i, max_tokens=40 + 10 * i, ignore_eos=True, n=1 + i % 3)
              for i in range(len(work))]
    runs = []
    for release in (True, False):
        x = llm(new_token_ratio=0.0, exact_fixed_length_reservation=False)
        sch, released = x.llm_engine.scheduler, []
        if release:
            keep_going = sch.release_ending
            sch.release_ending = lambda keep=None: (keep_going(keep), released.extend(sch.ending))
        else:
            sch.release_ending = lambda keep=None: None
        outs = x.generate(work, params)
        runs.append([[c.token_ids for c in o.outputs] for o in outs])
        st = x.llm_engine.stats()
        assert st["prefix_cache_hit_tokens"] > 0 and st["num_retractions"] > 0
        assert len(released) == (7 if release else 0)  # every sample (1 + 2 + 3 + 1) gave its memory early
        assert_idle_clean(x)
    assert runs[0] == runs[1]


def _scheduler(spec: int = 0) -> Scheduler:
    p = make_plan(TinyHybrid.decls(tiny_config(), "float32"), page_size=4)
    rows = size_arena(p, 150 << 10).num_rows
    dm = DemandModel(p, chunk=32, empty=ChainAllocator(p, rows), decode_pass=1 + spec)
    cfg = SchedulerConfig(4, 32, Buckets((1, 2, 4), (8, 16, 32), (64, 256)), num_speculative_tokens=spec)
    return Scheduler(cfg, ChainAllocator(p, rows), dm)


def _to_last_token(sch: Scheduler, lengths=(20, 9), max_tokens=5) -> list[Request]:
    """Admit requests of `lengths` and step them (async: one token pending) until each has its
    last token pending -> the requests."""
    reqs = []
    for i, n in enumerate(lengths):
        r = Request(str(i), None, [3 + (i * 7 + k) % 250 for k in range(n)],
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival=i, seed=0, max_tokens=max_tokens,
                    windows=tuple(n for n, _ in sch.demand.windows))
        sch.add(r)
        reqs.append(r)
    while any(r.wants_step for r in reqs):
        b = sch.schedule()
        for r in reqs:  # the step before is read back: its pending token becomes an output
            if r.num_pending:
                r.read_pending()
                r.output_token_ids.append(TOKEN)
        for i, row in enumerate(b.rows):
            if row.sample:
                row.req.mark_pending(i)
        sch.allocator.take_moves()
    assert all(r.num_pending == 1 for r in reqs)
    return reqs


def _clean(sch: Scheduler) -> None:
    assert not sch.running and not sch.ending and not sch.check_refs()
    if sch.cache is not None:
        sch.cache.clear()
    assert not sch.allocator.leaks()
    sch.allocator.check_invariants()


def test_released_requests_finish_or_fail_without_a_second_free():
    sch = _scheduler()
    done, failed = _to_last_token(sch)
    before = sch.allocator.usage().free_bytes
    sch.release_ending()
    assert sch.ending == [done, failed] and not sch.running and not done.pages and not failed.slots
    assert sch.allocator.usage().free_bytes > before
    done.read_pending()
    sch.finish(done, RequestStatus.FINISHED_LENGTH)
    sch.fail(failed)  # e.g. its stop checks raised on its last token
    assert done.finished and failed.finished
    _clean(sch)


def test_kept_requests_and_speculation_release_nothing():
    sch = _scheduler()
    kept, other = _to_last_token(sch)
    sch.release_ending(keep=lambda r: r is kept)  # a prefill held for its page transfer
    assert sch.running == [kept] and sch.ending == [other] and kept.pages
    for r in (kept, other):
        sch.finish(r, RequestStatus.FINISHED_LENGTH)
    _clean(sch)
    spec = _scheduler(spec=2)
    reqs = _to_last_token(spec)
    spec.release_ending()  # a verify in flight may keep fewer tokens than its drafts: not known ended
    assert spec.running == reqs and not spec.ending
