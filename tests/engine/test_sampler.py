"""Sampler: greedy, temperature, top-k/top-p/min-p cuts, seeds and penalties on random logits."""

import jax.numpy as jnp
import numpy as np
import pytest
from _engine_utils import SamplingBatch

from umem_jax.core.sampling_params import SamplingParams
from umem_jax.runner.sampler import MODES, apply_penalties, sample


def run(logits, params, seeds=None, steps=None, mode=None):
    """Tokens in the least sampler mode the rows need (as the engine picks it), or in `mode`."""
    B = logits.shape[0]
    n = len(params)
    sb = SamplingBatch.build(params, seeds or list(range(n)), steps or [0] * n, B)
    return np.asarray(sample(jnp.asarray(logits), **sb.arrays(), mode=mode or sb.mode))


def test_every_mode_that_covers_the_rows_gives_the_same_tokens():
    """The engine compiles the sampler per mode and may run a batch in a covering mode that was
    compiled already: a row's token must not depend on which."""
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(8, 300)).astype(np.float32) * 2
    greedy = [SamplingParams(temperature=0.0)] * 3
    mixed = greedy + [SamplingParams(temperature=0.9)] * 3
    cut = mixed + [SamplingParams(temperature=0.9, top_k=5), SamplingParams(temperature=1.1, top_p=0.5)]
    for ps, least in ((greedy, "greedy"), (mixed, "random"), (cut, "cuts")):
        sb = SamplingBatch.build(ps, list(range(len(ps))), [4] * len(ps), 8)
        assert sb.mode == least
        outs = [run(logits, ps, steps=[4] * len(ps), mode=m) for m in MODES[MODES.index(least):]]
        for o in outs[1:]:
            np.testing.assert_array_equal(o, outs[0])
    with pytest.raises(ValueError, match="sampling mode"):
        run(logits, greedy, mode="nucleus")


def test_greedy_is_argmax_and_padding_rows_are_greedy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 50)).astype(np.float32)
    out = run(logits, [SamplingParams(temperature=0.0)] * 4)  # rows 4, 5 are padding
    np.testing.assert_array_equal(out, logits.argmax(-1))


def test_cuts_restrict_the_support():
    rng = np.random.default_rng(1)
    row = rng.normal(size=(1, 40)).astype(np.float32) * 3
    logits = np.repeat(row, 512, axis=0)
    top2 = set(np.argsort(-row[0])[:2])
    out = run(logits, [SamplingParams(temperature=1.0, top_k=2)] * 512)
    assert set(out) <= top2 and len(set(out)) == 2
    out = run(logits, [SamplingParams(temperature=1.0, top_p=1e-6)] * 512)
    assert set(out) == {row[0].argmax()}
    p = np.exp(row[0] - row[0].max()); p /= p.sum()
    out = run(logits, [SamplingParams(temperature=1.0, min_p=0.5)] * 512)
    assert set(out) <= set(np.nonzero(p >= 0.5 * p.max())[0])


def test_temperature_sampling_matches_softmax_frequencies():
    rng = np.random.default_rng(2)
    row = rng.normal(size=(1, 8)).astype(np.float32)
    n = 4000
    out = run(np.repeat(row, n, axis=0), [SamplingParams(temperature=0.7)] * n)
    p = np.exp(row[0] / 0.7 - (row[0] / 0.7).max()); p /= p.sum()
    freq = np.bincount(out, minlength=8) / n
    np.testing.assert_allclose(freq, p, atol=0.03)


def _vllm_probs(logits, t, top_k, top_p, min_p):
    """vLLM's sampling distribution of one row: temperature, min-p, top-k, then top-p over what
    is left, renormalised."""
    z = logits / t
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, bool)
    keep[order[:top_k if top_k > 0 else len(p)]] = True
    keep &= p >= min_p * p.max()
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    before = np.cumsum(q[order]) - q[order]
    keep[order[before >= top_p]] = False
    q = np.where(keep, p, 0.0)
    return q / q.sum()


@pytest.mark.parametrize("case", range(4))
def test_top_p_cuts_what_top_k_and_min_p_left_renormalised(case):
    """vLLM applies top-p to the distribution after top-k (and min-p), renormalised: top_k=2,
    top_p=0.5 on probabilities (0.35, 0.3, ...) keeps the first token alone.  Chi-square of 4000
    draws (one jitted call) against that distribution."""
    from scipy import stats

    rng = np.random.default_rng(100 + case)
    V, n = 8, 4000
    row = rng.normal(0, 1.5, V).astype(np.float32)
    kw = [dict(temperature=1.0, top_k=2, top_p=0.5), dict(temperature=0.8, top_k=4, top_p=0.6),
          dict(temperature=1.2, min_p=0.3, top_p=0.7), dict(temperature=1.0, top_k=5, min_p=0.1, top_p=0.8)][case]
    if case == 0:  # the case above: renormalised, the top token holds more than half of the top two
        row = np.log(np.array([0.35, 0.3, 0.2, 0.05, 0.04, 0.03, 0.02, 0.01], np.float32))
    want = _vllm_probs(row.astype(np.float64), kw["temperature"], kw.get("top_k", 0), kw["top_p"], kw.get("min_p", 0.0))
    out = run(np.repeat(row[None], n, axis=0), [SamplingParams(**kw)] * n, seeds=[int(s) for s in rng.integers(0, 2**31, n)])
    counts = np.bincount(out, minlength=V)
    assert set(np.nonzero(counts)[0]) <= set(np.nonzero(want)[0]), (counts, want)
    support = want > 0
    if support.sum() > 1:
        chi2 = (((counts - n * want) ** 2)[support] / (n * want[support])).sum()
        assert chi2 < stats.chi2.ppf(0.999, support.sum() - 1), (counts, n * want)


@pytest.mark.parametrize("temperature", [1e-6, 5e-38])
def test_a_temperature_below_vllms_epsilon_is_greedy_as_packed(temperature):
    """vLLM samples greedily below temperature 1e-5.  Packed as given, 1e-6 drew among tied
    top logits at random (argmax takes the first) and 1e-38 overflowed logits / t to ties of inf."""
    from umem_jax.core.request import Request
    from umem_jax.runner.packing import FLOAT_SAMPLING, INT_SAMPLING, RowCache

    rng = np.random.default_rng(int(-np.log10(temperature)))
    n, V = 64, 16
    logits = rng.normal(0, 3, (n, V)).astype(np.float32)
    top = rng.integers(1, V, n)
    logits[np.arange(n), top] = 30.0
    logits[np.arange(n), top - 1] = 30.0 if temperature > 1e-20 else 29.0  # a tie / a near tie that overflows
    cache = RowCache(8, n)
    reqs = [Request(str(i), None, [5, 6], SamplingParams(temperature=temperature, top_p=0.9 if i % 2 else 1.0),
                    arrival=i, seed=int(rng.integers(0, 2**31)), max_tokens=4) for i in range(n)]
    rows = [cache.entry(r, []).row for r in reqs]
    words = cache.sampling_words[rows]
    cols = {f: words[:, i] for i, f in enumerate(INT_SAMPLING)}
    cols |= {f: words[:, len(INT_SAMPLING) + i].view(np.float32) for i, f in enumerate(FLOAT_SAMPLING)}
    mode = MODES[int(cache.sampling_mode[rows].max())]
    out = np.asarray(sample(jnp.asarray(logits), **{k: jnp.asarray(v) for k, v in cols.items()}, mode=mode))
    np.testing.assert_array_equal(out, logits.argmax(-1))


def test_seed_and_step_make_sampling_reproducible():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(8, 100)).astype(np.float32)
    ps = [SamplingParams(temperature=1.0)] * 8
    a = run(logits, ps, seeds=[5] * 8, steps=list(range(8)))
    b = run(logits, ps, seeds=[5] * 8, steps=list(range(8)))
    c = run(logits, ps, seeds=[6] * 8, steps=list(range(8)))
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()


def test_a_rows_token_does_not_depend_on_its_batch_mates():
    # Rows without cuts skip the vocabulary sort unless a batch-mate needs it: either way, the
    # same seed, step and parameters give the same token (retraction and batching must not
    # change a seeded request's output).
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(4, 300)).astype(np.float32) * 2
    plain, cut, greedy = (SamplingParams(temperature=0.9), SamplingParams(temperature=0.9, top_p=0.8),
                          SamplingParams(temperature=0.0))
    for step in range(6):
        alone = run(logits, [plain, plain, greedy, plain], seeds=[7, 8, 9, 10], steps=[step] * 4)
        mixed = run(logits, [plain, cut, greedy, plain], seeds=[7, 8, 9, 10], steps=[step] * 4)
        np.testing.assert_array_equal(alone[[0, 2, 3]], mixed[[0, 2, 3]])
        assert alone[2] == logits[2].argmax()
        cut_alone = run(logits[1:2], [cut], seeds=[8], steps=[step])
        assert mixed[1] == cut_alone[0]


def test_penalties_follow_vllm():
    logits = jnp.array([[2.0, -2.0, 1.0, 0.5]])
    prompt = jnp.array([[1, 0, 0, 0]], jnp.float32)
    output = jnp.array([[0, 1, 2, 0]], jnp.float32)
    out = apply_penalties(logits, prompt, output, jnp.array([2.0]), jnp.array([0.5]), jnp.array([0.25]))
    np.testing.assert_allclose(np.asarray(out), [[1.0, -4.0 - 0.5 - 0.25, 0.5 - 0.5 - 0.5, 0.5]])


@pytest.mark.parametrize("field, value", [("temperature", -1.0), ("top_p", 0.0), ("min_p", 2.0), ("max_tokens", 0),
                                          ("top_k", -3), ("n", 0), ("presence_penalty", 3.0), ("seed", 2**64),
                                          ("seed", -(2**63) - 1), ("stop", ""), ("stop", [""]), ("stop", ["a", ""])])
def test_bad_parameters_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
