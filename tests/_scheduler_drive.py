"""Driving a Scheduler without a model, as the engine applies a step's tokens (shared by the
demand and reservation tests): every sampling row gets one token, and a request that reached
max_tokens finishes -- at once (lag 0) or one schedule later (lag 1, async scheduling)."""

from __future__ import annotations

from umem_jax.core.request import RequestStatus

TOKEN = 7  # what every sampling row "samples" (never a stop token in these tests)


def emit(batch, done: list) -> None:
    """One token to each sampling row of `batch`; requests that reached max_tokens join `done`."""
    for row in batch.rows:
        if row.sample:
            row.req.output_token_ids.append(TOKEN)
            if row.req.num_output >= row.req.max_tokens:
                done.append(row.req)


def finish(sch, done: list) -> None:
    """Finish (length) every request in `done`, then empty it."""
    for r in done:
        sch.finish(r, RequestStatus.FINISHED_LENGTH)
    done.clear()
