"""Logprobs: the sampler's token_logprobs against log_softmax, the engine's per-token logprobs
against the dense forward, and the step without logprobs unchanged (no top-k traced, same tokens)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _engine_utils import assert_idle_clean, dense_greedy, llm, prompts, tiny

from umem_jax import SamplingParams
from umem_jax.runner.sampler import LOGPROB_BUCKETS, logprob_bucket, token_logprobs


@pytest.fixture(scope="module")
def engine_llm():
    return llm()


@pytest.mark.parametrize("k", [0, 5, 20])
def test_token_logprobs_match_log_softmax(k):
    rng = np.random.default_rng(k)
    logits = rng.normal(0, 3, (6, 300)).astype(np.float32)
    logits[2, 7] = -np.inf  # a token the model rules out
    tokens = rng.integers(0, 300, 6).astype(np.int32)
    tokens[0] = int(logits[0].argmax())
    chosen, rank, ids, vals = (np.asarray(x) for x in token_logprobs(jnp.asarray(logits), jnp.asarray(tokens), k))
    ref = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    np.testing.assert_allclose(chosen, ref[np.arange(6), tokens], rtol=1e-5, atol=1e-5)
    want_rank = 1 + (logits > logits[np.arange(6), tokens][:, None]).sum(-1)
    assert rank.tolist() == want_rank.tolist() and rank[0] == 1
    assert ids.shape == (6, k) and vals.shape == (6, k) and ids.dtype == np.int32
    order = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    np.testing.assert_allclose(vals, np.take_along_axis(ref, order, -1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.take_along_axis(ref, ids, -1), vals, rtol=1e-5, atol=1e-5)


def test_logprob_buckets():
    assert [logprob_bucket(k) for k in (0, 1, 5, 20)] == [0, 20, 20, 20]
    assert LOGPROB_BUCKETS[-1] == 20
    with pytest.raises(ValueError, match="logprobs=21"):
        logprob_bucket(21)


def _dense_logprobs(prompt, out):
    """log_softmax of the cache-free forward at the positions that sampled `out`."""
    m = tiny()
    toks = np.zeros((1, 128), np.int32)
    seq = list(prompt) + list(out)
    toks[0, : len(seq)] = seq
    logits = np.asarray(m.dense_logits(m.params, jnp.asarray(toks)))[0]
    return np.asarray(jax.nn.log_softmax(jnp.asarray(logits[len(prompt) - 1: len(seq) - 1]), axis=-1))


def test_logprobs_change_no_token_and_rows_without_them_get_none(engine_llm):
    """A batch mixing rows with and without logprobs (random, greedy, top-k): every row's tokens
    are the ones the same batch gets without logprobs; logprobs=0 gives the chosen token only.
    (Runs before the greedy test, which then finds its step compiled: a covering sampler mode.)"""
    ps = prompts(7, 21, 33, seed=5)
    kinds = [dict(temperature=0.9, seed=11), dict(temperature=0),
             dict(temperature=0.7, top_k=20, seed=12)]
    plain = [o.outputs[0] for o in engine_llm.generate(ps, [SamplingParams(max_tokens=8, ignore_eos=True, **kw)
                                                            for kw in kinds])]
    asked = [SamplingParams(max_tokens=8, ignore_eos=True, logprobs=lp, **kw) for kw, lp in zip(kinds, (0, None, 3))]
    mixed = [o.outputs[0] for o in engine_llm.generate(ps, asked)]
    assert [c.token_ids for c in mixed] == [c.token_ids for c in plain]
    assert all(c.logprobs is None and c.cumulative_logprob is None for c in plain)
    assert mixed[1].logprobs is None
    assert [list(d) for d in mixed[0].logprobs] == [[t] for t in mixed[0].token_ids]
    assert all(len(d) in (3, 4) and all(v.logprob <= 0 for v in d.values()) for d in mixed[2].logprobs)
    assert_idle_clean(engine_llm)


def test_greedy_logprobs_match_the_dense_forward(engine_llm):
    ps = prompts(9, 40, seed=3)
    outs = engine_llm.generate(ps, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=4))
    assert [o.outputs[0].token_ids for o in outs] == dense_greedy(ps, 6)
    for p, o in zip(ps, outs):
        c = o.outputs[0]
        ref = _dense_logprobs(p, c.token_ids)
        assert len(c.logprobs) == len(c.token_ids) == 6
        for pos, (t, d) in enumerate(zip(c.token_ids, c.logprobs)):
            assert d[t].rank == 1  # greedy: the chosen token is the most likely
            top = np.argsort(-ref[pos], kind="stable")[:4]
            assert set(d) == set(top.tolist()) | {t} and len(d) <= 5
            for tid, lp in d.items():
                np.testing.assert_allclose(lp.logprob, ref[pos, tid], rtol=1e-4, atol=1e-4)
                assert lp.decoded_token == engine_llm.get_tokenizer().decode([tid], False)
            assert [d[int(i)].rank for i in top] == [1, 2, 3, 4]
        np.testing.assert_allclose(c.cumulative_logprob, sum(ref[i, t] for i, t in enumerate(c.token_ids)), rtol=1e-4)
    assert_idle_clean(engine_llm)


def test_the_step_without_logprobs_traces_no_top_k(engine_llm):
    runner = engine_llm.llm_engine.runner
    plain = runner.lower(runner.layout(4, 1, 256)).as_text()
    asked = runner.lower(runner.layout(4, 1, 256, logprobs=20)).as_text()
    assert "top_k" not in plain.lower() and "topk" not in plain.lower()
    assert "topk" in asked.lower().replace("_", "")
    assert plain.count("reduce") < asked.count("reduce")  # the log-sum-exp and the rank count
