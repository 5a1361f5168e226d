"""Output text as it grows: incremental detokenizing and stop-string matching.

    d = IncrementalDetokenizer(tok, prompt_ids); text += d.step(token_id)
    hit = find_stop(text, len(new_text), ["\n\n"])    # (where it starts, which stop string) or None
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """New text per new token, holding back bytes that are not yet a whole character.

    Decodes a short window [prefix, end) of ids and emits what it adds beyond [prefix, read):
    starting a few prompt tokens back keeps tokenizers that drop a leading space honest.  The
    window starts on a character: a character the tokenizer split into byte tokens (rare emoji,
    CJK) and cut by the window would decode as U+FFFD, and a byte-fallback decoder then turns the
    whole run of byte tokens after it into U+FFFD too, the generated ones included.
    """

    WINDOW = 5  # prompt tokens decoded before the first generated one
    MAX_WINDOW = 32  # how far back a window may start to find a character's first byte

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        start = max(0, len(prompt_ids) - self.WINDOW)
        while start > max(0, len(prompt_ids) - self.MAX_WINDOW) and \
                tokenizer.decode(list(prompt_ids[start:]), skip_special_tokens).startswith("\ufffd"):
            start -= 1
        self.ids = list(prompt_ids[start:])
        self.prefix = 0
        self.read = len(self.ids)

    def step(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        before = self.tok.decode(self.ids[self.prefix:self.read], self.skip)
        text = self.tok.decode(self.ids[self.prefix:], self.skip)
        if len(text) > len(before) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(before):]
        return ""


def find_stop(text: str, new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """First stop string ending inside the last `new_chars` characters of `text` ->
    (index where it starts, the stop string), or None."""
    best = None
    for s in stops:
        if not s:
            continue
        i = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


__all__ = ["IncrementalDetokenizer", "find_stop"]
