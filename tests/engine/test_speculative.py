"""Speculative decoding with a draft model (issue 16): greedy output identical to greedy without,
through chunked prefill, retraction and prefix-cache hits; the acceptance rule keeps the target's
distribution (chi-square); refusals; invariants and the idle leak check after each run."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sps

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _engine_utils import assert_idle_clean, compiled_steps, noisy_copy, prompts  # noqa: E402

from umem_jax import LLM, SamplingParams  # noqa: E402
from umem_jax.pallas_kernels.short_extend import SHORT_EXTEND_ENV  # noqa: E402
from umem_jax.runner.acceptance import accept, row_probs  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
FIXTURE = FIXTURES / "gemma3_tiny"
LOCAL = {"gemma": FIXTURE, "gpt_oss": FIXTURES / "gpt_oss_tiny"}  # test names of fixture checkpoints
# One shape per dimension (one compile per step kind); an arena small enough that four long
# requests with a draft's K/V beside the target's retract.
SPEC = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=4, max_model_len=256, batch_buckets=(4,),
            token_buckets=(32,), page_buckets=(64,))
K = 3
MAX_TOKENS = 16
# The verify's form (decode rows or a prefill, conftest.decode_row_verify) is read when a step is
# traced and keys it.  The tests whose greedy runs of the tiny attention model at 250 KiB share
# the steps test_greedy_with_speculation_is_greedy_without compiles (n / best_of, the draft's
# cache hits, the warm-up, switching off) take its decode_row_verify too: one greedy set of
# steps in this file instead of one per verify form (~6 s of compiles each).  The prefill form
# stays in the sampling, logprobs and penalties tests here and in the speculative soak.


@functools.lru_cache(maxsize=None)
def _model(name: str):
    from umem_jax.models.loader import load_model

    return load_model(str(LOCAL.get(name, name)))


@functools.lru_cache(maxsize=None)
def _perturbed(name: str, scale: float = 0.5):
    """The target with noise on every weight: a draft that agrees with it on some tokens only."""
    return noisy_copy(_model(name), scale)


def _workload(vocab: int):
    """Long prompts (chunked: > 32 tokens), two sharing a 40-token prefix (a cache hit)."""
    shared = [t % vocab for t in prompts(40, seed=3)[0]]
    ps = [[t % vocab for t in p] for p in prompts(70, 9, 45, seed=5)]
    return [shared + ps[1], ps[0], shared + [7, 8, 9, 10], ps[2], ps[1]]


def _run(target, arena, draft=None, params=None, **kw):
    spec = None if draft is None else {"method": "draft", "model": draft, "num_speculative_tokens": K, "min_acceptance": 0.0}
    llm = LLM(target, arena_bytes=arena, speculative_config=spec, **SPEC, **kw)
    work = _workload(target.config.vocab_size)
    params = params or SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = llm.generate(work, params)
    outs += llm.generate(work[:1], params[:1] if isinstance(params, list) else params)  # its whole prompt is cached by now: a prefix-cache hit
    assert all(o.error is None for o in outs), [o.error for o in outs]
    assert_idle_clean(llm)
    return [o.outputs[0].token_ids for o in outs], llm.llm_engine.stats()


@functools.lru_cache(maxsize=None)
def _greedy(name: str, arena: int) -> list:
    """The workload's greedy tokens without speculation (the reference of several tests: run once).
    Traced without decode_row_verify's variable, which keys a step but changes no plain one (their
    chunks are 32 tokens or 1), so these steps are the ones the penalties test's plain engine runs."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(SHORT_EXTEND_ENV, raising=False)
        return _run(_model(name), arena)[0]


@functools.lru_cache(maxsize=None)
def _plain(n: int, logprobs: int | None = None, penalties: bool = False) -> list:
    """The first n prompts of the workload at 250 KiB without speculation: the logprobs and the
    penalties tests' reference, the same for both drafts (run once) -> RequestOutputs."""
    target = _model("tiny-attention")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=logprobs, **(PENALTIES if penalties else {}))
    return LLM(target, arena_bytes=250 << 10, **SPEC).generate(_workload(target.config.vocab_size)[:n], params)


# The tiny attention model's run retracts and hits the prefix cache; the Gemma 3 fixture's run
# (short windows) does neither at an arena that admits the 70-token prompt: chunked prefill only.
# gpt-oss (window 8 beside full attention, sinks, MoE) at an arena that clips no output (below
# ~80 KiB the draft's K/V shorten the 70-token prompt's max_tokens): a verify's rows cross windows.
@pytest.mark.parametrize("name,arena,retracts", [("tiny-attention", 250 << 10, True), ("gemma", 175 << 10, False),
                                                 ("gpt_oss", 128 << 10, False)])
def test_greedy_with_speculation_is_greedy_without(name, arena, retracts, decode_row_verify):
    target = _model(name)
    want = _greedy(name, arena)
    assert all(len(t) == MAX_TOKENS for t in want)
    got, st = _run(target, arena, draft=target)  # its own draft: every draft is the target's token
    assert got == want
    s = st["speculative"]
    assert s["acceptance_rate"] == 1.0 and s["mean_accepted_length"] > 2.5, s
    assert (st["num_retractions"] > 0 and st["prefix_cache"]["hit_tokens"] > 0) or not retracts, st
    # gpt-oss's router flips under the 0.5 noise of the others: its draft would accept nothing
    got, st = _run(target, arena, draft=_perturbed(name, 0.1 if name == "gpt_oss" else 0.5))
    assert got == want
    s = st["speculative"]
    assert 0.0 < s["acceptance_rate"] < 1.0, s
    assert len(s["acceptance_per_position"]) == K and s["draft_time_s"] > 0 and s["verify_time_s"] > 0


def test_sampling_with_speculation_runs_clean():
    target = _model("tiny-attention")
    params = [SamplingParams(temperature=0.8, top_k=20 if i % 2 else 0, max_tokens=16, seed=i) for i in range(5)]
    got, st = _run(target, 250 << 10, draft=_perturbed("tiny-attention"), params=params)
    assert all(len(t) == 16 and all(0 <= x < target.config.vocab_size for x in t) for t in got)
    assert st["speculative"]["num_verify_rows"] > 0


# ---------------------------------------------------------------------- the acceptance rule


def _chi2_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=probs.size)
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    expected = probs[keep].astype(np.float64) / probs[keep].astype(np.float64).sum() * counts[keep].sum()
    return sps.chisquare(counts[keep].astype(np.float64), expected).pvalue


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rejection_sampling_keeps_the_target_distribution(seed):
    """Over many rows with the same p and q: the first emitted token is distributed as p_0, the
    token after an accepted first draft as p_1 (each position's p fixed here), the bonus as p_k."""
    rng = np.random.default_rng(seed)
    V, k, N = 6, 2, 40000
    p = rng.dirichlet(np.ones(V) * 0.7, size=k + 1).astype(np.float32)
    q = rng.dirichlet(np.ones(V) * 0.7, size=k).astype(np.float32)
    key = jax.random.PRNGKey(seed)
    kd, ku, kr = jax.random.split(key, 3)
    drafts = jax.random.categorical(kd, jnp.log(jnp.asarray(q))[None].repeat(N, 0), axis=-1).astype(jnp.int32)
    P = jnp.broadcast_to(jnp.asarray(p), (N, k + 1, V))
    Q = jnp.broadcast_to(jnp.asarray(q), (N, k, V))
    u = jax.random.uniform(ku, (N, k))
    n, toks = jax.jit(accept)(drafts, Q, P, u, jax.random.split(kr, N), jnp.full((N,), k, jnp.int32),
                              jnp.zeros((N,), bool))
    n, toks = np.asarray(n), np.asarray(toks)
    assert _chi2_pvalue(toks[:, 0], p[0]) > 1e-3
    assert _chi2_pvalue(toks[n >= 1, 1], p[1]) > 1e-3
    assert _chi2_pvalue(toks[n == k, k], p[k]) > 1e-3
    # acceptance of the first draft happens with probability sum_x min(p0, q0)
    assert abs((n >= 1).mean() - np.minimum(p[0], q[0]).sum()) < 0.015
    assert ((toks >= 0).sum(1) == n + 1).all()


def test_acceptance_greedy_is_exact_and_respects_spec_lens():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, 4, 10)), jnp.float32)
    top = np.asarray(jnp.argmax(logits, -1))
    drafts = jnp.asarray([[top[0, 0], top[0, 1], top[0, 2]], [top[1, 0], (top[1, 1] + 1) % 10, top[1, 2]],
                          [top[2, 0], top[2, 1], top[2, 2]]], jnp.int32)
    n, toks = accept(drafts, None, logits, None, None, jnp.asarray([3, 3, 1]), jnp.ones(3, bool))
    assert np.asarray(n).tolist() == [3, 1, 1]
    assert np.asarray(toks).tolist() == [top[0].tolist(), [top[1, 0], top[1, 1], -1, -1],
                                         [top[2, 0], top[2, 1], -1, -1]]
    t = jnp.zeros(3)
    p = row_probs(logits[:, 0], t, jnp.zeros(3, jnp.int32), jnp.ones(3), jnp.zeros(3))
    assert (np.asarray(p).argmax(-1) == top[:, 0]).all() and np.allclose(np.asarray(p).sum(-1), 1)


def test_row_probs_cuts_match_the_sampler_rule():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(2, 12)) * 2, jnp.float32)
    p = np.asarray(row_probs(logits, jnp.asarray([1.0, 0.7]), jnp.asarray([3, 0]), jnp.asarray([1.0, 0.8]),
                             jnp.zeros(2)))
    assert (p[0] > 0).sum() == 3 and np.isclose(p[0].sum(), 1)
    full = np.asarray(jax.nn.softmax(logits[1] / 0.7))
    order = np.argsort(-full)
    kept = order[: int(np.searchsorted(np.cumsum(full[order]), 0.8) + 1)]
    assert set(np.flatnonzero(p[1])) == set(kept.tolist())


# ---------------------------------------------------------------------- refusals


@pytest.mark.parametrize("spec,match", [
    ({"method": "mtp"}, "UmemTinyHybrid has no MTP layers"),  # method mtp: tests/engine/test_speculative_mtp.py
    ({"method": "eagle", "model": "x"}, "method must be one of"),
    ({"model": "tiny-attention", "num_speculative_tokens": 9}, "1..8"),
    ({"model": "tiny-attention", "num_speculative_tokens": 0}, "1..8"),
    ({"num_speculative_tokens": 2}, "needs the draft model"),
])
def test_bad_speculative_configs_are_refused(spec, match):
    with pytest.raises(ValueError, match=match):
        LLM("tiny-attention", arena_bytes=1 << 20, speculative_config=spec)


@pytest.mark.parametrize("spec,match", [
    # vLLM's Python users pass fields of its SpeculativeConfig that this engine lacks: a ValueError
    # naming them (as the CLI's --speculative-config does), not a TypeError from the dataclass
    ({"model": "tiny-attention", "draft_tensor_parallel_size": 1}, r"\['draft_tensor_parallel_size'\]"),
    ({"model": "tiny-attention", "num_speculative_tokens": True}, "num_speculative_tokens must be an int"),
    ({"model": "tiny-attention", "probe_steps": True}, "probe_steps must be an int"),
    ({"model": "tiny-attention", "min_acceptance": "0.3"}, "min_acceptance must be"),
    ({"model": "tiny-attention", "min_acceptance": True}, "min_acceptance must be"),
])
def test_bad_speculative_fields_are_refused_naming_the_field(spec, match):
    from umem_jax.engine.config import EngineConfig

    with pytest.raises(ValueError, match=match):  # EngineConfig alone: refused before any model is loaded
        EngineConfig(model="tiny-attention", speculative_config=spec)


def test_unsupported_pairs_are_refused_with_the_reason():
    # (a target with recurrent state is served: tests/engine/test_speculative_state.py)
    with pytest.raises(ValueError, match="draft that has recurrent layers .* not supported yet"):
        LLM("tiny-attention", arena_bytes=1 << 20, speculative_config={"model": "tiny"})
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(_model("gemma"), arena_bytes=1 << 20, speculative_config={"model": "tiny-attention"})
    with pytest.raises(ValueError, match="max_num_batched_tokens=2 is below"):
        LLM("tiny-attention", arena_bytes=1 << 20, max_num_batched_tokens=2, token_buckets=(2,),
            speculative_config={"model": "tiny-attention"})


def _logprob_table(out):
    """Per output token: (token, its logprob, its rank, [(id, logprob) of the top ones by rank])."""
    rows = []
    for t, d in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        top = sorted((v.rank, i, v.logprob) for i, v in d.items() if i != t or v.rank is not None)
        rows.append((t, d[t].logprob, d[t].rank, [(i, lp) for _, i, lp in top]))
    return rows


@pytest.mark.parametrize("draft", ["self", "perturbed"])
def test_logprobs_with_speculation_are_logprobs_without(draft):
    """Every emitted token's logprobs (the chosen one, its rank, the top 3) equal the run without
    speculation's: accepted drafts, corrections and bonus tokens alike, the prefill's first token too."""
    target = _model("tiny-attention")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=3)
    work = _workload(target.config.vocab_size)[:3]
    want = _plain(3, logprobs=3)
    d = target if draft == "self" else _perturbed("tiny-attention")
    llm = LLM(target, arena_bytes=250 << 10, **SPEC,
              speculative_config={"model": d, "num_speculative_tokens": K, "min_acceptance": 0.0})
    got = llm.generate(work, params)
    s = llm.llm_engine.stats()["speculative"]
    assert s["mean_accepted_length"] > (2.5 if draft == "self" else 0.0), s
    for g, w in zip(got, want):
        assert g.error is None and g.outputs[0].token_ids == w.outputs[0].token_ids
        gl, wl = _logprob_table(g), _logprob_table(w)
        assert len(gl) == MAX_TOKENS == len(wl)
        for (gt, glp, grank, gtop), (wt, wlp, wrank, wtop) in zip(gl, wl):
            assert gt == wt and grank == wrank == 1 and [i for i, _ in gtop] == [i for i, _ in wtop]
            np.testing.assert_allclose([glp] + [v for _, v in gtop], [wlp] + [v for _, v in wtop], rtol=1e-4, atol=1e-4)
        assert g.outputs[0].cumulative_logprob == pytest.approx(w.outputs[0].cumulative_logprob, abs=1e-3)
    assert_idle_clean(llm)


def test_n_and_best_of_with_speculation(decode_row_verify):
    """n > 1 and best_of samples are requests of their own, each speculating alone: greedy n = 3
    gives the run without speculation's output three times; sampled n = 3 and best_of = 3 finish
    with distinct, in-vocabulary samples; nothing leaks."""
    target = _model("tiny-attention")
    work = _workload(target.config.vocab_size)[:2]
    want = _greedy("tiny-attention", 250 << 10)[:2]  # the shared reference (greedy is per request); its arena
    # and its verify form (decode_row_verify), so the greedy steps of the speculative engine are the ones
    # test_greedy_with_speculation_is_greedy_without compiles
    llm = LLM(target, arena_bytes=250 << 10, **SPEC,
              speculative_config={"model": _perturbed("tiny-attention"), "num_speculative_tokens": K, "min_acceptance": 0.0})
    got = llm.generate(work, SamplingParams(n=3, temperature=0, max_tokens=MAX_TOKENS))
    assert [[c.token_ids for c in o.outputs] for o in got] == [[w] * 3 for w in want]
    # Both sampled requests ask for logprobs: every batch of their rows is then one step layout
    # (random sampling with logprobs), one compile instead of two (with and without logprobs).
    got = llm.generate(work, [SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=MAX_TOKENS, logprobs=1),
                              SamplingParams(best_of=3, temperature=0.9, seed=6, max_tokens=MAX_TOKENS, logprobs=1)])
    assert [len(o.outputs) for o in got] == [3, 1] and all(o.error is None for o in got)
    samples = [c.token_ids for c in got[0].outputs]
    assert all(len(t) == MAX_TOKENS and all(0 <= x < target.config.vocab_size for x in t) for t in samples)
    assert len({tuple(t) for t in samples}) > 1
    assert all(len(c.logprobs) == MAX_TOKENS for o in got for c in o.outputs)
    assert llm.llm_engine.stats()["speculative"]["num_verify_rows"] > 0
    assert_idle_clean(llm)


def test_verify_penalties_match_the_plain_rule_at_each_position():
    """Position j's penalized logits equal apply_penalties with the output counts plus d_1..d_j
    (drafts repeat tokens, and some were in the prompt / output already)."""
    from umem_jax.runner.sampler import apply_penalties
    from umem_jax.runner.speculative import verify_penalties

    rng = np.random.default_rng(np.random.randint(1 << 30))
    B, k, V = 5, 4, 37
    logits = jnp.asarray(rng.normal(size=(B, k + 1, V)) * 3, jnp.float32)
    prompt = jnp.asarray(rng.integers(0, 2, (B, V)), jnp.float32)
    output = jnp.asarray(rng.integers(0, 3, (B, V)) * (rng.random((B, V)) < 0.3), jnp.float32)
    drafts = rng.integers(0, 6, (B, k)).astype(np.int32)  # few distinct ids: repeats within a row
    f = {"repetition_penalty": jnp.asarray(rng.uniform(1.0, 2.0, B), jnp.float32),
         "presence_penalty": jnp.asarray(rng.uniform(-1, 1, B), jnp.float32),
         "frequency_penalty": jnp.asarray(rng.uniform(-1, 1, B), jnp.float32)}
    got = np.asarray(verify_penalties(logits, (prompt, output), jnp.asarray(drafts), f))
    for j in range(k + 1):
        seen = np.zeros((B, V), np.float32)
        for b in range(B):
            for d in drafts[b, :j]:
                seen[b, d] += 1
        want = apply_penalties(logits[:, j], prompt, output + seen, f["repetition_penalty"], f["presence_penalty"],
                               f["frequency_penalty"])
        np.testing.assert_allclose(got[:, j], np.asarray(want), rtol=1e-6, atol=1e-6)


PENALTIES = dict(repetition_penalty=1.6, presence_penalty=0.5, frequency_penalty=0.4)


@pytest.mark.parametrize("draft", ["self", "perturbed"])
def test_greedy_with_penalties_and_speculation_is_greedy_without(draft):
    """Penalties change the output here, and the speculative run makes the same tokens: each
    verified position is penalized with the counts it follows, the prefill's first token too."""
    target = _model("tiny-attention")
    work = _workload(target.config.vocab_size)[:4]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **PENALTIES)
    want = [o.outputs[0].token_ids for o in _plain(4, penalties=True)]
    assert want != _greedy("tiny-attention", 250 << 10)[:4]  # the shared unpenalized reference (greedy is per request)
    d = target if draft == "self" else _perturbed("tiny-attention")
    llm = LLM(target, arena_bytes=250 << 10, **SPEC, speculative_config={"model": d, "num_speculative_tokens": K, "min_acceptance": 0.0})
    got = llm.generate(work, params)
    assert [o.outputs[0].token_ids for o in got] == want
    s = llm.llm_engine.stats()["speculative"]
    assert s["mean_accepted_length"] > 0.0 and s["num_verify_rows"] > 0, s
    assert_idle_clean(llm)


def test_draft_model_hits_are_unchanged_by_speculation(decode_row_verify):
    """A draft model's K/V at position i depends on tokens <= i, like the target's, so its cache
    keys pages without the next token (cache_lookahead 0; an MTP head's keys hold it:
    test_speculative_mtp.py).  A = P + [5, ...], B = P + [6, ...], C = P + [7, ...] (P: eight
    pages, left exactly at its end), then A again, one at a time: the same hits as without
    speculation -- none for B (no anchor near 32 kept A's window rows there), all of P for C
    (B made 32 a branch point; keyed with the next token it would be 28), A's prompt up to its
    last page boundary for A again."""
    target = _model("tiny-attention")
    vocab = target.config.vocab_size
    p = [t % vocab for t in prompts(32, seed=11)[0]]
    a, b, c = (p + [x] + [t % vocab for t in q] for x, q in zip((5, 6, 7), prompts(12, 7, 7, seed=12)))
    hits = []
    for spec in (None, {"method": "draft", "model": target, "num_speculative_tokens": K, "min_acceptance": 0.0}):
        llm = LLM(target, arena_bytes=250 << 10, speculative_config=spec, **SPEC)
        assert llm.llm_engine.scheduler.cache.lookahead == 0
        params = SamplingParams(temperature=0, max_tokens=8)
        hits.append([llm.generate([w], params)[0].num_cached_tokens for w in (a, b, c, a)])
        assert_idle_clean(llm)
    assert hits[0] == hits[1] == [0, 0, 32, 44], hits


def test_warmup_compiles_what_speculation_launches(caplog, decode_row_verify):
    """After LLMEngine.warmup a speculative run compiles no step: the warm-up lowers what the
    Speculator launches (the draft's jit_draft and the target's jit_verify for a decode shape,
    jit_prefill for a prefill shape), not the plain step.  (The allocator's page moves are a
    separate small jit that may compile for a new move count.)"""
    target = _model("tiny-attention")
    spec = {"method": "draft", "model": _perturbed("tiny-attention"), "num_speculative_tokens": K, "min_acceptance": 0.0}
    llm = LLM(target, arena_bytes=250 << 10, speculative_config=spec, **SPEC)
    eng = llm.llm_engine
    shapes = eng.reachable_shapes()
    assert eng.warmup() == len(shapes) + sum(s[1] == 1 for s in shapes)  # a decode shape: two executables
    assert compiled_steps(caplog, lambda: llm.generate(_workload(target.config.vocab_size)[:3],
                                                       SamplingParams(temperature=0, max_tokens=8))) == []
    assert eng.stats()["speculative"]["num_verify_rows"] > 0
    assert_idle_clean(llm)


def test_requests_whose_drafts_do_not_pay_stop_speculating(decode_row_verify):
    """A draft that almost never agrees (2% here): each request stops speculating after its first
    probe_steps verifies (min_acceptance) and decodes on with plain steps (asynchronous ones once no
    running request speculates); its greedy output is still greedy without speculation; a draft
    that agrees keeps speculating.  Also from the command line's flag and the JSON."""
    target = _model("tiny-attention")
    want = _greedy("tiny-attention", 250 << 10)
    spec = {"method": "draft", "model": _perturbed("tiny-attention"), "num_speculative_tokens": K,
            "min_acceptance": 0.3, "probe_steps": 4}
    llm = LLM(target, arena_bytes=250 << 10, speculative_config=spec, **SPEC)
    work = _workload(target.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    eng = llm.llm_engine
    plain_before = eng.num_steps["decode"]
    outs = llm.generate(work, params) + llm.generate(work[:1], params)
    assert [o.outputs[0].token_ids for o in outs] == want
    st = eng.stats()["speculative"]
    assert st["num_requests_switched_off"] == len(outs), st
    # every request verified at most probe_steps + (steps in flight) rows, far fewer than its tokens
    assert st["num_verify_rows"] < len(outs) * MAX_TOKENS // 2, st
    assert eng.num_steps["decode"] - plain_before > st["num_verify_rows"] // len(outs), eng.num_steps
    assert_idle_clean(llm)
    # A draft that agrees (the target itself) is never switched off.
    spec = dict(spec, model=target)
    llm = LLM(target, arena_bytes=250 << 10, speculative_config=spec, **SPEC)
    assert [o.outputs[0].token_ids for o in llm.generate(work, params)] == want[:len(work)]
    assert llm.llm_engine.stats()["speculative"]["num_requests_switched_off"] == 0
    with pytest.raises(ValueError, match="min_acceptance"):
        LLM(target, arena_bytes=250 << 10, speculative_config=dict(spec, min_acceptance=1.5))


def test_logit_bias_is_refused_with_speculation():
    """A verify's acceptance reads the unbiased rows, so a request with logit_bias is refused by
    name on a speculating engine (and nothing is queued)."""
    target = _model("tiny-attention")
    llm = LLM(target, arena_bytes=250 << 10, **SPEC, speculative_config={"model": target, "num_speculative_tokens": K})
    with pytest.raises(ValueError, match="^logit_bias: not supported with speculative decoding"):
        llm.llm_engine.add_request([5, 6, 7], SamplingParams(max_tokens=2, logit_bias={5: 1.0}))
    with pytest.raises(ValueError, match="^allowed_token_ids: not supported with speculative decoding"):
        llm.llm_engine.add_request([5, 6, 7], SamplingParams(max_tokens=2, allowed_token_ids=[5, 6]))
    assert not llm.llm_engine.has_unfinished_requests()
