"""The HTTP server end to end: a real uvicorn on loopback, the official `openai` client, raw httpx
for the byte-level checks, and the engine's leak / invariant checks at the end.

One server (`srv`, conftest.py; tiny hybrid model, 1 MiB arena) serves the whole package, its
buckets pinned so that concurrent and one-at-a-time greedy outputs are bit-identical.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest
from _server_utils import MAX_SEQS, MODEL, client_aborts, drained, engine_call, live_memory, sse_events, wait_idle
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from umem_jax import cli
from umem_jax.engine.engine import BUDGET_MESSAGE


# ------------------------------------------------------------------------------ basic endpoints


def test_health_is_503_until_warm_then_200(srv):
    assert srv.health_before_start == 503
    assert httpx.get(srv.url + "/health").status_code == 200


def test_models_lists_the_served_name(srv):
    models = srv.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    raw = httpx.get(srv.url + "/v1/models").json()
    assert raw["object"] == "list" and raw["data"][0]["object"] == "model"
    assert raw["data"][0]["max_model_len"] == 4096


def test_completion_non_streaming_is_greedy_and_counts_usage(srv):
    kw = dict(model=MODEL, prompt="Hello there", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    a = srv.client.completions.create(**kw)
    b = srv.client.completions.create(**kw)
    assert a.object == "text_completion" and a.choices[0].finish_reason == "length"
    assert a.usage.prompt_tokens == len("Hello there") + 1  # byte tokenizer + BOS
    assert a.usage.completion_tokens == 5 and a.usage.total_tokens == a.usage.prompt_tokens + 5
    assert a.choices[0].text == b.choices[0].text


def test_completion_stream_framing_and_usage_chunk(srv):
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    events = sse_events(text)
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    choice_chunks = chunks[:-1]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in choice_chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in choice_chunks[:-1])
    streamed = "".join(c["choices"][0]["text"] for c in choice_chunks)
    ref = srv.client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert streamed == ref.choices[0].text


def test_completion_stream_through_openai_client(srv):
    stream = srv.client.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert chunks[-2].choices[0].finish_reason == "length"


def test_token_id_prompts_batches_and_vllm_extras(srv):
    # what `vllm bench serve --backend openai` sends, with a token-id prompt
    r = httpx.post(srv.url + "/v1/completions", json={
        "model": MODEL, "prompt": [1, 72, 105], "max_tokens": 3, "repetition_penalty": 1.0, "logprobs": None,
        "ignore_eos": True, "temperature": 0, "some_unknown_extra": {"x": 1}}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
    two = srv.client.completions.create(model=MODEL, prompt=["one", "two"], max_tokens=2, temperature=0,
                                        extra_body={"ignore_eos": True, "max_new_tokens": 7})
    assert [c.index for c in two.choices] == [0, 1] and two.usage.completion_tokens == 4


def test_chat_non_streaming_and_streaming(srv):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi!"}]
    a = srv.client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert a.object == "chat.completion" and a.choices[0].message.role == "assistant"
    assert a.usage.completion_tokens == 4 and a.choices[0].finish_reason == "length"
    chunks = list(srv.client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=4,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True},
                                                     stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert chunks[-2].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == a.choices[0].message.content


def test_stop_strings_are_never_streamed_and_batches_stream_by_index(srv):
    kw = dict(model=MODEL, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    # a two-character stop string from a greedy output (random weights: mostly invalid UTF-8,
    # so look for two clean characters); its tokens arrive one by one, so the first must be held
    for prompt in ("Hello there", "The quick brown fox", "abc", "0123"):
        ref = srv.client.completions.create(prompt=prompt, **kw).choices[0].text
        at = next((i for i in range(1, len(ref) - 1)
                   if "\ufffd" not in ref[i:i + 2] and ref[i:i + 2] not in ref[:i + 1]), None)
        if at is not None:
            break
    assert at is not None, "no clean two-character stop string in the greedy outputs"
    stop = ref[at:at + 2]  # its first occurrence starts at `at`
    full = srv.client.completions.create(prompt=prompt, stop=[stop], **kw).choices[0]
    assert (full.text, full.finish_reason, full.model_extra.get("stop_reason")) == (ref[:at], "stop", stop)
    chunks = list(srv.client.completions.create(prompt=prompt, stop=[stop], stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == ref[:at]
    assert chunks[-1].choices[0].finish_reason == "stop"
    kept = dict(stop=[stop], extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    with_stop = srv.client.completions.create(prompt=prompt, **{**kw, **kept}).choices[0]
    assert (with_stop.text, with_stop.finish_reason) == (ref[:at + 2], "stop")  # vLLM's option: the stop kept
    chunks = list(srv.client.completions.create(prompt=prompt, stream=True, **{**kw, **kept}))
    assert "".join(c.choices[0].text for c in chunks) == ref[:at + 2]
    two = list(srv.client.completions.create(prompt=["one", "two"], stream=True, **kw))
    ends = {c.choices[0].index: c.choices[0].finish_reason for c in two if c.choices[0].finish_reason}
    assert ends == {0: "length", 1: "length"}


# ------------------------------------------------------------------------------ errors


def _post(srv, path, body, raw=None):
    kw = {"content": raw, "headers": {"content-type": "application/json"}} if raw is not None else {"json": body}
    return httpx.post(srv.url + path, timeout=120, **kw)


@pytest.mark.parametrize("path,body,raw,status,param,needle", [
    ("/v1/completions", None, b'{"model": "tiny-test", "prompt": ', 400, None, "malformed JSON"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, None, 400, "temperature", "temperature=-1"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, None, 400, "max_tokens", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, None, 400, "top_p", "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, None, 400, "n", "n=0: must be in [1, 128]"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, None, 400, "suffix", "not supported"),
    ("/v1/completions", {"prompt": []}, None, 400, "prompt", "empty"),
    ("/v1/completions", {"prompt": [1, 99999]}, None, 400, "prompt", "vocabulary"),
    ("/v1/completions", None, b'{"model": "tiny-test", "prompt": "a\\ud800b"}', 400, "prompt", "lone surrogate"),
    ("/v1/chat/completions", None, b'{"model": "tiny-test", "messages": [{"role": "user", "content": "\\udfff"}]}',
     400, "messages", "lone surrogate"),
    ("/v1/completions", None, b'{"model": "tiny-test", "prompt": "x", "temperature": Infinity}', 400, "temperature",
     "finite"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, None, 400, "stream_options",
     "stream is true"),
    ("/v1/completions", {"prompt": "x", "guided_json": {"type": "object"}}, None, 400, "guided_json", "not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "truncate_prompt_tokens": 0}, None, 400,
     "truncate_prompt_tokens", "must be -1 (max_model_len) or at least 1"),
    ("/v1/completions", {"prompt": "x", "echo": True, "truncate_prompt_tokens": 4}, None, 400,
     "truncate_prompt_tokens", "not supported with echo"),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 10**6}, None, 400, "truncate_prompt_tokens",
     "at most max_model_len"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": []}, None, 400, "allowed_token_ids", "at least one"),
    ("/v1/completions", {"prompt": "x", "bad_words": ["a"]}, None, 400, "bad_words", "not supported"),
    ("/v1/completions", {"prompt": "x" * 5000}, None, 400, "prompt", "max_model_len"),
    ("/v1/completions", {"prompt": list(range(3, 4100))}, None, 400, "prompt", "max_model_len"),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 33}, None, 400, "stop", "at most 32 stop strings"),
    ("/v1/completions", {"prompt": "x", "stop": ["a" * 257]}, None, 400, "stop", "at most 256 characters"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [5] * 257}, None, 400, "stop_token_ids", "at most 256"),
    ("/v1/completions", {"prompt": "x", "priority": 2**31}, None, 400, "priority", "priority range"),
    ("/v1/completions", {}, None, 400, "prompt", "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}, None, 404, "model", "does not exist"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, None, 400, "stop", "non-empty"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", ""]}, None, 400, "stop", "non-empty"),
    ("/v1/completions", {"prompt": "x", "stop": ""}, None, 400, "stop", "non-empty"),
    ("/v1/completions", {"prompt": "x", "top_k": 2**40}, None, 400, "top_k", "vocabulary size"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 1, "stop_token_ids": [2**40]}, None, 400, "stop_token_ids",
     "vocabulary"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, None, 400, "stop_token_ids", "vocabulary"),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, None, 400, "seed", "seed="),
    ("/v1/chat/completions", {"messages": []}, None, 400, "messages", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, None, 400, "messages", "content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, None, 400, "messages", "content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 5000}]}, None, 400, "messages",
     "max_model_len"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None, 400,
     "messages", "not supported"),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(srv, path, body, raw, status, param, needle):
    if body is not None:
        body = {"model": MODEL, **body}
    r = _post(srv, path, body, raw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert needle in err["message"] and err["param"] == param
    ok = srv.client.completions.create(model=MODEL, prompt="still here", max_tokens=1)
    assert ok.usage.completion_tokens == 1


def test_prompt_over_the_memory_budget_is_400_with_the_engine_text(srv):
    prompt = "x" * 3999  # 4000 tokens: under max_model_len (4096), over the 1 MiB arena
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    assert e.value.status_code == 400
    assert e.value.body["message"] == BUDGET_MESSAGE.format(4000)
    assert "umem:num_aborted_requests_total" in httpx.get(srv.url + "/metrics").text
    assert drained(srv) == (0, 0, 0)


def test_overload_is_503(srv):
    srv.aeng.max_waiting_requests = 0  # every new request finds the waiting queue "full"
    try:
        with pytest.raises(openai.APIStatusError) as e:
            srv.client.completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert e.value.status_code == 503 and "overloaded" in e.value.body["message"]
    finally:
        srv.aeng.max_waiting_requests = 256
    assert srv.client.completions.create(model=MODEL, prompt="x", max_tokens=1).usage.completion_tokens == 1


# ------------------------------------------------------------------------------ load, disconnects, metrics


def test_64_concurrent_streams_match_one_at_a_time_greedy(srv):
    prompts = [f"Prompt {k}: tell me" for k in range(8)]
    kw = dict(model=MODEL, max_tokens=4, temperature=0)
    ref = {p: srv.client.completions.create(prompt=p, **kw).choices[0] for p in prompts}

    async def one(client, p):
        text, finish = "", None
        async for c in await client.completions.create(prompt=p, stream=True, **kw):
            text += c.choices[0].text
            finish = c.choices[0].finish_reason or finish
        return p, text, finish

    async def main():
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="EMPTY", max_retries=0, timeout=120)
        try:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, prompts[i % 8]) for i in range(MAX_SEQS))), 240)
        finally:
            await client.close()

    results = asyncio.run(main())
    assert len(results) == MAX_SEQS
    for p, text, finish in results:
        assert (text, finish) == (ref[p].text, ref[p].finish_reason)
    assert drained(srv) == (0, 0, 0)


def test_client_disconnect_mid_stream_aborts_and_frees_pages(srv):
    body = {"model": MODEL, "prompt": "a long answer please", "max_tokens": 2000, "ignore_eos": True,
            "temperature": 0, "stream": True}
    before = client_aborts(srv)
    assert drained(srv) == (0, 0, 0)
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
        # keep the line iterator referenced: dropping it (a `break` out of a for loop) closes
        # the connection right away, which is the disconnect this test makes later, on purpose
        lines = r.iter_lines()
        got = []
        while len(got) < 3:
            line = next(lines)
            if line.startswith("data: "):
                got.append(line)
        during = live_memory(srv)
        assert during[0] > 0 and during[1] >= 1, during  # it holds pages and its state slot while streaming
        assert all(json.loads(g[6:])["choices"][0]["finish_reason"] is None for g in got)
    # the connection is closed: starlette's disconnect listener ends the stream, whose cleanup
    # aborts the request in the engine (long before its 2000 tokens)
    wait_idle(srv, timeout=20)
    engine_call(srv, lambda e: e.check_idle())
    assert client_aborts(srv) == before + 1
    assert drained(srv) == (0, 0, 0)


def test_metrics_parse_and_move(srv):
    srv.client.completions.create(model=MODEL, prompt="count me", max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    r = httpx.get(srv.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    names = {k[0] for k in samples}
    for name in ("umem:num_requests_running", "umem:num_requests_waiting", "umem:kv_cache_usage_perc",
                 "umem:arena_band_held_bytes", "umem:arena_band_held", "umem:arena_band_available",
                 "umem:arena_band_usage_perc", "umem:num_retractions_total", "umem:num_compilations_total",
                 "umem:relocated_bytes_total", "umem:num_moved_pages_total", "umem:num_compactions_total",
                 "umem:num_evictions_total",
                 "umem:time_to_first_token_seconds_count", "umem:inter_token_latency_seconds_count",
                 "umem:e2e_request_latency_seconds_count", "umem:prompt_tokens_total",
                 "umem:generation_tokens_total", "umem:request_success_total"):
        assert name in names, name
    bands = {dict(k[1])["band"]: dict(k[1]) for k in samples if k[0] == "umem:arena_band_held"}
    assert bands["window16"]["window"] == "16" and bands["window16"]["unit"] == "pages"
    assert bands["state"]["unit"] == "slots" and bands["full"]["kind"] == "full"
    get = lambda n: sum(v for k, v in samples.items() if k[0] == n)
    assert get("umem:generation_tokens_total") >= 3 and get("umem:prompt_tokens_total") > 0
    assert get("umem:time_to_first_token_seconds_count") >= 1 and get("umem:inter_token_latency_seconds_count") >= 2
    assert get("umem:num_compilations_total") >= 2
    assert get("umem:arena_total_bytes") == 1 << 20
    # at idle the band gauges are the allocator's numbers of that moment, exactly
    wait_idle(srv)
    held = engine_call(srv, lambda e: {k: (v.held, v.held_bytes) for k, v in e.allocator.usage().subpools.items()})
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)}
    gauge = lambda name: {s.labels["band"]: s.value for s in fams[name].samples}
    assert {k: v[0] for k, v in held.items()} == gauge("umem:arena_band_held")
    assert {k: v[1] for k, v in held.items()} == gauge("umem:arena_band_held_bytes")


# Integer fields of a completion request, each sent with extreme values: out-of-range ones must
# be a 400 naming the field, never a 500 or an int32 overflow inside the engine.
INT_FIELDS = ("max_tokens", "max_new_tokens", "min_tokens", "n", "top_k", "seed", "priority", "logprobs", "best_of",
              "stop_token_ids")
EXTREME_INTS = st.one_of(st.sampled_from([0, 1, -1, 319, 320, 2**31 - 1, 2**31, -(2**31) - 1, 2**63 - 1, 2**63,
                                          -(2**63), -(2**63) - 1, 2**64 - 1, 2**64]),
                         st.integers(-(2**70), 2**70))


@settings(max_examples=25, deadline=None)
@given(fields=st.dictionaries(st.sampled_from(INT_FIELDS), EXTREME_INTS, min_size=1, max_size=3))
def test_extreme_integers_are_served_or_refused_naming_the_field(srv, fields):
    body = {"model": MODEL, "prompt": [5, 6, 7], "stream": True,
            **{k: [v] if k == "stop_token_ids" else v for k, v in fields.items()}}
    # streamed and left after the first event: an accepted max_tokens=2**40 would run for long;
    # leaving aborts it
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
        if r.status_code == 400:
            r.read()
            err = r.json()["error"]
            assert err["code"] == 400 and err["param"] in fields, err
        else:
            assert r.status_code == 200, r.read()
            first = next(line for line in r.iter_lines() if line)
            assert first.startswith("data: ") and "choices" in json.loads(first[len("data: "):]), first
    ok = srv.client.completions.create(model=MODEL, prompt="still here", max_tokens=1)
    assert ok.usage.completion_tokens == 1


def test_engine_is_idle_clean_at_the_end(srv):
    wait_idle(srv)
    engine_call(srv, lambda e: e.check_idle())
    assert drained(srv) == (0, 0, 0)
    engine_call(srv, lambda e: e.check_idle())
    assert srv.aeng.error is None


# ------------------------------------------------------------------------------ CLI refusals (no engine built)


def test_cli_refuses_unknown_model_and_bad_options(capsys):
    assert cli.main(["serve", "/no/such/model"]) == 2
    assert "umem-jax:" in capsys.readouterr().err
    assert cli.main(["generate", "tiny", "--prompt", "x", "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "tiny", "--load-format", "pt"])
    assert e.value.code == 2


def test_cli_refuses_other_jax_backends(monkeypatch, capsys):
    import jax

    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert cli.main(["serve", "tiny"]) == 2
    assert "unsupported platform" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_generate_and_serve_startup_print_plan_capacity_and_memory(monkeypatch, capsys):
    flags = ["--arena-bytes", str(4 << 20), "--max-num-seqs", "2", "--max-model-len", "256"]
    assert cli.main(["generate", "tiny", "--prompt", "Hi", "--max-tokens", "3", *flags]) == 0
    out = capsys.readouterr().out
    assert "grows down" in out and "capacity:" in out and "concurrent requests" in out
    assert "[3 tokens, finish_reason=length]" in out or "finish_reason=stop" in out
    assert "peak" in out and re.search(r"state +0 = +0 \+ +0 slots", out)  # nothing held after it
    seen = {}
    monkeypatch.setattr("umem_jax.api.server.serve", lambda aeng, names, **kw: seen.update(
        names=names, priority_range=aeng.engine.config.priority_range, **{k: v for k, v in kw.items() if k != "sock"}))
    monkeypatch.setenv("UMEM_JAX_API_KEY", "from-env")
    assert cli.main(["serve", "tiny", "--served-model-name", "my-tiny", "--port", "8123", "--priority-range", "-5",
                     "5", "--max-request-bytes", "1000", *flags]) == 0
    assert seen == {"names": ["my-tiny"], "host": "127.0.0.1", "port": 8123, "model_root": "tiny",
                    "api_key": "from-env", "max_request_bytes": 1000, "priority_range": (-5, 5)}
    assert "capacity:" in capsys.readouterr().out


def test_version_is_served_without_the_api_key():
    # vLLM's GET /version: scripts probe it before sending work; it sits outside /v1 like /health
    from fastapi.testclient import TestClient

    import umem_jax
    from umem_jax.api.server import build_app

    client = TestClient(build_app(object(), ["m"], api_key="k"))  # the engine is not touched
    got = client.get("/version")
    assert got.status_code == 200 and got.json() == {"version": umem_jax.__version__}
