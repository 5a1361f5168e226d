"""benchmarks/bench_disagg.py: --small end to end on the CPU (two workers, the router and one engine
as processes, the tiny model; under --long), and the pieces the GPU run relies on that the tiny run does not
exercise: the preset's config.json, and a benchmark process that never imports JAX."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_help(capsys):
    from benchmarks import bench_disagg

    with pytest.raises(SystemExit) as stop:
        bench_disagg.main(["--help"])
    assert stop.value.code == 0 and capsys.readouterr().out.startswith("usage:")


def test_preset_config_is_the_registry_shape(tmp_path):
    """The config.json written for qwen3.5-4b-like reads back as registry's qwen3.5-4b-like."""
    from benchmarks.disagg_serve import model_files
    from umem_jax.models.registry import SHAPES, load_hf_config

    args, vocab = model_files("qwen3.5-4b-like", tmp_path)
    assert args[1:] == ["--load-format", "dummy"] and vocab == 248320
    assert load_hf_config(args[0]) == SHAPES["qwen3.5-4b-like"]("bfloat16")


def test_the_benchmark_process_never_imports_jax(tmp_path):
    """On a GPU, a JAX backend in the benchmark's own process would take 75% of the card before
    the servers start: the parts it runs before them import no JAX."""
    code = ("import sys; from pathlib import Path; from benchmarks import bench_disagg as b; "
            "from benchmarks.disagg_serve import model_files, word_tokenizer; "
            "a = b.parse([]); args, vocab = model_files(a.model, Path(sys.argv[1])); "
            "b.make_configs(a, args, word_tokenizer(320, Path(sys.argv[1]) / 't'), Path(sys.argv[1])); "
            "b.passes(a, 320); b._meta(a); print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"]


# Four processes compiling on two cores: 60-100 s, the CI's slowest test, for a benchmark whose
# path (router -> prefill -> decode) tests/disagg/test_router.py already runs in CI.
@pytest.mark.slow
def test_small_end_to_end(tmp_path):
    """--small: greedy outputs through the router equal the single engine's in every pass, both
    configurations have TTFT and ITL, page envelopes moved (bytes > 0, every part timed), both
    workers pass the idle leak check and the router needed no retry.  --sequential: on two shared
    cores the default (four processes start at once) took 50-110 s, one configuration at a time
    30-80 s (the default's orchestration differs only in starting and warming up both at once)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "benchmarks.bench_disagg", "--small", "--sequential", "--out", str(tmp_path)]
    out = subprocess.run(cmd,
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["outputs_equal"] is True and {"c1", "c4"} <= set(res["correctness"])
    assert all(v["equal"] == v["of"] > 0 for v in res["correctness"].values())
    rows = {(r["config"], r["pass"]): r for r in res["rows"] if r["kind"] == "pass"}
    for conf in ("router", "single"):
        for name in ("c1", "c4"):
            r = rows[(conf, name)]
            assert r["failed"] == 0 and r["output_tokens"] == r["requests"] * 12, r["errors"]
            assert r["ttft_ms"]["median"] > 0 and r["itl_ms"]["median"] is not None and r["output_tok_s"] > 0
    for name in ("c1", "c4"):
        ts = rows[("router", name)]["transfers"]
        assert [t["tokens"] for t in ts] == [16, 40, 100]
        assert all(t["bytes"] > 0 and t["send_gbps"] > 0 and t["install_ms"] is not None and t["http_ms"] is not None
                   for t in ts), ts
    assert all(v["ok"] and v["held"] == 0 for v in res["idle_check"].values()), res["idle_check"]
    assert res["router_stats"]["retries"] == 0 and res["router_stats"]["failed"] == 0
    assert {"prefill.log", "decode.log", "router.log", "single.log"} <= {p.name for p in tmp_path.iterdir()}
    assert "median TTFT by prompt length" in out.stdout and "outputs equal: True" in out.stdout
