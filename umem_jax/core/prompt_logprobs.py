"""Prompt logprobs: each prompt token's log probability given the tokens before it (vLLM's
`prompt_logprobs`; OpenAI completions' `echo` with `logprobs`).

    params = SamplingParams(prompt_logprobs=2, max_tokens=1)
    out.prompt_logprobs   # [None, {id: Logprob, ...}, ...]: one entry per prompt token

A prefill step whose rows ask for them scores every token of its chunk against the token after
it (runner.step: the rows' `targets`; the chunk's last position against the first token of the
next chunk), so the passes over positions 0..n-2 of an n-token prompt give entries 1..n-1; entry
0 is None (nothing comes before the first token).  A request that asks is computed from its
first token: the scheduler gives it no prefix-cache hit until its entries are complete
(prefix_sharing.take_hit).  A pass that computes a position again (after a retraction) leaves
its entry as it was.
"""

from __future__ import annotations

from .request import Logprob, TokenLogprobs, logprob_dict


class PromptLogprobs:
    """The entries of one prompt, filled pass by pass.  k: top alternatives kept per token."""

    def __init__(self, prompt_token_ids: list[int], k: int):
        self.ids = prompt_token_ids
        self.k = int(k)
        self.entries: list[TokenLogprobs | None] = [None] * len(prompt_token_ids)
        self.missing = max(len(prompt_token_ids) - 1, 0)  # entries 1..n-1 not recorded yet

    @property
    def complete(self) -> bool:
        return self.missing == 0

    def add(self, arrays, row: int, start: int, end: int) -> None:
        """Record row `row`'s chunk of positions [start, end) from a step's read-back arrays
        (numpy: logprob [B, T], rank [B, T], top ids [B, T, k'], top logprobs [B, T, k'], k' >= k):
        position p scores prompt token p + 1."""
        stop = min(end, len(self.ids) - 1)
        if stop <= start:
            return
        chosen, rank, ids, vals = arrays
        n, k = stop - start, self.k
        rows = zip(chosen[row, :n].tolist(), rank[row, :n].tolist(), ids[row, :n, :k].tolist(),
                   vals[row, :n, :k].tolist())
        for p, entry in enumerate(rows, start + 1):
            if self.entries[p] is None:
                self.entries[p] = entry
                self.missing -= 1

    def output(self, text) -> list[dict[int, Logprob] | None]:
        """vLLM's shape: None for the first token, then {id: Logprob} of the prompt token and the
        top alternatives.  text(id) -> its text (or None)."""
        return [None if e is None else logprob_dict(t, e, text) for t, e in zip(self.ids, self.entries)]


__all__ = ["PromptLogprobs"]
