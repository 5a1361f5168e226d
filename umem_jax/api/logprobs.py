"""Token logprobs in OpenAI's shapes, from what the engine records per output token.

The engine records, per token (core.request.TokenLogprobs): the chosen token's logprob and rank,
then the top alternatives' ids and logprobs, most likely first.  The server writes them as

  completions  CompletionLogProbs: tokens, token_logprobs, text_offset, and top_logprobs: {text:
               logprob} of the chosen token and the top `logprobs` alternatives (up to logprobs
               + 1 entries, as OpenAI documents; tokens of one text share its key: the chosen
               token's logprob, else the likeliest)
  chat         ChatLogProbs.content: per token {token, logprob, bytes, top_logprobs: the top
               `top_logprobs` alternatives, each {token, logprob, bytes}}

A token's text is the tokenizer's decoding of that one id (special tokens kept: "<eos>"), its
bytes the UTF-8 bytes of that text -- or the raw byte of a byte token (the byte tokenizer's ids,
SentencePiece's <0xNN> byte fallback), which is no character by itself.  A model without a
tokenizer names tokens "token_id:N" (vLLM's convention).  text_offset counts the characters of
the token texts before it (vLLM's way; not the choice's text, which may hold back partial
characters).  A logprob of -inf (a token the model rules out) is written as -9999.0, as vLLM
does: JSON has no infinity.
"""

from __future__ import annotations

import functools
import re

from ..engine.tokenizer import ByteTokenizer, HFTokenizer
from .responses import ChatLogProbs, ChatTokenLogprob, CompletionLogProbs, TopLogprob

FLOOR = -9999.0
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=1 << 16)
def token_piece(tok, t: int) -> tuple[str, tuple[int, ...]]:
    """(text, bytes) of token id t."""
    if tok is None:
        text = f"token_id:{t}"
        return text, tuple(text.encode())
    if isinstance(tok, ByteTokenizer) and tok.offset <= t < tok.offset + 256:
        raw = bytes([t - tok.offset])
        return raw.decode("utf-8", errors="replace"), tuple(raw)
    text = tok.decode([t], False)
    m = _BYTE_PIECE.fullmatch(tok.tok.id_to_token(t) or "") if isinstance(tok, HFTokenizer) else None
    if m is not None:
        return text, (int(m.group(1), 16),)
    return text, tuple(text.encode("utf-8"))


def clamp(x: float) -> float:
    """A logprob as JSON can carry it: -inf is FLOOR."""
    return max(float(x), FLOOR)


class CompletionLogprobWriter:
    """The logprobs of one completion choice, chunk by chunk (text offsets run on between chunks);
    `total` gathers every chunk's."""

    def __init__(self, tok, as_ids: bool = False):
        self.tok, self.offset = tok, 0
        self.shown = None if as_ids else tok  # return_tokens_as_token_ids: tokens written "token_id:N"
        self.total = CompletionLogProbs()

    def chunk(self, token_ids: list[int], entries: list) -> CompletionLogProbs:
        """These tokens' logprobs; an entry None (an echoed prompt's first token, which nothing
        before it scores) is written with null logprob and null top_logprobs, as OpenAI does."""
        out = CompletionLogProbs()
        for t, entry in zip(token_ids, entries):
            text, shown = token_piece(self.tok, t)[0], token_piece(self.shown, t)[0]
            lp, top = None, None
            if entry is not None:
                lp, _rank, ids, vals = entry
                lp = clamp(lp)
                top = {shown: lp}  # tokens of the same text share a key: the chosen one, else the likeliest
                for i, v in zip(ids, vals):
                    top.setdefault(token_piece(self.shown, i)[0], clamp(v))
            out.tokens.append(shown)
            out.token_logprobs.append(lp)
            out.top_logprobs.append(top)
            out.text_offset.append(self.offset)  # offsets in the text, whatever the tokens are written as
            self.offset += len(text)
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(self.total, name).extend(getattr(out, name))
        return out


def _top(tok, t: int, lp: float) -> TopLogprob:
    text, raw = token_piece(tok, t)
    return TopLogprob(token=text, logprob=clamp(lp), bytes=list(raw))


def chat_logprobs(tok, token_ids: list[int], entries: list) -> ChatLogProbs:
    """ChatLogProbs of these tokens (a whole choice, or one chunk's tokens)."""
    content = []
    for t, (lp, _rank, ids, vals) in zip(token_ids, entries):
        chosen = _top(tok, t, lp)
        content.append(ChatTokenLogprob(token=chosen.token, logprob=chosen.logprob, bytes=chosen.bytes,
                                        top_logprobs=[_top(tok, i, v) for i, v in zip(ids, vals)]))
    return ChatLogProbs(content=content)


__all__ = ["FLOOR", "CompletionLogprobWriter", "chat_logprobs", "clamp", "token_piece"]
