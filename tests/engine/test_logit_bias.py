"""logit_bias (OpenAI's, vLLM's SamplingParams field): each row's biases are added to its logits
before the min_tokens bans and the sampler, and nowhere else -- greedy tokens are the argmax of
the dense forward's logits plus the bias, rows without a bias in the same steps are unchanged,
logprobs still report the model's own distribution, a ban still wins, and bad biases are
refused naming the field.  Engine cases use test_engine.py's arena and buckets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _engine_utils import assert_idle_clean, dense_greedy, llm, prompts, tiny

from umem_jax import SamplingParams
from umem_jax.core.sampling_params import MAX_LOGIT_BIAS
from umem_jax.runner.packing import LOGIT_BIAS_BUCKETS, logit_bias_bucket

N = 6


@pytest.fixture(scope="module")
def engine_llm():
    return llm()


def _biased_greedy(prompt: list[int], bias: dict[int, float], n: int) -> list[int]:
    """Greedy continuation by the cache-free forward with `bias` added to every step's logits."""
    m = tiny()
    seq = list(prompt)
    add = np.zeros(m.config.vocab_size, np.float32)
    for t, b in bias.items():
        add[t] = b
    for _ in range(n):
        toks = np.zeros((1, 128), np.int32)
        toks[0, : len(seq)] = seq
        logits = np.asarray(m.dense_logits(m.params, jnp.asarray(toks)))[0, len(seq) - 1]
        seq.append(int((logits + add).argmax()))
    return seq[len(prompt):]


def test_params_take_json_keys_and_refuse_bad_biases():
    assert SamplingParams(logit_bias={"50": 5, 7: -1.5}).logit_bias == {50: 5.0, 7: -1.5}
    assert SamplingParams(logit_bias={}).logit_bias is None
    for bad in ({"x": 1}, {1.5: 1}, {1: "high"}, {1: 101}, {1: float("nan")}, {True: 1},
                {i: 1 for i in range(MAX_LOGIT_BIAS + 1)}):
        with pytest.raises(ValueError, match="^logit_bias="):
            SamplingParams(logit_bias=bad)
    assert [logit_bias_bucket(n) for n in (0, 1, 16, 17, 300)] == [0, 16, 16, 64, 300]
    assert LOGIT_BIAS_BUCKETS[-1] == MAX_LOGIT_BIAS


def test_biased_rows_follow_the_biased_argmax_and_others_do_not_move(engine_llm):
    ps = prompts(7, 21, 33, 12, seed=8)
    plain = dense_greedy(ps, N)
    avoid = {plain[0][0]: -100.0, plain[0][1]: -30.0}  # the greedy path's first two tokens pushed down
    force = {5: 100.0}  # one token pushed above every other
    nudge = {int(t): 2.5 for t in plain[2][:3]} | {299: -7.0}
    params = [SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logit_bias=b)
              for b in (avoid, force, nudge, None)]
    outs = [o.outputs[0].token_ids for o in engine_llm.generate(ps, params)]
    assert outs[0] == _biased_greedy(ps[0], avoid, N) and outs[0][0] != plain[0][0]
    assert outs[1] == [5] * N
    assert outs[2] == _biased_greedy(ps[2], nudge, N)
    assert outs[3] == plain[3]  # no bias, in the same steps as the biased rows
    assert_idle_clean(engine_llm)


def test_logprobs_are_the_models_and_a_ban_beats_a_bias(engine_llm):
    """The chosen token's logprob is log_softmax of the raw logits (vLLM's raw logprobs), so a
    forced token shows its own low probability; min_tokens bans a stop token even at +100."""
    p = prompts(15, seed=9)[0]
    out = engine_llm.generate([p], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=0,
                                                  logit_bias={5: 100.0}))[0].outputs[0]
    m = tiny()
    toks = np.zeros((1, 128), np.int32)
    toks[0, : len(p)] = p
    ref = np.asarray(jax.nn.log_softmax(m.dense_logits(m.params, jnp.asarray(toks))[0, len(p) - 1]))
    assert out.token_ids == [5] and abs(out.logprobs[0][5].logprob - ref[5]) < 1e-4
    assert ref[5] < ref.max() - 1e-3  # it was not the model's own choice
    banned = engine_llm.generate([p], SamplingParams(temperature=0, max_tokens=4, min_tokens=3, stop_token_ids=[5],
                                                     logit_bias={5: 100.0}))[0].outputs[0]
    assert banned.token_ids[:3] != [5, 5, 5] and 5 not in banned.token_ids[:3]
    assert banned.token_ids[3:] == [5] and banned.finish_reason == "stop"  # the ban ends at min_tokens
    assert_idle_clean(engine_llm)


def test_out_of_vocabulary_ids_are_refused_and_lose_nothing(engine_llm):
    e = engine_llm.llm_engine
    vocab = tiny().config.vocab_size
    with pytest.raises(ValueError, match=rf"^logit_bias=\[{vocab}\]: token ids must be in the vocabulary"):
        e.add_request(prompts(5, seed=1)[0], SamplingParams(logit_bias={vocab: 1.0}))
    assert not e.has_unfinished_requests()
