"""Guards in front of the routes (ASGI middleware): the API key and the request-body limit.

    app = ApiKeyGuard(BodyLimit(app, 16 << 20), "secret")    # build_app does this

ApiKeyGuard: with a key set, every /v1/* request must carry `Authorization: Bearer <key>`, else
401 (compared in constant time).  /health and /metrics stay open: probes and scrapers carry no
key.  BodyLimit: a body over `max_bytes` is a 413 -- at once when Content-Length says so, else
as soon as that many bytes arrived (chunked uploads), so nothing past the limit is read.
Errors are the OpenAI error object, as every other error of the server.
"""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from .protocol import error_body

DEFAULT_MAX_REQUEST_BYTES = 16 << 20


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


async def _refuse(scope, receive, send, status: int, message: str, headers: dict | None = None) -> None:
    await JSONResponse(error_body(status, message), status_code=status, headers=headers)(scope, receive, send)


class BodyLimit:
    """413 for request bodies over `max_bytes` (None: no limit)."""

    def __init__(self, app, max_bytes: int | None):
        self.app, self.max_bytes = app, max_bytes

    def message(self, size: str) -> str:
        return (f"request body of {size} bytes is over the server's limit of {self.max_bytes:,} bytes "
                f"(--max-request-bytes)")

    async def __call__(self, scope, receive, send):
        limit = self.max_bytes
        if scope["type"] != "http" or limit is None:
            return await self.app(scope, receive, send)
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await _refuse(scope, receive, send, 413, self.message(f"{int(length):,}"))
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # FastAPI hands an HTTPException raised here to the app's handler
                    raise HTTPException(413, self.message(f"more than {limit:,}"))
            return message

        await self.app(scope, limited, send)


class ApiKeyGuard:
    """401 for /v1/* requests without `Authorization: Bearer <api_key>` (None: open)."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.expected = None if not api_key else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if self.expected is not None and scope["type"] == "http" and scope.get("path", "").startswith("/v1/"):
            got = _header(scope, b"authorization") or b""
            if not hmac.compare_digest(got, self.expected):
                return await _refuse(scope, receive, send, 401, "missing or wrong API key: send "
                                     "'Authorization: Bearer <key>'", {"WWW-Authenticate": "Bearer"})
        await self.app(scope, receive, send)


__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "ApiKeyGuard", "BodyLimit"]
