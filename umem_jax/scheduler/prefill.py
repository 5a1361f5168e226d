"""The prefill step being shaped: chunks of prompts as rows of [B, T], padded to buckets.

Candidates go in order (admitted requests with prompt left to compute, most preferred first,
then the waiting queue) until the token budget, the largest batch bucket or memory runs out.
Each row takes the longest chunk that keeps the padded shape within the token budget.
"""

from __future__ import annotations

from ..core.request import Request
from ..core.scheduled_batch import Buckets, Row, ScheduledBatch
from ..memory.demand import Demand


def prefill_candidates(running: list[Request], waiting: list[Request]) -> list[Request]:
    """Admitted requests with prompt left to compute (most preferred first), then the waiting
    requests whose every token is known on the host."""
    candidates = sorted((r for r in running if not r.decode_ready), key=lambda r: r.sort_key)
    return candidates + [r for r in waiting if not r.num_pending]


def fit_chunk(buckets: Buckets, max_num_batched_tokens: int, num_rows: int, longest: int, chunk: int) -> int:
    """Shrink `chunk` so the padded prefill [B(num_rows), T(max(longest, chunk))] stays within
    the token budget -> the chunk, or 0 if no chunk fits beside the `longest` row so far."""
    # a lone row may take the largest T bucket, so no shape padded to at most that is worse
    limit = max(max_num_batched_tokens, buckets.batch[0] * buckets.tokens[-1])
    rows_bucket = Buckets.pick(buckets.batch, num_rows)
    chunk = min(chunk, buckets.tokens[-1])
    if chunk <= 0 or rows_bucket * Buckets.pick(buckets.tokens, max(longest, chunk)) <= limit or num_rows == 1:
        return chunk
    fits = [t for t in buckets.tokens if t >= longest and rows_bucket * t <= limit]
    return min(chunk, fits[-1]) if fits else 0


class PrefillBatch:
    """The rows of one prefill step so far, the tokens left in its budget, and the decode
    reservations of the requests it admitted (they are not running yet when the next candidate
    is priced, so admission adds them by hand)."""

    def __init__(self, buckets: Buckets, max_num_batched_tokens: int, min_chunk: int):
        self.buckets = buckets
        self.max_num_batched_tokens = max_num_batched_tokens
        self.min_chunk = min_chunk
        self.rows: list[Row] = []
        self.tokens_left = max_num_batched_tokens
        self.longest = 0  # the longest row's chunk: T of the padded shape
        self.admitted_reservations = Demand()

    @property
    def full(self) -> bool:
        return len(self.rows) >= self.buckets.batch[-1]

    @property
    def request_ids(self) -> set[int]:
        """ids of the requests with a row in it: never retracted to make room for another."""
        return {id(row.req) for row in self.rows}

    def chunk_for(self, req: Request, max_chunk: int) -> int:
        """Tokens of `req`'s next pass in this batch, at most `max_chunk` -> 0 if it gets none:
        the shape leaves no room, or only a sliver of its prompt (under min_chunk) behind other
        rows (it waits for a step that gives it more, rather than cost a pass for a few tokens)."""
        chunk = fit_chunk(self.buckets, self.max_num_batched_tokens, len(self.rows) + 1, self.longest,
                          min(req.to_compute, self.tokens_left, max_chunk))
        if chunk <= 0 or (chunk < req.to_compute and chunk < self.min_chunk and self.rows):
            return 0
        return chunk

    def add(self, row: Row) -> None:
        self.rows.append(row)
        self.tokens_left -= row.end - row.start
        self.longest = max(self.longest, row.end - row.start)

    def scheduled(self) -> ScheduledBatch | None:
        return ScheduledBatch("prefill", self.rows) if self.rows else None
