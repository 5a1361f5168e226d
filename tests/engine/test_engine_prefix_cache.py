"""Prefix caching end to end: hits give the same greedy tokens as misses (and as the dense
oracle) on the tiny hybrid (full + window + Mamba2) and on the NemotronH and Qwen3.5 fixtures;
hits resume where the state checkpoints are (prefill chunk ends, fork points, decode interval);
concurrent requests share pages; the cache is evicted before anything is retracted and a
checkpoint that does not fit is skipped, never stalling a request; every test ends with the
idle invariant / leak / refcount checks.

The tiny-model engines use the shared settings (_engine_utils), so they add no step shapes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _engine_utils import ARENA, assert_idle_clean, dense_greedy, llm, prompts

from umem_jax import LLM, SamplingParams

G = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731
FIXTURES = Path(__file__).parents[1] / "fixtures"


def run(engine_llm, prompt, n):
    out = engine_llm.generate(prompt, G(n))[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


@pytest.fixture(scope="module")
def cached():
    """Room for a few cached paths with their checkpoints, so LRU eviction does not interfere
    with the hits these tests look for (the tight default arena is for the pressure tests)."""
    return llm(arena_bytes=4 * ARENA)


def test_hits_resume_at_checkpoints_and_match_dense(cached):
    e = cached.llm_engine
    base, other = prompts(70, 60, seed=21)
    a = base  # chunked 32 + 32 + 6: checkpoints at 32, 64 and 68 (the page before the last token)
    b = base[:50] + other[:20]  # shares 48 tokens in whole pages; the deepest checkpoint is 32
    c = base[:50] + other[20:40]  # diverges from b at 50: resumes at b's fork checkpoint, 48
    want = dense_greedy([a, b, c], 10)
    assert run(cached, a, 10) == (want[0], 0)
    assert run(cached, a, 10) == (want[0], 68)
    assert run(cached, b, 10) == (want[1], 32)
    assert run(cached, c, 10) == (want[2], 48)
    st = e.stats()
    pc = st["prefix_cache"]
    assert pc["hits"] == 3 and pc["hit_tokens"] == 68 + 32 + 48 == st["prefix_cache_hit_tokens"]
    assert pc["shortened_tokens"] == 48 - 32  # b found 48 tokens but only 32 had a checkpoint
    assert pc["adopted_pages"] > 0  # b's own pages before its fork replaced tombstoned ones
    assert pc["copied_slots"] == 3 and pc["checkpoints_taken"] > 0
    # idle: every live byte is the cache's alone, so all of it is evictable
    assert st["evictable_bytes"] == st["live_bytes"] > 0
    assert_idle_clean(cached)


def test_decode_checkpoint_serves_a_follow_up(cached):
    """A conversation's next turn resumes at the decode checkpoint (every 32 tokens here)."""
    first = prompts(20, seed=22)[0]
    out, hit = run(cached, first, 30)  # computes 20 + 29 tokens: a decode checkpoint at 32
    assert hit == 0 and out == dense_greedy([first], 30)[0]
    turn2 = first + out[:16] + prompts(9, seed=23)[0]
    assert run(cached, turn2, 8) == (dense_greedy([turn2], 8)[0], 32)
    assert_idle_clean(cached)


def test_concurrent_requests_share_the_prefix(cached):
    e = cached.llm_engine
    shared = prompts(40, seed=24)[0]
    tails = prompts(7, 9, 6, 8, 5, seed=25)
    ps = [shared + t for t in tails]
    want = dense_greedy(ps, 12)
    assert run(cached, ps[0], 12) == (want[0], 0)
    ids = [e.add_request(p, G(12)) for p in ps[1:4]]  # together: all three hit at once
    outs, most = {}, 0
    while e.has_unfinished_requests():
        for o in e.step():
            outs[o.request_id] = o
        most = max(most, int(e.scheduler.owner.refs.max()))
    assert most >= 4  # a shared page held by the cache and the three requests
    assert [outs[i].outputs[0].token_ids for i in ids] == want[1:4]
    # the chunk-end checkpoint, or the fork checkpoint when admitted a step after the others
    assert all(outs[i].num_cached_tokens in (32, 40) for i in ids) and outs[ids[0]].num_cached_tokens == 32
    assert run(cached, ps[4], 12) == (want[4], 40)  # the fork checkpoint they planted
    assert_idle_clean(cached)


def test_cache_is_evicted_before_running_requests_are_retracted():
    tight = llm(new_token_ratio=0.0)
    e = tight.llm_engine
    fill = prompts(60, 60, 60, seed=26)
    for p in fill:  # one at a time: each leaves its pages and checkpoints in the cache
        tight.generate(p, G(8))
    before = e.stats()["prefix_cache"]
    assert before["cached_pages"] > 25 and before["cached_checkpoints"] > 0
    pair = prompts(40, 40, seed=27)
    outs = tight.generate(pair, G(40))  # together they need most of the arena
    st = e.stats()
    assert [o.outputs[0].token_ids for o in outs] == dense_greedy(pair, 40)
    assert st["num_retractions"] == 0 and st["num_evictions"] > before["evicted_pages"]
    # a repeat after all that gets the same tokens from whatever survived in the cache
    assert run(tight, pair[1], 40)[0] == outs[1].outputs[0].token_ids
    assert_idle_clean(tight)


def test_stalled_checkpoints_are_skipped_and_requests_finish():
    tight = llm(new_token_ratio=0.0)
    long = prompts(5, 17, 40, 70, seed=4)
    outs = tight.generate(long, G(50))
    st = tight.llm_engine.stats()
    assert st["prefix_cache"]["checkpoints_skipped"] > 0  # no slot fit beside the running requests
    assert [o.outputs[0].token_ids for o in outs] == dense_greedy(long, 50)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert_idle_clean(tight)


def test_disabled():
    off = llm(enable_prefix_caching=False)
    p = prompts(40, seed=28)[0]
    want = dense_greedy([p], 6)[0]
    assert run(off, p, 6) == (want, 0) and run(off, p, 6) == (want, 0)
    st = off.llm_engine.stats()
    assert not st["prefix_cache"]["enabled"] and st["prefix_cache_hit_tokens"] == 0
    assert all(v == 0 for v in st["held"].values()) and st["evictable_bytes"] == 0
    assert off.reset_prefix_cache()
    assert_idle_clean(off)


@pytest.mark.parametrize("fixture", ["nemotron_h_tiny", "qwen3_5_tiny"])
def test_fixture_models_hits_equal_misses(fixture):
    from umem_jax.models.loader import load_model

    m = load_model(str(FIXTURES / fixture))
    model_llm = LLM(m, arena_bytes=256 << 10, max_num_seqs=4, max_num_batched_tokens=32, page_size=4,
                    max_model_len=256, batch_buckets=(4,), token_buckets=(32,), page_buckets=(64,))
    base, other = prompts(45, 40, seed=29)
    base = [t % 120 + 3 for t in base]
    other = [t % 120 + 3 for t in other]
    # base: checkpoints at 32 and 44; the second resumes at 32 and plants one at its fork, 36
    ps = [base, base[:36] + other[:10], base[:36] + other[10:22]]
    misses = []
    for p in ps:  # each on an empty cache
        misses.append(run(model_llm, p, 6)[0])
        assert model_llm.reset_prefix_cache()
    hits = [run(model_llm, p, 6) for p in ps + [base]]
    assert [h[0] for h in hits] == misses + misses[:1]
    assert [h[1] for h in hits] == [0, 32, 36, 44]
    assert_idle_clean(model_llm)


# ------------------------------------------------------------------ issue 21: no admitted request waits on itself
# A prompt at the clip limit, run twice: the second's hit is shortened to nothing (its window
# rows are gone) and it computes the prefix again; once its own pages are cached below the
# first run's copies, those copies are no leaf and LRU eviction could not reach them, so its
# next chunk never fit ("scheduler stalled").  The tree-only copies now go (release_duplicates).

def _tight(model, arena_bytes=100000, max_model_len=1024):
    return LLM(model, arena_bytes=arena_bytes, max_num_seqs=4, max_num_batched_tokens=32, page_size=4,
               max_model_len=max_model_len, batch_buckets=(4,), token_buckets=(32,), page_buckets=(256,))


def _clip_limit(engine_llm, max_model_len=1024) -> int:
    demand = engine_llm.llm_engine.demand
    return max(k for k in range(1, max_model_len - 1) if demand.clip(k, 1) is not None)


def _twice(engine_llm, prompt, n):
    first, second = (engine_llm.generate(prompt, G(n))[0].outputs[0].token_ids for _ in range(2))
    return first, second


@pytest.fixture(scope="module")
def tiny_attention():
    """(the model, a large-arena engine: the reference outputs)."""
    from umem_jax.models.loader import load_model

    m = load_model("tiny-attention")
    return m, _tight(m, arena_bytes=1 << 21)


def test_prompt_at_the_clip_limit_runs_twice(tiny_attention):
    import numpy as np

    model, big = tiny_attention
    small = _tight(model)
    n = _clip_limit(small)
    p = np.random.default_rng(11).integers(3, 300, n).tolist()
    clip = small.llm_engine.demand.clip(n, 1024 - n)  # max_tokens unset: up to the room left, then the memory clip
    want = big.generate(p, G(clip))[0].outputs[0].token_ids
    sp = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    first, second = (small.generate(p, sp)[0].outputs[0].token_ids for _ in range(2))
    assert first == want and second == want and len(want) == clip
    assert_idle_clean(small)


def test_window_model_prompts_near_the_budget_repeated():
    import numpy as np

    from umem_jax.models.loader import load_model

    m = load_model(str(FIXTURES / "gemma3_tiny"))
    small = _tight(m, arena_bytes=64 << 10, max_model_len=256)
    n = _clip_limit(small, 256)
    rng = np.random.default_rng(5)
    big = _tight(m, arena_bytes=4 << 20, max_model_len=256)
    for k in (n, n - 3):
        p = rng.integers(3, 120, k).tolist()
        clip = small.llm_engine.demand.clip(k, 10_000)
        want = big.generate(p, G(clip))[0].outputs[0].token_ids
        assert _twice(small, p, clip) == (want, want)
    assert_idle_clean(small)


def test_prompts_near_the_clip_limit_random(tiny_attention):
    import numpy as np

    model, big = tiny_attention
    small = _tight(model)
    n = _clip_limit(small)
    cases = []
    for seed in range(20):
        rng = np.random.default_rng(100 + seed)
        k = int(rng.integers(int(0.7 * n), n + 1))
        cases.append((rng.integers(3, 300, k).tolist(), small.llm_engine.demand.clip(k, 10_000)))
    wants = [o.outputs[0].token_ids for o in big.generate([p for p, _ in cases], [G(c) for _, c in cases])]
    for (p, clip), want in zip(cases, wants):
        assert _twice(small, p, clip) == (want, want)
        small.llm_engine.check_idle()
    assert_idle_clean(small)


# ------------------------------------------------------------------ issue 22 (5): window models at the budget
# Attention-only window models: a lone prompt at 70-100% of the clip limit, run twice, neither
# stalls (the tree's duplicates of the pages the second run computed again go: 12eebba), and the
# repeat hits the cache exactly at the prompt's last page boundary: the tree MARKS that node and
# keeps its window pages (before, only the leaf past the outputs kept any, so a repeat found
# none and recomputed everything).  Gemma 3 at 100 kB / 512 tokens stalled on 19 of 30 repeats
# before 12eebba.

def _repeats_hit(small, big, vocab, lo, seeds):
    import numpy as np

    n = _clip_limit(small, small.llm_engine.max_model_len)
    for seed in seeds:
        rng = np.random.default_rng(seed)
        k = int(rng.integers(int(lo * n), n + 1))
        p = rng.integers(3, vocab, k).tolist()
        clip = small.llm_engine.demand.clip(k, 10_000)
        want = big.generate(p, G(clip))[0].outputs[0].token_ids
        assert run(small, p, clip) == (want, 0)
        assert run(small, p, clip) == (want, (k - 1) // 4 * 4)  # the exact repeat resumes at the mark
        small.llm_engine.check_idle()
    assert_idle_clean(small)


def test_window_model_repeats_at_the_budget_hit(tiny_attention):
    model, big = tiny_attention
    _repeats_hit(_tight(model), big, 300, 0.7, range(8))
    _repeats_hit(_tight(model), big, 300, 0.05, range(8, 12))  # short prompts too


def test_gemma_repeats_at_the_budget_hit():
    from umem_jax.models.loader import load_model

    m = load_model(str(FIXTURES / "gemma3_tiny"))
    _repeats_hit(_tight(m, arena_bytes=100000, max_model_len=512), _tight(m, arena_bytes=4 << 20, max_model_len=256),
                 120, 0.7, range(8))


def test_a_lone_request_that_waits_on_its_own_cache_restarts_without_it(tiny_attention, monkeypatch):
    """The last rung of the shortfall ladder: with the prompt-end marks and the duplicates
    release switched off (the issue-21 repro as it was), the second run recomputes the prompt
    and cannot fit its next chunk beside the tree's copies above its own pages; instead of
    stalling it is retracted, the cache emptied, and it resumes from nothing."""
    import numpy as np

    from umem_jax.scheduler.prefix_cache import PrefixCache

    model, big = tiny_attention
    small = _tight(model)
    n = _clip_limit(small)
    p = np.random.default_rng(11).integers(3, 300, n).tolist()
    clip = small.llm_engine.demand.clip(n, 10_000)
    want = big.generate(p, G(clip))[0].outputs[0].token_ids
    insert = PrefixCache.insert
    monkeypatch.setattr(PrefixCache, "insert", lambda self, *a, marks=(), **kw: insert(self, *a, **kw))  # no hit
    monkeypatch.setattr(PrefixCache, "release_duplicates", lambda self, paths: 0)
    assert _twice(small, p, clip) == (want, want)
    assert small.llm_engine.scheduler.num_restarts >= 1
    assert_idle_clean(small)
