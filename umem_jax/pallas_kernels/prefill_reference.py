"""Paged prefill attention: the argument checks of its contract and the plain-JAX reference.

Both prefill kernels (the Triton one in paged_prefill.py, the Mosaic GPU one in
paged_prefill_mgpu.py) take the same arguments and must compute what
`paged_prefill_attention_reference` computes; the contract is in paged_prefill.py's docstring
and docs/kernel_contracts.md.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from .kv_write import check_view, read_kv_reference

__all__ = ["check_prefill_args", "check_prefill_options", "paged_prefill_attention_reference"]


def check_prefill_args(q, arena, page_table, q_lens, kv_lens, sinks, view) -> None:
    """Static shape/dtype checks of q [B, T, Hq, D], the page table int32 [B, P], q_lens and
    kv_lens int32 [B] and sinks [Hq] | None against `view` and `arena`."""
    check_view(arena, view)
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, Hq, D], got shape {q.shape}")
    B, _, Hq, D = q.shape
    Hkv = view.num_kv_heads
    if D != view.head_dim:
        raise ValueError(f"q head_dim {D} != the view's head_dim {view.head_dim}")
    if Hq % Hkv:
        raise ValueError(f"q heads {Hq} are not a multiple of kv heads {Hkv}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be floating point, got {q.dtype}")
    if page_table.ndim != 2 or page_table.shape[0] != B or jnp.dtype(page_table.dtype) != jnp.int32:
        raise ValueError(f"page_table must be int32 [{B}, P], got {page_table.dtype}{list(page_table.shape)}")
    for name, a in (("q_lens", q_lens), ("kv_lens", kv_lens)):
        if a.shape != (B,) or jnp.dtype(a.dtype) != jnp.int32:
            raise ValueError(f"{name} must be int32 [{B}], got {a.dtype}{list(a.shape)}")
    if sinks is not None and sinks.shape != (Hq,):
        raise ValueError(f"sinks must be [{Hq}] (one logit per q head), got {sinks.shape}")


def check_prefill_options(window, softcap) -> None:
    """window and softcap are None or positive."""
    # A whole number, as decode's check_decode_args wants: a float window reached the Pallas kernel's
    # integer block arithmetic as an obscure lax.div dtype error (and the reference took it silently).
    if window is not None and (isinstance(window, bool) or int(window) != window or window <= 0):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be positive, got {softcap}")


def paged_prefill_attention_reference(q, arena, page_table, q_lens, kv_lens, *, view, window=None,
                                      softcap=None, sinks=None, scale=None, kv_dtype=None, k_scale=None,
                                      v_scale=None):
    """Plain-JAX paged prefill attention: gather every mapped token, mask, softmax in fp32.

    Shapes as in paged_prefill's docstring; returns [B, T, Hq, Dv] in q.dtype.  Key positions no
    query may see (tombstoned pages, unwritten slots, sink entries) are zeroed before use, so NaN
    garbage there cannot leak through `0 * NaN`.  fp8 views: K/V dequantised (fp8 * k_scale /
    v_scale, f32 [Hkv] or scalars, default 1.0) by read_kv_reference.
    """
    check_prefill_args(q, arena, page_table, q_lens, kv_lens, sinks, view)
    check_prefill_options(window, softcap)  # called directly too (the tests' oracle), not only via the wrapper
    B, T, Hq, D = q.shape
    Hkv, Dv = view.num_kv_heads, view.v_head_dim
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    k, v = read_kv_reference(arena, page_table, view=view, kv_dtype=kv_dtype, k_scale=k_scale,
                             v_scale=v_scale)  # [B, S, Hkv, D|Dv]
    S = k.shape[1]

    j = jnp.arange(T, dtype=jnp.int32)
    p = jnp.arange(S, dtype=jnp.int32)
    pos = (kv_lens - q_lens)[:, None] + j[None, :]  # [B, T]
    vis = (p[None, None, :] <= pos[:, :, None]) & (j[None, :, None] < q_lens[:, None, None])
    if window is not None:
        vis &= p[None, None, :] > pos[:, :, None] - window
    used = vis.any(axis=1)  # [B, S]: keys some query sees; everything else may be garbage
    k = jnp.where(used[:, :, None, None], k.astype(jnp.float32), 0.0)
    v = jnp.where(used[:, :, None, None], v.astype(jnp.float32), 0.0)

    qf = q.astype(jnp.float32).reshape(B, T, Hkv, G, D)
    s = jnp.einsum("btkgd,bskd->bkgts", qf, k, precision=lax.Precision.HIGHEST) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(vis[:, None, None], s, -jnp.inf)  # [B, Hkv, G, T, S]
    if sinks is not None:
        sink_logits = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, Hkv, G, 1, 1), (B, Hkv, G, T, 1))
        s = jnp.concatenate([s, sink_logits], axis=-1)
    w = jax.nn.softmax(s, axis=-1)
    if sinks is not None:
        w = w[..., :S]
    o = jnp.einsum("bkgts,bskd->btkgd", w, v, precision=lax.Precision.HIGHEST).reshape(B, T, Hq, Dv)
    valid = j[None, :] < q_lens[:, None]
    return jnp.where(valid[:, :, None, None], o, 0.0).astype(q.dtype)
