"""EngineConfig: every engine option, with vLLM / SGLang names where they exist."""

from __future__ import annotations

import dataclasses
import math
import numbers


# weight dtype names (vLLM's --dtype values and short forms) -> ours; "auto": the checkpoint's
_WEIGHT_DTYPES = {"auto": None, "float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16",
                  "bf16": "bfloat16"}


@dataclasses.dataclass
class EngineConfig:
    """Engine options, vLLM / SGLang names where they exist."""

    model: object = "tiny"  # a path, a built-in name ("tiny", the default Gemma 3 name) or a loaded Model
    tokenizer: str | None = None
    memory_mode: str = "unified"  # "unified": one arena, bands move | "static": fixed pools by the ratios
    swa_full_tokens_ratio: float = 0.8
    mamba_full_memory_ratio: float = 0.9
    gpu_memory_utilization: float = 0.9
    arena_bytes: int | None = None  # arena bytes per device (each TP shard its own); None: free GPU memory / fit.py
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # prefill tokens per step, and the longest chunk
    page_size: int = 16
    max_model_len: int | None = None  # None: the model's context, or the longest one request can hold in the arena
    dtype: str | None = None  # weights; default: the checkpoint's
    kv_cache_dtype: str = "auto"  # "auto" (the weight dtype if bf16/fp32, else bf16), "bfloat16", "float32",
    #   "fp8" / "fp8_e4m3" (float8 e4m3 K/V, two per 16-bit word; scales from the checkpoint, else 1.0)
    mamba_ssm_dtype: str = "auto"  # recurrent (Mamba2 SSM / gated DeltaNet) state: "float32" (two 16-bit planes),
    #   "bfloat16" / "float16" (one plane: half the state bytes, still computed in fp32); "auto": what the
    #   checkpoint's config.json names (mamba_ssm_dtype / mamba_ssm_cache_dtype), else float32 (vLLM's
    #   --mamba-ssm-cache-dtype)
    load_format: str = "auto"  # "auto" | "dummy" (random weights of the checkpoint's shape)
    seed: int = 0
    kernel_impl: str | None = None  # "pallas" | "reference"; default: pallas on GPU, reference elsewhere
    interpret: bool = False
    batch_buckets: tuple[int, ...] | None = None
    token_buckets: tuple[int, ...] | None = None
    page_buckets: tuple[int, ...] | None = None
    new_token_ratio: float = 0.5
    # fixed-length requests (ignore_eos, no stop strings / stop token ids) reserve exactly what they
    # will take (DemandModel.decode_peak) instead of new_token_ratio of it: no retraction among them,
    # never more than needed.  Off: the ratio rule for every request (to measure against, or to
    # force retraction in tests).  Speculative decoding keeps the ratio either way.
    exact_fixed_length_reservation: bool = True
    # a long prompt whose whole need does not fit yet may start its prefill in the bytes no running
    # request is owed, and wait there for the rest (scheduler/early_start.py); off: it waits in the
    # queue.  On an H100 at 4B scale (session 32) it raised Qwen3.5's live share where memory binds
    # to 0.98-0.99 at -1.1% to +1.9% of the throughput (docs/memory.md); off in session 31, when
    # evicting the cache for its shortest pass cost 5-17%
    early_admission: bool = True
    # a fixed-length request whose one pass completes its prompt is admitted against the joint peak
    # of the fixed-length decoders and itself (scheduler/admission.py); off: its own peak added to theirs
    joint_admission: bool = True
    max_prefill_streak: int = 4
    extra_state_slots: int = 0  # state slots per request beyond its working slot (priced at admission)
    enable_prefix_caching: bool = True  # share cached prefixes (vLLM's default)
    max_checkpoints_per_path: int | None = 4  # state checkpoints kept on one cached path (None: no cap)
    checkpoint_interval: int | None = None  # decode tokens between state checkpoints (None: the model's)
    async_scheduling: bool = True
    check_at_idle: bool = True
    debug_nan: bool = False
    tensor_parallel_size: int = 1  # devices the model and the arena are split over (KV / state heads)
    # MoE layers' routed experts split whole over those devices instead of by their width (vLLM's
    # --enable-expert-parallel; models/sharding.py): for many narrow experts (Qwen3.5-MoE's 512 columns)
    enable_expert_parallel: bool = False
    fuse_projections: bool = True  # one matmul per group of projections reading one input (models/model.py)
    priority_range: tuple[int, int] = (-(2**31), 2**31 - 1)  # a request's priority must lie in it (ValueError)
    speculative_config: object = None  # None (off) | SpeculativeConfig | its fields as a dict (vLLM's)
    interface: str = "python"  # what advice in messages names: "python" keywords (arena_bytes=) | "cli" flags

    def __post_init__(self):
        if self.memory_mode not in ("unified", "static"):
            raise ValueError(f"memory_mode must be 'unified' or 'static', got {self.memory_mode!r}")
        if self.interface not in ("python", "cli"):
            raise ValueError(f"interface must be 'python' or 'cli', got {self.interface!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        for name, lo, optional in (("max_num_seqs", 1, False), ("max_num_batched_tokens", 1, False),
                                   ("page_size", 1, False), ("tensor_parallel_size", 1, False),
                                   ("max_prefill_streak", 1, False), ("extra_state_slots", 0, False),
                                   ("max_model_len", 1, True), ("arena_bytes", 1, True),
                                   ("checkpoint_interval", 1, True), ("max_checkpoints_per_path", 0, True)):
            v = getattr(self, name)
            if optional and v is None:
                continue
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}{' (or None)' if optional else ''}, got {v!r}")
        for name in ("swa_full_tokens_ratio", "mamba_full_memory_ratio"):  # shares of the arena (sizing.py)
            v = getattr(self, name)
            if not isinstance(v, numbers.Real) or isinstance(v, bool) or not 0 < v < math.inf:
                raise ValueError(f"{name} must be a number > 0, got {v!r}")
        if not isinstance(self.new_token_ratio, numbers.Real) or not 0 <= self.new_token_ratio <= 1:
            raise ValueError(f"new_token_ratio must be in [0, 1], got {self.new_token_ratio!r}")
        if self.kernel_impl not in (None, "pallas", "reference"):
            raise ValueError(f"kernel_impl must be 'pallas', 'reference' or None (pallas on a GPU, reference "
                             f"elsewhere), got {self.kernel_impl!r}")
        self.dtype = _WEIGHT_DTYPES.get(self.dtype, self.dtype) if isinstance(self.dtype, str) else self.dtype
        if self.dtype is not None and self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16 (vLLM's aliases too: float, half, bf16, "
                             f"fp16, fp32), or auto / None for the checkpoint's, got {self.dtype!r}")
        lo, hi = self.priority_range
        if not (isinstance(lo, int) and isinstance(hi, int) and lo <= 0 <= hi):
            raise ValueError(f"priority_range must be two ints (min, max) with min <= 0 <= max (0: the priority of "
                             f"a request that gives none), got {self.priority_range}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        from ..memory.declarations import kv_cache_dtype, mamba_ssm_dtype

        kv_cache_dtype(self.kv_cache_dtype)  # raises ValueError naming the accepted values
        mamba_ssm_dtype(self.mamba_ssm_dtype)  # likewise
        if isinstance(self.speculative_config, dict):
            # fields vLLM's SpeculativeConfig has and this one lacks (draft_tensor_parallel_size ...):
            # refused naming them, as the CLI's --speculative-config is, not as a dataclass TypeError
            known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
            unknown = sorted(set(self.speculative_config) - known)
            if unknown:
                raise ValueError(f"speculative_config fields {unknown} are not supported (known: {sorted(known)})")
            self.speculative_config = SpeculativeConfig(**self.speculative_config)
        if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            raise ValueError(f"speculative_config must be a SpeculativeConfig or a dict of its fields, got "
                             f"{type(self.speculative_config).__name__}")


SPECULATIVE_METHODS = ("draft", "mtp")
MAX_SPECULATIVE_TOKENS = 8


@dataclasses.dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM / SGLang names): `method` "draft" runs a separate small model
    `model` (a path, a built-in name or a loaded Model) that proposes `num_speculative_tokens`
    tokens the target verifies in one forward.  "mtp" (SGLang's NEXTN) drafts with the target's
    own MTP layers (models/mtp.py), read from the target's checkpoint directory, or from `model`
    when given (a checkpoint directory, or an MTP head Model loaded by models.mtp.load_head)."""

    method: str = "draft"
    num_speculative_tokens: int = 3
    model: object = None  # the draft: a path, a built-in name or a loaded Model (mtp: optional, see above)
    # A request whose drafts are accepted at a lower rate than this, over its first `probe_steps`
    # verifies and on, stops speculating and decodes plainly (asynchronously, when no running
    # request speculates): where drafts do not pay, the verify and the draft cost more than they
    # save.  0 keeps every request speculating.
    min_acceptance: float = 0.3
    probe_steps: int = 8

    def __post_init__(self):
        from .speculative_flags import method_name

        self.method = method_name(self.method)  # vLLM's "draft_model", SGLang's "NEXTN" ... -> ours
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens  # a bool is an int to Python, never a count here
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an int in 1..{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        a = self.min_acceptance
        if not isinstance(a, numbers.Real) or isinstance(a, bool) or not 0.0 <= a <= 1.0:
            raise ValueError(f"min_acceptance must be a number in [0, 1], got {a!r}")
        if not isinstance(self.probe_steps, int) or isinstance(self.probe_steps, bool) or self.probe_steps < 1:
            raise ValueError(f"probe_steps must be an int >= 1, got {self.probe_steps!r}")
        if self.model is None and self.method == "draft":
            raise ValueError("speculative method 'draft' needs the draft model (speculative_config model= / "
                             "--speculative-draft-model PATH)")


__all__ = ["EngineConfig", "SpeculativeConfig"]
