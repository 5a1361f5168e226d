"""The paged decode contract in plain JAX (gather every mapped token, mask, softmax in fp32) and its
argument checks: what the Triton kernel (paged_decode.py) and the Mosaic GPU kernel
(paged_decode_mgpu.py) must compute; and `merge_splits`, the split-K merge both kernels' wrappers
end with.  Both kernel modules import this one; paged_decode_mgpu never
imports paged_decode (which imports paged_decode_mgpu lazily, to dispatch to it)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from .kv_write import check_view, read_kv_reference

__all__ = ["check_decode_args", "merge_splits", "paged_decode_attention_reference"]


def check_decode_args(q, arena, page_table, lengths, view, sinks, window=None, softcap=None):
    check_view(arena, view)
    if window is not None and (isinstance(window, bool) or int(window) != window or window <= 0):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap!r}")
    if q.ndim != 3 or q.shape[2] != view.head_dim:
        raise ValueError(f"q must be [B, Hq, {view.head_dim}], got {q.shape}")
    if not jnp.issubdtype(q.dtype, jnp.floating):  # as the prefill's check; the output takes q's dtype
        raise ValueError(f"q must be floating point, got {q.dtype}")
    B, Hq, _ = q.shape
    if Hq % view.num_kv_heads:
        raise ValueError(f"q heads ({Hq}) must be a multiple of kv heads ({view.num_kv_heads})")
    if page_table.ndim != 2 or page_table.shape[0] != B or jnp.dtype(page_table.dtype) != jnp.int32:
        raise ValueError(f"page_table must be int32 [{B}, P], got {page_table.dtype}{list(page_table.shape)}")
    if lengths.shape != (B,) or jnp.dtype(lengths.dtype) != jnp.int32:
        raise ValueError(f"lengths must be int32 [{B}], got {lengths.dtype}{list(lengths.shape)}")
    if sinks is not None and sinks.shape != (Hq,):
        raise ValueError(f"sinks must be [{Hq}], got {sinks.shape}")


# --------------------------------------------------------------------------- reference


@functools.partial(jax.jit, static_argnames=("view", "window", "softcap", "scale", "kv_dtype"))
def paged_decode_attention_reference(q, arena, page_table, lengths, *, view, window=None, softcap=None,
                                     sinks=None, scale=None, kv_dtype=None, k_scale=None, v_scale=None):
    """Plain-JAX decode attention: gather every mapped token (fp8: dequantised), mask, softmax in fp32."""
    check_decode_args(q, arena, page_table, lengths, view, sinks, window, softcap)
    B, Hq, D = q.shape
    Hkv, G = view.num_kv_heads, Hq // view.num_kv_heads
    P = page_table.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    lengths = jnp.minimum(lengths, P * view.page_size)
    k, v = read_kv_reference(arena, page_table, view=view, kv_dtype=kv_dtype, k_scale=k_scale,
                             v_scale=v_scale)  # [B, S, Hkv, D]
    k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    pos = jnp.arange(P * view.page_size, dtype=jnp.int32)[None, :]
    start = jnp.zeros_like(lengths) if window is None else jnp.maximum(lengths - window, 0)
    visible = (pos < lengths[:, None]) & (pos >= start[:, None])               # [B, S]
    # Masked positions may hold anything (poisoned sink pages): zero V so 0 * NaN cannot leak.
    v = jnp.where(visible[:, :, None, None], v, 0.0)
    qg = q.astype(jnp.float32).reshape(B, Hkv, G, D)
    s = jnp.einsum("bhgd,bshd->bhgs", qg, k, precision=lax.Precision.HIGHEST) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    if sinks is not None:
        m = jnp.maximum(m, sinks.astype(jnp.float32).reshape(1, Hkv, G))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m[..., None])
    denom = p.sum(-1)
    if sinks is not None:
        denom = denom + jnp.exp(sinks.astype(jnp.float32).reshape(1, Hkv, G) - m)
    o = jnp.einsum("bhgs,bshd->bhgd", p, v, precision=lax.Precision.HIGHEST)
    o = o / jnp.where(denom == 0, 1.0, denom)[..., None]
    o = jnp.where((lengths > 0)[:, None, None, None], o, 0.0)
    return o.reshape(B, Hq, view.v_head_dim).astype(q.dtype)


def merge_splits(acc, m, l, lengths, sinks, dtype):
    """Merge split-K partials, as both decode kernels' wrappers end: acc [B, Hkv, S, G, Dv]
    unnormalised, m [B, Hkv, S, G] the running max (natural log units), l the sum -> [B, Hkv, G, Dv]
    in dtype; sinks [Hkv * G] join the denominator; lengths == 0 gives 0.  Empty splits: l = 0."""
    Hkv, G = acc.shape[1], acc.shape[3]
    M = jnp.max(m, axis=2)                                                 # [B, Hkv, G]
    if sinks is not None:
        sk = sinks.astype(jnp.float32).reshape(1, Hkv, G)
        M = jnp.maximum(M, sk)
    w = jnp.exp(m - M[:, :, None])                                         # empty splits: l = 0
    num = jnp.sum(acc * w[..., None], axis=2)
    den = jnp.sum(l * w, axis=2)
    if sinks is not None:
        den = den + jnp.exp(sk - M)
    o = num / jnp.where(den == 0, 1.0, den)[..., None]
    o = jnp.where((lengths > 0)[:, None, None, None], o, 0.0)
    return o.astype(dtype)
