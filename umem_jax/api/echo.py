"""The choices of /v1/completions: the echoed prompt and the prompt's logprobs before the completion.

  echo: true            each choice's text starts with its prompt's text: a text prompt as sent,
                        token ids decoded by the tokenizer (special tokens dropped, as in the
                        completion's text; a model without a tokenizer writes no text, for its
                        completions have none either).  With logprobs: k the choice's logprobs
                        start with the prompt's tokens -- the first with null token_logprobs and
                        top_logprobs (nothing before it scores it), as OpenAI and vLLM write it --
                        and text_offset runs on from the prompt's tokens into the completion's.
  max_tokens 0 + echo   the prompt scored, nothing generated (lm-eval's loglikelihood request):
                        the engine draws one token (it needs max_tokens >= 1), which no choice
                        shows or counts; finish_reason "length".
  prompt_logprobs: k    vLLM's extra: per choice a list, null for the first prompt token, then
                        {"<token id>": {logprob, rank, decoded_token}} of the prompt token and
                        the top k.

The prompt is scored once, by its primary sample (core/prompt_logprobs.py: siblings of n /
best_of have no scores of their own), for the larger k of the two asks; each is cut to its own
k here.  The scores reach the server on the primary's first delta, and every choice of that
prompt shows them.  A stream starts each choice with a chunk of its prompt's text and scores;
with max_tokens 0 only the finishing chunk follows.  -inf is written as logprobs.FLOOR.
"""

from __future__ import annotations

from ..core.request import logprob_dict
from .logprobs import CompletionLogprobWriter, clamp, token_piece
from .protocol import CompletionRequest
from .responses import CompletionChoice, CompletionLogProbs, PromptLogprob


def prompt_text(tok, prompt: str | list[int]) -> str:
    """The text echo writes for a prompt: as sent, or its token ids decoded."""
    if isinstance(prompt, str):
        return prompt
    return tok.decode(prompt) if tok is not None else ""


def _cut(entry, k: int):
    """A TokenLogprobs entry with its top k alternatives (None stays None)."""
    return None if entry is None else (entry[0], entry[1], entry[2][:k], entry[3][:k])


def prompt_logprobs_json(tok, pl, k: int) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's prompt_logprobs of a PromptLogprobs, top k per token (an entry never scored -- a
    request that ended early -- is null too)."""
    text = (lambda t: token_piece(tok, t)[0]) if tok is not None else (lambda t: None)
    out = []
    for t, entry in zip(pl.ids, pl.entries):
        d = None
        if entry is not None:
            d = {str(i): PromptLogprob(logprob=clamp(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
                 for i, lp in logprob_dict(t, _cut(entry, k), text).items()}
        out.append(d)
    return out


class ChoiceWriter:
    """Writes one /v1/completions request's choices, whole or chunk by chunk.  `prompts`: the
    request's prompts (body.prompts()); samples are generation._Sample (prompt index, text,
    token ids, logprobs, finish)."""

    def __init__(self, body: CompletionRequest, tok, prompts: list):
        self.tok, self.echo, self.only, self.as_ids = tok, body.echo, body.echo_only, body.return_tokens_as_token_ids
        self.k_logprobs, self.k_echo, self.k_prompt = body.logprobs, body.echo_logprobs, body.prompt_logprobs
        self.texts = [prompt_text(tok, p) for p in prompts] if body.echo else []
        self._writers: dict = {}

    @property
    def scored(self) -> bool:
        """The choices show their prompt's scores (so a stream waits for the primary's)."""
        return self.k_echo is not None or self.k_prompt is not None

    def _writer(self, s) -> CompletionLogprobWriter | None:
        if self.k_logprobs is None:
            return None
        if s not in self._writers:
            self._writers[s] = CompletionLogprobWriter(self.tok, self.as_ids)
        return self._writers[s]

    def _head(self, s, pl) -> tuple[str, CompletionLogProbs | None, list | None]:
        """(text, logprobs, prompt_logprobs) that sample s's choice starts with; pl: its prompt's
        PromptLogprobs (None: not scored)."""
        text = self.texts[s.prompt] if self.echo else ""
        lp = extra = None
        if pl is not None and self.k_echo is not None:
            lp = self._writer(s).chunk(pl.ids, [_cut(e, self.k_echo) for e in pl.entries])
        if pl is not None and self.k_prompt is not None:
            extra = prompt_logprobs_json(self.tok, pl, self.k_prompt)
        return text, lp, extra

    def _finish(self, reason: str | None, stop) -> tuple[str | None, object]:
        # max_tokens 0: the one token drawn is not shown, so the output ended at its length
        if self.only and reason is not None and reason != "abort":
            return "length", None
        return reason, stop

    def whole(self, index: int, s, pl) -> CompletionChoice:
        """The finished choice of sample s."""
        text, _, extra = self._head(s, pl)
        w = self._writer(s)
        if not self.only:
            text += s.text
            if w is not None:
                w.chunk(s.token_ids, s.logprobs)
        reason, stop = self._finish(*s.finish)
        return CompletionChoice(index=index, text=text, logprobs=None if w is None else w.total,
                                finish_reason=reason, stop_reason=stop, prompt_logprobs=extra)

    def first(self, index: int, s, pl) -> CompletionChoice | None:
        """The chunk that starts sample s's streamed choice (None: echo and prompt_logprobs off)."""
        if not self.echo and self.k_prompt is None:
            return None
        text, lp, extra = self._head(s, pl)
        return CompletionChoice(index=index, text=text, logprobs=lp, prompt_logprobs=extra)

    def delta(self, index: int, s, d) -> CompletionChoice | None:
        """The streamed chunk of sample s's delta d (None: nothing to send)."""
        reason, stop = self._finish(d.finish_reason, d.stop_reason)
        if self.only:
            return None if reason is None else CompletionChoice(index=index, text="", finish_reason=reason)
        w = self._writer(s)
        lp = w.chunk(d.token_ids, d.logprobs) if w is not None and d.token_ids else None
        if not d.text and lp is None and reason is None:
            return None
        return CompletionChoice(index=index, text=d.text, logprobs=lp, finish_reason=reason, stop_reason=stop)


__all__ = ["ChoiceWriter", "prompt_logprobs_json", "prompt_text"]
