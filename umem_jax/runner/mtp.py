"""MTPSpeculator: the runner's steps when the target's own MTP head proposes (speculative method
"mtp"; the head: models/mtp.py, its layers planned beside the target's as model "draft").

The head's entry at position i is computed from (x_{i+1}, h_i), h_i the target's final-normed
hidden there, so it lags the target by one token: after every step the head holds K/V for every
token the target computed.  Drafts are carried as tokens (a step's output columns, and
Request.drafts once read back), not hidden states.

    prefill   ONE jitted call: the target over the chunk -> logits at each row's last token and
              the hidden at every token; sample; the head over the same positions with the tokens
              shifted by one (x_{i+1}: the chunk's next token; at a row's last token the next
              prompt token from the host, or the token just sampled) writes its K/V for every
              position of the chunk.  A sampling row (its prompt's last chunk) also gets d_1
              (argmax of the head's logits at its last token) and, by k-1 chained head passes,
              d_2..d_k.
    decode    ONE jitted call: verify [t0, d_1..d_s] with the target (logits and hidden at every
              position, acceptance with one-hot q: acceptance.ONEHOT) -> m accepted, m+1 tokens;
              the head's catch-up over positions n..n+m (q_len m+1, dynamic) on (x_{i+1}, h_i),
              x = d_1..d_m then the bonus token, h the verify's hiddens; its logits at n+m give
              the next d'_1 and k-1 chained passes d'_2..d'_k.

Chained pass j runs the head at position p = last + j on (d_j, the head's own output y): its
K/V there is provisional (the next catch-up rewrites p with the accepted token before any pass
reads it).  A pass whose page the row does not hold (the table says sink, or p is past the
table's width, where write_targets would clip onto the row's last page) writes into the sink
and proposes nothing: that draft and the later ones are -1, and the next verify checks fewer.
A row without drafts (its first decode step after a resume without a prefill, a handed-in
request) verifies none that step and gets drafts from it.

A decode step's output is one int32 array [max_batch, 2k+3]: accepted count m, the k+1 tokens
(acceptance.accept's), the k next drafts (-1 where none), then the drafts verified.  A step
launched before the previous one is read back (speculative.py: overlap) takes its rows' drafts
from that output on the device instead of Request.drafts.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core.scheduled_batch import ScheduledBatch
from ..models import mtp
from .acceptance import ONEHOT
from .runner import _SAMPLER_ARGS, Launched, Runner, StepModel, step_key
from .sampler import sample, sample_with_penalties, token_logprobs
from .shift import commit_on_device, decode_fields, only_verified
from .speculative import SpecLaunched, Speculator, _batch, _step_model, accept_verified, verify_batch, verify_logprobs
from .xla_log import quiet_xla_alarms


@dataclasses.dataclass(frozen=True, eq=False)
class HeadModel:
    """The MTP head's half of a step's static arguments (hashed by identity, one per graph,
    params structure, plan and kernels: engines on one model share its compilations)."""

    forward: Callable  # models.mtp.forward_fn: (target params, head params, arena, batch, hidden) -> (logits, y, arena)
    treedef: Any
    pool: str  # the token sub-pool the head's K/V live in (its page table)
    page_size: int


_HEAD_MODELS: dict = {}


def head_model(target, head, runner: Runner, treedef) -> HeadModel:
    key = step_key(target.graphdef, head.graphdef, treedef, runner.plan, runner.impl, runner.interpret)
    got = _HEAD_MODELS.get(key)
    if got is None:
        pools = [sp for sp in runner.plan.token_pools if any(m == mtp.MEMORY_MODEL for m, _ in sp.layers)]
        got = _HEAD_MODELS[key] = HeadModel(mtp.forward_fn(target, head, impl=runner.impl, interpret=runner.interpret),
                                            treedef, pools[0].name, pools[0].page_size)
    return got


def _chain(head: HeadModel, tp, hp, arena, batch, first, y, last, live, k: int):
    """Drafts [B, k]: d_1 = first [B], then pass j = 1..k-1 runs the head at position last + j
    on (d_j, y) for d_{j+1} (module doc: passes without a page propose -1).  One loop body, so
    the head's decode pass compiles once whatever k is."""
    table = batch.page_tables[head.pool]
    width = table.shape[1]
    drafts = jnp.full((first.shape[0], k), -1, jnp.int32).at[:, 0].set(jnp.where(live, first, -1))

    def one(j, carry):
        arena, drafts, y, ok = carry
        pos = last + j
        col = pos // head.page_size
        page = jnp.take_along_axis(table, jnp.clip(col, 0, width - 1)[:, None], axis=1)[:, 0]
        ok = ok & (col < width) & (page > 0)
        prev = jax.lax.dynamic_index_in_dim(drafts, j - 1, axis=1, keepdims=False)
        b = dataclasses.replace(batch, tokens=jnp.maximum(prev, 0)[:, None], q_lens=ok.astype(jnp.int32),
                                kv_lens=jnp.where(ok, pos + 1, 0), checkpoint_positions=None, checkpoint_slots=None)
        logits, y, arena = head.forward(tp, hp, arena, b, y[:, None])
        d = jnp.where(ok, jnp.argmax(logits, axis=-1).astype(jnp.int32), -1)
        return arena, jax.lax.dynamic_update_index_in_dim(drafts, d, j, axis=1), y, ok

    arena, drafts, _, _ = jax.lax.fori_loop(1, k, one, (arena, drafts, y, live))
    return drafts, arena


def prefill_step(params, hparams, arena, meta, prev, next_tokens, counts, *, layout, target: StepModel,
                 head: HeadModel, k: int):
    """The target's prefill step, then the head over the chunk -> (sampled tokens [max_batch],
    drafts [B, k] (-1 where none; sampling rows only), arena).  next_tokens [B]: the token after
    each row's chunk, -1 for a row that samples it (module doc)."""
    f = layout.unpack(meta)
    batch = _batch(f, layout, prev)
    tp, hp = jax.tree.unflatten(target.treedef, params), jax.tree.unflatten(head.treedef, hparams)
    (logits, hidden), arena = target.forward(tp, arena, batch)
    ban = f["ban"]
    banned = logits.at[jnp.arange(layout.B)[:, None], jnp.maximum(ban, 0)].min(jnp.where(ban >= 0, -jnp.inf, jnp.inf))
    sampling = [f[n] for n in _SAMPLER_ARGS]
    if layout.penalties:  # counts: runner.step's
        toks = sample_with_penalties(banned, counts[0], counts[1], *sampling, mode=layout.sampling)
    else:
        toks = sample(banned, *sampling, mode=layout.sampling)
    toks = toks.astype(jnp.int32)
    rows, last = jnp.arange(layout.B), batch.last_index()
    samples = next_tokens < 0
    shifted = jnp.concatenate([batch.tokens[:, 1:], jnp.zeros_like(batch.tokens[:, :1])], axis=1)
    shifted = shifted.at[rows, last].set(jnp.where(samples, toks, next_tokens))
    hb = dataclasses.replace(batch, tokens=shifted, checkpoint_positions=None, checkpoint_slots=None)
    lg, y, arena = head.forward(tp, hp, arena, hb, hidden)
    live = samples & (batch.q_lens > 0)
    drafts, arena = _chain(head, tp, hp, arena, batch, jnp.argmax(lg, axis=-1).astype(jnp.int32), y,
                           batch.kv_lens - 1, live, k)
    out = jnp.zeros((layout.max_batch,), jnp.int32).at[: layout.B].set(toks)
    if layout.logprobs is not None:  # the sampled tokens' (runner.step's third item)
        return out, drafts, arena, token_logprobs(logits, toks, layout.logprobs)
    return out, drafts, arena


def decode_step(params, hparams, arena, meta, prev, spec_lens, drafts, states, counts, *, layout, target: StepModel,
                head: HeadModel):
    """Verify, the head's catch-up and its chain (module doc) -> (out [max_batch, 2k+3], arena).
    prev: the previous decode step's output (speculative.decode_fields).  drafts [B, k]: the
    host's drafts (row b verifies its first spec_lens[b]), for rows whose pending token is on the
    host; a row whose token the previous step made verifies the drafts that step proposed, at
    most spec_lens[b].  states: as speculative.verify_step's (recurrent targets)."""
    k = drafts.shape[1]
    fields = layout.unpack(meta)
    on = fields["src"] >= 0  # rows whose pending token the previous step made
    f, a, verified, row = decode_fields(fields, prev)
    f, states = commit_on_device(f, states, a, verified)
    # such a row verifies the drafts that step proposed (its columns k+2..2k+1), up to the first -1
    held = row[:, k + 2:2 * k + 2]
    drafts = jnp.where(on[:, None], jnp.maximum(held, 0), drafts)
    spec_lens = jnp.where(on, jnp.minimum(spec_lens, jnp.cumprod(held >= 0, axis=1).sum(axis=1)), spec_lens)
    base = _batch(f, layout, None)
    tp, hp = jax.tree.unflatten(target.treedef, params), jax.tree.unflatten(head.treedef, hparams)
    (logits, hidden), arena = target.forward(tp, arena, verify_batch(base, spec_lens, drafts,
                                                                     only_verified(states, spec_lens)))
    m, toks = accept_verified(f, layout, logits, drafts, ONEHOT, spec_lens, counts)
    live = base.q_lens > 0
    catch = dataclasses.replace(base, tokens=jnp.maximum(toks, 0), q_lens=jnp.where(live, m + 1, 0),
                                kv_lens=jnp.where(live, base.kv_lens + m, 0))
    lg, y, arena = head.forward(tp, hp, arena, catch, hidden)
    nxt, arena = _chain(head, tp, hp, arena, base, jnp.argmax(lg, axis=-1).astype(jnp.int32), y,
                        base.kv_lens - 1 + m, live, k)
    out = jnp.concatenate([m[:, None], toks, nxt, spec_lens[:, None]], axis=1)
    out = jnp.zeros((layout.max_batch, 2 * k + 3), jnp.int32).at[: layout.B].set(out)
    if layout.logprobs is not None:  # of every emitted token (SpecLaunched.logprobs)
        return out, arena, verify_logprobs(logits, toks, layout.logprobs)
    return out, arena


jit_prefill = jax.jit(prefill_step, donate_argnums=(2,), static_argnames=("layout", "target", "head", "k"))
jit_decode = jax.jit(decode_step, donate_argnums=(2,), static_argnames=("layout", "target", "head"))


def valid_drafts(row: np.ndarray) -> list[int]:
    """A row of drafts read back -> the leading ones before the first -1."""
    out = []
    for t in row.tolist():
        if t < 0:
            break
        out.append(t)
    return out


class MTPSpeculator(Speculator):
    """Launches a runner's steps with the target's MTP head (`Runner.launch` hands every batch
    here).  head: the MTP head Model (models/mtp.py), its layers in the runner's plan as "draft"."""

    def __init__(self, runner: Runner, head, k: int):
        super().__init__(runner, head, k, out_width=2 * int(k) + 3)
        self._models: dict = {}

    def _leaves(self):
        """(target leaves, head leaves, target StepModel for prefill, for verify, HeadModel), re-made
        when either model's params were replaced."""
        r = self.runner
        key = (id(r.model.params), id(self.draft.params))
        if key not in self._models:
            tleaves, ttree = jax.tree.flatten(r.model.params)
            hleaves, htree = jax.tree.flatten(self.draft.params)
            self._models = {key: (tleaves, hleaves, _step_model(r.model, r, ttree, hidden=True),
                                  _step_model(r.model, r, ttree, all_positions=True, decode_rows=True, hidden=True),
                                  head_model(r.model, self.draft, r, htree))}
        return self._models[key]

    def launch(self, batch: ScheduledBatch, prev) -> Launched:
        r = self.runner
        lay, meta, counts = r.prepare(batch)
        if batch.kind == "decode":
            return self._decode_mtp(batch, lay, meta, self.previous_output(prev), counts)
        prev = r.prev_tokens if prev is None else prev
        nxt = np.full(lay.B, -1, np.int32)
        for i, row in enumerate(batch.rows):
            if not row.sample:  # a prompt's chunk before its last: the next token is the prompt's
                nxt[i] = row.req.token_ids(row.end, row.end + 1)[0]
        with quiet_xla_alarms(r._compiles):  # a shape warm-up left out compiles here, on demand
            tokens, drafts, r.arena, *lp = self._prefill_mtp(jit_prefill, lay, meta, prev, nxt, counts)
        r.prev_tokens = tokens
        drafts = np.asarray(drafts)  # speculation reads every step back at once anyway
        for i, row in enumerate(batch.rows):
            row.req.drafts = valid_drafts(drafts[i]) if row.sample else []
            if row.sample:
                row.req.mark_pending(i)
        return Launched(batch, tokens, logprobs=lp[0] if lp else None)

    def lower(self, lay, decode: bool) -> list[jax.stages.Lowered]:
        """What `launch` runs for a batch of layout `lay`, traced and lowered for the runner's
        arena (Runner.precompile compiles it): one jit_prefill or one jit_decode."""
        if not decode:
            return [self._prefill_mtp(jit_prefill.lower, lay, lay.template, self.runner.prev_tokens,
                                      np.full(lay.B, -1, np.int32), None)]
        zeros = np.zeros(lay.B, np.int32)
        return [self._decode_call(jit_decode.lower, lay, lay.template, self.previous_output(), zeros,
                                  np.zeros((lay.B, self.k), np.int32), self._states(lay), None)]

    # The jitted calls' arguments in one place for the launch (fn: the jitted function) and for
    # `lower` (fn: its .lower): a warm-up compiles exactly what a launch finds in the cache.
    def _prefill_mtp(self, fn, lay, meta, prev, nxt, counts):
        tleaves, hleaves, prefill, _, head = self._leaves()
        return fn(tleaves, hleaves, self.runner.arena, meta, prev, nxt, counts, layout=lay, target=prefill, head=head,
                  k=self.k)

    def _decode_call(self, fn, lay, meta, prev, spec, drafts, states, counts):
        tleaves, hleaves, _, verify, head = self._leaves()
        return fn(tleaves, hleaves, self.runner.arena, meta, prev, spec, drafts, states, counts, layout=lay,
                  target=verify, head=head)

    def _decode_mtp(self, batch, lay, meta, prev, counts) -> SpecLaunched:
        """The rows verify the drafts they carry (Request.drafts, or on the device the previous
        step's when their pending token is still there), at most their scheduled spec_lens; the
        output's last column says how many each verified."""
        r = self.runner
        spec = np.zeros(lay.B, np.int32)
        drafts = np.zeros((lay.B, self.k), np.int32)
        for i, row in enumerate(batch.rows):
            s = batch.spec_lens[i]
            if not row.req.num_pending:  # else the step takes them from `prev`
                held = row.req.drafts or []
                s = min(s, len(held))
                drafts[i, :s] = held[:s]
            spec[i] = s
        timed = self._timed()
        t0 = time.perf_counter()
        with quiet_xla_alarms(r._compiles):
            out, r.arena, *lp = self._decode_call(jit_decode, lay, meta, prev, spec, drafts,
                                                  self._states(lay, batch, spec), counts)
        _, verify_s = self.launched(batch, out, t0, timed)  # the head drafts inside the call: no draft seconds
        return SpecLaunched(batch, out, 0.0, verify_s, next_drafts=self.k, logprobs=lp[0] if lp else None)


__all__ = ["HeadModel", "MTPSpeculator", "decode_step", "prefill_step", "valid_drafts"]
