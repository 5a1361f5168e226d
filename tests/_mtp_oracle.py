"""The dense oracle of the speculative method "mtp" tests: what a request's MTP head should hold
and propose, cache-free, from the request's own tokens.

    greedy        the target's greedy continuation (what the engine without speculation makes)
    drafts        d_1 from (x_{i+1}, h_i) at the last computed position, then chained on the
                  head's own output, as runner/mtp.py chains them
    head entries  the head's K/V at every computed position i, from (x_{i+1}, h_i): compared
                  with the rows the request's page table maps in the arena, so an entry made
                  with another request's next token (a stale prefix-cache page) shows at once,
                  where a draft's argmax often survives it
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

DENSE = 160  # the oracle's padded length (one compile)


class DenseOracle:
    def __init__(self, target, head=None):
        tg, hg = target.graphdef, None if head is None else head.graphdef
        positions = jnp.arange(DENSE, dtype=jnp.int32)[None]

        def hiddens(tp, toks):
            t = nnx.merge(tg, tp)
            h = t.embed(toks)
            for layer in t.layers:
                h = layer.dense(h, positions, jnp.ones(toks.shape, bool))
            return t.final_norm(h)

        def head_kv(tp, hp, nxt, hid):
            """The head's attention layer's K/V rows [T, Hkv, D] (its first layer attends: Qwen's
            decoder layer, NemotronH's attention block)."""
            t, h = nnx.merge(tg, tp), nnx.merge(hg, hp)
            layer = h.layers[0]
            norm = layer.input_layernorm if hasattr(layer, "input_layernorm") else layer.norm
            _, k, v, _ = layer.mixer.project(norm(h.fuse_inputs(t.embed(nxt), hid)), positions)
            return k[0], v[0]

        self.hiddens = jax.jit(hiddens)
        self.logits = jax.jit(lambda tp, normed: nnx.merge(tg, tp).head_logits(normed))
        self.head = jax.jit(lambda tp, hp, toks, hid: nnx.merge(hg, hp).dense(toks, hid, nnx.merge(tg, tp)))
        self.head_kv = jax.jit(head_kv)
        self.target, self.head_model = target, head

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """The target's greedy continuation, cache-free."""
        toks = np.zeros((1, DENSE), np.int32)
        seq = list(prompt)
        for _ in range(n):
            toks[0, :len(seq)] = seq
            normed = self.hiddens(self.target.params, jnp.asarray(toks))[:, len(seq) - 1]
            seq.append(int(np.asarray(self.logits(self.target.params, normed)).argmax()))
        return seq[len(prompt):]

    def _inputs(self, seq: list[int]):
        """The head's inputs at positions 0..n-1 (n = len(seq) - 1): x_{i+1} and h_i."""
        n = len(seq) - 1
        toks = np.zeros((1, DENSE), np.int32)
        toks[0, :n + 1] = seq
        hid = np.asarray(self.hiddens(self.target.params, jnp.asarray(toks)))
        nxt, h = np.zeros((1, DENSE), np.int32), np.zeros_like(hid)
        nxt[0, :n] = seq[1:]
        h[0, :n] = hid[0, :n]
        return n, nxt, h

    def drafts(self, seq: list[int], k: int):
        """seq: the request's tokens, the pending one last -> (drafts [k], the logits each came from)."""
        n, nxt, h = self._inputs(seq)  # the pending token's position n; the head's last entry is n - 1
        out, logits = [], []
        for j in range(k):
            lg, y = self.head(self.target.params, self.head_model.params, jnp.asarray(nxt), jnp.asarray(h))
            lg, y = np.asarray(lg[0, n - 1 + j]), np.asarray(y[0, n - 1 + j])
            d = int(lg.argmax())
            out.append(d)
            logits.append(lg)
            nxt[0, n + j], h[0, n + j] = d, y
        return out, logits

    def head_entries(self, seq: list[int], upto: int):
        """The head's (K, V) rows at positions 0..upto-1 of the sequence `seq` (upto < len(seq))."""
        _, nxt, h = self._inputs(seq[:upto + 1])
        k, v = self.head_kv(self.target.params, self.head_model.params, jnp.asarray(nxt), jnp.asarray(h))
        return np.asarray(k[:upto]), np.asarray(v[:upto])


def check_drafts(oracle, req, checked: list) -> None:
    """req.drafts against the oracle: each equals its argmax (or ties it within 1e-3: fp32 on
    other kernels), until a tie sends the chain elsewhere."""
    seq = list(req.prompt_token_ids) + list(req.output_token_ids)
    want, logits = oracle.drafts(seq, len(req.drafts))
    for d, w, lg in zip(req.drafts, want, logits):
        assert lg[d] >= lg.max() - 1e-3, (req.request_id, len(seq), req.drafts, want)
        checked.append(len(req.drafts))
        if d != w:
            break


def check_head_entries(oracle, engine, req, width: int) -> None:
    """Every head K/V row the request reads -- positions 0..num_computed-1, shared cached pages
    and its own -- equals the oracle's from the request's own tokens (fp32 rows: 1e-4 of the
    rows' scale; a stale entry, made from another token, is off by the scale itself)."""
    from umem_jax.arena import read_kv

    assert not engine.allocator.layout.moves, "moves still queued: the tables are ahead of the arena"
    runner = engine.runner
    pool = runner.speculator._leaves()[4].pool
    n = req.num_computed
    table = engine.allocator.translate_pages(np.asarray([req.pages], np.int64), pool, width)
    k, v = (np.asarray(a[0, :n], np.float32) for a in read_kv(runner.arena, table, layer=0, model="draft"))
    seq = list(req.prompt_token_ids) + list(req.output_token_ids)
    want_k, want_v = oracle.head_entries(seq, n)
    for got, want in ((k, want_k), (v, want_v)):
        err = np.abs(got - want).max(axis=(1, 2)) / np.abs(want).max()
        assert (err < 1e-4).all(), (req.request_id, req.num_cached_tokens, np.flatnonzero(err >= 1e-4), err.max())


__all__ = ["DENSE", "DenseOracle", "check_drafts", "check_head_entries"]
