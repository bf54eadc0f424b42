"""OpenAI's error body, and how every failure becomes one.

Every refusal is ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status, as the
``openai`` client expects (it raises ``BadRequestError``, ``AuthenticationError``, ``NotFoundError``...).
continuum's own errors carry messages that say what to do, so they are passed through as 400s.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import ContextLengthError, ContinuumError

__all__ = ["APIError", "error_body", "from_exception", "install_handlers"]

logger = logging.getLogger("continuum.serve")


class APIError(Exception):
    """A refusal with an HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


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
    if isinstance(exc, ContextLengthError):
        return APIError(400, str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, ContinuumError):  # continuum's errors say what was wrong and what to do
        return APIError(400, str(exc), code=type(exc).__name__)
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


def install_handlers(app: FastAPI) -> None:
    """Route every error to OpenAI's body: validation (400), HTTP errors, API errors, anything else (500)."""

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return APIError(400, message, param=param, code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = str(exc.detail) if exc.status_code != 404 else f"Unknown route {request.method} {request.url.path}."
        return APIError(exc.status_code, message, type=kind).response()

    @app.exception_handler(Exception)
    async def _other(request: Request, exc: Exception):
        return from_exception(exc).response()
