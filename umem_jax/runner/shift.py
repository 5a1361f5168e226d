"""The shift of an overlapped speculative decode step: the engine launches it before the step
before it is read back (engine/overlap.py), so the host packed each row as if that step accepted
nothing; these functions move the row on, on the device, by what that step's output says.

A decode step's output [max_batch, W]: column 0 the accepted count a, then the emitted tokens,
the last column the drafts verified (runner/speculative.py, runner/mtp.py).  A row whose
pending token that step made has src >= 0 (its row there).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def decode_fields(f: dict, prev):
    """A speculative decode step's fields with the previous step's outcome applied (module doc:
    overlap).  prev [max_batch, W]: that step's output (accepted count, tokens, ..., drafts
    verified last).  Row b with src[b] >= 0 takes from prev's row src[b]: a accepted, so its
    pending token is prev's token a, and kv_lens and the sampling step move on by a -> (fields
    with every first token filled in (src -1), a [B], that row's verified count [B], the
    prev row [B, W]; 0 where src < 0)."""
    src = f["src"]
    on = src >= 0
    row = jnp.take(prev, jnp.clip(src, 0, prev.shape[0] - 1), axis=0)
    row = jnp.where(on[:, None], row, 0)
    a = row[:, 0]
    t0 = jnp.take_along_axis(row, 1 + jnp.clip(a, 0, prev.shape[1] - 3)[:, None], axis=1)[:, 0]
    tokens = f["tokens"].at[:, 0].set(jnp.where(on, t0, f["tokens"][:, 0]))
    f = dict(f, tokens=tokens, src=jnp.full_like(src, -1), kv_lens=f["kv_lens"] + a, step=f["step"] + a)
    return f, a, row[:, -1], row


def commit_on_device(f: dict, states, a, verified):
    """commit_state's swap for rows the host has not committed yet: a row that kept a < verified
    drafts of the previous step has its state in speculative slot a, so that slot becomes the
    working slot (f["slots"]) and the old working slot takes its place among the speculative
    ones -> (fields, states).  states: (positions, physical slots) [B, k] (every speculative
    slot of the row, in the host's order) or None (no recurrent state)."""
    if states is None:
        return f, None
    pos, slots = states
    hit = (a < verified)[:, None] & (jnp.arange(slots.shape[1])[None, :] == a[:, None])
    work = f["slots"]
    new = jnp.where(hit.any(axis=1), jnp.sum(jnp.where(hit, slots, 0), axis=1), work)
    return dict(f, slots=new), (pos, jnp.where(hit, work[:, None], slots))


def only_verified(states, spec_lens):
    """States (positions, slots) [B, k] with the positions past each row's spec_lens dropped."""
    if states is None:
        return None
    pos, slots = states
    return jnp.where(jnp.arange(pos.shape[1])[None, :] < spec_lens[:, None], pos, -1), slots


@functools.partial(jax.jit, static_argnames="layout")
def pending_shift(meta, prev, *, layout):
    """decode_fields' shift of each row [B] (the accepted count of the step in flight, 0 for rows
    whose pending token is on the host): where a proposer that is not the draft model (a test
    harness) finds each row's position, row.start + shift."""
    return decode_fields(layout.unpack(meta), prev)[1]


@jax.jit
def next_tokens(out):
    """A decode step's output [max_batch, W] -> each row's pending token for the next step
    [max_batch] (the last one emitted): what a plain step after it reads (`src`)."""
    return jnp.take_along_axis(out, 1 + jnp.clip(out[:, :1], 0, out.shape[1] - 3), axis=1)[:, 0]


@functools.partial(jax.jit, static_argnums=1)
def as_output(tokens, width: int):
    """A plain or prefill step's tokens [max_batch] as a decode output [max_batch, width] (nothing
    accepted): what a speculative step after it reads."""
    return jnp.zeros((tokens.shape[0], width), jnp.int32).at[:, 1].set(tokens)


__all__ = ["as_output", "commit_on_device", "decode_fields", "next_tokens", "only_verified", "pending_shift"]
