"""Sampler: one jitted function from last-token logits to next tokens, per-row parameters.

Every option is a per-row array, so a compiled sampler serves any mix of requests in a batch.
What the batch needs at most is a static `mode`, chosen on the host from the rows' parameters:
"greedy" (argmax only), "random" (some row samples, none cuts) or "cuts" (some row has a top-k /
top-p / min-p cut: the [B, V] vocabulary sort).  It is static rather than a lax.cond because XLA
on the GPU decides a conditional on the host: it copies the predicate back and waits for the
stream, so the next step could not be launched while this one runs.  A row's token is the same
in every mode that covers it.  Penalties need token counts; they are a separate static variant
because building counts costs a [B, V] scatter.  Logprobs (`token_logprobs`) are one more static
variant of the step, traced only for batches where a row asks for them.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np


def apply_penalties(logits, prompt_counts, output_counts, rep, presence, frequency):
    """vLLM penalties.  logits [B, V] f32; counts [B, V] (tokens seen in prompt / output)."""
    seen = (prompt_counts + output_counts) > 0
    rep = rep[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - frequency[:, None] * output_counts - presence[:, None] * (output_counts > 0)
    return logits


MODES = ("greedy", "random", "cuts")  # each covers the ones before it
# Top alternatives a logprobs step computes per row: the chosen token alone, or the top 20 (the
# most a request may ask for: SamplingParams.logprobs); each bucket is one more compiled step.
LOGPROB_BUCKETS = (0, 20)


def logprob_bucket(k: int) -> int:
    """The least bucket that holds k alternatives."""
    for b in LOGPROB_BUCKETS:
        if k <= b:
            return b
    raise ValueError(f"logprobs={k}: at most {LOGPROB_BUCKETS[-1]} alternatives")


def token_logprobs(logits, tokens, k: int):
    """Log probabilities of the model's distribution (the raw logits: before penalties, banned
    tokens, temperature and cuts, as vLLM reports by default).

    logits [B, V], tokens [B] (the chosen ones) -> (logprob [B] f32 of the chosen token, its
    rank [B] i32 (1 = the most likely), top ids [B, k] i32 and logprobs [B, k] f32, most likely
    first).  One log-sum-exp and (k > 0) one top-k over V; nothing [B, V] is kept."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0]
    rank = 1 + jnp.sum(logits > picked[:, None], axis=-1).astype(jnp.int32)
    if k:
        vals, ids = jax.lax.top_k(logits, k)
        vals = vals - lse[:, None]
    else:
        vals, ids = jnp.zeros((logits.shape[0], 0), jnp.float32), jnp.zeros((logits.shape[0], 0), jnp.int32)
    return picked - lse, rank, ids.astype(jnp.int32), vals


def keep_sorted(probs, top_k, top_p, min_p):
    """Which tokens survive the cuts -> bool [B, V].  probs [B, V]: each row's tempered
    distribution sorted most likely first.  vLLM's order: min-p and top-k, then top-p over the
    distribution they left, renormalised (the smallest prefix whose mass reaches top_p), so
    top_k=2, top_p=0.5 on probabilities (0.35, 0.3, ...) keeps one token, not two.  The first
    token always stays.  The speculative acceptance rule uses it too (acceptance.row_probs):
    both must draw from the same distribution."""
    rank = jnp.arange(probs.shape[-1])[None, :]
    keep = jnp.where(top_k[:, None] > 0, rank < top_k[:, None], True)
    keep &= probs >= min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)
    left = jnp.where(keep, probs, 0.0)
    left = left / left.sum(-1, keepdims=True)
    # top_p 1.0 cuts nothing: the cumulative sum may round to 1 before the last kept token
    return keep & (((jnp.cumsum(left, axis=-1) - left) < top_p[:, None]) | (top_p[:, None] >= 1.0))


def sampling_mode(temperature, top_k, top_p, min_p) -> str:
    """The least mode that covers rows with these parameters (numpy arrays or scalars)."""
    stochastic = np.asarray(temperature) > 0
    if not stochastic.any():
        return "greedy"
    cut = (np.asarray(top_k) > 0) | (np.asarray(top_p) < 1.0) | (np.asarray(min_p) > 0.0)
    return "cuts" if (stochastic & cut).any() else "random"


def _sample_rows(logits, temperature, top_k, top_p, min_p, seed, step, mode: str = "cuts"):
    """logits [B, V] f32 -> tokens [B] i32.

    Greedy rows take the argmax.  A sampling row without top-k / top-p / min-p draws from its
    tempered logits directly; only rows with a cut need the vocabulary sorted (one sort serves
    all three cuts).  The sort over [B, V] is the costly part (V is 128K-262K), so it is traced
    only in mode "cuts"; a mode that does not cover a row's parameters gives that row a wrong
    token (the host picks the mode: `sampling_mode`).  Each row's token depends on its own
    parameters and seed alone, never on the mode its batch took."""
    if mode not in MODES:
        raise ValueError(f"sampling mode {mode!r}: one of {MODES}")
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if mode == "greedy":
        return greedy
    stochastic = temperature > 0
    cut = (top_k > 0) | (top_p < 1.0) | (min_p > 0.0)

    def draw():
        t = jnp.where(stochastic, temperature, 1.0)[:, None]
        scaled = logits / t
        keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(seed, step)
        plain = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, scaled).astype(jnp.int32)
        if mode == "random":
            return plain

        def with_cuts():
            order = jnp.argsort(-scaled, axis=-1)
            sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
            probs = jax.nn.softmax(sorted_logits, axis=-1)
            masked = jnp.where(keep_sorted(probs, top_k, top_p, min_p), sorted_logits, -jnp.inf)
            choice = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, masked)
            return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)

        return jnp.where(cut, with_cuts(), plain)

    return jnp.where(stochastic, draw(), greedy)


@partial(jax.jit, static_argnames=("mode",))
def sample(logits, temperature, top_k, top_p, min_p, seed, step, repetition_penalty, presence_penalty,
           frequency_penalty, mode: str = "cuts"):
    """Next tokens [B] for last-token logits [B, V], no penalties (their arrays are ignored).
    mode: see `sampling_mode` ("cuts", the default, covers every row)."""
    del repetition_penalty, presence_penalty, frequency_penalty
    return _sample_rows(logits.astype(jnp.float32), temperature, top_k, top_p, min_p, seed, step, mode)


@partial(jax.jit, static_argnames=("mode",))
def sample_with_penalties(logits, prompt_counts, output_counts, temperature, top_k, top_p, min_p, seed, step,
                          repetition_penalty, presence_penalty, frequency_penalty, mode: str = "cuts"):
    """As `sample`, after applying penalties from token counts [B, V]."""
    logits = apply_penalties(logits.astype(jnp.float32), prompt_counts, output_counts, repetition_penalty,
                             presence_penalty, frequency_penalty)
    return _sample_rows(logits, temperature, top_k, top_p, min_p, seed, step, mode)
