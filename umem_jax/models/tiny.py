"""A built-in tiny hybrid model: full attention, sliding-window attention and Mamba2 state layers.

It exists so the engine, the arena and the benchmarks can exercise all three kinds of memory
without any checkpoint: `tiny_model()` builds it with random weights from a seed.  Attention
layers are Gemma 3 blocks (same math, same parameter names, embeddings scaled by sqrt(d) as
Gemma's); Mamba2 layers are a pre-norm Mamba2 mixer (NemotronH / Bamba naming) followed by the
same MLP block.

It saves and loads like a checkpoint: config.json with `architectures: ["UmemTinyHybrid"]`
plus model.safetensors.  `tiny_config(with_mamba=False)` gives an attention-only variant
(window + full, no state sub-pool).

The Mamba2 layer runs the shared Mamba2Mixer (mamba2_mixer.py) over the request's state slot;
its dt clamp is 0 (no clamp), so cached decoding and the cache-free forward agree exactly.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from ..memory.declarations import StateTensor
from .causal_lm import CausalLM, ResidualLayer
from .config import FULL, RECURRENT, SLIDING, MambaConfig, ModelConfig, RopeConfig
from .gemma3 import DecoderLayer
from .layers import MLP, RMSNorm
from .mamba2_mixer import Mamba2Mixer

ARCHITECTURE = "UmemTinyHybrid"
# Decode tokens between prefix-cache checkpoints of the recurrent state (small, so CPU tests
# cross a decode checkpoint).
CHECKPOINT_INTERVAL = 32


def tiny_config(*, with_mamba: bool = True, **overrides) -> ModelConfig:
    """The default tiny hybrid: 6 layers (sliding, mamba, sliding, full, sliding, mamba).

    Sizes are small enough for CPU tests (hidden 64, 4 heads / 2 KV heads of 16, window 16).
    """
    types = (SLIDING, RECURRENT, SLIDING, FULL, SLIDING, RECURRENT)
    if not with_mamba:
        types = tuple(SLIDING if t == RECURRENT else t for t in types)
    fields = {
        "architecture": ARCHITECTURE, "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
        "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "layer_types": types, "sliding_window": 16,
        "rope": ((FULL, RopeConfig(1_000_000.0)), (SLIDING, RopeConfig(10_000.0))),
        "query_pre_attn_scalar": 16,
        "mamba": MambaConfig(num_heads=4, head_dim=16, state_size=16, n_groups=1, conv_kernel=4, chunk_size=16),
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "max_position_embeddings": 4096,
    }
    fields.update(overrides)
    return ModelConfig(**fields)


def tiny_config_to_dict(cfg: ModelConfig) -> dict:
    """config.json content for a tiny model (the inverse of tiny_config_from_dict)."""
    d = dataclasses.asdict(cfg)
    d["architectures"] = [ARCHITECTURE]
    d["model_type"] = "umem_tiny_hybrid"
    d["layer_types"] = list(cfg.layer_types)
    d["rope"] = {name: dataclasses.asdict(r) for name, r in cfg.rope}
    del d["architecture"]
    return d


def tiny_config_from_dict(d: dict) -> ModelConfig:
    d = dict(d)
    for k in ("architectures", "model_type", "architecture"):
        d.pop(k, None)
    d["layer_types"] = tuple(d["layer_types"])
    d["mtp_layer_types"] = tuple(d.get("mtp_layer_types", ()))  # JSON lists read back as the config's tuples
    d["rope"] = tuple((name, RopeConfig(**r)) for name, r in d.get("rope", {}).items())
    if d.get("mamba") is not None:
        d["mamba"] = MambaConfig(**d["mamba"])
    if isinstance(d.get("eos_token_id"), list):
        d["eos_token_id"] = tuple(d["eos_token_id"])
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"unknown tiny-model config keys {unknown}")
    return ModelConfig(architecture=ARCHITECTURE, **d)


class MambaLayer(ResidualLayer):
    """h += mixer(norm(h)); then the Gemma MLP block (pre- and post-norm), both residual."""

    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        dtype, d, eps = jnp.dtype(cfg.dtype), cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps=eps, dtype=dtype)
        self.mixer = Mamba2Mixer(d, cfg.mamba, time_step_min=0.0, eps=eps, conv_bias=True, dtype=dtype, rngs=rngs)
        self.pre_feedforward_layernorm = RMSNorm(d, eps=eps, dtype=dtype)
        self.mlp = MLP(d, cfg.intermediate_size, cfg.hidden_activation, dtype=dtype, rngs=rngs)
        self.post_feedforward_layernorm = RMSNorm(d, eps=eps, dtype=dtype)

    ffn = DecoderLayer.ffn


class TinyHybrid(CausalLM):
    """Gemma 3 blocks and Mamba2 layers in the shared decoder, embeddings scaled as Gemma's."""

    scale_embeddings = True
    checkpoint_interval = CHECKPOINT_INTERVAL

    def make_layer(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs) -> nnx.Module:
        if cfg.layer_types[layer] == RECURRENT:
            return MambaLayer(cfg, layer, rngs=rngs)
        return DecoderLayer(cfg, layer, rngs=rngs)

    @staticmethod
    def state_tensors(cfg: ModelConfig, conv_dtype: str) -> tuple[StateTensor, ...]:
        return Mamba2Mixer.state_tensors(cfg.mamba, conv_dtype)


def tiny_model(seed: int = 0, **config_overrides):
    """A random-weight tiny model as a Model handle (see model.py)."""
    from .model import Model

    cfg = config_overrides.pop("config", None) or tiny_config(**config_overrides)
    module = TinyHybrid(cfg, rngs=nnx.Rngs(seed))
    _randomise_norms(module, seed)
    return Model.from_module(module)


def _randomise_norms(module: nnx.Module, seed: int) -> None:
    """Add noise to every norm weight (zero-init "1 + w" norms and the mixer's ones-init gated
    norm alike), so a (1 + w) vs w slip shows."""
    import jax

    key = jax.random.key(seed + 1)
    for path, var in nnx.iter_graph(module):
        if isinstance(var, nnx.Param) and path and path[-1] == "weight" and "norm" in str(path[-2]):
            key, sub = jax.random.split(key)
            var[...] = var[...] + 0.1 * jax.random.normal(sub, var[...].shape, var[...].dtype)


__all__ = ["ARCHITECTURE", "MambaLayer", "TinyHybrid", "tiny_config", "tiny_config_from_dict", "tiny_config_to_dict",
           "tiny_model"]
