"""benchmarks.simulate_admission: the engine's scheduler, allocator and demand model on a
serving trace at a realistic model's sizes, without a model.  Every request of the trace runs to
its last token in every configuration, nothing leaks (simulate asserts it), and the rows say what
the benchmark prints."""

from __future__ import annotations

from benchmarks import simulate_admission as sim


def test_simulated_shifting_trace_runs_every_request(capsys):
    rows = sim.run(["--model", "qwen3.5-4b-like", "--n-short", "16", "--short", "512,32", "--long", "16384,32",
                    "--static-ratios", "0.9", "--rule", "now,before", "--arena-gib", "2"])
    assert [(r["rule"], r["config"]) for r in rows] == [("now", "unified"), ("now", "static -/0.9"),
                                                         ("before", "unified"), ("before", "static -/0.9")]
    for r in rows:
        assert r["steps"] > 0 and r["seconds"] > 0 and r["out_tok_per_s"] > 0 and r["peak_running"] >= 1
        assert r["retractions"] >= 0
    out = capsys.readouterr().out
    assert "qwen3.5-4b-like, shifting:" in out and out.count("retractions") == 4


def test_utilization_split_tiles_the_arena_and_spread_trace_runs(capsys):
    rows = sim.run(["--model", "nemotronh-8b-like", "--n-short", "32", "--short", "512,32", "--long", "2048,32",
                    "--static-ratios", "0.9", "--rule", "now", "--arena-gib", "1", "--phases", "6", "--phase-s", "0.5",
                    "--spread", "--n-long-phase", "4", "--max-num-seqs", "16", "--max-num-batched-tokens", "1024"])
    assert [r["config"] for r in rows] == ["unified", "static -/0.9"]
    for r in rows:
        if r["split"] is None:  # memory never bound in this configuration
            continue
        parts = r["split"]
        assert parts["live"] == r["util"] and all(0.0 <= v <= 1.0 for v in parts.values())
        # the sink, the bands' spans (live + holes) and the free gap tile the arena
        assert abs(sum(parts.values()) - 1.0) < 1e-9 and parts["sink"] > 0  # NemotronH's sink: one state slot
    out = capsys.readouterr().out
    assert "48 requests" in out and "sink" in out


def test_exact_reservation_never_retracts_fixed_lengths(capsys):
    """Every request here is fixed-length (ignore_eos), so by default the decoders reserve their
    exact worst step (decode_peak) and admission never over-commits: no retraction, every
    request to its last token.  --no-exact (the ratio rule, here at 0: no outputs reserved)
    retracts on the same trace; the memory-bound figure counts only samples where the head did
    not fit."""
    argv = ["--model", "qwen3.5-4b-like", "--n-short", "16", "--short", "512,512", "--long", "8192,256",
            "--static-ratios", "0.9", "--rule", "now", "--arena-gib", "1", "--ratio", "0", "--min-ratio", "0"]
    for r in sim.run(argv):
        assert r["retractions"] == 0 and r["steps"] > 0
        if r["util_bound"] is not None:
            assert 0.0 < r["util_bound"] <= 1.0 and abs(sum(r["split_bound"].values()) - 1.0) < 1e-9
    assert "memory-bound median" in capsys.readouterr().out
    assert all(r["retractions"] > 0 for r in sim.run(argv + ["--no-exact"]))


def test_early_start_fills_the_gap_a_long_prompt_leaves(capsys):
    """Long prompts only (kv-heavy): without early starts the next 4K prompt waits until all of
    it fits, and the bytes it does not fit into stay idle (0.88 of the arena live where memory
    binds); started early in the bytes no running request can need, its first chunks fill them
    (0.98), with no retraction and within 1% of the modelled throughput."""
    argv = ["--model", "qwen3.5-4b-like", "--workload", "kv-heavy", "--long", "4096,64", "--arena-gib", "1",
            "--rule", "now", "--static-ratios", "0.5"]
    (early, _), (late, _) = sim.run(argv), sim.run(argv + ["--no-early"])  # the early start is the default
    assert early["retractions"] == late["retractions"] == 0
    assert late["util_bound"] < 0.9 and early["util_bound"] > 0.97
    assert early["out_tok_per_s"] > 0.99 * late["out_tok_per_s"]
    # with the prefix cache (--prefix-cache: finished requests' pages stay cached, as in the engine) the
    # same trace runs to the end about as fast (test_scheduler checks the early start takes the cache's bytes)
    (cached, _) = sim.run(argv + ["--prefix-cache"])
    assert cached["retractions"] == 0 and cached["steps"] <= 1.05 * early["steps"]


def test_by_state_splits_the_memory_bound_samples(capsys):
    """--by-state: the memory-bound samples with an early start under way and without one, each
    group's live, free, cache-only and (NemotronH's) sink shares tiling the arena."""
    argv = ["--model", "nemotronh-8b-like", "--n-short", "32", "--short", "512,32", "--long", "2048,32",
            "--static-ratios", "none", "--rule", "now", "--arena-gib", "1", "--max-num-seqs", "16",
            "--max-num-batched-tokens", "1024", "--prefix-cache", "--by-state"]
    (row,) = sim.run(argv)
    groups = row["by_state"]
    assert set(groups) <= {"an early start under way", "no early start"} and groups
    assert sum(g["samples"] for g in groups.values()) == row["memory_bound_samples"] > 0
    for g in groups.values():
        assert 0 <= g["owed_decoders"] <= 1 and g["live"] > 0.5
        assert 0.99 < g["live"] + g["free"] + g["cached"] < 1.0  # the rest: the sink's slot
    out = capsys.readouterr().out
    assert all(f"      {name}: {g['samples']} samples" in out for name, g in groups.items())


def test_fp8_kv_holds_twice_the_tokens_in_the_same_bytes(capsys):
    """--kv-cache-dtype auto,fp8: the same trace in the same arena bytes, once per K/V dtype.  On
    an attention-only model whose K/V binds (kv-heavy, 4K prompts, a small arena), fp8's half-width
    rows hold about twice the tokens at once and run more requests together, and every request
    still runs to its last token with nothing leaked (simulate asserts it)."""
    rows = sim.run(["--model", "gemma3-4b-like", "--workload", "kv-heavy", "--long", "4096,64", "--arena-gib", "0.5",
                    "--static-ratios", "0.5", "--rule", "now", "--kv-cache-dtype", "auto,fp8"])
    by = {(r["kv_cache_dtype"], r["config"]): r for r in rows}
    assert set(by) == {(kv, c) for kv in ("bfloat16", "float8_e4m3fn") for c in ("unified", "static 0.5/-")}
    bf16, fp8 = by["bfloat16", "unified"], by["float8_e4m3fn", "unified"]
    assert fp8["tokens_held_peak"] >= 1.8 * bf16["tokens_held_peak"]
    assert fp8["peak_running"] > bf16["peak_running"] and fp8["out_tok_per_s"] > bf16["out_tok_per_s"]
    assert "float8_e4m3fn" in capsys.readouterr().out


def test_a_prefill_step_costs_its_padded_shape():
    """The cost model charges a prefill step the tokens the engine computes: B rows padded up to
    the batch bucket, each padded up to the token bucket of the longest (`--prefill-cost padded`,
    the default); `tokens` charges the rows' own."""
    from types import SimpleNamespace

    from umem_jax.core.scheduled_batch import Buckets

    buckets = Buckets.default(64, 2048, 512)  # B 1, 2, 4, ..., 64; T 16, 32, ..., 2048
    rows = [SimpleNamespace(start=s, end=e) for s, e in ((0, 520), (100, 400), (0, 17))]
    batch = SimpleNamespace(rows=rows)
    assert sim.prefill_tokens(batch, buckets) == 4 * 1024  # 3 rows -> 4, the longest 520 -> 1024
    assert sim.prefill_tokens(batch, buckets, padded=False) == 520 + 300 + 17
    lone = SimpleNamespace(rows=[SimpleNamespace(start=2048, end=4096)])
    assert sim.prefill_tokens(lone, buckets) == sim.prefill_tokens(lone, buckets, padded=False) == 2048
