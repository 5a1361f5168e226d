"""The offline engine end to end on the tiny hybrid (full + window + Mamba2), reference kernels.

Greedy generation must equal a dense-forward greedy loop; outputs, stops and errors must look
like vLLM's; the step must stop compiling after warmup; the arena must be clean at idle.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from _engine_utils import assert_idle_clean, compile_count, dense_greedy, llm, prompts, tiny

from hypothesis import example, given, settings
from hypothesis import strategies as st

from umem_jax import SamplingParams
from umem_jax.engine.engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# 5: shorter than a page row; 17: past the window (16); 40, 70: chunked (32-token passes)
MIXED = prompts(5, 17, 40, 70)


@pytest.fixture(scope="module")
def engine_llm():
    return llm()


def test_greedy_matches_dense_mixed_lengths(engine_llm):
    outs = engine_llm.generate(MIXED, GREEDY)
    ref = dense_greedy(MIXED, 12)
    for o, p, r in zip(outs, MIXED, ref):
        c = o.outputs[0]
        assert o.prompt_token_ids == p and o.finished
        assert c.token_ids == r
        assert c.finish_reason == "length" and c.stop_reason is None
        assert engine_llm.get_tokenizer().decode(c.token_ids).startswith(c.text)
    e = engine_llm.llm_engine
    assert e.num_steps["prefill"] >= 4 and e.num_steps["decode"] >= 11  # chunked, batched
    assert_idle_clean(engine_llm)


def test_static_mode_same_outputs():
    static = llm(memory_mode="static")
    assert static.llm_engine.regions is not None
    outs = static.generate(MIXED, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == dense_greedy(MIXED, 12)
    assert_idle_clean(static)


def test_compile_counter_stops_growing(engine_llm):
    """Each step shape compiles once per sampler variant the traffic needs (greedy, random,
    cuts: a static choice, see sampler.py); after that, other lengths and batch mixes in the
    same buckets compile nothing."""
    e = engine_llm.llm_engine
    engine_llm.generate(prompts(3, 33, 9, seed=1), GREEDY)  # warm: both shapes
    assert e.runner.num_compilations == 2  # one decode and one prefill shape
    engine_llm.generate(prompts(2, 30, 9, seed=4), SamplingParams(temperature=0.7, seed=4, max_tokens=9))
    _warm_moves(e)
    shapes, compiles = e.runner.num_compilations, compile_count()
    assert shapes == 4  # the same two shapes with the "random" sampler
    for seed in (2, 3):  # other lengths, other batch mixes, same buckets: nothing new
        engine_llm.generate(prompts(1, 20, 64, 2, seed=seed), SamplingParams(temperature=0.7, seed=seed, max_tokens=9))
        engine_llm.generate(prompts(2, 17, 40, seed=seed), GREEDY)
    assert e.runner.num_compilations == shapes
    assert compile_count() == compiles, "the steady state recompiled something"
    assert_idle_clean(engine_llm)


def _warm_moves(e):
    """Compile every sub-pool's page moves at every batch bucket up to its page count (batches
    of 0 -> 0 padding pairs: they copy nothing), as bench/driver.py's warm-up does: relocation
    compiles once per sub-pool and bucket on the first batch that the layout happens to need,
    which is the traffic's doing, not a step shape's."""
    from umem_jax.arena import apply_moves, move_bucket
    from umem_jax.memory.tables import Move

    for sp in e.plan.subpools:
        n, top = 16, move_bucket(e.runner.arena.num_pages(sp.name))
        while n <= top:
            zeros = np.zeros(n, np.int32)
            e.runner.arena = apply_moves(e.runner.arena, [Move(sp.name, zeros, zeros, sp.rows_per_page)],
                                         impl=e.runner.impl, interpret=e.runner.interpret)
            n *= 2


def test_stop_token_ids_eos_and_ignore_eos(engine_llm):
    p = MIXED[1]
    ref = dense_greedy([p], 12)[0]
    t = ref[3]
    first = ref.index(t)
    out = engine_llm.generate(p, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[t]))[0].outputs[0]
    assert out.token_ids == ref[:first + 1] and out.finish_reason == "stop" and out.stop_reason == t
    e = engine_llm.llm_engine
    saved = e.eos_ids
    try:
        e.eos_ids = {t}  # pretend the model's EOS is the token it is about to produce
        out = engine_llm.generate(p, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
        assert out.token_ids == ref[:first + 1] and out.finish_reason == "stop" and out.stop_reason is None
        out = engine_llm.generate(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
        assert out.token_ids == ref and out.finish_reason == "length"
        # min_tokens: the EOS is banned (logits masked) until min_tokens tokens exist
        sp = SamplingParams(temperature=0, max_tokens=12, min_tokens=first + 2)
        req_out = engine_llm.generate(p, sp)[0].outputs[0]
        assert t not in req_out.token_ids[: first + 2] and len(req_out.token_ids) >= first + 2
    finally:
        e.eos_ids = saved
    assert_idle_clean(engine_llm)


def test_min_tokens_bans_many_stop_ids(engine_llm):
    """min_tokens keeps every stop id out (EOS ids included), not only the first four: models ship
    several EOS ids and users add their own stop ids; more than the runner's columns is refused."""
    p = MIXED[0]
    ref = dense_greedy([p], 12)[0]
    vocab = engine_llm.llm_engine.model.config.vocab_size
    stops = list(dict.fromkeys(ref))[:4]
    stops += [int(t) for t in np.random.default_rng(7).choice(np.setdiff1d(np.arange(vocab), stops), 5, replace=False)]
    assert ref[0] in stops  # the greedy's first token, banned until min_tokens
    out = engine_llm.generate(p, SamplingParams(temperature=0, max_tokens=12, min_tokens=6,
                                                stop_token_ids=stops))[0].outputs[0]
    assert len(out.token_ids) >= 6 and not set(out.token_ids[:6]) & set(stops), (out.token_ids, stops)
    too_many = list(range(3, 3 + engine_llm.llm_engine.runner.banned_per_row + 1))
    with pytest.raises(ValueError, match="min_tokens with more than"):
        engine_llm.generate(p, SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=too_many))
    assert_idle_clean(engine_llm)


def test_stop_strings_without_a_tokenizer_are_refused(engine_llm):
    """Without a tokenizer no text is made, so a stop string could never end the request: refused
    at arrival (it was silently ignored), nothing else touched."""
    e = engine_llm.llm_engine
    saved = e.tokenizer
    try:
        e.tokenizer = None
        with pytest.raises(ValueError, match="stop strings need a tokenizer"):
            e.add_request([5, 6, 7], SamplingParams(max_tokens=3, stop=["x"]))
        out = engine_llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, stop_token_ids=[9]))
        assert len(out[0].outputs[0].token_ids) >= 1
    finally:
        e.tokenizer = saved
    assert_idle_clean(engine_llm)


def test_stop_strings_on_text_prompts(engine_llm):
    tok = engine_llm.get_tokenizer()
    text_prompt = "The quick brown fox"
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = engine_llm.generate(text_prompt, sp)[0]
    assert full.prompt == text_prompt and full.prompt_token_ids == tok.encode(text_prompt)
    text = full.outputs[0].text
    assert len(text) >= 4, f"the tiny model produced too little text to test stop strings: {text!r}"
    stop = text[2:4]
    out = engine_llm.generate(text_prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                          stop=[stop, "\x00never"]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    assert full.outputs[0].token_ids[: len(out.token_ids)] == out.token_ids
    assert_idle_clean(engine_llm)


def test_bad_inputs_raise_and_lose_nothing(engine_llm):
    e: LLMEngine = engine_llm.llm_engine
    good = MIXED[:2]
    ids = [e.add_request(p, GREEDY) for p in good]
    for _ in range(3):
        e.step()
    bad_params = SamplingParams(temperature=0)
    bad_params.top_p = 0.0  # mutated after construction: validated again on arrival
    bad_logprobs = SamplingParams(logprobs=2)
    bad_logprobs.logprobs = 21  # above the 20 alternatives the sampler computes
    bad = [("", GREEDY), ([], GREEDY), ([5, 320], GREEDY), ([-1, 4], GREEDY), ([5, 6], bad_params),
           ([7] * 1024, GREEDY), (3.5, GREEDY), ([True, 5], GREEDY), ([5], bad_logprobs)]
    for prompt, params in bad:
        with pytest.raises(ValueError):
            e.add_request(prompt, params)
    with pytest.raises(ValueError, match="already in use"):
        e.add_request([5, 6], GREEDY, request_id=ids[0])
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    outs = {}
    while e.has_unfinished_requests():
        for o in e.step():
            outs[o.request_id] = o
    assert sorted(outs) == sorted(ids)
    assert [outs[i].outputs[0].token_ids for i in ids] == dense_greedy(good, 12)
    # a bad prompt in a batch refuses the batch before anything is queued
    with pytest.raises(ValueError, match="prompt 1"):
        engine_llm.generate([MIXED[0], [999]], GREEDY)
    assert not e.has_unfinished_requests()
    assert_idle_clean(engine_llm)


def test_abort_mid_flight(engine_llm):
    e = engine_llm.llm_engine
    ids = [e.add_request(p, GREEDY) for p in MIXED[:3]]
    for _ in range(4):
        e.step()
    e.abort_request(ids[1])
    outs = {}
    while e.has_unfinished_requests():
        for o in e.step():
            outs[o.request_id] = o
    ref = dense_greedy(MIXED[:3], 12)
    assert outs[ids[1]].outputs[0].finish_reason == "abort"
    assert outs[ids[0]].outputs[0].token_ids == ref[0] and outs[ids[2]].outputs[0].token_ids == ref[2]
    assert_idle_clean(engine_llm)


def test_prompt_forms_and_chat(engine_llm):
    tok = engine_llm.get_tokenizer()
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    a, b, c = engine_llm.generate(["hi", {"prompt": "hi"}, {"prompt_token_ids": tok.encode("hi")}], sp)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    single = engine_llm.generate(tok.encode("hi"), sp)  # one token-id prompt
    assert len(single) == 1 and single[0].outputs[0].token_ids == a.outputs[0].token_ids
    chat = engine_llm.chat([{"role": "user", "content": "hello"}], sp)[0]
    assert chat.prompt_token_ids == tok.encode("user: hello\nassistant: ")
    assert len(chat.outputs[0].token_ids) == 3
    started = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "An apple"}]
    going_on = engine_llm.chat(started, sp, add_generation_prompt=False, continue_final_message=True)[0]
    assert going_on.prompt_token_ids == tok.encode("user: hello\nassistant: An apple")  # no end of its turn
    with pytest.raises(TypeError, match="unknown LLM arguments"):
        type(engine_llm)(tiny(), not_an_option=1)
    assert_idle_clean(engine_llm)


def test_penalties_match_dense(engine_llm):
    """The penalty variant of the step (host-built counts, read-back before packing)."""
    import jax.numpy as jnp
    import numpy as np
    from _engine_utils import DENSE_LEN

    from umem_jax.runner.sampler import apply_penalties

    p = MIXED[0]
    kw = dict(repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.5)
    got = engine_llm.generate(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **kw))[0]
    m, V = tiny(), tiny().config.vocab_size
    toks, out = np.zeros((4, DENSE_LEN), np.int32), []
    toks[0, :len(p)] = p
    for _ in range(8):
        n = len(p) + len(out)
        logits = m.dense_logits(m.params, jnp.asarray(toks))[0, n - 1][None]
        pc = np.bincount(p, minlength=V)[None].astype(np.float32)
        oc = np.bincount(out, minlength=V)[None].astype(np.float32) if out else np.zeros((1, V), np.float32)
        f = lambda x: jnp.asarray([x], jnp.float32)
        lg = apply_penalties(logits, pc, oc, f(kw["repetition_penalty"]), f(kw["presence_penalty"]),
                             f(kw["frequency_penalty"]))
        out.append(int(np.argmax(np.asarray(lg)[0])))
        toks[0, n] = out[-1]
    assert got.outputs[0].token_ids == out
    assert out != dense_greedy([p], 8)[0]  # the penalties changed something
    assert_idle_clean(engine_llm)


def test_engine_text_leaves_stop_token_out():
    m = llm()
    p = prompts(12)[0]
    full = m.generate([p], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    stop = full.token_ids[3]
    out = m.generate([p], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                         stop_token_ids=[stop]))[0].outputs[0]
    k = full.token_ids.index(stop)
    assert out.token_ids == full.token_ids[: k + 1] and out.stop_reason == stop
    tok = m.get_tokenizer()
    assert out.text == tok.decode(full.token_ids[:k]) and full.text == tok.decode(full.token_ids)


def test_include_stop_str_in_output_keeps_a_stop_tokens_text(engine_llm):
    """vLLM leaves a stop token's text out of the output text unless include_stop_str_in_output
    (its token id is in token_ids either way)."""
    rng = np.random.default_rng(23)
    tok = engine_llm.get_tokenizer()
    p = rng.integers(3 + 97, 3 + 123, 9).tolist()  # lower-case ASCII letters of the byte tokenizer
    full = engine_llm.generate([p], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    # an ASCII token after whole characters (the detokenizer holds back a character's first bytes)
    ids = full.token_ids
    k = next(i for i, t in enumerate(ids) if tok.decode([t]).isascii() and tok.decode([t]).isprintable()
             and tok.decode([t]) and not tok.decode(ids[:i]).endswith("\ufffd"))
    stop = full.token_ids[k]
    for keep in (False, True):
        out = engine_llm.generate([p], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop],
                                                      include_stop_str_in_output=keep))[0].outputs[0]
        assert out.token_ids == full.token_ids[: k + 1] and out.stop_reason == stop and out.finish_reason == "stop"
        assert out.text == tok.decode(full.token_ids[: k + 1 if keep else k]), keep
    assert_idle_clean(engine_llm)


def test_out_of_vocabulary_fields_are_refused_by_name(engine_llm):
    e: LLMEngine = engine_llm.llm_engine
    vocab = e.model.config.vocab_size
    for params, field in [(SamplingParams(top_k=vocab + 1), "top_k"), (SamplingParams(top_k=2**40), "top_k"),
                          (SamplingParams(min_tokens=2, stop_token_ids=[2**40]), "stop_token_ids"),
                          (SamplingParams(stop_token_ids=[vocab]), "stop_token_ids"),
                          (SamplingParams(stop_token_ids=[-1]), "stop_token_ids")]:
        with pytest.raises(ValueError, match=f"^{field}="):
            e.prepare([5, 6], params)
    assert not e.has_unfinished_requests()
    out = engine_llm.generate([[5, 6]], SamplingParams(temperature=0.7, top_k=vocab, seed=2**64 - 1, max_tokens=3))
    assert len(out[0].outputs[0].token_ids) == 3


def test_seeds_differing_in_high_bits_or_sign_draw_different_tokens(engine_llm):
    """A seed is 64 bits; the sampler's key word holds 31.  Seeds equal modulo 2**31 (5, 5 +
    2**31, 5 + 2**32; -1 and 2**31 - 1) must not share a stream, and each stays reproducible."""
    rng = np.random.default_rng(31)
    p = rng.integers(3, 300, 7).tolist()
    base = int(rng.integers(0, 2**20))
    seeds = [base, base + 2**31, base + 2**32, base + 2**63, -1, 2**31 - 1]  # (-1 is 2**64 - 1: one seed)

    def run(seed):
        sp = SamplingParams(temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True)
        return tuple(engine_llm.generate([p], sp)[0].outputs[0].token_ids)

    outs = [run(s) for s in seeds]
    assert len(set(outs)) == len(seeds), outs
    assert run(seeds[2]) == outs[2]
    assert_idle_clean(engine_llm)


# Integer fields of SamplingParams (and the request priority), each with extreme values.
INT_FIELDS = ("n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs", "stop_token_ids", "priority")
EXTREME_INTS = st.one_of(st.sampled_from([0, 1, -1, 319, 320, 2**31 - 1, 2**31, -(2**31) - 1, 2**63 - 1, 2**63,
                                          -(2**63), -(2**63) - 1, 2**64 - 1, 2**64]),
                         st.integers(-(2**70), 2**70))


@settings(max_examples=25, deadline=None)
@given(fields=st.dictionaries(st.sampled_from(INT_FIELDS), EXTREME_INTS, min_size=1, max_size=3))
@example(fields={"max_tokens": 375})  # under max_model_len, over what the 150 KiB arena holds beside the prompt
def test_extreme_integers_are_served_or_refused_naming_the_field(engine_llm, fields):
    """Either served (finished, in range) or refused naming one of the fields set: a ValueError,
    or -- for a max_tokens the arena cannot hold beside the prompt, found at arrival by the memory
    clip -- an aborted output whose error says so; the engine serves the next request either way."""
    kw = {k: [v] if k == "stop_token_ids" else v for k, v in fields.items() if k != "priority"}
    try:
        params = SamplingParams(temperature=0.7, **kw)
        res = engine_llm.generate([[5, 6, 7]], params, priority=[fields.get("priority", 0)])[0]
    except ValueError as err:
        named = re.match(r"(?:prompt \d+: )?(\w+)", str(err)).group(1)
        assert named in fields, err
    else:
        out = res.outputs[0]
        if out.finish_reason == "abort":  # refused at arrival: the arena's clip, which names max_tokens
            assert "max_tokens" in fields and not out.token_ids
            assert res.error.startswith("max_tokens=") and "does not fit the arena" in res.error, res.error
        else:
            vocab = engine_llm.llm_engine.model.config.vocab_size
            assert out.finish_reason in ("stop", "length") and all(0 <= t < vocab for t in out.token_ids)
            assert params.max_tokens is None or len(out.token_ids) <= params.max_tokens
    assert len(engine_llm.generate([[5, 6]], GREEDY)[0].outputs[0].token_ids) == 12
    assert_idle_clean(engine_llm)
