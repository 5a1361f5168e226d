"""The realistic model families the model benchmarks run, at full size and cut down.

  gemma3     Gemma-3-4B-like: 34 layers (5 sliding w=1024 : 1 global), d 2560, 8 q / 4 kv heads x 256,
             GeGLU 10240, vocab 262144, tied
  nemotronh  NemotronH-8B-like: 52 blocks "M-M-M-M*-...", 24 Mamba2 (128 heads x 64, state 128, 8 groups),
             4 NoPE attention (32 q / 8 kv x 128), 24 relu^2 MLP 21504, d 4096, vocab 131072, untied
  qwen35     Qwen3.5-4B-like: 32 layers, 3 gated DeltaNet (16 k / 32 v heads x 128) : 1 gated attention
             (16 q / 4 kv x 256), d 2560, SwiGLU 9216, vocab 248320, tied
  gptoss     gpt-oss-20b-like: 24 layers alternating sliding w=128 / full (64 q / 8 kv x 64, sinks,
             biases), MoE 32 experts top-4 (2880), d 2880, vocab 201088, untied
  qwen35moe  Qwen3.5-35B-A3B-like: 40 layers 3 gated DeltaNet : 1 gated attention, MoE 256 experts
             top-8 (512) + gated shared expert, d 2048
  nemo3nano  Nemotron-3-Nano-30B-A3B-like: 52 blocks, 23 Mamba2, 23 MoE (128 experts top-6 relu^2 +
             a shared one), 6 attention (32 q / 2 kv x 128), d 2688

Per family: `full(dtype)` the real shape; `tiny(cfg)` tiny widths and a few layers of the family's
pattern (CPU runs); `check(cfg)` one layer of each kind at the real head and state geometry with a
small vocabulary (the correctness model of a GPU run).
"""

from __future__ import annotations

import dataclasses

from umem_jax.models.config import FULL, RECURRENT, SLIDING, MambaConfig
from umem_jax.models.gemma3 import gemma3_4b_like
from umem_jax.models.gpt_oss import gpt_oss_20b_like
from umem_jax.models.model import Model
from umem_jax.models.nemotron_h import MOE_BLOCK, nemotron_3_nano_30b_a3b_like, nemotron_h_8b_like
from umem_jax.models.qwen3_5 import qwen3_5_4b_like
from umem_jax.models.qwen3_5_moe import qwen3_5_35b_a3b_like
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


def _tiny_moe(c):
    """The block's routing and expert kind kept; 8 experts of width 64, top-2 (shared expert 64)."""
    m = c.moe
    return dataclasses.replace(m, num_experts=8, top_k=2, intermediate_size=64,
                               n_group=min(m.n_group, 2), topk_group=min(m.topk_group, 1),
                               shared_intermediate_size=64 if m.shared_intermediate_size else 0)


def gpt_oss_tiny(c):
    return dataclasses.replace(c, vocab_size=512, hidden_size=64, intermediate_size=64, num_heads=6,
                               num_kv_heads=2, head_dim=32, sliding_window=32, moe=_tiny_moe(c),
                               layer_types=(SLIDING, FULL, SLIDING))


def qwen_moe_tiny(c):
    return dataclasses.replace(qwen_tiny(c), moe=_tiny_moe(c), mlp_only_layers=())


def nemotron_moe_tiny(c):
    return dataclasses.replace(nemotron_tiny(c), moe=_tiny_moe(c),
                               layer_types=(RECURRENT, MOE_BLOCK, RECURRENT, FULL, MOE_BLOCK))


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
    # MoE families: the check keeps every expert at its real shape (one MoE layer per kind).
    "gptoss": dict(name="gpt-oss-20b-like", full=gpt_oss_20b_like, tiny=gpt_oss_tiny,
                   check=lambda c: _reduce(c, (SLIDING, FULL), sliding_window=32)),
    "qwen35moe": dict(name="qwen3.5-35b-a3b-like", full=qwen3_5_35b_a3b_like, tiny=qwen_moe_tiny,
                      check=lambda c: _reduce(c, (RECURRENT, FULL), mlp_only_layers=())),
    "nemo3nano": dict(name="nemotron-3-nano-30b-a3b-like", full=nemotron_3_nano_30b_a3b_like,
                      tiny=nemotron_moe_tiny,
                      check=lambda c: _reduce(c, (RECURRENT, FULL, MOE_BLOCK), time_step_min=0.0)),
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
           "gpt_oss_tiny", "nemotron_moe_tiny", "nemotron_tiny", "qwen_moe_tiny", "qwen_tiny"]
