"""A short extend (a speculative verify's k + 1 queries) as decode rows.

Contract: that of paged_prefill_attention (docs/kernel_contracts.md)::

    paged_short_extend_attention(q, arena, page_table, q_lens, kv_lens, *, view, window=None,
                                 softcap=None, sinks=None, scale=None, ...) -> o [B, T, Hq, Dv]

Query j < q_lens[b] of row b sits at position kv_lens[b] - q_lens[b] + j and sees the keys up
to itself (and inside the window): exactly a decode query whose cache holds
kv_lens[b] - q_lens[b] + j + 1 tokens.  So the chunk runs as B * T decode rows, row (b, j)
reading row b's page table with that length (0 for j >= q_lens[b]: a padding lane, output 0,
as the prefill contract wants).

Why: the prefill kernel gives each (request, kv head, q block) one program, which walks the
whole context alone.  At B = 1 a verify is a handful of programs on a GPU of 132 SMs, each
reading the context serially: on the H200 (2026-12-05, Qwen3.5-4B-like in fp32, context 512)
each of the 8 attention layers took 0.63 ms of a 13.2 ms verify, against a 7-8 ms decode step
(benchmarks/RESULTS.md).  The decode kernel splits the context over many programs (split-K), so
a row costs what a decode step's does (measured on an H100, 2026-12-05: a verify of 4 positions at
1.18x a decode step, from 1.99x with the prefill kernel).  The price is K/V read once per query instead of once
per request, which matters only when the GPU is already full: `short_extend_applies` takes
this form only for chunks of at most SHORT_EXTEND_TOKENS queries whose prefill grid would
leave most SMs idle.  The same kernel as the decode step also keeps a verify's logits closer to
those of decoding the same tokens one by one (the greedy paths with and without speculation).

UMEM_JAX_SHORT_EXTEND=decode|prefill|auto (default auto) overrides the choice at trace time.
`auto` takes this form on a GPU only: elsewhere the kernels run as their plain-JAX references,
which have no idle SMs to fill, and the per-query gather only costs time (the CPU tests that
check the engine through this path set it to `decode`).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from .paged_decode import paged_decode_attention

__all__ = ["SHORT_EXTEND_ENV", "SHORT_EXTEND_TOKENS", "paged_short_extend_attention", "short_extend_applies"]

SHORT_EXTEND_ENV = "UMEM_JAX_SHORT_EXTEND"
SHORT_EXTEND_TOKENS = 8  # a verify's k + 1 (k <= 7); longer chunks are prefills
# Prefill programs (requests x kv heads, one q block each) below which the GPU is mostly idle:
# about one per SM of an H100 / H200 (132).
FEW_PROGRAMS = 128


def short_extend_applies(batch: int, tokens: int, num_kv_heads: int, choice: str | None = None) -> bool:
    """Whether a chunk of `tokens` queries per row, `batch` rows, runs as decode rows.  choice:
    "decode" | "prefill" | "auto" (None: $UMEM_JAX_SHORT_EXTEND, default auto; auto: on a GPU
    where the prefill grid would leave it mostly idle)."""
    choice = (choice or os.environ.get(SHORT_EXTEND_ENV) or "auto").lower()
    if choice not in ("decode", "prefill", "auto"):
        raise ValueError(f"{SHORT_EXTEND_ENV} must be decode, prefill or auto, got {choice!r}")
    if tokens <= 1 or tokens > SHORT_EXTEND_TOKENS or choice == "prefill":
        return False
    if choice == "decode":
        return True
    return jax.default_backend() == "gpu" and batch * num_kv_heads < FEW_PROGRAMS


def paged_short_extend_attention(q, arena, page_table, q_lens, kv_lens, **kw):
    """q [B, T, Hq, D], page_table int32 [B, P], q_lens / kv_lens int32 [B] (the prefill
    contract) -> [B, T, Hq, Dv]: each query as a decode row of its own length.  kw: those of
    paged_decode_attention (view, window, softcap, sinks, scale, kv_dtype, k/v scales, impl)."""
    B, T, Hq, D = q.shape
    if page_table.ndim != 2 or page_table.shape[0] != B or q_lens.shape != (B,) or kv_lens.shape != (B,):
        raise ValueError(f"q {q.shape} wants page_table [B, P] and q_lens, kv_lens [B] with B = {B}; got "
                         f"{page_table.shape}, {q_lens.shape}, {kv_lens.shape}")
    j = jnp.arange(T, dtype=jnp.int32)[None, :]
    q_lens, kv_lens = q_lens.astype(jnp.int32)[:, None], kv_lens.astype(jnp.int32)[:, None]
    lengths = jnp.where(j < q_lens, kv_lens - q_lens + j + 1, 0)  # [B, T]: query j sees keys up to itself
    o = paged_decode_attention(q.reshape(B * T, Hq, D), arena, jnp.repeat(page_table, T, axis=0),
                               lengths.reshape(B * T), **kw)
    return o.reshape(B, T, Hq, o.shape[-1])
