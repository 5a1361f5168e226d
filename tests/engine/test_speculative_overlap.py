"""Overlapped speculative steps (issue 16): a decode step launched before the previous one is read
back shifts its rows on the device by the accepted counts.  The device half against the host's
own rules (decode_fields, commit_on_device), then the engine: steps really overlap, sampled and
greedy output equal the read-back-every-step run token for token, and requests aborted or
retracted while their step is in flight lose nothing and leak nothing."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _engine_utils import assert_idle_clean, noisy_copy, prompts  # noqa: E402

from umem_jax import LLM, SamplingParams  # noqa: E402
from umem_jax.runner.shift import commit_on_device, decode_fields, next_tokens  # noqa: E402
from umem_jax.runner.speculative import SpecLaunched  # noqa: E402
from umem_jax.scheduler.speculation import commit_state  # noqa: E402

SHAPES = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=4, max_model_len=256, batch_buckets=(4,),
              token_buckets=(32,), page_buckets=(64,))
K = 3


# ---------------------------------------------------------------------- the device half


def _prev(rng, rows: int, k: int):
    """A decode output [rows, k+3]: accepted a <= verified s, tokens (-1 past a+1), s last."""
    s = rng.integers(0, k + 1, rows)
    a = np.array([rng.integers(0, x + 1) for x in s])
    toks = rng.integers(0, 1000, (rows, k + 1))
    toks[np.arange(k + 1)[None, :] > a[:, None]] = -1
    return np.concatenate([a[:, None], toks, s[:, None]], axis=1).astype(np.int32), a, s, toks


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_fields_shift_rows_by_the_accepted_count(seed):
    rng = np.random.default_rng(seed)
    B, k, M = 6, 4, 8
    prev, a, s, toks = _prev(rng, M, k)
    src = rng.permutation(M)[:B].astype(np.int32)
    src[rng.random(B) < 0.4] = -1  # their pending token is on the host
    f = {"src": src, "tokens": rng.integers(0, 1000, (B, 1)).astype(np.int32),
         "kv_lens": rng.integers(1, 50, B).astype(np.int32), "step": rng.integers(0, 20, B).astype(np.int32)}
    got, shift, verified, _ = decode_fields({n: jnp.asarray(v) for n, v in f.items()}, jnp.asarray(prev))
    on = src >= 0
    want_a = np.where(on, a[np.maximum(src, 0)], 0)
    np.testing.assert_array_equal(shift, want_a)
    np.testing.assert_array_equal(verified, np.where(on, s[np.maximum(src, 0)], 0))
    np.testing.assert_array_equal(got["kv_lens"], f["kv_lens"] + want_a)
    np.testing.assert_array_equal(got["step"], f["step"] + want_a)
    want_t = np.where(on, toks[np.maximum(src, 0), want_a], f["tokens"][:, 0])  # the last token emitted
    np.testing.assert_array_equal(got["tokens"][:, 0], want_t)
    assert (np.asarray(got["src"]) == -1).all()
    # a plain step after it reads the same token (next_tokens), rows beyond it a padding 0
    np.testing.assert_array_equal(np.asarray(next_tokens(jnp.asarray(prev)))[src[on]], want_t[on])


class _Req:
    def __init__(self, slots):
        self.slots = list(slots)


@pytest.mark.parametrize("seed", [0, 1])
def test_commit_on_device_makes_the_host_swap(seed):
    """For every (accepted, verified) pair the device's working and speculative slots equal the
    host's commit_state on the same slot list."""
    rng = np.random.default_rng(seed)
    k = 3
    pairs = [(a, s) for s in range(k + 1) for a in range(s + 1)]
    B = len(pairs)
    slots = rng.permutation(100)[: B * (k + 1)].reshape(B, k + 1).astype(np.int32) + 1
    a = jnp.asarray([p[0] for p in pairs], jnp.int32)
    s = jnp.asarray([p[1] for p in pairs], jnp.int32)
    pos = jnp.full((B, k), -1, jnp.int32)
    f, (_, spec) = commit_on_device({"slots": jnp.asarray(slots[:, 0])}, (pos, jnp.asarray(slots[:, 1:])), a, s)
    for b, (ab, sb) in enumerate(pairs):
        req = _Req(slots[b])
        commit_state(req, ab, sb)
        assert [int(f["slots"][b])] + np.asarray(spec[b]).tolist() == req.slots, (ab, sb)


# ---------------------------------------------------------------------- the engine


@functools.lru_cache(maxsize=None)
def _target():
    from umem_jax.models.loader import load_model

    return load_model("tiny-attention")


@functools.lru_cache(maxsize=None)
def _draft():
    """The target with noise on every weight: it agrees with the target on some tokens only."""
    return noisy_copy(_target(), 0.5)


def _engine(overlap: bool, arena: int = 600 << 10):
    spec = {"method": "draft", "model": _draft(), "num_speculative_tokens": K, "min_acceptance": 0.0}
    return LLM(_target(), arena_bytes=arena, speculative_config=spec, async_scheduling=overlap, **SHAPES)


def _work():
    vocab = _target().config.vocab_size
    return [[t % vocab for t in p] for p in prompts(40, 9, 30, 17, seed=11)]


def _drive(llm, work, params, hook=None):
    """engine.step() until done -> (outputs in order, steps that left a speculative step in flight)."""
    eng = llm.llm_engine
    ids = [eng.add_request(p, q) for p, q in zip(work, params)]
    outs, overlapped, steps = {}, 0, 0
    while eng.has_unfinished_requests():
        outs.update((o.request_id, o) for o in eng.step())
        steps += 1
        overlapped += isinstance(eng._inflight, SpecLaunched)
        if hook is not None:
            hook(eng, steps)
    return [outs[i] for i in ids], overlapped


def test_overlapped_steps_give_the_read_back_runs_tokens():
    """Greedy and seeded sampled rows (rejection sampling: its keys follow each row's step, which
    the device moves on by the accepted count) with min_tokens and logprobs, in an arena where
    nothing retracts: the same tokens and logprobs with and without the overlap, and the overlap
    happened.  A sampled row's last 2(k+1) tokens may differ: near max_tokens the overlapped step
    speculates fewer drafts (it is placed as if the step in flight accepted all of its), so
    those positions are verified in other passes and drawn with other keys."""
    work = _work()
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.9, top_k=20, max_tokens=28, seed=5, ignore_eos=True),
              SamplingParams(temperature=0.7, max_tokens=30, seed=9, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0, max_tokens=25, min_tokens=4)]
    runs = []
    for overlap in (False, True):
        llm = _engine(overlap)
        outs, overlapped = _drive(llm, work, params)
        assert all(o.error is None for o in outs), [o.error for o in outs]
        assert_idle_clean(llm)
        st = llm.llm_engine.stats()
        assert 0 < st["speculative"]["acceptance_rate"] < 1 and st["num_retractions"] == 0, st
        runs.append((outs, overlapped))
    (sync, n_sync), (over, n_over) = runs
    assert n_sync == 0 and n_over > 5, (n_sync, n_over)
    for a, b, p in zip(sync, over, params):
        n = p.max_tokens - (2 * (K + 1) if p.temperature > 0 else 0)
        assert list(a.outputs[0].token_ids)[:n] == list(b.outputs[0].token_ids)[:n], a.request_id
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
        if a.outputs[0].logprobs:
            for x, y in list(zip(a.outputs[0].logprobs, b.outputs[0].logprobs))[:n]:
                assert x.keys() == y.keys()
                np.testing.assert_allclose([x[t].logprob for t in x], [y[t].logprob for t in x], rtol=1e-5, atol=1e-6)


def test_abort_and_retract_while_a_step_is_in_flight():
    """A request aborted and one retracted while their speculative step is in flight: the others'
    greedy tokens are unchanged, the retracted one resumes and ends with the same tokens, no
    page or slot leaks."""
    work = _work()
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True) for _ in work]
    want, _ = _drive(_engine(False), work, params)
    llm = _engine(True)
    done = {}

    def hook(eng, steps):
        flying = eng._inflight
        if not isinstance(flying, SpecLaunched) or steps < 4:
            return
        reqs = [row.req for row in flying.batch.rows if not row.req.finished]
        if "abort" not in done and reqs:
            done["abort"] = reqs[0].request_id
            eng.abort_request(reqs[0].request_id)
        elif "retract" not in done and len(reqs) > 1 and reqs[-1] in eng.scheduler.running:
            done["retract"] = reqs[-1].request_id
            eng.scheduler.retract(reqs[-1])

    got, overlapped = _drive(llm, work, params, hook)
    assert overlapped and {"abort", "retract"} <= done.keys(), done
    assert llm.llm_engine.scheduler.num_retractions >= 1
    for w, g in zip(want, got):
        if g.request_id == done["abort"]:
            assert g.outputs[0].finish_reason == "abort"
            n = len(g.outputs[0].token_ids)
            assert list(g.outputs[0].token_ids) == list(w.outputs[0].token_ids)[:n]
        else:
            assert g.error is None and list(g.outputs[0].token_ids) == list(w.outputs[0].token_ids), g.request_id
    assert_idle_clean(llm)


def test_a_failing_row_fails_alone_while_steps_overlap(monkeypatch):
    """The verify raises for every decode batch holding one marked request (after its draft
    passes ran): the batch is relaunched in halves, each part still shifted by the step in
    flight (engine/isolation.py), the marked request fails alone and the others' greedy tokens
    are unchanged."""
    work = _work()
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True) for _ in work]
    want, _ = _drive(_engine(False), work, params)
    llm = _engine(True)
    eng = llm.llm_engine
    sp, seen, failed = eng.runner.speculator, {}, []
    prepare, verify = eng.runner.prepare, sp._verify_call

    def spy(batch):
        seen["batch"] = batch
        return prepare(batch)

    def failing(fn, *a, **kw):
        b = seen["batch"]
        if b.kind == "decode" and any(r.req.prompt_token_ids == work[1] and r.req.num_output >= 3 for r in b.rows):
            failed.append(len(b.rows))
            raise RuntimeError("injected verify failure")
        return verify(fn, *a, **kw)

    monkeypatch.setattr(eng.runner, "prepare", spy)
    monkeypatch.setattr(sp, "_verify_call", failing)
    got, overlapped = _drive(llm, work, params)
    assert overlapped and max(failed) > 1 and min(failed) == 1, failed  # bisected down to the marked row
    for i, (w, g) in enumerate(zip(want, got)):
        if i == 1:
            assert g.outputs[0].finish_reason == "abort" and "injected" in g.error
        else:
            assert g.error is None and list(g.outputs[0].token_ids) == list(w.outputs[0].token_ids), i
    monkeypatch.undo()
    assert_idle_clean(llm)
