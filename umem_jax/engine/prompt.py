"""Prompts: text or token ids -> (text, ids), and the checks a request passes before it is queued.

    text, ids = prompt_ids("Hello", tok, max_model_len, max_token_chars(tok))   # or [1, 72, 105], a dict
    ids = truncate_prompt(ids, params.truncate_prompt_tokens, max_model_len)  # the last k, if asked
    check_prompt_len(len(ids), max_model_len)                      # ValueError "prompt: ..."

Messages that name a request field start with "field:" or "field=" (the server's 400 names it).
Each check is pure, so the server runs them in its request handlers, before the engine thread
sees the request (tokenizing a long text there would stall every other request).
"""

from __future__ import annotations

import numpy as np

from ..core.sampling_params import SamplingParams
from .tokenizer import ByteTokenizer


def prompt_ids(prompt, tokenizer, max_model_len: int, per_token: int | None) -> tuple[str | None, list[int]]:
    """A prompt -> (its text or None, its token ids).  A string is tokenized after the early
    length check (`per_token`: max_token_chars of the tokenizer); a dict is {"prompt": text}
    or {"prompt_token_ids": ids} (with "prompt" too: tokenized already, the text kept for the
    output).  Raises ValueError."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            text = prompt.get("prompt")
            return (text if isinstance(text, str) else None), prompt_ids(list(prompt["prompt_token_ids"]),
                                                                          tokenizer, max_model_len, per_token)[1]
        if "prompt" not in prompt:
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        prompt = prompt["prompt"]
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("empty prompt: give some text or token ids")
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids instead of text")
        check_text_len(prompt, max_model_len, per_token)
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, np.ndarray):
        prompt = prompt.tolist()
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                                                 for t in prompt):
        return None, [int(t) for t in prompt]
    raise ValueError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")


def max_token_chars(tokenizer) -> int | None:
    """At most how many characters of text one token covers: 1 for the byte tokenizer; else 4x
    the longest vocabulary entry (room for normalizers); None when unknown (no early check)."""
    if isinstance(tokenizer, ByteTokenizer):
        return 1
    vocab = getattr(getattr(tokenizer, "tok", None), "get_vocab", None)
    return 4 * max(map(len, vocab())) if vocab is not None else None


def check_text_len(text: str, max_model_len: int, per_token: int | None, field: str = "prompt") -> None:
    """Refuse text that cannot fit max_model_len whatever it tokenizes to, before tokenizing."""
    if per_token and len(text) > max_model_len * per_token:
        raise ValueError(f"{field}: {len(text):,} characters cannot fit max_model_len={max_model_len} tokens "
                         f"(a token covers at most {per_token} character{'s' if per_token > 1 else ''})")


def check_prompt_len(num_tokens: int, max_model_len: int, field: str = "prompt") -> None:
    """A prompt must leave room for one output token."""
    if num_tokens >= max_model_len:
        raise ValueError(f"{field}: {num_tokens} tokens leave no room for output: max_model_len is {max_model_len} "
                         f"(prompt + output tokens)")


def truncate_prompt(ids: list[int], k: int | None, max_model_len: int) -> list[int]:
    """The prompt's last `k` token ids (SamplingParams.truncate_prompt_tokens; -1: max_model_len,
    None: all of them).  A k above max_model_len is refused, as vLLM does."""
    if k is None:
        return ids
    if k > max_model_len:
        raise ValueError(f"truncate_prompt_tokens={k}: must be at most max_model_len={max_model_len} (-1: that)")
    return ids[-(max_model_len if k == -1 else k):]


def check_vocab_fields(params: SamplingParams, vocab: int) -> None:
    """Fields bounded by the vocabulary (they are packed into int32 sampling words)."""
    if params.top_k > vocab:
        raise ValueError(f"top_k={params.top_k}: must be at most the vocabulary size {vocab} (-1 or 0: off)")
    bad = [t for t in params.stop_token_ids if isinstance(t, bool) or not isinstance(t, (int, np.integer))
           or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"stop_token_ids={bad[:8]}: token ids must be in the vocabulary [0, {vocab})")
    for name in ("logit_bias", "allowed_token_ids"):
        bad = [t for t in (getattr(params, name) or ()) if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{name}={bad[:8]}: token ids must be in the vocabulary [0, {vocab})")


def check_priority(priority, priority_range: tuple[int, int]) -> None:
    lo, hi = priority_range
    if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)) or not lo <= priority <= hi:
        raise ValueError(f"priority={priority!r}: must be an int in [{lo}, {hi}] (the server's priority range)")


__all__ = ["check_priority", "check_prompt_len", "check_text_len", "check_vocab_fields", "max_token_chars",
           "prompt_ids", "truncate_prompt"]
