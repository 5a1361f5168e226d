"""Named layer-declaration sets of well-known hybrid shapes (memory only, no weights).

They let the CLI and benchmarks plan and size an arena for a realistic model without loading
one.  Shapes follow the public configs of each family closely enough for memory accounting.
"""

from __future__ import annotations

from ..memory.declarations import (
    LayerDecl,
    full_attention,
    gated_deltanet_state_tensors,
    mamba2_state_tensors,
    recurrent_state,
    window_attention,
)


def tiny_hybrid(page_size_hint: int = 16) -> list[LayerDecl]:
    """Six layers: window(64) / Mamba2 / full, twice; the built-in demo model's memory."""
    st = mamba2_state_tensors(num_heads=4, head_dim=16, state_size=16, n_groups=1, conv_kernel=4)
    decls = []
    for i in range(6):
        kind = i % 3
        if kind == 0:
            decls.append(window_attention(i, 64, num_kv_heads=2, head_dim=64))
        elif kind == 1:
            decls.append(recurrent_state(i, st, checkpoint_interval=64))
        else:
            decls.append(full_attention(i, num_kv_heads=2, head_dim=64))
    return decls


def gemma3_4b_like() -> list[LayerDecl]:
    """34 layers, 5 local (window 1024) : 1 global, 4 kv heads x 256."""
    return [full_attention(i, 4, 256) if (i + 1) % 6 == 0 else window_attention(i, 1024, 4, 256) for i in range(34)]


def nemotronh_8b_like() -> list[LayerDecl]:
    """52 blocks: 24 Mamba2 (128 heads x 64, state 128, 8 groups), 4 attention (8 kv x 128), MLPs."""
    pattern = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
    st = mamba2_state_tensors(num_heads=128, head_dim=64, state_size=128, n_groups=8, conv_kernel=4)
    decls = []
    for i, c in enumerate(pattern):
        if c == "M":
            decls.append(recurrent_state(i, st, checkpoint_interval=256))
        elif c == "*":
            decls.append(full_attention(i, 8, 128))
    return decls


def qwen35_4b_like() -> list[LayerDecl]:
    """32 layers, 3 gated DeltaNet (16 k / 32 v heads x 128) : 1 gated full attention (4 kv x 256)."""
    st = gated_deltanet_state_tensors(num_k_heads=16, num_v_heads=32, k_head_dim=128, v_head_dim=128, conv_kernel=4)
    return [full_attention(i, 4, 256) if i % 4 == 3 else recurrent_state(i, st, checkpoint_interval=256)
            for i in range(32)]


PRESETS = {
    "tiny-hybrid": tiny_hybrid,
    "gemma3-4b-like": gemma3_4b_like,
    "nemotronh-8b-like": nemotronh_8b_like,
    "qwen3.5-4b-like": qwen35_4b_like,
}


def preset(name: str) -> list[LayerDecl]:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None
