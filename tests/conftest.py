"""Shared pytest setup: the `gpu` and `slow` markers (declared in pyproject.toml).

* `@pytest.mark.gpu` tests run only when JAX's default backend is an NVIDIA GPU.
* `@pytest.mark.slow` tests run only with `--long` or `UMEM_LONG_TESTS=1`.
Others may append fixtures below.
"""

from __future__ import annotations

import os

import pytest
from _options import long_tests_enabled

# CLI commands run in-process keep compiled steps on disk for later starts; tests should not
# leave files in the user's cache, nor read stale ones.
os.environ.setdefault("UMEM_JAX_COMPILATION_CACHE", "0")

# One XLA compilation cache for the whole run, in a folder of its own: both pytest-xdist workers
# and every subprocess a test starts (servers, the TP worker, CLI runs) inherit it, so a step
# shape compiled by one process is read back by the others instead of compiled again.  The
# controller makes it (the workers see the variable) and removes it at exit.  OFF by default
# (UMEM_JAX_TEST_XLA_CACHE=1 turns it on): on jax 0.10's CPU backend, writing an entry
# (executable.serialize()) segfaulted a worker in 2 of 4 full runs on 2026-12-05.  Compiling
# alone has segfaulted too (session 14, the cache off), which the mapping limit at the end of this
# file explains; whether it explains the cache's crashes too is untested.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ and os.environ.get("UMEM_JAX_TEST_XLA_CACHE", "0") != "0":
    import atexit
    import shutil
    import tempfile

    _xla_cache = tempfile.mkdtemp(prefix="umem-jax-tests-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _xla_cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    atexit.register(shutil.rmtree, _xla_cache, True)

# On the CPU, compile the tests' programs at XLA's lowest backend optimisation: most of the suite's
# time is XLA:CPU compiling small step programs that then run a few times, and -O0 cuts a
# speculative-decoding file's time by a fifth (108 -> 84 s, 2026-12-05).  XLA:CPU's older loop
# emitters instead of its MLIR fusion emitters compile faster again: 11-27% off four files
# (test_gated_deltanet.py 39.6 -> 28.7 s, 2026-12-06, jax 0.10.2).  Both sides of every
# comparison compile under the same flags; numerics stay within the tests' tolerances.  Not on a
# GPU machine (its tests time kernels and compile for the device), nor when XLA_FLAGS already sets
# a level, nor with UMEM_JAX_TEST_FULL_OPT=1.  Subprocesses that tests start inherit it.
def _cpu_only() -> bool:
    import importlib.util

    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return True
    return not any(importlib.util.find_spec(p) for p in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


def _emitters_flag() -> str:
    """The loop-emitter flag where this jaxlib is known to have it: XLA aborts the process on a flag
    it does not know, so a jaxlib past the 0.10 line goes without it until checked."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return " --xla_cpu_use_fusion_emitters=false" if version("jaxlib").startswith("0.10.") else ""
    except PackageNotFoundError:
        return ""


if os.environ.get("UMEM_JAX_TEST_FULL_OPT", "0") == "0" and "xla_backend_optimization_level" not in \
        os.environ.get("XLA_FLAGS", "") and _cpu_only():
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                               " --xla_llvm_disable_expensive_passes=true" + _emitters_flag()).strip()


@pytest.fixture
def decode_row_verify(monkeypatch):
    """A verify's k + 1 queries as decode rows (pallas_kernels/short_extend.py): the GPU's choice
    at small B, which `auto` leaves off on the CPU.  The choice is read when a step is traced;
    the runner keys its traced steps on it (runner.step_key), so steps traced here are never
    reused by a later test that runs without it."""
    monkeypatch.setenv("UMEM_JAX_SHORT_EXTEND", "decode")
    yield


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true", default=False,
                     help="run tests marked slow (same as UMEM_LONG_TESTS=1)")


def pytest_collection_modifyitems(config, items):
    import jax  # here, not at import: collecting must not pick a backend before options are read

    on_gpu = jax.default_backend() == "gpu"
    long = long_tests_enabled(config)
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU")
    skip_slow = pytest.mark.skip(reason="long-running: run with --long or UMEM_LONG_TESTS=1")
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not long:
            item.add_marker(skip_slow)
    # The longest tests first.  `--dist worksteal` hands each worker a contiguous half of this list
    # and lets one steal from the other's end only, so a long test left at a queue's end keeps
    # one worker busy while the other idles (the tensor-parallel file, 200 s of subprocesses, came
    # second to last).  Each of these is self-contained (a subprocess, or engines of its own), so
    # moving it shares no less work with its file's other tests.
    # Before them, the tests that drop JAX's caches (jax.clear_caches): at a worker's start that
    # drops nothing, where mid-run every step compiled before (the soaks' shapes, which most engine
    # tests share) was compiled again after each (17 s of a 631 s run of tests/engine alone).
    clears = [i for i in items if i.nodeid.split("[")[0] in CLEARS_CACHES]
    first = [i for i in items if i.nodeid in HEAVY_FIRST]
    rest = [i for i in items if i.nodeid not in HEAVY_FIRST and i.nodeid.split("[")[0] not in CLEARS_CACHES]
    items[:] = clears + sorted(first, key=lambda i: HEAVY_FIRST.index(i.nodeid)) + rest


# Tests that call jax.clear_caches() (each says why), parameters left out.
CLEARS_CACHES = (
    "tests/engine/test_decode_path.py::test_decode_step_crosses_the_documented_files",
    "tests/engine/test_prefill_memory.py::test_gpu_prefill_dataflow_is_in_place",
)


# Over 40 s each on the 2-core CI machine (pytest --durations, 2026-12-05), longest first.
HEAVY_FIRST = (
    "tests/engine/test_soak_speculative.py::test_soak_speculative_ci",
    "tests/engine/test_soak.py::test_soak_ci",
    "tests/models/test_tensor_parallel.py::test_speculation_with_a_split_draft_or_head_matches_tp1",
    "tests/bench/test_bench_models.py::test_small_mode_end_to_end",
    "tests/models/test_tensor_parallel.py::test_moe_fixtures_with_expert_parallelism_match_tp1",
    "tests/models/test_tensor_parallel.py::test_moe_layer_tp2_and_tp4_match_tp1_on_several_devices",
)


# XLA:CPU maps the code of every executable it compiles into the process (about three mappings
# each), and a pytest worker compiles for most of the suite: past Linux's vm.max_map_count (65,530
# by default) the next compile aborts or segfaults.  That was the "random" XLA crash of earlier
# runs: counted per worker on 2026-12-05, a worker reached 57,700 mappings by its 1,075th test and
# died compiling test_speculative_mtp's steps, the test three full runs that day died at.  So every
# MAP_CHECK_EVERY tests a worker past MAP_LIMIT mappings drops JAX's compiled executables
# (jax.clear_caches: steps compiled later again, the mappings released).
MAP_LIMIT = 36_000
MAP_CHECK_EVERY = 10
_tests_done = 0


def _mappings() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: no such limit to keep under
        return 0


def pytest_runtest_teardown(item, nextitem):
    global _tests_done
    _tests_done += 1
    if _tests_done % MAP_CHECK_EVERY == 0 and _mappings() > MAP_LIMIT:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()
