"""Failure isolation (engine/isolation.py): an exception raised by one request's work fails that
request alone, offline through LLM.generate, while the others run in the same batches.

An exception is injected for one marked prompt at each place a step can raise -- the scheduler's
admission, the runner's step (prefill and decode, so the launch is bisected and the marked row
found among others), the stop checks and the detokenizer.  The others must finish with the
outputs of a clean greedy run, the marked one with finish_reason "abort" and the error, the
arena must be clean at idle (the engine's leak and refcount checks), and afterwards every prompt
(the marked one too, from the prefix cache the failures must not have poisoned) must generate
as in the clean run.  A failure that is not one request's, a device error and a lost arena end
the engine with EngineDeadError.
"""

from __future__ import annotations

import pytest
from _engine_utils import assert_idle_clean, fail_step_when, llm, prompts

from umem_jax import SamplingParams
from umem_jax.engine.detokenizer import IncrementalDetokenizer
from umem_jax.engine.isolation import EngineDeadError
from umem_jax.runner.runner import Launched

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = prompts(5, 17, 40, 70, 9, 33, 12, seed=3)  # 7 requests, 4 rows a step: shared, chunked batches
MARKED = 2
RAISED: list[int] = []  # rows of each batch whose step the injection failed


class Injected(RuntimeError):
    pass


@pytest.fixture(scope="module")
def clean():
    """One engine for the module and its clean greedy outputs."""
    e = llm()
    return e, [o.outputs[0].token_ids for o in e.generate(PROMPTS, GREEDY)]


def _marked(req) -> bool:
    return req.prompt_token_ids == PROMPTS[MARKED]


def _in_step(monkeypatch, eng, kind: str) -> None:
    """The runner's jitted step raises for a `kind` batch holding the marked request (after its
    packing, where a tracing or dispatch error would); decode only once it has 3 tokens."""

    def marked(b) -> bool:
        if b.kind == kind and any(_marked(r.req) and (kind == "prefill" or r.req.num_output >= 3) for r in b.rows):
            RAISED.append(len(b.rows))
            return True
        return False

    fail_step_when(monkeypatch, eng.runner, marked, Injected(f"{kind} step"))


def _in_admission(monkeypatch, eng) -> None:
    admit = eng.scheduler._admit

    def failing(req, hit):
        if _marked(req):
            raise Injected("admission")
        return admit(req, hit)

    monkeypatch.setattr(eng.scheduler, "_admit", failing)


def _in_stop_checks(monkeypatch, eng) -> None:
    append = eng._append

    def failing(req, t):
        if _marked(req) and len(req.output_token_ids) == 4:
            raise Injected("stop checks")
        return append(req, t)

    monkeypatch.setattr(eng, "_append", failing)


def _in_last_stop_checks(monkeypatch, eng) -> None:
    """At the marked request's last token: its memory already went to the next step
    (Scheduler.release_ending), so failing it must not give it back twice."""
    append = eng._append

    def failing(req, t):
        if _marked(req) and len(req.output_token_ids) == req.max_tokens - 1:
            assert any(r is req for r in eng.scheduler.ending)
            raise Injected("stop checks")
        return append(req, t)

    monkeypatch.setattr(eng, "_append", failing)


def _in_detokenizer(monkeypatch, eng) -> None:
    step = IncrementalDetokenizer.step  # the text of a request without stop strings is made at its end

    def failing(self, token_id):
        if any(r.detok is self for r in eng._requests.values() if _marked(r)):
            raise Injected("detokenizer")
        return step(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "step", failing)


INJECTIONS = {
    "admission": _in_admission,
    "prefill step": lambda mp, eng: _in_step(mp, eng, "prefill"),
    "decode step": lambda mp, eng: _in_step(mp, eng, "decode"),
    "stop checks": _in_stop_checks,
    "stop checks at the last token": _in_last_stop_checks,
    "detokenizer": _in_detokenizer,
}


@pytest.mark.parametrize("where", list(INJECTIONS))
def test_one_failing_request_fails_alone_and_the_others_match_a_clean_run(clean, monkeypatch, where):
    e, ref = clean
    eng = e.llm_engine
    probes = eng.isolation._num_probes
    RAISED.clear()
    INJECTIONS[where](monkeypatch, eng)
    outs = e.generate(PROMPTS, GREEDY)
    monkeypatch.undo()
    if where.endswith("step"):  # the launch was bisected: the marked row shared its batch, then ran alone
        assert max(RAISED) > 1 and RAISED[-1] == 1, RAISED
    assert len(outs) == len(PROMPTS)  # the probe's output is not among them
    for i, (o, r) in enumerate(zip(outs, ref)):
        if i == MARKED:
            assert o.finished and o.outputs[0].finish_reason == "abort", o
            assert o.error.startswith("request failed in the engine") and "Injected" in o.error, o.error
        else:
            assert (o.error, o.outputs[0].finish_reason, o.outputs[0].token_ids) == (None, "length", r), i
    assert eng.dead is None and eng.isolation._num_probes == probes + 1  # the probe passed
    assert_idle_clean(e)


def test_after_the_failures_every_prompt_generates_as_in_the_clean_run(clean):
    e, ref = clean
    assert [o.outputs[0].token_ids for o in e.generate(PROMPTS, GREEDY)] == ref
    assert_idle_clean(e)


def _dead(e, needle: str) -> None:
    with pytest.raises(EngineDeadError, match=needle):
        e.generate(PROMPTS[:3], GREEDY)
    eng = e.llm_engine
    with pytest.raises(EngineDeadError, match=needle):  # and stays dead, saying why
        eng.step()
    with pytest.raises(EngineDeadError):
        eng.add_request([5, 6, 7], GREEDY)


def test_a_failure_of_every_batch_ends_the_engine_at_the_probe(monkeypatch):
    e = llm()

    def failing(*a, **kw):
        raise Injected("every step")

    monkeypatch.setattr(e.llm_engine.runner, "_step", failing)
    _dead(e, "probe")


class _LostTokens:
    def __array__(self, *a, **kw):
        raise RuntimeError("INTERNAL: device lost")


def test_a_device_error_or_a_lost_arena_ends_the_engine(monkeypatch):
    e = llm()
    runner = e.llm_engine.runner
    launch = runner.launch
    monkeypatch.setattr(runner, "launch", lambda batch, prev=None: Launched(launch(batch, prev).batch, _LostTokens()))
    _dead(e, "device error")

    e = llm()
    runner = e.llm_engine.runner

    def donated_then_failed(params, arena, *a, **kw):
        arena.data.delete()
        raise RuntimeError("execution failed")

    monkeypatch.setattr(runner, "_step", donated_then_failed)
    _dead(e, "arena")
