"""Warm-up: which step shapes a start compiles, in what order, on how many threads, reported
as they compile (startup.py) and without XLA's slow-compile alarm on the console.

    n = warm_up(engine, max_shapes=default_shapes(), sampling=default_sampling())

GPU: decode shapes first (every steady step is one), 32 by default, each in the greedy and the
cuts sampler (cuts covers any request).  CPU: a compile of a real model's step takes seconds to
minutes there, so a start compiles few, in the order first requests need them -- the narrowest
page table first, then the fewest rows, then the fewest prefill tokens: a short prompt's prefill
and decode -- in the greedy and the random sampler (the OpenAI clients' default temperature 1 is
random; top-k/top-p/min-p compile on first use).  Shapes left out compile on first use; the
compile cache on disk keeps every compiled step for the next start.
"""

from __future__ import annotations

import os

from ..runner.xla_log import quiet_xla_alarms
from . import startup

GPU_WARMUP_SHAPES, CPU_WARMUP_SHAPES = 32, 4
GPU_SAMPLING, CPU_SAMPLING = ("greedy", "cuts"), ("greedy", "random")


def on_cpu() -> bool:
    import jax

    return jax.default_backend() == "cpu"


def default_shapes() -> int:
    """How many step shapes a start compiles before it serves: 4 on a CPU, 32 on a GPU."""
    return CPU_WARMUP_SHAPES if on_cpu() else GPU_WARMUP_SHAPES


def default_sampling() -> tuple[str, ...]:
    return CPU_SAMPLING if on_cpu() else GPU_SAMPLING


def resolve(shapes: int | None, sampling: str | None) -> tuple[int | None, str]:
    """The CLI's --warmup-shapes / --warmup-sampling, None for this backend's default -> (shapes,
    None for every reachable one; the sampler modes as a comma list)."""
    shapes = default_shapes() if shapes is None else shapes
    return (None if shapes < 0 else shapes), sampling or ",".join(default_sampling())


def order(shapes: list[tuple], cpu: bool) -> list[tuple]:
    """(B, T, P, checkpoints) shapes in the order a start compiles them: as given (decode first)
    on a GPU; on a CPU by page-table width, then rows, then prefill tokens (T=1 is decode)."""
    return sorted(shapes, key=lambda s: (s[2], s[0], s[1])) if cpu else list(shapes)


def compile_threads() -> int:
    """Compilations at once: one per core, at most 8.  More than the cores only stretches each
    compile's wall time (and XLA's alarm fires on a compile's wall time over 2 minutes)."""
    return max(1, min(8, os.cpu_count() or 1))


def _name(shape: tuple) -> str:
    b, t, p, _ = shape
    return f"decode B={b} P={p}" if t == 1 else f"prefill B={b} T={t} P={p}"


def warm_up(engine, max_shapes: int | None = None, threads: int | None = None, sampling=("greedy",)) -> int:
    """Compile the first `max_shapes` (None: all) reachable step shapes in start order, each in
    every sampler mode of `sampling`, `threads` (default: one per core) at a time -> how many
    compilations.  Progress goes to the installed start-up report, a group of shapes at a time."""
    cpu = on_cpu()
    shapes = order(engine.reachable_shapes(), cpu)
    if max_shapes is not None:
        shapes = shapes[:max_shapes]
    threads = threads or compile_threads()
    n = 0
    with startup.compiling(len(shapes), f"compiling {len(shapes)} step shapes x {len(sampling)} samplers") as advance, \
            quiet_xla_alarms():
        for i in range(0, len(shapes), threads):
            group = shapes[i:i + threads]
            n += engine.runner.precompile(group, threads=threads, sampling=tuple(sampling))
            advance(len(group), note=_name(group[-1]))
    release_host_memory()
    return n


def release_host_memory() -> None:
    """Hand freed heap back to the OS (glibc's malloc_trim): compiling a real model's steps frees
    gigabytes of compiler temporaries that glibc would keep mapped, resident, for the process's
    life.  A no-op without glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): nothing to trim this way
        pass


__all__ = ["CPU_SAMPLING", "CPU_WARMUP_SHAPES", "GPU_SAMPLING", "GPU_WARMUP_SHAPES", "compile_threads",
           "default_sampling", "default_shapes", "order", "quiet_xla_alarms", "release_host_memory", "resolve",
           "warm_up"]
