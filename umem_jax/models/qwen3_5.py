"""Qwen3.5 text decoder (`qwen3_5_text`, dense): gated DeltaNet and gated full attention, 3 : 1.

    h = E[ids]
    per layer:  h = h + mixer(RMSNorm(h))      linear_attention: gated DeltaNet (gdn_mixer.py)
                                               full_attention:   gated attention (below)
                h = h + MLP(RMSNorm(h))        SwiGLU
    logits = RMSNorm(h) W_lm^T

Every RMSNorm here (final and q/k norms too) is zero-centred, x_hat * (1 + w), like Gemma's.
Gated attention: q_proj gives [Hq, 2*hd] per head, the first hd the query and the last hd an
output gate; q/k RMSNorm per head; RoPE (theta 1e7) on the first rotary_dim = hd *
partial_rotary_factor dims only (text-only MRoPE has three equal position streams, which is plain
RoPE); softmax(q k^T hd^-0.5) v, times sigmoid(gate), then o_proj.

Parameter paths are the checkpoint's without the `model.` prefix (`layers.0.linear_attn.A_log`,
`layers.3.self_attn.q_proj.weight`, `embed_tokens.weight`, `norm.weight`, `lm_head.weight`); the
multimodal hub checkpoints' `model.language_model.*` map to the same, `model.visual.*` and
`mtp.*` are skipped (loader.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from ..core.batch import Batch
from ..memory.declarations import MHA, Full, LayerDecl, Part, State, StateGeometry, gated_deltanet_state_tensors
from ..memory.plan import Plan
from ..pallas_kernels.kv_write import write_kv
from ..pallas_kernels.paged_decode import paged_decode_attention
from ..pallas_kernels.paged_prefill import paged_prefill_attention
from .attention import _NEG, Attention, KVSlot, kv_slot
from .config import FULL, MAMBA, ModelConfig, RopeConfig, _dtype, _tuple_or_int
from .gdn_mixer import GatedDeltaNet
from .gemma3 import Gemma3ForCausalLM
from .layers import MLP, Linear, RMSNorm, apply_rope, rope_inv_freq
from .mamba2_mixer import state_slot

ARCHITECTURE = "Qwen3_5ForCausalLM"
# Decode tokens between prefix-cache checkpoints of the recurrent state (SGLang's default --mamba-track-interval).
CHECKPOINT_INTERVAL = 256
LINEAR = MAMBA  # transformers calls every recurrent layer "linear_attention"; here it is gated DeltaNet


@dataclasses.dataclass(frozen=True)
class Qwen3_5Config(ModelConfig):
    """ModelConfig plus the gated DeltaNet geometry and the partial rotary factor."""

    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 0.25

    def __post_init__(self):
        bad = sorted(set(self.layer_types) - {FULL, LINEAR})
        if bad:
            raise ValueError(f"Qwen3.5 layer types must be {FULL} or {LINEAR}, got {bad}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
                             f"linear_num_key_heads {self.linear_num_key_heads}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary dim {self.rotary_dim} (head_dim x partial_rotary_factor) must be even, "
                             f"positive and at most head_dim")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


_LINEAR_DEFAULTS = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}  # transformers' defaults


def qwen3_5_config(d: dict) -> Qwen3_5Config:
    """A `qwen3_5_text` config.json dict (the multimodal wrapper's text_config already unwrapped by
    config.from_hf_config) -> config.  MoE variants are refused."""
    archs = d.get("architectures") or []
    if "moe" in str(d.get("model_type", "")) or any("Moe" in a for a in archs) or d.get("num_experts"):
        raise NotImplementedError("Qwen3.5 MoE (qwen3_5_moe) is not supported: umem_jax serves the dense Qwen3.5 "
                                  "checkpoints (0.8B-27B)")
    if d.get("attention_bias"):
        raise NotImplementedError("Qwen3.5 with attention_bias=true is not supported")
    n = d.get("num_hidden_layers", 32)
    if d.get("layer_types") is not None:
        legacy = {"attention": FULL, "linear": LINEAR}
        types = tuple(legacy.get(t, t) for t in d["layer_types"])
    else:  # hub: every full_attention_interval-th layer is full attention
        every = d.get("full_attention_interval", 4)
        types = tuple(FULL if (i + 1) % every == 0 else LINEAR for i in range(n))
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={n}")
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "mrope"):  # text-only MRoPE is plain RoPE
        raise NotImplementedError(f"Qwen3.5 rope_type {kind!r} is not supported (default is)")
    theta = float(rope.get("rope_theta", d.get("rope_theta", 10_000_000.0)))
    partial = float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25)))
    heads = d.get("num_attention_heads", 16)
    return Qwen3_5Config(
        architecture=ARCHITECTURE, vocab_size=d.get("vocab_size", 248320), hidden_size=d.get("hidden_size", 4096),
        intermediate_size=d.get("intermediate_size", 12288), num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads", 4), head_dim=d.get("head_dim") or 256, layer_types=types,
        rope=((FULL, RopeConfig(theta)),), rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        hidden_activation=d.get("hidden_act", "silu"), tie_word_embeddings=d.get("tie_word_embeddings", False),
        dtype=_dtype(d), bos_token_id=d.get("bos_token_id"), eos_token_id=_tuple_or_int(d.get("eos_token_id")),
        pad_token_id=d.get("pad_token_id"), max_position_embeddings=d.get("max_position_embeddings", 32768),
        partial_rotary_factor=partial,
        **{k: d.get(k, default) for k, default in _LINEAR_DEFAULTS.items()},
    )


def qwen3_5_4b_like(dtype: str = "bfloat16") -> Qwen3_5Config:
    """A Qwen3.5-4B-sized text decoder: 32 layers, 3 gated DeltaNet (16 key / 32 value heads x 128)
    : 1 gated attention (16 q / 4 kv heads x 256, partial RoPE 0.25), hidden 2560, SwiGLU 9216,
    vocab 248320, tied; about 4.2B parameters.  The memory geometry is presets.qwen35_4b_like's;
    hidden/intermediate sizes are this family's usual 4B figures, not read from a released
    config.json (none was to hand).  For benchmarks with random weights."""
    return qwen3_5_config({
        "vocab_size": 248320, "hidden_size": 2560, "intermediate_size": 9216, "num_hidden_layers": 32,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "full_attention_interval": 4,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        "max_position_embeddings": 262144, "dtype": dtype})


# ------------------------------------------------------------------------------- attention


class GatedAttention(Attention):
    """Qwen3.5 full attention: the shared Attention's K/V path, plus the per-head output gate and
    partial RoPE.  The gate is computed with the query (one q_proj), so this class owns its two
    forwards; the arena writes and kernels are the same calls as Attention's."""

    def __init__(self, cfg: Qwen3_5Config, layer: int, *, rngs: nnx.Rngs):
        super().__init__(cfg, layer, qk_norm=True, rngs=rngs)
        # [Hq, 2*hd] per head: query then gate, interleaved per head (not [all q | all gate]).
        self.q_proj = Linear(cfg.hidden_size, 2 * cfg.num_heads * cfg.head_dim, dtype=jnp.dtype(cfg.dtype), rngs=rngs)
        self.rotary_dim = cfg.rotary_dim

    def _rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        r = self.rotary_dim
        rotated = apply_rope(x[..., :r], positions, rope_inv_freq(self.rope, r))
        return jnp.concatenate([rotated, x[..., r:]], axis=-1)

    def project_gated(self, x: jax.Array, positions: jax.Array):
        """x [B, T, d] -> q [B, T, Hq, D], gate [B, T, Hq*D], k and v [B, T, Hkv, D]."""
        b, t, _ = x.shape
        hq, hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        qg, k, v = self.project_qkv(x)
        qg = qg.reshape(b, t, hq, 2 * hd)
        q, gate = self.q_norm(qg[..., :hd]), qg[..., hd:].reshape(b, t, hq * hd)
        k = self.k_norm(k.reshape(b, t, hkv, hd))
        v = v.reshape(b, t, hkv, hd)
        return self._rope(q, positions), gate, self._rope(k, positions), v

    def project(self, x: jax.Array, positions: jax.Array):
        q, _, k, v = self.project_gated(x, positions)
        return q, k, v

    def _gated_out(self, o: jax.Array, gate: jax.Array, dtype) -> jax.Array:
        b, t = gate.shape[:2]
        o = o.reshape(b, t, self.num_heads * self.head_dim).astype(dtype)
        return self.o_proj(o * jax.nn.sigmoid(gate))

    def dense(self, x: jax.Array, positions: jax.Array, valid: jax.Array) -> jax.Array:
        """Cache-free causal attention among the tokens of x: [B, T, d] -> [B, T, d]."""
        b, t, _ = x.shape
        q, gate, k, v = self.project_gated(x, positions)
        g = self.num_heads // self.num_kv_heads
        q = q.reshape(b, t, self.num_kv_heads, g, self.head_dim)
        s = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32) * self.scale
        mask = (positions[:, None, :] <= positions[:, :, None]) & valid[:, None, :]
        p = jax.nn.softmax(jnp.where(mask[:, None, None], s, _NEG), axis=-1)
        o = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v)
        return self._gated_out(o, gate, x.dtype)

    def __call__(self, x: jax.Array, arena: jax.Array, batch: Batch, slot: KVSlot):
        """Serving path: write this step's K/V first, then attend over the new arena."""
        b, t, _ = x.shape
        q, gate, k, v = self.project_gated(x, batch.positions())
        pages, slots = batch.write_targets(slot.pool, slot.view.page_size)
        arena = write_kv(arena, k.reshape(b * t, self.num_kv_heads, self.head_dim),
                         v.reshape(b * t, self.num_kv_heads, self.head_dim), pages, slots, view=slot.view,
                         **slot.kernel_kw)
        table = batch.page_tables[slot.pool]
        kw = dict(view=slot.view, scale=self.scale, **slot.kernel_kw)
        if t == 1:
            o = paged_decode_attention(q[:, 0], arena, table, batch.kv_lens, **kw)[:, None]
        else:
            o = paged_prefill_attention(q, arena, table, batch.q_lens, batch.kv_lens, **kw)
        return self._gated_out(o, gate, x.dtype), arena


# ------------------------------------------------------------------------------- layers


class Qwen3_5DecoderLayer(nnx.Module):
    """h + mixer(input_norm(h)), then h + MLP(post_attention_norm(h))."""

    def __init__(self, cfg: Qwen3_5Config, layer: int, *, rngs: nnx.Rngs):
        dt, d, eps = jnp.dtype(cfg.dtype), cfg.hidden_size, cfg.rms_norm_eps
        self.kind = cfg.layer_types[layer]
        self.input_layernorm = RMSNorm(d, eps=eps, dtype=dt)
        if self.kind == FULL:
            self.self_attn = GatedAttention(cfg, layer, rngs=rngs)
        else:
            self.linear_attn = GatedDeltaNet(
                d, k_heads=cfg.linear_num_key_heads, v_heads=cfg.linear_num_value_heads,
                k_dim=cfg.linear_key_head_dim, v_dim=cfg.linear_value_head_dim,
                conv_kernel=cfg.linear_conv_kernel_dim, eps=eps, dtype=dt, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(d, eps=eps, dtype=dt)
        self.mlp = MLP(d, cfg.intermediate_size, cfg.hidden_activation, dtype=dt, rngs=rngs)

    @property
    def mixer(self) -> nnx.Module:
        return self.self_attn if self.kind == FULL else self.linear_attn

    def _ffn(self, h: jax.Array) -> jax.Array:
        return h + self.mlp(self.post_attention_layernorm(h))

    def dense(self, h, positions, valid):
        return self._ffn(h + self.mixer.dense(self.input_layernorm(h), positions, valid))

    def __call__(self, h, arena, batch, slot):
        a, arena = self.mixer(self.input_layernorm(h), arena, batch, slot)
        return self._ffn(h + a), arena


class Qwen3_5ForCausalLM(Gemma3ForCausalLM):
    """The Gemma 3 shell (same names: embed_tokens, layers, norm, lm_head; same (1 + w) final norm)
    over Qwen3.5 layers, without Gemma's sqrt(d) embedding scale."""

    def make_layer(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs) -> nnx.Module:
        return Qwen3_5DecoderLayer(cfg, layer, rngs=rngs)

    def embed(self, ids: jax.Array) -> jax.Array:
        return self.embed_tokens(ids)

    def arena_slot(self, plan: Plan, layer: int, **kernel_kw):
        if self.config.layer_types[layer] == FULL:
            return kv_slot(plan, layer, **kernel_kw)
        return state_slot(plan, layer, **kernel_kw)

    @staticmethod
    def decls(cfg: Qwen3_5Config, kv_dtype: str = "bfloat16") -> list[LayerDecl]:
        """Gated DeltaNet layers: State (conv window in kv_dtype, fp32 recurrent); attention: Full K/V."""
        kv = MHA(cfg.num_kv_heads, cfg.head_dim, dtype=kv_dtype)
        st = StateGeometry(gated_deltanet_state_tensors(
            cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
            cfg.linear_conv_kernel_dim, conv_dtype=kv_dtype))
        return [LayerDecl(i, (Part(kv, Full()),)) if t == FULL else LayerDecl(i, (Part(st, State(CHECKPOINT_INTERVAL)),))
                for i, t in enumerate(cfg.layer_types)]


__all__ = ["ARCHITECTURE", "GatedAttention", "Qwen3_5Config", "Qwen3_5ForCausalLM", "qwen3_5_4b_like",
           "qwen3_5_config"]
