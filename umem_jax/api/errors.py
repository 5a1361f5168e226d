"""HTTP errors in OpenAI's shape: APIError (raised by the routes) and the app's exception
handlers.  Every error body is {"error": {"message", "type", "param", "code"}}; `param` names
the request field at fault where there is one."""

from __future__ import annotations

import logging
import re

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .protocol import error_body

log = logging.getLogger("umem_jax")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


_PARAM = re.compile(r"^(\w+)[=:]")


def bad_request(e: ValueError) -> APIError:
    """ValueError from the engine / SamplingParams -> 400; "field=value: why" or "field: why"
    names the field."""
    msg = str(e)
    m = _PARAM.match(msg)
    return APIError(400, msg, m.group(1) if m else None)


async def _api_error(_, e: APIError):
    return error(e.status, e.message, e.param)


async def _validation_error(_, e: RequestValidationError):
    errs = e.errors()
    first = errs[0] if errs else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return error(400, f"malformed JSON body: {first.get('msg', '')}")
    return error(400, f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}", loc[0] if loc else None)


async def _http_error(_, e: StarletteHTTPException):
    return error(e.status_code, str(e.detail))


async def _internal_error(_, e: Exception):
    log.exception("umem_jax: request failed")
    return error(500, f"internal error: {e!r}")


def add_handlers(app) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)


__all__ = ["APIError", "add_handlers", "bad_request", "error"]
