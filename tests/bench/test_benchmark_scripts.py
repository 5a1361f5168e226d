"""Every benchmark script under benchmarks/ runs as a module from the repository root and answers
--help (GPU-only ones included: their help must not need a GPU), as do the modes that hand over
to another module's options."""

from __future__ import annotations

import importlib

import pytest

SCRIPTS = ["bench_kernels", "bench_prefill", "bench_state", "bench_arena", "bench_models", "bench_engine",
           "bench_serving", "simulate_admission", "bench_allocator", "bench_tp", "bench_moe", "bench_fp8_kv",
           "copy_limit", "bench_speculative", "bench_disagg", "bench_issue", "bench_decode_mgpu", "profile_decode"]
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


def test_copy_limit_is_the_fastest_exact_variant():
    """The roofline is the fastest trusted variant that wrote the right bytes (device_put is
    reported, never taken: its timing read above the card's peak), and every variant is reported."""
    from benchmarks.copy_limit import UNTRUSTED, copy_limit

    lim = copy_limit(1 << 20, iters=2, trials=2)
    rates = {k: v for k, v in lim.variants.items() if isinstance(v, float) and k not in UNTRUSTED}
    assert {"xla_xor", "xla_copy", "device_put"} <= set(lim.variants)
    assert lim.fastest in rates and lim.tbps == max(rates.values()) and lim.fastest not in UNTRUSTED
    assert lim.nbytes == 2 * (1 << 20) and abs(lim.seconds * lim.bytes_per_s - lim.nbytes) < 1e-6 * lim.nbytes


def test_bench_issue_runs_every_calling_pattern(capsys):
    """bench_issue --small: each calling pattern runs the same step on the tiny family (the
    donated and io patterns thread their buffers through the calls) and gets a row."""
    from benchmarks import bench_issue

    assert bench_issue.main(["--small", "--families", "gptoss", "--iters", "2", "--trials", "1"]) == 0
    table = capsys.readouterr().out.split("family                         mode")[-1]
    assert [line.split()[1] for line in table.strip().splitlines()[1:]] == list(bench_issue.MODES)


def test_decode_sweep_keeps_the_named_tilings():
    """bench_decode_mgpu --configs 128x2,128x3: the sweep's Mosaic tilings with those block sizes
    and ring depths (any split count or consumer count), all of them without it."""
    from benchmarks.bench_decode_mgpu import sweep_configs

    every = sweep_configs(128)
    some = sweep_configs(128, only="128x2,128x3")
    assert some and set(some) < set(every) and all((c.block_kv, c.ring_slots) in {(128, 2), (128, 3)} for c in some)
    assert [c for c in every if (c.block_kv, c.ring_slots) in {(128, 2), (128, 3)}] == some
    assert sweep_configs(128, fp8=True, only="64x4") == \
        [c for c in sweep_configs(128, fp8=True) if (c.block_kv, c.ring_slots) == (64, 4)]
    assert any(c.transposed for c in sweep_configs(128, fp8=True)) and not any(c.transposed for c in every)
