"""Building blocks shared by the model families: projections, embedding, RMSNorm, RoPE, MLPs.

Weights are stored in the Hugging Face layout ([out, in] for projections) so loading a
checkpoint is a rename, never a transpose; `Linear` computes x @ W^T.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from ..pallas_kernels.rms_norm import norm_backend, rms_norm, rms_norm_reference
from ..parallel.collectives import reduce_sum
from .config import RopeConfig


def fp32_precision(*operands):
    """The precision of a model dot: "highest" when every operand is float32, else JAX's default.
    A GPU multiplies fp32 in TF32 (a 10-bit mantissa) by default; a one-token decode and a k+1-token
    speculative verify then round differently enough to part greedy paths at near ties (the H200:
    benchmarks/RESULTS.md, speculative decoding, 2026-12-05), and a user who serves fp32 weights
    expects fp32 arithmetic.  Kernels choose their own."""
    return jax.lax.Precision.HIGHEST if all(x.dtype == jnp.float32 for x in operands) else None


def normal_init(rngs: nnx.Rngs, shape, dtype, std: float = 0.02):
    """std * N(0, 1) of `shape`.  Called eagerly (a model built outside jit), it runs one jitted
    generator per distinct (shape, dtype, std): a model has a handful of distinct weight shapes,
    so the device compiles a handful of small programs, where one jit over the whole constructor
    would compile a generator per weight (slow to build a billion-parameter model).  Inside a jit
    (an abstract build) the generator is inlined."""
    return _normal(rngs.params(), tuple(shape), jnp.dtype(dtype), float(std))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _normal(key, shape, dtype, std):
    return std * jax.random.normal(key, shape, dtype)


class Linear(nnx.Module):
    """y = x W^T (+ b), W [out, in] as in the checkpoint; bias=True adds `bias` [out] (gpt-oss's
    attention projections have one).

    reduce_axis: under tensor parallelism a row-parallel projection holds a slice of `in` on each
    device and psums its partial outputs over this mesh axis (sharding.py sets it on the
    per-device module; None, the default, is the unsplit layer).  The bias is added once, after
    the psum.
    """

    def __init__(self, in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs, bias: bool = False):
        self.weight = nnx.Param(normal_init(rngs, (out_features, in_features), dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else nnx.data(None)
        self.reduce_axis = None

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.weight[...]
        y = reduce_sum(jnp.einsum("...i,oi->...o", x, w, precision=fp32_precision(x, w)), self.reduce_axis)
        return y if self.bias is None else y + self.bias[...]


def settle(h) -> jax.Array:
    """The residual stream as an array: a block that leaves its residual add to the next block's
    norm (RMSNorm.enter, one kernel with the norm) returns the pending (h, delta)."""
    return h[0] + h[1] if isinstance(h, tuple) else h


class FusedLinear(nnx.Module):
    """Several column projections of the same input as one matmul: y_i = x W_i^T (+ b_i) for each part.

    weight [sum(out_i), in] is the parts' weights stacked along `out` (also [tp, sum, in] for a
    stacked tensor-parallel leaf: the concatenation is on axis -2 either way); bias [sum(out_i)]
    (or [tp, sum]) their biases, zeros for a part without one, when any part has one.  At small batch a
    projection is a weight read; one launch over the stacked weight avoids a launch per part and
    lets the GEMM reach the copy rate (Qwen3.5-4B-like decode at B=64: -0.3 ms of 7.4 ms on the H200).
    """

    def __init__(self, parts: list[Linear], *, donate: bool = False):
        """donate: delete the parts' arrays once stacked, so fusing a model costs one layer's
        projections of extra memory at a time instead of a second copy of them all."""
        if any(p.reduce_axis is not None for p in parts):
            raise ValueError("only column-parallel projections (no psum) can be fused")
        self.sizes = tuple(int(p.weight.shape[-2]) for p in parts)
        self.weight = nnx.Param(jnp.concatenate([p.weight[...] for p in parts], axis=-2))
        self.bias = nnx.data(None)
        if any(p.bias is not None for p in parts):
            biases = [p.bias[...] if p.bias is not None else jnp.zeros(p.weight.shape[:-1], p.weight.dtype)
                      for p in parts]
            self.bias = nnx.Param(jnp.concatenate(biases, axis=-1))
        if donate:
            self.weight[...].block_until_ready()
            for p in parts:
                p.weight[...].delete()
                if p.bias is not None:
                    p.bias[...].delete()

    def __call__(self, x: jax.Array) -> tuple[jax.Array, ...]:
        """x [..., in] -> the parts' outputs [..., out_i], sliced from `product`."""
        y = self.product(x)
        return tuple(y[..., s:s + n] for s, n in zip(self.starts, self.sizes))

    @property
    def starts(self) -> tuple[int, ...]:
        """Each part's first column in the product."""
        return tuple(sum(self.sizes[:i]) for i in range(len(self.sizes)))

    def product(self, x: jax.Array) -> jax.Array:
        """x [..., in] -> y [..., sum(out_i)], part i at columns starts[i]..+sizes[i]: for a consumer
        that reads its part in place (a slice is a copy launch at decode)."""
        w = self.weight[...]
        y = jnp.einsum("...i,oi->...o", x, w, precision=fp32_precision(x, w))
        if self.bias is not None:
            y = y + self.bias[...]
        # Each part goes to a different consumer, and XLA may fuse the whole matmul into every one of
        # them: on an H100 a Qwen3.5-MoE decode step ran the DeltaNet input projection (with its
        # RMSNorm) three times a layer, 1.2 ms of a 5.5 ms step (benchmarks/RESULTS.md, session 18
        # traces).  The barrier makes the product one buffer that the parts are sliced from.
        if len(self.sizes) > 1:
            y = jax.lax.optimization_barrier(y)
        return y


class Embedding(nnx.Module):
    """Token embedding [vocab, d]; `attend` is the tied (or separate) LM head h E^T."""

    def __init__(self, vocab: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(normal_init(rngs, (vocab, dim), dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)

    def attend(self, h: jax.Array) -> jax.Array:
        """h [..., d] -> fp32 logits [..., V], accumulated and returned in fp32: logits rounded to
        bf16 tie exactly (8 mantissa bits: steps of 1/32 near |8|), and a tie's winner then
        depends on which kernel computed the hidden state (a speculative verify and a decode step
        picked different tokens of a bf16 tie on the H200, benchmarks/RESULTS.md)."""
        w = self.weight[...]
        return jnp.einsum("...d,vd->...v", h, w, precision=fp32_precision(h, w), preferred_element_type=jnp.float32)


class RMSNorm(nnx.Module):
    """x * rsqrt(mean(x^2) + eps) * (offset + w), in fp32, cast back to x's dtype.

    Gemma stores w zero-centred and multiplies by (1 + w): offset = 1.  Plain RMSNorm: offset = 0.
    """

    def __init__(self, dim: int, *, eps: float, offset: float = 1.0, dtype):
        init = jnp.zeros if offset else jnp.ones
        self.weight = nnx.Param(init((dim,), dtype))
        self.eps = eps
        self.offset = offset

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., dim] -> [..., dim] in x.dtype (one Pallas kernel on a GPU: pallas_kernels/rms_norm.py)."""
        return self._norm(x, None)

    def add(self, h: jax.Array, delta: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The residual add and the norm after it: h, delta [..., dim] -> (h + delta, norm(h + delta)),
        the sum as `h + delta` gives it; one kernel on a GPU instead of XLA's three."""
        if delta.dtype != h.dtype:  # the sum promotes: keep XLA's
            h = h + delta
            return h, self(h)
        y, h = self._norm(h, delta)
        return h, y

    def enter(self, h) -> tuple[jax.Array, jax.Array]:
        """A block's entry: the residual stream h, an array or a pending add (h, delta) that the block
        before left (settle) -> (the stream as an array, its norm)."""
        return self.add(*h) if isinstance(h, tuple) else (h, self(h))

    def _norm(self, x, residual):
        kw = dict(eps=self.eps, offset=self.offset, residual=residual)
        if norm_backend() == "pallas":
            return rms_norm(x, self.weight[...], interpret=jax.default_backend() != "gpu", **kw)
        return rms_norm_reference(x, self.weight[...], **kw)


def rope_inv_freq(rope: RopeConfig, dim: int) -> jax.Array:
    """[dim/2] fp32 inverse frequencies; linear scaling divides them by the factor, yarn blends
    the two (the cos/sin factor yarn also applies is rope.attention_scaling)."""
    exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
    pos_freqs = rope.theta ** exponents
    inv = 1.0 / pos_freqs
    if rope.rope_type == "linear":
        return inv / rope.factor
    if rope.rope_type != "yarn":
        return inv
    low, high = _yarn_correction_range(rope, dim)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: keep the dim's own frequency (fast dims); 0: interpolate by factor
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + inv * extrapolation


def _yarn_correction_range(rope: RopeConfig, dim: int) -> tuple[float, float]:
    """The dims (of dim/2) where yarn's ramp runs: from the one turning beta_fast times to the one
    turning beta_slow times over the original context."""
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(rope.theta)))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scaling: float = 1.0) -> jax.Array:
    """Rotate pairs (x[j], x[j + D/2]) ("rotate_half" layout).

    x [B, T, H, D], positions [B, T] int32, inv_freq [D/2] -> [B, T, H, D] in x's dtype.
    cos/sin are computed in fp32, times `scaling` (yarn's attention factor), and cast to x's dtype
    before the product, as transformers does.
    """
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    ang = jnp.concatenate([ang, ang], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "silu": jax.nn.silu,
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),
}


def activation(name: str):
    if name not in _ACTIVATIONS:
        raise NotImplementedError(f"activation {name!r}; known: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class MLP(nnx.Module):
    """down(act(gate x) * up x)."""

    def __init__(self, hidden: int, intermediate: int, act: str, *, dtype, rngs: nnx.Rngs):
        self.gate_proj = Linear(hidden, intermediate, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(hidden, intermediate, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(intermediate, hidden, dtype=dtype, rngs=rngs)
        self.act = act
        self.gate_up = nnx.data(None)  # FusedLinear once fuse_projections() ran

    def fuse_projections(self, donate: bool = False) -> bool:
        """Replace gate_proj and up_proj by one FusedLinear over their stacked weights."""
        if self.gate_up is not None:  # fused already
            return False
        self.gate_up = FusedLinear([self.gate_proj, self.up_proj], donate=donate)
        self.gate_proj = self.up_proj = None
        return True

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = self.gate_up(x) if self.gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(activation(self.act)(gate) * up)


class UngatedMLP(nnx.Module):
    """down(act(up x)), no gate (NemotronH's MLP blocks, act relu^2)."""

    def __init__(self, hidden: int, intermediate: int, act: str, *, dtype, rngs: nnx.Rngs):
        self.up_proj = Linear(hidden, intermediate, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(intermediate, hidden, dtype=dtype, rngs=rngs)
        self.act = act

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(activation(self.act)(self.up_proj(x)))
