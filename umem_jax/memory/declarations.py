"""Layer declarations: what each layer of a model keeps per request, as parts.

A part is a *geometry* (how one entry's bytes are shaped) times a *lifetime* (how long the
entries are kept).  The planner (plan.py) groups parts into sub-pools; nothing here knows
about the arena.

Geometries
  MHA(num_kv_heads, head_dim, v_head_dim)  one K row and one V row per token
  MLA(kv_lora_rank, rope_dim)              one latent row per token (V is a slice of it)
  StateGeometry(tensors)                   recurrent state tensors of one request
Lifetimes
  Full()                                   kept for the whole request (and the prefix cache)
  Window(w)                                only the last w tokens are needed
  State(checkpoint_interval)               one live state per request, overwritten each token

Sizes are counted in 16-bit *words*, the arena's element: a bf16 value is one word, an fp32
value two (stored as a hi plane and a lo plane), a float8 e4m3 K/V value half of one (two values
per word; K/V rows only: MHA/MLA geometries, never state).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

WORD_BYTES = 2  # the arena's element is one 16-bit word

_DTYPE_PLANES = {"bfloat16": 1, "float16": 1, "uint16": 1, "int16": 1, "float32": 2, "int32": 2, "uint32": 2}


FP8_E4M3 = "float8_e4m3fn"  # K/V stored as float8 e4m3, two values per 16-bit word
# The names engines give it (vLLM / SGLang --kv-cache-dtype): all mean e4m3 with per-layer scales.
_FP8_NAMES = ("fp8", "fp8_e4m3", "float8_e4m3fn", "float8_e4m3")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8", "fp8_e4m3")


def _dtype_name(dtype) -> str:
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name


def is_fp8(dtype) -> bool:
    """Whether `dtype` (a name or a dtype) is the fp8 K/V format (float8 e4m3)."""
    try:
        return _dtype_name(dtype) in _FP8_NAMES
    except TypeError:
        return False


def dtype_planes(dtype) -> int:
    """16-bit planes one element of `dtype` takes (bf16: 1, fp32: 2).  fp8 takes half a word and
    has no planes of its own: K/V rows count it with `dtype_words`."""
    name = _dtype_name(dtype)
    if name in _FP8_NAMES:
        raise ValueError(f"dtype {name} packs two values per 16-bit word: only K/V rows may be fp8 "
                         "(count them with dtype_words); recurrent state is bf16/fp16/fp32")
    if name not in _DTYPE_PLANES:
        raise ValueError(f"dtype {name} cannot be stored in the 16-bit arena (use bf16, fp16, fp32, or fp8 for K/V)")
    return _DTYPE_PLANES[name]


def dtype_words(dtype, n: int) -> int:
    """16-bit words `n` values of `dtype` take: n * planes, or n / 2 for fp8 (n must be even)."""
    if is_fp8(dtype):
        if n % 2:
            raise ValueError(f"fp8 packs two values per word: a row of {n} values is odd")
        return n // 2
    return n * dtype_planes(dtype)


def kv_cache_dtype(name: str, model_dtype: str | None = None) -> str:
    """The K/V storage dtype an engine option names: "auto" -> the model's dtype when it is bf16
    or fp32 (else bf16); "fp8" / "fp8_e4m3" -> FP8_E4M3 (scales from the checkpoint, else 1.0);
    "bfloat16" / "float32" as given."""
    if name == "auto":
        return model_dtype if model_dtype in ("float32", "bfloat16") else "bfloat16"
    if is_fp8(name):
        return FP8_E4M3
    if name in ("bfloat16", "float32"):
        return name
    raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}"
                     + (" (fp8 e5m2 K/V is not supported: use fp8_e4m3)" if "e5m2" in str(name) else ""))


# --------------------------------------------------------------------------- lifetimes


@dataclasses.dataclass(frozen=True)
class Full:
    """Kept for the whole request; reusable as prefix cache."""

    rank: int = dataclasses.field(default=2, init=False, repr=False, compare=False)


@dataclasses.dataclass(frozen=True)
class Window:
    """Only the last `window` tokens are read."""

    window: int
    rank: int = dataclasses.field(default=1, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.window <= 0:
            raise ValueError(f"window must be positive, got {self.window}")


@dataclasses.dataclass(frozen=True)
class State:
    """One state per request, overwritten every token; a checkpoint every
    `checkpoint_interval` tokens for prefix caching (0: no checkpoints)."""

    checkpoint_interval: int = 0
    rank: int = dataclasses.field(default=0, init=False, repr=False, compare=False)


Lifetime = Full | Window | State


# -------------------------------------------------------------------------- geometries


@dataclasses.dataclass(frozen=True)
class MHA:
    """K and V rows for one token: num_kv_heads x head_dim (V may use v_head_dim)."""

    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    dtype: str = "bfloat16"

    unit = "token"

    @property
    def k_words(self) -> int:
        return dtype_words(self.dtype, self.num_kv_heads * self.head_dim)

    @property
    def v_words(self) -> int:
        return dtype_words(self.dtype, self.num_kv_heads * (self.v_head_dim or self.head_dim))

    @property
    def row_words(self) -> tuple[int, ...]:
        """Word counts of each row this geometry stores per token per layer."""
        return (self.k_words, self.v_words)

    def describe(self) -> str:
        v = f"/{self.v_head_dim}" if self.v_head_dim and self.v_head_dim != self.head_dim else ""
        return f"MHA {self.num_kv_heads}x{self.head_dim}{v}" + (" fp8" if is_fp8(self.dtype) else "")


@dataclasses.dataclass(frozen=True)
class MLA:
    """One latent row per token: kv_lora_rank + rope_dim."""

    kv_lora_rank: int
    rope_dim: int
    dtype: str = "bfloat16"

    unit = "token"

    @property
    def row_words(self) -> tuple[int, ...]:
        return (dtype_words(self.dtype, self.kv_lora_rank + self.rope_dim),)

    def describe(self) -> str:
        return f"MLA {self.kv_lora_rank}+{self.rope_dim}"


@dataclasses.dataclass(frozen=True)
class StateTensor:
    """One recurrent-state tensor of one layer, e.g. Mamba2 conv state [conv_dim, k-1]."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def numel(self) -> int:
        return int(math.prod(self.shape))

    @property
    def planes(self) -> int:
        return dtype_planes(self.dtype)


@dataclasses.dataclass(frozen=True)
class StateGeometry:
    """The state tensors one layer keeps per request."""

    tensors: tuple[StateTensor, ...]

    unit = "request"

    def __post_init__(self):
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"state tensor names must be unique, got {names}")

    @property
    def row_words(self) -> tuple[int, ...]:
        return ()

    @property
    def words(self) -> int:
        return sum(t.numel * t.planes for t in self.tensors)

    def describe(self) -> str:
        return "state " + " ".join(f"{t.name}{list(t.shape)}:{t.dtype}" for t in self.tensors)


Geometry = MHA | MLA | StateGeometry


# ------------------------------------------------------------------------------ parts


@dataclasses.dataclass(frozen=True)
class Part:
    geometry: Geometry
    lifetime: Lifetime

    def __post_init__(self):
        is_state_geom = isinstance(self.geometry, StateGeometry)
        is_state_life = isinstance(self.lifetime, State)
        if is_state_geom != is_state_life:
            raise ValueError(
                f"part {self.geometry.describe()} with lifetime {self.lifetime}: state tensors need a "
                "State lifetime and attention rows need a Full or Window lifetime"
            )


@dataclasses.dataclass(frozen=True)
class LayerDecl:
    """Everything one layer stores: an attention part, a state part, or both.

    `layer` is the layer's index in its model; `model` names the model ("target", or a
    draft) so a fused draft's layers can share sub-pools with the target's.
    """

    layer: int
    parts: tuple[Part, ...]
    model: str = "target"

    def __post_init__(self):
        if not self.parts:
            raise ValueError(f"layer {self.layer} declares no parts")
        kinds = [type(p.lifetime) for p in self.parts]
        if kinds.count(State) > 1 or len(kinds) - kinds.count(State) > 1:
            raise ValueError(f"layer {self.layer}: at most one attention part and one state part")


# ---------------------------------------------------------------------- conveniences


def full_attention(layer: int, num_kv_heads: int, head_dim: int, v_head_dim: int | None = None, *,
                   dtype: str = "bfloat16", **kw) -> LayerDecl:
    """Full-lifetime K/V rows; `dtype` is what the K/V are stored as (pass the engine's kv_dtype)."""
    return LayerDecl(layer, (Part(MHA(num_kv_heads, head_dim, v_head_dim, dtype), Full()),), **kw)


def window_attention(layer: int, window: int, num_kv_heads: int, head_dim: int, v_head_dim: int | None = None, *,
                     dtype: str = "bfloat16", **kw) -> LayerDecl:
    """K/V rows of the last `window` tokens; `dtype` as in full_attention."""
    return LayerDecl(layer, (Part(MHA(num_kv_heads, head_dim, v_head_dim, dtype), Window(window)),), **kw)


def recurrent_state(layer: int, tensors: tuple[StateTensor, ...], checkpoint_interval: int = 0, **kw) -> LayerDecl:
    return LayerDecl(layer, (Part(StateGeometry(tuple(tensors)), State(checkpoint_interval)),), **kw)


def mamba2_state_tensors(
    num_heads: int, head_dim: int, state_size: int, n_groups: int, conv_kernel: int, conv_dtype: str = "bfloat16"
) -> tuple[StateTensor, ...]:
    """Mamba2 per-request state: the conv window over x|B|C and the SSM state (fp32)."""
    conv_dim = num_heads * head_dim + 2 * n_groups * state_size
    return (
        StateTensor("conv", (conv_kernel - 1, conv_dim), conv_dtype),
        StateTensor("ssm", (num_heads, head_dim, state_size), "float32"),
    )


def gated_deltanet_state_tensors(
    num_k_heads: int, num_v_heads: int, k_head_dim: int, v_head_dim: int, conv_kernel: int, conv_dtype: str = "bfloat16"
) -> tuple[StateTensor, ...]:
    """Gated DeltaNet per-request state: the conv window over q|k|v and the recurrent matrix (fp32).

    The recurrent matrix is stored *transposed* against Hugging Face's cache ([Hv, Dk, Dv] there):
    ``recurrent[h, v, k] = S_h[k, v]``.  The decode kernel splits a head over v (the columns of
    S are independent; every update reduces over k), so with v-major storage each program's
    [block_v, Dk] tile is one contiguous run of words, as Mamba2's [P, N] tiles are.
    """
    conv_dim = 2 * num_k_heads * k_head_dim + num_v_heads * v_head_dim
    return (
        StateTensor("conv", (conv_kernel - 1, conv_dim), conv_dtype),
        StateTensor("recurrent", (num_v_heads, v_head_dim, k_head_dim), "float32"),
    )


# --------------------------------------------------------------------------- state dtype

# The recurrent state's storage dtype (vLLM --mamba-ssm-cache-dtype, SGLang --mamba-ssm-dtype; the
# checkpoint's config.json: Qwen3.5 `mamba_ssm_dtype`, NemotronH `mamba_ssm_cache_dtype`).  "auto":
# the checkpoint's, else float32.  The kernels compute in fp32 whatever is stored; a 16-bit state is
# one plane instead of two (half the state bytes), rounded once per token.
MAMBA_SSM_DTYPES = ("auto", "float32", "bfloat16", "float16")
SSM_STATE_TENSORS = ("ssm", "recurrent")  # Mamba2's SSM state, gated DeltaNet's recurrent matrix


def mamba_ssm_dtype(name: str, checkpoint: str | None = None) -> str:
    """The SSM / DeltaNet state dtype an engine option names: "auto" -> the checkpoint config's
    (`checkpoint`, None when it names none), else "float32"; the others as given."""
    for value, what in ((name, "mamba_ssm_dtype"), (checkpoint, "the checkpoint's mamba_ssm_dtype")):
        if value is not None and value not in MAMBA_SSM_DTYPES:
            raise ValueError(f"{what} must be one of {MAMBA_SSM_DTYPES}, got {value!r}")
    if name != "auto":
        return name
    return checkpoint if checkpoint not in (None, "auto") else "float32"


def with_ssm_dtype(decls: list[LayerDecl], dtype: str) -> list[LayerDecl]:
    """`decls` with every layer's recurrent state tensor (SSM_STATE_TENSORS; not the conv window,
    which is stored like K/V) stored as `dtype` ("float32", "bfloat16" or "float16")."""
    if dtype not in MAMBA_SSM_DTYPES[1:]:
        raise ValueError(f"the SSM state dtype must be one of {MAMBA_SSM_DTYPES[1:]}, got {dtype!r}")

    def part(p: Part) -> Part:
        if not isinstance(p.geometry, StateGeometry):
            return p
        tensors = tuple(dataclasses.replace(t, dtype=dtype) if t.name in SSM_STATE_TENSORS else t
                        for t in p.geometry.tensors)
        return dataclasses.replace(p, geometry=StateGeometry(tensors))

    return [dataclasses.replace(d, parts=tuple(part(p) for p in d.parts)) for d in decls]
