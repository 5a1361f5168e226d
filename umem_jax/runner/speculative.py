"""Speculator: the runner's steps when a draft model proposes tokens (speculative decoding).

The draft's layers are planned beside the target's (memory/plan.py, model tag "draft"): they
share the target's page envelopes where lifetime and geometry match and have a window sub-pool
of their own where the target has no such window, so the page tables of a batch address both
models and one allocation, free and relocation covers both.

    prefill   the target's step (runner.step), then the draft over the same batch: the draft's
              K/V for every prompt token (no draft logits are used)
    decode    draft: k+1 decode passes (jitted together).  Pass j (0..k) feeds the token at
              position n+j (t0 = the pending token, then the draft's own d_j) and writes its
              draft K/V; passes 0..k-1 propose d_1..d_k.  The last pass only writes d_k's K/V,
              so the draft holds K/V for every token the target computed (no catch-up pass
              after an all-accepted step, no hole in pages handed to the prefix cache).
              verify: the target over [t0, d_1..d_k] at positions n..n+k in ONE forward (a
              T=k+1 chunk: the prefill / extend kernels), logits of every position, then the
              acceptance rule (acceptance.py).

A row speculates `spec_len` <= k tokens (the scheduler's choice: never past max_tokens, none
before min_tokens); passes and positions past it are padding (q_len 0: writes go to the sink).
The output of a decode step is one int32 array [max_batch, k+3]: accepted count, the k+1 tokens
(accepted drafts, the corrected / bonus token, -1 after), then the drafts verified.

Overlap: the engine launches a decode step while the previous one is still running, before its
accepted counts are read back (engine.py).  A row whose pending token that step produces
(`src` >= 0) was packed as if it accepted nothing; the step reads the row's accepted count a
from the previous step's output on the device (shift.py): its pending token is the one after
the accepted ones, its positions (kv_lens) and its sampling step move on by a, and with
recurrent state the swap `commit_state` makes on the host later is made here first.  The
scheduler placed its memory for the worst case (scheduler/speculation.py).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from ..core.batch import Batch
from ..core.scheduled_batch import ScheduledBatch
from .acceptance import accept, draw, row_probs
from .runner import Launched, Runner, StepModel, step, step_key
from .shift import as_output, commit_on_device, decode_fields, next_tokens, only_verified
from .sampler import apply_penalties, token_logprobs
from .xla_log import quiet_xla_alarms

_DRAFT_TAG, _ACCEPT_TAG, _RESIDUAL_TAG = 0x5EED01, 0x5EED02, 0x5EED03


@dataclasses.dataclass
class SpecLaunched(Launched):
    """A speculative decode step: tokens [max_batch, W] (see module doc), read back by the engine."""

    draft_s: float = 0.0
    verify_s: float = 0.0
    next_drafts: int = 0  # columns after the k+2 holding each row's next drafts (an MTP head's: runner/mtp.py)
    overlap: bool = True  # the next step may be launched before this one is read back (module doc)


def _batch(f: dict, layout, prev) -> Batch:
    """The Batch of unpacked fields `f`; prev [max_batch]: where rows with src >= 0 take their
    first token (None: every row's tokens are in f, as decode_fields leaves them)."""
    tokens, src = f["tokens"], f["src"]
    if prev is not None:
        fed = jnp.take(prev, jnp.clip(src, 0, prev.shape[0] - 1))
        tokens = tokens.at[:, 0].set(jnp.where(src >= 0, fed, tokens[:, 0]))
    return Batch(tokens, f["q_lens"], f["kv_lens"], {p: f[f"table:{p}"] for p in layout.pools}, f["slots"],
                 f.get("checkpoint_positions"), f.get("checkpoint_slots"))


def prefill_step(params, draft_params, arena, meta, prev, counts, *, layout, model: StepModel, draft: StepModel):
    """The target's step, then the draft over the same rows (its K/V only) -> (tokens, arena,
    and with layout.logprobs the sampled tokens' logprobs: runner.step's third item)."""
    out, arena, *lp = step(params, arena, meta, prev, counts, layout=layout, model=model)
    batch = _batch(layout.unpack(meta), layout, prev)
    _, arena = draft.forward(jax.tree.unflatten(draft.treedef, draft_params), arena, batch)
    return (out, arena, *lp)


def verify_logprobs(logits, toks, n: int):
    """sampler.token_logprobs at every verified position: logits [B, T, V] (raw: before bans and
    sampling, as a plain step reports), toks [B, T] the emitted tokens (-1 past them) -> chosen
    logprob [B, T], rank [B, T], top ids [B, T, n], top logprobs [B, T, n]."""
    B, T, V = logits.shape
    lp = token_logprobs(logits.reshape(B * T, V), jnp.maximum(toks, 0).reshape(-1), n)
    return tuple(x.reshape(B, T, *x.shape[1:]) for x in lp)


def _keys(seed, step_, tag, j=0):
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(
        jax.random.PRNGKey(s), i), tag), j))(seed, step_)


def draft_step(draft_params, arena, meta, prev, spec_lens, *, layout, draft: StepModel, k: int):
    """k+1 draft decode passes -> (drafts [B, k], q [B, k, V] or None (greedy layout), arena).
    prev: the previous decode step's output (decode_fields)."""
    f, *_ = decode_fields(layout.unpack(meta), prev)
    base = _batch(f, layout, None)
    params = jax.tree.unflatten(draft.treedef, draft_params)
    n = base.kv_lens - 1  # position of the pending token t0; -1 in padding rows
    live = base.q_lens > 0
    cur = base.tokens[:, 0]
    drafts, qs = [], []
    for j in range(k + 1):
        active = live & (j <= spec_lens)
        b = dataclasses.replace(base, tokens=cur[:, None], q_lens=active.astype(jnp.int32),
                                kv_lens=jnp.where(active, n + j + 1, jnp.maximum(base.kv_lens, 0)))
        logits, arena = draft.forward(params, arena, b)
        if j == k:
            break
        if layout.sampling == "greedy":
            d = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        else:
            q = row_probs(logits, f["temperature"], f["top_k"], f["top_p"], f["min_p"], cuts=layout.sampling == "cuts")
            d = draw(_keys(f["seed"], f["step"], _DRAFT_TAG, j), q, f["temperature"] <= 0)
            qs.append(q)
        drafts.append(d)
        cur = d
    return jnp.stack(drafts, 1), (jnp.stack(qs, 1) if qs else None), arena


def verify_step(params, arena, meta, prev, spec_lens, drafts, q, states, counts, *, layout, model: StepModel):
    """The target over [t0, d_1..d_k] in one forward, then acceptance -> (out [max_batch, k+3], arena).
    model: the target's StepModel with logits at every position (Speculator._verify_model).
    prev: the previous decode step's output (decode_fields).  states: None, or for a target
    with recurrent state (positions, slots) [B, k] int32: the state after the first j+1 verified
    tokens of row b also goes to physical slot slots[b, j] (the prefill kernels' checkpoint
    writes; position -1 / slot 0 is padding), so the state of whichever prefix is accepted is
    kept (Speculator doc); slots holds all k of the row's speculative slots (commit_on_device).
    counts: runner.step's, for a layout with penalties (verify_penalties), else None."""
    f, a, verified, _ = decode_fields(layout.unpack(meta), prev)
    f, states = commit_on_device(f, states, a, verified)
    b = verify_batch(_batch(f, layout, None), spec_lens, drafts, only_verified(states, spec_lens))
    logits, arena = model.forward(jax.tree.unflatten(model.treedef, params), arena, b)  # [B, k+1, V]
    n, toks = accept_verified(f, layout, logits, drafts, q, spec_lens, counts)
    out = jnp.concatenate([n[:, None], toks, spec_lens[:, None]], axis=1)
    out = jnp.zeros((layout.max_batch, drafts.shape[1] + 3), jnp.int32).at[: layout.B].set(out)
    if layout.logprobs is not None:  # of every emitted token (SpecLaunched.logprobs)
        return out, arena, verify_logprobs(logits, toks, layout.logprobs)
    return out, arena


def verify_batch(base: Batch, spec_lens, drafts, states) -> Batch:
    """The decode batch `base` as a verify: row b computes [t0, d_1..d_s] (s = spec_lens[b]) at
    positions n..n+s, keeping the state after each (states: see verify_step)."""
    live = base.q_lens > 0
    return dataclasses.replace(base, tokens=jnp.concatenate([base.tokens[:, :1], drafts], axis=1),
                               q_lens=jnp.where(live, spec_lens + 1, 0),
                               kv_lens=jnp.where(live, base.kv_lens + spec_lens, 0),
                               checkpoint_positions=None if states is None else states[0],
                               checkpoint_slots=None if states is None else states[1])


def verify_penalties(logits, counts, drafts, f: dict):
    """Penalties at every verified position as a plain step applies them to its one: position j
    follows [t0, d_1..d_j], so its output counts also hold d_1..d_j.  logits [B, k+1, V], counts
    (prompt, output) [B, V] f32 as of t0, drafts [B, k] -> penalized logits [B, k+1, V]: every
    position with the step's counts, then at j >= 1 the few tokens d_1..d_j again with theirs."""
    prompt, output = counts
    rep, presence, freq = f["repetition_penalty"], f["presence_penalty"], f["frequency_penalty"]
    out = jax.vmap(apply_penalties, in_axes=(1, None, None, None, None, None), out_axes=1)(
        logits, prompt, output, rep, presence, freq)
    B, k = drafts.shape
    rows = jnp.arange(B)[:, None]
    for j in range(1, k + 1):
        d = jnp.maximum(drafts[:, :j], 0)  # [B, j]
        c = jnp.take_along_axis(output, d, axis=1) + (d[:, :, None] == d[:, None, :]).sum(-1)  # count after d_j
        raw = jnp.take_along_axis(logits[:, j], d, axis=1)
        val = apply_penalties(raw, jnp.take_along_axis(prompt, d, axis=1), c, rep, presence, freq)  # [B, j]
        out = out.at[rows, j, d].set(val)
    return out


def accept_verified(f: dict, layout, logits, drafts, q, spec_lens, counts=None):
    """The acceptance rule over a verify's logits [B, k+1, V] with each row's bans, penalties
    (counts, a layout with penalties: verify_penalties) and sampling -> (accepted [B], tokens
    [B, k+1]: acceptance.accept).  q: the draft distributions [B, k, V], None (greedy drafts) or
    acceptance.ONEHOT (deterministic drafts)."""
    k = drafts.shape[1]
    ban = f["ban"]  # rows that ban tokens speculate nothing (spec_len 0): only position 0 counts
    rows = jnp.arange(layout.B)[:, None, None]
    logits = logits.at[rows, jnp.arange(k + 1)[None, :, None], jnp.maximum(ban, 0)[:, None, :]].min(
        jnp.where(ban >= 0, -jnp.inf, jnp.inf)[:, None, :])
    if layout.penalties:  # after the bans, as runner.step
        logits = verify_penalties(logits.astype(jnp.float32), counts, drafts, f)
    greedy = f["temperature"] <= 0
    if layout.sampling == "greedy":
        return accept(drafts, None, logits, None, None, spec_lens, greedy)
    B, T, V = logits.shape
    rep = lambda x: jnp.repeat(x, T)
    p = row_probs(logits.reshape(B * T, V), rep(f["temperature"]), rep(f["top_k"]), rep(f["top_p"]),
                  rep(f["min_p"]), cuts=layout.sampling == "cuts").reshape(B, T, V)
    u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(_keys(f["seed"], f["step"], _ACCEPT_TAG))
    return accept(drafts, q, p, u, _keys(f["seed"], f["step"], _RESIDUAL_TAG), spec_lens, greedy)


jit_prefill = jax.jit(prefill_step, donate_argnums=(2,), static_argnames=("layout", "model", "draft"))
jit_draft = jax.jit(draft_step, donate_argnums=(1,), static_argnames=("layout", "draft", "k"))
jit_verify = jax.jit(verify_step, donate_argnums=(1,), static_argnames=("layout", "model"))


_STEP_MODELS: dict = {}


def _step_model(model, runner: Runner, treedef, **model_kw) -> StepModel:
    """One StepModel per (graph, params structure, plan, kernels, forward options), shared by
    engines on one model as runner.step_model does, so each compiles once."""
    key = step_key(model.graphdef, treedef, runner.plan, runner.impl, runner.interpret, tuple(sorted(model_kw.items())))
    got = _STEP_MODELS.get(key)
    if got is None:
        fwd = model.forward_fn(runner.plan, impl=runner.impl, interpret=runner.interpret, **model_kw)
        got = _STEP_MODELS[key] = StepModel(fwd, treedef)
    return got


class Speculator:
    """Launches a runner's steps with the draft model: `Runner.launch` hands every batch here
    when the runner has one.  draft: the draft Model (its layers in the runner's plan as "draft")."""

    TIME_EVERY = 16  # decode steps per timed one (the one that waits for the draft, then the verify)
    KEEP_OUTPUTS = 4  # decode outputs remembered by their next_tokens, least recently read dropped first

    def __init__(self, runner: Runner, draft, k: int, out_width: int | None = None):
        self.runner, self.draft, self.k = runner, draft, int(k)
        self.out_width = out_width or self.k + 3  # a decode step's output columns (module doc)
        next_tokens(as_output(runner.prev_tokens, self.out_width))  # compile both small jits now, not mid-serving
        self._draft_src = self._target_src = None
        self._steps, self._due = 0, True  # decode steps launched; a timed one is due
        self._times = (0.0, 0.0)  # the last timed step's (draft, verify) seconds
        self._outputs: dict[int, tuple] = {}  # id(next_tokens(out)) -> (that array, out)

    def _timed(self) -> bool:
        """Whether this decode step is timed: one every TIME_EVERY steps, the first one that does
        not compile from then on (a compile is not the step's time)."""
        if self._steps % self.TIME_EVERY == 0:
            self._due = True
        self._steps += 1
        timed = self._due and not self.runner._compiles
        self._due &= not timed
        return timed

    @property
    def overlap(self) -> bool:
        """Whether the engine may launch the next step before reading this one back: not when a
        harness replaced `propose` reading each row's position on the host (one that shifts
        them on the device as decode_fields does says so with an `on_device` attribute)."""
        harness = vars(self).get("propose")
        return harness is None or getattr(harness, "on_device", False)

    def _draft_leaves(self):
        if self.draft.params is not self._draft_src:
            self._draft_src = self.draft.params
            leaves, treedef = jax.tree.flatten(self._draft_src)
            self._draft_leaves_ = leaves
            self._draft_model = _step_model(self.draft, self.runner, treedef, memory_model="draft")
        return self._draft_leaves_

    def _verify(self) -> StepModel:
        """The target's forward with logits at every position, every row a decode row, over the
        runner's plan."""
        r = self.runner
        if r.model.params is not self._target_src:
            self._target_src = r.model.params
            self._verify_model = _step_model(r.model, r, jax.tree.structure(self._target_src), all_positions=True,
                                             decode_rows=True)
        return self._verify_model

    def launch(self, batch: ScheduledBatch, prev) -> Launched:
        r = self.runner
        rows = batch.rows
        lay, meta, counts = r.prepare(batch)
        if batch.kind != "decode":
            prev = r.prev_tokens if prev is None else prev
            with quiet_xla_alarms(r._compiles):  # a shape warm-up left out compiles here, on demand
                tokens, r.arena, *lp = self._prefill(jit_prefill, lay, meta, prev, counts)
            r.prev_tokens = tokens
            for i, row in enumerate(rows):
                if row.sample:
                    row.req.mark_pending(i)
            return Launched(batch, tokens, logprobs=lp[0] if lp else None)
        return self._decode(batch, lay, meta, self.previous_output(prev), counts)

    def previous_output(self, prev=None):
        """What a decode step reads its pending inputs from: the output [max_batch, W] of the
        decode step whose next_tokens `prev` is (default: the runner's prev_tokens, the last
        step launched), or a prefill or plain step's tokens [max_batch] as such an output."""
        prev = self.runner.prev_tokens if prev is None else prev
        got = self._outputs.pop(id(prev), None)
        if got is None or got[0] is not prev:
            return as_output(prev, self.out_width)
        self._outputs[id(prev)] = got  # the most recent again: a relaunch's parts keep reading it
        return got[1]

    def launched(self, batch: ScheduledBatch, out, t_start: float, timed: bool,
                 draft_s: float = 0.0) -> tuple[float, float]:
        """After a decode step's launch: its output becomes what the next step reads (and the
        runner's prev_tokens, for a plain step), its rows' tokens pending, their drafts ahead
        (Request.spec_ahead) -> the (draft, verify) seconds to report: measured on a timed step
        (it waited for the draft, draft_s after t_start, then for its output), else the last
        timed step's."""
        r = self.runner
        nxt = next_tokens(out)
        self._outputs[id(nxt)] = (nxt, out)
        while len(self._outputs) > self.KEEP_OUTPUTS:
            self._outputs.pop(next(iter(self._outputs)))
        r.prev_tokens = nxt
        for i, (row, s) in enumerate(zip(batch.rows, batch.spec_lens or [0] * len(batch.rows))):
            row.req.mark_pending(i)
            row.req.spec_ahead += s
        if timed:
            out.block_until_ready()
            self._times = (draft_s, time.perf_counter() - t_start - draft_s)
        return self._times

    def lower(self, lay, decode: bool) -> list[jax.stages.Lowered]:
        """What `launch` runs for a batch of layout `lay`, traced and lowered (not compiled) for
        the runner's arena, as Runner.lower is for the plain step (Runner.precompile compiles
        them): a prefill's jit_prefill, or a decode's jit_draft (as `propose` launches it) and
        jit_verify (given the draft's output shapes).  Nothing runs: the arena is donated."""
        spec = np.zeros(lay.B, np.int32)
        if not decode:
            return [self._prefill(jit_prefill.lower, lay, lay.template, self.runner.prev_tokens, None)]
        prev = self.previous_output()
        draft = self._draft_call(jit_draft.lower, lay, lay.template, prev, spec)
        drafts, q, _ = draft.out_info
        return [draft, self._verify_call(jit_verify.lower, lay, lay.template, prev, spec, drafts, q, self._states(lay),
                                         None)]

    # The jitted calls' arguments, each in one place for the launch (fn: the jitted function) and
    # for `lower` (fn: its .lower): a warm-up compiles exactly what a launch finds in the cache.
    def _prefill(self, fn, lay, meta, prev, counts):
        (params, target), dparams = self.runner.params_leaves(), self._draft_leaves()
        return fn(params, dparams, self.runner.arena, meta, prev, counts, layout=lay, model=target,
                  draft=self._draft_model)

    def _draft_call(self, fn, lay, meta, prev, spec_lens):
        dparams = self._draft_leaves()
        return fn(dparams, self.runner.arena, meta, prev, spec_lens, layout=lay, draft=self._draft_model, k=self.k)

    def _verify_call(self, fn, lay, meta, prev, spec_lens, drafts, q, states, counts):
        params, _ = self.runner.params_leaves()
        return fn(params, self.runner.arena, meta, prev, spec_lens, drafts, q, states, counts, layout=lay,
                  model=self._verify())

    def propose(self, batch, lay, meta, prev, spec_lens):
        """The draft's k tokens per row -> (drafts [B, k] int32, q [B, k, V] or None); the draft's
        K/V of t0, d_1..d_k is written.  prev: the previous decode step's output (decode_fields).
        (A test harness may stand in for it: then every step is read back before the next.)"""
        drafts, q, self.runner.arena = self._draft_call(jit_draft, lay, meta, prev, spec_lens)
        return drafts, q

    def _states(self, lay, batch=None, spec=None):  # spec [B]: the batch's speculation lengths
        """Where the verify keeps the state after each verified position (target with recurrent
        state): (positions, physical slots) [B, k]: row b's j-th position (j < spec[b]) and all
        of its speculative slots, slots[1 + j] (priced by the demand model; commit_on_device
        may swap one with the working slot; batch None: all padding, -1 / the sink); None
        without state."""
        r = self.runner
        if not r.has_state:
            return None
        pos = np.full((lay.B, self.k), -1, np.int32)
        ids = np.full((lay.B, self.k), -1, np.int32)
        if batch is not None:
            for i, (row, s) in enumerate(zip(batch.rows, spec)):
                held = row.req.slots[1:1 + self.k]  # all of them, even if s is 0: the swap may need one
                pos[i, :s] = np.arange(1, s + 1)
                ids[i, :len(held)] = held
        return pos, r.allocator.translate_slots(ids.reshape(-1)).reshape(lay.B, self.k).astype(np.int32)

    def _decode(self, batch, lay, meta, prev, counts) -> SpecLaunched:
        """Draft, then verify, launched back to back: the verify is queued while the draft runs,
        and nothing waits for either (the engine reads the step back later).  Every TIME_EVERY-th
        step waits for the draft and then the verify, to time the two apart; the others report
        those figures (SpecStats' draft and verify seconds are estimates between timed steps)."""
        r = self.runner
        spec = np.zeros(lay.B, np.int32)
        spec[: len(batch.rows)] = batch.spec_lens or 0
        timed, draft_s = self._timed(), 0.0
        t0 = time.perf_counter()
        with quiet_xla_alarms(r._compiles):
            drafts, q = self.propose(batch, lay, meta, prev, spec)
            if timed:
                drafts.block_until_ready()
                draft_s = time.perf_counter() - t0
            out, r.arena, *lp = self._verify_call(jit_verify, lay, meta, prev, spec, drafts, q,
                                                  self._states(lay, batch, spec), counts)
        draft_s, verify_s = self.launched(batch, out, t0, timed, draft_s)
        return SpecLaunched(batch, out, draft_s, verify_s, logprobs=lp[0] if lp else None, overlap=self.overlap)


__all__ = ["SpecLaunched", "Speculator", "accept", "draft_step", "prefill_step", "verify_step"]
