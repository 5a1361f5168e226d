"""Speculative decoding over recurrent state (issue 16): a verify of k+1 positions keeps the state
after each verified position in the request's speculative slots and commits the accepted one.
Greedy output with speculation == greedy without, for a window + Mamba2 state + full model (the
tiny hybrid) and a gated-DeltaNet state + full model (the Qwen3.5 fixture; NemotronH's under
--long), through chunked
prefill, retraction and prefix-cache hits in the same run; invariants and the idle leak check
after each run.

Random drafts accept nothing, so the runs that check the commit use a test harness: a proposer
that reads the target's greedy continuation (from the run without speculation) and corrupts a
seeded share of it, so every accepted count 0..k occurs.  One run uses the real draft passes."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _engine_utils import assert_idle_clean, prompts  # noqa: E402

from umem_jax import LLM, SamplingParams  # noqa: E402
from umem_jax.runner.shift import pending_shift  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SHAPES = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=4, max_model_len=160, batch_buckets=(4,),
              token_buckets=(32,), page_buckets=(40,))
K = 3
MAX_TOKENS = 14
WRONG = 0.3  # share of harness drafts made wrong


@functools.lru_cache(maxsize=None)
def _models(name: str):
    """(target, a draft without state of the target's vocabulary)."""
    from umem_jax.models.loader import load_model
    from umem_jax.models.tiny import tiny_model

    if name == "tiny":  # the tiny hybrid with a small Mamba2 state, so K/V growth (not slots) fills the arena
        from umem_jax.models.config import MambaConfig

        target = tiny_model(seed=1, mamba=MambaConfig(num_heads=2, head_dim=8, state_size=8, n_groups=1, conv_kernel=4,
                                                      chunk_size=16))
    else:
        target = load_model(str(FIXTURES / name))
    return target, tiny_model(seed=3, with_mamba=False, vocab_size=target.config.vocab_size)


def _workload(vocab: int):
    """Long prompts (chunked: > 32 tokens), two sharing a 40-token prefix (a cache hit)."""
    shared = [t % vocab for t in prompts(40, seed=3)[0]]
    ps = [[t % vocab for t in p] for p in prompts(60, 9, 45, seed=5)]
    return [shared + ps[1], ps[0], shared + [7, 8, 9, 10], ps[2]]


def _oracle(speculator, expected: dict, vocab: int, seed: int = 0):
    """A harness proposer: the target's greedy continuation of each row, WRONG of it corrupted.
    It proposes on the device, so steps still overlap: a row's pending token is at row.start
    plus what the step in flight accepted (decode_fields' shift), so it picks its K drafts from
    a window of 2K tokens past row.start."""
    rng = np.random.default_rng(seed)

    def propose(batch, lay, meta, prev, spec_lens):
        win = np.zeros((lay.B, 2 * K), np.int32)
        for i, row in enumerate(batch.rows):
            seq = expected[tuple(row.req.prompt_token_ids)]
            nxt = seq[row.start + 1:row.start + 1 + 2 * K]
            win[i, :len(nxt)] = nxt
        bad = rng.random(win.shape) < WRONG
        win = jnp.asarray(np.where(bad, (win + 1) % vocab, win))
        shift = pending_shift(meta, prev, layout=lay)
        return jnp.take_along_axis(win, shift[:, None] + jnp.arange(K)[None, :], axis=1), None

    propose.on_device = True
    speculator.propose = propose


def _generate(engine, work, params, retract_at: int | None):
    """engine.step() until done; with retract_at, the speculative run also retracts the running
    request furthest into its output after that many steps, and again 3 steps later (their
    verifies may still be in flight), to resume them by recomputing."""
    ids = [engine.add_request(p, params) for p in work]
    outs, steps = {}, 0
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step())
        steps += 1
        if retract_at is not None and steps in (retract_at, retract_at + 3):
            running = [r for r in engine.scheduler.running if r.num_output > 0]
            if running:
                engine.scheduler.retract(max(running, key=lambda r: r.num_output))
    return [outs[i] for i in ids]


def _run(target, arena, draft=None, expected=None, overlap=True):
    spec = None if draft is None else {"method": "draft", "model": draft, "num_speculative_tokens": K, "min_acceptance": 0.0}
    llm = LLM(target, arena_bytes=arena, speculative_config=spec, async_scheduling=overlap, **SHAPES)
    if expected is not None:
        _oracle(llm.llm_engine.runner.speculator, expected, target.config.vocab_size)
    work = _workload(target.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = _generate(llm.llm_engine, work, params, None if draft is None else 8)
    # the last prompt again: its whole prompt is cached by now, a prefix-cache hit (the first one's entries, the
    # oldest, may have gone: an early start evicts the cache's least recently used entries for its longest pass)
    outs += _generate(llm.llm_engine, work[-1:], params, None)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    assert_idle_clean(llm)
    return [list(o.outputs[0].token_ids) for o in outs], llm.llm_engine.stats(), work + work[-1:]


# NemotronH (Mamba2 with a prefill dt clamp: the verify must not clamp its decode rows; MoE) under --long.
# The fixtures' arenas are 300 KiB less the 11.5 KiB their sink no longer takes (it was a whole state
# slot until the state grid started at the sink): the same pressure, so retractions and a cache hit.
@pytest.mark.parametrize("name,arena", [("tiny", 220 << 10), ("qwen3_5_tiny", 288 << 10),
                                        pytest.param("nemotron_h_tiny", 288 << 10, marks=pytest.mark.slow)])
def test_greedy_with_speculation_over_state_is_greedy_without(name, arena, decode_row_verify):
    """Read back step by step in the tight arena, then overlapped (each step launched before the
    previous one is read back: placed for the worst case of the accepted counts, so it needs
    more room for the same prefix-cache hits)."""
    target, draft = _models(name)
    want, base, work = _run(target, arena)
    assert all(len(t) == MAX_TOKENS for t in want)
    expected = {tuple(p): list(p) + w for p, w in zip(work, want)}
    for overlap, room in ((False, arena), (True, arena + (200 << 10))):
        got, st, _ = _run(target, room, draft=draft, expected=expected, overlap=overlap)
        assert got == want, overlap
        s = st["speculative"]
        assert 0.2 < s["acceptance_rate"] < 0.9 and min(s["acceptance_per_position"]) > 0, s
        assert st["num_retractions"] > 0 and st["prefix_cache"]["hit_tokens"] > 0, (overlap, st)
    if name == "tiny":  # the real draft passes over a target with state: its random drafts are mostly rejected
        got, st, _ = _run(target, arena, draft=draft)
        assert got == want and st["speculative"]["num_verify_rows"] > 0


def test_each_request_holds_its_speculative_state_slots():
    """The demand model prices k speculative slots beside the working slot: a request holds
    1 + k state slots while it runs, and the clip at arrival counts them."""
    target, draft = _models("tiny")
    llm = LLM(target, arena_bytes=220 << 10, speculative_config={"model": draft, "num_speculative_tokens": K, "min_acceptance": 0.0},
              **SHAPES)
    eng = llm.llm_engine
    assert eng.demand.slots_per_request == 1 + K
    assert eng.demand.lifetime(10, 4).state_slots == 1 + K
