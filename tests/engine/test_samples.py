"""n / best_of: a prompt's samples forked from one prefill (engine/samples.py) -- they share the
prompt's pages through the prefix cache, draw with their own seeds, and come back as one output.

Every request here records logprobs=0 (the chosen token's): then the step compiled for the first
(sampling, logprobs) serves every later one (a covering sampler mode), which keeps the file fast."""

from __future__ import annotations

import pytest
from _engine_utils import assert_idle_clean, llm, prompts

from umem_jax import SamplingParams


@pytest.fixture(scope="module")
def engine_llm():
    return llm()


def _run(e, rid):
    """Step until idle -> (the output of `rid`, peak pages the full band held)."""
    out, peak = None, 0
    while e.has_unfinished_requests():
        for o in e.step():
            out = o if o.request_id == rid else out
        peak = max(peak, e.allocator.usage().subpools["full"].held)
    return out, peak


def test_seeded_samples_are_distinct_reproducible_and_the_first_is_the_n1_output(engine_llm):
    p = prompts(13, seed=8)[0]
    kw = dict(temperature=0.9, seed=5, max_tokens=8, ignore_eos=True, logprobs=0)
    one = engine_llm.generate([p], SamplingParams(**kw))[0].outputs[0].token_ids
    three = engine_llm.generate([p], SamplingParams(n=3, **kw))[0].outputs
    again = engine_llm.generate([p], SamplingParams(n=3, **kw))[0].outputs
    assert three[0].token_ids == one
    assert [c.token_ids for c in three] == [c.token_ids for c in again]
    assert len({tuple(c.token_ids) for c in three}) == 3
    assert three[0].cumulative_logprob == pytest.approx(
        engine_llm.generate([p], SamplingParams(**kw))[0].outputs[0].cumulative_logprob)
    assert_idle_clean(engine_llm)


def test_samples_share_the_prompt_pages_and_compute_it_once(engine_llm):
    e = engine_llm.llm_engine
    e.reset_prefix_cache()
    hits = e.scheduler.cache.stats()["hit_tokens"]
    p = prompts(41, seed=7)[0]  # 10 full pages of 4 tokens and one more token
    rid = e.add_request(p, SamplingParams(n=4, temperature=0, max_tokens=6, ignore_eos=True, logprobs=0))
    out, peak = _run(e, rid)
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2, 3]
    # the three siblings resume at the primary's last full page: 3 x 40 cached tokens
    assert e.scheduler.cache.stats()["hit_tokens"] - hits == 3 * 40
    # 10 shared pages, then each sample's own 2 (positions 40..46); unshared it would be 4 x 12
    assert peak == 10 + 4 * 2
    assert out.num_cached_tokens == 0  # the primary computed the prompt
    assert [len(c.logprobs) for c in out.outputs] == [6] * 4
    ref = engine_llm.generate([p], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0))[0]
    assert all(c.token_ids == ref.outputs[0].token_ids and c.finish_reason == "length" for c in out.outputs)
    assert_idle_clean(engine_llm)


def test_best_of_returns_the_n_samples_of_highest_mean_logprob(engine_llm):
    p = prompts(19, seed=9)[0]
    kw = dict(temperature=1.0, seed=9, max_tokens=6, ignore_eos=True)
    drawn = engine_llm.generate([p], SamplingParams(n=4, logprobs=0, **kw))[0].outputs
    best = engine_llm.generate([p], SamplingParams(n=2, best_of=4, **kw))[0].outputs  # records logprobs=0 itself
    ranked = sorted(drawn, key=lambda c: (-c.cumulative_logprob / len(c.token_ids), c.index))
    assert [c.index for c in best] == [0, 1]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked[:2]]
    assert [c.cumulative_logprob for c in best] == pytest.approx([c.cumulative_logprob for c in ranked[:2]])
    assert best[0].logprobs is None  # ranked by logprobs it did not ask to see
    assert_idle_clean(engine_llm)


def test_aborting_the_primary_aborts_every_sample(engine_llm):
    e = engine_llm.llm_engine
    rid = e.add_request(prompts(30, seed=10)[0], SamplingParams(n=3, temperature=0, max_tokens=200, ignore_eos=True,
                                                                 logprobs=0))
    for _ in range(3):
        e.step()
    e.abort_request(rid)
    out, _ = _run(e, rid)
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 3 and len(out.outputs[0].token_ids) < 200
    assert_idle_clean(engine_llm)


def test_aborting_a_group_whose_primary_finished_aborts_the_rest_and_its_id_stays_taken():
    """The primary's id names the group until the group is reported: aborting it after the
    primary finished (its siblings start a step or more later) ended nothing, the siblings ran
    to max_tokens; and a new request could take the id meanwhile (two outputs of one id).  One
    sequence at a time, so the siblings wait for the primary to finish."""
    one = llm(max_num_seqs=1)
    e = one.llm_engine
    rid = e.add_request(prompts(9, seed=12)[0], SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True,
                                                                logprobs=0), request_id="group")
    primary = e._requests[rid]
    while not primary.finished:
        assert not e.step()
    assert not all(s.finished for s in primary.siblings)
    with pytest.raises(ValueError, match="already in use"):
        e.add_request([5, 6, 7], SamplingParams(max_tokens=2), request_id=rid)
    e.abort_request(rid)
    out, _ = _run(e, rid)
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 6
    assert {c.finish_reason for c in out.outputs[1:]} == {"abort"} and out.error == "aborted by the user"
    assert e.add_request([5, 6, 7], SamplingParams(max_tokens=2), request_id=rid) == rid  # reported: free again
    _run(e, rid)
    assert_idle_clean(one)


def test_a_refused_group_reports_all_its_samples_and_leaks_nothing(engine_llm):
    """A prompt over the memory budget (or a max_tokens over what the arena holds) with n = 3:
    the output has 3 completions, each an abort with the reason -- not 1 (its siblings were never
    registered) -- and a request beside it runs to the end."""
    e = engine_llm.llm_engine
    n = next(n for n in range(200, 1024, 8) if e.demand.clip(n, 1) is None)
    ok = prompts(12, seed=8)[0]
    outs = engine_llm.generate([ok, prompts(n, seed=3)[0]],
                               SamplingParams(n=3, best_of=4, temperature=0.7, seed=1, max_tokens=4, ignore_eos=True))
    assert [len(c.token_ids) for c in outs[0].outputs] == [4, 4, 4]
    refused = outs[1]
    assert [c.index for c in refused.outputs] == [0, 1, 2]
    assert all(c.finish_reason == "abort" and c.token_ids == [] for c in refused.outputs)
    assert refused.error == f"Request prompt exceeds the KV memory budget: input_len={n}."
    assert not e.samples.groups and not e.samples.held
    assert_idle_clean(engine_llm)


@pytest.mark.parametrize("kw,field", [(dict(n=0), "n"), (dict(n=129), "n"), (dict(n=2, best_of=1), "best_of"),
                                      (dict(best_of=129), "best_of"), (dict(logprobs=21), "logprobs")])
def test_bad_sample_counts_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field}="):
        SamplingParams(**kw)


def test_without_a_prefix_cache_samples_run_side_by_side(engine_llm):
    plain = llm(enable_prefix_caching=False)
    p = prompts(9, seed=11)[0]
    kw = dict(temperature=0.8, seed=3, max_tokens=4, ignore_eos=True, logprobs=0)
    out = plain.generate([p], SamplingParams(n=2, **kw))[0]
    ref = engine_llm.generate([p], SamplingParams(n=2, **kw))[0]  # (with a prefix cache)
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
    assert_idle_clean(plain)
