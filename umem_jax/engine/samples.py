"""Samples: a prompt's n (or best_of) parallel samples, forked from one prefill of the prompt.

    engine.add_request("Hi", SamplingParams(n=4, temperature=0.8))   # one RequestOutput, 4 outputs

Each sample is a Request of its own (scheduled, retracted and finished alone).  The first, the
primary, keeps the id the caller gets and is queued like any request; the others, its
siblings ("<id>#1", ...), wait until the primary's prompt is computed (its last prefill pass is
launched).  Then they are queued, and at admission they find the prompt's full pages in the
prefix cache (handed to it at the start of that schedule): they share those pages (the page
owner's refcounts), skip their tokens, and the demand model prices for each sibling only what
it adds -- the prompt's last partial page, its recurrent state slot, its own output -- so the
prompt is computed, held and priced once.  Without a prefix cache the siblings are queued at
once (there is nothing to share).

step() reports a group once, when every sample finished: its outputs in index order, or for
best_of the n with the highest mean token logprob (OpenAI's rule), indexed by that rank.
Seeds: sample 0 draws with the request's seed itself (so the first of n samples is the n=1
output); sample i > 0 with one derived from (seed, i).  Aborting the primary aborts the group.
"""

from __future__ import annotations

import dataclasses

from ..core.prompt_logprobs import PromptLogprobs
from ..core.request import Request, RequestOutput
from ..core.sampling_params import SamplingParams, seed_word


def num_logprobs(params: SamplingParams) -> int | None:
    """Alternatives recorded per token: what the request asks, else 0 (the chosen token's
    logprob only) when best_of ranks its samples, else None (no logprobs)."""
    if params.logprobs is not None:
        return params.logprobs
    return 0 if params.num_samples > params.n else None


def best_order(cumulative: list[float | None], lengths: list[int]) -> list[int]:
    """Sample indices by mean token logprob, best first (ties: the lower index)."""
    mean = [(c if c is not None else float("-inf")) / n if n else float("-inf") for c, n in zip(cumulative, lengths)]
    return sorted(range(len(mean)), key=lambda i: (-mean[i], i))


@dataclasses.dataclass(eq=False)
class Group:
    """The samples of one prompt, until every one finished."""

    members: list[Request]  # in sample order; members[0] is the primary
    n: int
    done: dict[str, RequestOutput] = dataclasses.field(default_factory=dict)

    def output(self) -> RequestOutput:
        first = self.members[0]
        outs = [self.done[m.request_id].outputs[0] for m in self.members]
        if len(outs) > self.n:  # best_of: keep the n best, indexed by rank (their logprobs only if asked)
            order = best_order([o.cumulative_logprob for o in outs], [len(o.token_ids) for o in outs])
            shown = first.params.logprobs is not None
            outs = [dataclasses.replace(outs[i], index=rank, logprobs=outs[i].logprobs if shown else None)
                    for rank, i in enumerate(order[: self.n])]
        error = next((self.done[m.request_id].error for m in self.members if self.done[m.request_id].error), None)
        return RequestOutput(first.request_id, first.prompt, list(first.prompt_token_ids), outs, True, first.metrics,
                             error, first.num_cached_tokens, self.done[first.request_id].prompt_logprobs)


class Samples:
    """The engine's sample groups: forks made at prepare, siblings held until their primary's
    prompt is computed, and the groups' outputs merged."""

    def __init__(self, engine):
        self.engine = engine
        self.held: list[Request] = []  # primaries whose siblings are not queued yet
        self.groups: dict[str, Group] = {}  # member id -> its group, until the group is reported

    def fork(self, req: Request) -> None:
        """Set what `req` records (logprobs) and make its siblings (not queued).  Raises
        ValueError, changing nothing, for what the engine cannot do."""
        eng, p = self.engine, req.params
        if p.prompt_logprobs is not None and eng.runner.speculator is not None:
            raise ValueError("prompt_logprobs: not offered with speculative decoding (its prefill steps do not score "
                             "the prompt); start the engine without a speculative config for them")
        wants = num_logprobs(p)
        req.record_logprobs(wants)
        req.prompt_lp = None if p.prompt_logprobs is None else PromptLogprobs(req.prompt_token_ids, p.prompt_logprobs)
        req.siblings = []
        for i in range(1, p.num_samples):
            arrival = next(eng._arrivals)
            seed = eng.config.seed * 1_000_003 + arrival if p.seed is None else int(p.seed) + i * 0x9E3779B9
            sid = f"{req.request_id}#{i}"
            while sid in eng._requests:
                sid += "+"
            s = Request(sid, req.prompt, req.prompt_token_ids, p, arrival=arrival, seed=seed_word(seed),
                        max_tokens=req.max_tokens, priority=req.priority, windows=tuple(req.window_start))
            s.stop_ids, s.sample_index = list(req.stop_ids), i
            s.record_logprobs(wants)
            req.siblings.append(s)

    def hold(self, req: Request) -> None:
        """`req` (a primary) was queued: its siblings wait for its prompt (or go now, without a
        prefix cache); the group is reported as one."""
        if not req.siblings:
            return
        self._register(req)
        self.held.append(req)
        if self.engine.scheduler.cache is None:
            self.release()

    def refuse(self, req: Request) -> list[Request]:
        """`req` (a primary) was refused at enqueue: its group is registered so that it is
        reported as one, with all its samples -> the siblings, to be finished as it is."""
        if not req.siblings:
            return []
        self._register(req)
        return list(req.siblings)

    def _register(self, req: Request) -> None:
        """`req`'s group is reported as one; its siblings' ids are taken (abort_request finds them)."""
        group = Group([req, *req.siblings], req.params.n)
        for m in group.members:
            self.groups[m.request_id] = group
        for s in req.siblings:
            self.engine._requests[s.request_id] = s

    def release(self) -> None:
        """Queue the siblings of every primary whose prompt is computed (or that finished)."""
        for req in [r for r in self.held if r.finished or r.num_computed >= r.prompt_len
                    or self.engine.scheduler.cache is None]:
            self.held.remove(req)
            for s in req.siblings:
                if not s.finished:  # (aborted while held: reported already)
                    self.engine.enqueue(s)

    def merge(self, outs: list[RequestOutput]) -> list[RequestOutput]:
        """Outputs of a step with each group's members replaced by the group, once all finished."""
        merged = []
        for o in outs:
            group = self.groups.get(o.request_id)
            if group is None:
                merged.append(o)
                continue
            group.done[o.request_id] = o
            if len(group.done) == len(group.members):
                for m in group.members:  # only now: the primary's id names the group until it is reported
                    self.groups.pop(m.request_id, None)
                merged.append(group.output())
        return merged

    def rest(self, request_id: str) -> list[Request]:
        """The unfinished samples of the group `request_id` names (its primary's id), the primary
        left out: they go with it when it is aborted, even after it finished (the group is not)."""
        group = self.groups.get(request_id)
        if group is None or group.members[0].request_id != request_id:
            return []
        return [m for m in group.members[1:] if not m.finished]


__all__ = ["Group", "Samples", "best_order", "num_logprobs"]
