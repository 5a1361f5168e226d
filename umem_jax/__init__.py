"""umem_jax: a JAX/Pallas serving engine for hybrid language models with one unified memory arena."""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):
    # Lazy: `import umem_jax.memory` must not pull in the engine (and its JAX/Flax imports).
    if name == "LLM":
        from .api.llm import LLM

        return LLM
    if name == "SamplingParams":
        from .core.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'umem_jax' has no attribute {name!r}")
