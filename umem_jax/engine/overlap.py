"""When a launched step may stay in flight while the engine schedules and launches the next one
(async scheduling, engine.step), and when the step in flight must be read back first.

    plain / prefill   in flight while no request may speculate (a speculative step reads a
                      pending token from a speculative step's output only)
    speculative       in flight: the next decode step reads each row's accepted count on the
                      device (runner/shift.py) and is placed for the worst case; a row that
                      could reach max_tokens in it sits that step out (scheduler/speculation.py);
                      read back at once when a harness proposes drafts on the host
                      (SpecLaunched.overlap)
    any               read back first while a running request uses penalties: their counts need
                      every output token on the host
"""

from __future__ import annotations

from ..runner.runner import Launched
from ..runner.speculative import SpecLaunched


def needs_sync(engine, inflight: Launched) -> bool:
    """Whether `inflight` must be read back before the next step is scheduled."""
    running = engine.scheduler.running
    if any(r.params.has_penalties for r in running):
        return True
    if isinstance(inflight, SpecLaunched):
        return False
    return speculating(engine)


def may_overlap(engine, launched: Launched) -> bool:
    """Whether `launched` may stay in flight until after the next step is launched (else it is
    read back at once: also when the next step would read it back first anyway)."""
    if not engine.config.async_scheduling:
        return False
    if isinstance(launched, SpecLaunched):
        return launched.overlap and not needs_sync(engine, launched)
    return not speculating(engine)


def speculating(engine) -> bool:
    """Speculation is on and a request may still speculate (a running one, or one not yet
    admitted): plain and prefill steps are read back at once.  Once every request switched it
    off, decoding runs with the overlap as without speculation."""
    return engine.spec_stats is not None and (
        bool(engine.scheduler.waiting) or any(not r.spec_off for r in engine.scheduler.running))


__all__ = ["may_overlap", "needs_sync", "speculating"]
