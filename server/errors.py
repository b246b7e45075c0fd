"""Exception types raised where a problem is found, and the one place they become HTTP.

Every non-2xx response carries the OpenAI error object:
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hotlora.adapters.errors import AdapterError


class ServerError(Exception):
    """Base for errors that map onto an OpenAI error response."""

    status_code = 400
    type = "invalid_request_error"
    code: str | None = None
    headers: dict[str, str] = {}

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class InvalidRequest(ServerError):
    """A request that is well-formed JSON but asks for something we cannot do."""


class ModelNotFound(ServerError):
    status_code = 404
    code = "model_not_found"

    def __init__(self, model: str, available: list[str]):
        names = ", ".join(available) or "none"
        super().__init__(
            f"The model '{model}' does not exist. Available models: {names}.", param="model"
        )


class ContextOverflow(ServerError):
    code = "context_length_exceeded"


class NotReady(ServerError):
    status_code = 503
    type = "service_unavailable"
    code = "model_not_ready"
    headers = {"Retry-After": "5"}


class QueueFull(ServerError):
    status_code = 503
    type = "service_unavailable"
    code = "queue_full"
    headers = {"Retry-After": "1"}


class ClientDisconnected(ServerError):
    """The client left before its response was ready; the answer goes nowhere (nginx's 499)."""

    status_code = 499
    type = "client_closed_request"


class Unauthorized(ServerError):
    status_code = 401
    type = "authentication_error"
    code = "invalid_api_key"
    headers = {"WWW-Authenticate": "Bearer"}


class BodyTooLarge(ServerError):
    status_code = 413
    code = "request_too_large"


def error_body(
    message: str, type_: str, *, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(
    status: int, message: str, type_: str, *, param: str | None = None, code: Any = None
) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param=param, code=code), status_code=status)


def from_exception(exc: Exception) -> JSONResponse:
    """The single mapping from any exception to an OpenAI-shaped response."""
    if isinstance(exc, ServerError | AdapterError):
        status = getattr(exc, "status_code", 400)
        type_ = getattr(exc, "type", None) or _type_for(status)
        message = getattr(exc, "message", None) or str(exc)
        response = error_response(
            status, message, type_, param=getattr(exc, "param", None), code=exc.code
        )
        response.headers.update(getattr(exc, "headers", {}))
        return response
    if isinstance(exc, RequestValidationError):
        return _validation_response(exc)
    if isinstance(exc, StarletteHTTPException):
        return _http_response(exc)
    # No details in the body; the server logs the traceback once (uvicorn, or the worker).
    return error_response(
        500,
        "The server had an error while processing your request.",
        "server_error",
        code="internal_error",
    )


def _type_for(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 404:
        return "not_found_error"
    if status == 409:
        return "conflict_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


# Names pydantic gives union branches in an error location, e.g. `str`, `list[str]`.
_UNION_BRANCH = re.compile(r"(str|int|float|bool|none|[\w-]+\[.*\])")


def _validation_response(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return error_response(
            400,
            "We could not parse the JSON body of your request.",
            "invalid_request_error",
            code="invalid_json",
        )
    loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path")]
    # Drop pydantic's union-branch names (e.g. "str", "list[...]") from the reported location.
    loc = [part for part in loc if not _UNION_BRANCH.fullmatch(part)]
    param = ".".join(loc) or None
    message = first.get("msg", "Invalid request.")
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if param:
        message = f"{message} (param '{param}')"
    return error_response(400, message, "invalid_request_error", param=param, code="invalid_value")


def _http_response(exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        message = "Unknown route."
    elif exc.status_code == 405:
        message = "Method not allowed for this route."
    else:
        message = str(exc.detail)
    code = "request_too_large" if exc.status_code == 413 else None
    response = error_response(exc.status_code, message, _type_for(exc.status_code), code=code)
    for key, value in (exc.headers or {}).items():
        response.headers[key] = value
    return response


def install_error_handlers(app: FastAPI) -> None:
    """Route every error through `from_exception`."""

    async def handle(_: Request, exc: Exception) -> JSONResponse:
        return from_exception(exc)

    for exc_type in (
        ServerError,
        AdapterError,
        RequestValidationError,
        StarletteHTTPException,
        Exception,
    ):
        app.add_exception_handler(exc_type, handle)


def json_bytes(payload: Any) -> str:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
