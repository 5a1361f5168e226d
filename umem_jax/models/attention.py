"""Attention layer: GQA with optional q/k RMSNorm, RoPE (full or partial, or none), sliding
window, logit softcap, per-head output gate, projection biases and attention sinks (gpt-oss: a
learned per-head logit `sinks` [Hq] that joins each softmax denominator, no value row).

Two paths share the projections (`project`) and the output (`output`):
  * `dense`: cache-free attention over the tokens given (the math oracle, checked against
    transformers; also what a no-arena prefill would run);
  * `__call__`: the serving path.  It writes this step's K/V into the arena first
    (kv_write.write_kv), then attends over the *new* arena (paged_decode for T == 1,
    paged_prefill otherwise), so no older arena version is ever read and XLA can update the
    donated arena in place.

A family changes how q, k, v (and a gate) come out of the projections by overriding `project`
(Qwen3.5's gated attention does); the cache writes and kernel calls stay these.

fp8 K/V (kv_cache_dtype "fp8_e4m3"): `k_scale`, `v_scale` [Hkv] are the layer's
dequantisation scales (vLLM's names: K is stored as k / k_scale, read as fp8 * k_scale), from
the checkpoint when it ships them (loader.py maps vLLM's names), else 1.0.  They ride with the
weights (split over kv heads under TP), are handed to the kernels only when the layer's view is
fp8, and are unused otherwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..core.batch import Batch
from ..pallas_kernels.kv_write import write_kv
from ..pallas_kernels.paged_decode import paged_decode_attention
from ..pallas_kernels.paged_prefill import paged_prefill_attention
from ..pallas_kernels.short_extend import paged_short_extend_attention, short_extend_applies
from .arena_slot import ArenaSlot
from .config import ModelConfig
from .layers import FusedLinear, Linear, RMSNorm, apply_rope, fp32_precision, rope_inv_freq

_NEG = -1e30  # finite, so fully masked rows (padding) give zeros, not NaN


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, qk_norm: bool = True, bias: bool = False,
                 sinks: bool = False, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        d, hq, hkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, hd
        self.window = cfg.window_of(layer)
        self.scale = cfg.attn_scale
        self.softcap = cfg.attn_logit_softcapping
        self.rope = cfg.rope_for(cfg.layer_types[layer])  # None: no positional encoding (NemotronH)
        self.rotary_dim = hd  # RoPE turns the first rotary_dim dims of each head
        self.q_proj = Linear(d, hq * hd, dtype=dtype, rngs=rngs, bias=bias)
        self.k_proj = Linear(d, hkv * hd, dtype=dtype, rngs=rngs, bias=bias)
        self.v_proj = Linear(d, hkv * hd, dtype=dtype, rngs=rngs, bias=bias)
        self.o_proj = Linear(hq * hd, d, dtype=dtype, rngs=rngs, bias=bias)
        self.sinks = nnx.Param(jnp.zeros((hq,), dtype)) if sinks else nnx.data(None)
        # fp8 K/V only (module docstring).  In the weights' dtype like every parameter: a bf16 scale
        # is exact for the kernels, which quantise and dequantise with the same stored value.
        self.k_scale = nnx.Param(jnp.ones((hkv,), dtype))
        self.v_scale = nnx.Param(jnp.ones((hkv,), dtype))
        if qk_norm:
            self.q_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_proj = nnx.data(None)  # FusedLinear over q | k | v once fuse_projections() ran

    def fuse_projections(self, donate: bool = False) -> bool:
        """Replace q_proj, k_proj and v_proj by one FusedLinear over their stacked weights."""
        if self.qkv_proj is not None:  # fused already
            return False
        self.qkv_proj = FusedLinear([self.q_proj, self.k_proj, self.v_proj], donate=donate)
        self.q_proj = self.k_proj = self.v_proj = None
        return True

    def project_qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, T, d] -> the three projections, flat: q_proj(x), k_proj(x), v_proj(x)."""
        if self.qkv_proj is not None:
            return self.qkv_proj(x)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def project(self, x: jax.Array, positions: jax.Array):
        """x [B, T, d], positions [B, T] -> q [B, T, Hq, D], k and v [B, T, Hkv, D], and the
        output gate [B, T, Hq*D] (None here: no gate)."""
        b, t, _ = x.shape
        q, k, v = self.project_qkv(x)
        q = q.reshape(b, t, self.num_heads, self.head_dim)
        k = k.reshape(b, t, self.num_kv_heads, self.head_dim)
        v = v.reshape(b, t, self.num_kv_heads, self.head_dim)
        q, k = self.position(q, k, positions)
        return q, k, v, None

    def position(self, q: jax.Array, k: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Per-head q/k RMSNorm (when the layer has it), then RoPE on the first rotary_dim dims."""
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is None:
            return q, k
        inv_freq = rope_inv_freq(self.rope, self.rotary_dim)
        return self._rotate(q, positions, inv_freq), self._rotate(k, positions, inv_freq)

    def _rotate(self, x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
        r, scaling = self.rotary_dim, self.rope.attention_scaling
        if r == self.head_dim:
            return apply_rope(x, positions, inv_freq, scaling)
        return jnp.concatenate([apply_rope(x[..., :r], positions, inv_freq, scaling), x[..., r:]], axis=-1)

    def sink_logits(self) -> jax.Array | None:
        """The per-head sink logits, f32 [Hq] (None: no sinks), as the kernels take them."""
        return None if self.sinks is None else self.sinks[...].astype(jnp.float32)

    def kv_scales(self, slot: ArenaSlot) -> dict:
        """The fp8 dequantisation scales as kernel keywords (k_scale, v_scale f32 [Hkv]) when the
        layer's K/V view is fp8; {} otherwise (the kernels refuse scales for other dtypes)."""
        if not slot.fp8:
            return {}
        return {"k_scale": self.k_scale[...].astype(jnp.float32), "v_scale": self.v_scale[...].astype(jnp.float32)}

    def output(self, o: jax.Array, gate: jax.Array | None, dtype) -> jax.Array:
        """Attention output o [B, T, Hq, D] -> o_proj(o * sigmoid(gate)) [B, T, d] (no gate: o_proj(o))."""
        b, t = o.shape[:2]
        o = o.reshape(b, t, self.num_heads * self.head_dim).astype(dtype)
        return self.o_proj(o if gate is None else o * jax.nn.sigmoid(gate))

    def dense(self, x: jax.Array, positions: jax.Array, valid: jax.Array) -> jax.Array:
        """Cache-free attention of the tokens in x among themselves.

        x [B, T, d]; positions [B, T]; valid [B, T] bool (keys that exist) -> [B, T, d].
        """
        b, t, _ = x.shape
        q, k, v, gate = self.project(x, positions)
        group = self.num_heads // self.num_kv_heads
        q = q.reshape(b, t, self.num_kv_heads, group, self.head_dim)
        s = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, precision=fp32_precision(q, k),
                       preferred_element_type=jnp.float32) * self.scale
        if self.softcap is not None:
            s = self.softcap * jnp.tanh(s / self.softcap)
        qp, kp = positions[:, :, None], positions[:, None, :]
        mask = (kp <= qp) & valid[:, None, :]
        if self.window is not None:
            mask &= kp > qp - self.window  # the query sees `window` keys, itself included
        s = jnp.where(mask[:, None, None], s, _NEG)
        if self.sinks is None:
            p = jax.nn.softmax(s, axis=-1)
        else:  # one more logit per head in the denominator, with no value: dropped after the softmax
            sink = jnp.broadcast_to(self.sink_logits().reshape(1, self.num_kv_heads, group, 1, 1), (*s.shape[:-1], 1))
            p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
        o = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v, precision=fp32_precision(v))
        return self.output(o, gate, x.dtype)

    def __call__(self, x: jax.Array, arena: jax.Array, batch: Batch, slot: ArenaSlot):
        """Serving path.  x [B, T, d] -> ([B, T, d], arena with this step's K/V written)."""
        b, t, _ = x.shape
        view = slot.view
        q, k, v, gate = self.project(x, batch.positions())
        pages, offsets = batch.write_targets(slot.pool, view.page_size)
        scales = self.kv_scales(slot)
        # write_kv casts to what the view stores (bf16, fp32 as two planes, or fp8 / scale).
        arena = write_kv(arena, k.reshape(b * t, self.num_kv_heads, self.head_dim),
                         v.reshape(b * t, self.num_kv_heads, self.head_dim), pages, offsets, view=view,
                         **scales, **slot.kernel_kw)
        # Read only the arena just written: attending over an older version would make XLA
        # keep both alive, i.e. copy the whole arena.
        table = batch.page_tables[slot.pool]
        kw = dict(view=view, window=self.window, softcap=self.softcap, scale=self.scale, sinks=self.sink_logits(),
                  **scales, **slot.kernel_kw)
        if t == 1:
            o = paged_decode_attention(q[:, 0], arena, table, batch.kv_lens, **kw)[:, None]
        elif short_extend_applies(b, t, self.num_kv_heads):  # a verify's few queries: split-K decode rows
            o = paged_short_extend_attention(q, arena, table, batch.q_lens, batch.kv_lens, **kw)
        else:
            o = paged_prefill_attention(q, arena, table, batch.q_lens, batch.kv_lens, **kw)
        return self.output(o, gate, x.dtype), arena


__all__ = ["Attention"]
