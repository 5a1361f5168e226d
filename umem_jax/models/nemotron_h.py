"""NemotronH (`nemotron_h`, dense): Mamba2, NoPE attention and relu^2 MLP blocks by pattern.

    h = E[ids]
    per block i:  h = h + mixer_i(RMSNorm(h))      mixer by layers_block_type[i] / hybrid_override_pattern:
                    "M" linear_attention  Mamba2 (mamba2_mixer.py)
                    "*" full_attention    GQA, no positional encoding, scale head_dim^-0.5
                    "-" mlp               down(relu(up x)^2), no gate
                    "E" moe               refused: dense checkpoints only
    logits = RMSNorm_f(h) W_lm^T

RMSNorm here is plain (w * x_hat, w initialised to ones).  Memory: Mamba2 blocks keep a state slot
(conv window + fp32 SSM state), attention blocks full-attention K/V, MLP blocks nothing.

Parameter paths are the checkpoint's with `backbone.` dropped (`layers.0.mixer.in_proj.weight`,
`embeddings.weight`, `norm_f.weight`, `lm_head.weight`); transformers' save_pretrained writes the
`backbone.*` hub names, its in-memory model says `model.*`: the loader strips either.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from ..memory.declarations import MHA, Full, LayerDecl, Part, State, StateGeometry, mamba2_state_tensors
from ..memory.plan import Plan
from .attention import Attention, kv_slot
from .config import FULL, MAMBA, MambaConfig, ModelConfig, _dtype, _tuple_or_int
from .gemma3 import Embedding, Gemma3ForCausalLM
from .layers import Linear, RMSNorm, activation
from .mamba2_mixer import Mamba2Mixer, state_slot

ARCHITECTURE = "NemotronHForCausalLM"
# Decode tokens between prefix-cache checkpoints of the recurrent state (SGLang's default --mamba-track-interval).
CHECKPOINT_INTERVAL = 256
MLP = "mlp"
MOE = "moe"
_PATTERN = {"M": MAMBA, "*": FULL, "-": MLP, "E": MOE}
_LEGACY = {"mamba": MAMBA, "attention": FULL, "linear_attention": MAMBA, "full_attention": FULL, "mlp": MLP,
           "moe": MOE}


@dataclasses.dataclass(frozen=True)
class NemotronHConfig(ModelConfig):
    """ModelConfig plus what NemotronH's Mamba2 mixer needs; layer types also take "mlp"."""

    time_step_min: float = 1e-3  # prefill-only dt clamp (transformers' NemotronH quirk)
    use_conv_bias: bool = True

    def __post_init__(self):
        bad = sorted(set(self.layer_types) - {FULL, MAMBA, MLP})
        if bad:
            raise ValueError(f"NemotronH layer types must be {FULL}, {MAMBA} or {MLP}, got {bad}")
        if MAMBA in self.layer_types and self.mamba is None:
            raise ValueError("Mamba2 (linear_attention) blocks need a MambaConfig")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    def rope_for(self, layer_type: str):
        return None  # NoPE: NemotronH attention has no positional encoding


def _layer_types(d: dict) -> tuple[str, ...]:
    if d.get("layers_block_type") is not None or d.get("layer_types") is not None:
        raw = d.get("layers_block_type") or d.get("layer_types")
        unknown = sorted({t for t in raw if t not in _LEGACY})
        if unknown:
            raise ValueError(f"NemotronH: unknown block types {unknown}")
        types = tuple(_LEGACY[t] for t in raw)
    elif d.get("hybrid_override_pattern"):
        pattern = d["hybrid_override_pattern"]
        unknown = sorted(set(pattern) - set(_PATTERN))
        if unknown:
            raise ValueError(f"NemotronH: hybrid_override_pattern has unknown characters {unknown} (known: M * - E)")
        types = tuple(_PATTERN[c] for c in pattern)
    else:
        raise ValueError("NemotronH config.json needs layers_block_type or hybrid_override_pattern")
    if MOE in types:
        moe = [i for i, t in enumerate(types) if t == MOE]
        raise NotImplementedError(
            f"NemotronH MoE blocks ('E' at layers {moe[:8]}) are not supported: umem_jax serves the dense "
            "NemotronH checkpoints (Nemotron-H 4B/8B, Nemotron-Nano-9B-v2); Nemotron 3 (latent MoE) is not")
    return types


def _get(d: dict, *names, default=None):
    """First present (non-None) of several spellings: 5.x names first, then hub-era `mamba_*` ones."""
    for n in names:
        if d.get(n) is not None:
            return d[n]
    return default


def nemotron_h_config(d: dict) -> NemotronHConfig:
    """config.json (5.x `layers_block_type`, or hub `hybrid_override_pattern` / `mamba_*`) -> config."""
    for key in ("use_bias", "mamba_proj_bias", "attention_bias", "mlp_bias"):
        if d.get(key):
            raise NotImplementedError(f"NemotronH with {key}=true is not supported (no released checkpoint has it)")
    if _get(d, "mamba_hidden_act", default="silu") != "silu":
        raise NotImplementedError(f"NemotronH mamba_hidden_act {d['mamba_hidden_act']!r} (silu is supported)")
    hidden, heads = d.get("hidden_size", 4096), d.get("num_attention_heads", 32)
    mamba = MambaConfig(
        num_heads=d.get("mamba_num_heads", 128), head_dim=d.get("mamba_head_dim", 64),
        state_size=d.get("ssm_state_size", 128), n_groups=_get(d, "n_groups", "mamba_n_groups", default=8),
        conv_kernel=_get(d, "conv_kernel", "mamba_d_conv", default=4),
        chunk_size=_get(d, "chunk_size", "mamba_chunk_size", default=128))
    return NemotronHConfig(
        architecture=ARCHITECTURE, vocab_size=d.get("vocab_size", 131072), hidden_size=hidden,
        intermediate_size=d.get("intermediate_size", 21504), num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=_get(d, "head_dim", "attention_head_dim", default=hidden // heads),
        layer_types=_layer_types(d), rms_norm_eps=d.get("layer_norm_epsilon", 1e-5),
        hidden_activation=d.get("mlp_hidden_act", "relu2"), tie_word_embeddings=d.get("tie_word_embeddings", False),
        dtype=_dtype(d), bos_token_id=d.get("bos_token_id", 1), eos_token_id=_tuple_or_int(d.get("eos_token_id", 2)),
        pad_token_id=d.get("pad_token_id", 0), max_position_embeddings=d.get("max_position_embeddings", 4096),
        mamba=mamba, time_step_min=float(_get(d, "time_step_min", "mamba_dt_min", default=1e-3)),
        use_conv_bias=bool(_get(d, "use_conv_bias", "mamba_conv_bias", default=True)),
    )


def nemotron_h_8b_like(dtype: str = "bfloat16") -> NemotronHConfig:
    """Nemotron-H-8B-Base-8K's shape (its published config.json, as quoted in
    reference/hybrid_models.md): 52 blocks "M-M-M-M*-...", 24 Mamba2 (128 heads x 64, state 128,
    8 groups), 4 attention (32 q / 8 kv heads x 128), 24 MLP (21504), vocab 131072, untied.
    Its memory is presets.nemotronh_8b_like's.  For benchmarks with random weights."""
    pattern = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
    return nemotron_h_config({
        "hybrid_override_pattern": pattern, "vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 21504,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "mamba_num_heads": 128,
        "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4, "chunk_size": 128,
        "layer_norm_epsilon": 1e-5, "max_position_embeddings": 8192, "dtype": dtype})


# ------------------------------------------------------------------------------- blocks


class NoPEAttention(Attention):
    """The shared Attention with no q/k norm and no RoPE (NemotronH's attention blocks)."""

    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        super().__init__(cfg, layer, qk_norm=False, rngs=rngs)

    def project(self, x: jax.Array, positions: jax.Array):
        """x [B, T, d] -> q [B, T, Hq, D], k and v [B, T, Hkv, D]; positions unused."""
        b, t, _ = x.shape
        q, k, v = self.project_qkv(x)
        return (q.reshape(b, t, self.num_heads, self.head_dim), k.reshape(b, t, self.num_kv_heads, self.head_dim),
                v.reshape(b, t, self.num_kv_heads, self.head_dim))


class SquaredReLUMLP(nnx.Module):
    """down(act(up x)), no gate; NemotronH's act is relu^2."""

    def __init__(self, hidden: int, intermediate: int, act: str, *, dtype, rngs: nnx.Rngs):
        self.up_proj = Linear(hidden, intermediate, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(intermediate, hidden, dtype=dtype, rngs=rngs)
        self.act = act

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(activation(self.act)(self.up_proj(x)))


class NemotronHBlock(nnx.Module):
    """h + mixer(RMSNorm(h)); the mixer is Mamba2, NoPE attention or the MLP."""

    def __init__(self, cfg: NemotronHConfig, layer: int, *, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        self.kind = cfg.layer_types[layer]
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, offset=0.0, dtype=dt)
        if self.kind == MAMBA:
            self.mixer = Mamba2Mixer(cfg.hidden_size, cfg.mamba, time_step_min=cfg.time_step_min,
                                     eps=cfg.rms_norm_eps, conv_bias=cfg.use_conv_bias, dtype=dt, rngs=rngs)
        elif self.kind == FULL:
            self.mixer = NoPEAttention(cfg, layer, rngs=rngs)
        else:
            self.mixer = SquaredReLUMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_activation, dtype=dt,
                                        rngs=rngs)

    def dense(self, h, positions, valid):
        a = self.norm(h)
        return h + (self.mixer(a) if self.kind == MLP else self.mixer.dense(a, positions, valid))

    def __call__(self, h, arena, batch, slot):
        a = self.norm(h)
        if self.kind == MLP:
            return h + self.mixer(a), arena
        out, arena = self.mixer(a, arena, batch, slot)
        return h + out, arena


class NemotronHForCausalLM(Gemma3ForCausalLM):
    """The Gemma 3 shell's forwards (dense and arena) over NemotronH blocks; its own names."""

    def __init__(self, cfg: NemotronHConfig, *, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        self.config = cfg
        self.embeddings = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dt, rngs=rngs)
        self.layers = nnx.List([NemotronHBlock(cfg, i, rngs=rngs) for i in range(cfg.num_layers)])
        self.norm_f = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, offset=0.0, dtype=dt)
        self.lm_head = None if cfg.tie_word_embeddings else Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dt,
                                                                      rngs=rngs)

    def embed(self, ids: jax.Array) -> jax.Array:
        return self.embeddings(ids)  # no scale, unlike Gemma

    def logits(self, h: jax.Array) -> jax.Array:
        """h [..., d] -> fp32 logits [..., V]."""
        head = self.lm_head if self.lm_head is not None else self.embeddings
        return head.attend(self.norm_f(h)).astype(jnp.float32)

    def arena_slot(self, plan: Plan, layer: int, **kernel_kw):
        kind = self.config.layer_types[layer]
        if kind == MAMBA:
            return state_slot(plan, layer, **kernel_kw)
        if kind == FULL:
            return kv_slot(plan, layer, **kernel_kw)
        return None  # MLP blocks keep nothing

    @staticmethod
    def decls(cfg: NemotronHConfig, kv_dtype: str = "bfloat16") -> list[LayerDecl]:
        """Mamba2 blocks: State (conv window in kv_dtype, fp32 SSM); attention: Full K/V; MLP: none."""
        m = cfg.mamba
        kv = MHA(cfg.num_kv_heads, cfg.head_dim, dtype=kv_dtype)
        out = []
        for i, t in enumerate(cfg.layer_types):
            if t == MAMBA:
                st = mamba2_state_tensors(m.num_heads, m.head_dim, m.state_size, m.n_groups, m.conv_kernel,
                                          conv_dtype=kv_dtype)
                out.append(LayerDecl(i, (Part(StateGeometry(st), State(CHECKPOINT_INTERVAL)),)))
            elif t == FULL:
                out.append(LayerDecl(i, (Part(kv, Full()),)))
        return out


__all__ = ["ARCHITECTURE", "NemotronHConfig", "NemotronHForCausalLM", "nemotron_h_8b_like", "nemotron_h_config"]
