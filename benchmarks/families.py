"""The three realistic model families the model benchmarks run, at full size and cut down.

  gemma3     Gemma-3-4B-like: 34 layers (5 sliding w=1024 : 1 global), d 2560, 8 q / 4 kv heads x 256,
             GeGLU 10240, vocab 262144, tied
  nemotronh  NemotronH-8B-like: 52 blocks "M-M-M-M*-...", 24 Mamba2 (128 heads x 64, state 128, 8 groups),
             4 NoPE attention (32 q / 8 kv x 128), 24 relu^2 MLP 21504, d 4096, vocab 131072, untied
  qwen35     Qwen3.5-4B-like: 32 layers, 3 gated DeltaNet (16 k / 32 v heads x 128) : 1 gated attention
             (16 q / 4 kv x 256), d 2560, SwiGLU 9216, vocab 248320, tied

Per family: `full(dtype)` the real shape; `tiny(cfg)` tiny widths and a few layers of the family's
pattern (CPU runs); `check(cfg)` one layer of each kind at the real head and state geometry with a
small vocabulary (the correctness model of a GPU run).
"""

from __future__ import annotations

import dataclasses

from umem_jax.models.config import FULL, RECURRENT, SLIDING, MambaConfig
from umem_jax.models.gemma3 import gemma3_4b_like
from umem_jax.models.model import Model
from umem_jax.models.nemotron_h import nemotron_h_8b_like
from umem_jax.models.qwen3_5 import qwen3_5_4b_like
from umem_jax.models.registry import build_random

MLP_BLOCK = "mlp"  # NemotronH's third block type


def gemma_tiny(c):
    return dataclasses.replace(c, vocab_size=512, hidden_size=64, intermediate_size=128, num_heads=4,
                               num_kv_heads=2, head_dim=32, sliding_window=32, query_pre_attn_scalar=32,
                               layer_types=(SLIDING, SLIDING, FULL))


def nemotron_tiny(c):
    # time_step_min 0: cached decode and the cache-free forward then compute the same thing
    return dataclasses.replace(c, vocab_size=512, hidden_size=64, intermediate_size=128, num_heads=4,
                               num_kv_heads=2, head_dim=16,
                               mamba=MambaConfig(num_heads=4, head_dim=16, state_size=16, n_groups=2,
                                                 conv_kernel=4, chunk_size=16),
                               layer_types=(RECURRENT, MLP_BLOCK, RECURRENT, FULL, MLP_BLOCK), time_step_min=0.0)


def qwen_tiny(c):
    return dataclasses.replace(c, vocab_size=512, hidden_size=64, intermediate_size=128, num_heads=4,
                               num_kv_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=16, linear_value_head_dim=16,
                               layer_types=(RECURRENT, RECURRENT, FULL))


def _reduce(c, types, **kw):
    """The correctness model: one layer of each kind, the family's own geometry, a small vocab."""
    return dataclasses.replace(c, layer_types=types, vocab_size=min(c.vocab_size, 16384), **kw)


FAMILIES = {
    # Gemma's window is cut to 32 so pages slide out of it within the check's 81 tokens.
    "gemma3": dict(name="gemma3-4b-like", full=gemma3_4b_like, tiny=gemma_tiny,
                   check=lambda c: _reduce(c, (SLIDING, FULL), sliding_window=32)),
    "nemotronh": dict(name="nemotronh-8b-like", full=nemotron_h_8b_like, tiny=nemotron_tiny,
                      check=lambda c: _reduce(c, (RECURRENT, FULL, MLP_BLOCK), time_step_min=0.0)),
    "qwen35": dict(name="qwen3.5-4b-like", full=qwen3_5_4b_like, tiny=qwen_tiny,
                   check=lambda c: _reduce(c, (RECURRENT, FULL))),
}
ALIASES = {v["name"]: k for k, v in FAMILIES.items()}


def family_key(name: str) -> str | None:
    """"qwen35" or "qwen3.5-4b-like" -> "qwen35"; None for an unknown name."""
    key = ALIASES.get(name.strip(), name.strip())
    return key if key in FAMILIES else None


def family_config(key: str, small: bool = False, dtype: str = "bfloat16"):
    """The family's config at full size, or its tiny cut with `small`."""
    cfg = FAMILIES[key]["full"](dtype)
    return FAMILIES[key]["tiny"](cfg) if small else cfg


def build_model(cfg, seed: int = 0) -> Model:
    """Random weights of `cfg` made on the default device (in cfg.dtype; nothing passes through the
    host), by registry.build_random: one jitted generator per distinct weight shape."""
    return build_random(cfg, cfg.dtype, seed=seed)


__all__ = ["ALIASES", "FAMILIES", "MLP_BLOCK", "build_model", "family_config", "family_key", "gemma_tiny",
           "nemotron_tiny", "qwen_tiny"]
