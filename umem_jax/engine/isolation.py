"""FailureIsolation: an exception caused by one request fails that request, not the engine.

A step can raise where a request's own data is at work:

  admission     the scheduler places a request's pass (cache lookup, pricing, memory,
                checkpoints): it drops that request (`Scheduler.fail`, reported through
                `take_failed`) and the batch goes on without it.
  launch        `Runner.launch` raised (packing, tracing, compiling, dispatch) and the arena is
                intact, so nothing ran: the batch is launched again in halves, and halves of the
                halves that fail, until the rows that fail alone are found.  Those requests fail;
                every other row ran, once.
  read-back     a row's token is applied (stop checks, detokenizing, the output): that request
                fails.  So does one whose text fails while AsyncLLMEngine streams it
                (LLMEngine.fail_request, between steps).

A failed request ends with finish_reason "abort" and `error` saying where and what raised; its
pages and slots go back to the arena, and nothing more of it is handed to the prefix cache (a
failed pass claims tokens it never wrote; what earlier passes computed was handed over when
they ran).  The idle checks count it like any other request.

Whose fault was it?  After a failure the engine sends a probe: a known-good request (8 token
ids, 2 greedy tokens, most preferred) through the same scheduler, runner and read-back.  If
the probe fails too, the failure is the engine's: it stops with EngineDeadError.  So does any
failure outside the three places (the scheduler's decode step, page moves, the idle checks),
a step whose tokens cannot be read (a device error), and a launch that lost the arena
(donated to a call that failed).  Once dead, every later call raises EngineDeadError.
"""

from __future__ import annotations

import logging

import jax

from ..core.request import Request, RequestOutput, RequestStatus
from ..core.sampling_params import SamplingParams
from ..core.scheduled_batch import Row, ScheduledBatch

log = logging.getLogger("umem_jax")

PROBE_PROMPT = list(range(1, 9))


class EngineDeadError(RuntimeError):
    """The engine cannot go on (a device error, or a failure that is not one request's)."""


class FailureIsolation:
    """The engine's failure handling (one per LLMEngine, which calls it from step())."""

    def __init__(self, engine):
        self.engine = engine
        self.num_failed = 0  # requests failed by an exception
        self.probe: Request | None = None  # the probe in flight, if any
        self.probing = False  # a probe is due or in flight: the engine calls after_step (else not at all)
        self._probe_due = False
        self._num_probes = 0

    # ------------------------------------------------------------------ failing one request
    def fail(self, req: Request, error: BaseException, where: str) -> None:
        """End `req` with an error: its memory back, reported by the next step() (or at once
        through the request, which is finished).  The probe failing ends the engine."""
        self.engine.scheduler.fail(req)
        self.report(req, error, where)

    def report(self, req: Request, error: BaseException, where: str) -> None:
        """Record the failure of `req`, already dropped by the scheduler."""
        if req is self.probe:
            raise EngineDeadError(f"the engine failed a known-good probe request ({where}): "
                                  f"{type(error).__name__}: {error}") from error
        log.warning("umem_jax: request %s failed (%s): %r", req.request_id, where, error)
        req.detok = None  # its output must not run the detokenizer again
        req.mark_finished(RequestStatus.FINISHED_ABORTED,
                          error=f"request failed in the engine ({where}): {type(error).__name__}: {error}")
        self.engine._aborted.append(req)
        self.num_failed += 1
        self._probe_due = self.probing = True

    # ------------------------------------------------------------------ a failed launch
    def relaunch(self, batch: ScheduledBatch, error: BaseException) -> list[RequestOutput]:
        """`batch`'s launch raised `error`: launch it in halves until the rows that fail alone
        are found, fail their requests, then read back the step in flight and every part that
        ran (in launch order; nothing is left in flight) -> outputs of finished requests."""
        eng = self.engine
        self.check_arena(error)
        prev = eng.runner.prev_tokens  # pending inputs of every part come from the step in flight
        parts, failed, launched = _halves(batch.rows), [], []
        spec = None if batch.spec_lens is None else dict(zip(map(id, batch.rows), batch.spec_lens))
        if not parts:
            failed.append((batch.rows[0], error))
        while parts:
            rows = parts.pop(0)
            part = ScheduledBatch(batch.kind, rows, spec_lens=None if spec is None else [spec[id(r)] for r in rows])
            try:
                launched.append(eng.runner.launch(part, prev=prev))
            except Exception as e:  # noqa: BLE001 - narrowed down below
                self.check_arena(e)
                if len(rows) == 1:
                    failed.append((rows[0], e))
                else:
                    parts[:0] = _halves(rows)
        for row, e in failed:
            self.fail(row.req, e, f"{batch.kind} step")
        outs = []
        if eng._inflight is not None:
            outs += eng._process(eng._inflight)
            eng._inflight = None
        for part in launched:
            outs += eng._process(part)
        return outs

    def check_arena(self, error: BaseException) -> None:
        """A failed launch may have donated the arena: then every request's memory is gone."""
        leaves = jax.tree.leaves(self.engine.runner.arena)
        if any(getattr(x, "is_deleted", lambda: False)() for x in leaves):
            raise EngineDeadError(f"a step failed after the arena was handed to it: {error!r}") from error

    # ------------------------------------------------------------------ the probe
    def after_step(self, outs: list[RequestOutput]) -> list[RequestOutput]:
        """Send a probe if a request failed and none is in flight; leave the probe's output out."""
        probe = self.probe
        if probe is not None:
            if probe.finished:
                self.probe = None
            outs = [o for o in outs if o.request_id != probe.request_id]
        if self._probe_due and self.probe is None:
            self._probe_due = False
            self._send_probe()
        self.probing = self.probe is not None or self._probe_due
        return outs

    def _send_probe(self) -> None:
        eng = self.engine
        self._num_probes += 1
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        rid = f"umem-probe-{self._num_probes}"
        while rid in eng._requests:  # a caller's id
            rid += "+"
        req = eng.prepare(PROBE_PROMPT, params, request_id=rid, priority=eng.config.priority_range[0])
        eng.enqueue(req)
        if req.finished:  # refused by the memory clip (a tiny arena): no verdict, nothing in flight
            eng._aborted.remove(req)
            eng._requests.pop(req.request_id, None)
            return
        self.probe = req


def _halves(rows: list[Row]) -> list[list[Row]]:
    half = len(rows) // 2
    return [rows[:half], rows[half:]] if half else []


__all__ = ["EngineDeadError", "FailureIsolation"]
