"""Honest bench summaries (issue 20 item 6): runs that aborted, clipped, hit their time cap or
compiled inside the timed window are marked in the table and the plot titles; goal verdicts
appear only for a real measurement (not --small, not a CPU backend).  Pure host-side checks on
hand-made results: nothing compiles."""

from __future__ import annotations

import random

import jax

from umem_jax.bench.results import RequestRecord, RunResult, shortfall
from umem_jax.bench.sweep import compare, ratio_lines, table, verdict_blocker


def _run(label: str, n: int, aborted: int = 0, clipped: int = 0, seed: int = 0, **kw) -> RunResult:
    """A finished run of n requests (output 8 each) over 2 s: `aborted` never ran, `clipped`
    finished short of their max_tokens."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        r = RequestRecord(arrival_s=rng.random(), input_len=rng.randint(4, 64), output_len=8, kind="short")
        if i < aborted:
            r.finish_reason, r.error = "abort", "Request prompt exceeds the KV memory budget"
        else:
            r.tokens = 8 - 3 * (i < aborted + clipped)
            r.finish_reason, r.ttft_s, r.e2e_s, r.tpot_s = "length", 0.1, 0.5, 0.05
        reqs.append(r)
    mode = "unified" if label == "unified" else "static"
    swa, mamba = (0.8, 0.9) if label == "static 0.8/0.9" else (None, None)
    return RunResult("shifting", label, mode, swa, mamba, requests=reqs, duration_s=2.0,
                     counters=kw.pop("counters", {}), **kw)


def test_shortfall_names_what_a_run_did_not_serve():
    n = random.Random(1).randint(10, 30)
    assert shortfall(_run("unified", n).summary()) == ""
    assert shortfall(_run("static 0.8/0.9", n, aborted=2).summary()) == f"2/{n} aborted"
    assert shortfall(_run("static 0.8/0.9", n, aborted=1, clipped=3).summary()) == f"1/{n} aborted, 3 clipped"
    s = _run("unified", n, status="truncated", counters={"compiles": 2}).summary()
    assert shortfall(s) == "truncated, 2 compiles in run"
    assert shortfall({"status": "skipped"}) == "skipped"


def test_table_and_titles_mark_aborted_runs():
    from umem_jax.bench.plots import run_title

    n = 20
    full, partial = _run("unified", n).summary(), _run("static 0.8/0.9", n, aborted=2, seed=3).summary()
    lines = table([full, partial]).splitlines()
    assert "ok: 2/20 aborted" in lines[2] and "ok: " not in lines[1]  # status cells: partial vs full
    assert run_title(full) == f"unified: {full['out_tok_per_s']:.0f} tok/s"
    assert run_title(partial).endswith("(2/20 aborted)")


def test_no_goal_verdicts_on_small_or_cpu_runs():
    results = [_run("unified", 12, seed=5), _run("static 0.8/0.9", 12, seed=6)]
    assert verdict_blocker(small=True).startswith("--small")
    if jax.default_backend() == "cpu":
        assert verdict_blocker(small=False).startswith("CPU")
    for why in ("--small smoke run, not a measurement", "CPU run, not a measurement"):
        c = compare(results, why)
        assert c["unified_vs_default"] is not None  # the ratio is still reported
        assert c["goals"]["unified_vs_default"] == f"no verdict ({why})"
        line = ratio_lines([c])[0]
        assert "MISSED" not in line and "met (" not in line and "no verdict" in line
    judged = compare(results, None)["goals"]["unified_vs_default"]  # a real measurement: a verdict
    assert judged.startswith(("met (", "MISSED ("))
