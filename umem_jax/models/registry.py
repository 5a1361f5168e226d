"""Architecture name -> model class.

Keys are the names a checkpoint's config.json lists under `architectures` (and the built-in
"UmemTinyHybrid").  Each class is an nnx.Module built as `cls(config, rngs=...)` with a static
`decls(config, kv_dtype)` and a forward `module(arena, batch, plan)`.
"""

from __future__ import annotations


def _classes() -> dict[str, type]:
    from .gemma3 import Gemma3ForCausalLM
    from .nemotron_h import NemotronHForCausalLM
    from .qwen3_5 import Qwen3_5ForCausalLM
    from .tiny import TinyHybrid

    return {
        "Gemma3ForCausalLM": Gemma3ForCausalLM,
        # The multimodal Gemma 3 checkpoints (4b and up) carry the same text decoder.
        "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,
        "UmemTinyHybrid": TinyHybrid,
        "NemotronHForCausalLM": NemotronHForCausalLM,
        "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
        # The multimodal Qwen3.5 checkpoints: the same text decoder under model.language_model.
        "Qwen3_5ForConditionalGeneration": Qwen3_5ForCausalLM,
    }


def supported_architectures() -> list[str]:
    return sorted(_classes())


def model_class(architecture: str) -> type:
    classes = _classes()
    if architecture not in classes:
        raise NotImplementedError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(sorted(classes))}")
    return classes[architecture]
