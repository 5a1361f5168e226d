"""benchmarks/bench_speculative.py: the harness's acceptance rule, and --small end to end on the CPU
(a tiny Qwen3.5 with gated-DeltaNet state, reference kernels, B=1): every speculative run's greedy
output equals the run without speculation, a row for every a and both methods, nothing compiled
inside a timed window, and the accepted length follows a (a=0 accepts nothing, a=1 everything).
About 45 s on two shared cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
ACCEPTANCE = (0.0, 0.5, 0.8, 1.0)


def test_help(capsys):
    from benchmarks import bench_speculative

    with pytest.raises(SystemExit) as stop:
        bench_speculative.main(["--help"])
    assert stop.value.code == 0 and capsys.readouterr().out.startswith("usage:")


def test_harness_keeps_each_position_with_probability_a():
    from benchmarks.spec_harness import Harness, expected_accepted

    want = np.arange(30000).reshape(10000, 3) % 97
    for a in ACCEPTANCE:
        got = Harness(3, 97, a, seed=1).corrupt(want)
        kept = (got == want).mean()
        assert abs(kept - a) < 0.015, (a, kept)  # a corrupted position is never the right token
        assert ((got >= 0) & (got < 97)).all()
        # the greedy verify keeps the leading run of right drafts
        run = np.cumprod(got == want, axis=1).sum(1).mean()
        assert abs(run - expected_accepted(a, 3)) < 0.05, (a, run)


def test_small_end_to_end(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "benchmarks.bench_speculative", "--small", "--batches", "1", "--out", str(tmp_path),
           "--profile-verify", "1"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    res = json.loads((tmp_path / "bench_speculative.json").read_text())
    assert (tmp_path / "bench_speculative.log").read_text().startswith("== bench_speculative")
    assert res["mismatches"] == [] and res["errors"] == [] and res["skipped"] == []
    rows = res["rows"]
    e2e = [r for r in rows if r["part"] == "e2e"]
    assert {r["scheduling"] for r in e2e if r["method"] == "none"} == {"async (default)", "sync"}
    assert all(r["compiles"] == 0 and r["retractions"] == 0 for r in e2e), e2e  # warmed up, nothing retracted
    for method in ("draft", "mtp"):
        got = {r["a"]: r for r in e2e if r["method"] == method}
        assert sorted(got) == list(ACCEPTANCE), (method, sorted(got))
        assert all(r["outputs_equal"] and "HARNESS" in r["harness"] and r["tok_s"] > 0 for r in got.values())
        assert got[0.0]["acceptance_rate"] == 0 and got[0.0]["mean_accepted_length"] == 0
        assert got[1.0]["acceptance_rate"] == 1  # every draft kept (the last steps verify fewer: max_tokens)
        lengths = [got[a]["mean_accepted_length"] for a in ACCEPTANCE]
        assert all(y >= x - 0.5 for x, y in zip(lengths, lengths[1:])) and lengths[-1] > lengths[1] > 0, lengths
        assert all(r["ratio"] > 0 and r["harness_us_per_call"] > 0 for r in got.values())
    verify = [r for r in rows if r["part"] == "verify"]
    assert [(r["B"], r["k"]) for r in verify] == [(1, 3)] and verify[0]["ms"] > 0 and verify[0]["decode_ms"] > 0
    assert (tmp_path / "profile_verify_B1.perfetto_trace.json.gz").stat().st_size > 0  # flat: the device returns it
    assert {r["method"] for r in rows if r["part"] == "draft"} == {"draft", "mtp"}
    assert all(r["compiles"] == 0 for r in rows if r["part"] in ("verify", "draft", "decode"))
    assert len(res["verdicts"]) == 4  # a=0.8 and a=0 for each method: figures from this CPU mean nothing
