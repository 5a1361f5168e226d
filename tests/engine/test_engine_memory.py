"""The engine under memory pressure: the arrival clip, the budget refusal, retraction and
priority preemption, each checked against unconstrained outputs (the dense oracle, or each
request run alone) and followed by the idle invariant / leak checks.

Same arena shape and buckets as test_engine.py, so no new step compilation.
"""

from __future__ import annotations

from _engine_utils import assert_idle_clean, dense_greedy, llm, prompts

from umem_jax import SamplingParams
from umem_jax.engine.engine import BUDGET_MESSAGE

LONG = prompts(5, 17, 40, 70, seed=4)
# new_token_ratio=0: admission reserves whole prompts but no outputs, so decode outgrows the arena;
# the requests here are fixed-length (ignore_eos), which reserve exactly by default and never
# retract (test_exact_reservation.py), so these retraction tests use the ratio rule for them too
RATIO_ONLY = dict(new_token_ratio=0.0, exact_fixed_length_reservation=False)


def test_retraction_outputs_identical_to_unconstrained():
    tight = llm(**RATIO_ONLY)
    outs = tight.generate(LONG, SamplingParams(temperature=0, max_tokens=70, ignore_eos=True))
    e = tight.llm_engine
    assert e.scheduler.num_retractions > 0
    assert e.stats()["num_moved_pages"] > 0  # pages were relocated under the live requests, data followed
    assert 0 < e.stats()["num_compactions"] <= sum(e.num_steps.values())
    assert sum(o.metrics.num_retractions for o in outs) == e.scheduler.num_retractions
    assert [o.outputs[0].token_ids for o in outs] == dense_greedy(LONG, 70)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert_idle_clean(tight)


def test_seeded_sampling_survives_retraction():
    sp = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=70, ignore_eos=True) for i in range(4)]
    tight = llm(**RATIO_ONLY)
    squeezed = tight.generate(LONG, sp)
    assert tight.llm_engine.scheduler.num_retractions > 0
    alone = [tight.generate(p, s)[0] for p, s in zip(LONG, sp)]  # one at a time: no pressure
    assert all(a.metrics.num_retractions == 0 for a in alone)
    assert [o.outputs[0].token_ids for o in squeezed] == [a.outputs[0].token_ids for a in alone]
    assert_idle_clean(tight)


def test_priority_preemption():
    eng_llm = llm(**RATIO_ONLY)
    e = eng_llm.llm_engine
    low_p = prompts(40, 40, 40, seed=5)
    sp_low = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    low = [e.add_request(p, sp_low, priority=1) for p in low_p]
    outs = {}
    for _ in range(30):
        for o in e.step():
            outs[o.request_id] = o
    assert len(e.scheduler.running) == 3 and all(r.decode_ready for r in e.scheduler.running)
    high_p = prompts(100, seed=6)[0]
    high = e.add_request(high_p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), priority=0)
    for o in e.step():
        outs[o.request_id] = o
    assert e.scheduler.num_preemptions >= 1
    assert any(r.request_id == high for r in e.scheduler.running)
    while e.has_unfinished_requests():
        for o in e.step():
            outs[o.request_id] = o
    assert sum(outs[i].metrics.num_preemptions for i in low) >= 1
    assert [outs[i].outputs[0].token_ids for i in low] == dense_greedy(low_p, 60)
    assert outs[high].outputs[0].token_ids == dense_greedy([high_p], 20)[0]
    assert_idle_clean(eng_llm)


def test_prompt_over_budget_is_refused_with_the_message():
    eng_llm = llm()
    dm = eng_llm.llm_engine.demand
    n = next(n for n in range(200, 1024, 8) if dm.clip(n, 1) is None)
    over = prompts(n, seed=7)[0]
    ok = prompts(12, seed=8)[0]
    outs = eng_llm.generate([ok, over], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert outs[0].outputs[0].token_ids == dense_greedy([ok], 5)[0]
    refused = outs[1]
    assert refused.finished and refused.outputs[0].finish_reason == "abort" and refused.outputs[0].token_ids == []
    assert refused.error == BUDGET_MESSAGE.format(n) == f"Request prompt exceeds the KV memory budget: input_len={n}."
    assert_idle_clean(eng_llm)


def test_max_tokens_clipped_by_the_memory_clip():
    """max_model_len (1024) above what the arena holds: a request that leaves max_tokens unset gets
    as many as fit (a "length" finish); one that asks for more than fit is refused naming how many
    do -- never cut short under a "length" finish it did not ask for."""
    eng_llm = llm()
    dm = eng_llm.llm_engine.demand
    p = prompts(200, seed=9)[0]
    want = 1024 - 200  # what max_model_len alone would allow
    clipped = dm.clip(200, want)
    assert clipped is not None and clipped < want
    out = eng_llm.generate(p, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == clipped and out.outputs[0].finish_reason == "length"
    assert out.metrics.num_retractions == 0  # admitted alone means it fits
    asked = eng_llm.generate(p, SamplingParams(temperature=0, max_tokens=clipped + 1, ignore_eos=True))[0]
    assert asked.outputs[0].finish_reason == "abort" and not asked.outputs[0].token_ids
    assert f"max_tokens={clipped + 1} does not fit the arena" in asked.error and f"at most {clipped} do" in asked.error
    fits = eng_llm.generate(p, SamplingParams(temperature=0, max_tokens=clipped, ignore_eos=True))[0]
    assert fits.outputs[0].token_ids == out.outputs[0].token_ids
    assert_idle_clean(eng_llm)


def test_warmup_compiles_every_reachable_shape_before_the_first_request():
    # A batch bucket no other test uses, so these shapes are new to this process.
    from _engine_utils import compile_count

    eng = llm(batch_buckets=(2,), max_num_seqs=2).llm_engine
    shapes = eng.reachable_shapes()
    assert [s[1] for s in shapes] == [1, 32] and shapes[0][0] == 2  # decode first, then the prefill
    assert eng.warmup() == len(shapes)
    before = compile_count()
    outs = _generate(eng, LONG[:2])
    assert compile_count() == before  # nothing left to compile: the steps ran on the warm executables
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    st = eng.stats()
    assert st["num_compilations"] == len(shapes) and st["num_compactions"] >= 0
    # Sampled requests: the "cuts" sampler warmed up covers them, no step compiles on first use
    # (every step launched is one warm-up compiled; a page-move batch size may still be new).
    assert eng.warmup(sampling=("cuts",)) == len(shapes)
    warm = set(eng.runner._ready)
    outs = _generate(eng, LONG[:2], SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True))
    assert eng.runner.shapes <= warm and {lay.sampling for lay in eng.runner.shapes} == {"greedy", "cuts"}
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    _check_idle(eng)


def _generate(eng, ps, sp=None):
    sp = sp or SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = [eng.add_request(p, sp) for p in ps]
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            done[o.request_id] = o
    return [done[i] for i in ids]


def _check_idle(eng):
    eng.check_idle()
    assert eng.num_running == 0 and eng.num_waiting == 0
