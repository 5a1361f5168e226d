"""Named layer-declaration sets of well-known hybrid shapes (memory only, no weights).

They let the CLI and benchmarks plan and size an arena for a realistic model without loading
one.  The "*-like" presets are the memory of registry.SHAPES' configs, declared by their own
families (`decls(config)`, bf16 K/V); "tiny-hybrid" is a small shape of its own.
"""

from __future__ import annotations

import functools

from ..memory.declarations import LayerDecl, full_attention, mamba2_state_tensors, recurrent_state, window_attention
from .registry import SHAPES, model_class


def tiny_hybrid() -> list[LayerDecl]:
    """Six layers, window(64) / Mamba2 / full twice: the default shape of the CLI's `plan` and the
    arena demo (wider heads and a longer window than the tiny model's, so a page holds few tokens)."""
    state = mamba2_state_tensors(num_heads=4, head_dim=16, state_size=16, n_groups=1, conv_kernel=4)
    decls = []
    for i in range(6):
        kind = i % 3
        if kind == 0:
            decls.append(window_attention(i, 64, num_kv_heads=2, head_dim=64))
        elif kind == 1:
            decls.append(recurrent_state(i, state, checkpoint_interval=64))
        else:
            decls.append(full_attention(i, num_kv_heads=2, head_dim=64))
    return decls


def shape_decls(name: str) -> list[LayerDecl]:
    """The memory declarations of registry.SHAPES[name] (K/V and conv windows in bf16)."""
    cfg = SHAPES[name]()
    return model_class(cfg.architecture).decls(cfg)


gemma3_4b_like = functools.partial(shape_decls, "gemma3-4b-like")
nemotronh_8b_like = functools.partial(shape_decls, "nemotronh-8b-like")
qwen35_4b_like = functools.partial(shape_decls, "qwen3.5-4b-like")

PRESETS = {"tiny-hybrid": tiny_hybrid, **{name: functools.partial(shape_decls, name) for name in SHAPES}}


def preset(name: str) -> list[LayerDecl]:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None
