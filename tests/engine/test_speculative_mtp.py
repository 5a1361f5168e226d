"""Speculative decoding with the target's own MTP head (method "mtp", issue 16): greedy output with
it equals greedy output without, through chunked prefill, forced retraction and a prefix-cache
hit, for Qwen3.5 (dense, gated-DeltaNet state), Qwen3.5-MoE and NemotronH (Mamba2 state, an
attention + MoE head); temperature > 0 runs clean; the acceptance rule with one-hot q keeps the
target's distribution (chi-square); refusals; invariants and the idle leak check after each run.

The checkpoints are the committed family fixtures plus random `mtp.*` tensors (tests/_mtp_fixtures.py).
A random head proposes what the target rarely takes, so the runs also use a harness: after every
step, each running request's drafts -- the head's, carried on the host -- and the head's K/V
rows it reads are first checked against a dense oracle (tests/_mtp_oracle.py: the cache-free
target's final-normed hiddens, the head's cache-free forward chained as the engine chains it),
then replaced by the target's greedy continuation with a seeded share corrupted, so the next
verify accepts 0..k and the head's catch-up runs over every length.  Requests resumed from a cached prefix (another request's, or their own after a
retraction) are checked too: with an MTP head the cache keys a page with the token after it
(scheduler/radix_node.py), so every head entry a request reads was made with its own tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _engine_utils import assert_idle_clean, compiled_steps, prompts  # noqa: E402
from _mtp_fixtures import FIXTURES, write_mtp_checkpoint  # noqa: E402
from _mtp_oracle import DenseOracle, check_drafts, check_head_entries  # noqa: E402

from umem_jax import LLM, SamplingParams  # noqa: E402

SHAPES = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=4, max_model_len=160, batch_buckets=(4,),
              token_buckets=(32,), page_buckets=(40,), debug_nan=True)
K = 3
MAX_TOKENS = 14
WRONG = 0.3  # share of harness drafts made wrong
ARENA = 300 << 10  # four long requests with the head's K/V beside the target's retract


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return lambda name: write_mtp_checkpoint(root, name)


def _workload(vocab: int):
    """Long prompts (chunked: > 32 tokens), two sharing a 40-token prefix (a cache hit)."""
    shared = [t % vocab for t in prompts(40, seed=3)[0]]
    ps = [[t % vocab for t in p] for p in prompts(60, 9, 45, seed=5)]
    return [shared + ps[1], ps[0], shared + [7, 8, 9, 10], ps[2]]


def _harness(engine, expected: dict, oracle, checked: list, rng, given: dict):
    """After a step: check the drafts the head gave each running request this step (not the
    ones the harness gave it before: a request a prefill step left out still holds those), then
    hand it the harness's."""
    for req in engine.scheduler.running:
        if not req.drafts or not req.decode_ready or req.drafts is given.get(req.request_id):
            continue
        if oracle is not None:
            check_drafts(oracle, req, checked)
            check_head_entries(oracle, engine, req, SHAPES["page_buckets"][0])
        seq = expected[tuple(req.prompt_token_ids)]
        nxt = np.array(seq[req.num_computed + 1:req.num_computed + 1 + K], np.int64)
        bad = rng.random(nxt.shape) < WRONG
        req.drafts = given[req.request_id] = np.where(bad, (nxt + 1) % engine.model.config.vocab_size, nxt).tolist()


def _generate(engine, work, params, retract_at=None, after_step=None):
    """engine.step() until done; with retract_at, retract the running request furthest into its
    output after that many steps and again 3 steps later (read back each step: nothing in flight)."""
    ids = [engine.add_request(p, params) for p in work]
    outs, steps = {}, 0
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step())
        steps += 1
        if after_step is not None:
            after_step(engine)
        if retract_at is not None and steps in (retract_at, retract_at + 3):
            running = [r for r in engine.scheduler.running if r.num_output > 0]
            if running:
                engine.scheduler.retract(max(running, key=lambda r: r.num_output))
    return [outs[i] for i in ids]


def _run(path, arena, method=None, expected=None, oracle=None, params=None):
    spec = None if method is None else {"method": method, "num_speculative_tokens": K, "min_acceptance": 0.0}
    # The harness hands the head's drafts over on the host after each step, so those runs read
    # every step back (a step launched before the previous one is read takes its drafts on the device)
    llm = LLM(str(path), arena_bytes=arena, speculative_config=spec, async_scheduling=expected is None, **SHAPES)
    eng = llm.llm_engine
    work = _workload(eng.model.config.vocab_size)
    params = params or SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    checked, rng, given = [], np.random.default_rng(0), {}
    hook = None if expected is None else (lambda e: _harness(e, expected, oracle, checked, rng, given))
    outs = _generate(eng, work, params, None if method is None else 8, hook)
    outs += _generate(eng, work[:1], params, None, hook)  # its whole prompt is cached by now: a prefix-cache hit
    assert all(o.error is None for o in outs), [o.error for o in outs]
    assert_idle_clean(llm)
    return [list(o.outputs[0].token_ids) for o in outs], eng, work + work[:1], checked


# NemotronH: Mamba2 state and a two-block head (attention, MoE) with plain norms; Qwen3-Next:
# gated DeltaNet, MoE with a shared expert, and its own head
@pytest.mark.parametrize("name", ["qwen3_5_tiny", "qwen3_5_moe_tiny", "nemotron_h_moe_tiny", "qwen3_next_tiny"])
def test_greedy_with_mtp_is_greedy_without(ckpt, name, decode_row_verify):
    """Greedy without speculation is the cache-free forward's continuation here (the engine
    without speculation makes the same: the family tests), which spares a second engine's compiles."""
    from umem_jax.models.loader import load_model
    from umem_jax.models.mtp import load_head

    path = ckpt(name)
    target = load_model(path)
    oracle = DenseOracle(target, load_head(target))
    work = _workload(target.config.vocab_size)
    want = [oracle.greedy(p, MAX_TOKENS) for p in work]
    expected = {tuple(p): list(p) + w for p, w in zip(work, want)}
    got, eng, _, checked = _run(path, ARENA, "NEXTN", expected, oracle)  # SGLang's name for it
    assert got == want + want[:1]
    s = eng.stats()
    sp = s["speculative"]
    assert 0.2 < sp["acceptance_rate"] < 0.95 and min(sp["acceptance_per_position"]) > 0, sp
    assert s["num_retractions"] > 0 and s["prefix_cache"]["hit_tokens"] > 0, s
    # the head's own drafts were checked after most steps, full chains among them
    assert len(checked) > 20 and max(checked) == K, checked


def _branches(vocab: int):
    """A 32-token prefix P (eight pages), then three prompts leaving it exactly at its last page
    boundary with next tokens 5, 6, 7, then the first again."""
    p = [t % vocab for t in prompts(32, seed=11)[0]]
    tails = [[t % vocab for t in q] for q in prompts(12, 7, 7, seed=12)]
    a, b, c = (p + [x] + t for x, t in zip((5, 6, 7), tails))
    return [a, b, c, a]


@pytest.mark.parametrize("name", ["qwen3_5_tiny", "nemotron_h_moe_tiny"])
def test_a_hit_shares_only_pages_made_with_its_own_next_token(ckpt, name):
    """One request at a time.  A = P + [5, ...] caches P with checkpoints at 32 and 44 (its two
    prefill passes).  The head's entry at 31 (P's last position) was made from A's token 5, so
    B = P + [6, ...] must not share P's last page: its hit stops a page earlier, at the deepest
    checkpoint there -- none (0 tokens; without the cut it resumed at 32 and read A's entry), and
    B checkpoints its fork at 28.  C = P + [7, ...] resumes there (28).  A again resumes at 44,
    as it would without MTP: its own next tokens.  After every step the head's K/V rows each
    request reads equal the oracle's from its own tokens, its drafts the oracle's drafts; greedy
    output is the target's greedy continuation; no leak at idle."""
    from umem_jax.models.loader import load_model
    from umem_jax.models.mtp import load_head

    path = ckpt(name)
    target = load_model(path)
    oracle = DenseOracle(target, load_head(target))
    work = _branches(target.config.vocab_size)
    n = 8
    want = [oracle.greedy(p, n) for p in work]
    expected = {tuple(p): list(p) + w for p, w in zip(work, want)}
    llm = LLM(str(path), arena_bytes=ARENA, speculative_config={"method": "mtp", "num_speculative_tokens": K, "min_acceptance": 0.0},
              async_scheduling=False, **SHAPES)  # the harness hands drafts over on the host
    eng = llm.llm_engine
    assert eng.scheduler.cache.lookahead == 1
    checked, rng, given = [], np.random.default_rng(0), {}
    hook = lambda e: _harness(e, expected, oracle, checked, rng, given)  # noqa: E731
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = [_generate(eng, [p], params, None, hook)[0] for p in work]
    assert all(o.error is None for o in outs), [o.error for o in outs]
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [0, 0, 28, 44]
    assert len(checked) >= 4 * 2, checked  # every request's head checked after its prefill and decode steps
    assert_idle_clean(llm)


def test_sampling_with_mtp_runs_clean(ckpt):
    """Sampled rows beside greedy ones (one sampler mode covers both): every sampled token is in
    the vocabulary, the greedy rows still make the greedy continuation."""
    from umem_jax.models.loader import load_model

    path = ckpt("qwen3_5_tiny")
    llm = LLM(str(path), arena_bytes=ARENA, speculative_config={"method": "mtp", "num_speculative_tokens": K, "min_acceptance": 0.0},
              **SHAPES)
    work = _workload(llm.llm_engine.model.config.vocab_size)
    params = [SamplingParams(temperature=0.9, top_k=20 if i % 2 else 0, max_tokens=MAX_TOKENS, seed=i,
                             ignore_eos=True) for i in range(3)] + [SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                                   ignore_eos=True)]
    outs = llm.generate(work, params)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert all(len(t) == MAX_TOKENS and all(0 <= x < 128 for x in t) for t in got)
    target = load_model(path)
    assert got[3] == DenseOracle(target).greedy(work[3], MAX_TOKENS)
    assert llm.llm_engine.stats()["speculative"]["num_verify_rows"] > 0
    assert_idle_clean(llm)


# ---------------------------------------------------------------------- the acceptance rule, one-hot q


@pytest.mark.parametrize("seed", [0, 1])
def test_one_hot_acceptance_keeps_the_target_distribution(seed):
    """Deterministic drafts (q_j one-hot at d_j, never materialised): d_j is kept with probability
    p_j(d_j), a rejection draws from p_j without d_j; the first emitted token is distributed as
    p_0, the one after an accepted first draft as p_1, the bonus as p_k, whatever the drafts."""
    from scipy import stats as sps

    from umem_jax.runner.acceptance import ONEHOT, accept

    rng = np.random.default_rng(seed)
    V, k, N = 6, 2, 40000
    p = rng.dirichlet(np.ones(V) * 0.7, size=k + 1).astype(np.float32)
    key = jax.random.PRNGKey(seed)
    kd, ku, kr = jax.random.split(key, 3)
    drafts = jax.random.randint(kd, (N, k), 0, V, jnp.int32)  # each row its own (deterministic) drafts
    P = jnp.broadcast_to(jnp.asarray(p), (N, k + 1, V))
    u = jax.random.uniform(ku, (N, k))
    run = jax.jit(lambda d, P, u, keys: accept(d, ONEHOT, P, u, keys, jnp.full((N,), k, jnp.int32),
                                                jnp.zeros((N,), bool)))
    n, toks = map(np.asarray, run(drafts, P, u, jax.random.split(kr, N)))

    def pvalue(samples, probs):
        counts = np.bincount(samples, minlength=V)
        keep = probs > 0
        assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
        kept = probs[keep].astype(np.float64)
        expected = kept / kept.sum() * counts[keep].sum()
        return sps.chisquare(counts[keep].astype(np.float64), expected).pvalue

    assert pvalue(toks[:, 0], p[0]) > 1e-3
    assert pvalue(toks[n >= 1, 1], p[1]) > 1e-3
    assert pvalue(toks[n == k, k], p[k]) > 1e-3
    d = np.asarray(drafts)
    assert abs((n >= 1).mean() - p[0][d[:, 0]].mean()) < 0.01  # kept with probability p_0(d_1)
    rejected = n == 0
    assert (toks[rejected, 0] != d[rejected, 0]).all()  # a rejected draft is never the drawn token
    assert ((toks >= 0).sum(1) == n + 1).all()


# ---------------------------------------------------------------------- refusals and the compiled step


def test_refusals_name_the_reason(ckpt, tmp_path):
    import shutil

    spec = {"method": "mtp", "num_speculative_tokens": K, "min_acceptance": 0.0}
    d = tmp_path / "no_mtp_weights"
    shutil.copytree(FIXTURES / "qwen3_5_tiny", d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}))
    with pytest.raises(ValueError, match=r"speculative method 'mtp': .*has no MTP weights.*mtp.fc.weight"):
        LLM(str(d), arena_bytes=ARENA, speculative_config=spec, **SHAPES)
    with pytest.raises(ValueError, match="declares no MTP layers"):
        LLM(str(FIXTURES / "qwen3_5_tiny"), arena_bytes=ARENA, speculative_config=spec, **SHAPES)


def test_the_heads_kv_is_priced_in_the_targets_envelope(ckpt):
    """The head's K/V rows sit in the target's full-attention page envelope (one page, one
    allocation for both), so the one demand model prices them; a recurrent target also holds k
    speculative state slots.  load_format "dummy" gives the head random weights."""
    spec = {"method": "mtp", "num_speculative_tokens": K, "min_acceptance": 0.0}
    path = ckpt("nemotron_h_moe_tiny")
    eng = LLM(str(path), arena_bytes=ARENA, load_format="dummy", speculative_config=spec, **SHAPES).llm_engine
    plain = LLM(str(path), arena_bytes=ARENA, load_format="dummy", **SHAPES).llm_engine
    assert eng.draft.module_cls.__name__ == "NemotronHMTP"
    assert eng.plan["full"].layers == (("target", 2), ("draft", 0))
    assert eng.plan["full"].page_bytes == 2 * plain.plan["full"].page_bytes  # one attention layer each
    assert eng.demand.slots_per_request == 1 + K
    d, e = eng.demand, plain.demand
    assert d.bytes(d.lifetime(40, 8), {"full"}) == 2 * e.bytes(e.lifetime(40, 8), {"full"})


def test_chain_passes_without_a_page_write_only_the_sink(ckpt):
    """A chained pass at a position whose page the row does not hold -- past the table's width
    (where write_targets would clip onto the row's last page) or an unmapped entry (sink 0) --
    writes nothing outside the sink and proposes -1 from there on; a pass with its page writes
    that page only."""
    from umem_jax.core.batch import Batch
    from umem_jax.runner.mtp import _chain

    llm = LLM(str(ckpt("qwen3_5_tiny")), arena_bytes=ARENA, speculative_config={"method": "mtp",
              "num_speculative_tokens": K, "min_acceptance": 0.0}, **SHAPES)
    r = llm.llm_engine.runner
    tleaves, hleaves, _, verify, head = r.speculator._leaves()
    rpp, ps = r.plan[head.pool].rows_per_page, head.page_size
    # row 0: positions from 2 * ps on, past a width-2 table; row 1: its page 1 unmapped; row 2:
    # positions ps, ps + 1 on its page 3
    table = np.array([[4, 5], [6, 0], [2, 3]], np.int32)
    last = np.array([2 * ps - 1, ps - 1, ps - 1], np.int32)
    i32 = lambda a: jnp.asarray(a, jnp.int32)
    batch = Batch(i32(np.zeros((3, 1))), i32([1, 1, 1]), i32(last + 1), {head.pool: i32(table)}, i32([0, 0, 0]))
    y = jnp.asarray(np.random.default_rng(0).normal(size=(3, r.model.config.hidden_size)), jnp.float32)

    @jax.jit
    def run(tl, hl, arena):
        tp, hp = jax.tree.unflatten(verify.treedef, tl), jax.tree.unflatten(head.treedef, hl)
        return _chain(head, tp, hp, arena, batch, i32([5, 6, 7]), y, i32(last), jnp.ones(3, bool), K)

    before = np.asarray(r.arena.data).copy()
    drafts, arena = run(tleaves, hleaves, r.arena)
    drafts, changed = np.asarray(drafts), np.flatnonzero((np.asarray(arena.data) != before).any(axis=1))
    assert drafts[:2, 1:].tolist() == [[-1, -1], [-1, -1]] and (drafts[2] >= 0).all(), drafts
    outside = changed[changed >= r.plan.sink_rows]
    assert len(outside) and set((outside // rpp).tolist()) == {3}, outside  # row 2's passes: page 3 only


def test_decode_step_updates_the_arena_in_place(ckpt):
    """The MTP decode step (verify, catch-up, the chain's loop) compiled at two arena sizes: the
    arena is donated and aliased, no arena-shaped copy, and its temporaries do not grow with it."""
    from umem_jax.arena import check_in_place

    temps = []
    for arena in (ARENA, 2 * ARENA):
        llm = LLM(str(ckpt("qwen3_5_tiny")), arena_bytes=arena, speculative_config={"method": "mtp",
                  "num_speculative_tokens": K, "min_acceptance": 0.0}, **SHAPES)
        r = llm.llm_engine.runner
        lay = r.layout(SHAPES["batch_buckets"][0], 1, SHAPES["page_buckets"][0])
        (lowered,) = r.speculator.lower(lay, decode=True)  # runner/mtp.jit_decode, as a launch calls it
        compiled = lowered.compile()
        temps.append(check_in_place(compiled, r.arena, max_temp_bytes=1 << 30)["temp_bytes"])
    assert temps[1] == temps[0], temps


def test_warmup_compiles_what_mtp_launches(ckpt, caplog):
    """After LLMEngine.warmup an MTP run compiles no step: the warm-up lowers the MTP speculator's
    jit_prefill (target + head chain) and jit_decode (verify + head catch-up), not the plain step."""
    llm = LLM(str(ckpt("qwen3_5_tiny")), arena_bytes=ARENA, speculative_config={"method": "mtp",
              "num_speculative_tokens": K, "min_acceptance": 0.0}, **SHAPES)
    eng = llm.llm_engine
    assert eng.warmup() == len(eng.reachable_shapes())
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    work = _workload(eng.model.config.vocab_size)[:3]
    assert compiled_steps(caplog, lambda: _generate(eng, work, params)) == []
    assert eng.stats()["speculative"]["num_verify_rows"] > 0
    assert_idle_clean(llm)


def test_logprobs_with_mtp_are_logprobs_without(ckpt):
    """Every emitted token's logprobs under method mtp (prefill and verify steps) equal the run
    without speculation's, through chunked prefill; the harness makes most drafts right."""
    from umem_jax.models.loader import load_model
    from umem_jax.models.mtp import load_head

    path = ckpt("qwen3_5_tiny")
    target = load_model(path)
    oracle = DenseOracle(target, load_head(target))
    work = _workload(target.config.vocab_size)[:2]
    want_tokens = [oracle.greedy(p, MAX_TOKENS) for p in work]
    expected = {tuple(p): list(p) + w for p, w in zip(work, want_tokens)}
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    plain = LLM(str(path), arena_bytes=1 << 20, **SHAPES).llm_engine
    want = _generate(plain, work, params)
    llm = LLM(str(path), arena_bytes=1 << 20, speculative_config={"method": "mtp", "num_speculative_tokens": K, "min_acceptance": 0.0},
              async_scheduling=False, **SHAPES)  # the harness hands drafts over on the host
    rng, given = np.random.default_rng(1), {}
    got = _generate(llm.llm_engine, work, params, None, lambda e: _harness(e, expected, None, [], rng, given))
    assert llm.llm_engine.stats()["speculative"]["mean_accepted_length"] > 0.5
    for g, w in zip(got, want):
        assert g.error is None and list(g.outputs[0].token_ids) == list(w.outputs[0].token_ids)
        for t, gd, wd in zip(g.outputs[0].token_ids, g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert set(gd) == set(wd) and gd[t].rank == wd[t].rank
            np.testing.assert_allclose([gd[i].logprob for i in wd], [wd[i].logprob for i in wd], rtol=1e-4, atol=1e-4)
    assert_idle_clean(llm)


def test_penalties_with_mtp_are_penalties_without(ckpt):
    """Greedy with repetition / presence / frequency penalties under method mtp equals the run
    without speculation (which the penalties change); the harness proposes that run's tokens with
    a share corrupted, so verifies accept 0..k with the counts of what they accept."""
    path = ckpt("qwen3_5_tiny")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.6,
                            presence_penalty=0.5, frequency_penalty=0.4)
    plain = LLM(str(path), arena_bytes=1 << 20, **SHAPES).llm_engine
    work = _workload(plain.model.config.vocab_size)[:3]
    want = [list(o.outputs[0].token_ids) for o in _generate(plain, work, params)]
    unpenalized = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert want != [list(o.outputs[0].token_ids) for o in _generate(plain, work, unpenalized)]
    expected = {tuple(p): list(p) + w for p, w in zip(work, want)}
    llm = LLM(str(path), arena_bytes=1 << 20, speculative_config={"method": "mtp", "num_speculative_tokens": K, "min_acceptance": 0.0},
              **SHAPES)
    rng, given = np.random.default_rng(2), {}
    got = _generate(llm.llm_engine, work, params, None, lambda e: _harness(e, expected, None, [], rng, given))
    assert [list(o.outputs[0].token_ids) for o in got] == want
    assert llm.llm_engine.stats()["speculative"]["mean_accepted_length"] > 0.5
    assert_idle_clean(llm)
