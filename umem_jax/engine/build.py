"""The build chain of an engine: model -> plan -> fit (arena size, demand, max_model_len: fit.py)
-> allocator -> scheduler -> runner.

    parts = build(EngineConfig(model="tiny", arena_bytes=8 << 20))

Order matters: the model is split over the devices and its projections fused before the plan
is made (the plan and the arena bytes are per device), and the weights are on the device before
the arena is sized from what memory is left; max_model_len is settled with the arena, so one
request of it always fits (fit.py).
"""

from __future__ import annotations

import dataclasses

from ..core.scheduled_batch import Buckets
from ..memory import ChainAllocator
from ..memory import plan as make_plan
from ..memory.declarations import kv_cache_dtype, with_ssm_dtype
from ..memory.demand import DemandModel
from ..memory.sizing import ArenaSize
from ..memory.plan import PlanError
from ..runner.runner import Runner
from ..runner.mtp import MTPSpeculator
from ..runner.speculative import Speculator
from ..scheduler.scheduler import Scheduler, SchedulerConfig
from . import startup, state_dtype
from .config import EngineConfig
from .fit import CPU_ARENA_BYTES, fit_context
from .speculative import SpeculationError, cache_lookahead, check_config, load_draft, plan_decls, speculative_demand
from .tokenizer import get_tokenizer
from .warmup import release_host_memory

DEFAULT_CPU_ARENA_BYTES = CPU_ARENA_BYTES  # the least default CPU arena; fit.py sizes it up to hold the context


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
    draft: object = None  # the speculative draft Model or MTP head (None: speculation off)


def build(cfg: EngineConfig) -> EngineParts:
    """Every part of an engine for `cfg`, in dependency order.  Raises ValueError for settings
    the model or the buckets cannot serve."""
    _convert_once(cfg)
    if cfg.speculative_config is not None:
        check_config(cfg)  # before the target is split: what needs no model is refused first
    with startup.phase(f"loading the weights of {_name(cfg)}"):
        model = prepared_model(cfg)
        release_host_memory()  # the loader's and the fusion's temporaries
    mc = model.config
    kv = kv_cache_dtype(cfg.kv_cache_dtype, mc.dtype)  # "auto": the weights' dtype; "fp8": float8 e4m3
    spec = cfg.speculative_config
    draft = load_draft(cfg, model) if spec is not None else None
    plan = _plan(model, draft, kv, cfg.page_size, state_dtype.resolve(cfg, model))
    context = mc.max_position_embeddings if draft is None else min(mc.max_position_embeddings,
                                                                   draft.config.max_position_embeddings)
    if cfg.max_model_len is not None and cfg.max_model_len > context:
        raise ValueError(f"max_model_len={cfg.max_model_len} exceeds the model's max_position_embeddings={context}")
    if cfg.max_model_len is None and cfg.page_buckets:  # the longest request the given page buckets can run
        context = min(context, max(cfg.page_buckets) * cfg.page_size)
    tokens = cfg.token_buckets or Buckets.default(cfg.max_num_seqs, cfg.max_num_batched_tokens, 1).tokens
    demand_kw = speculative_demand(cfg, plan) if spec is not None else None
    fitted = fit_context(cfg, plan, context, chunk=min(cfg.max_num_batched_tokens, max(tokens)), demand_kw=demand_kw)
    size, regions, demand, max_model_len = fitted.size, fitted.regions, fitted.demand, fitted.max_model_len
    allocator = ChainAllocator(plan, size.num_rows, static_regions=regions)
    buckets = step_buckets(cfg, max_model_len)
    scheduler = Scheduler(scheduler_config(cfg, plan, buckets), allocator, demand)
    tokenizer = get_tokenizer(model, cfg.tokenizer)
    eos = mc.eos_token_id
    eos_ids = set(eos if isinstance(eos, (tuple, list)) else ([] if eos is None else [eos]))
    if tokenizer is not None:
        eos_ids |= set(tokenizer.eos_token_ids)
    runner = Runner(model, plan, size.num_rows, allocator, buckets, impl=cfg.kernel_impl, interpret=cfg.interpret,
                    debug_nan=cfg.debug_nan, checkpoints=cfg.enable_prefix_caching)
    if draft is not None:
        cls = MTPSpeculator if spec.method == "mtp" else Speculator
        runner.speculator = cls(runner, draft, spec.num_speculative_tokens)
        runner.plain_decode = spec.min_acceptance > 0  # requests may stop speculating: plain decode steps too
    return EngineParts(model, plan, max_model_len, size, regions, allocator, buckets, demand, scheduler, tokenizer,
                       eos_ids, runner, draft)


def _plan(model, draft, kv: str, page_size: int, ssm: str = "float32"):
    """The target's plan, or the target's and the draft's layers planned as one model; recurrent
    state stored as `ssm` (state_dtype.resolve: the option, else the checkpoint's, else fp32)."""
    if draft is None:
        return make_plan(with_ssm_dtype(model.decls(kv), ssm), page_size=page_size)
    try:
        return make_plan(with_ssm_dtype(plan_decls(model.decls(kv), draft, kv), ssm), page_size=page_size)
    except PlanError as e:
        raise SpeculationError(f"the draft's layers cannot be placed beside the target's: {e}") from None


def prepared_model(cfg: EngineConfig):
    """The model as the engine serves it: loaded, split over `tensor_parallel_size` devices (from
    here on the model, plan and arena bytes are per device), its projections fused."""
    model = _load(cfg)
    if cfg.enable_expert_parallel and getattr(model.config, "moe", None) is None:
        opt = "--enable-expert-parallel" if cfg.interface == "cli" else "enable_expert_parallel=True"
        raise ValueError(f"{opt} splits MoE experts over the devices; {model.config.architecture} has no MoE layers "
                         "(leave it off)")
    if cfg.tensor_parallel_size > 1:
        from ..models.sharded_model import shard_model

        model = shard_model(model, cfg.tensor_parallel_size, expert_parallel=cfg.enable_expert_parallel)
    if cfg.fuse_projections:  # a model this engine made is donated: its unfused weights are not kept
        model = model.fuse_projections(donate=model is not cfg.model)
    return model


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
    interval, spec = cfg.checkpoint_interval, cfg.speculative_config
    if interval is None:
        interval = plan.state.lifetime.checkpoint_interval if plan.state is not None else 0
    return SchedulerConfig(min(cfg.max_num_seqs, buckets.batch[-1]), cfg.max_num_batched_tokens, buckets,
                           new_token_ratio=cfg.new_token_ratio, max_prefill_streak=cfg.max_prefill_streak,
                           exact_fixed_length_reservation=cfg.exact_fixed_length_reservation,
                           early_admission=cfg.early_admission, joint_admission=cfg.joint_admission,
                           enable_prefix_caching=cfg.enable_prefix_caching,
                           max_checkpoints_per_path=cfg.max_checkpoints_per_path,
                           checkpoint_interval=int(interval),
                           num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
                           cache_lookahead=cache_lookahead(spec))


def _name(cfg: EngineConfig) -> str:
    from ..models.model import Model

    return "the given Model" if isinstance(cfg.model, Model) else str(cfg.model)


def _convert_once(cfg: EngineConfig) -> None:
    """A GGUF (the built-in model's, or a .gguf path) not converted yet is converted here, as a
    start-up phase of its own: it takes minutes once, then its conversion is read back."""
    from ..models import loader

    name = loader.HF_NAMES.get(_name(cfg), _name(cfg))
    if name == loader.DEFAULT_MODEL and not loader.converted(loader.DEFAULT_MODEL):
        with startup.phase(f"converting the {name} GGUF once (1-3 min on 2 cores; kept in {loader.cache_dir()})"):
            loader.convert_gguf(loader.fetch_default_model())
    elif name.endswith(".gguf") and not loader.converted(name):
        with startup.phase(f"converting {name} once (kept in {loader.cache_dir()})"):
            loader.convert_gguf(name)


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
