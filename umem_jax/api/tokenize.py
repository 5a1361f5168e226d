"""vLLM's tokenizer endpoints: POST /tokenize and POST /detokenize.

    POST /tokenize    {"prompt": "Hi"} or {"messages": [...]}  -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"tokens": [1, 72, 105]}                 -> {"prompt": "<bos>Hi"}

Text is tokenized in the server's tokenizer pool (never on the engine thread), chat messages
through the chat template, exactly as a generation request would be; /detokenize keeps special
tokens (as vLLM's does).  Ids outside the vocabulary are a 400 naming `tokens`.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel

from .async_engine import AsyncLLMEngine
from .errors import APIError, bad_request
from .logprobs import token_piece
from .protocol import ChatMessage, ChatTemplateFields, _Request

router = APIRouter()


class TokenizeRequest(ChatTemplateFields):
    """A `prompt` (text) or chat `messages` (through the chat template), not both."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # text only (a chat template writes its own BOS)
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def _tokenizer(raw: Request, model: str | None):
    if model is not None and model not in raw.app.state.names:
        raise APIError(404, f"The model `{model}` does not exist.", "model")
    engine: AsyncLLMEngine = raw.app.state.engine
    if engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer (it takes token ids only)")
    return engine


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, raw: Request):
    engine = _tokenizer(raw, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", "prompt")
    if body.messages is not None:
        try:
            conv = [{"role": m.role, "content": m.text()} for m in body.messages]
            ids = await engine.tokenize_chat(conv, body.add_generation_prompt, check_len=False,
                                             continue_final_message=body.continue_final_message,
                                             template_kwargs=body.template_kwargs())
        except ValueError as e:
            raise APIError(400, str(e), bad_request(e).param or "messages") from None
    else:
        ids = await engine.encode(body.prompt, body.add_special_tokens)
    strs = [token_piece(engine.tokenizer, t)[0] for t in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, raw: Request):
    engine = _tokenizer(raw, body.model)
    vocab = engine.engine.model.config.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"tokens={bad[:8]}: token ids must be in the vocabulary [0, {vocab})", "tokens")
    return DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens, False))


__all__ = ["DetokenizeRequest", "DetokenizeResponse", "TokenizeRequest", "TokenizeResponse", "router"]
