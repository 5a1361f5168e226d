"""The rest of the OpenAI surface through the official `openai` client on the shared live server
(`srv`): logprobs (completions and chat, streamed and not), n / best_of, cached prompt tokens in
usage, /tokenize and /detokenize, seed, penalties, max_completion_tokens, response_format
refused -- and bad values answered with 400s that name the field.

The first logprobs request samples (temperature > 0): the step it compiles (random sampler,
top-20 logprobs) covers every later logprobs request here, greedy ones and logprobs=0 ones too
(runner: a covering compiled layout is reused), so the file compiles few step shapes."""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest
from _server_utils import MODEL, drained, engine_call

from umem_jax.api.logprobs import token_piece

KW = dict(model=MODEL, max_tokens=5, extra_body={"ignore_eos": True})


def _unique(n: int) -> str:
    """A prompt of n characters (n + 1 tokens with BOS) that no other test sent."""
    return (uuid.uuid4().hex * (n // 32 + 1))[:n]


def _hits(srv) -> int:
    return engine_call(srv, lambda e: e.scheduler.cache.stats()["hit_tokens"])


# ------------------------------------------------------------------------------ logprobs


def test_completion_logprobs_streamed_equal_the_response_and_are_consistent(srv):
    warm = srv.client.completions.create(prompt="warm up", temperature=0.5, seed=1, logprobs=5, **KW)
    assert len(warm.choices[0].logprobs.tokens) == 5
    kw = dict(prompt="Hello there", temperature=0, logprobs=3, **KW)
    lp = srv.client.completions.create(**kw).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    offset = 0
    for tok, chosen, top, at in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset):
        assert at == offset and chosen <= 0
        offset += len(tok)
        assert 1 <= len(top) <= 4 and top[tok] == pytest.approx(chosen)
        assert chosen == pytest.approx(max(top.values()))  # greedy: the chosen token is the most likely
    chunks = list(srv.client.completions.create(stream=True, **kw))
    streamed = {k: [x for c in chunks if c.choices[0].logprobs for x in getattr(c.choices[0].logprobs, k)]
                for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert streamed == {k: getattr(lp, k) for k in streamed}
    zero = srv.client.completions.create(prompt="Hello there", temperature=0, logprobs=0, **KW).choices[0].logprobs
    assert [list(t) for t in zero.top_logprobs] == [[t] for t in zero.tokens]
    assert srv.client.completions.create(prompt="Hello there", temperature=0, **KW).choices[0].logprobs is None


def test_chat_logprobs_match_completions_on_the_templated_prompt(srv):
    msgs = [{"role": "user", "content": "Hi there!"}]
    kw = dict(model=MODEL, messages=msgs, max_completion_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    r = srv.client.chat.completions.create(logprobs=True, top_logprobs=2, **kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    for entry in content:
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.bytes and all(0 <= b < 256 for b in entry.bytes)
    # the same prompt through /tokenize and /v1/completions: the same tokens and numbers
    ids = httpx.post(srv.url + "/tokenize", json={"model": MODEL, "messages": msgs}).json()["tokens"]
    assert len(ids) == r.usage.prompt_tokens
    comp = srv.client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, logprobs=2,
                                         extra_body={"ignore_eos": True}).choices[0].logprobs
    assert comp.token_logprobs == pytest.approx([e.logprob for e in content])
    chunks = list(srv.client.chat.completions.create(logprobs=True, top_logprobs=2, stream=True, **kw))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    # The repeats resume from the prefix cache (a shorter last pass): against the first response the
    # same tokens, and numbers up to the rounding of a differently shaped computation; among
    # themselves (the same path) exactly equal.
    again = srv.client.chat.completions.create(logprobs=True, top_logprobs=2, **kw).choices[0].logprobs.content
    flat = lambda es: [(e.token, e.bytes, [(t.token, t.bytes) for t in e.top_logprobs]) for e in es]
    nums = lambda es: [x for e in es for x in [e.logprob] + [t.logprob for t in e.top_logprobs]]
    assert flat(again) == flat(content) and nums(again) == pytest.approx(nums(content), rel=1e-5, abs=1e-5)
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in again]
    bare = srv.client.chat.completions.create(logprobs=True, **kw).choices[0].logprobs.content
    assert [e.top_logprobs for e in bare] == [[]] * 4 and [e.logprob for e in bare] == [e.logprob for e in again]
    assert srv.client.chat.completions.create(**kw).choices[0].logprobs is None


# ------------------------------------------------------------------------------ n, best_of, cached tokens


def test_n_samples_share_the_prompt_and_count_it_once(srv):
    prompt = _unique(40)  # 41 tokens: two full pages of 16 the samples share
    kw = dict(model=MODEL, prompt=prompt, temperature=0.8, seed=3, **{k: v for k, v in KW.items() if k != "model"})
    one = srv.client.completions.create(**kw)
    hits = _hits(srv)
    three = srv.client.completions.create(n=3, **kw)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.choices[0].text == one.choices[0].text  # sample 0 draws with the request's seed
    assert three.usage.prompt_tokens == 41 and three.usage.completion_tokens == 15
    assert three.usage.prompt_tokens_details.cached_tokens == 32  # (`one` cached the prompt's pages)
    assert _hits(srv) - hits == 3 * 32
    streamed: dict[int, str] = {}
    ends = {}
    for c in srv.client.completions.create(n=3, stream=True, **kw):
        for ch in c.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + ch.text
            ends[ch.index] = ch.finish_reason or ends.get(ch.index)
    assert streamed == {c.index: c.text for c in three.choices} and ends == {0: "length", 1: "length", 2: "length"}
    two = srv.client.completions.create(model=MODEL, prompt=[_unique(5), _unique(7)], n=2, max_tokens=2,
                                        temperature=0.8, extra_body={"ignore_eos": True})
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert two.usage.prompt_tokens == 6 + 8 and two.usage.completion_tokens == 8
    chat = srv.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                              max_completion_tokens=3, temperature=0.8, seed=4,
                                              extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 6
    assert drained(srv) == (0, 0, 0)


def test_best_of_returns_the_best_n_by_mean_logprob(srv):
    kw = dict(model=MODEL, prompt=_unique(20), temperature=1.0, seed=9, max_tokens=4, extra_body={"ignore_eos": True})
    drawn = srv.client.completions.create(n=4, logprobs=0, **kw).choices
    best = srv.client.completions.create(n=2, best_of=4, **kw)
    mean = lambda c: sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs)
    ranked = sorted(drawn, key=lambda c: (-mean(c), c.index))
    assert [(c.index, c.text) for c in best.choices] == [(0, ranked[0].text), (1, ranked[1].text)]
    assert best.choices[0].logprobs is None and best.usage.completion_tokens == 16
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.completions.create(n=2, best_of=4, stream=True, **kw)
    assert e.value.body["param"] == "best_of" and "stream" in e.value.body["message"]


def test_usage_reports_prompt_tokens_the_prefix_cache_served(srv):
    prompt = _unique(50)  # 51 tokens: the prefix cache can serve its first 48 (three pages)
    first = srv.client.completions.create(prompt=prompt, temperature=0, **KW).usage
    again = srv.client.completions.create(prompt=prompt, temperature=0, **KW).usage
    assert first.prompt_tokens_details.cached_tokens == 0
    assert again.prompt_tokens_details.cached_tokens == 48 and again.prompt_tokens == 51
    chunks = list(srv.client.completions.create(prompt=prompt, temperature=0, stream=True,
                                                stream_options={"include_usage": True}, **KW))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 48


# ------------------------------------------------------------------------------ tokenizer endpoints


def test_tokenize_and_detokenize(srv):
    post = lambda path, body: httpx.post(srv.url + path, json=body, timeout=60)
    r = post("/tokenize", {"model": MODEL, "prompt": "Hello", "return_token_strs": True}).json()
    assert r == {"count": 6, "max_model_len": srv.aeng.max_model_len, "tokens": r["tokens"],
                 "token_strs": ["<bos>", "H", "e", "l", "l", "o"]}
    assert post("/tokenize", {"prompt": "Hello", "add_special_tokens": False}).json()["tokens"] == r["tokens"][1:]
    assert post("/detokenize", {"model": MODEL, "tokens": r["tokens"]}).json() == {"prompt": "<bos>Hello"}
    for path, body, status, param in [("/detokenize", {"tokens": [5, 99999]}, 400, "tokens"),
                                      ("/tokenize", {}, 400, "prompt"),
                                      ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]},
                                       400, "prompt"),
                                      ("/tokenize", {"prompt": "x", "model": "nope"}, 404, "model")]:
        res = post(path, body)
        assert res.status_code == status and res.json()["error"]["param"] == param, res.text


# ------------------------------------------------------------------------------ sampling options


def test_seed_penalties_and_max_completion_tokens(srv):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, extra_body={"ignore_eos": True})
    a = srv.client.completions.create(temperature=1.0, seed=42, logprobs=0, **kw).choices[0].logprobs.tokens
    b = srv.client.completions.create(temperature=1.0, seed=42, logprobs=0, **kw).choices[0].logprobs.tokens
    c = srv.client.completions.create(temperature=1.0, seed=43, logprobs=0, **kw).choices[0].logprobs.tokens
    assert a == b and a != c
    msgs = [{"role": "user", "content": "Once upon a time"}]
    chat = dict(model=MODEL, messages=msgs, max_completion_tokens=12, temperature=0, logprobs=True,
                extra_body={"ignore_eos": True})
    ids = lambda r: [(e.token, tuple(e.bytes)) for e in r.choices[0].logprobs.content]  # a byte token's text is not unique
    plain = ids(srv.client.chat.completions.create(**chat))
    assert len(set(plain)) < len(plain), "the greedy output repeats no token: nothing for a penalty to change"
    pen = ids(srv.client.chat.completions.create(frequency_penalty=2.0, presence_penalty=2.0, **chat))
    assert pen != plain and len(set(pen)) == len(pen)  # a repeat costs 4 or more: none is chosen
    r = srv.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, max_completion_tokens=3,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("fmt", [{"type": "json_object"},
                                 {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}])
def test_response_format_other_than_text_is_refused_by_name(srv, fmt):
    msgs = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=2, response_format=fmt)
    assert e.value.body["param"] == "response_format" and fmt["type"] in e.value.body["message"]
    ok = srv.client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=2,
                                            response_format={"type": "text"})
    assert ok.usage.completion_tokens <= 2


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "n": 129}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 1}, "best_of"),
    ("/v1/completions", {"prompt": "x", "best_of": 0}, "best_of"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"7": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"seven": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"99999999": 1}},
     "logit_bias"),
])
def test_bad_values_are_openai_400s_naming_the_field(srv, path, body, param):
    r = httpx.post(srv.url + path, json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "BadRequestError" and err["code"] == 400
    assert err["message"].startswith(param), err
    assert json.loads(r.text)  # one JSON object


def test_logit_bias_steers_completions_and_chat(srv):
    """OpenAI's logit_bias: +100 on one token id makes greedy decoding repeat it, in both APIs."""
    a, b = (httpx.post(srv.url + "/tokenize", json={"model": MODEL, "prompt": c, "add_special_tokens": False},
                       timeout=60).json()["tokens"][0] for c in "AB")
    tok = srv.client.completions.create(prompt=_unique(16), temperature=0, logit_bias={str(a): 100}, **KW)
    assert tok.choices[0].text == "A" * 5
    chat = srv.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": _unique(8)}],
                                              temperature=0, max_completion_tokens=3, logit_bias={str(b): 100},
                                              extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == "BBB"


def test_vllm_sampling_extras_reach_the_engine(srv):
    """vLLM's allowed_token_ids (only those drawn), truncate_prompt_tokens (the prompt's last k
    tokens: a text over max_model_len is taken, and the usage counts k) and skip_special_tokens
    (false: the special tokens stay in the text), through both APIs."""
    a, b = (httpx.post(srv.url + "/tokenize", json={"model": MODEL, "prompt": c, "add_special_tokens": False},
                       timeout=60).json()["tokens"][0] for c in "AB")
    got = srv.client.completions.create(model=MODEL, prompt=_unique(16), temperature=0.9, seed=1, max_tokens=5,
                                        extra_body={"allowed_token_ids": [a, b], "ignore_eos": True})
    assert len(got.choices[0].text) == 5 and set(got.choices[0].text) <= {"A", "B"}
    long = "x" * 5000  # refused whole (max_model_len), taken truncated
    cut = srv.client.completions.create(model=MODEL, prompt=long, max_tokens=5,
                                        extra_body={"truncate_prompt_tokens": 7})
    assert cut.usage.prompt_tokens == 7 and cut.usage.completion_tokens <= 5
    chat = srv.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long}],
                                              max_completion_tokens=2, extra_body={"truncate_prompt_tokens": 9})
    assert chat.usage.prompt_tokens == 9
    bos = engine_call(srv, lambda e: e.tokenizer.bos_token_id)
    for skip, want in ((True, ""), (False, engine_call(srv, lambda e: e.tokenizer.decode([bos] * 3, False)))):
        r = srv.client.completions.create(prompt=_unique(8), temperature=0, max_tokens=3,
                                          extra_body={"allowed_token_ids": [bos], "ignore_eos": True,
                                                      "skip_special_tokens": skip}, model=MODEL)
        assert r.choices[0].text == want and r.usage.completion_tokens == 3
    assert want


def test_return_tokens_as_token_ids_writes_logprob_tokens_as_ids(srv):
    """vLLM's return_tokens_as_token_ids: the logprobs' tokens (chosen and top) are "token_id:N";
    the text, the logprobs and the completions' text offsets are what they are without it."""
    prompt = _unique(12)
    kw = dict(model=MODEL, prompt=prompt, temperature=0, max_tokens=4, logprobs=2)
    plain = srv.client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0]
    ids = srv.client.completions.create(**kw, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    ids = ids.choices[0]
    assert ids.text == plain.text and ids.logprobs.token_logprobs == plain.logprobs.token_logprobs
    assert ids.logprobs.text_offset == plain.logprobs.text_offset
    # each id is the chosen token: its text is the plain response's token text (id -> text is
    # one-valued; text -> id is not: two ids may decode alike, so /tokenize of the text may differ)
    assert all(t.startswith("token_id:") for t in ids.logprobs.tokens)
    chosen = [int(t.removeprefix("token_id:")) for t in ids.logprobs.tokens]
    assert engine_call(srv, lambda e: [token_piece(e.tokenizer, i)[0] for i in chosen]) == plain.logprobs.tokens
    # and by id, not only by text: greedy picks a most likely id, listed among the top ids with its logprob
    for c, lp, top in zip(chosen, ids.logprobs.token_logprobs, ids.logprobs.top_logprobs, strict=True):
        assert top[f"token_id:{c}"] == lp == max(top.values())
    assert all(all(k.startswith("token_id:") for k in top) for top in ids.logprobs.top_logprobs)
    msgs = [{"role": "user", "content": prompt}]
    chat = srv.client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_completion_tokens=3,
                                              logprobs=True, top_logprobs=1,
                                              extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(c.token.startswith("token_id:") and c.bytes == list(c.token.encode())
                                     for c in content)


def test_the_engine_is_clean_after_the_surface_tests(srv):
    assert drained(srv) == (0, 0, 0)
    engine_call(srv, lambda e: e.check_idle())


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(srv):
    """vLLM's stream_options.continuous_usage_stats: each chunk's usage counts the tokens streamed so far."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    for stream in (srv.client.completions.create(prompt=_unique(20), temperature=0, stream=True,
                                                 stream_options=opts, **KW),
                   srv.client.chat.completions.create(messages=[{"role": "user", "content": _unique(20)}],
                                                      temperature=0, stream=True, stream_options=opts, **KW)):
        chunks = [c for c in stream if c.choices]
        counts = [c.usage.completion_tokens for c in chunks if c.usage is not None]
        assert len(counts) == len(chunks) and counts == sorted(counts) and counts[-1] >= 1
        assert all(c.usage.prompt_tokens > 0 for c in chunks)
    plain = list(srv.client.completions.create(prompt=_unique(20), temperature=0, stream=True,
                                               stream_options={"include_usage": True}, **KW))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage is not None
