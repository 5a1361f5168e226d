"""Attention layer: GQA with optional q/k RMSNorm, RoPE, sliding window and logit softcap.

Two paths share the projections:
  * `dense`: cache-free attention over the tokens given (the math oracle, checked against
    transformers; also what a no-arena prefill would run);
  * `__call__`: the serving path.  It writes this step's K/V into the arena first
    (kv_write.write_kv), then attends over the *new* arena (paged_decode for T == 1,
    paged_prefill otherwise), so no older arena version is ever read and XLA can update the
    donated arena in place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from ..core.batch import Batch
from ..memory.plan import KVView, Plan
from ..pallas_kernels.kv_write import write_kv
from ..pallas_kernels.paged_decode import paged_decode_attention
from ..pallas_kernels.paged_prefill import paged_prefill_attention
from .config import ModelConfig
from .layers import FusedLinear, Linear, RMSNorm, apply_rope, rope_inv_freq

_NEG = -1e30  # finite, so fully masked rows (padding) give zeros, not NaN


@dataclasses.dataclass(frozen=True)
class KVSlot:
    """Where one attention layer's K/V live: its sub-pool (the page_tables key) and view, plus
    which kernel implementation to call (None: the kernels' default, Pallas on GPU)."""

    pool: str
    view: KVView
    impl: str | None = None
    interpret: bool = False

    @property
    def kernel_kw(self) -> dict:
        return {"impl": self.impl, "interpret": self.interpret}


def kv_slot(plan: Plan, layer: int, model: str = "target", **kernel_kw) -> KVSlot:
    """Find the sub-pool holding `layer`'s attention rows."""
    for sp in plan.subpools:
        if sp.kv and (model, layer) in sp.layers:
            return KVSlot(sp.name, sp.kv_view(layer, model), **kernel_kw)
    raise KeyError(f"the plan holds no attention rows for layer {model}:{layer}")


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, qk_norm: bool = True, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        d, hq, hkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, hd
        self.window = cfg.window_of(layer)
        self.scale = cfg.attn_scale
        self.softcap = cfg.attn_logit_softcapping
        self.rope = cfg.rope_for(cfg.layer_types[layer])
        self.q_proj = Linear(d, hq * hd, dtype=dt, rngs=rngs)
        self.k_proj = Linear(d, hkv * hd, dtype=dt, rngs=rngs)
        self.v_proj = Linear(d, hkv * hd, dtype=dt, rngs=rngs)
        self.o_proj = Linear(hq * hd, d, dtype=dt, rngs=rngs)
        if qk_norm:
            self.q_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, dtype=dt)
            self.k_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, dtype=dt)
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
        """x [B, T, d], positions [B, T] -> q [B, T, Hq, D], k and v [B, T, Hkv, D]."""
        b, t, _ = x.shape
        q, k, v = self.project_qkv(x)
        q = q.reshape(b, t, self.num_heads, self.head_dim)
        k = k.reshape(b, t, self.num_kv_heads, self.head_dim)
        v = v.reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = rope_inv_freq(self.rope, self.head_dim)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def dense(self, x: jax.Array, positions: jax.Array, valid: jax.Array) -> jax.Array:
        """Cache-free attention of the tokens in x among themselves.

        x [B, T, d]; positions [B, T]; valid [B, T] bool (keys that exist) -> [B, T, d].
        """
        b, t, _ = x.shape
        q, k, v = self.project(x, positions)
        g = self.num_heads // self.num_kv_heads
        q = q.reshape(b, t, self.num_kv_heads, g, self.head_dim)
        s = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32) * self.scale
        if self.softcap is not None:
            s = self.softcap * jnp.tanh(s / self.softcap)
        qp, kp = positions[:, :, None], positions[:, None, :]
        mask = (kp <= qp) & valid[:, None, :]
        if self.window is not None:
            mask &= kp > qp - self.window  # the query sees `window` keys, itself included
        s = jnp.where(mask[:, None, None], s, _NEG)
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v)
        return self.o_proj(o.reshape(b, t, self.num_heads * self.head_dim).astype(x.dtype))

    def __call__(self, x: jax.Array, arena: jax.Array, batch: Batch, slot: KVSlot):
        """Serving path.  x [B, T, d] -> ([B, T, d], arena with this step's K/V written)."""
        b, t, _ = x.shape
        view = slot.view
        q, k, v = self.project(x, batch.positions())
        pages, slots = batch.write_targets(slot.pool, view.page_size)
        # write_kv casts to what the view stores (bf16, or fp32 as two planes).
        arena = write_kv(arena, k.reshape(b * t, self.num_kv_heads, self.head_dim),
                         v.reshape(b * t, self.num_kv_heads, self.head_dim), pages, slots, view=view,
                         **slot.kernel_kw)
        # Read only the arena just written: attending over an older version would make XLA
        # keep both alive, i.e. copy the whole arena.
        table = batch.page_tables[slot.pool]
        kw = dict(view=view, window=self.window, softcap=self.softcap, scale=self.scale, **slot.kernel_kw)
        if t == 1:
            o = paged_decode_attention(q[:, 0], arena, table, batch.kv_lens, **kw)[:, None]
        else:
            o = paged_prefill_attention(q, arena, table, batch.q_lens, batch.kv_lens, **kw)
        o = o.reshape(b, t, self.num_heads * self.head_dim).astype(x.dtype)
        return self.o_proj(o), arena
