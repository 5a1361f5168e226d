"""The build chain of an engine: model -> plan -> size -> allocator -> demand -> scheduler -> runner.

    parts = build(EngineConfig(model="tiny", arena_bytes=8 << 20))

Order matters: the model is split over the devices and its projections fused before the plan
is made (the plan and the arena bytes are per device), and the weights are on the device before
the arena is sized from what memory is left.
"""

from __future__ import annotations

import dataclasses
import logging

import jax

from ..core.scheduled_batch import Buckets
from ..memory import ChainAllocator, size_arena, static_regions
from ..memory import plan as make_plan
from ..memory.demand import DemandModel
from ..memory.sizing import ArenaSize, ArenaSizeError, budget_bytes, check_bs1_floor
from ..runner.runner import Runner
from ..scheduler.scheduler import Scheduler, SchedulerConfig
from .config import EngineConfig
from .tokenizer import get_tokenizer

log = logging.getLogger("umem_jax")

DEFAULT_CPU_ARENA_BYTES = 64 << 20  # no memory_stats() on CPU: a fixed budget unless arena_bytes is given


@dataclasses.dataclass
class EngineParts:
    """What `build` makes; LLMEngine keeps each part as an attribute of the same name."""

    model: object
    plan: object
    max_model_len: int
    size: ArenaSize
    regions: dict | None  # static mode: each sub-pool's fixed region; None in unified mode
    allocator: ChainAllocator
    buckets: Buckets
    demand: DemandModel
    scheduler: Scheduler
    tokenizer: object | None
    eos_ids: set[int]
    runner: Runner


def build(cfg: EngineConfig) -> EngineParts:
    """Every part of an engine for `cfg`, in dependency order.  Raises ValueError for settings
    the model or the buckets cannot serve."""
    model = prepared_model(cfg)
    mc = model.config
    kv = cfg.kv_cache_dtype if cfg.kv_cache_dtype != "auto" else (
        mc.dtype if mc.dtype in ("float32", "bfloat16") else "bfloat16")
    plan = make_plan(model.decls(kv), page_size=cfg.page_size)
    max_model_len = int(cfg.max_model_len or mc.max_position_embeddings)
    if max_model_len > mc.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                         f"{mc.max_position_embeddings}")
    size = size_arena(plan, arena_budget(cfg, plan))
    regions = None
    if cfg.memory_mode == "static":
        regions = static_regions(plan, size.num_rows, swa_full_tokens_ratio=cfg.swa_full_tokens_ratio,
                                 mamba_full_memory_ratio=cfg.mamba_full_memory_ratio)
    allocator = ChainAllocator(plan, size.num_rows, static_regions=regions)
    buckets = step_buckets(cfg, max_model_len)
    chunk = min(cfg.max_num_batched_tokens, buckets.tokens[-1])
    empty = ChainAllocator(plan, size.num_rows, static_regions=regions)  # the demand model's picture of an idle arena
    demand = DemandModel(plan, chunk=chunk, empty=empty, extra_state_slots=cfg.extra_state_slots)
    scheduler = Scheduler(scheduler_config(cfg, plan, buckets), allocator, demand)
    tokenizer = get_tokenizer(model, cfg.tokenizer)
    eos = mc.eos_token_id
    eos_ids = set(eos if isinstance(eos, (tuple, list)) else ([] if eos is None else [eos]))
    if tokenizer is not None:
        eos_ids |= set(tokenizer.eos_token_ids)
    runner = Runner(model, plan, size.num_rows, allocator, buckets, impl=cfg.kernel_impl, interpret=cfg.interpret,
                    debug_nan=cfg.debug_nan, checkpoints=cfg.enable_prefix_caching)
    _warn_floor(cfg, plan, size, max_model_len, regions)
    return EngineParts(model, plan, max_model_len, size, regions, allocator, buckets, demand, scheduler, tokenizer,
                       eos_ids, runner)


def prepared_model(cfg: EngineConfig):
    """The model as the engine serves it: loaded, split over `tensor_parallel_size` devices (from
    here on the model, plan and arena bytes are per device), its projections fused."""
    model = _load(cfg)
    if cfg.tensor_parallel_size > 1:
        from ..models.sharded_model import shard_model

        model = shard_model(model, cfg.tensor_parallel_size)
    if cfg.fuse_projections:  # a model this engine made is donated: its unfused weights are not kept
        model = model.fuse_projections(donate=model is not cfg.model)
    return model


def arena_budget(cfg: EngineConfig, plan) -> int:
    """Bytes the arena may take: cfg.arena_bytes, else a fixed CPU budget, else what the device
    has left after the weights (which are loaded by now: bytes_in_use counts them)."""
    if cfg.arena_bytes is not None:
        return budget_bytes(fixed_bytes=int(cfg.arena_bytes), plan=plan)
    if jax.devices()[0].memory_stats() is None:
        return budget_bytes(fixed_bytes=DEFAULT_CPU_ARENA_BYTES, plan=plan)
    return budget_bytes(fraction=cfg.gpu_memory_utilization, plan=plan,
                        reserve_bytes=_reserve(cfg.gpu_memory_utilization))


def step_buckets(cfg: EngineConfig, max_model_len: int) -> Buckets:
    """The step shapes: cfg's buckets where given, else powers of two up to the limits."""
    max_pages = -(-max_model_len // cfg.page_size)
    default = Buckets.default(cfg.max_num_seqs, cfg.max_num_batched_tokens, max_pages)
    buckets = Buckets(tuple(cfg.batch_buckets or default.batch), tuple(cfg.token_buckets or default.tokens),
                      tuple(cfg.page_buckets or default.pages))
    if buckets.pages[-1] < max_pages:
        raise ValueError(f"page_buckets top out at {buckets.pages[-1]} pages; max_model_len={max_model_len} needs "
                         f"{max_pages}")
    return buckets


def scheduler_config(cfg: EngineConfig, plan, buckets: Buckets) -> SchedulerConfig:
    interval = cfg.checkpoint_interval
    if interval is None:
        interval = plan.state.lifetime.checkpoint_interval if plan.state is not None else 0
    return SchedulerConfig(min(cfg.max_num_seqs, buckets.batch[-1]), cfg.max_num_batched_tokens, buckets,
                           new_token_ratio=cfg.new_token_ratio, max_prefill_streak=cfg.max_prefill_streak,
                           enable_prefix_caching=cfg.enable_prefix_caching,
                           max_checkpoints_per_path=cfg.max_checkpoints_per_path,
                           checkpoint_interval=int(interval))


def _warn_floor(cfg: EngineConfig, plan, size: ArenaSize, max_model_len: int, regions) -> None:
    try:
        check_bs1_floor(plan, size.num_rows, max_model_len=max_model_len, checkpoint_slots=cfg.extra_state_slots,
                        static_regions=regions)
    except ArenaSizeError as e:  # not fatal: the memory clip refuses or shortens what does not fit
        log.warning("%s", e)


def _reserve(fraction: float) -> int:
    """Bytes kept out of the arena for the step's temporaries (activations, logits, sampler
    sort): 1/16 of what is left after the weights, at most 4 GiB.  A heuristic: measuring the
    compiled steps (sizing.compiled_temp_bytes) would need them compiled before the arena exists."""
    stats = jax.devices()[0].memory_stats() or {}
    left = int(stats.get("bytes_limit", 0)) * fraction - int(stats.get("bytes_in_use", 0))
    return int(min(max(left, 0) // 16, 4 << 30))


def _load(cfg: EngineConfig):
    """A Model from cfg.model: a Model as is, a built-in name, a path; load_format="dummy" gives
    random weights of the checkpoint's shapes (no weights read)."""
    from ..models import loader
    from ..models.model import Model

    if isinstance(cfg.model, Model):
        return cfg.model
    name = loader.HF_NAMES.get(str(cfg.model), str(cfg.model))  # "google/gemma-3-270m" is the built-in
    if cfg.load_format == "dummy" and name not in ("tiny", "tiny-attention"):
        from pathlib import Path

        from flax import nnx

        from ..models.registry import load_hf_config, model_class

        path = Path(name)
        if name == loader.DEFAULT_MODEL:
            path = loader.convert_gguf(loader.fetch_default_model())
        mc = load_hf_config(path)
        if cfg.dtype is not None:
            mc = dataclasses.replace(mc, dtype=cfg.dtype)
        model = Model.from_module(model_class(mc.architecture)(mc, rngs=nnx.Rngs(cfg.seed)))
        tok = path / "tokenizer.json"
        model.tokenizer_path = tok if tok.exists() else None
        return model
    return loader.load_model(name, dtype=cfg.dtype)


__all__ = ["DEFAULT_CPU_ARENA_BYTES", "EngineParts", "build"]
