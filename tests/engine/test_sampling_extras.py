"""vLLM's SamplingParams extras beside logit_bias: `allowed_token_ids` (only those ids may be
sampled: they take logit_bias' columns, with their biases, and the others' logits go to -inf),
`truncate_prompt_tokens` (the prompt's last k tokens, before its length is checked) and
`skip_special_tokens` (the output text keeps special tokens when false).  Greedy tokens are
checked against the dense forward's argmax over the allowed ids, with and without biases, beside
rows that ask for nothing; engine cases use test_engine.py's arena and buckets."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from _engine_utils import assert_idle_clean, dense_greedy, llm, prompts, tiny

from umem_jax import SamplingParams
from umem_jax.core.sampling_params import MAX_LOGIT_BIAS

N = 6


@pytest.fixture(scope="module")
def engine_llm():
    return llm(max_model_len=256)


def _masked_greedy(prompt: list[int], allowed: list[int], n: int, bias: dict[int, float] | None = None) -> list[int]:
    """Greedy continuation by the cache-free forward over `allowed` ids only (biases added first)."""
    m = tiny()
    seq, add = list(prompt), np.zeros(m.config.vocab_size, np.float32)
    for t, b in (bias or {}).items():
        add[t] = b
    mask = np.full(m.config.vocab_size, -np.inf, np.float32)
    mask[allowed] = 0.0
    for _ in range(n):
        toks = np.zeros((1, 128), np.int32)
        toks[0, : len(seq)] = seq
        logits = np.asarray(m.dense_logits(m.params, jnp.asarray(toks)))[0, len(seq) - 1]
        seq.append(int((logits + add + mask).argmax()))
    return seq[len(prompt):]


def test_params_check_the_new_fields():
    p = SamplingParams(allowed_token_ids=[9, "4", 9], logit_bias={7: 1.0, 9: 2.0})
    assert p.allowed_token_ids == [4, 9] and p.bias_ids == [4, 9]  # 7 can never be drawn: no column
    assert SamplingParams(logit_bias={7: 1.0, 3: 2.0}).bias_ids == [7, 3]
    for bad in ([], ["x"], [1.5], list(range(MAX_LOGIT_BIAS + 1))):
        with pytest.raises(ValueError, match="^allowed_token_ids="):
            SamplingParams(allowed_token_ids=bad)
    for bad in (0, -2, True):
        with pytest.raises(ValueError, match="^truncate_prompt_tokens="):
            SamplingParams(truncate_prompt_tokens=bad)


def test_allowed_rows_sample_only_their_ids_and_others_do_not_move(engine_llm):
    ps = prompts(9, 23, 14, 30, seed=21)
    plain = dense_greedy(ps, N)
    avoid = sorted({int(t) for t in plain[0]})  # the greedy path's own tokens left out
    allowed0 = [t for t in range(40, 80) if t not in avoid]
    allowed2 = [int(plain[2][0]), 200, 201]
    params = [SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, allowed_token_ids=allowed0),
              SamplingParams(temperature=0.8, seed=3, max_tokens=N, ignore_eos=True, allowed_token_ids=[11]),
              SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, allowed_token_ids=allowed2,
                             logit_bias={200: 40.0, 17: 100.0}),  # 17 biased but not allowed: never drawn
              SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)]
    outs = [o.outputs[0].token_ids for o in engine_llm.generate(ps, params)]
    assert outs[0] == _masked_greedy(ps[0], allowed0, N) and not set(outs[0]) & set(avoid)
    assert outs[1] == [11] * N  # one id allowed: sampled at any temperature
    assert outs[2] == _masked_greedy(ps[2], allowed2, N, {200: 40.0, 17: 100.0}) and 17 not in outs[2]
    assert outs[3] == plain[3]  # no mask, in the same steps as the masked rows
    assert_idle_clean(engine_llm)


def test_allowed_ids_keep_raw_logprobs_and_refuse_bad_ids(engine_llm):
    p = prompts(12, seed=4)[0]
    out = engine_llm.generate([p], SamplingParams(temperature=0, max_tokens=1, logprobs=2,
                                                  allowed_token_ids=[100]))[0].outputs[0]
    assert out.token_ids == [100] and np.isfinite(out.logprobs[0][100].logprob)
    assert out.logprobs[0][100].logprob < 0 and len(out.logprobs[0]) >= 3  # the model's own top ids too
    e = engine_llm.llm_engine
    vocab = tiny().config.vocab_size
    with pytest.raises(ValueError, match=rf"^allowed_token_ids=\[{vocab}\]: token ids must be in the vocabulary"):
        e.add_request(p, SamplingParams(allowed_token_ids=[3, vocab]))
    eos = min(e.eos_ids)
    with pytest.raises(ValueError, match="^allowed_token_ids: every allowed id is a stop token that min_tokens bans"):
        e.add_request(p, SamplingParams(min_tokens=2, allowed_token_ids=[eos]))
    assert not e.has_unfinished_requests()
    got = engine_llm.generate([p], SamplingParams(temperature=0, max_tokens=3, min_tokens=2,
                                                  allowed_token_ids=[eos, 100]))[0].outputs[0]
    assert got.token_ids[:2] == [100, 100]  # eos banned until min_tokens, then allowed again


def test_truncate_prompt_tokens_keeps_the_last_k(engine_llm):
    long = prompts(300, seed=5)[0]  # over max_model_len (256): refused whole, taken truncated
    short = long[-40:]
    want = dense_greedy([short[-24:]], N)[0]
    outs = engine_llm.generate([long, short, short[-24:]],
                               [SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, truncate_prompt_tokens=24),
                                SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, truncate_prompt_tokens=24),
                                SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, truncate_prompt_tokens=-1)])
    for o in outs:
        assert o.prompt_token_ids == short[-24:] and o.outputs[0].token_ids == want
    e = engine_llm.llm_engine
    with pytest.raises(ValueError, match="^prompt: 300 tokens leave no room"):
        e.add_request(long, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="^truncate_prompt_tokens=257: must be at most max_model_len=256"):
        e.add_request(short, SamplingParams(max_tokens=2, truncate_prompt_tokens=257))
    with pytest.raises(ValueError, match="^prompt: 256 tokens leave no room"):  # -1 keeps max_model_len of them
        e.add_request(long, SamplingParams(max_tokens=2, truncate_prompt_tokens=-1))
    assert not e.has_unfinished_requests()
    assert_idle_clean(engine_llm)


def test_skip_special_tokens_false_keeps_them_in_the_text(engine_llm):
    tok = engine_llm.llm_engine.tokenizer
    bos = tok.bos_token_id
    p = tok.encode("ab")
    # bos forced at the second token (min_tokens keeps nothing out: bos is no stop id)
    params = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, allowed_token_ids=[bos, tok.offset + 99],
                             logit_bias={bos: 100.0}, skip_special_tokens=skip) for skip in (True, False)]
    kept, dropped = (o.outputs[0] for o in engine_llm.generate([p, p], params)[::-1])
    assert kept.token_ids == dropped.token_ids == [bos] * 3
    assert dropped.text == "" and kept.text == tok.decode([bos] * 3, False) == "<bos>" * 3
