"""Shims over the jax versions the kernels run on: the Triton module and its compiler params.

jax 0.10.2 (CPU machines) and 0.11.x (the GPU machine) both export
`jax.experimental.pallas.triton.CompilerParams(num_warps, num_stages)`; older releases called it
`pl.TritonCompilerParams`.  Passing it explicitly is what selects the Triton lowering: without it
`jax_pallas_use_mosaic_gpu` (default True) sends a `pallas_call` to Mosaic GPU.
"""

from __future__ import annotations

import warnings

from jax.experimental import pallas as pl

try:  # jax >= 0.5: the Triton-specific module
    from jax.experimental.pallas import triton as pltr
except ImportError:  # pragma: no cover - very old jax
    pltr = None


def triton_params(num_warps: int = 4, num_stages: int = 2):
    """Triton compiler params under whichever name this jax uses."""
    cls = getattr(pltr, "CompilerParams", None) if pltr is not None else None
    if cls is None:
        cls = getattr(pl, "TritonCompilerParams", None)
    if cls is None:  # pragma: no cover
        raise ImportError("this jax has no Pallas Triton CompilerParams")
    return cls(num_warps=num_warps, num_stages=num_stages)


def silence_triton_deprecation():
    """jax 0.11 warns `jax-pallas-triton` at every Triton lowering.  The kernels use the Triton
    lowering on purpose (it runs on every CUDA GPU and in interpret mode; Mosaic GPU only on
    Hopper, for the one kernel written for it), so keep that one warning out of logs and -W error
    runs."""
    warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
    warnings.filterwarnings("ignore", message=".*jax-pallas-triton.*")


def mgpu_load(plgpu, ref, layout):
    """`plgpu.load` of a whole shared-memory ref in `layout`: jax 0.11 takes (ref, *, layout), jax 0.10
    also wants an index (the kernels are compiled on 0.11; 0.10 machines cross-lower them in tests)."""
    import inspect

    idx = inspect.signature(plgpu.load).parameters.get("idx")
    if idx is not None and idx.default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)
