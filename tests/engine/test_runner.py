"""Runner packing: the vectorised launch (row cache, numpy over all rows) must pack exactly the
metadata the straightforward per-row packing gives, through page growth, rollbacks,
retractions, window tombstones, page moves, params changes and row-cache reuse.  The device
step is replaced by a recorder: nothing compiles here."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from _engine_utils import SamplingBatch, tiny

from umem_jax.core.request import Request
from umem_jax.core.sampling_params import SamplingParams
from umem_jax.core.scheduled_batch import Buckets, Row, ScheduledBatch
from umem_jax.runner.packing import FLOAT_SAMPLING, INT_SAMPLING, RowCache
from umem_jax.runner.sampler import MODES, sampling_mode


def _engine(**kw):
    from umem_jax import LLM

    settings = dict(arena_bytes=400 << 10, max_num_seqs=8, max_num_batched_tokens=32, page_size=4,
                    max_model_len=256, batch_buckets=(2, 4, 8), token_buckets=(16, 32), page_buckets=(8, 16, 64))
    return LLM(tiny(), **{**settings, **kw}).llm_engine


def batch_layout(runner, batch: ScheduledBatch, penalties: bool, sampling: str):
    """The layout of `batch`'s bucketed shape, row by row."""
    bk = runner.buckets
    B = Buckets.pick(bk.batch, len(batch.rows))
    T = 1 if batch.kind == "decode" else Buckets.pick(bk.tokens, max(r.end - r.start for r in batch.rows))
    P = Buckets.pick(bk.pages, max(len(r.req.pages) for r in batch.rows))
    return runner.layout(B, T, P, penalties, runner.checkpoints_per_row if batch.kind == "prefill" else 0, sampling)


def reference_meta(runner, batch: ScheduledBatch) -> tuple[np.ndarray, object]:
    """The straightforward per-row packing the vectorised launch must equal."""
    rows = batch.rows
    penalties = any(r.sample and r.req.params.has_penalties for r in rows)
    need = max((MODES.index(sampling_mode(r.req.params.temperature, max(r.req.params.top_k, 0), r.req.params.top_p,
                                          r.req.params.min_p)) for r in rows if r.sample), default=0)
    lay = batch_layout(runner, batch, penalties, MODES[need])
    for mode in MODES[need + 1:]:  # a covering mode already compiled is reused
        if lay in runner._ready:
            break
        cover = batch_layout(runner, batch, penalties, mode)
        if cover in runner._ready:
            lay = cover
    meta = np.zeros(lay.size, np.int32)
    v = lay.host_views(meta)
    v["src"][:] = -1
    vids = np.full((lay.B, lay.P), -1, np.int32)
    slot_ids = np.full((lay.B,), -1, np.int32)
    K = lay.checkpoints_per_row
    ck_ids = np.full((lay.B, max(1, K)), -1, np.int32)
    if K:
        v["checkpoint_positions"][:] = -1
    v["ban"][:] = -1
    params, seeds, steps = [], [], []
    for i, row in enumerate(rows):
        req = row.req
        n = row.end - row.start
        if req.num_pending and batch.kind == "decode":
            v["src"][i] = req.pending_row
        else:
            v["tokens"][i, :n] = req.token_ids(row.start, row.end)
        v["q_lens"][i], v["kv_lens"][i] = n, row.end
        vids[i, : len(req.pages)] = req.pages
        if req.slots:
            slot_ids[i] = req.slots[0]
        for j, (pos, slot) in enumerate(getattr(row, "checkpoints", ())[:K]):
            v["checkpoint_positions"][i, j], ck_ids[i, j] = pos - row.start, slot
        params.append(req.params)
        seeds.append(req.seed)
        steps.append(req.num_output)
        if row.sample and req.num_output < req.min_tokens:
            ban = req.stop_ids[: runner.banned_per_row]
            v["ban"][i, : len(ban)] = ban
    for p in runner.pools:
        v[f"table:{p}"][:] = runner.allocator.translate_pages(vids, p, lay.P)
    if runner.has_state:
        v["slots"][:] = runner.allocator.translate_slots(slot_ids, lay.B)
    if K:
        v["checkpoint_slots"][:] = runner.allocator.translate_slots(ck_ids.reshape(-1)).reshape(lay.B, K)
    sb = SamplingBatch.build(params, seeds, steps, lay.B)
    for name in INT_SAMPLING + FLOAT_SAMPLING:
        v[name][:] = getattr(sb, name)
    return meta, lay


class Harness:
    """An engine whose runner records each step's inputs instead of running it."""

    def __init__(self, **kw):
        self.eng = _engine(**kw)
        self.runner = self.eng.runner
        self.alloc = self.eng.allocator
        self.calls = []
        max_batch = self.runner.max_batch

        def fake_step(params, arena, meta, prev, counts, *, layout):
            self.calls.append((np.array(meta), layout, counts))
            return jnp.zeros((max_batch,), jnp.int32), arena

        self.runner._step = fake_step
        self.runner._leaves = lambda: self.runner._params  # keep the recorder
        self.n = 0

    def request(self, prompt_len=10, out=0, params=None, pages=0, slots=True) -> Request:
        self.n += 1
        rng = np.random.default_rng(self.n)
        params = params or SamplingParams(temperature=0.0, max_tokens=64)
        req = Request(f"r{self.n}", None, rng.integers(3, 300, prompt_len).tolist(), params, arrival=self.n,
                      seed=1000 + self.n, max_tokens=64, windows=tuple(n for n, _ in self.eng.demand.windows))
        req.stop_ids = [2, 7]
        req.output_token_ids = rng.integers(3, 300, out).tolist()
        if pages:
            self.grow(req, pages)
        if slots and self.runner.has_state:
            req.slots = self.alloc.alloc_state_slots(1).tolist()
        return req

    def free(self, req):
        self.alloc.free_token_pages(req.pages)
        if req.slots:
            self.alloc.free_state_slots(req.slots)
        req.pages, req.slots = [], []

    def grow(self, req, n):
        req.pages += self.alloc.alloc_token_pages(n).tolist()

    def check(self, batch: ScheduledBatch):
        want, lay = reference_meta(self.runner, batch)
        pend = [(r.req.pending_row, r.req.num_pending) for r in batch.rows]
        self.runner.launch(batch)
        got, got_lay, counts = self.calls[-1]
        assert got_lay == lay
        assert got.dtype == np.int32 and got.shape == want.shape
        bad = np.flatnonzero(got != want)
        if bad.size:
            names = {k: v for k, v in lay.offsets.items() if k != "_size"}
            where = sorted({n for i in bad for n, (a, s) in names.items() if a <= i < a + int(np.prod(s))})
            raise AssertionError(f"packed metadata differs in fields {where}")
        assert (counts is not None) == lay.penalties
        for i, (row, (pr, np_)) in enumerate(zip(batch.rows, pend)):  # sampled rows become pending
            assert (row.req.pending_row, row.req.num_pending) == ((i, np_ + 1) if row.sample else (pr, np_))


def decode(reqs, pending=True):
    rows = []
    for r in reqs:
        if not pending:
            r.num_pending = 0
        rows.append(Row(r, r.num_tokens - 1, r.num_tokens, True))
    return ScheduledBatch("decode", rows)


def test_decode_packing_matches_through_page_changes():
    h = Harness()
    mixed = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, max_tokens=64),
             SamplingParams(temperature=0.0, max_tokens=64),
             SamplingParams(temperature=1.3, top_k=-1, seed=3, max_tokens=64, min_tokens=4)]
    reqs = [h.request(prompt_len=9 + i, out=i % 3, params=mixed[i % 3], pages=3 + i % 2) for i in range(6)]
    reqs[2].min_tokens = 4  # still under min_tokens: its stop ids are banned
    h.check(decode(reqs, pending=False))  # every input token from the host
    h.check(decode(reqs))  # every input token pending on the device
    for step in range(12):  # pages grow one at a time, as in decode
        for j, r in enumerate(reqs):
            r.output_token_ids.append(5 + step)
            r.num_pending -= 1
            if (step + j) % 4 == 0:
                h.grow(r, 1)
        h.check(decode(reqs))
    # rollback of an allocation round then a different allocation, at the same length
    r = reqs[1]
    old = r.pages[-2:]
    del r.pages[-2:]
    fresh = h.alloc.alloc_token_pages(2).tolist()
    h.alloc.free_token_pages(old)
    r.pages += fresh
    h.check(decode(reqs))
    # retraction (pages given back, new list), then recomputed with new pages
    h.alloc.free_token_pages(reqs[3].pages)
    reqs[3].pages = []
    h.grow(reqs[3], 5)
    h.check(decode(reqs))
    # params and seed replaced on a live request
    reqs[0].params = SamplingParams(temperature=0.2, top_p=0.5, max_tokens=64)
    reqs[4].seed = 77
    h.check(decode(reqs[::-1]))  # and the rows in another order, a smaller batch bucket
    h.check(decode(reqs[:3]))


def test_translation_follows_tombstones_and_moves():
    h = Harness()
    reqs = [h.request(pages=6) for _ in range(4)]
    h.check(decode(reqs))
    windows = [n for n, _ in h.eng.demand.windows]
    assert windows, "the tiny model has a sliding-window sub-pool"
    h.alloc.release_window_pages(reqs[0].pages[:3], windows[0])  # tombstones read as the sink
    h.check(decode(reqs))
    # free a request in the middle and compact: live pages move, their ids stay
    h.alloc.free_token_pages(reqs[1].pages)
    del reqs[1]
    h.alloc.flush(urgent=True)
    moves = h.alloc.take_moves()
    assert moves, "compaction moved no page; the test needs a move"
    h.check(decode(reqs))


def test_penalties_bans_and_prefill_rows():
    h = Harness()
    pen = SamplingParams(temperature=1.0, repetition_penalty=1.2, frequency_penalty=0.5, max_tokens=64)
    a = h.request(prompt_len=12, out=2, params=pen, pages=4)
    b = h.request(prompt_len=20, pages=5, params=SamplingParams(temperature=0.0, max_tokens=64, min_tokens=3))
    h.check(decode([a, b], pending=False))
    # prefill: a partial chunk (no sample) and a last chunk (samples)
    c = h.request(prompt_len=30, pages=8)
    d = h.request(prompt_len=7, pages=2)
    rows = [Row(c, 0, 16, False), Row(d, 0, 7, True)]
    h.check(ScheduledBatch("prefill", rows))
    h.check(ScheduledBatch("prefill", [Row(c, 16, 30, True)]))


def test_row_cache_reuses_rows_and_grows():
    h = Harness()
    runner = h.runner
    cap = runner._rows.capacity
    live = []
    for wave in range(4):  # 4 waves of fresh requests: old rows are reclaimed, not leaked
        for r in live:
            h.free(r)
        live = [h.request(pages=2 + wave) for _ in range(runner.max_batch)]
        h.check(decode(live))
    assert runner._rows.capacity == cap
    assert len(runner._rows.entries) <= cap
    c = RowCache(width=4, capacity=1)  # a batch larger than the cache grows it

    class _R:
        def __init__(self, req):
            self.req = req

    reqs = [h.request(pages=0) for _ in range(3)]
    rows = [_R(r) for r in reqs]
    got = [c.entry(r, rows).row for r in reqs]
    assert sorted(got) == [0, 1, 2] and c.capacity >= 3
    with pytest.raises(ValueError):
        c.set_pages(c.entries[id(reqs[0])], list(range(1, 6)))  # wider than the largest bucket


def test_layout_fields_start_256_byte_aligned():
    """Kernels get views of the packed metadata (the page tables, q/kv lengths, slots): each of
    those starts on a 256-byte boundary of the buffer; the sampling fields stay one block."""
    from umem_jax.runner.packing import FIELD_ALIGN, SAMPLING_FIELDS, Layout

    for B, T, P, K in [(1, 1, 3, 0), (5, 17, 7, 2), (64, 1, 129, 0)]:
        lay = Layout(B, T, P, ("full", "sliding_4096"), 64, 3, True, K)
        offs = {n: at for n, (at, _) in lay.offsets.items() if n != "_size"}
        for name, at in offs.items():
            if name not in SAMPLING_FIELDS[1:]:
                assert at % FIELD_ALIGN == 0 and FIELD_ALIGN * 4 == 256, (name, at)
        a = offs[SAMPLING_FIELDS[0]]
        assert [offs[f] for f in SAMPLING_FIELDS] == [a + j * B for j in range(len(SAMPLING_FIELDS))]
        ends = sorted((at, at + int(np.prod(shape))) for n, (at, shape) in lay.offsets.items() if n != "_size")
        assert all(e <= s for (_, e), (s, _) in zip(ends, ends[1:]))  # no overlap
        assert lay.size >= ends[-1][1]


def test_sampler_mode_is_the_least_the_rows_need_and_a_compiled_cover_is_reused():
    """The step's sampler variant is static (no lax.cond, see the next test): greedy batches
    never trace the vocabulary sort; a sampled row with a cut selects "cuts"; a batch whose
    least mode was not compiled runs in a compiled mode that covers it instead of compiling."""
    h = Harness()
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    plain = SamplingParams(temperature=0.8, max_tokens=64)
    cut = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=64)
    a, b = h.request(out=3, params=greedy, pages=4), h.request(out=3, params=plain, pages=4)
    h.check(decode([a]))
    assert h.calls[-1][1].sampling == "greedy"
    h.check(decode([a, b]))
    assert h.calls[-1][1].sampling == "random"
    c = h.request(out=3, params=cut, pages=4)
    h.check(decode([a, c]))
    lay_cuts = h.calls[-1][1]
    assert lay_cuts.sampling == "cuts" and lay_cuts.B == 2
    # At a shape where only "cuts" is ready (as precompile leaves it), a "random" batch uses it.
    lay_new = h.runner.layout(4, 1, 8, False, 0, "cuts")
    h.runner._ready.add(lay_new)
    d = h.request(out=3, params=plain, pages=4)
    h.check(decode([b, d, a]))  # B bucket 4: only "cuts" is ready there
    assert h.calls[-1][1] == lay_new


@pytest.mark.parametrize("mode", ["greedy", "random", "cuts"])
def test_step_has_no_device_conditional(mode):
    """XLA on the GPU decides a conditional on the host (predicate copied back, stream
    synchronised), which would block the launch of the next step behind this one: the decode
    step must contain none, in any sampler mode.  (Loops are not checked: on the CPU the
    sampler's threefry lowers to a rolled loop, on the GPU to one kernel.)"""
    eng = _engine(kernel_impl="reference")
    r = eng.runner
    for B, T, P, K in ((2, 1, 8, 0), (2, 16, 8, r.checkpoints_per_row)):  # decode, and prefill with state checkpoints
        text = r.lower(r.layout(B, T, P, False, K, mode)).as_text()
        assert "stablehlo.if" not in text and "stablehlo.case" not in text, (B, T, mode)
