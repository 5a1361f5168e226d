"""ScheduledBatch: one step the scheduler picked (its rows), and Buckets, the fixed shapes steps
are padded to so each shape compiles once."""

from __future__ import annotations

import bisect
import dataclasses

from .request import Request

CHECKPOINTS_PER_ROW = 2  # a prefill pass checkpoints at most its fork point and its last page boundary


# ------------------------------------------------------------------------------ shapes


def _pow2_upto(lo: int, hi: int) -> tuple[int, ...]:
    out, n = [], max(1, lo)
    while n < hi:
        out.append(n)
        n *= 2
    return tuple(out) + (hi,)


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The fixed step shapes: batch rows B, prefill tokens per row T, page-table width P.
    Every step is padded up to the smallest bucket that holds it, so a steady workload
    compiles each (kind, B, T, P) once."""

    batch: tuple[int, ...]
    tokens: tuple[int, ...]  # prefill T, each >= 2 (T == 1 is decode)
    pages: tuple[int, ...]

    def __post_init__(self):
        for name in ("batch", "tokens", "pages"):
            v = getattr(self, name)
            if not v or list(v) != sorted(set(v)) or v[0] < 1:
                raise ValueError(f"buckets.{name} must be ascending positive sizes, got {v}")
        if self.tokens[0] < 2:
            raise ValueError("prefill token buckets must be >= 2 (T == 1 is the decode shape)")

    @classmethod
    def default(cls, max_num_seqs: int, max_num_batched_tokens: int, max_pages: int) -> "Buckets":
        """Powers of two: B 1..max_num_seqs, T 16..max_num_batched_tokens, P 8..max_pages."""
        return cls(_pow2_upto(1, max_num_seqs), _pow2_upto(min(16, max_num_batched_tokens), max_num_batched_tokens),
                   _pow2_upto(min(8, max_pages), max_pages))

    def reachable(self, max_num_batched_tokens: int, page_size: int, max_num_seqs: int,
                  checkpoints_per_row: int = 0) -> list[tuple[int, int, int, int]]:
        """Every (B, T, P, checkpoints per row) step shape the scheduler can launch, decode first
        (decode steps take no checkpoints): decode [B, 1] at
        any page width; prefill [B, T] within the token budget (a lone row may take the largest T:
        scheduler.prefill.fit_chunk) at the page widths a row of T tokens can need."""
        top_b = self.pick(self.batch, max_num_seqs)
        batches = [b for b in self.batch if b <= top_b]
        limit = max(max_num_batched_tokens, self.batch[0] * self.tokens[-1])
        out = [(b, 1, p, 0) for b in batches for p in self.pages]
        for b in batches:
            for i, t in enumerate(self.tokens):
                if b != self.batch[0] and b * t > limit:
                    continue
                longest = self.tokens[i - 1] + 1 if i else 1  # the widest row is longer than the bucket below
                if -(-longest // page_size) > self.pages[-1]:  # no request is that long
                    continue
                min_p = self.pick(self.pages, -(-longest // page_size))
                out += [(b, t, p, checkpoints_per_row) for p in self.pages if p >= min_p]
        return out

    @staticmethod
    def pick(sizes: tuple[int, ...], n: int) -> int:
        i = bisect.bisect_left(sizes, n)
        if i == len(sizes):
            raise ValueError(f"{n} is above the largest bucket {sizes[-1]}")
        return sizes[i]


# ------------------------------------------------------------------------------ batches


@dataclasses.dataclass
class Row:
    """One request in a step: compute its tokens [start, end); sample if that is all of them.
    checkpoints: ((position, state slot id), ...) -- also write the state after `position`
    tokens (start < position <= end) into that slot (prefix-cache checkpoints)."""

    req: Request
    start: int
    end: int
    sample: bool
    checkpoints: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass
class ScheduledBatch:
    kind: str  # "prefill" | "decode"
    rows: list[Row]
    spec_lens: list[int] | None = None  # speculative decode: tokens each row's draft proposes (None: off)

    @property
    def num_tokens(self) -> int:
        return sum(r.end - r.start for r in self.rows)


__all__ = ["Buckets", "Row", "ScheduledBatch"]
