"""Qwen3.5 text decoder (`qwen3_5_text`): gated DeltaNet and gated full attention, 3 : 1.

    h = E[ids]
    per layer:  h = h + mixer(RMSNorm(h))      linear_attention: gated DeltaNet (gdn_mixer.py)
                                               full_attention:   gated attention (below)
                h = h + ffn(RMSNorm(h))        SwiGLU MLP, or with `moe` set a sparse MoE block
                                               (moe.py; Qwen3.5-MoE, Qwen3-Next: qwen3_5_moe.py,
                                               qwen3_next.py) on the layers `is_sparse` names
    logits = RMSNorm(h) W_lm^T

Every RMSNorm here (final and q/k norms too) is zero-centred, x_hat * (1 + w), like Gemma's.
Gated attention: q_proj gives [Hq, 2*hd] per head, the first hd the query and the last hd an
output gate; q/k RMSNorm per head; RoPE (theta 1e7) on the first rotary_dim = hd *
partial_rotary_factor dims only (text-only MRoPE has three equal position streams, which is plain
RoPE); softmax(q k^T hd^-0.5) v, times sigmoid(gate), then o_proj.

Parameter paths are the checkpoint's without the `model.` prefix (`layers.0.linear_attn.A_log`,
`layers.3.self_attn.q_proj.weight`, `embed_tokens.weight`, `norm.weight`, `lm_head.weight`); the
multimodal hub checkpoints' `model.language_model.*` map to the same, `model.visual.*` is
skipped, and `mtp.*` (config `mtp_num_hidden_layers`: the multi-token-prediction head, one gated
full-attention decoder layer) is read only for speculative method "mtp" (models/mtp.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from ..core.batch import Batch
from ..memory.declarations import StateTensor, gated_deltanet_state_tensors
from .attention import Attention
from .causal_lm import CausalLM, ResidualLayer
from .config import FULL, RECURRENT, ModelConfig, RopeConfig, int_or_tuple, weight_dtype
from .gdn_mixer import GatedDeltaNet
from .layers import MLP, Linear, RMSNorm
from .moe import MoE, MoEConfig

ARCHITECTURE = "Qwen3_5ForCausalLM"
# Decode tokens between prefix-cache checkpoints of the recurrent state (SGLang's default --mamba-track-interval).
CHECKPOINT_INTERVAL = 256


@dataclasses.dataclass(frozen=True)
class Qwen3_5Config(ModelConfig):
    """ModelConfig plus the gated DeltaNet geometry, the partial rotary factor and, for the MoE
    variants, which layers are sparse and their MoE block."""

    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 0.25
    moe: MoEConfig | None = None  # None: every layer's ffn is the dense MLP (intermediate_size)
    mlp_only_layers: tuple[int, ...] = ()  # with moe: layers that keep the dense MLP (Qwen3-Next)
    decoder_sparse_step: int = 1  # with moe: layer i is sparse when (i + 1) % step == 0 (Qwen3-Next)

    def __post_init__(self):
        bad = sorted(set(self.layer_types) - {FULL, RECURRENT})
        if bad:
            raise ValueError(f"Qwen3.5 layer types must be {FULL} or {RECURRENT}, got {bad}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
                             f"linear_num_key_heads {self.linear_num_key_heads}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary dim {self.rotary_dim} (head_dim x partial_rotary_factor) must be even, "
                             f"positive and at most head_dim")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        dense = [i for i in range(self.num_layers) if not self.is_sparse(i)]
        if dense and self.intermediate_size <= 0:
            raise ValueError(f"layers {dense[:8]} have a dense MLP but intermediate_size={self.intermediate_size}")

    def is_sparse(self, layer: int) -> bool:
        """Layer `layer`'s ffn is the MoE block (transformers' Qwen3NextDecoderLayer rule)."""
        return (self.moe is not None and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


_LINEAR_DEFAULTS = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}  # transformers' defaults


# transformers' Qwen3_5TextConfig defaults (rope theta: the Qwen3.5 checkpoints' 1e7).
_DENSE_DEFAULTS = {"vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
                   "num_key_value_heads": 4, "rope_theta": 10_000_000.0}


def qwen3_5_fields(d: dict, defaults: dict) -> dict:
    """The config.json fields every Qwen3.5-style decoder (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) shares
    -> Qwen3_5Config keyword arguments (all but `architecture` and the MoE ones).  `defaults`:
    the family's transformers defaults for the keys of _DENSE_DEFAULTS."""
    if d.get("attention_bias"):
        raise NotImplementedError("Qwen3.5 with attention_bias=true is not supported")
    n = d.get("num_hidden_layers", defaults["num_hidden_layers"])
    if d.get("layer_types") is not None:
        legacy = {"attention": FULL, "linear": RECURRENT}
        types = tuple(legacy.get(t, t) for t in d["layer_types"])
    else:  # hub: every full_attention_interval-th layer is full attention
        every = d.get("full_attention_interval", 4)
        types = tuple(FULL if (i + 1) % every == 0 else RECURRENT for i in range(n))
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={n}")
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "mrope"):  # text-only MRoPE is plain RoPE
        raise NotImplementedError(f"Qwen3.5 rope_type {kind!r} is not supported (default is)")
    theta = float(rope.get("rope_theta", d.get("rope_theta", defaults["rope_theta"])))
    partial = float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25)))
    get = lambda key: d.get(key, defaults[key])  # noqa: E731
    mtp = int(d.get("mtp_num_hidden_layers") or d.get("num_nextn_predict_layers") or 0)  # Qwen3-Next: either name
    return dict(
        vocab_size=get("vocab_size"), hidden_size=get("hidden_size"), intermediate_size=get("intermediate_size"),
        num_heads=d.get("num_attention_heads", 16), num_kv_heads=get("num_key_value_heads"),
        head_dim=d.get("head_dim") or 256, layer_types=types, rope=((FULL, RopeConfig(theta)),),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6), hidden_activation=d.get("hidden_act", "silu"),
        tie_word_embeddings=d.get("tie_word_embeddings", False), dtype=weight_dtype(d),
        bos_token_id=d.get("bos_token_id"), eos_token_id=int_or_tuple(d.get("eos_token_id")),
        pad_token_id=d.get("pad_token_id"), max_position_embeddings=d.get("max_position_embeddings", 32768),
        partial_rotary_factor=partial, **{k: d.get(k, default) for k, default in _LINEAR_DEFAULTS.items()},
        mtp_num_layers=mtp, mtp_layer_types=(FULL,) if mtp else (),
    )


def qwen3_5_config(d: dict) -> Qwen3_5Config:
    """A dense `qwen3_5_text` config.json dict (the multimodal wrapper's text_config already
    unwrapped by registry.from_hf_config) -> config.  The MoE variants have parsers of their own
    (qwen3_5_moe.qwen3_5_moe_config, qwen3_next.qwen3_next_config), which the registry picks by name."""
    if d.get("num_experts"):
        raise ValueError(f"this Qwen3.5 config has num_experts={d['num_experts']}: it is a Qwen3.5-MoE config, "
                         "read by qwen3_5_moe.qwen3_5_moe_config (model_type qwen3_5_moe_text)")
    return Qwen3_5Config(architecture=ARCHITECTURE, **qwen3_5_fields(d, _DENSE_DEFAULTS))


def qwen3_5_4b_like(dtype: str = "bfloat16") -> Qwen3_5Config:
    """A Qwen3.5-4B-sized text decoder: 32 layers, 3 gated DeltaNet (16 key / 32 value heads x 128)
    : 1 gated attention (16 q / 4 kv heads x 256, partial RoPE 0.25), hidden 2560, SwiGLU 9216,
    vocab 248320, tied; about 4.2B parameters.  Hidden and intermediate sizes are this family's
    usual 4B figures, not a released config.json's.  For benchmarks with random weights
    (registry.build_random) and its memory preset."""
    return qwen3_5_config({
        "vocab_size": 248320, "hidden_size": 2560, "intermediate_size": 9216, "num_hidden_layers": 32,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "full_attention_interval": 4,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        "max_position_embeddings": 262144, "dtype": dtype})


# ------------------------------------------------------------------------------- attention


class GatedAttention(Attention):
    """Qwen3.5 full attention: the shared Attention with a per-head output gate and partial RoPE.
    q_proj gives each head its query and its gate, [Hq, 2*hd] interleaved per head (not
    [all q | all gate]), so `project` splits them; Attention.output applies the gate."""

    def __init__(self, cfg: Qwen3_5Config, layer: int, *, rngs: nnx.Rngs):
        super().__init__(cfg, layer, qk_norm=True, rngs=rngs)
        self.q_proj = Linear(cfg.hidden_size, 2 * cfg.num_heads * cfg.head_dim, dtype=jnp.dtype(cfg.dtype), rngs=rngs)
        self.rotary_dim = cfg.rotary_dim

    def project(self, x: jax.Array, positions: jax.Array):
        """x [B, T, d] -> q [B, T, Hq, D], k and v [B, T, Hkv, D], gate [B, T, Hq*D]."""
        b, t, _ = x.shape
        hq, hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        qg, k, v = self.project_qkv(x)
        qg = qg.reshape(b, t, hq, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(b, t, hq * hd)
        q, k = self.position(q, k.reshape(b, t, hkv, hd), positions)
        return q, k, v.reshape(b, t, hkv, hd), gate


# ------------------------------------------------------------------------------- layers


class Qwen3_5DecoderLayer(ResidualLayer):
    """h + mixer(input_norm(h)), then h + ffn(post_attention_norm(h)), ffn the MLP or the MoE block
    (whose padding tokens take no expert rows: the forwards hand it the valid mask)."""

    def __init__(self, cfg: Qwen3_5Config, layer: int, *, rngs: nnx.Rngs):
        dtype, d, eps = jnp.dtype(cfg.dtype), cfg.hidden_size, cfg.rms_norm_eps
        self.kind = cfg.layer_types[layer]
        self.input_layernorm = RMSNorm(d, eps=eps, dtype=dtype)
        if self.kind == FULL:
            self.self_attn = GatedAttention(cfg, layer, rngs=rngs)
        else:
            self.linear_attn = GatedDeltaNet(
                d, k_heads=cfg.linear_num_key_heads, v_heads=cfg.linear_num_value_heads,
                k_dim=cfg.linear_key_head_dim, v_dim=cfg.linear_value_head_dim,
                conv_kernel=cfg.linear_conv_kernel_dim, eps=eps, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(d, eps=eps, dtype=dtype)
        self.sparse = cfg.is_sparse(layer)
        if self.sparse:
            self.mlp = MoE(d, cfg.moe, dtype=dtype, rngs=rngs)
        else:
            self.mlp = MLP(d, cfg.intermediate_size, cfg.hidden_activation, dtype=dtype, rngs=rngs)

    @property
    def mixer(self) -> nnx.Module:
        return self.self_attn if self.kind == FULL else self.linear_attn

    def ffn(self, h: jax.Array, a: jax.Array, valid: jax.Array | None = None) -> jax.Array:
        h, x = self.post_attention_layernorm.add(h, a)
        return h + (self.mlp(x, valid) if self.sparse else self.mlp(x))

    def dense(self, h: jax.Array, positions: jax.Array, valid: jax.Array) -> jax.Array:
        return self.ffn(h, self.mixer.dense(self.input_layernorm(h), positions, valid), valid)

    def __call__(self, h: jax.Array, arena: jax.Array, batch: Batch, slot):
        a, arena = self.mixer(self.input_layernorm(h), arena, batch, slot)
        return self.ffn(h, a, batch.valid()), arena


class Qwen3_5ForCausalLM(CausalLM):
    """Qwen3.5 layers in the shared decoder (embed_tokens, layers, norm, lm_head; zero-centred
    (1 + w) final norm, unscaled embeddings)."""

    checkpoint_interval = CHECKPOINT_INTERVAL

    def make_layer(self, cfg: Qwen3_5Config, layer: int, rngs: nnx.Rngs) -> nnx.Module:
        return Qwen3_5DecoderLayer(cfg, layer, rngs=rngs)

    @staticmethod
    def state_tensors(cfg: Qwen3_5Config, conv_dtype: str) -> tuple[StateTensor, ...]:
        """Gated DeltaNet: the conv window over q|k|v (conv_dtype) and the fp32 recurrent matrix."""
        return gated_deltanet_state_tensors(cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                                            cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                                            cfg.linear_conv_kernel_dim, conv_dtype=conv_dtype)


__all__ = ["ARCHITECTURE", "GatedAttention", "Qwen3_5Config", "Qwen3_5DecoderLayer", "Qwen3_5ForCausalLM",
           "qwen3_5_4b_like", "qwen3_5_config", "qwen3_5_fields"]
