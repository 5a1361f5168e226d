"""`umem-jax bench` flags: the --small preset equals README's tiny CPU command, explicit flags
override it, and without it the defaults are the documented ones."""

from __future__ import annotations

import argparse

import pytest

from umem_jax.bench.command import add_arguments, resolve

# README's tiny CPU command: --workload shifting --scale 0.02 --count-scale 0.2 --phase-s 0.2
# --arena-bytes 400000 --max-num-seqs 8 --max-num-batched-tokens 64 --page-size 4 --buckets single
README_TINY = dict(model="tiny", workload="shifting", scale=0.02, count_scale=0.2, phase_s=0.2, arena_bytes=400000,
                   max_num_seqs=8, max_num_batched_tokens=64, page_size=4, buckets="single", seed=0)


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return resolve(p.parse_args(list(argv)))


def test_small_preset_is_the_readme_tiny_command():
    args = _parse("--small")
    assert {k: getattr(args, k) for k in README_TINY} == README_TINY
    assert args.arena_gib is None


@pytest.mark.parametrize("argv", [("--small", "--max-num-seqs", "4", "--seed", "3", "--workload", "mixed"),
                                  ("--max-num-seqs", "4", "--seed", "3", "--workload", "mixed", "--small")])
def test_explicit_flags_override_the_preset_in_any_order(argv):
    args = _parse(*argv)
    assert (args.max_num_seqs, args.seed, args.workload) == (4, 3, "mixed")
    assert (args.page_size, args.buckets, args.arena_bytes) == (4, "single", 400000)


def test_explicit_arena_gib_keeps_the_preset_arena_out():
    args = _parse("--small", "--arena-gib", "0.5")
    assert args.arena_gib == 0.5 and args.arena_bytes is None


def test_defaults_without_the_preset():
    args = _parse()
    assert (args.model, args.workload, args.scale, args.count_scale, args.phase_s, args.arena_bytes) == \
        (None, "all", 1.0, None, 1.0, None)
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.page_size, args.buckets, args.seed) == \
        (64, 2048, 16, "coarse", 0)
