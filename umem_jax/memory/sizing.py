"""Sizing: from a byte budget to the arena's row count, its floor and its static split.

    budget = budget_bytes(fraction=0.9, temp_bytes=compiled_temp_bytes(*steps), plan=p)
    size = size_arena(p, budget, max_model_len=32768)   # refuses what cannot serve bs=1
    print(size.summary())
    arena = Arena.create(p, size.num_rows)

Everything here is host arithmetic on Python ints: nothing allocates, so a 64 GiB arena (more
than 2**31 16-bit elements) is sized exactly on any machine.  The arena is addressed by row,
so the one hard limit is `num_rows < 2**31` (int32 row ids); the element count may exceed it.
"""

from __future__ import annotations

import dataclasses
import math

from .declarations import WORD_BYTES
from .plan import Plan

PAGE_BYTES_ALIGN = 4096  # the budget is floored to whole 4 KiB pages (and whole arena rows)
MAX_ROWS = 2**31 - 1  # row ids are int32 on the device
DEFAULT_CHECKPOINT_SLOTS = 2  # a state request holds its working slot + 2 checkpoints (SGLang's floor)


class ArenaSizeError(ValueError):
    """The budget cannot hold the arena that was asked for; the message names the knobs."""


# ------------------------------------------------------------------------------ budget


def _gib(n: int) -> str:
    """Human-readable bytes: 512 B, 8.0 KiB, 1.50 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def compiled_temp_bytes(*compiled) -> int:
    """Largest `temp_size_in_bytes` of AOT-compiled steps (jax `Compiled` objects).

    Compile every step bucket against a small probe arena first: if nothing copies the arena
    (tests/memory/test_arena.py checks that), temporaries do not depend on the arena's size.
    """
    temps = [c.memory_analysis().temp_size_in_bytes for c in compiled]
    return max(temps, default=0)


def budget_bytes(device=None, *, fraction: float = 0.9, weights_bytes: int | None = None, temp_bytes: int = 0,
                 reserve_bytes: int = 0, fixed_bytes: int | None = None, plan: Plan | None = None) -> int:
    """Bytes the arena may take on `device` (default: the first device).

    GPU:  floor(bytes_limit * fraction) - weights_bytes - temp_bytes - reserve_bytes, where
          bytes_limit is the allocator pool from `device.memory_stats()` (its size is set by
          XLA_CLIENT_MEM_FRACTION, best ~0.95) and weights_bytes defaults to the bytes in use now
          (so load the weights first).  `fraction` plays --gpu-memory-utilization.
    CPU (no memory_stats) or `fixed_bytes` given: `fixed_bytes`, as is.
    The result is floored to a multiple of 4096 bytes and, if `plan` is given, of its row size;
    a measured (GPU) budget is also capped at MAX_ROWS rows of the plan (int32 row ids).
    """
    import jax  # local: sizing arithmetic must not need a backend

    device = device if device is not None else jax.devices()[0]
    stats = None if fixed_bytes is not None else device.memory_stats()
    if stats is None:
        if fixed_bytes is None:
            raise ArenaSizeError(f"{device.platform} device reports no memory_stats(): pass fixed_bytes= (the "
                                 "arena budget in bytes) on this backend")
        raw = int(fixed_bytes)
        what = f"fixed budget {raw:,} B"
    else:
        limit = int(stats["bytes_limit"])
        used = int(stats.get("bytes_in_use", 0)) if weights_bytes is None else int(weights_bytes)
        raw = int(limit * fraction) - used - int(temp_bytes) - int(reserve_bytes)
        what = (f"{fraction} x bytes_limit {_gib(limit)} - weights {_gib(used)} - temporaries "
                f"{_gib(int(temp_bytes))} - reserve {_gib(int(reserve_bytes))}")
    unit = _unit(plan.row_words * WORD_BYTES if plan is not None else 1)
    if stats is not None and plan is not None:
        # A measured budget stops at the rows int32 ids address (narrow rows on a large card
        # would otherwise refuse to start); an explicit fixed_bytes is left to size_arena to refuse.
        raw = min(raw, MAX_ROWS * plan.row_words * WORD_BYTES)
    out = raw // unit * unit
    if out <= 0:
        raise ArenaSizeError(f"no memory left for the arena: {what} = {raw:,} B. Raise --gpu-memory-utilization "
                             "(fraction) or XLA_CLIENT_MEM_FRACTION, or load smaller weights.")
    return out


def _unit(row_bytes: int) -> int:
    return math.lcm(PAGE_BYTES_ALIGN, row_bytes)


# ------------------------------------------------------------------------------- size


@dataclasses.dataclass(frozen=True)
class ArenaSize:
    """The arena's shape for a budget, and what each sub-pool could hold with all of it.

    pages_alone[name]: physical pages of that sub-pool above the sink if it had the whole arena
    (state: slots), as the allocator hands them out.  Counted on the sub-pool's own page grid:
    the full sub-pool's are `num_pages(num_rows) - plan.first_page(sp)`; every other one ends
    below the full grid's last page boundary (`full_top`), where the empty full band sits, so
    rows past it (when the full page does not divide num_rows) count for nobody (state:
    (full_top - sink_rows) // rows_per_slot, its grid starting at the sink).
    """

    plan: Plan = dataclasses.field(repr=False, compare=False)
    budget_bytes: int
    num_rows: int
    row_words: int
    sink_rows: int
    pages_alone: dict[str, int]

    @property
    def row_bytes(self) -> int:
        return self.row_words * WORD_BYTES

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.row_bytes

    @property
    def num_elements(self) -> int:
        return self.num_rows * self.row_words

    def tokens_alone(self, name: str) -> int:
        """Tokens (KV sub-pools) or state slots (state) if `name` had the whole arena."""
        return self.pages_alone[name] * self.plan[name].page_size

    def summary(self, static_regions: dict[str, tuple[int, int]] | None = None) -> str:
        """Printable table: bytes, rows, and per sub-pool tokens or slots if alone (and in its
        static region when given)."""
        p = self.plan
        lines = [(f"arena {_gib(self.nbytes)} ({self.nbytes:,} B) = {self.num_rows:,} rows x {self.row_bytes} B "
                  f"({self.num_elements:,} 16-bit words); budget {self.budget_bytes:,} B; sink {self.sink_rows} rows "
                  f"({self.sink_rows * self.row_bytes:,} B)")]
        head = ["sub-pool", "kind", "page bytes", "pages if alone", "capacity if alone"]
        if static_regions:
            head += ["static rows", "static capacity"]
        rows = [head]
        for sp in p.subpools:
            unit = "state slots" if sp.kind == "state" else "tokens"
            r = [sp.name, sp.kind, f"{sp.page_bytes:,}", f"{self.pages_alone[sp.name]:,}",
                 f"{self.tokens_alone(sp.name):,} {unit}"]
            if static_regions:
                lo, hi = static_regions[sp.name]
                r += [f"[{lo:,}, {hi:,})", f"{(sp.page_floor(hi) - sp.page_ceil(lo)) * sp.page_size:,} {unit}"]
            rows.append(r)
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join(lines)

    __str__ = summary


def size_arena(plan: Plan, budget_bytes: int, *, max_model_len: int | None = None,
               checkpoint_slots: int = DEFAULT_CHECKPOINT_SLOTS) -> ArenaSize:
    """Rows of `plan.row_words` words that fit `budget_bytes` (floored to 4096 B and whole rows).

    Refuses (ArenaSizeError) an arena of 2**31 rows or more, and one that cannot hold even the
    sink plus one page of every sub-pool; with `max_model_len`, also one that cannot serve a
    single worst-case request (check_bs1_floor).
    """
    row_bytes = plan.row_words * WORD_BYTES
    unit = _unit(row_bytes)
    nbytes = int(budget_bytes) // unit * unit
    num_rows = nbytes // row_bytes
    if num_rows > MAX_ROWS:
        raise ArenaSizeError(
            f"arena of {num_rows:,} rows ({_gib(nbytes)} / {row_bytes} B rows) exceeds the int32 row ids "
            f"(at most {MAX_ROWS:,} rows): use wider rows (plan(..., row_words=) a multiple of {plan.row_words}) "
            "or a smaller budget")
    need = plan.sink_rows + max(sp.rows_per_page for sp in plan.subpools) * len(plan.subpools)
    if num_rows < need:
        raise ArenaSizeError(f"budget {budget_bytes:,} B gives {num_rows:,} rows, fewer than the sink plus one page "
                             f"of each sub-pool ({need:,} rows = {need * row_bytes:,} B)")
    # The empty full band sits at its grid's top page boundary and no band grows past it: the
    # rows above that boundary (less than one full page) are no sub-pool's.
    full_top = plan.full.page_row(plan.full.num_pages(num_rows))
    pages = {sp.name: (sp.num_pages(num_rows) if sp is plan.full else sp.page_floor(full_top)) - plan.first_page(sp)
             for sp in plan.subpools}
    size = ArenaSize(plan, int(budget_bytes), num_rows, plan.row_words, plan.sink_rows, pages)
    if max_model_len is not None:
        check_bs1_floor(plan, num_rows, max_model_len=max_model_len, checkpoint_slots=checkpoint_slots)
    return size


# ------------------------------------------------------------------------ bs=1 floor


def request_pages(plan: Plan, max_model_len: int, checkpoint_slots: int = DEFAULT_CHECKPOINT_SLOTS) -> dict[str, int]:
    """Pages (state: slots) one worst-case request holds alone, per sub-pool.

    full: every page of max_model_len tokens.  window(w): the pages w tokens can straddle plus
    the page being written, ceil(w / page_size) + 1, capped at the request's own pages.
    state: the working slot plus `checkpoint_slots` prefix-cache checkpoints.
    """
    out = {}
    for sp in plan.subpools:
        ctx_pages = -(-max_model_len // sp.page_size)
        if sp.kind == "full":
            out[sp.name] = ctx_pages
        elif sp.kind == "window":
            out[sp.name] = min(-(-sp.window // sp.page_size) + 1, ctx_pages)
        else:
            out[sp.name] = 1 + checkpoint_slots
    return out


def _floor_rows(plan: Plan, pages: dict[str, int]) -> int:
    """Smallest num_rows holding `pages` laid out in chain order: sink, the lower sub-pools
    grown up from the sink each on its own page grid, the full sub-pool grown down from the top."""
    cursor = plan.sink_rows
    for sp in plan.subpools[:-1]:
        cursor = sp.page_row(sp.page_ceil(cursor) + pages[sp.name])
    top = plan.subpools[-1]
    return top.page_row(top.page_ceil(cursor) + pages[top.name])


def check_bs1_floor(plan: Plan, num_rows: int, *, max_model_len: int,
                    checkpoint_slots: int = DEFAULT_CHECKPOINT_SLOTS,
                    static_regions: dict[str, tuple[int, int]] | None = None) -> None:
    """Raise ArenaSizeError unless one worst-case request fits an otherwise empty arena.

    Without this a lone request could be admitted, retracted for memory and re-admitted forever.
    With `static_regions`, each sub-pool's share must fit inside its own region instead.
    """
    pages = request_pages(plan, max_model_len, checkpoint_slots)
    row_bytes = plan.row_words * WORD_BYTES
    if static_regions is not None:
        have = {sp.name: sp.page_floor(static_regions[sp.name][1]) - sp.page_ceil(static_regions[sp.name][0])
                for sp in plan.subpools}
        short = [(sp.name, pages[sp.name], have[sp.name]) for sp in plan.subpools if pages[sp.name] > have[sp.name]]
        if short:
            desc = "; ".join(f"{n} needs {need:,} pages, its region has {have:,}" for n, need, have in short)
            raise ArenaSizeError(
                f"static split cannot hold one request of max_model_len={max_model_len:,}: {desc}. Raise "
                "--gpu-memory-utilization (the budget), lower --max-model-len, change --swa-full-tokens-ratio / "
                "--mamba-full-memory-ratio, lower the page size or the checkpoint count.")
        return
    need = _floor_rows(plan, pages)
    if need <= num_rows:
        return
    parts = [f"sink {plan.sink_rows * row_bytes:,} B"]
    for sp in plan.subpools:
        n = pages[sp.name]
        if sp.kind == "state":
            what = f"{n} state slots (working + {checkpoint_slots} checkpoints)"
        else:
            what = f"{n:,} pages of {sp.page_size} tokens" + (f" (window {sp.window} + 1 page)" if sp.kind == "window" else "")
        parts.append(f"{sp.name}: {what} = {n * sp.page_bytes:,} B")
    lo, hi = 0, max_model_len  # largest context that would fit: for the message
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _floor_rows(plan, request_pages(plan, mid, checkpoint_slots)) <= num_rows:
            lo = mid
        else:
            hi = mid - 1
    raise ArenaSizeError(
        f"arena too small for one request alone (bs=1 floor) at max_model_len={max_model_len:,}: it needs "
        f"{need * row_bytes:,} B ({_gib(need * row_bytes)}) = {'; '.join(parts)}, alignment included; the arena "
        f"has {num_rows * row_bytes:,} B ({_gib(num_rows * row_bytes)}). Raise --gpu-memory-utilization (or the "
        f"budget), lower --max-model-len (at most {lo:,} fits now), lower the page size (now {plan.page_size}), "
        f"or lower the checkpoint count (now {checkpoint_slots}).")


# ---------------------------------------------------------------------- static split


def static_regions(plan: Plan, num_rows: int, *, swa_full_tokens_ratio: float = 0.8,
                   mamba_full_memory_ratio: float = 0.9) -> dict[str, tuple[int, int]]:
    """Split the arena into fixed per-sub-pool regions by SGLang's ratios (the control mode).

    With F full-attention tokens:
      window tokens (all window sub-pools together) = swa_full_tokens_ratio * F
      state bytes = mamba_full_memory_ratio * full KV bytes (F * full entry bytes)
    Several windows share the window tokens in proportion to their window lengths, since a
    request holds about `w` tokens of each window, so that split matches what requests take.
    Returns {name: (lo_row, hi_row)} in chain order above the sink, each end on its sub-pool's
    page grid, non-overlapping, inside [sink, num_rows).  Rounding goes down for every region but
    the full one, which takes what is left up to the top.
    """
    full = plan.full
    windows, state = plan.windows, plan.state
    wsum = sum(sp.window for sp in windows)
    # bytes per full token, all regions together (ignoring page rounding, fixed below)
    per_full_token = full.entry_bytes * (1 + (mamba_full_memory_ratio if state is not None else 0.0))
    per_full_token += sum(swa_full_tokens_ratio * sp.window / wsum * sp.entry_bytes for sp in windows)
    row_bytes = plan.row_words * WORD_BYTES
    avail = (num_rows - plan.sink_rows) * row_bytes
    f_tokens = avail / per_full_token
    want = {}
    if state is not None:
        want[state.name] = mamba_full_memory_ratio * f_tokens * full.entry_bytes / state.entry_bytes
    for sp in windows:
        want[sp.name] = swa_full_tokens_ratio * f_tokens * sp.window / wsum

    regions, cursor = {}, plan.sink_rows
    for sp in plan.subpools[:-1]:
        first = sp.page_ceil(cursor)
        n = int(want[sp.name] // sp.page_size)
        if n < 1:
            raise ArenaSizeError(f"static split gives {sp.name} no page in an arena of {num_rows:,} rows; raise the "
                                 "budget or change --swa-full-tokens-ratio / --mamba-full-memory-ratio")
        regions[sp.name] = (sp.page_row(first), sp.page_row(first + n))
        cursor = regions[sp.name][1]
    lo, hi = full.page_row(full.page_ceil(cursor)), full.page_row(full.num_pages(num_rows))
    if hi - lo < full.rows_per_page:
        raise ArenaSizeError(f"static split leaves the full sub-pool no page in an arena of {num_rows:,} rows")
    regions[full.name] = (lo, hi)
    return regions


__all__ = ["ArenaSize", "ArenaSizeError", "budget_bytes", "check_bs1_floor", "compiled_temp_bytes",
           "request_pages", "size_arena", "static_regions"]
