"""The recurrent state's storage dtype: EngineConfig.mamba_ssm_dtype against what the checkpoint's
config.json names (issue 17, item 2).

    ssm = resolve(cfg, model)             # "float32" | "bfloat16" | "float16"
    plan(with_ssm_dtype(model.decls(kv), ssm))

vLLM reads the same keys when its --mamba-ssm-cache-dtype is "auto": Qwen3.5 / Qwen3-Next write
`mamba_ssm_dtype` (under text_config for the multimodal checkpoints), NemotronH
`mamba_ssm_cache_dtype`.  A 16-bit state is one plane of the arena instead of two (half the state
bytes, so more slots); the kernels compute in fp32 either way.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..memory.declarations import mamba_ssm_dtype

CONFIG_KEYS = ("mamba_ssm_dtype", "mamba_ssm_cache_dtype")
_ALIASES = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def checkpoint_ssm_dtype(source) -> str | None:
    """The state dtype a checkpoint directory's config.json names (top level or text_config), or
    None when it names none (or there is no config.json).  "torch.bfloat16" reads as "bfloat16"."""
    if source is None or not (Path(source) / "config.json").is_file():
        return None
    cfg = json.loads((Path(source) / "config.json").read_text())
    for scope in (cfg, cfg.get("text_config") or {}):
        for key in CONFIG_KEYS:
            value = scope.get(key)
            if value is not None:
                name = str(value).removeprefix("torch.")
                return _ALIASES.get(name, name)
    return None


def resolve(cfg, model) -> str:
    """cfg.mamba_ssm_dtype, or with "auto" the checkpoint's (the directory the model was loaded
    from, or cfg.model when it is one), else "float32"."""
    if cfg.mamba_ssm_dtype != "auto":
        return mamba_ssm_dtype(cfg.mamba_ssm_dtype)
    source = getattr(model, "source", None)
    if source is None and isinstance(cfg.model, (str, Path)):
        source = cfg.model
    return mamba_ssm_dtype(cfg.mamba_ssm_dtype, checkpoint_ssm_dtype(source))


__all__ = ["CONFIG_KEYS", "checkpoint_ssm_dtype", "resolve"]
