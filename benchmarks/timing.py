"""Device timing shared by every benchmark: calls dispatched back to back, synchronised once.

    t = time_calls(lambda: f(x), iters=20, trials=5)       # t.median, t.best: seconds per call
    chain = Chain(step, arena)                              # a donated value threaded through calls
    t = time_calls(chain, iters=10, trials=5)               # chain.value: the newest arena
    rate = copy_rate(4 << 30, iters=10, trials=5)           # the copy limit, bytes read + written / s

Dispatch is asynchronous, so `iters` calls in a row keep the device busy and the one
block_until_ready at the end of a trial measures the device, not the host's launch of each call.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp


@dataclasses.dataclass
class Timing:
    """Seconds per call of each timed trial, and the first call (compile + run) apart."""

    per_call: list[float]
    first_s: float
    first: Any  # what the first call returned
    # Seconds per call the host spent issuing each trial's calls (until the last returned): near
    # per_call, the host sets the pace, not the device.
    issue: list[float] = dataclasses.field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.per_call)

    @property
    def best(self) -> float:
        return min(self.per_call)


def time_calls(fn: Callable[[], Any], *, iters: int, trials: int, warmup: int = 1) -> Timing:
    """Time fn() (no arguments; it may carry state between calls, see Chain).

    One first call (timed apart: it compiles), `warmup` more untimed calls, then `trials` runs of
    `iters` calls back to back, each synchronised once on its last call's result."""
    t = time.perf_counter()
    first = jax.block_until_ready(fn())
    first_s = time.perf_counter() - t
    for _ in range(warmup):
        jax.block_until_ready(fn())
    per, issue = [], []
    for _ in range(trials):
        t = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn()
        issue.append((time.perf_counter() - t) / iters)
        jax.block_until_ready(out)
        per.append((time.perf_counter() - t) / iters)
    return Timing(per, first_s, first, issue)


class Chain:
    """value = fn(value) per call: a donated buffer (an arena) threaded through back-to-back
    calls, as a serving loop threads it through its steps.  Returns the new value."""

    def __init__(self, fn: Callable[[Any], Any], value: Any):
        self.fn, self.value = fn, value

    def __call__(self):
        self.value = self.fn(self.value)
        return self.value


@dataclasses.dataclass
class CopyRate:
    """A device read + write pass over a uint16 buffer: the bandwidth a memory-bound kernel can reach."""

    bytes_per_s: float
    seconds: float  # per pass
    nbytes: int  # read + written per pass
    exact: bool  # the pass wrote what it should (False: the figure is void)

    @property
    def tbps(self) -> float:
        return self.bytes_per_s / 1e12


def copy_rate(nbytes: int, *, iters: int, trials: int, best: bool = False, donate: bool = False) -> CopyRate:
    """Time `x ^ 1` over `nbytes` of uint16 (read nbytes, write nbytes): median of the trials, or
    the best with `best`.  donate: in place (the output reuses the input), as the arena kernels run."""
    words = max(nbytes // 2, 1)
    shape = (words // 1024, 1024) if words % 1024 == 0 else (words,)
    x = jax.jit(lambda: jnp.zeros(shape, jnp.uint16))()
    f = jax.jit(lambda x: x ^ jnp.uint16(1), donate_argnums=0 if donate else ())
    if donate:
        exact = True  # the input is gone after the call; the non-donated check covers the op
        t = time_calls(Chain(f, x), iters=iters, trials=trials)
    else:
        y = f(x)
        exact = int(jnp.max(y)) == 1 and int(jnp.min(y)) == 1
        del y
        t = time_calls(lambda: f(x), iters=iters, trials=trials)
    seconds = t.best if best else t.median
    moved = 2 * words * 2
    return CopyRate(moved / seconds, seconds, moved, exact)


def tbps(nbytes: int, seconds: float | None) -> float | None:
    """TB/s of moving `nbytes` in `seconds` (None without a time)."""
    return nbytes / seconds / 1e12 if seconds else None


__all__ = ["Chain", "CopyRate", "Timing", "copy_rate", "tbps", "time_calls"]
