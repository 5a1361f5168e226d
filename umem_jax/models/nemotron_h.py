"""NemotronH (`nemotron_h`): Mamba2, NoPE attention, relu^2 MLP and MoE blocks by pattern.

    h = E[ids]
    per block i:  h = h + mixer_i(RMSNorm(h))      mixer by layers_block_type[i] / hybrid_override_pattern:
                    "M" linear_attention  Mamba2 (mamba2_mixer.py)
                    "*" full_attention    GQA, no positional encoding, scale head_dim^-0.5
                    "-" mlp               down(relu(up x)^2), no gate
                    "E" moe               routed relu^2 experts + one shared relu^2 expert (moe.py):
                                          sigmoid router, top-k of (s + e_score_correction_bias),
                                          optionally by groups; weights s, renormalised, times
                                          routed_scaling_factor  (Nemotron 3 Nano 30B-A3B)
    logits = RMSNorm_f(h) W_lm^T

RMSNorm here is plain (w * x_hat, w initialised to ones).  Memory: Mamba2 blocks keep a state slot
(conv window + fp32 SSM state), attention blocks full-attention K/V, MLP and MoE blocks nothing.

Parameter paths are the checkpoint's with `backbone.` dropped (`layers.0.mixer.in_proj.weight`,
`embeddings.weight`, `norm_f.weight`, `lm_head.weight`); transformers' save_pretrained writes the
`backbone.*` hub names, its in-memory model says `model.*`: the loader strips either.  MoE blocks
are the exception (`checkpoint_to_params`): the hub keeps one tensor per expert,
`mixer.experts.{j}.up_proj.weight` [I, d] and `.down_proj.weight` [d, I] (transformers' in-memory
model fuses them to `mixer.experts.up_proj` [E, I, d] / `down_proj` [E, d, I]); ours are stacked
in (in, out) layout, `mixer.experts.up_proj` [E, d, I] / `down_proj` [E, I, d], and the shared
expert is `mixer.shared_expert.*` (hub: `mixer.shared_experts.*`).  Latent MoE (moe_latent_size,
Nemotron 3 Super) is refused by name.  The MTP layer (config num_nextn_predict_layers,
mtp_layers_block_type, default attention then MoE; tensors `mtp.layers.*`) is skipped here and
read only for speculative method "mtp" (models/mtp.py).
"""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
from flax import nnx

from ..memory.declarations import StateTensor
from .attention import Attention
from .causal_lm import CausalLM
from .config import FULL, RECURRENT, MambaConfig, ModelConfig, int_or_tuple, weight_dtype
from .layers import RMSNorm, UngatedMLP
from .mamba2_mixer import Mamba2Mixer
from .moe import MoE, MoEConfig

ARCHITECTURE = "NemotronHForCausalLM"
# Decode tokens between prefix-cache checkpoints of the recurrent state (SGLang's default --mamba-track-interval).
CHECKPOINT_INTERVAL = 256
MLP_BLOCK = "mlp"  # a layer type of its own: keeps no memory
MOE_BLOCK = "moe"  # a layer type of its own too: keeps no memory
# hybrid_override_pattern characters, and the block type names of `layers_block_type` (5.x and hub).
_PATTERN = {"M": RECURRENT, "*": FULL, "-": MLP_BLOCK, "E": MOE_BLOCK}
_BLOCK_TYPES = {"mamba": RECURRENT, "attention": FULL, "linear_attention": RECURRENT, "full_attention": FULL,
                "mlp": MLP_BLOCK, "moe": MOE_BLOCK}


@dataclasses.dataclass(frozen=True)
class NemotronHConfig(ModelConfig):
    """ModelConfig plus what NemotronH's Mamba2 mixer and MoE blocks need; layer types also take
    "mlp" and "moe"."""

    time_step_min: float = 1e-3  # prefill-only dt clamp (transformers' NemotronH quirk)
    use_conv_bias: bool = True
    moe: MoEConfig | None = None  # the MoE blocks' shape and routing (every "moe" block alike)

    def __post_init__(self):
        bad = sorted(set(self.layer_types) - {FULL, RECURRENT, MLP_BLOCK, MOE_BLOCK})
        if bad:
            raise ValueError(f"NemotronH layer types must be {FULL}, {RECURRENT}, {MLP_BLOCK} or {MOE_BLOCK}, "
                             f"got {bad}")
        if RECURRENT in self.layer_types and self.mamba is None:
            raise ValueError("Mamba2 (linear_attention) blocks need a MambaConfig")
        if MOE_BLOCK in self.layer_types and self.moe is None:
            raise ValueError("NemotronH MoE blocks need a MoEConfig")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    def rope_for(self, layer_type: str):
        return None  # NoPE: NemotronH attention has no positional encoding


def _layer_types(d: dict) -> tuple[str, ...]:
    if d.get("layers_block_type") is not None or d.get("layer_types") is not None:
        raw = d.get("layers_block_type") or d.get("layer_types")
        unknown = sorted({t for t in raw if t not in _BLOCK_TYPES})
        if unknown:
            raise ValueError(f"NemotronH: unknown block types {unknown}")
        types = tuple(_BLOCK_TYPES[t] for t in raw)
    elif d.get("hybrid_override_pattern"):
        pattern = d["hybrid_override_pattern"]
        unknown = sorted(set(pattern) - set(_PATTERN))
        if unknown:
            raise ValueError(f"NemotronH: hybrid_override_pattern has unknown characters {unknown} (known: M * - E)")
        types = tuple(_PATTERN[c] for c in pattern)
    else:
        raise ValueError("NemotronH config.json needs layers_block_type or hybrid_override_pattern")
    return types


def _moe_config(d: dict) -> MoEConfig:
    """The MoE fields of config.json (transformers' NemotronHConfig defaults where absent)."""
    if d.get("moe_latent_size") is not None:
        raise NotImplementedError(
            f"NemotronH latent MoE (moe_latent_size={d['moe_latent_size']}: experts run in a latent space "
            "behind fc1/fc2_latent_proj, as in Nemotron 3 Super) is not supported; Nemotron 3 Nano's MoE "
            "(no latent projection) is")
    if d.get("n_shared_experts", 1) != 1:
        raise NotImplementedError(f"NemotronH n_shared_experts={d['n_shared_experts']}: transformers builds "
                                  "exactly one shared expert, so only 1 is supported")
    act = d.get("mlp_hidden_act", "relu2")
    return MoEConfig(
        num_experts=_first_present(d, "n_routed_experts", "num_local_experts", default=8),
        top_k=d.get("num_experts_per_tok", 2), intermediate_size=d.get("moe_intermediate_size", 7688),
        scoring="sigmoid", norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)), score_correction_bias=True,
        n_group=d.get("n_group", 1), topk_group=d.get("topk_group", 1), expert_kind="ungated", activation=act,
        shared_intermediate_size=d.get("moe_shared_expert_intermediate_size", 7688), shared_expert_kind="ungated")


def _first_present(d: dict, *names, default=None):
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
    if _first_present(d, "mamba_hidden_act", default="silu") != "silu":
        raise NotImplementedError(f"NemotronH mamba_hidden_act {d['mamba_hidden_act']!r} (silu is supported)")
    hidden, heads = d.get("hidden_size", 4096), d.get("num_attention_heads", 32)
    types = _layer_types(d)
    mtp_layers = int(d.get("num_nextn_predict_layers") or 0)
    mtp_types = _mtp_layer_types(d) if mtp_layers else ()
    mamba = MambaConfig(
        num_heads=d.get("mamba_num_heads", 128), head_dim=d.get("mamba_head_dim", 64),
        state_size=d.get("ssm_state_size", 128), n_groups=_first_present(d, "n_groups", "mamba_n_groups", default=8),
        conv_kernel=_first_present(d, "conv_kernel", "mamba_d_conv", default=4),
        chunk_size=_first_present(d, "chunk_size", "mamba_chunk_size", default=128))
    return NemotronHConfig(
        architecture=ARCHITECTURE, vocab_size=d.get("vocab_size", 131072), hidden_size=hidden,
        intermediate_size=d.get("intermediate_size", 21504), num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=_first_present(d, "head_dim", "attention_head_dim", default=hidden // heads),
        layer_types=types, rms_norm_eps=d.get("layer_norm_epsilon", 1e-5),
        # Never tied, whatever the config says: transformers' NemotronH ties no weights (its
        # `_tied_weights_keys` is empty), saves its own lm_head and computes with it.
        hidden_activation=d.get("mlp_hidden_act", "relu2"), tie_word_embeddings=False,
        dtype=weight_dtype(d), bos_token_id=d.get("bos_token_id", 1),
        eos_token_id=int_or_tuple(d.get("eos_token_id", 2)),
        pad_token_id=d.get("pad_token_id", 0), max_position_embeddings=d.get("max_position_embeddings", 4096),
        mamba=mamba, time_step_min=float(_first_present(d, "time_step_min", "mamba_dt_min", default=1e-3)),
        use_conv_bias=bool(_first_present(d, "use_conv_bias", "mamba_conv_bias", default=True)),
        moe=_moe_config(d) if MOE_BLOCK in types + mtp_types else None,
        mtp_num_layers=mtp_layers, mtp_layer_types=mtp_types,
    )


def _mtp_layer_types(d: dict) -> tuple[str, ...]:
    """The blocks of one MTP layer (models/mtp.py): `mtp_layers_block_type` (transformers' default
    ["attention", "moe"]) or the pattern string `mtp_hybrid_override_pattern` ("*E")."""
    if d.get("mtp_hybrid_override_pattern"):
        return _layer_types({"hybrid_override_pattern": d["mtp_hybrid_override_pattern"]})
    return _layer_types({"layers_block_type": d.get("mtp_layers_block_type") or ["attention", "moe"]})


def nemotron_h_8b_like(dtype: str = "bfloat16") -> NemotronHConfig:
    """Nemotron-H-8B-Base-8K's shape (its published config.json): 52 blocks "M-M-M-M*-...",
    24 Mamba2 (128 heads x 64, state 128, 8 groups), 4 attention (32 q / 8 kv heads x 128), 24 MLP
    (21504), vocab 131072, untied.  For benchmarks with random weights (registry.build_random)
    and its memory preset."""
    pattern = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
    return nemotron_h_config({
        "hybrid_override_pattern": pattern, "vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 21504,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "mamba_num_heads": 128,
        "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4, "chunk_size": 128,
        "layer_norm_epsilon": 1e-5, "max_position_embeddings": 8192, "dtype": dtype})


def nemotron_3_nano_30b_a3b_like(dtype: str = "bfloat16") -> NemotronHConfig:
    """NVIDIA Nemotron 3 Nano 30B-A3B's shape, every figure from its published config.json
    (nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16, as reproduced verbatim in public test code;
    transformers 5.23 names this checkpoint in NemotronHConfig's docstring, but its defaults are
    not these): 52 blocks "MEMEM*EMEMEM*...EMEMEMEME" = 23 Mamba2 (64 heads x 64, state 128,
    8 groups, conv 4, chunk 128), 23 MoE, 6 NoPE attention (32 q / 2 kv heads x 128), no MLP block;
    hidden 2688; MoE: 128 relu^2 experts of 1856, top-6, one shared expert of 3712, sigmoid routing
    with n_group = topk_group = 1, norm_topk_prob, routed_scaling_factor 2.5, no moe_latent_size;
    vocab 131072, untied, eps 1e-5, 262144 positions.  ~31.6B parameters (the published "30B").
    For benchmarks with random weights (registry.build_random) and its memory preset."""
    return nemotron_h_config({
        "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", "vocab_size": 131072,
        "hidden_size": 2688, "intermediate_size": 1856, "num_attention_heads": 32, "num_key_value_heads": 2,
        "head_dim": 128, "mamba_num_heads": 64, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8,
        "conv_kernel": 4, "chunk_size": 128, "n_routed_experts": 128, "num_experts_per_tok": 6,
        "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712, "n_shared_experts": 1,
        "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "mlp_hidden_act": "relu2", "layer_norm_epsilon": 1e-5, "max_position_embeddings": 262144,
        "tie_word_embeddings": False, "dtype": dtype})


# ------------------------------------------------------------------------------- blocks


class NemotronHBlock(nnx.Module):
    """h + mixer(RMSNorm(h)); the mixer is Mamba2, attention without RoPE or q/k norm, the MLP or
    the MoE block."""

    def __init__(self, cfg: NemotronHConfig, layer: int, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.kind = cfg.layer_types[layer]
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, offset=0.0, dtype=dtype)
        if self.kind == RECURRENT:
            self.mixer = Mamba2Mixer(cfg.hidden_size, cfg.mamba, time_step_min=cfg.time_step_min,
                                     eps=cfg.rms_norm_eps, conv_bias=cfg.use_conv_bias, dtype=dtype, rngs=rngs)
        elif self.kind == FULL:
            self.mixer = Attention(cfg, layer, qk_norm=False, rngs=rngs)  # the config gives it no RoPE
        elif self.kind == MOE_BLOCK:
            self.mixer = MoE(cfg.hidden_size, cfg.moe, dtype=dtype, rngs=rngs)
        else:
            self.mixer = UngatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_activation, dtype=dtype,
                                    rngs=rngs)

    def dense(self, h, positions, valid):
        a = self.norm(h)
        if self.kind == MLP_BLOCK:
            return h + self.mixer(a)
        if self.kind == MOE_BLOCK:
            return h + self.mixer(a, valid)  # padding tokens take no expert rows
        return h + self.mixer.dense(a, positions, valid)

    def __call__(self, h, arena, batch, slot):
        """h: [B, T, d] or the pending add (h, delta) the block before left -> ((h, delta), arena): the
        residual add is left to the next block's norm, which fuses it (RMSNorm.enter), or to settle()."""
        h, a = self.norm.enter(h)
        if self.kind == MLP_BLOCK:
            return (h, self.mixer(a)), arena
        if self.kind == MOE_BLOCK:
            return (h, self.mixer(a, batch.valid())), arena
        out, arena = self.mixer(a, arena, batch, slot)
        return (h, out), arena


class NemotronHForCausalLM(CausalLM):
    """NemotronH blocks in the shared decoder, under the checkpoint's own top-level names and with
    plain (x_hat * w) final norm."""

    embedding_name = "embeddings"
    final_norm_name = "norm_f"
    final_norm_offset = 0.0
    checkpoint_interval = CHECKPOINT_INTERVAL

    def make_layer(self, cfg: NemotronHConfig, layer: int, rngs: nnx.Rngs) -> nnx.Module:
        return NemotronHBlock(cfg, layer, rngs=rngs)

    @staticmethod
    def state_tensors(cfg: NemotronHConfig, conv_dtype: str) -> tuple[StateTensor, ...]:
        return Mamba2Mixer.state_tensors(cfg.mamba, conv_dtype)

    @classmethod
    def checkpoint_to_params(cls, cfg: NemotronHConfig, tensors: dict) -> dict:
        """The MoE blocks' hub tensors -> ours (module docstring); everything else by name."""
        out = {}
        for name, arr in tensors.items():
            m = _MOE_TENSOR.match(name)
            if m is None or cfg.layer_types[int(m["layer"]) % cfg.num_layers] != MOE_BLOCK:
                out[name] = arr  # (a layer index past the last: the loader calls it unexpected)
            elif m["rest"].startswith("shared_experts."):
                out[f"layers.{m['layer']}.mixer.shared_expert.{m['rest'].removeprefix('shared_experts.')}"] = arr
            elif m["rest"] in ("experts.up_proj", "experts.down_proj"):  # transformers' fused [E, out, in]
                out[name] = jnp.swapaxes(jnp.asarray(arr), 1, 2)
            else:
                out[name] = arr
        for layer in (i for i, t in enumerate(cfg.layer_types) if t == MOE_BLOCK):
            for proj in ("up_proj", "down_proj"):
                _stack_experts(out, f"layers.{layer}.mixer.experts", proj, cfg.moe.num_experts)
        return out


_MOE_TENSOR = re.compile(r"layers\.(?P<layer>\d+)\.mixer\.(?P<rest>.+)")


def _stack_experts(tensors: dict, prefix: str, proj: str, num_experts: int):
    """Replace `{prefix}.{j}.{proj}.weight` ([out, in] each) in place by `{prefix}.{proj}` [E, in, out]."""
    names = [f"{prefix}.{j}.{proj}.weight" for j in range(num_experts)]
    present = [n for n in names if n in tensors]
    if not present:
        return  # fused, or missing: the loader names what is missing
    if len(present) < num_experts:
        missing = [j for j, n in enumerate(names) if n not in tensors]
        raise KeyError(f"{prefix}: {proj} of experts {missing[:8]} missing (the checkpoint has {len(present)} "
                       f"of {num_experts})")
    tensors[f"{prefix}.{proj}"] = jnp.stack([jnp.asarray(tensors.pop(n)).T for n in names])


__all__ = ["ARCHITECTURE", "NemotronHConfig", "NemotronHForCausalLM", "nemotron_3_nano_30b_a3b_like",
           "nemotron_h_8b_like", "nemotron_h_config"]
