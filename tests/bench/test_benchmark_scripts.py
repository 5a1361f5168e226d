"""Every benchmark script under benchmarks/ runs as a module from the repository root and answers
--help (GPU-only ones included: their help must not need a GPU), as do the modes that hand over
to another module's options."""

from __future__ import annotations

import importlib

import pytest

SCRIPTS = ["bench_kernels", "bench_prefill", "bench_state", "bench_arena", "bench_models", "bench_engine",
           "bench_serving", "simulate_admission", "bench_allocator", "bench_tp", "bench_moe"]
MODES = [("bench_models", "--breakdown"), ("bench_models", "--memory-probe"), ("bench_engine", "--host"),
         ("bench_engine", "--parity")]


@pytest.mark.parametrize("argv", [(name,) for name in SCRIPTS] + MODES, ids=" ".join)
def test_help(argv, capsys):
    module = importlib.import_module(f"benchmarks.{argv[0]}")
    with pytest.raises(SystemExit) as stop:
        module.main([*argv[1:], "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--help" in out
    if len(argv) > 1:  # the mode's own parser, named after the command that reaches it
        assert f"benchmarks.{argv[0]} {argv[1]}" in out
