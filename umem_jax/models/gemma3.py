"""Gemma 3 text decoder (`gemma3_text`): 5 sliding-window layers to 1 global, q/k norm, sandwich norms.

    h = E[ids] * sqrt(d)                       (the scale cast to the weight dtype first)
    per layer:  h += post_attn_norm(attn(input_norm(h)))
                h += post_ffw_norm(mlp(pre_ffw_norm(h)))
    logits = final_norm(h) E^T                  (tied), optionally softcapped

Parameter paths match the checkpoint names with the `model.` prefix dropped
(`layers.3.self_attn.q_proj.weight`, `embed_tokens.weight`, `norm.weight`, `lm_head.weight`
when untied), so loading is a rename.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..core.batch import Batch
from ..memory.declarations import MHA, Full, LayerDecl, Part, Window
from ..memory.plan import Plan
from .attention import Attention, kv_slot
from .config import SLIDING, ModelConfig, from_hf_config
from .layers import MLP, RMSNorm, _init


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(_init(rngs, (vocab, dim), dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)

    def attend(self, h: jax.Array) -> jax.Array:
        return jnp.einsum("...d,vd->...v", h, self.weight[...])


class DecoderLayer(nnx.Module):
    """One Gemma 3 block: attention then MLP, each wrapped in a pre- and a post-norm."""

    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        dt, d, eps = jnp.dtype(cfg.dtype), cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps=eps, dtype=dt)
        self.self_attn = Attention(cfg, layer, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(d, eps=eps, dtype=dt)
        self.pre_feedforward_layernorm = RMSNorm(d, eps=eps, dtype=dt)
        self.mlp = MLP(d, cfg.intermediate_size, cfg.hidden_activation, dtype=dt, rngs=rngs)
        self.post_feedforward_layernorm = RMSNorm(d, eps=eps, dtype=dt)

    def _ffn(self, h: jax.Array) -> jax.Array:
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))

    def dense(self, h, positions, valid):
        a = self.self_attn.dense(self.input_layernorm(h), positions, valid)
        return self._ffn(h + self.post_attention_layernorm(a))

    def __call__(self, h, arena, batch, slot):
        a, arena = self.self_attn(self.input_layernorm(h), arena, batch, slot)
        return self._ffn(h + self.post_attention_layernorm(a)), arena


class Gemma3ForCausalLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dt, rngs=rngs)
        self.layers = nnx.List([self.make_layer(cfg, i, rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dt)
        self.lm_head = None if cfg.tie_word_embeddings else Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dt, rngs=rngs)

    def make_layer(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs) -> nnx.Module:
        return DecoderLayer(cfg, layer, rngs=rngs)

    def arena_slot(self, plan: Plan, layer: int, **kernel_kw):
        """Static placement of `layer`'s memory in the plan, handed to the layer's forward."""
        return kv_slot(plan, layer, **kernel_kw)

    # ------------------------------------------------------------------ memory declaration
    @staticmethod
    def decls(cfg: ModelConfig, kv_dtype: str = "bfloat16") -> list[LayerDecl]:
        """Local layers keep Window(sliding_window) K/V, global layers Full."""
        geom = MHA(cfg.num_kv_heads, cfg.head_dim, dtype=kv_dtype)
        return [LayerDecl(i, (Part(geom, Window(cfg.sliding_window) if t == SLIDING else Full()),))
                for i, t in enumerate(cfg.layer_types)]

    # ------------------------------------------------------------------ pieces
    def embed(self, ids: jax.Array) -> jax.Array:
        w = self.embed_tokens.weight[...]
        # transformers multiplies by sqrt(d) cast to the weight dtype (bf16 rounds it).
        return self.embed_tokens(ids) * jnp.asarray(self.config.hidden_size ** 0.5, w.dtype)

    def logits(self, h: jax.Array) -> jax.Array:
        """h [..., d] -> fp32 logits [..., V]."""
        h = self.norm(h)
        head = self.lm_head if self.lm_head is not None else self.embed_tokens
        out = head.attend(h).astype(jnp.float32)
        cap = self.config.final_logit_softcapping
        return out if cap is None else cap * jnp.tanh(out / cap)

    # ------------------------------------------------------------------ forwards
    def dense(self, tokens: jax.Array, valid: jax.Array | None = None) -> jax.Array:
        """Cache-free forward.  tokens [B, T] (positions 0..T-1) -> logits [B, T, V] fp32."""
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        valid = jnp.ones((b, t), bool) if valid is None else valid
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer.dense(h, positions, valid)
        return self.logits(h)

    def __call__(self, arena: jax.Array, batch: Batch, plan: Plan, **kernel_kw):
        """Serving forward -> (logits [B, V] fp32 at each row's last valid token, arena).

        kernel_kw: impl ("pallas" | "reference") and interpret, passed to every kernel.
        """
        h = self.embed(batch.tokens)
        for i, layer in enumerate(self.layers):
            h, arena = layer(h, arena, batch, self.arena_slot(plan, i, **kernel_kw))
        last = jnp.take_along_axis(h, batch.last_index()[:, None, None], axis=1)[:, 0]
        return self.logits(last), arena


def gemma3_4b_like(dtype: str = "bfloat16") -> ModelConfig:
    """Gemma-3-4B's text decoder shape: 34 layers (5 sliding w=1024 : 1 global), hidden 2560, GeGLU
    10240, 8 q / 4 kv heads x 256, vocab 262144, tied, 128K positions (global RoPE linear x8).
    Its memory is presets.gemma3_4b_like's.  For benchmarks with random weights."""
    return from_hf_config({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
        "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 1024, "sliding_window_pattern": 6,
        "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "max_position_embeddings": 131072, "dtype": dtype})
