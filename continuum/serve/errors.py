"""OpenAI's error body, and how every failure becomes one.

Every refusal is ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status, as the
``openai`` client expects (it raises ``BadRequestError``, ``AuthenticationError``, ``NotFoundError``...).
continuum's own errors carry messages that say what to do, so they are passed through as 400s.

Refusals are answered by handlers for their own classes (Starlette's ``ExceptionMiddleware``), which
never re-raise: the connection stays open for the client's next request and the log gets one line.
A handler for ``Exception`` would run in Starlette's ``ServerErrorMiddleware``, which re-raises after
answering, and uvicorn then closes the connection (the ``openai`` client's next request on its pooled
connection fails). So real internal errors are caught by :class:`Guard`, an ASGI middleware that logs
the traceback and answers a 500 without re-raising.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import ContextLengthError, ContinuumError
from .redact import redact

__all__ = ["APIError", "Overloaded", "StoreUnavailable", "Guard", "error_body", "from_exception", "install_handlers"]

logger = logging.getLogger("continuum.serve")


class Overloaded(Exception):
    """More replies wait for room than the server queues (``--max-queue``): 503 with Retry-After, never a 4xx."""


class StoreUnavailable(Exception):
    """The store's database does not answer: 503 with Retry-After (the client retries; the data is not lost)."""


class APIError(Exception):
    """A refusal with an HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def not_found(what: str, ident: str, param: str | None = None) -> APIError:
    """404 for an id that is unknown, expired, deleted or another key's (the same words for all)."""
    return APIError(404, f"No {what} found with id {ident!r}.", param=param, code="not_found")


def from_exception(exc: BaseException) -> APIError:
    """The API error for an exception raised while serving a request (never a traceback to the client)."""
    if isinstance(exc, APIError):
        return exc
    # (redact: a message may quote the store's URL; its password never reaches a client)
    if isinstance(exc, Overloaded):  # busy, not the client's fault: OpenAI's clients retry a 503 after Retry-After
        return APIError(503, redact(exc), type="server_error", code="server_overloaded", headers={"Retry-After": "1"})
    if isinstance(exc, StoreUnavailable):
        return APIError(503, redact(exc), type="server_error", code="store_unavailable", headers={"Retry-After": "5"})
    if isinstance(exc, ContextLengthError):
        return APIError(400, redact(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, ContinuumError):  # continuum's errors say what was wrong and what to do
        return APIError(400, redact(exc), code=type(exc).__name__)
    logger.exception("internal error while serving a request", exc_info=exc)
    return APIError(500, f"internal server error ({type(exc).__name__}); the server keeps running", type="server_error")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors: list[Any] = list(exc.errors())
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    param = ".".join(loc) or None
    where = f" at {param!r}" if param else ""
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return f"invalid request{where}: {first.get('msg')}{more}", param


def _refused(request: Request, error: APIError) -> JSONResponse:
    """The refusal's response, and its one log line (no traceback: it is an answer, not a failure)."""
    logger.info("refused %s %s: %d %s", request.method, request.url.path, error.status, error.message)
    return error.response()


def install_handlers(app: FastAPI) -> None:
    """Route every refusal to OpenAI's body with a handler that keeps the connection: API errors,
    continuum's errors (400), validation (400), HTTP errors. Anything else reaches :class:`Guard` (500)."""

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError):
        return _refused(request, exc)

    @app.exception_handler(Overloaded)
    async def _overloaded(request: Request, exc: Overloaded):
        return _refused(request, from_exception(exc))

    @app.exception_handler(StoreUnavailable)
    async def _store_unavailable(request: Request, exc: StoreUnavailable):
        return _refused(request, from_exception(exc))  # 503 + Retry-After, not Guard's 500

    @app.exception_handler(ContinuumError)
    async def _continuum(request: Request, exc: ContinuumError):
        return _refused(request, from_exception(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return _refused(request, APIError(400, message, param=param, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = str(exc.detail) if exc.status_code != 404 else f"Unknown route {request.method} {request.url.path}."
        return _refused(request, APIError(exc.status_code, message, type=kind))


class Guard:
    """ASGI middleware: an exception no handler answered is a real internal error. It is logged with its
    traceback and answered with a 500 in OpenAI's body, and not re-raised, so uvicorn keeps the
    connection. Once a response has started (a stream) nothing can be answered: it is re-raised then,
    and the connection closes, which is how a client learns that a body was cut."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started:
                raise
            body = json.dumps(from_exception(exc).body()).encode()  # from_exception logs the traceback
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
