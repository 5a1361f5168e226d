"""The Batch pytree: what one step of the model reads besides the weights and the arena.

Shapes are padded to the runner's buckets so the step compiles once per bucket:

    tokens       [B, T] int32   new tokens of each row, left-aligned; T == 1 is decode
    q_lens       [B]    int32   valid new tokens per row (0: padding row)
    kv_lens      [B]    int32   tokens in cache after this step's tokens are written
    page_tables  {sub-pool name: [B, P] int32}  physical page of token page i (pos // page_size);
                                sink 0 where unmapped.  Window sub-pools use the same index as
                                full, with pages that left the window tombstoned to 0.
    state_slots  [B]    int32   physical state slot per row (0 for padding rows)
    checkpoint_positions, checkpoint_slots   [B, K] int32 or None (prefill only): the recurrent
                                state after the first p tokens of row b's chunk is also written
                                to physical slot s (prefix-cache checkpoints); p = -1 or s = 0 is
                                padding.  None: no checkpoints (decode, or caching off).
    targets      [B, T] int32 or None: the token each new token is scored against (the one after
                                it), for prompt logprobs (core/prompt_logprobs.py); None: no scores.

Row b's new token j < q_lens[b] sits at position kv_lens[b] - q_lens[b] + j.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class Batch:
    tokens: jax.Array
    q_lens: jax.Array
    kv_lens: jax.Array
    page_tables: dict[str, jax.Array]
    state_slots: jax.Array
    checkpoint_positions: jax.Array | None = None
    checkpoint_slots: jax.Array | None = None
    targets: jax.Array | None = None

    def positions(self) -> jax.Array:
        """[B, T] int32 position of every new token (padding rows continue the count)."""
        t = self.tokens.shape[1]
        start = self.kv_lens - self.q_lens
        return start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]

    def valid(self) -> jax.Array:
        """[B, T] bool: token j of row b is real (j < q_lens[b])."""
        return jnp.arange(self.tokens.shape[1], dtype=jnp.int32)[None, :] < self.q_lens[:, None]

    def write_targets(self, name: str, page_size: int) -> tuple[jax.Array, jax.Array]:
        """Where the new tokens' K/V go in sub-pool `name`: (pages, slots), each [B*T] int32.

        page = page_tables[name][b, pos // page_size], slot = pos % page_size; padding rows
        (j >= q_len) write into the sink, page 0.
        """
        table = self.page_tables[name]
        pos = self.positions()
        idx = jnp.clip(pos // page_size, 0, table.shape[1] - 1)
        pages = jnp.take_along_axis(table, idx, axis=1)
        pages = jnp.where(self.valid(), pages, 0)
        slots = pos % page_size
        return pages.reshape(-1).astype(jnp.int32), slots.reshape(-1).astype(jnp.int32)

    def last_index(self) -> jax.Array:
        """[B] index of each row's last valid token (0 for padding rows)."""
        return jnp.maximum(self.q_lens - 1, 0)


def make_batch(tokens, q_lens, kv_lens, page_tables, state_slots=None) -> Batch:
    """Build a Batch from host arrays (numpy or lists), casting everything to int32."""
    tokens = jnp.asarray(tokens, jnp.int32)
    b = tokens.shape[0]
    if state_slots is None:
        state_slots = jnp.zeros((b,), jnp.int32)
    return Batch(tokens, jnp.asarray(q_lens, jnp.int32), jnp.asarray(kv_lens, jnp.int32),
                 {k: jnp.asarray(v, jnp.int32) for k, v in page_tables.items()}, jnp.asarray(state_slots, jnp.int32))
