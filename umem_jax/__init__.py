"""umem_jax: a JAX/Pallas serving engine for hybrid language models with one unified memory arena."""

__version__ = "0.1.0"
