"""`umem-jax bench serve` (umem_jax.bench.serve_*, datasets.py): datasets, arrivals and metrics on
their own, then the command against our server on loopback (tiny hybrid, _engine_utils'
arena and buckets): the printed block, the JSON, failures, the chat endpoint, and the sweep's
--dataset-name over HTTP."""

from __future__ import annotations

import asyncio
import json
import math
import re
import socket
import threading
import time
import types

import numpy as np
import pytest
from _engine_utils import SETTINGS, tiny

from umem_jax.bench import datasets as D
from umem_jax.bench.serve_client import Api, RequestOutput, run_requests
from umem_jax.bench.serve_metrics import block, calculate, parse_goodput, parse_percentiles

VOCAB = 320  # the tiny model's


def _args(**kw):
    base = {"dataset_name": "random", "dataset_path": None, "num_prompts": 8, "random_input_len": 20,
            "random_output_len": 6, "random_range_ratio": 0.0, "gsp_num_groups": 2, "gsp_prompts_per_group": 3,
            "gsp_system_prompt_len": 10, "gsp_question_len": 4, "gsp_output_len": 5, "sharegpt_output_len": None,
            "seed": 0}
    return types.SimpleNamespace(**{**base, **kw})


# ------------------------------------------------------------------------------ datasets


def test_random_lengths_follow_the_range_ratio_and_the_seed():
    reqs = D.random_requests(400, 100, 20, 0.25, VOCAB, seed=3)
    ins, outs = [r.prompt_len for r in reqs], [r.output_len for r in reqs]
    assert min(ins) >= 75 and max(ins) <= 125 and len(set(ins)) > 20 and 90 < np.mean(ins) < 110
    assert min(outs) >= 15 and max(outs) <= 25
    assert all(len(r.prompt) == r.prompt_len and all(D.LOW_ID <= t < VOCAB for t in r.prompt) for r in reqs)
    assert reqs == D.random_requests(400, 100, 20, 0.25, VOCAB, seed=3)
    assert reqs != D.random_requests(400, 100, 20, 0.25, VOCAB, seed=4)
    fixed = D.sample(_args(dataset_name="random-ids"), None, VOCAB)
    assert [(r.prompt_len, r.output_len, r.kind) for r in fixed] == [(20, 6, "random-ids")] * 8
    with pytest.raises(ValueError, match="range-ratio"):
        D.random_requests(4, 10, 4, 1.0, VOCAB)


def test_shared_prefix_groups_share_exactly_their_system_prompt():
    reqs = D.sample(_args(dataset_name="generated-shared-prefix", num_prompts=999), None, VOCAB)
    assert len(reqs) == 6 and all(r.prompt_len == 14 == len(r.prompt) and r.output_len == 5 for r in reqs)
    systems = {}
    for r in reqs:
        systems.setdefault(tuple(r.prompt[:10]), []).append(tuple(r.prompt[10:]))
    assert len(systems) == 2 and all(len(q) == 3 and len(set(q)) == 3 for q in systems.values())
    groups = [tuple(r.prompt[:10]) for r in reqs]
    assert groups != sorted(groups, key=groups.index)  # shuffled: the groups interleave


def test_sharegpt_reads_a_local_file_and_filters(tmp_path):
    conv = lambda a, b: {"conversations": [{"from": "human", "value": a}, {"from": "gpt", "value": b}]}
    data = [conv("hello there, how are you doing today?", "fine thanks, and you? " * 3),
            conv("hi", "too short a prompt to keep"),  # 1 estimated token: dropped
            {"conversations": [{"from": "human", "value": "only one turn in this one"}]},
            {"conversation": [{"role": "user", "content": "the role / content spelling works too"},
                              {"role": "assistant", "content": "yes it does work fine"}]},
            conv("x" * 5000, "a prompt over 1024 tokens is dropped")]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = D.sample(_args(dataset_name="sharegpt", dataset_path=str(path), num_prompts=10), None, VOCAB)
    assert sorted(r.prompt for r in reqs) == sorted([data[0]["conversations"][0]["value"],
                                                    data[3]["conversation"][0]["content"]])
    first = next(r for r in reqs if r.prompt.startswith("hello"))
    assert first.prompt_len == math.ceil(len(first.prompt) / 4) and first.output_len == math.ceil(66 / 4)
    fixed = D.sample(_args(dataset_name="sharegpt", dataset_path=str(path), sharegpt_output_len=3), None, VOCAB)
    assert {r.output_len for r in fixed} == {3}
    with pytest.raises(ValueError, match="no such file"):
        D.sample(_args(dataset_name="sharegpt", dataset_path=str(tmp_path / "none.json")), None, VOCAB)
    with pytest.raises(ValueError, match="--dataset-path"):
        D.sample(_args(dataset_name="sharegpt"), None, VOCAB)
    with pytest.raises(ValueError, match="--tokenizer"):
        D.sample(_args(dataset_name="sharegpt", dataset_path=str(path)), None, VOCAB, ids_only=True)


def test_client_tokenizer_decodes_random_prompts_and_counts_sharegpt(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["[UNK]", "[PAD]", "[BOS]", "[EOS]"] + [f"w{i}" for i in range(60)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece(prefix="##")
    tok.save(str(tmp_path / "tokenizer.json"))
    ct = D.ClientTokenizer(str(tmp_path))  # a directory holding tokenizer.json
    assert ct.vocab_size == 64 and ct.encode("w0 w5 w59") == [4, 9, 63] and ct.decode([4, 9]) == "w0 w5"
    reqs = D.sample(_args(num_prompts=5, random_range_ratio=0.5), ct, VOCAB)
    assert all(isinstance(r.prompt, str) and r.prompt_len == len(r.prompt.split()) for r in reqs)
    assert all(10 <= r.prompt_len <= 30 and set(r.prompt.split()) <= set(words[4:]) for r in reqs)
    ids = D.sample(_args(dataset_name="random-ids", num_prompts=2), ct, VOCAB)  # random-ids stay ids
    assert all(isinstance(r.prompt, list) and len(r.prompt) == 20 for r in ids)
    data = [{"conversations": [{"from": "human", "value": "w1 w2 w3 w4 w5"}, {"from": "gpt", "value": "w6 " * 7}]}]
    (tmp_path / "sg.json").write_text(json.dumps(data))
    (sg,) = D.sample(_args(dataset_name="sharegpt", dataset_path=str(tmp_path / "sg.json")), ct, VOCAB,
                     ids_only=True)
    assert (sg.prompt, sg.prompt_len, sg.output_len) == ([5, 6, 7, 8, 9], 5, 7)


def test_arrivals_poisson_gamma_and_burst():
    assert D.arrivals(5, math.inf) == [0.0] * 5
    for burstiness in (0.25, 1.0, 4.0):
        t = np.asarray(D.arrivals(8001, 50.0, burstiness, seed=1))
        gaps = np.diff(t)
        assert t[0] == 0 and np.all(gaps >= 0)
        assert abs(gaps.mean() - 1 / 50) < 0.1 / 50  # mean gap 1 / rate
        cv2 = gaps.var() / gaps.mean() ** 2  # gamma of shape k: squared coefficient of variation 1 / k
        assert abs(cv2 * burstiness - 1) < 0.15, (burstiness, cv2)
    with pytest.raises(ValueError, match="request-rate"):
        D.arrivals(3, 0.0)


# ------------------------------------------------------------------------------ metrics


def _out(ttft, gaps, tokens, success=True, prompt=10):
    o = RequestOutput(prompt, tokens, success=success, output_tokens=tokens if success else 0, ttft=ttft,
                      latency=ttft + sum(gaps), itl=list(gaps))
    o.chunk_times = [ttft + sum(gaps[:i]) for i in range(len(gaps) + 1)]
    return o


def test_metrics_match_their_definitions():
    outs = [_out(0.1, [0.02] * 4, 5), _out(0.3, [0.04] * 2, 3), _out(0.0, [], 0, success=False)]
    m = calculate(outs, 2.0, 2, percentiles=(50.0, 90.0), goodput={"ttft": 200.0, "tpot": 50.0})
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (2, 1, 20, 8)
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 4.0 and m["total_token_throughput"] == 14.0
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["p50_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_tpot_ms"] == pytest.approx(30.0) and m["median_itl_ms"] == pytest.approx(20.0)
    assert m["mean_itl_ms"] == pytest.approx((4 * 20 + 2 * 40) / 6)
    assert m["mean_e2el_ms"] == pytest.approx((180 + 380) / 2)
    assert m["request_goodput"] == 0.5  # the second misses the 200 ms TTFT SLO
    assert m["max_output_tokens_per_s"] == 8.0 and m["max_concurrent_requests"] == 2
    text = block(m, max_concurrency=4, request_rate=2.5)
    for line in ("Successful requests:                     2", "Failed requests:                         1",
                 "Maximum request concurrency:             4", "Request rate configured (RPS):           2.50",
                 "Request goodput (req/s):                 0.50", "P90 TTFT (ms):", "Median E2EL (ms):"):
        assert line in text, line
    assert text.splitlines()[0] == "=" * 12 + " Serving Benchmark Result " + "=" * 12
    empty = calculate([_out(0.0, [], 0, success=False)], 1.0, 1)
    assert empty["mean_ttft_ms"] is None and "Mean TTFT (ms):                          n/a" in block(
        empty, max_concurrency=None, request_rate=math.inf)
    assert parse_goodput(["ttft:500", "e2el:2000"]) == {"ttft": 500.0, "e2el": 2000.0}
    for bad in (["ttft"], ["itl:5"], ["tpot:-1"], ["ttft:x"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)
    assert parse_percentiles("25,50,99.9") == [25.0, 50.0, 99.9]
    with pytest.raises(ValueError):
        parse_percentiles("0,101")


# ------------------------------------------------------------------------------ against our server


@pytest.fixture(scope="module")
def server():
    import uvicorn

    from umem_jax.api.async_engine import AsyncLLMEngine
    from umem_jax.api.metrics import EngineMetrics
    from umem_jax.api.server import build_app
    from umem_jax.engine.engine import EngineConfig, LLMEngine

    # every request here is greedy (temperature 0): warm-up compiles only that sampler variant
    aeng = AsyncLLMEngine(LLMEngine(EngineConfig(model=tiny(), **SETTINGS)), metrics=EngineMetrics("tiny"),
                          metrics_interval_s=0.05, warmup_sampling=("greedy",))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(build_app(aeng, ["tiny"]), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    aeng.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert aeng.wait_ready(120), aeng.error
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    srv.should_exit = True
    thread.join(15)
    sock.close()
    aeng.shutdown()


def _field(text: str, label: str) -> str:
    m = re.search(rf"^{re.escape(label)}\s+(\S+)\s*$", text, re.MULTILINE)
    assert m, f"{label!r} not in\n{text}"
    return m.group(1)


def test_bench_serve_block_and_json(server, tmp_path, capsys):
    from umem_jax import cli

    argv = ["bench", "serve", "--base-url", server + "/v1", "--dataset-name", "random-ids", "--num-prompts", "6",
            "--random-input-len", "12", "--random-output-len", "5", "--vocab-size", str(VOCAB), "--request-rate",
            "40", "--burstiness", "0.5", "--max-concurrency", "3", "--ignore-eos", "--goodput", "ttft:600000",
            "tpot:600000", "--metric-percentiles", "50,99", "--save-result", "--save-detailed", "--result-dir",
            str(tmp_path), "--result-filename", "r.json", "--disable-tqdm"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "Initial test run completed" in out
    assert _field(out, "Successful requests:") == "6" and _field(out, "Failed requests:") == "0"
    assert _field(out, "Maximum request concurrency:") == "3" and _field(out, "Total generated tokens:") == "30"
    assert _field(out, "Request rate configured (RPS):") == "40.00"
    assert 1 <= int(_field(out, "Peak concurrent requests:")) <= 3
    for name in ("TTFT", "TPOT", "ITL", "E2EL"):
        assert float(_field(out, f"Mean {name} (ms):")) > 0 and float(_field(out, f"P99 {name} (ms):")) > 0
        assert float(_field(out, f"P50 {name} (ms):")) <= float(_field(out, f"P99 {name} (ms):"))
    assert "umem-jax server over the run:" in out
    r = json.loads((tmp_path / "r.json").read_text())
    assert (r["completed"], r["failed"], r["num_prompts"], r["max_concurrency"]) == (6, 0, 6, 3)
    assert r["total_output_tokens"] == 30 and r["output_lens"] == [5] * 6 and r["output_tokens_source"] == "usage"
    assert r["total_input_tokens"] == sum(r["input_lens"]) >= 6 * 12  # the server's own prompt counts
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # SLOs every request meets
    assert r["model_id"] == "tiny" and r["endpoint"] == "/v1/completions" and r["request_rate"] == 40.0
    assert r["max_concurrent_requests"] <= 3 and r["p50_ttft_ms"] <= r["p99_ttft_ms"]
    from umem_jax.bench.serve_command import SERVER_COUNTERS

    assert set(r["server_counters"]) == set(SERVER_COUNTERS) and min(r["server_counters"].values()) >= 0
    for ttft, itl, e2e_start in zip(r["ttfts"], r["itls"], r["start_times"]):
        assert ttft > 0 and e2e_start >= 0 and all(g >= 0 for g in itl)
    assert r["duration"] * 1e3 >= r["mean_e2el_ms"] >= r["mean_ttft_ms"]


def test_failures_are_counted_and_a_bad_model_stops_at_the_initial_test(server, capsys):
    from umem_jax import cli

    ok = D.random_requests(2, 8, 3, 0.0, VOCAB, seed=1)
    too_long = D.random_requests(1, 1100, 3, 0.0, VOCAB, seed=2)  # over max_model_len=1024: a 400
    api = Api(server + "/v1/completions", "tiny", ignore_eos=True)
    outs, dur, peak = asyncio.run(run_requests(api, ok + too_long, [0.0] * 3, progress=False))
    assert [o.success for o in outs] == [True, True, False] and "HTTP 400" in outs[2].error
    m = calculate(outs, dur, peak)
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (2, 1, 6)
    assert "Failed requests:                         1" in block(m, max_concurrency=None, request_rate=math.inf)
    argv = ["bench", "serve", "--base-url", server, "--model", "no-such-model", "--dataset-name", "random-ids",
            "--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "2", "--vocab-size", str(VOCAB),
            "--ready-check-timeout-sec", "0", "--disable-tqdm"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "initial test run failed" in err and "HTTP 4" in err


def test_sharegpt_text_through_the_chat_endpoint(server, tmp_path, capsys):
    from umem_jax import cli

    prompts = ["Tell me about the arena.", "What is a page?", "Why unify the memory of hybrid models?"]
    data = [{"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": "an answer " * 4}]}
            for p in prompts]
    (tmp_path / "sg.json").write_text(json.dumps(data))
    argv = ["bench", "serve", "--base-url", server, "--backend", "openai-chat", "--dataset-name", "sharegpt",
            "--dataset-path", str(tmp_path / "sg.json"), "--sharegpt-output-len", "4", "--ignore-eos",
            "--percentile-metrics", "ttft,e2el", "--save-result", "--result-dir", str(tmp_path), "--disable-tqdm"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert _field(out, "Successful requests:") == "3" and _field(out, "Total generated tokens:") == "12"
    assert "Mean E2EL (ms):" in out and "Mean TPOT" not in out and "Inter-token Latency" not in out
    (path,) = tmp_path.glob("openai-chat-infqps-tiny-*.json")
    r = json.loads(path.read_text())
    # the server tokenized the text (its chat template adds tokens): more prompt tokens than characters / 4
    assert r["endpoint"] == "/v1/chat/completions" and r["request_rate"] == "inf"
    assert r["total_input_tokens"] > sum(math.ceil(len(p) / 4) for p in prompts)


def test_sweep_dataset_name_over_http(server, capsys):
    from umem_jax import cli

    argv = ["bench", "--server", server, "--model", "tiny", "--dataset-name", "generated-shared-prefix",
            "--gsp-num-groups", "2", "--gsp-prompts-per-group", "2", "--gsp-system-prompt-len", "16",
            "--gsp-question-len", "4", "--gsp-output-len", "3", "--vocab-size", str(VOCAB), "--no-progress"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "generated-shared-prefix: 4 requests, 4 gsp (mean 20 in / 3 out)" in out
    assert cli.main(["bench", "--workload", "mixed", "--dataset-name", "random"]) == 2
    assert "not both" in capsys.readouterr().err


def test_dataset_workload_keeps_its_prompts():
    from umem_jax.bench.workload import from_samples

    samples = D.shared_prefix_requests(2, 2, 6, 2, 3, VOCAB, seed=5)
    wl = from_samples("gsp", samples, [0.3, 0.1, 0.2, 0.0], seed=5)
    assert [r.arrival_s for r in wl.requests] == [0.0, 0.1, 0.2, 0.3]
    assert wl.prompts(VOCAB) == [samples[i].prompt for i in (3, 1, 2, 0)] and wl.max_len == 11
    with pytest.raises(ValueError, match="outside the vocabulary"):
        wl.prompts(10)
    with pytest.raises(ValueError, match="max_model_len=10"):
        from_samples("gsp", samples, [0.0] * 4, max_len=10)


def test_a_server_not_answering_is_said_while_the_initial_test_retries(capsys):
    import socket

    from umem_jax import cli

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--dataset-name",
            "random-ids", "--num-prompts", "1", "--random-input-len", "4", "--random-output-len", "1",
            "--vocab-size", "64", "--ready-check-timeout-sec", "1.5", "--disable-tqdm"]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out.count("retrying every second for up to 1.5 s (--ready-check-timeout-sec)") == 1, out
    assert "Connect" in out and "initial test run failed" in err
