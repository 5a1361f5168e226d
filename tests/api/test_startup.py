"""A start that says what it is doing (issue 20 item 3): `serve` reports loading, each group of
step shapes compiled with an ETA, and when it is ready; a CPU start compiles few shapes, a short
prompt's first; XLA's slow-compile alarm is kept off the console while warm-up compiles; and
`umem-jax cache` lists and clears what is kept on disk.  The compile check reuses the package
server's engine and its shapes; the rest compiles nothing."""

from __future__ import annotations

import io
import re
import time

import pytest
from _server_utils import engine_call

from umem_jax import cli
from umem_jax.core.scheduled_batch import Buckets
from umem_jax.engine import cache, startup, warmup
from umem_jax.models import loader


def _plain() -> tuple[startup.StartupReport, io.StringIO]:
    out = io.StringIO()
    return startup.StartupReport(stream=out, live=False), out


def test_plain_report_lines_phases_compiles_eta_and_ready():
    report, out = _plain()
    with report.phase("loading the weights of x"):
        pass
    with report.compiling(3, "compiling 3 step shapes") as advance:
        for i in range(3):
            advance(1, note=f"decode B=1 P={8 << i}")
    report.ready("ready: http://h:1/v1")
    lines = out.getvalue().splitlines()
    assert lines[0] == "umem-jax: loading the weights of x ..."
    assert re.fullmatch(r"umem-jax: loading the weights of x: done in \d+\.\d s", lines[1])
    assert lines[2] == "umem-jax: compiling 3 step shapes: 0/3 ..."
    for i in range(3):
        assert re.fullmatch(rf"umem-jax: compiling 3 step shapes: {i + 1}/3 in \d+ s, ETA \d+ s "
                            rf"\(decode B=1 P={8 << i}\)", lines[3 + i]), lines[3 + i]
    assert lines[6].startswith("umem-jax: compiling 3 step shapes: done in")
    assert re.fullmatch(r"umem-jax: ready: http://h:1/v1 \(start-up took \d+ s\)", lines[7])


def test_warm_up_reports_every_group_of_shapes(srv):
    report, out = _plain()
    with startup.reporting(report):  # warm-up runs on the engine thread: the report is process-wide
        n = engine_call(srv, lambda e: warmup.warm_up(e, max_shapes=2, threads=1, sampling=("greedy",)), timeout=600)
    assert startup.current() is None and n == 2
    text = out.getvalue()
    assert "compiling 2 step shapes x 1 samplers: 1/2 in" in text and "2/2 in" in text and "ETA" in text
    assert "compiling 2 step shapes x 1 samplers: done in" in text


def test_a_cpu_start_compiles_a_short_prompts_shapes_first():
    shapes = Buckets.default(256, 2048, 2048).reachable(2048, 16, 256, 2)
    assert warmup.order(shapes, cpu=False) == shapes  # a GPU: decode first, as reachable lists them
    first = warmup.order(shapes, cpu=True)[:warmup.CPU_WARMUP_SHAPES]
    assert first == [(1, 1, 8, 0), (1, 16, 8, 2), (1, 32, 8, 2), (1, 64, 8, 2)]  # <= 128 tokens, one request
    assert sorted(warmup.order(shapes, cpu=True)) == sorted(shapes)
    if warmup.on_cpu():
        assert warmup.resolve(None, None) == (4, "greedy,random")
    assert warmup.resolve(-1, "cuts") == (None, "cuts") and warmup.resolve(7, None)[0] == 7


def test_serve_defaults_leave_the_warm_up_to_the_backend():
    args = cli.parser().parse_args(["serve", "tiny"])
    assert args.warmup_shapes is None and args.warmup_sampling is None


@pytest.mark.parametrize("env, restored", [(None, 0), ("1", 1)])
def test_xla_alarm_is_quiet_while_warm_up_compiles(monkeypatch, env, restored):
    from jaxlib import utils

    calls = []
    monkeypatch.setattr(utils, "absl_set_min_log_level", calls.append)
    if env is None:
        monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", env)
    with warmup.quiet_xla_alarms(True):
        assert calls == [3]  # FATAL only: the alarm is an ERROR log
    assert calls == [3, restored]
    with warmup.quiet_xla_alarms(False):
        pass
    assert calls == [3, restored]


def test_ready_is_announced_once_the_server_engine_is_warm():
    report, out = _plain()

    class Warm:
        error, _thread, calls = None, object(), 0

        def wait_ready(self, timeout):
            self.calls += 1
            return self.calls >= 3

    startup.announce_when_ready(report, Warm(), "ready: http://x:2/v1")
    deadline = time.monotonic() + 10
    while "ready:" not in out.getvalue():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert out.getvalue().startswith("umem-jax: ready: http://x:2/v1 (start-up took")


def test_serve_prints_its_loading_phase(monkeypatch, capsys):
    monkeypatch.setattr("umem_jax.api.server.serve", lambda aeng, names, **kw: 0)
    assert cli.main(["serve", "tiny", "--port", "0", "--arena-bytes", str(2 << 20), "--max-num-seqs", "2",
                     "--max-num-batched-tokens", "32"]) == 0
    err = capsys.readouterr().err
    assert "umem-jax: loading the weights of tiny ..." in err and "loading the weights of tiny: done in" in err
    assert startup.current() is None  # serve took its report down


def test_cache_lists_and_clears_each_kind(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("UMEM_JAX_CACHE", str(tmp_path))
    (tmp_path / "xla").mkdir()
    (tmp_path / "xla" / "step").write_bytes(b"x" * 3000)
    (tmp_path / "m.gguf").write_bytes(b"g" * 2000)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.safetensors").write_bytes(b"w" * 5000)
    (tmp_path / "m" / ".complete").write_text("m.gguf")
    assert loader.converted(tmp_path / "m.gguf") and not loader.converted(tmp_path / "other.gguf")
    sizes = {p.name: n for p, _, n in cache.entries(tmp_path)}
    assert sizes == {"xla": 3000, "m.gguf": 2000, "m": 5000 + len("m.gguf")}
    assert cli.main(["cache"]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path) in out and "m.gguf" in out and "GGUF conversion" in out and "--clear" in out
    assert cache.clear(tmp_path, "gguf") == 2000 and sorted(p.name for p in tmp_path.iterdir()) == ["m", "xla"]
    assert cli.main(["cache", "--clear", "xla"]) == 0 and [p.name for p in tmp_path.iterdir()] == ["m"]
    assert cache.clear(tmp_path, "all") > 0 and not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="one of xla, gguf, models, all"):
        cache.clear(tmp_path, "weights")


def test_a_launch_that_compiles_its_step_is_quiet_and_the_next_is_not(monkeypatch):
    """A step shape warm-up left out compiles on its first launch: XLA's false alarms are kept
    off the console for that launch only (runner/xla_log.py)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from _engine_utils import SETTINGS, tiny

    from umem_jax import LLM, SamplingParams
    from umem_jax.runner import runner as runner_mod

    seen, real = [], runner_mod.quiet_xla_alarms
    monkeypatch.setattr(runner_mod, "quiet_xla_alarms", lambda enabled=True: (seen.append(enabled), real(enabled))[1])
    llm = LLM(tiny(), **SETTINGS)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    assert seen[:2] == [True, True] and not any(seen[2:]), seen  # prefill, first decode; later decodes reuse it
