"""/v1/completions' echo, max_tokens 0 with echo (lm-eval's scoring request) and vLLM's
prompt_logprobs extra (api/echo.py), on the shared live server (`srv`): the echoed text is the
prompt's followed by the completion's; the prompt's logprobs equal log_softmax of the model's
cache-free forward, the first token's null; streams start each choice with the prompt; every
choice of n shows the primary's scores; bad values are 400s naming the field."""

from __future__ import annotations

import asyncio
import json
import math
import uuid

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _server_utils import MODEL, drained, engine_call

from umem_jax.api.echo import prompt_logprobs_json
from umem_jax.api.generation import _Run
from umem_jax.api.stream import RequestStream, StreamDelta
from umem_jax.core.prompt_logprobs import PromptLogprobs

KW = {"model": MODEL, "temperature": 0, "ignore_eos": True}


def _unique(n: int) -> str:
    return (uuid.uuid4().hex * (n // 32 + 1))[:n]


def _post(srv, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(srv.url + path, json={**KW, **body}, timeout=300)


def _ok(srv, body: dict) -> dict:
    r = _post(srv, body)
    assert r.status_code == 200, r.text
    return r.json()


def _ids(srv, text: str) -> list[int]:
    return httpx.post(srv.url + "/tokenize", json={"model": MODEL, "prompt": text}, timeout=60).json()["tokens"]


@pytest.fixture(scope="module")
def dense():
    """ids -> log_softmax [n, V] of the cache-free forward at each prompt position (the same
    random tiny model the server loads)."""
    from umem_jax.models.loader import load_model

    m = load_model("tiny")

    def run(ids: list[int]) -> np.ndarray:
        toks = np.zeros((1, 128), np.int32)
        toks[0, : len(ids)] = ids
        logits = jnp.asarray(m.dense_logits(m.params, jnp.asarray(toks)))[0, : len(ids)]
        return np.asarray(jax.nn.log_softmax(logits, axis=-1))

    return run


def _check_prompt_logprobs(got: list, ids: list[int], ref: np.ndarray, k: int) -> None:
    """vLLM's shape: null first, then {"<id>": {logprob, rank, decoded_token}} of the prompt token
    and the top k, against the dense forward."""
    assert len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        entry, t, row = got[p], ids[p], ref[p - 1]
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
        assert entry[str(t)]["logprob"] == pytest.approx(row[t], abs=1e-4)
        assert entry[str(t)]["rank"] == 1 + int((row > row[t]).sum())
        by_rank = {v["rank"]: v["logprob"] for v in entry.values()}
        assert len(entry) <= k + 1 and [by_rank[r] for r in range(1, k + 1)] == \
            pytest.approx(np.sort(row)[::-1][:k].tolist(), abs=1e-4)


def _check_offsets(lp: dict) -> None:
    offset = 0
    for tok, at in zip(lp["tokens"], lp["text_offset"]):
        assert at == offset
        offset += len(tok)


def test_echo_is_the_prompt_then_the_completion_with_the_prompts_logprobs_first(srv, dense):
    prompt = "Echo " + _unique(24)
    ids = _ids(srv, prompt)
    plain = _ok(srv, {"prompt": prompt, "max_tokens": 4, "logprobs": 2})["choices"][0]
    r = _ok(srv, {"prompt": prompt, "max_tokens": 4, "logprobs": 2, "echo": True, "prompt_logprobs": 3})
    c = r["choices"][0]
    assert c["text"] == prompt + plain["text"] and c["finish_reason"] == "length"
    assert r["usage"]["prompt_tokens"] == len(ids) and r["usage"]["completion_tokens"] == 4
    lp, n = c["logprobs"], len(ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = dense(ids)
    for p in range(1, n):  # the prompt's tokens, each given the ones before it; top: chosen + 2 at most
        assert lp["token_logprobs"][p] == pytest.approx(ref[p - 1, ids[p]], abs=1e-4)
        assert lp["tokens"][p] in lp["top_logprobs"][p] and len(lp["top_logprobs"][p]) <= 3
        assert max(lp["top_logprobs"][p].values()) == pytest.approx(ref[p - 1].max(), abs=1e-4)
    assert lp["tokens"][n:] == plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][n:] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-4)
    _check_offsets(lp)
    _check_prompt_logprobs(c["prompt_logprobs"], ids, ref, 3)  # its own k (3), not echo's (2)
    assert plain["prompt_logprobs"] is None


def test_prompt_logprobs_alone_and_a_token_id_prompt(srv, dense):
    ids = _ids(srv, "ids " + _unique(20))
    plain = _ok(srv, {"prompt": ids, "max_tokens": 3})["choices"][0]
    c = _ok(srv, {"prompt": ids, "max_tokens": 3, "prompt_logprobs": 0})["choices"][0]
    assert c["text"] == plain["text"] and c["logprobs"] is None  # the completion as without it
    _check_prompt_logprobs(c["prompt_logprobs"], ids, dense(ids), 0)
    decoded = srv.aeng.tokenizer.decode(ids)  # token ids echo their decoding (BOS dropped)
    echoed = _ok(srv, {"prompt": ids, "max_tokens": 3, "echo": True})["choices"][0]
    assert echoed["text"] == decoded + plain["text"] and echoed["logprobs"] is None
    assert decoded.startswith("ids ")
    batch = ["one " + _unique(8), "two " + _unique(8)]
    got = _ok(srv, {"prompt": batch, "max_tokens": 2, "echo": True})["choices"]
    assert [c["text"][: len(p)] for p, c in zip(batch, sorted(got, key=lambda c: c["index"]))] == batch


def test_max_tokens_zero_with_echo_scores_the_prompt_only(srv, dense):
    """lm-eval's loglikelihood request: the prompt back with its logprobs, nothing generated."""
    prompt = "Score " + _unique(16)
    ids = _ids(srv, prompt)
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
    r = _ok(srv, body)
    c = r["choices"][0]
    assert c["text"] == prompt and c["finish_reason"] == "length" and c["stop_reason"] is None
    assert r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] == len(ids)
    lp, ref = c["logprobs"], dense(ids)
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx([ref[p - 1, ids[p]] for p in range(1, len(ids))], abs=1e-4)
    _check_offsets(lp)
    events = list(srv.client.completions.create(stream=True, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                                model=MODEL, temperature=0))
    assert [(e.choices[0].text, e.choices[0].finish_reason) for e in events] == [(prompt, None), ("", "length")]
    assert events[0].choices[0].logprobs.token_logprobs == lp["token_logprobs"]
    sdk = srv.client.completions.create(prompt=prompt, max_tokens=0, echo=True, model=MODEL, temperature=0)
    assert sdk.choices[0].text == prompt and sdk.choices[0].logprobs is None and sdk.usage.completion_tokens == 0


def test_streamed_echo_starts_each_choice_with_the_prompt(srv):
    prompt = "Stream " + _unique(16)
    body = {"prompt": prompt, "max_tokens": 4, "logprobs": 2, "echo": True}
    whole = _ok(srv, body)["choices"][0]
    chunks = list(srv.client.completions.create(stream=True, model=MODEL, temperature=0,
                                                extra_body={"ignore_eos": True}, **body))
    first = chunks[0].choices[0]
    assert first.text == prompt and first.logprobs.token_logprobs[0] is None
    assert len(first.logprobs.tokens) == len(_ids(srv, prompt))
    assert "".join(c.choices[0].text for c in chunks) == whole["text"]
    for key in ("tokens", "text_offset", "token_logprobs"):
        streamed = [x for c in chunks if c.choices[0].logprobs for x in getattr(c.choices[0].logprobs, key)]
        assert streamed == whole["logprobs"][key], key


@pytest.mark.parametrize("stream", [False, True])
def test_every_choice_of_n_shows_the_primarys_prompt_scores(srv, stream):
    prompt = "Many " + _unique(12)
    body = {"prompt": prompt, "n": 3, "temperature": 0.8, "seed": 7, "max_tokens": 3, "echo": True, "logprobs": 1,
            "prompt_logprobs": 2, "stream": stream}
    if not stream:
        choices = _ok(srv, body)["choices"]
    else:
        with httpx.stream("POST", srv.url + "/v1/completions", json={**KW, **body}, timeout=300) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        firsts = {}
        for e in events[:-1]:
            c = json.loads(e)["choices"][0]
            firsts.setdefault(c["index"], c)  # the first chunk of each choice
        choices = [firsts[i] for i in range(3)]
    assert sorted(c["index"] for c in choices) == [0, 1, 2]
    assert all(c["text"].startswith(prompt) for c in choices)
    assert all(c["prompt_logprobs"] == choices[0]["prompt_logprobs"] for c in choices)
    n = len(_ids(srv, prompt))
    heads = [(c["logprobs"]["tokens"][:n], c["logprobs"]["token_logprobs"][:n]) for c in choices]
    assert all(h == heads[0] for h in heads) and heads[0][1][0] is None and None not in heads[0][1][1:]
    assert len(choices[0]["prompt_logprobs"]) == n


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1, "echo": True, "logprobs": 3}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": "all"}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 21},
     "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1, "stream": True},
     "prompt_logprobs"),
])
def test_bad_values_are_400s_naming_the_field(srv, path, body, param):
    r = _post(srv, body, path)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err


def test_chat_prompt_logprobs_score_the_templated_prompt(srv, dense):
    """vLLM's chat extra: the response's prompt_logprobs score the conversation as the chat
    template renders it, as the dense forward does; the choices are unchanged."""
    conv = [{"role": "user", "content": _unique(40)}]
    body = {"messages": conv, "max_tokens": 3}
    got = _ok_chat(srv, {**body, "prompt_logprobs": 2})
    plain = _ok_chat(srv, body)
    ids = engine_call(srv, lambda e: e.tokenizer.encode_chat(conv, True))
    ref = dense(ids)
    pl = got["prompt_logprobs"]
    assert len(pl) == len(ids) == got["usage"]["prompt_tokens"] and pl[0] is None
    for p in range(1, len(ids)):
        entry = pl[p][str(ids[p])]
        assert math.isclose(entry["logprob"], ref[p - 1, ids[p]], rel_tol=1e-4, abs_tol=1e-4)
        assert len(pl[p]) <= 3 and {v["rank"] for v in pl[p].values()} >= {1, 2}
    assert got["choices"][0]["message"] == plain["choices"][0]["message"] and plain.get("prompt_logprobs") is None


def test_chat_continues_and_echoes_the_final_message(srv):
    """vLLM's chat extras: continue_final_message (with add_generation_prompt false) renders the
    chat up to the last message's content, as /tokenize says; with echo the answer starts with
    that message (in its role), then the tokens the request draws without echo, streamed alike.
    After a generation prompt the last message is the user's: echo adds nothing.  Both flags at
    once: a 400 naming continue_final_message."""
    last = _unique(12)
    conv = [{"role": "user", "content": _unique(20)}, {"role": "assistant", "content": last}]
    body = {"messages": conv, "max_tokens": 4, "add_generation_prompt": False, "continue_final_message": True}
    plain, echo = _ok_chat(srv, body), _ok_chat(srv, {**body, "echo": True})
    ids = httpx.post(srv.url + "/tokenize", json={"model": MODEL, "messages": conv, "add_generation_prompt": False,
                                                  "continue_final_message": True}, timeout=60).json()["tokens"]
    assert ids == engine_call(srv, lambda e: e.tokenizer.encode_chat(conv, False, True))
    assert ids != engine_call(srv, lambda e: e.tokenizer.encode_chat(conv, False))  # the turn's end is cut
    assert plain["usage"]["prompt_tokens"] == echo["usage"]["prompt_tokens"] == len(ids)
    msg = echo["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"] == last + plain["choices"][0]["message"]["content"]
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**KW, **body, "echo": True, "stream": True},
                      timeout=300) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[1]["content"] == last
    assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
    asked = {"messages": conv[:1], "max_tokens": 3}
    echoed = _ok_chat(srv, {**asked, "echo": True})["choices"][0]["message"]
    assert echoed == _ok_chat(srv, asked)["choices"][0]["message"]
    user_turn = _ok_chat(srv, {"messages": conv[:1], "max_tokens": 2, "add_generation_prompt": False, "echo": True})
    assert user_turn["choices"][0]["message"]["role"] == "user"  # the answer goes on in the last message's role
    assert user_turn["choices"][0]["message"]["content"].startswith(conv[0]["content"])
    r = _post(srv, {**body, "add_generation_prompt": True}, "/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text
    for extra, param in (({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                         ({"chat_template": "{{ 1 }}"}, "chat_template")):  # vLLM refuses a request's own template
        r = _post(srv, {"messages": conv[:1], **extra}, "/v1/chat/completions")
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    kw = _ok_chat(srv, {**asked, "chat_template_kwargs": {"enable_thinking": False}})  # a variable this one ignores
    assert kw["choices"][0]["message"] == echoed


def test_reasoning_effort_is_a_template_variable(srv):
    """OpenAI's reasoning_effort reaches the chat template as a variable of that name (gpt-oss's
    template reads it; chat_template_kwargs may set it too, and win); other values are a 400."""
    from umem_jax.api.protocol import ChatCompletionRequest

    msgs = [{"role": "user", "content": "x"}]
    assert ChatCompletionRequest(messages=msgs, reasoning_effort="low").template_kwargs() == {"reasoning_effort": "low"}
    both = ChatCompletionRequest(messages=msgs, reasoning_effort="low",
                                 chat_template_kwargs={"reasoning_effort": "high"})
    assert both.template_kwargs() == {"reasoning_effort": "high"}
    assert ChatCompletionRequest(messages=msgs).template_kwargs() is None
    r = _post(srv, {"messages": msgs, "reasoning_effort": "extreme"}, "/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text
    ok = _ok_chat(srv, {"messages": msgs, "max_tokens": 2, "reasoning_effort": "high"})
    assert ok["choices"][0]["message"]
    # /tokenize takes the same field and renders the same prompt (and refuses the same values)
    tok = httpx.post(srv.url + "/tokenize", json={"model": MODEL, "messages": msgs, "reasoning_effort": "high"},
                     timeout=60)
    assert tok.status_code == 200 and tok.json()["count"] == ok["usage"]["prompt_tokens"], tok.text
    r = _post(srv, {"model": MODEL, "messages": msgs, "reasoning_effort": "extreme"}, "/tokenize")
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text


def _ok_chat(srv, body: dict) -> dict:
    r = _post(srv, body, "/v1/chat/completions")
    assert r.status_code == 200, r.text
    return r.json()


def test_minus_infinity_is_written_as_the_floor():
    pl = PromptLogprobs([5, 6], 1)
    pl.entries[1] = (-math.inf, 7, [9], [-math.inf])
    got = [e if e is None else {i: lp.model_dump() for i, lp in e.items()} for e in prompt_logprobs_json(None, pl, 1)]
    assert got == [None, {"6": {"logprob": -9999.0, "rank": 7, "decoded_token": None},
                          "9": {"logprob": -9999.0, "rank": 1, "decoded_token": None}}]


def test_a_sibling_ahead_of_its_primary_waits_for_the_prompts_scores():
    """A stream holds a sample's deltas until its primary's first delta (which carries the
    prompt's scores) has gone out -- as when the primary was retracted and a sibling drew first."""
    async def order():
        q = asyncio.Queue()
        streams = [RequestStream(rid, 3, q) for rid in ("a", "a#1")]
        run = _Run(streams, 2, 2, q)
        pl = PromptLogprobs([5, 6, 7], 0)
        for d in (StreamDelta("a#1", "x", [9], "length"), StreamDelta("a", "y", [8], "length", prompt_logprobs=pl)):
            q.put_nowait(d)
        seen = [(s.sample, run.prompt_lp.get(s.prompt)) async for s, _ in run.deltas(None, hold=True)]
        return seen, pl

    seen, pl = asyncio.run(order())
    assert seen == [(0, pl), (1, pl)]


def test_the_engine_is_clean_after_the_echo_tests(srv):
    assert drained(srv) == (0, 0, 0)
    engine_call(srv, lambda e: e.check_idle())
