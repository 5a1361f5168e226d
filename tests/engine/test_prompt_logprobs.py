"""Prompt logprobs (core/prompt_logprobs.py): every prompt token's logprob given the tokens before
it, against log_softmax of the cache-free forward -- across prefill chunks (32 tokens a pass
here), beside rows that do not ask, after a prefix-cache entry of the same prompt exists, and
after a retraction; a request that does not ask gets None and the same tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _engine_utils import assert_idle_clean, dense_greedy, llm, prompts, tiny

from umem_jax import SamplingParams
from umem_jax.core.prompt_logprobs import PromptLogprobs


@pytest.fixture(scope="module")
def engine_llm():
    return llm()


def _dense(prompt):
    """log_softmax [n, V] of the cache-free forward at every prompt position."""
    m = tiny()
    toks = np.zeros((1, 128), np.int32)
    toks[0, : len(prompt)] = prompt
    logits = np.asarray(m.dense_logits(m.params, jnp.asarray(toks)))[0, : len(prompt)]
    return np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))


def _check(prompt, got, k):
    """got (vLLM's shape) against the dense forward: each prompt token's logprob and rank, and
    the top k alternatives' logprobs by rank."""
    ref = _dense(prompt)
    assert len(got) == len(prompt) and got[0] is None
    for p in range(1, len(prompt)):
        entry, t, row = got[p], prompt[p], ref[p - 1]
        np.testing.assert_allclose(entry[t].logprob, row[t], rtol=1e-4, atol=1e-4)
        assert entry[t].rank == 1 + int((row > row[t]).sum())
        by_rank = {lp.rank: lp.logprob for lp in entry.values()}
        assert len(entry) <= k + 1 and all(r in by_rank for r in range(1, k + 1))
        np.testing.assert_allclose([by_rank[r] for r in range(1, k + 1)], np.sort(row)[::-1][:k], rtol=1e-4, atol=1e-4)


def test_prompt_logprobs_match_the_dense_forward_across_chunks(engine_llm):
    long, short = prompts(77, 9, seed=21)  # 77 tokens: three prefill passes of 32
    outs = engine_llm.generate([long, short], [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3,
                                                              ignore_eos=True),
                                               SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)])
    _check(long, outs[0].prompt_logprobs, 3)
    assert outs[1].prompt_logprobs is None
    assert [o.outputs[0].token_ids for o in outs] == dense_greedy([long, short], 3)  # scoring changes no token
    assert_idle_clean(engine_llm)


def test_a_cached_prompt_is_computed_again_to_be_scored(engine_llm):
    p = prompts(45, seed=22)[0]
    engine_llm.generate([p], SamplingParams(temperature=0, max_tokens=2))  # now in the prefix cache
    out = engine_llm.generate([p], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0
    _check(p, out.prompt_logprobs, 0)
    again = engine_llm.generate([p], SamplingParams(temperature=0, max_tokens=2))[0]
    assert again.num_cached_tokens > 0 and again.prompt_logprobs is None
    assert_idle_clean(engine_llm)


def test_samples_report_the_prompt_once(engine_llm):
    p = prompts(30, seed=23)[0]
    out = engine_llm.generate([p], SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=2, prompt_logprobs=1))[0]
    assert len(out.outputs) == 2
    _check(p, out.prompt_logprobs, 1)
    assert_idle_clean(engine_llm)


def test_retracted_request_keeps_its_first_scores():
    pl = PromptLogprobs([5, 6, 7, 8], 1)
    arr = lambda v: (np.full((1, 4), v, np.float32), np.ones((1, 4), np.int32), np.zeros((1, 4, 1), np.int32),
                     np.full((1, 4, 1), v, np.float32))
    pl.add(arr(-1.0), 0, 0, 2)  # positions 0, 1 -> entries 1, 2
    assert not pl.complete and pl.missing == 1
    pl.add(arr(-2.0), 0, 0, 4)  # computed again from 0 (a retraction), past the prompt
    assert pl.complete and [e[0] if e else None for e in pl.entries] == [None, -1.0, -1.0, -2.0]


def test_bad_prompt_logprobs_names_the_field():
    with pytest.raises(ValueError, match="^prompt_logprobs="):
        SamplingParams(prompt_logprobs=21)


def test_a_sliding_window_model_scores_past_its_window():
    """Gemma 3's fixture (sliding-window layers): a 75-token prompt in 32-token passes, past the
    window, scored as the cache-free forward scores it."""
    from pathlib import Path

    from umem_jax import LLM
    from umem_jax.models.loader import load_model

    m = load_model(str(Path(__file__).parents[1] / "fixtures" / "gemma3_tiny"))
    gemma = LLM(m, arena_bytes=512 << 10, max_num_seqs=4, max_num_batched_tokens=32, page_size=4, max_model_len=256,
                batch_buckets=(4,), token_buckets=(32,), page_buckets=(64,))
    p = [t % 120 + 3 for t in prompts(75, seed=24)[0]]
    out = gemma.generate([p], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))[0]
    ref = np.asarray(jax.nn.log_softmax(m.dense_logits(m.params, jnp.asarray([p]))[0], axis=-1))
    got = [out.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))]
    np.testing.assert_allclose(got, ref[np.arange(len(p) - 1), p[1:]], rtol=1e-4, atol=1e-4)
    assert_idle_clean(gemma)
