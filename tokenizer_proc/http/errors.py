"""How the HTTP server fails: an error body with the status that the ZMQ error code maps to, and the
app's exception handlers that turn every exception a route raises into such a reply. Kept apart from
the routes so that every route group fails the same way: a route only raises.

The body's shape is the API's the route speaks: OpenAI's (``{"error": {"message", "type", "param",
"code"}}``) unless the route's router says otherwise (``api_router(error_shape=...)`` in
tokenizer_proc/http/context.py sets ``request.state.error_shape`` before the route runs), so that an
Anthropic or Ollama client reads a refusal the way its SDK expects."""

from __future__ import annotations

import logging
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.protocol.field_refs import FieldNames, FieldRef, bare_name, render
from tokenizer_proc import openai_protocol as oai
from tokenizer_proc.request_builder import Rejected

logger = logging.getLogger(__name__)

# The ZMQ error codes as HTTP statuses (an unknown code is a 500).
STATUS_OF_CODE = {
    "invalid_request": 400,
    "too_long": 400,
    "unauthorized": 401,
    "model_not_found": 404,
    "too_many_requests": 429,
    "out_of_memory": 503,
    "unhealthy": 503,
    "starting": 503,
    "server_shutdown": 503,
    "draining": 503,
    "overloaded": 503,
    "aborted": 499,
    "internal": 500,
}
# Refusals a client should retry elsewhere or later: their 503 says after how many seconds.
RETRY_AFTER_S = {"draining": 1, "overloaded": 1, "starting": 1}
_ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class RequestFailed(Exception):
    """A request that ended in an error reply after it was accepted (e.g. out of memory)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ClientWentAway(Exception):
    """The HTTP client disconnected before its reply; nothing is left to answer."""


def error_type(status: int) -> str:
    """OpenAI's ``error.type`` for an HTTP status (a stream's error event carries it too)."""
    return _ERROR_TYPE.get(status, "server_error")


# An API's error body: (status, message, code, param) -> the JSON its clients read.
ErrorShape = Callable[[int, str, str, "str | None"], Any]


def openai_error(status: int, message: str, code: str, param: str | None) -> dict[str, Any]:
    """OpenAI's error body (also what SGLang's routes answer)."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def error_response(
    status: int, message: str, code: str, param: str | None = None, shape: ErrorShape = openai_error
) -> JSONResponse:
    """An error body of ``shape`` (OpenAI's by default); a retryable refusal (RETRY_AFTER_S) says
    when to retry."""
    retry = RETRY_AFTER_S.get(code)
    headers = None if retry is None else {"Retry-After": str(retry)}
    return JSONResponse(shape(status, message, code, param), status_code=status, headers=headers)


def shape_of(request: Request) -> ErrorShape:
    """The error shape of the API the request's route speaks (OpenAI's unless its router set one)."""
    shape: ErrorShape = getattr(request.state, "error_shape", openai_error)
    return shape


async def _bad_request(request: Request, exc: oai.BadRequest) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.code, exc.param, shape_of(request))


async def _rejected(request: Request, exc: Rejected) -> JSONResponse:
    """A refusal of the shared request path, its param and message in the names the client's body
    used: the route that parsed the body set them (``request.state.field_names``: an OpenAI body's
    ``max_tokens`` for ``max_new_tokens``, ...); other bodies (SGLang's) name every field as sent."""
    names: FieldNames = getattr(request.state, "field_names", bare_name)
    message = render(exc.parts, names)
    param = names(FieldRef(exc.param)) if exc.param is not None else None
    return error_response(STATUS_OF_CODE.get(exc.code, 400), message, exc.code, param, shape_of(request))


async def _failed(request: Request, exc: RequestFailed) -> JSONResponse:
    return error_response(STATUS_OF_CODE.get(exc.code, 500), exc.message, exc.code, shape=shape_of(request))


async def _went_away(request: Request, exc: ClientWentAway) -> Response:
    return Response(status_code=499)  # nginx's "client closed request": never read by anyone


async def _internal(request: Request, exc: Exception) -> JSONResponse:
    logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(500, f"{type(exc).__name__}: {exc}", "internal", shape=shape_of(request))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (unknown path, wrong method) in the same JSON."""
    return error_response(exc.status_code, str(exc.detail), "not_found" if exc.status_code == 404 else "http")


def add_error_handlers(app: FastAPI) -> None:
    """Register the handlers on ``app``: a route raises, these answer (the ``Exception`` one is
    Starlette's last resort, for a bug)."""
    app.add_exception_handler(oai.BadRequest, _bad_request)  # type: ignore[arg-type]
    app.add_exception_handler(Rejected, _rejected)  # type: ignore[arg-type]
    app.add_exception_handler(RequestFailed, _failed)  # type: ignore[arg-type]
    app.add_exception_handler(ClientWentAway, _went_away)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _internal)
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
