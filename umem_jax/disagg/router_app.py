"""The router's OpenAI API (`umem-jax router`): /v1/completions and /v1/chat/completions, streamed
or not, over router.Router's tokenize / reserve / prefill / stream; /health, /v1/models and
/router/stats.  Choices carry `token_ids` besides the text.  Not supported yet (400 by name): n /
best_of > 1, logprobs, echo, prompt_logprobs, suffix, several prompts in one request.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..api.errors import APIError, add_handlers, bad_request, error
from ..api.protocol import ChatCompletionRequest, CompletionRequest
from .router import Router


def _asked(body, name: str) -> bool:
    """The request sets `name` (a field of its model, else an extra) to something but None / false."""
    value = getattr(body, name) if name in type(body).model_fields else (body.model_extra or {}).get(name)
    return value is not None and value is not False


def _refuse(body) -> None:
    # the router writes only the decode worker's tokens; the prompt's scores stay in the prefill
    # worker's passes (a handoff refuses prompt_logprobs), so neither echo nor them can be answered
    for name in ("prompt_logprobs", "echo"):
        if _asked(body, name):
            raise APIError(400, f"{name} is not supported by the disaggregated router (it returns no prompt text "
                           "or prompt logprobs); send such requests to a server that is not disaggregated", name)
    if body.n != 1 or (body.best_of or 1) != 1 or body.num_logprobs() is not None:
        raise APIError(400, "the disaggregated router supports n=1 without logprobs for now")
    bad = body.unsupported()
    if bad:
        raise APIError(400, f"{bad} is not supported", bad)


def build_router_app(router: Router, model_name: str = "umem-jax") -> FastAPI:
    app = FastAPI(title="umem_jax router", docs_url=None, redoc_url=None)
    add_handlers(app)

    @app.get("/health")
    async def health():
        for url in router.prefill + router.decode:
            try:
                if (await router.client.get(f"{url}/health", timeout=5)).status_code != 200:
                    return error(503, f"{url} is not ready")
            except httpx.HTTPError as e:
                return error(503, f"{url} is unreachable: {e}")
        return JSONResponse({})

    @app.get("/v1/models")
    async def models():
        r = await router._any_decode("GET", "/v1/models")
        return JSONResponse(r.json(), status_code=r.status_code)

    @app.get("/router/stats")
    async def stats():
        return {**router.counts, "errors": list(router.errors)}

    @app.post("/v1/completions")
    async def completions(raw: Request):
        body = CompletionRequest(**await raw.json())
        _refuse(body)
        prompts = body.prompts()
        if len(prompts) != 1:
            raise APIError(400, "the disaggregated router takes one prompt per request for now", "prompt")
        p = prompts[0]
        ids = p if isinstance(p, list) else await router.tokenize({"prompt": p})
        return await _respond(router, body, ids, "text_completion", body.model or model_name)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request):
        body = ChatCompletionRequest(**await raw.json())
        _refuse(body)
        template = {"add_generation_prompt": body.add_generation_prompt,  # rendered at the decode worker as asked
                    "continue_final_message": body.continue_final_message,
                    "chat_template_kwargs": _template_kwargs(body)}
        ids = await router.tokenize({"messages": body.conversation(), **template})
        return await _respond(router, body, ids, "chat.completion", body.model or model_name)

    return app


def _template_kwargs(body) -> dict | None:
    try:
        return body.template_kwargs()
    except ValueError as e:
        raise bad_request(e) from None


def _params(body) -> dict:
    try:
        return dataclasses.asdict(body.sampling_params())
    except ValueError as e:
        raise APIError(400, str(e)) from None


def _choice(kind: str, d: dict, stream: bool, role: str = "assistant") -> dict:
    out = {"index": 0, "finish_reason": d.get("finish_reason"), "stop_reason": d.get("stop_reason"),
           "token_ids": d.get("token_ids", [])}
    if kind == "text_completion":
        out["text"] = d.get("text", "")
    else:
        out["delta" if stream else "message"] = {"role": role, "content": d.get("text", "")}
    return out


async def _respond(router: Router, body, ids: list[int], kind: str, model: str):
    params, rid = _params(body), f"{'cmpl' if kind == 'text_completion' else 'chatcmpl'}-{uuid.uuid4().hex[:16]}"
    k = params.get("truncate_prompt_tokens")
    if k is not None and k > 0:  # cut here so the usage counts what the workers see (-1: theirs, by max_model_len)
        ids = ids[-k:]
    gen = router.deltas(ids, params, (body.model_extra or {}).get("request_id"))
    role = body.response_role() if kind != "text_completion" else "assistant"
    head = {"id": rid, "object": kind if not body.stream or kind == "text_completion" else "chat.completion.chunk",
            "created": int(time.time()), "model": model}
    if not body.stream:
        text, toks, last = "", [], {}
        async for d in gen:
            text, toks, last = text + d.get("text", ""), toks + d.get("token_ids", []), d
        if last.get("error"):
            raise APIError(500, last["error"])
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(toks), "total_tokens": len(ids) + len(toks)}
        return JSONResponse({**head, "choices": [_choice(kind, {**last, "text": text, "token_ids": toks}, False, role)],
                             "usage": usage})
    first = await anext(gen)  # errors before the first token are still an HTTP status

    async def events():
        d = first
        while True:
            if d.get("error"):
                yield f"data: {json.dumps({'error': {'message': d['error'], 'type': 'server_error', 'code': 500}})}\n\n"
                break
            yield f"data: {json.dumps({**head, 'choices': [_choice(kind, d, True, role)]})}\n\n"
            if d.get("finish_reason") is not None:
                break
            try:
                d = await anext(gen)
            except StopAsyncIteration:
                break
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def serve_router(router: Router, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> int:
    """Serve the router -> 0; 2 without serving when the workers that answer cannot work together
    (Router.check_workers: the reason is logged)."""
    import asyncio
    import logging

    import uvicorn

    why = asyncio.run(router.check_workers())
    if why is not None:
        logging.getLogger("umem_jax").error("umem-jax router: refusing to start: %s", why)
        return 2
    uvicorn.run(build_router_app(router), host=host, port=port, log_level=log_level)
    return 0
