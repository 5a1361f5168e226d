"""The decoder every family here shares: embedding, a list of layers, final RMSNorm, LM head.

    h = E[ids]                                  (Gemma-style families: times sqrt(d))
    per layer i:  h = layer_i(h)                attention, recurrent mixer or MLP block
    logits = final_norm(h) W^T                  (W = E when tied), optionally softcapped

A family subclasses `CausalLM` with its layers (`make_layer`) and, for recurrent layers, the
state they keep (`state_tensors`); its checkpoint's top-level names are class attributes, so
loading stays a rename.  The memory declarations follow from the layer types alone: full
attention keeps Full K/V, sliding attention Window K/V, recurrent layers one State per request,
anything else (NemotronH's MLP blocks) nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from ..core.batch import Batch
from ..memory.declarations import (
    FP8_E4M3,
    MHA,
    Full,
    LayerDecl,
    Part,
    State,
    StateGeometry,
    StateTensor,
    Window,
    is_fp8,
    kv_cache_dtype,
)
from ..memory.plan import Plan
from .arena_slot import arena_slot
from .config import FULL, LAYER_TYPES, RECURRENT, SLIDING, ModelConfig
from .layers import Embedding, RMSNorm, settle

# Tokens whose logits one block of `score_tokens` holds: 512 x a 262K vocabulary is 512 MiB fp32.
SCORE_BLOCK = 512


class ResidualLayer(nnx.Module):
    """h = ffn(h, post_mixer(mixer(input_layernorm(h)))), ffn(h, a) the feed-forward block over h + a.

    A subclass provides `input_layernorm`, `mixer` (attention or a recurrent mixer: a `dense`
    forward and a serving forward over the arena) and `ffn(h, a)` (the residual add, then the
    residual feed-forward block: it takes the add apart so that its norm can fuse it, RMSNorm.add);
    `post_mixer` is the identity unless overridden (Gemma's post-attention norm).
    """

    def post_mixer(self, a: jax.Array) -> jax.Array:
        return a

    def dense(self, h: jax.Array, positions: jax.Array, valid: jax.Array) -> jax.Array:
        return self.ffn(h, self.post_mixer(self.mixer.dense(self.input_layernorm(h), positions, valid)))

    def __call__(self, h: jax.Array, arena: jax.Array, batch: Batch, slot):
        a, arena = self.mixer(self.input_layernorm(h), arena, batch, slot)
        return self.ffn(h, self.post_mixer(a)), arena


class CausalLM(nnx.Module):
    # The checkpoint's names (without the `model.` prefix) of the embedding and the final norm.
    embedding_name = "embed_tokens"
    final_norm_name = "norm"
    final_norm_offset = 1.0  # 1: zero-centred weight, x_hat * (1 + w); 0: plain x_hat * w
    scale_embeddings = False  # Gemma multiplies the embeddings by sqrt(hidden_size)
    checkpoint_interval = 0  # decode tokens between prefix-cache checkpoints of the recurrent state

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.config = cfg
        setattr(self, self.embedding_name, Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs))
        self.layers = nnx.List([self.make_layer(cfg, i, rngs) for i in range(cfg.num_layers)])
        setattr(self, self.final_norm_name,
                RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, offset=self.final_norm_offset, dtype=dtype))
        self.lm_head = (None if cfg.tie_word_embeddings
                        else Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs))

    def make_layer(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs) -> nnx.Module:
        """Layer `layer` of the family: `layer.dense(h, positions, valid)` and
        `layer(h, arena, batch, slot) -> (h, arena)`."""
        raise NotImplementedError

    @property
    def embedding(self) -> Embedding:
        return getattr(self, self.embedding_name)

    @property
    def final_norm(self) -> RMSNorm:
        return getattr(self, self.final_norm_name)

    @classmethod
    def checkpoint_to_params(cls, cfg: ModelConfig, tensors: dict) -> dict:
        """{checkpoint name (text prefix stripped): array} -> {our parameter path: array}.

        The identity: our parameter paths are the checkpoint's names.  A family whose checkpoint
        keeps some weights in another form (one tensor per expert, quantised blocks) overrides
        this to build its module's arrays from them; loader.build then checks every name and shape.
        """
        return tensors

    # ------------------------------------------------------------------ memory declaration
    @staticmethod
    def state_tensors(cfg: ModelConfig, conv_dtype: str) -> tuple[StateTensor, ...]:
        """What one recurrent layer keeps per request (families with recurrent layers say)."""
        raise NotImplementedError(f"{cfg.architecture} declares no state for its recurrent layers")

    @classmethod
    def decls(cls, cfg: ModelConfig, kv_dtype: str = "bfloat16") -> list[LayerDecl]:
        """One LayerDecl per layer that keeps memory; K/V (and conv windows) stored as kv_dtype.
        fp8 K/V keeps the conv windows in the model's dtype ("auto"): fp8 is for K/V rows only."""
        fp8 = is_fp8(kv_dtype)
        kv = MHA(cfg.num_kv_heads, cfg.head_dim, dtype=FP8_E4M3 if fp8 else kv_dtype)
        conv_dtype = kv_cache_dtype("auto", cfg.dtype) if fp8 else kv_dtype
        out = []
        for i, kind in enumerate(cfg.layer_types):
            if kind == FULL:
                part = Part(kv, Full())
            elif kind == SLIDING:
                part = Part(kv, Window(cfg.sliding_window))
            elif kind == RECURRENT:
                part = Part(StateGeometry(cls.state_tensors(cfg, conv_dtype)), State(cls.checkpoint_interval))
            else:
                continue
            out.append(LayerDecl(i, (part,)))
        return out

    # ------------------------------------------------------------------ pieces
    def embed(self, ids: jax.Array) -> jax.Array:
        e = self.embedding(ids)
        if not self.scale_embeddings:
            return e
        # transformers multiplies by sqrt(d) cast to the weight dtype (bf16 rounds it).
        return e * jnp.asarray(self.config.hidden_size ** 0.5, self.embedding.weight[...].dtype)

    def logits(self, h: jax.Array) -> jax.Array:
        """h [..., d] -> fp32 logits [..., V]."""
        return self.head_logits(self.final_norm(h))

    def head_logits(self, normed: jax.Array) -> jax.Array:
        """The LM head alone: a normed hidden [..., d] -> fp32 logits [..., V] (an MTP head
        normalises its own output and shares this head: models/mtp.py)."""
        head = self.lm_head if self.lm_head is not None else self.embedding
        out = head.attend(normed)  # fp32 (Embedding.attend)
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

    def __call__(self, arena: jax.Array, batch: Batch, plan: Plan, *, memory_model: str = "target",
                 all_positions: bool = False, decode_rows: bool = False, hidden: bool = False,
                 per_token: Callable | None = None, **kernel_kw):
        """Serving forward -> (logits [B, V] fp32 at each row's last valid token, arena).

        kernel_kw: impl ("pallas" | "reference") and interpret, passed to every kernel.
        memory_model: whose layers of the plan this model reads and writes ("draft" for a
        speculative draft planned beside the target).  all_positions: logits [B, T, V] of every
        token (a speculative verify reads them all).  decode_rows: every row decodes, T > 1 too
        (a verify): no prefill-only rule applies (ArenaSlot.decode_rows).  hidden: the first
        item is (logits, the final-normed hidden [B, T, d] of every token): what an MTP head reads.
        per_token: the first item is (logits, `score_tokens(normed, batch.targets, per_token)`):
        every token's logits scored against its target (prompt logprobs).
        """
        h = self.embed(batch.tokens)
        for i, layer in enumerate(self.layers):
            keeps_memory = self.config.layer_types[i] in LAYER_TYPES
            slot = arena_slot(plan, i, memory_model, decode_rows=decode_rows, **kernel_kw) if keeps_memory else None
            h, arena = layer(h, arena, batch, slot)
        h = settle(h)  # a layer may leave its residual add pending (RMSNorm.enter)
        last = lambda x: x if all_positions else jnp.take_along_axis(x, batch.last_index()[:, None, None], axis=1)[:, 0]
        if hidden or per_token is not None:
            normed = self.final_norm(h)
            extra = normed if hidden else self.score_tokens(normed, batch.targets, per_token)
            return (self.head_logits(last(normed)), extra), arena
        return self.logits(last(h)), arena

    def score_tokens(self, normed: jax.Array, targets: jax.Array, fn: Callable, block: int = SCORE_BLOCK):
        """fn(logits [n, V] fp32, targets [n] int32) -> arrays [n, ...], applied to the LM head's
        logits of every token of normed [B, T, d] (targets [B, T]) in blocks of `block` tokens, so
        the [block, V] logits are the largest temporary -> those arrays as [B, T, ...]."""
        b, t, d = normed.shape
        n = b * t
        blk = min(block, n)
        nb = -(-n // blk)
        x = jnp.pad(normed.reshape(n, d), ((0, nb * blk - n), (0, 0))).reshape(nb, blk, d)
        y = jnp.pad(targets.reshape(n).astype(jnp.int32), (0, nb * blk - n)).reshape(nb, blk)
        out = jax.lax.map(lambda xy: fn(self.head_logits(xy[0]), xy[1]), (x, y))
        return jax.tree.map(lambda a: a.reshape(nb * blk, *a.shape[2:])[:n].reshape(b, t, *a.shape[2:]), out)


__all__ = ["CausalLM", "ResidualLayer"]
