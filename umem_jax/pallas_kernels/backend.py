"""Which Pallas kernel `impl="pallas"` runs for an attention op: the Triton kernel, or the Mosaic GPU
(plgpu) one on Hopper where it covers the case.

Both attention ops (paged_prefill, paged_decode) decide the same way, from static shapes, dtypes
and this process's device, so at trace time: a request for "triton" is obeyed; "auto" takes the
Mosaic GPU kernel where `mgpu_refusal` finds no reason against it, else Triton; "mgpu" insists and
raises NotImplementedError with the reason where it cannot run.  The choice comes from the
caller's `backend` argument or, when that is None, from an environment variable read when the
caller's jitted step is traced (UMEM_JAX_PREFILL, UMEM_JAX_DECODE).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax

__all__ = ["BACKENDS", "DeviceInfo", "choose", "device_info", "hopper_refusal", "requested_backend"]

BACKENDS = ("auto", "triton", "mgpu")


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """What the kernel choice depends on besides shapes: jax.default_backend(), the CUDA compute
    capability ("9.0"; None off CUDA) and jax's (major, minor)."""

    platform: str
    compute_capability: str | None
    jax_version: tuple[int, int]


def _jax_version() -> tuple[int, int]:
    try:
        major, minor = (int(x) for x in jax.__version__.split(".")[:2])
    except ValueError:  # pragma: no cover - odd dev version strings
        return (0, 0)
    return (major, minor)


@functools.lru_cache(maxsize=1)
def device_info() -> DeviceInfo:
    """This process's accelerator (probed once: devices do not change under a running process)."""
    platform = jax.default_backend()
    cc = None
    if platform == "gpu":
        dev = jax.devices()[0]
        if "cuda" in getattr(dev.client, "platform_version", "").lower():  # not ROCm
            cc = getattr(dev, "compute_capability", None)
    return DeviceInfo(platform, cc, _jax_version())


def requested_backend(backend: str | None, env: str, default: str) -> str:
    """`backend`, or $env (stripped, lower case; unset or empty: `default`), checked."""
    choice = backend if backend is not None else (os.environ.get(env, "").strip().lower() or default)
    if choice not in BACKENDS:
        src = "backend" if backend is not None else env
        raise ValueError(f"{src} must be one of {BACKENDS}, got {choice!r}")
    return choice


def choose(choice: str, op: str, refusal) -> tuple[str, str]:
    """The kernel for a requested `choice` (requested_backend's): ("mgpu", "") when `refusal()` (the
    reason the Mosaic GPU kernel of `op` cannot or should not run here, or None; called only when
    needed) has none, else ("triton", why); a choice of "mgpu" that cannot run raises
    NotImplementedError with the reason instead of falling back."""
    if choice == "triton":
        return "triton", "the Triton kernel was asked for"
    why = refusal()
    if why is None:
        return "mgpu", ""
    if choice == "mgpu":
        raise NotImplementedError(f"the Mosaic GPU {op} kernel was asked for but cannot run: {why}")
    return "triton", why


def hopper_refusal(info: DeviceInfo) -> str | None:
    """Why this device cannot run a Mosaic GPU kernel written for Hopper, or None when it can."""
    if info.platform != "gpu" or info.compute_capability is None:
        return f"not an NVIDIA GPU (backend {info.platform!r})"
    try:
        major = int(str(info.compute_capability).split(".")[0])
    except ValueError:
        return f"unrecognised compute capability {info.compute_capability!r}"
    if major != 9:  # wgmma and the sm_90 TMA/barrier forms it lowers to exist on Hopper only
        return f"compute capability {info.compute_capability} is not Hopper (9.x)"
    if info.jax_version < (0, 11):
        return f"jax {info.jax_version[0]}.{info.jax_version[1]} < 0.11 (the plgpu.kernel API)"
    return None
