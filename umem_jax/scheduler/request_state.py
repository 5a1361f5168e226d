"""Every change the scheduler makes to a request's scheduling state, one named function each.

A request's scheduling state is its status, how many of its tokens are computed
(`num_computed`), the memory it holds (`pages`, `slots`, `window_start`) and its prefix-cache
fields (`fork`, `ckpts`, `cache_node`, `cache_pages`).  Only the scheduler package changes them,
and only through these functions, so each transition can be read in one place.
"""

from __future__ import annotations

import time

from ..core.request import Request, RequestStatus


# ------------------------------------------------------------------ status
def mark_waiting(req: Request) -> None:
    req.status = RequestStatus.WAITING


def mark_running(req: Request, cached_tokens: int) -> None:
    """Admitted: the first admission stamps the time and the prompt tokens the cache served."""
    req.status = RequestStatus.RUNNING
    if req.metrics.first_scheduled_time is None:
        req.metrics.first_scheduled_time = time.time()
        req.num_cached_tokens = cached_tokens


def mark_finished(req: Request, status: RequestStatus) -> None:
    """Out of the queues with `status` (the engine records why: Request.mark_finished)."""
    req.status = status


# ------------------------------------------------------------------ progress
def compute_to(req: Request, end: int) -> None:
    """A launched step computes the request's tokens up to `end`."""
    req.num_computed = end


def restart(req: Request, *, preempted: bool) -> None:
    """Retracted: it keeps its tokens but computes them all again (no fork is known)."""
    req.num_computed = 0
    req.fork = 0
    req.metrics.num_retractions += 1
    if preempted:
        req.metrics.num_preemptions += 1


# ------------------------------------------------------------------ memory
def hold(req: Request, pages: list[int], slots: list[int]) -> None:
    """New token page ids and state slots, after those it holds."""
    req.pages += pages
    req.slots += slots


def drop_held_since(req: Request, num_pages: int, num_slots: int) -> None:
    """Forget the page ids and slots past the first `num_pages` / `num_slots` (rolled back)."""
    del req.pages[num_pages:], req.slots[num_slots:]


def pass_window(req: Request, window: str, first_page: int) -> None:
    """Pages before `first_page` are out of every future query's `window`."""
    req.window_start[window] = first_page


def forget_memory(req: Request, windows: tuple[str, ...]) -> None:
    """Holds nothing any more: no pages, slots, planned checkpoints or cached prefix."""
    req.pages, req.slots, req.ckpts = [], [], []
    req.window_start = {name: 0 for name in windows}
    req.cache_node, req.cache_pages = None, 0


# ------------------------------------------------------------------ prefix cache
def set_fork(req: Request, fork: int) -> None:
    """Where the request leaves a cached path that goes on (0: nowhere known)."""
    req.fork = fork


def resume_from(req: Request, pages: list[int], window_start: dict[str, int], resume: int, node) -> None:
    """A cache hit: the request holds the shared `pages` (cached up to `node`) and skips their
    `resume` tokens."""
    req.pages = pages
    req.window_start.update(window_start)
    req.num_computed = resume
    req.cache_node, req.cache_pages = node, len(pages)


def undo_resume(req: Request) -> None:
    """The hit is dropped: nothing is computed."""
    req.num_computed = 0


def plan_checkpoints(req: Request, checkpoints: list[tuple[int, int]]) -> None:
    """State checkpoints ((position, slot), ...) its next pass writes, for the cache."""
    req.ckpts += checkpoints


def take_planned_checkpoints(req: Request) -> list[tuple[int, int]]:
    """The planned checkpoints, handed over: the request no longer holds their slots."""
    planned, req.ckpts = req.ckpts, []
    return planned


def mark_cached(req: Request, node, num_pages: int) -> None:
    """Its first `num_pages` pages are in the cache, the last one at `node`."""
    req.cache_node, req.cache_pages = node, num_pages


def add_checkpoint(req: Request, slot: int) -> None:
    """A checkpoint of the state after every token it computed, in `slot`."""
    req.ckpts.append((req.num_computed, slot))
