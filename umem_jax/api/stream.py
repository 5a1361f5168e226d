"""What a request streams: StreamDelta (what it produced since its previous delta) and
RequestStream (its deltas, in order), both made by AsyncLLMEngine."""

from __future__ import annotations

import asyncio
import dataclasses


@dataclasses.dataclass
class StreamDelta:
    """What one request produced since its previous delta."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # set on the last delta: "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # so far, this delta included
    error: str | None = None  # the engine failed: the request ends with this message
    logprobs: list | None = None  # per token of token_ids, what the engine recorded (core.request.TokenLogprobs)
    cached_tokens: int = 0  # prompt tokens the prefix cache served (known once admitted)
    # the prompt's scores (core.prompt_logprobs.PromptLogprobs), on the first delta of a primary
    # sample that asked for prompt_logprobs: complete once its first token exists (a request that
    # ends before that may leave entries None)
    prompt_logprobs: object | None = None


class RequestStream:
    """The deltas of one request, in order, ending with the one that has finish_reason."""

    def __init__(self, request_id: str, prompt_tokens: int, q: asyncio.Queue):
        self.request_id, self.prompt_tokens, self.queue = request_id, prompt_tokens, q
        self.finished = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamDelta:
        if self.finished:
            raise StopAsyncIteration
        d = await self.queue.get()
        self.finished = d.finish_reason is not None
        return d


__all__ = ["RequestStream", "StreamDelta"]
