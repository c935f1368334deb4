"""OpenAI-shaped error answers: ``{"error": {"message", "type", "param", "code"}}``.

``type`` is the HTTP status's name (``BadRequestError``, ``NotFoundError``, ...)
and ``code`` the status, as vLLM's server answers; the openai client raises the
matching exception class from the status.
"""

from __future__ import annotations

import re
from http import HTTPStatus

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from enginecore.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

_encode = msgspec.json.Encoder().encode


class APIError(Exception):
    """An answer for the client, raised anywhere below a route."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


# The longest error message sent (a message that quotes a value is cut here at worst).
MAX_ERROR_MESSAGE_CHARS = 2000


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    if len(message) > MAX_ERROR_MESSAGE_CHARS:
        message = message[:MAX_ERROR_MESSAGE_CHARS] + "... (cut)"
    kind = _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return _encode(ErrorResponse(ErrorInfo(message, kind, param, status)))


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(status, message, param), status_code=status,
                    media_type="application/json", headers=headers)


def api_error_response(err: APIError) -> Response:
    return error_response(err.status, err.message, err.param, err.headers)


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return api_error_response(exc)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(exc.status_code, str(exc.detail), headers=exc.headers)


async def _on_crash(request: Request, exc: Exception) -> Response:
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


def exception_handlers() -> dict:
    """Starlette's handlers for an app that answers every error in OpenAI's shape:
    APIError as raised, HTTP errors (404, 405, ...) with their status, anything else 500."""
    return {APIError: _on_api_error, HTTPException: _on_http_error, Exception: _on_crash}


_PATH = re.compile(r"at `\$\.([A-Za-z0-9_.\[\]]+)`")
_MISSING = re.compile(r"missing required field `(\w+)`")


def validation_error(err: msgspec.MsgspecError) -> APIError:
    """A body msgspec refused -> 400 naming the field (``$.messages[0].role`` -> param)."""
    text = str(err)
    match = _PATH.search(text)
    param = match.group(1) if match else None
    missing = _MISSING.search(text)
    if missing:
        param = f"{param}.{missing.group(1)}" if param else missing.group(1)
    return APIError(400, f"invalid request body: {text}", param)


def value_error(err: Exception) -> APIError:
    """ValueError/TypeError from the front-end's validation -> 400; the field name is
    the one the message names (``SamplingParams.top_p must be ...``)."""
    text = str(err) or type(err).__name__
    match = re.search(r"SamplingParams\.(\w+)", text)
    return APIError(400, text, match.group(1) if match else None)
