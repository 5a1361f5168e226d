"""Runner: turns a scheduled batch into ONE jitted step over the arena, and owns the arena.

Each step's inputs besides the weights travel as one flat int32 array (`meta`: the padded
tokens, lengths, physical page tables of every token sub-pool, state slots and prefix-cache
checkpoints, sampling parameters with floats bit-cast into int32 words, banned token ids),
built on the host with numpy from the row cache and sent in ONE host->device transfer
(packing.py).  The step (`step`, below) is launched without waiting: JAX dispatch is
asynchronous, so the host packs step N+1 while the device runs step N.

The step, one jitted function per padded shape:

    tokens [max_batch] int32, arena = jit_step(params, arena, meta, prev, counts, layout=..., model=...)

`meta` is the packed int32 metadata `layout` describes (packing.Layout); `prev` is the previous
step's output, still on the device: a decode row whose input token that step sampled takes it
from there (`src` column), so the host launches step N+1 before reading step N's tokens and the
device never waits for the host between steps.  The arena is donated: XLA updates it in place.
Neither the step nor the sampler holds a conditional (see sampler.py), so nothing in it makes the
host wait.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..arena import Arena, apply_moves
from ..core.batch import Batch
from ..core.scheduled_batch import CHECKPOINTS_PER_ROW, Buckets, ScheduledBatch
from ..memory.chain import ChainAllocator
from ..pallas_kernels.dispatch_plan import PLAN_ENV
from ..pallas_kernels.expert_gemv import PROLOGUE_ENV
from ..pallas_kernels.paged_decode import DECODE_ENV
from ..pallas_kernels.paged_prefill import BLOCK_K_ENV, PREFILL_ENV
from ..pallas_kernels.rms_norm import NORM_ENV
from ..pallas_kernels.route_topk import ROUTE_ENV, ROUTER_DOT_ENV
from ..pallas_kernels.short_extend import SHORT_EXTEND_ENV
from .packing import Layout, RowCache, RowEntry, logit_bias_bucket, pack, penalty_counts
from .sampler import LOGPROB_BUCKETS, MODES, logprob_bucket, sample, sample_with_penalties, token_logprobs
from .xla_log import quiet_xla_alarms

_SAMPLER_ARGS = ("temperature", "top_k", "top_p", "min_p", "seed", "step", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")


@dataclasses.dataclass(frozen=True, eq=False)
class StepModel:
    """The model half of the step's static arguments: its forward over the arena and the
    structure of its params.  Hashed by identity, and made once per (model graph, params
    structure, plan, kernels, mesh) by `step_model`, so engines on one model share every
    compiled step."""

    forward: Callable  # forward(params, arena, Batch) -> (logits [B, V] fp32, arena)
    treedef: Any  # the params' pytree structure: the step takes them as their flat list of leaves


_STEP_MODELS: dict = {}


# The environment variables the kernels read when a step is traced.
TRACE_ENV = (PREFILL_ENV, BLOCK_K_ENV, DECODE_ENV, SHORT_EXTEND_ENV, ROUTE_ENV, NORM_ENV, PROLOGUE_ENV, PLAN_ENV,
             ROUTER_DOT_ENV)


def step_key(*parts) -> tuple:
    """The key of a cached step object (this module's, speculative.py's, mtp.py's): `parts` and
    TRACE_ENV's values now.  JAX caches a trace by its function and static arguments, so a step
    object shared across a change of these variables would keep running the kernels chosen
    before it."""
    return (*parts, *(os.environ.get(name, "").strip().lower() for name in TRACE_ENV))


def step_model(model, plan, impl: str | None, interpret: bool, treedef, scores: int | None = None) -> StepModel:
    """The StepModel of `model` (whose params flatten to `treedef`) over `plan`'s arena; with
    `scores` (k), one whose forward also scores every token (prompt logprobs, k alternatives)."""
    key = step_key(model.graphdef, treedef, plan, impl, interpret, getattr(model, "mesh", None), scores)
    got = _STEP_MODELS.get(key)
    if got is None:
        kw = {} if scores is None else {"per_token": _scorer(scores)}
        got = _STEP_MODELS[key] = StepModel(model.forward_fn(plan, impl=impl, interpret=interpret, **kw), treedef)
    return got


@functools.cache
def _scorer(k: int) -> Callable:
    """token_logprobs with k alternatives, one object per k (a forward's option: its identity keys the trace)."""
    return functools.partial(token_logprobs, k=k)


def step(params: list, arena, meta: jax.Array, prev: jax.Array, counts, *, layout: Layout,
         model: StepModel) -> tuple[jax.Array, Any]:
    """One step -> (tokens [max_batch] int32, rows past B zero; the arena), and for a layout with
    logprobs a third item: sampler.token_logprobs of the B rows (the step is otherwise the same);
    for one with prompt_logprobs (and `model` made with scores) one more: token_logprobs of every
    token [B, T] against the token after it (`targets`; the chunk's last one: `next`).

    params: the flat list of leaves (flattening the NNX State on every call is Python work per
    leaf; a flat list is flattened by the C++ dispatch path).  counts: (prompt, output) token
    counts, each [B, V] f32, for a layout with penalties, else None."""
    params = jax.tree.unflatten(model.treedef, params)
    f = layout.unpack(meta)
    tokens, src = f["tokens"], f["src"]
    fed = jnp.take(prev, jnp.clip(src, 0, prev.shape[0] - 1))
    tokens = tokens.at[:, 0].set(jnp.where(src >= 0, fed, tokens[:, 0]))
    batch = Batch(tokens, f["q_lens"], f["kv_lens"], {p: f[f"table:{p}"] for p in layout.pools}, f["slots"],
                  f.get("checkpoint_positions"), f.get("checkpoint_slots"))
    scores = None
    if layout.prompt_logprobs is not None:
        after = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
        last = jnp.arange(layout.T)[None, :] == f["q_lens"][:, None] - 1
        batch = batch.replace(targets=jnp.where(last, f["next"][:, None], after))
        (logits, scores), arena = model.forward(params, arena, batch)
    else:
        logits, arena = model.forward(params, arena, batch)
    raw = logits  # logprobs report the model's distribution, before biases, bans and penalties
    rows = jnp.arange(layout.B)[:, None]
    if layout.logit_bias:  # [B, columns] token ids (-1: none) and their biases, before the bans (these win)
        ids = jnp.where(f["bias_ids"] >= 0, f["bias_ids"], logits.shape[-1])  # none: out of range, dropped
        logits = logits.at[rows, ids].add(f["bias"].astype(logits.dtype), mode="drop")
        listed = jnp.zeros(logits.shape, bool).at[rows, ids].set(True, mode="drop")
        logits = jnp.where((f["bias_only"][:, None] > 0) & ~listed, -jnp.inf, logits)  # allowed_token_ids
    ban = f["ban"]  # [B, banned_per_row], -1 = none: min_tokens keeps stop tokens out
    logits = logits.at[rows, jnp.maximum(ban, 0)].min(jnp.where(ban >= 0, -jnp.inf, jnp.inf))
    sampling = [f[n] for n in _SAMPLER_ARGS]
    if layout.penalties:
        toks = sample_with_penalties(logits, counts[0], counts[1], *sampling, mode=layout.sampling)
    else:
        toks = sample(logits, *sampling, mode=layout.sampling)
    out = jnp.zeros((layout.max_batch,), jnp.int32).at[: layout.B].set(toks.astype(jnp.int32))
    extra = () if layout.logprobs is None else (token_logprobs(raw, toks, layout.logprobs),)
    return (out, arena, *extra) + (() if scores is None else (scores,))


jit_step = jax.jit(step, donate_argnums=(1,), static_argnames=("layout", "model"))


@dataclasses.dataclass
class Launched:
    """A step in flight: its output tokens (a device array, not read yet) and its rows."""

    batch: ScheduledBatch
    tokens: jax.Array
    logprobs: tuple | None = dataclasses.field(default=None, kw_only=True)  # sampler.token_logprobs, if asked
    prompt_logprobs: tuple | None = dataclasses.field(default=None, kw_only=True)  # [B, T, ...] scores, if asked


class Runner:
    def __init__(self, model, plan, num_rows: int, allocator: ChainAllocator, buckets: Buckets, *,
                 impl: str | None = None, interpret: bool = False, debug_nan: bool = False, banned_per_row: int = 16,
                 checkpoints: bool = False):
        self.model, self.plan, self.allocator, self.buckets = model, plan, allocator, buckets
        self.impl, self.interpret = impl, interpret
        self.pools = tuple(sp.name for sp in plan.token_pools)
        self.has_state = plan.state is not None
        # State checkpoint columns of a prefill step (decode steps take none).
        self.checkpoints_per_row = CHECKPOINTS_PER_ROW if checkpoints and self.has_state else 0
        self.vocab = model.config.vocab_size
        self.banned_per_row = banned_per_row
        self.max_batch = buckets.batch[-1]
        self.arena = Arena.create(plan, num_rows, debug_nan=debug_nan, mesh=getattr(model, "mesh", None))
        self._params_src = None  # the params pytree the flat leaves below come from
        self._leaves()
        self._prev = jnp.zeros((self.max_batch,), jnp.int32)
        if getattr(model, "mesh", None) is not None:  # as the step returns it, so the first step's shape is reused
            self._prev = jax.device_put(self._prev, jax.sharding.NamedSharding(model.mesh, jax.sharding.PartitionSpec()))
        self._rows = RowCache(buckets.pages[-1], 2 * self.max_batch)
        self._layouts: dict[tuple, Layout] = {}
        self.shapes: set[Layout] = set()  # every step shape launched: each one compilation
        self._ready: set[Layout] = set()  # shapes launched or precompiled (a covering sampling mode is reused)
        self._compiles = False  # whether the launch being prepared compiles its step
        self.num_moved_pages = 0  # pages relocated by compaction / float moves
        self.num_compactions = 0  # batches of relocations applied (one per step at most)
        self.relocated_bytes = 0
        self.num_copied_slots = 0  # state slots copied (prefix-cache checkpoints saved / restored)
        self.speculator = None  # a speculative.Speculator: it launches every step (a draft model proposes)
        self.plain_decode = False  # with a speculator: plain decode steps run too (requests that stopped speculating)

    @property
    def num_compilations(self) -> int:
        """Distinct step shapes this runner launched (each compiled once, or found compiled by
        an engine on the same model).  A steady workload stops growing it."""
        return len(self.shapes)

    def _leaves(self) -> list:
        """The params as a flat list of arrays (re-flattened if model.params was replaced)."""
        if self.model.params is not self._params_src:
            self._params_src = self.model.params
            self._params, treedef = jax.tree.flatten(self._params_src)
            self._step_model = step_model(self.model, self.plan, self.impl, self.interpret, treedef)
            self._step = functools.partial(jit_step, model=self._step_model)  # (..., layout=) -> (tokens, arena)
            self._treedef = treedef
        return self._params

    def _model_for(self, lay: Layout) -> StepModel:
        """The StepModel a step of `lay` runs: the plain one, or one that scores its tokens."""
        if lay.prompt_logprobs is None:
            return self._step_model
        return step_model(self.model, self.plan, self.impl, self.interpret, self._treedef, lay.prompt_logprobs)

    def apply_moves(self, moves) -> None:
        """Relocations queued by the allocator, applied before the step that reads the pages."""
        if moves:
            self.arena = apply_moves(self.arena, moves, impl=self.impl, interpret=self.interpret)
            relocations = [m for m in moves if not m.copy]
            self.num_compactions += bool(relocations)
            self.num_moved_pages += sum(len(m) for m in relocations)
            self.relocated_bytes += sum(len(m) * m.rows_per_page for m in relocations) * self.allocator.row_bytes
            self.num_copied_slots += sum(len(m) for m in moves if m.copy)

    def layout(self, B: int, T: int, P: int, penalties: bool = False, checkpoints_per_row: int = 0,
               sampling: str = "greedy", logprobs: int | None = None, prompt_logprobs: int | None = None,
               logit_bias: int = 0) -> Layout:
        """The layout of one step shape, made once (it caches its padding template)."""
        key = (B, T, P, penalties, checkpoints_per_row, sampling, logprobs, prompt_logprobs, logit_bias)
        got = self._layouts.get(key)
        if got is None:
            got = self._layouts[key] = Layout(B, T, P, self.pools, self.max_batch, self.banned_per_row, penalties,
                                              checkpoints_per_row, sampling, logprobs, prompt_logprobs, logit_bias)
            got.template  # noqa: B018 - built (and its sampling block checked) on first use
        return got

    def lower(self, layout: Layout) -> jax.stages.Lowered:
        """The step of `layout` traced and lowered (not compiled) for this runner's arena."""
        return jit_step.lower(self._leaves(), self.arena, layout.template, self._prev, None, layout=layout,
                              model=self._model_for(layout))

    def precompile(self, shapes, threads: int = 8, sampling=("greedy",)) -> int:
        """Compile step shapes ahead of use -> how many executables.  shapes: (B, T, P,
        checkpoints per row) tuples (T=1: decode), each compiled in every sampler mode of
        `sampling` (sampler.MODES; a step whose rows need a mode that was not compiled runs in a
        compiled mode that covers it, else compiles).  With a speculator, what it launches for
        the shape instead (`Speculator.lower`: a draft model's decode is two jitted calls), and
        for a decode shape the plain step as well when requests may stop speculating.

        Each shape is traced and lowered here (Python, one at a time), then XLA compiles them on
        `threads` threads at once (compilation releases the GIL; a 4B model's step takes tens of
        seconds to compile, so a few dozen shapes one by one would take many minutes).  The
        compiled executables land in JAX's caches, so the first launch of each shape compiles
        nothing."""
        import concurrent.futures

        lowered = []
        for b, t, p, checkpoints_per_row in shapes:
            for mode in sampling:
                lay = self.layout(b, t, p, False, checkpoints_per_row, mode)
                if self.speculator is not None:  # as `launch` hands it every batch
                    lowered += self.speculator.lower(lay, decode=t == 1)
                    if t == 1 and self.plain_decode:
                        lowered.append(self.lower(lay))
                else:
                    lowered.append(self.lower(lay))
                self._ready.add(lay)
        with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
            list(pool.map(lambda low: low.compile(), lowered))
        return len(lowered)

    @property
    def prev_tokens(self) -> jax.Array:
        """The last launched step's sampled tokens, on the device: where decode rows whose input
        token is pending read it (`src`)."""
        return self._prev

    @prev_tokens.setter
    def prev_tokens(self, tokens: jax.Array) -> None:  # a step launched by the speculator
        self._prev = tokens

    def params_leaves(self) -> tuple[list, StepModel]:
        """(the target's params as a flat list of leaves, its StepModel), re-made if model.params
        was replaced: what a step launched outside `launch` (the speculator's) takes."""
        return self._leaves(), self._step_model

    def launch(self, batch: ScheduledBatch, prev: jax.Array | None = None) -> Launched:
        """Pack `batch` (after the scheduler allocated its memory and the moves were applied),
        launch the step without waiting, and mark the sampled tokens as pending.  prev: the
        tokens pending inputs are read from (default: `prev_tokens`; the engine passes the same
        ones to every part of a batch it relaunches in parts after a failure).

        Per row, Python only reads the request's counters; everything [B]- or [B, P]-shaped is
        built by numpy from the row cache, into one int32 buffer: the step's only host->device
        copy (handed to the jitted call as numpy, so the copy happens in its C++ dispatch)."""
        if self.speculator is not None and not (batch.kind == "decode" and batch.spec_lens is None):
            return self.speculator.launch(batch, prev)  # (a plain decode batch: no row speculates any more)
        rows = batch.rows
        lay, meta, counts = self.prepare(batch)
        if self.model.params is not self._params_src:
            self._leaves()
        with quiet_xla_alarms(self._compiles):  # a shape warm-up left out compiles here, on demand
            scoring = {} if lay.prompt_logprobs is None else {"model": self._model_for(lay)}
            prev = self._prev if prev is None else prev
            tokens, self.arena, *extra = self._step(self._params, self.arena, meta, prev, counts, layout=lay, **scoring)
        self._prev = tokens
        local = lambda x: x if x.is_fully_addressable else x.addressable_data(0)  # multi-host: this host's replica
        tokens = local(tokens)
        for i, row in enumerate(rows):
            if row.sample:
                row.req.mark_pending(i)
        lp = tuple(map(local, extra.pop(0))) if lay.logprobs is not None else None
        scores = tuple(map(local, extra.pop(0))) if lay.prompt_logprobs is not None else None
        return Launched(batch, tokens, logprobs=lp, prompt_logprobs=scores)

    def prepare(self, batch: ScheduledBatch) -> tuple[Layout, np.ndarray, np.ndarray | None]:
        """The host half of a launch, shared with the speculator: the rows' cache entries, the
        layout (marked compiled), the packed int32 buffer and the penalty counts (or None)."""
        rows = batch.rows
        entries = self._rows.gather([row.req for row in rows], rows)
        cache_rows = np.array([e.row for e in entries], np.intp)
        lay = self._pick_layout(batch, entries, cache_rows)
        meta = self._pack(batch, lay, cache_rows)
        counts = penalty_counts(rows, lay.B, self.vocab) if lay.penalties else None
        self.shapes.add(lay)
        self._compiles = lay not in self._ready  # this launch compiles its step (no precompile, no launch before)
        self._ready.add(lay)
        return lay, meta, counts

    def _pick_layout(self, batch: ScheduledBatch, entries: list[RowEntry], cache_rows: np.ndarray) -> Layout:
        """The bucketed shape and the least sampler mode (and penalties) the sampled rows need;
        a compiled layout whose sampler covers those rows is taken instead, saving a compile."""
        rows, cache, bk = batch.rows, self._rows, self.buckets
        decode = batch.kind == "decode"
        sampled = np.array([row.sample for row in rows], bool)
        penalties = bool((cache.penalties[cache_rows] & sampled).any())
        need = MODES[int(cache.sampling_mode[cache_rows][sampled].max(initial=0))]  # rows that sample need none
        asks = int(cache.logprobs[cache_rows][sampled].max(initial=-1))
        logprobs = None if asks < 0 else logprob_bucket(asks)
        scores = () if decode else [r.req.prompt_lp.k for r in rows
                                    if r.req.prompt_lp is not None and not r.req.prompt_lp.complete]
        prompt_logprobs = logprob_bucket(max(scores)) if scores else None  # decode steps score nothing
        bias = logit_bias_bucket(int(cache.bias_count[cache_rows][sampled].max(initial=0)))
        B = Buckets.pick(bk.batch, len(rows))
        T = 1 if decode else Buckets.pick(bk.tokens, max(r.end - r.start for r in rows))
        P = Buckets.pick(bk.pages, max(len(e.pages) for e in entries))
        checkpoints_per_row = 0 if decode else self.checkpoints_per_row
        lay = self.layout(B, T, P, penalties, checkpoints_per_row, need, logprobs, prompt_logprobs, bias)
        if lay not in self._ready:  # a larger logprobs bucket covers a smaller one (never no logprobs)
            buckets = [logprobs] if logprobs is None else [b for b in LOGPROB_BUCKETS if b >= logprobs]
            for mode in MODES[MODES.index(need):]:
                for lp in buckets:
                    cover = self.layout(B, T, P, penalties, checkpoints_per_row, mode, lp, prompt_logprobs, bias)
                    if cover in self._ready:
                        return cover
        return lay

    def _pack(self, batch: ScheduledBatch, lay: Layout, cache_rows: np.ndarray) -> np.ndarray:
        """The step's meta buffer (packing.pack)."""
        return pack(batch, lay, cache_rows, self._rows, self.allocator, self.pools, self.has_state,
                    self.banned_per_row)

__all__ = ["Launched", "Runner", "StepModel", "jit_step", "step", "step_model"]
