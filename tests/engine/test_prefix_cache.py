"""The prefix cache (umem_jax/scheduler/prefix_cache.py) on the host: the radix tree over real
allocators and refcounts, no device.  Window retention near anchors, shortened hits, adoption at
branch points, the per-path checkpoint cap, LRU eviction, and refcounts that always add up."""

from __future__ import annotations

import numpy as np
import pytest

from umem_jax.memory import ChainAllocator, size_arena
from umem_jax.memory import plan as make_plan
from umem_jax.memory.page_owner import PageOwner
from umem_jax.models.tiny import TinyHybrid, tiny_config
from umem_jax.scheduler.prefix_cache import PrefixCache

PS, W = 4, 16  # the tiny model's window: a resume at r reads pages (r - 15) // 4 .. r // 4 - 1


def make(with_state: bool, cap: int | None = 4, lookahead: int = 0):
    p = make_plan(TinyHybrid.decls(tiny_config(with_mamba=with_state), "float32"), page_size=PS)
    alloc = ChainAllocator(p, size_arena(p, 1 << 20).num_rows)
    owner = PageOwner(alloc, alloc.bands[-1].table.num_virtual + 1)
    cache = PrefixCache(owner, PS, tuple((sp.name, sp.window) for sp in p.windows), p.state is not None,
                        max_checkpoints_per_path=cap, lookahead=lookahead)
    return alloc, owner, cache


class Seq:
    """A request as the scheduler keeps it: its pages, window refs from window_start on."""

    def __init__(self, alloc, owner, tokens):
        self.alloc, self.owner, self.tokens = alloc, owner, list(tokens)
        self.pages = alloc.alloc_token_pages(len(tokens) // PS).tolist()
        owner.take(self.pages, owner.windows)
        self.wstart = 0

    def advance(self, computed: int):
        """Give up window pages every query after `computed` tokens has passed."""
        upto = max(0, computed - W + 1) // PS
        if upto > self.wstart:
            self.owner.release_window(self.pages[self.wstart:upto], "window16")
            self.wstart = upto

    def free(self):
        self.owner.release_window(self.pages[self.wstart:], "window16")
        self.owner.release(self.pages)
        self.pages = []


def check(alloc, owner, cache, *seqs):
    n = owner.refs.size
    refs, wrefs = np.zeros(n, np.int32), {"window16": np.zeros(n, np.int32)}
    for s in seqs:
        np.add.at(refs, s.pages, 1)
        np.add.at(wrefs["window16"], s.pages[s.wstart:], 1)
    vids, slots, wins = cache.held()
    np.add.at(refs, vids, 1)
    np.add.at(wrefs["window16"], wins["window16"], 1)
    assert owner.check(refs, wrefs) == []
    alloc.check_invariants()
    assert not alloc.leaks(token_pages=vids + [p for s in seqs for p in s.pages], state_slots=slots)


def evictable_reference(cache) -> dict[str, int]:
    """evictable_by_subpool by walking the tree: a node no request's path runs through (page
    refcount 1: the tree's own) with its window pages, and every unpinned checkpoint."""
    plan = cache.allocator.plan
    out = {plan.full.name: 0, **{n: 0 for n in cache.owner.windows}}
    if plan.state is not None:
        out[plan.state.name] = 0
    for x in cache.nodes():
        if cache.owner.refs[x.vid] == 1:
            out[plan.full.name] += 1
            for n in x.wins:
                out[n] += 1
        if x.ckpt and not x.pins:
            out[plan.state.name] += 1
    return out


def bound(alloc, vids):
    return (alloc.translate_pages(np.asarray(vids, np.int32), "window16") > 0).tolist()


def test_window_pages_kept_near_leaves_hits_shortened_then_adopted_at_the_branch():
    alloc, owner, cache = make(with_state=False)
    rng = np.random.default_rng(0)
    base = rng.integers(3, 300, 40).tolist()
    a = Seq(alloc, owner, base)  # computed all 40 tokens
    cache.insert(a.tokens, a.pages, 10)  # the scheduler inserts before the request moves on
    a.advance(40)
    a.free()
    check(alloc, owner, cache)
    nodes = [cache.find(base, d) for d in range(1, 11)]
    # the leaf (depth 10) is the only anchor: windows kept for pages (40 - 15) // 4 = 6 .. 9
    assert bound(alloc, [x.vid for x in nodes]) == [False] * 6 + [True] * 4
    assert cache.match(base, 9).resume == 0  # the repeat stops at 36: its window pages are gone
    b_tok = base[:24] + rng.integers(3, 300, 16).tolist()
    hit = cache.match(b_tok, 9)
    assert (hit.matched, hit.resume, hit.fork) == (24, 0, 24)  # shortened to nothing; a fork at 24
    b = Seq(alloc, owner, b_tok)  # computes it all itself
    cache.insert(b.tokens, b.pages, 10)
    b_pages = list(b.pages)
    b.advance(40)
    b.free()
    check(alloc, owner, cache)
    # depth 6 is now a branch point: the tree adopted b's pages 2..5 (window pages still bound)
    assert cache.adopted_pages == 4
    assert [cache.find(base, d).vid for d in (3, 4, 5, 6)] == b_pages[2:6]
    c_tok = base[:24] + rng.integers(3, 300, 16).tolist()
    assert cache.match(c_tok, 9).resume == 24  # resumes exactly at the branch
    # LRU eviction frees everything no request holds; the arena is empty again
    held = Seq(alloc, owner, base[:8])
    cache.insert(held.tokens, held.pages, 2)  # a duplicate of cached pages: the tree keeps its own
    assert cache.evict() == 14  # a's 10 pages and b's 4 past the branch
    check(alloc, owner, cache, held)
    held.free()
    assert cache.num_pages == 0 and alloc.live_token_pages().size == 0
    assert (alloc.translate_pages(np.arange(owner.refs.size, dtype=np.int32), "window16") == 0).all()


def test_checkpoint_cap_pins_and_eviction_order():
    alloc, owner, cache = make(with_state=True, cap=3)
    toks = list(range(3, 3 + 48))
    s = Seq(alloc, owner, toks)
    slots = alloc.alloc_state_slots(6).tolist()
    _, rejected = cache.insert(toks, s.pages, 12, checkpoints={2: slots[0], 4: slots[1], 6: slots[2], 8: slots[3]})
    assert rejected == []
    assert [d for d in range(1, 13) if cache.find(toks, d).ckpt] == [4, 6, 8]  # the shallowest went
    cache.pin(cache.find(toks, 4))
    _, rejected = cache.insert(toks, s.pages, 12, checkpoints={10: slots[4], 8: slots[5]})
    assert rejected == [slots[5]]  # depth 8 has one already: the caller frees it
    alloc.free_state_slots(rejected)
    assert [d for d in range(1, 13) if cache.find(toks, d).ckpt] == [4, 8, 10]  # 4 pinned: 6 went
    assert cache.dropped_checkpoints == 2 and alloc.live_state_slots().size == 3
    # windows follow the checkpoints (the anchors of a model with state)
    win = [d for d in range(1, 13) if "window16" in cache.find(toks, d).wins]
    assert win == list(range(1, 11))  # pages a resume at 16, 32 or 40 reads in the window
    # the request still holds every page: only checkpoints are evictable (not the pinned one)
    state = alloc.plan.state.name
    assert cache.evictable_by_subpool() == {"full": 0, "window16": 0, state: 2} == evictable_reference(cache)
    assert cache.evict() == 2 and cache.num_checkpoints == 1 and cache.num_pages == 12
    s.advance(48)
    s.free()
    ev = cache.evictable_by_subpool()  # every page now: the request is gone; the pinned checkpoint stays
    assert ev == evictable_reference(cache) and ev["full"] == 12 and ev[state] == 0
    assert ev["window16"] == cache.num_window_pages["window16"] > 0
    cache.unpin(cache.find(toks, 4))
    assert cache.evictable_by_subpool() == {**ev, state: 1} == evictable_reference(cache)
    check(alloc, owner, cache)
    order = []
    cache.evict(lambda: bool(order.append(cache.num_pages)) and False)
    assert order[:3] == [12, 11, 10]  # leaves, deepest first
    assert cache.num_pages == 0 and alloc.live_state_slots().size == 0
    check(alloc, owner, cache)


def test_lru_evicts_the_oldest_path_first():
    alloc, owner, cache = make(with_state=False)
    seqs = [list(range(10 * i + 3, 10 * i + 11)) for i in range(3)]  # 3 disjoint 2-page paths
    for t in seqs:
        s = Seq(alloc, owner, t)
        cache.insert(t, s.pages, 2)
        s.advance(8)
        s.free()
    cache.match(seqs[0] + [1], 2)  # touch the first: now the second is the oldest
    n = cache.evict(lambda: cache.num_pages <= 4)
    assert n == 2 and cache.find(seqs[1], 1) is None and cache.find(seqs[0], 2) and cache.find(seqs[2], 2)
    check(alloc, owner, cache)


@pytest.mark.parametrize("lookahead", [0, 1])
def test_scheduler_with_the_cache_keeps_every_count_under_pressure(lookahead):
    """A host-only run of the scheduler (no device): prompts sharing prefixes arrive in waves
    into a tight arena.  After every step: allocator invariants, refcounts equal to what the
    requests and the cache hold, and every page a pass attends bound in the window (hits
    included).  At the end nothing leaks.  lookahead 1: keys with the next token (an MTP head)."""
    from umem_jax.core.request import Request, RequestStatus
    from umem_jax.core.sampling_params import SamplingParams
    from umem_jax.core.scheduled_batch import Buckets
    from umem_jax.memory.demand import DemandModel
    from umem_jax.scheduler.scheduler import Scheduler, SchedulerConfig

    p = make_plan(TinyHybrid.decls(tiny_config(), "float32"), page_size=PS)
    rows = size_arena(p, 200 << 10).num_rows
    alloc = ChainAllocator(p, rows)
    dm = DemandModel(p, chunk=32, empty=ChainAllocator(p, rows))
    cfg = SchedulerConfig(4, 32, Buckets((1, 2, 4), (8, 16, 32), (64, 256)), new_token_ratio=0.2,
                          enable_prefix_caching=True, checkpoint_interval=8, max_checkpoints_per_path=3,
                          cache_lookahead=lookahead)
    sch = Scheduler(cfg, alloc, dm)
    rng = np.random.default_rng(3)
    bases = [rng.integers(3, 300, 70).tolist() for _ in range(3)]
    n = shared = 0
    for wave in range(6):
        for _ in range(5):
            prompt = bases[rng.integers(3)][: rng.integers(6, 70)] + rng.integers(3, 300, rng.integers(0, 9)).tolist()
            m = dm.clip(len(prompt), int(rng.integers(1, 30)))
            sch.add(Request(str(n), None, prompt, SamplingParams(temperature=0), arrival=n, seed=0, max_tokens=m,
                            windows=("window16",)))
            n += 1
        while sch.has_work():
            b = sch.schedule()
            assert b is not None, "stalled with work queued"
            for row in b.rows:
                first = max(0, row.start - W + 1) // PS
                held = alloc.translate_pages(np.asarray(row.req.pages, np.int32), "window16")
                assert (held[first:] > 0).all() and len(row.req.slots) == 1
            for row in b.rows:
                if row.sample:
                    row.req.output_token_ids.append(5 + len(row.req.output_token_ids) % 7)
                    if row.req.num_output >= row.req.max_tokens:
                        sch.finish(row.req, RequestStatus.FINISHED_LENGTH)
            alloc.check_invariants()
            assert sch.check_refs() == []
            assert sch.cache.evictable_by_subpool() == evictable_reference(sch.cache)
            shared += any(sch.cache.owner.refs[v] > 1 for r in sch.running for v in r.pages)
            alloc.take_moves()
    assert shared  # requests held cached pages at times: those were not counted as evictable
    # idle: every page and checkpoint left is the cache's alone, and eviction frees exactly those
    assert sch.cache.evictable_by_subpool() == sch.cache.held_by_subpool()
    pages, slots = sch.held_ids()
    assert not alloc.leaks(token_pages=pages, state_slots=slots)
    st = sch.cache.stats()
    assert st["hits"] >= 3 and st["adopted_pages"] > 0 and st["evicted_pages"] > 0 and sch.num_checkpoints > 0
    assert sch.cache.clear() and alloc.live_token_pages().size == 0 and alloc.live_state_slots().size == 0
    assert sch.check_refs() == []


def test_a_prompt_end_mark_keeps_its_window_pages_until_evicted():
    """A prompt of 30 tokens (its exact repeat resumes at 28: depth 7) and 10 outputs: the mark
    at depth 7 keeps the window pages a resume there reads ((28 - 15) // 4 = 3 .. 6) beside the
    leaf's (6 .. 9); eviction drops the mark alone while a request holds the path, then all."""
    alloc, owner, cache = make(with_state=False)
    toks = np.random.default_rng(3).integers(3, 300, 40).tolist()
    a = Seq(alloc, owner, toks)
    cache.insert(toks, a.pages, 10, marks=(7,))
    a.advance(40)
    check(alloc, owner, cache, a)
    nodes = [cache.find(toks, d) for d in range(1, 11)]
    assert nodes[6].mark and bound(alloc, [x.vid for x in nodes]) == [False] * 3 + [True] * 7
    assert cache.match(toks[:30], 7).resume == 28  # the exact repeat of the prompt
    held = evictable_reference(cache)
    assert held == cache.evictable_by_subpool() == {"full": 0, "window16": 0}  # a's path: all its pages
    # the leaf a still holds goes first (deepest among equals: the tree's window refs alone, a
    # keeps its own), then the mark alone; the pages stay
    assert cache.evict(lambda: not nodes[6].mark) == 2 and not nodes[6].mark and nodes[9].bare
    assert bound(alloc, [x.vid for x in nodes]) == [False] * 6 + [True] * 4  # only a's own window
    check(alloc, owner, cache, a)
    a.free()
    cache.insert(toks, [x.vid for x in nodes], 10, marks=(7,))  # a mark on a path cached earlier
    assert nodes[6].mark and cache.match(toks[:30], 7).resume == 0  # its window pages are gone: no hit
    assert cache.clear() and alloc.live_token_pages().size == 0


def test_a_branch_points_window_pages_go_under_pressure_while_its_paths_run():
    """Two running requests part after 24 tokens (depth 6): the branch point keeps the window
    pages a resume there reads ((24 - 15) // 4 = 2 .. 5) after both have passed them, and no
    eviction of an unreferenced leaf can free them while the requests run.  Under pressure they
    go alone (the pages stay), before anything would be retracted; a new branch un-bares the node."""
    alloc, owner, cache = make(with_state=False)
    rng = np.random.default_rng(5)
    base = rng.integers(3, 300, 24).tolist()
    a = Seq(alloc, owner, base + rng.integers(3, 300, 16).tolist())
    cache.insert(a.tokens, a.pages, 10)
    b_tok = base + rng.integers(3, 300, 16).tolist()
    b = Seq(alloc, owner, b_tok)
    cache.insert(b.tokens, b.pages, 10)
    a.advance(40)
    b.advance(40)
    check(alloc, owner, cache, a, b)
    branch = cache.find(base, 6)
    assert len(branch.children) == 2 and branch.wins and not branch.bare
    path = [cache.find(base, d) for d in range(1, 7)]
    assert [bool(x.wins) for x in path] == [False, False, True, True, True, True]
    assert cache.evictable_by_subpool()["window16"] == 0  # its pages are the requests': no leaf to evict
    # the two leaves the requests hold go first (deepest among equals), then the branch point
    assert cache.evict(lambda: branch.bare) == 3 and branch.bare
    assert not any(x.wins for x in path) and cache.num_pages == 14  # windows let go, every page kept (6 + 4 + 4)
    check(alloc, owner, cache, a, b)
    c = Seq(alloc, owner, base + rng.integers(3, 300, 16).tolist())
    cache.insert(c.tokens, c.pages, 10)
    assert not branch.bare  # a third branch: a resume here is wanted again
    for s_ in (a, b, c):
        s_.free()
    assert cache.clear() and alloc.live_token_pages().size == 0


def test_a_decoders_last_cached_page_lets_the_window_page_it_passed_go_under_pressure():
    """A decoder's full pages are handed to the cache as they fill, so its last cached page is a
    leaf it still holds.  That leaf anchors a resume at 40 ((40 - 15) // 4 = 6 .. 9) while the
    decoder at 43 has let page 6 go (it reads 7 .. 10): the tree alone keeps that window page,
    which the demand model counts as given back.  Under pressure it goes (the pages stay, the
    leaf turns bare); the next hand-off grows a new leaf, an anchor again, and a request letting
    its last leaf go makes it one again (`reanchor`)."""
    alloc, owner, cache = make(with_state=False)
    toks = np.random.default_rng(9).integers(3, 300, 48).tolist()
    a = Seq(alloc, owner, toks[:44])  # 11 pages; the 11th is still filling
    cache.insert(toks, a.pages, 10)
    a.advance(43)
    check(alloc, owner, cache, a)
    leaf = cache.find(toks, 10)
    nodes = [cache.find(toks, d) for d in range(1, 11)]
    assert not leaf.children and owner.refs[leaf.vid] == 2 and not leaf.bare
    assert bound(alloc, a.pages) == [False] * 6 + [True] * 5  # page 6: the tree's alone
    assert cache.evictable_by_subpool()["window16"] == 0  # every page is a's: no leaf to evict
    assert cache.evict(lambda: leaf.bare) == 1 and leaf.bare
    assert bound(alloc, a.pages) == [False] * 7 + [True] * 4 and cache.num_pages == 10  # page 6 freed, pages kept
    check(alloc, owner, cache, a)
    cache.retention.reanchor(leaf)  # were a to stop here (finish, retraction): an anchor again
    assert not leaf.bare and bound(alloc, a.pages) == [False] * 7 + [True] * 4 and leaf.wins
    assert cache.match(toks[:44], 10).resume == 0  # page 6's rows are gone: a resume at 40 is shortened
    assert cache.evict(lambda: leaf.bare) == 1 and leaf.bare  # under pressure again
    a.pages += alloc.alloc_token_pages(1).tolist()  # a's 12th page
    owner.take(a.pages[-1:], owner.windows)
    cache.insert(toks, a.pages, 11)  # the next hand-off: a new leaf, an anchor, past the bare one
    assert not cache.find(toks, 11).bare and len(leaf.children) == 1
    a.advance(48)
    a.free()
    check(alloc, owner, cache)
    assert cache.match(toks[:48], 11).resume == 44 and all(x.alive for x in nodes)
    assert cache.clear() and alloc.live_token_pages().size == 0


def test_lookahead_keys_a_page_with_the_token_after_it():
    """lookahead 1 (an MTP head: a page's last entry is made from the token after the page): A
    caches p + [1, ...] (p four pages) with checkpoints at depths 3, 4, 5.  B = p + [2, ...]
    leaves A's path exactly at p's end, so it shares one page less: it forks and resumes at
    12, not 16 (lookahead 0).  Leaving mid-page or repeating A loses nothing.  B's insert
    makes the boundary a branch of two nodes, its own page beside A's, so C following B's
    path reads B's page there, not A's (with lookahead 0 one page serves both)."""
    for la in (0, 1):
        alloc, owner, cache = make(with_state=True, lookahead=la)
        rng = np.random.default_rng(5)
        p = rng.integers(3, 300, 16).tolist()
        a_tok, b_tok = p + [1] + rng.integers(3, 300, 7).tolist(), p + [2] + rng.integers(3, 300, 7).tolist()
        a, b = Seq(alloc, owner, a_tok), Seq(alloc, owner, b_tok)
        slots = alloc.alloc_state_slots(3).tolist()
        assert cache.insert(a_tok, a.pages, 5, checkpoints=dict(zip((3, 4, 5), slots)))[1] == []
        hit = cache.match(b_tok, 5)
        assert (hit.matched, hit.resume, hit.fork) == ((12, 12, 12) if la else (16, 16, 16))
        mid = p[:14] + rng.integers(3, 300, 10).tolist()
        assert cache.match(mid, 5).resume == 12 and cache.match(a_tok, 5).resume == 20
        cache.insert(b_tok, b.pages, 5)
        c_hit = cache.match(b_tok + [9], 5)
        assert c_hit.matched == 20 and c_hit.resume == (12 if la else 16)  # B's path has no checkpoint of its own
        want = b.pages[3] if la else a.pages[3]
        assert cache.find(b_tok, 4).vid == want and cache.find(a_tok, 4).vid == a.pages[3]
        assert cache.find(b_tok, 3) is cache.find(a_tok, 3)
        if la:
            with pytest.raises(ValueError, match="page 4 has 4 of its 5 key tokens"):
                cache.insert(a_tok[:20], a.pages, 5)  # the token after page 4 is not known yet
        check(alloc, owner, cache, a, b)
        for x in (a, b):
            x.advance(24)
            x.free()
        assert cache.clear() and alloc.live_token_pages().size == 0 and alloc.live_state_slots().size == 0
