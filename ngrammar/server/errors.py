"""OpenAI-shaped errors: every exception a handler can meet, classified into a status and a body."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ngrammar.grammar import GrammarError
from ngrammar.sampling_params import InvalidRequestError
from ngrammar.server.engine_loop import (
    EngineFailure,
    EngineUnavailable,
    QueueFull,
)
from ngrammar.server.protocol import ErrorInfo, ErrorResponse

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered in OpenAI's error shape with the given HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type_, param=param, code=code)
        self.headers = dict(headers or {})

    def response(self) -> Response:
        # ASCII-escaped JSON: a message can never fail to encode (a lone surrogate would).
        body = json.dumps(ErrorResponse(error=self.info).model_dump())
        return Response(body, status_code=self.status, headers=self.headers, media_type="application/json")


def as_api_error(exc: BaseException) -> APIError:
    """Classify any exception a handler can meet; unknown ones are server errors (500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (InvalidRequestError, GrammarError)):
        return APIError(400, str(exc))
    from ngrammar.speculative.external import DraftCorpusError

    if isinstance(exc, DraftCorpusError):
        return APIError(400, str(exc))
    if isinstance(exc, QueueFull):
        return APIError(
            503,
            str(exc),
            "server_overloaded",
            code="queue_full",
            headers={"Retry-After": str(exc.retry_after_s)},
        )
    if isinstance(exc, EngineUnavailable):
        return APIError(503, str(exc), "service_unavailable", headers={"Retry-After": "5"})
    if isinstance(exc, EngineFailure):
        return APIError(500, str(exc), "server_error")
    return APIError(500, f"internal error: {type(exc).__name__}", "server_error")


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":  # (its loc is a character offset, not a parameter)
        reason = (first.get("ctx") or {}).get("error", "decode error")
        return APIError(400, f"the request body is not valid JSON: {reason} at character {''.join(loc) or 0}")
    param = ".".join(loc) or None
    # pydantic prefixes messages raised by our own validators; the client needs only the reason.
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return APIError(400, f"{param}: {message}" if param else message, param=param)


def _http_error(exc: StarletteHTTPException) -> APIError:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return APIError(exc.status_code, str(exc.detail), kind, headers=exc.headers)


def install_error_handlers(app: FastAPI) -> None:
    async def on_validation(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return _validation_error(exc).response()

    async def on_http(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        return _http_error(exc).response()

    async def on_known(_: Request, exc: Exception) -> Response:
        return as_api_error(exc).response()

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        return as_api_error(exc).response()

    from ngrammar.speculative.external import DraftCorpusError

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    # Every kind as_api_error answers with a 4xx/503 must be listed: the catch-all Exception handler
    # runs outside the middleware, so such an error was logged as unhandled (with its traceback,
    # twice) and counted in /metrics as a 500, though the client got the right status.
    known = (
        APIError,
        InvalidRequestError,
        GrammarError,
        DraftCorpusError,
        QueueFull,
        EngineUnavailable,
        EngineFailure,
    )
    for kind in known:
        app.add_exception_handler(kind, on_known)
    app.add_exception_handler(Exception, on_unexpected)
