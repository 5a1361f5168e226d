"""Fitting the context and the arena to each other: one request of max_model_len must fit.

    fitted = fit_context(cfg, plan, context=32768, chunk=2048)
    fitted.size, fitted.regions, fitted.demand, fitted.max_model_len

"Fits" is the demand model's answer (memory/demand.py) for one request of max_model_len tokens
in an otherwise empty arena, prefilled in chunks of `chunk` tokens: the price the memory clip,
admission and the startup capacity report use, so what is advertised has capacity >= 1.

- The arena budget: cfg.arena_bytes; else on a GPU what gpu_memory_utilization leaves after the
  weights; else (a CPU has no memory_stats) the least budget from CPU_ARENA_BYTES up to
  MAX_CPU_ARENA_BYTES (and 1/HOST_FRACTION of the host memory free now) that holds one request
  of max_model_len (the model's context when it is not given).
- max_model_len not given: the model's context if it fits, else the longest that does (vLLM's
  max_model_len="auto"), with a warning saying how to get more.
- max_model_len given and it does not fit: kept, with a warning (prompts over the budget are
  refused at arrival: engine.BUDGET_MESSAGE).

Advice names Python keywords (`arena_bytes=`) or CLI flags (`--arena-bytes`), as cfg.interface
says, and on a CPU never gpu_memory_utilization.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax

from ..memory import ChainAllocator, size_arena, static_regions
from ..memory.declarations import WORD_BYTES
from ..memory.demand import Demand, DemandModel
from ..memory.sizing import ArenaSize, ArenaSizeError, budget_bytes
from .config import EngineConfig

# max_tokens that fits max_model_len but not the arena (max_model_len set above what the arena holds)
ARENA_MAX_TOKENS_MESSAGE = ("max_tokens={0} does not fit the arena beside this prompt ({1} tokens): at most {2} "
                            "do (max_model_len={3} is more than the arena holds; see the start-up warning)")

log = logging.getLogger("umem_jax")


def fit_max_tokens(req, clipped: int, max_model_len: int) -> str | None:
    """Fit `req`'s max_tokens to the `clipped` tokens the arena holds beside its prompt (the demand
    model's clip) -> None, or why it is refused: a max_tokens the request asked for is refused (not
    cut short under a "length" finish); an unset one takes what fits.  The engine and the decode
    side of a page handoff both apply it."""
    if clipped >= req.max_tokens:
        return None
    if req.params.max_tokens is not None:
        return ARENA_MAX_TOKENS_MESSAGE.format(req.max_tokens, req.prompt_len, clipped, max_model_len)
    log.info("request %s: max_tokens %d clipped to %d by the arena", req.request_id, req.max_tokens, clipped)
    req.clip_max_tokens(clipped)
    return None


CPU_ARENA_BYTES = 64 << 20  # the least default CPU arena (no memory_stats() there)
MAX_CPU_ARENA_BYTES = 1 << 30  # the most a default CPU arena grows to hold one request of the context
HOST_FRACTION = 8  # ...and at most this fraction of the host memory free at startup


@dataclasses.dataclass
class Fitted:
    """The arena (size, static regions), its demand model and the max_model_len it serves."""

    size: ArenaSize
    regions: dict | None
    demand: DemandModel
    max_model_len: int


def fit_context(cfg: EngineConfig, plan, context: int, chunk: int, demand_kw: dict | None = None) -> Fitted:
    """Size the arena and settle max_model_len (at most `context`, the model's) for `cfg`.
    demand_kw: more DemandModel arguments (beside plan, chunk, empty; extra_state_slots here overrides cfg's)."""
    demand_kw = dict(demand_kw or {})
    on_cpu = jax.devices()[0].memory_stats() is None
    want = int(cfg.max_model_len or context)
    if cfg.arena_bytes is not None:
        unit = math.lcm(4096, plan.row_words * WORD_BYTES)
        if cfg.arena_bytes < unit:  # (budget_bytes would advise gpu_memory_utilization)
            raise ArenaSizeError(f"{setting(cfg, 'arena_bytes', cfg.arena_bytes)} is less than one {unit:,}-byte "
                                 "block of arena rows: raise it")
        budget = budget_bytes(fixed_bytes=int(cfg.arena_bytes), plan=plan)
    elif on_cpu:
        budget = _cpu_budget(cfg, plan, want, chunk, demand_kw)
    else:
        budget = budget_bytes(fraction=cfg.gpu_memory_utilization, plan=plan,
                              reserve_bytes=_reserve(cfg.gpu_memory_utilization))
    fitted = _arena(cfg, plan, budget, chunk, want, demand_kw)
    if fits(fitted.demand, want):
        return fitted
    longest = _longest(fitted.demand, want)
    if longest < 2:
        raise ArenaSizeError(f"the arena ({fitted.size.nbytes:,} B) holds no request of even 2 tokens: "
                             f"{_more_memory(cfg, on_cpu, fitted.size)}")
    if cfg.max_model_len is not None:
        log.warning("max_model_len=%s does not fit the arena: %s, so no request of max_model_len can run (capacity "
                    "0; a prompt over what fits is refused at arrival). To fit it: %s.", f"{want:,}",
                    _need(fitted, want, chunk), _advice(cfg, on_cpu, fitted.size, longest, plan))
        return fitted
    served = longest // plan.page_size * plan.page_size if longest >= plan.page_size else longest
    log.warning("max_model_len: the model's context of %s tokens does not fit the arena (%s); serving "
                "max_model_len=%s, the longest one request can hold. For more: %s.", f"{want:,}",
                _need(fitted, want, chunk), f"{served:,}", _advice(cfg, on_cpu, fitted.size, None, plan))
    return dataclasses.replace(fitted, max_model_len=served)


def fits(demand: DemandModel, max_model_len: int) -> bool:
    """One request of max_model_len tokens (prompt + output) fits the empty arena."""
    return demand.fits_empty(demand.lifetime(max_model_len - 1, 1))


def capacity(demand: DemandModel, max_model_len: int, limit: int) -> int:
    """Requests of max_model_len the empty arena holds at once, at most `limit`."""
    d = demand.lifetime(max_model_len - 1, 1)
    times = lambda k: Demand(d.token_pages * k, {w: v * k for w, v in d.window_pages.items()}, d.state_slots * k)
    lo, hi = 0, int(limit)
    while lo < hi:  # demand grows with k: the largest k that fits the empty arena
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if demand.fits_empty(times(mid)) else (lo, mid - 1)
    return lo


def _arena(cfg: EngineConfig, plan, budget: int, chunk: int, max_model_len: int, demand_kw: dict) -> Fitted:
    size = size_arena(plan, budget)
    regions = None
    if cfg.memory_mode == "static":
        regions = static_regions(plan, size.num_rows, swa_full_tokens_ratio=cfg.swa_full_tokens_ratio,
                                 mamba_full_memory_ratio=cfg.mamba_full_memory_ratio)
    empty = ChainAllocator(plan, size.num_rows, static_regions=regions)  # the demand model's idle arena
    demand = DemandModel(plan, chunk=chunk, empty=empty, **{"extra_state_slots": cfg.extra_state_slots, **demand_kw})
    return Fitted(size, regions, demand, max_model_len)


def _longest(demand: DemandModel, want: int) -> int:
    """The longest max_model_len <= want that fits (0 when not even 1 token does)."""
    lo, hi = 1, int(want)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(demand, mid) else (lo, mid - 1)
    return lo if lo >= 2 else 0


def _cpu_budget(cfg: EngineConfig, plan, want: int, chunk: int, demand_kw: dict) -> int:
    """The least CPU budget in [CPU_ARENA_BYTES, cap] holding one request of `want` (the cap if none)."""
    unit = math.lcm(4096, plan.row_words * WORD_BYTES)
    free = _host_free_bytes()
    cap = min(MAX_CPU_ARENA_BYTES, free // HOST_FRACTION if free else MAX_CPU_ARENA_BYTES)
    lo, hi = -(-CPU_ARENA_BYTES // unit), max(-(-CPU_ARENA_BYTES // unit), cap // unit)
    ok = lambda k: fits(_arena(cfg, plan, k * unit, chunk, want, demand_kw).demand, want)
    if ok(lo) or not ok(hi):
        return (lo if ok(lo) else hi) * unit
    while hi - lo > 1:  # ok(hi), not ok(lo)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi * unit


def _host_free_bytes() -> int | None:
    """Host memory free now (Linux MemAvailable, else sysconf), None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _reserve(fraction: float) -> int:
    """Bytes kept out of the arena for the step's temporaries (activations, logits, sampler
    sort): 1/16 of what is left after the weights, at most 4 GiB.  A heuristic: measuring the
    compiled steps (sizing.compiled_temp_bytes) would need them compiled before the arena exists."""
    stats = jax.devices()[0].memory_stats() or {}
    left = int(stats.get("bytes_limit", 0)) * fraction - int(stats.get("bytes_in_use", 0))
    return int(min(max(left, 0) // 16, 4 << 30))


# ------------------------------------------------------------------------------ advice


def flag(cfg: EngineConfig, name: str) -> str:
    """How the user sets option `name` where they are: `name=` (Python) or `--name` (CLI)."""
    return "--" + name.replace("_", "-") if cfg.interface == "cli" else name + "="


def setting(cfg: EngineConfig, name: str, value) -> str:
    """`name=value` (Python) or `--name value` (CLI)."""
    return f"{flag(cfg, name)}{value}" if cfg.interface == "python" else f"{flag(cfg, name)} {value}"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _need(fitted: Fitted, want: int, chunk: int) -> str:
    d = fitted.demand.lifetime(want - 1, 1)
    need = fitted.demand.bytes(d) + fitted.size.sink_rows * fitted.size.row_bytes
    return (f"one request of it needs about {_mib(need)} (prefill chunks of {chunk:,} tokens), the arena has "
            f"{_mib(fitted.size.nbytes)}")


def _more_memory(cfg: EngineConfig, on_cpu: bool, size: ArenaSize) -> str:
    if on_cpu or cfg.arena_bytes is not None:
        return f"raise {flag(cfg, 'arena_bytes')} (now {size.budget_bytes:,})"
    return f"raise {flag(cfg, 'gpu_memory_utilization')} (now {cfg.gpu_memory_utilization:g})"


def _advice(cfg: EngineConfig, on_cpu: bool, size: ArenaSize, longest: int | None, plan) -> str:
    tips = [_more_memory(cfg, on_cpu, size)]
    if longest is not None:
        tips.append(f"lower {flag(cfg, 'max_model_len')} (at most {longest:,} fits now)")
    if plan.windows:
        tips.append(f"lower {flag(cfg, 'max_num_batched_tokens')} (now {cfg.max_num_batched_tokens:,}: a prefill "
                    "chunk keeps its tokens' pages in every window band)")
    if cfg.memory_mode == "static":
        tips.append(f"change {flag(cfg, 'swa_full_tokens_ratio')} / {flag(cfg, 'mamba_full_memory_ratio')}")
    return "; ".join(tips)


__all__ = ["CPU_ARENA_BYTES", "MAX_CPU_ARENA_BYTES", "Fitted", "capacity", "fit_context", "fits", "flag", "setting"]
