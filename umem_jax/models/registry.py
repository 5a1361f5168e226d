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


# ------------------------------------------------------------------ random weights, real shapes


def _random_shapes() -> dict:
    """Preset name (the names umem_jax.models.presets uses for the same models' memory) -> config factory
    `f(dtype) -> ModelConfig`.  Each family adds its own entries."""
    from .gemma3 import gemma3_4b_like
    from .nemotron_h import nemotron_h_8b_like
    from .qwen3_5 import qwen3_5_4b_like

    return {"gemma3-4b-like": gemma3_4b_like, "nemotronh-8b-like": nemotron_h_8b_like,
            "qwen3.5-4b-like": qwen3_5_4b_like}


def random_shape_names() -> list[str]:
    return sorted(_random_shapes())


def build_random(name_or_config, dtype: str = "bfloat16", *, seed: int = 0, abstract: bool = False):
    """A Model of a realistic shape with random weights, for benchmarks (no checkpoint needed).

    name_or_config: a name from `random_shape_names()` or a ModelConfig.  The weights are made
    on the default device (an 8B model in bf16 is 16 GB: nothing goes through the host).
    abstract=True gives jax.ShapeDtypeStruct leaves instead (weight bytes for sizing, no memory).
    Returns a `model.Model`.
    """
    import dataclasses

    import jax
    from flax import nnx

    from .model import Model

    if isinstance(name_or_config, str):
        shapes = _random_shapes()
        if name_or_config not in shapes:
            raise ValueError(f"unknown model shape {name_or_config!r}; choose one of {sorted(shapes)}")
        cfg = shapes[name_or_config](dtype)
    else:
        cfg = dataclasses.replace(name_or_config, dtype=dtype)
    cls = model_class(cfg.architecture)
    # unsafe_rbg: one RNG op per weight instead of a hash expanded per weight; the values only
    # need to be random.
    build = lambda: cls(cfg, rngs=nnx.Rngs(jax.random.key(seed, impl="unsafe_rbg")))
    if abstract:
        graphdef, params = nnx.split(nnx.eval_shape(build))  # ShapeDtypeStruct leaves
        return Model(cfg, graphdef, params, cls)
    # Built eagerly, not in one jit: each weight comes from a jitted generator cached per shape
    # (layers._init), so the device compiles ~10 small programs; the one jit over the whole
    # constructor (a generator kernel per weight) took 124 s to build a 4B model on the H200,
    # this way 4-6 s.
    graphdef, params = nnx.split(build())
    return Model(cfg, graphdef, params, cls)
