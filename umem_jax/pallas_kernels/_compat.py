"""Small shims shared by the arena kernels: backend choice and Triton compiler params.

jax 0.10.2 (CPU machines) and 0.11.x (the GPU machine) both export
`jax.experimental.pallas.triton.CompilerParams(num_warps, num_stages)`; older releases called it
`pl.TritonCompilerParams`.  Passing it explicitly is what selects the Triton lowering: without it
`jax_pallas_use_mosaic_gpu` (default True) sends a `pallas_call` to Mosaic GPU.
"""

from __future__ import annotations

import warnings

import jax
from jax.experimental import pallas as pl

try:  # jax >= 0.5: the Triton-specific module
    from jax.experimental.pallas import triton as pltr
except ImportError:  # pragma: no cover - very old jax
    pltr = None

IMPLS = ("pallas", "reference")


def triton_params(num_warps: int = 4, num_stages: int = 2):
    """Triton compiler params under whichever name this jax uses."""
    cls = getattr(pltr, "CompilerParams", None) if pltr is not None else None
    if cls is None:
        cls = getattr(pl, "TritonCompilerParams", None)
    if cls is None:  # pragma: no cover
        raise ImportError("this jax has no Pallas Triton CompilerParams")
    return cls(num_warps=num_warps, num_stages=num_stages)


def resolve_impl(impl: str | None, interpret: bool = False) -> str:
    """`impl` or the default: pallas on GPU (or when interpreting), reference elsewhere."""
    if impl is None:
        return "pallas" if (interpret or jax.default_backend() == "gpu") else "reference"
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


def silence_triton_deprecation():
    """jax 0.11 warns `jax-pallas-triton` at every Triton lowering; the project chose Triton
    deliberately (DESIGN.md decision 4), so keep that one warning out of logs and -W error runs."""
    warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
    warnings.filterwarnings("ignore", message=".*jax-pallas-triton.*")
