"""Acceptance of speculative tokens: the distributions a row samples from, and the rule that
keeps the target's distribution (speculative / rejection sampling, Leviathan et al. 2023).

    p = row_probs(target_logits, ...)            [B, V] per position: what the sampler draws from
    n, tokens = accept(drafts, q_at, q, p, u, residual_keys, spec_lens, greedy)

A draft token d_j ~ q_j is kept with probability min(1, p_j(d) / q_j(d)); at the first
rejection j the token is drawn from norm(max(0, p_j - q_j)); when all k are kept a bonus token
is drawn from p_k.  Each emitted token is then distributed exactly as p (whatever q is).
Greedy rows have one-hot p and q (argmax), so the rule keeps d_j exactly when it is the
target's argmax and emits the target's argmax where it is not: the output is the target's
greedy continuation token for token.

Deterministic drafts (an MTP head's argmax, q_j the one-hot of d_j: pass q=ONEHOT) need no
[B, k, V] array: d_j is kept with probability p_j(d_j), and at a rejection the token is drawn
from p_j with d_j removed, renormalised (max(0, p - onehot) is exactly that).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .sampler import keep_sorted


def row_probs(logits, temperature, top_k, top_p, min_p, *, cuts: bool = True):
    """The distribution each row's sampler draws from -> probs [B, V] fp32.

    logits [B, V]; greedy rows (temperature 0) get the one-hot of the argmax; others the
    softmax of logits / temperature after the top-k / top-p / min-p cuts (the sampler's rule:
    runner/sampler.py), when `cuts` (static) is on."""
    logits = logits.astype(jnp.float32)
    V = logits.shape[-1]
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), V, dtype=jnp.float32)
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    scaled = logits / t
    probs = jax.nn.softmax(scaled, axis=-1)
    if cuts:
        order = jnp.argsort(-scaled, axis=-1)
        sp = jnp.take_along_axis(probs, order, axis=-1)
        kept = jnp.where(keep_sorted(sp, top_k, top_p, min_p), sp, 0.0)
        kept = kept / kept.sum(-1, keepdims=True)
        probs = jnp.zeros_like(probs).at[jnp.arange(probs.shape[0])[:, None], order].set(kept)
    return jnp.where((temperature > 0)[:, None], probs, greedy)


ONEHOT = "onehot"  # `accept`'s q for deterministic drafts: q_j is the one-hot of d_j


def accept(drafts, q, p, u, residual_keys, spec_lens, greedy):
    """The speculative acceptance rule -> (accepted [B] int32, tokens [B, k+1] int32).

    drafts [B, k] int32: proposed tokens, d_j ~ q[:, j];  q [B, k, V]: the draft distributions
    (None for an all-greedy batch: then every row must be greedy; ONEHOT for deterministic
    drafts, q_j = one-hot(d_j), never materialised);  p [B, k+1, V]: the target's
    distributions at the k+1 verified positions;  u [B, k] uniform [0, 1);  residual_keys [B]
    PRNG keys (one draw per row);  spec_lens [B]: drafts row b may keep (<= k, the rest are
    ignored);  greedy [B] bool.  tokens[b, :accepted[b]] are the kept drafts, tokens[b,
    accepted[b]] the corrected or bonus token, -1 after it."""
    B, k = drafts.shape
    rows = jnp.arange(B)
    target_argmax = jnp.argmax(p, axis=-1).astype(jnp.int32)  # [B, k+1]
    if q is None:
        ok = drafts == target_argmax[:, :k]
    else:
        p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
        q_d = 1.0 if q is ONEHOT else jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
        ok = jnp.where(greedy[:, None], drafts == target_argmax[:, :k], u * q_d < p_d)
    ok &= jnp.arange(k)[None, :] < spec_lens[:, None]
    n = jnp.cumprod(ok.astype(jnp.int32), axis=-1).sum(-1).astype(jnp.int32)  # [B]
    p_n = p[rows, n]  # [B, V]
    if q is None:
        last = target_argmax[rows, n]
    else:
        rejected = n < spec_lens
        if q is ONEHOT:  # p_n less the rejected draft's entry
            d_n = drafts[rows, jnp.minimum(n, k - 1)]
            residual = p_n.at[rows, d_n].set(jnp.where(rejected, 0.0, p_n[rows, d_n]))
        else:
            residual = jnp.maximum(p_n - jnp.where(rejected[:, None], q[rows, jnp.minimum(n, k - 1)], 0.0), 0.0)
        mass = residual.sum(-1, keepdims=True)
        residual = jnp.where(mass > 0, residual, p_n)  # p == q where it rejected: only rounding gets here
        drawn = jax.vmap(lambda key, r: jax.random.categorical(key, jnp.log(r)))(residual_keys, residual)
        last = jnp.where(greedy, target_argmax[rows, n], drawn.astype(jnp.int32))
    j = jnp.arange(k + 1)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1)
    tokens = jnp.where(j < n[:, None], padded, jnp.where(j == n[:, None], last[:, None], -1))
    return n, tokens.astype(jnp.int32)


def draw(keys, probs, greedy):
    """One token per row from probs [B, V] (greedy rows: the argmax) -> [B] int32."""
    drawn = jax.vmap(lambda key, pr: jax.random.categorical(key, jnp.log(pr)))(keys, probs)
    return jnp.where(greedy, jnp.argmax(probs, axis=-1), drawn).astype(jnp.int32)


__all__ = ["ONEHOT", "accept", "draw", "row_probs"]
