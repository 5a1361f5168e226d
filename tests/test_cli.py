"""The README's main command (`umem-jax demo`) and `umem-jax plan`, run in-process."""

import pytest

from umem_jax import cli, demo


@pytest.mark.parametrize("mode", ["unified", "static"])
def test_demo_runs_the_scripted_workload_and_ends_clean(mode):
    lines = []
    d = demo.run(budget_mib=2.0, memory_mode=mode, out=lines.append)
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
        demo.run(budget_mib=2.0, memory_mode=mode, out=lines.append)
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
