"""The one place exceptions become HTTP: an OpenAI error object with a status and headers.

Every non-2xx response carries `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hotlora.adapters import AdapterConflict, AdapterError, AdapterNotFound, shown_path
from hotlora.config.errors import HotloraError, InvalidRequest, ModelNotFound
from hotlora.config.log_text import printable
from hotlora.server.api.wire_base import unknown_key_message
from hotlora.server.engine import (
    ClientNotReading,
    GrammarFailed,
    NonFiniteLogits,
    QueueFull,
    WorkerStopped,
)
from hotlora.server.http.request_errors import (
    ClientDisconnected,
    Forbidden,
    LoraPathNotFound,
    NotReady,
    RequestTimeout,
    Unauthorized,
)
from hotlora.server.http.tenant_limits import RateLimited, TokensRateLimited
from hotlora.server.telemetry.access_log import CLIENT_CLOSED_REQUEST, note_error

log = logging.getLogger("hotlora")


@dataclass(frozen=True)
class HttpError:
    """How one kind of error travels: status, OpenAI error type, extra headers."""

    status: int
    type: str
    headers: Mapping[str, str] = field(default_factory=dict)


_INVALID = HttpError(400, "invalid_request_error")
_UNAVAILABLE = "service_unavailable"

# The most specific class in an exception's MRO decides; a `HotloraError` not listed here is
# a server error, told to the client without details.
HTTP_ERRORS: Mapping[type[HotloraError], HttpError] = {
    InvalidRequest: _INVALID,
    ModelNotFound: HttpError(404, "invalid_request_error"),
    AdapterError: _INVALID,
    AdapterNotFound: HttpError(404, "not_found_error"),
    LoraPathNotFound: HttpError(404, "not_found_error"),
    AdapterConflict: HttpError(409, "conflict_error"),
    Unauthorized: HttpError(401, "authentication_error", {"WWW-Authenticate": "Bearer"}),
    Forbidden: HttpError(403, "permission_error"),
    ClientDisconnected: HttpError(CLIENT_CLOSED_REQUEST, "client_closed_request"),
    # OpenAI's types for its rate limits; `Retry-After` comes from the error.
    RateLimited: HttpError(429, "requests"),
    TokensRateLimited: HttpError(429, "tokens"),
    RequestTimeout: HttpError(408, "invalid_request_error", {"Connection": "close"}),
    ClientNotReading: HttpError(408, "invalid_request_error"),
    NotReady: HttpError(503, _UNAVAILABLE, {"Retry-After": "5"}),
    QueueFull: HttpError(503, _UNAVAILABLE, {"Retry-After": "1"}),
    WorkerStopped: HttpError(503, _UNAVAILABLE, {"Retry-After": "5"}),
    NonFiniteLogits: HttpError(500, "server_error"),
    GrammarFailed: _INVALID,
}


def http_error(exc: HotloraError) -> HttpError | None:
    """The HTTP form of `exc`, or None when it is not one a client may see."""
    for cls in type(exc).__mro__:
        found = HTTP_ERRORS.get(cls)
        if found is not None:
            return found
    return None


def error_body(
    message: str, type_: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    note_error(code or type_)  # the access log names what the request was answered with
    message = shown_path(message)  # no server path for a key that may not see them
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def json_error(
    status: int,
    message: str,
    type_: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    body = error_body(message, type_, param=param, code=code)
    return JSONResponse(body, status_code=status, headers=dict(headers or {}))


def error_response(exc: Exception) -> JSONResponse:
    """The single mapping from any exception to an OpenAI-shaped response."""
    if isinstance(exc, HotloraError) and (known := http_error(exc)) is not None:
        headers = dict(known.headers)
        if isinstance(exc, RateLimited):
            headers["Retry-After"] = str(exc.retry_after)
        return json_error(
            known.status,
            exc.message,
            known.type,
            param=exc.param,
            code=exc.code,
            headers=headers,
        )
    if isinstance(exc, RequestValidationError):
        return _validation_response(exc)
    if isinstance(exc, StarletteHTTPException):
        return _http_response(exc)
    # No details in the body; the server logs the traceback once (uvicorn, or the worker).
    return json_error(
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
_MODEL_BRANCH = re.compile(r"[A-Z][A-Za-z]+")


def _validation_response(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return json_error(
            400,
            "We could not parse the JSON body of your request.",
            "invalid_request_error",
            code="invalid_json",
        )
    # A key no object declares is named before anything else: in a union (a message's content,
    # say) it is the cause, and the other branches' complaints would hide it.
    unknown = [e for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:
        first = unknown[0]
    loc = [str(part) for part in first.get("loc", ())]
    if loc and loc[0] in ("body", "query", "path", "header"):  # where, not which field
        loc = loc[1:]
    # Drop pydantic's union-branch names (e.g. "str", "list[...]") from the reported location.
    loc = [part for part in loc if not _UNION_BRANCH.fullmatch(part)]
    if unknown:
        # Likewise the class names pydantic gives model branches (`NamedToolChoice`).
        loc = [part for part in loc[:-1] if not _MODEL_BRANCH.fullmatch(part)] + loc[-1:]
    param = ".".join(loc) or None
    if unknown:
        return json_error(
            400,
            unknown_key_message(param),
            "invalid_request_error",
            param=param,
            code="unknown_parameter",
        )
    if first.get("loc") == ("body",) and first.get("type") in _NOT_AN_OBJECT:
        return _body_refusal(exc, first)  # the body as a whole
    message = first.get("msg", "Invalid request.")
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if param:
        message = f"{message} (param '{param}')"
    return json_error(400, message, "invalid_request_error", param=param, code="invalid_value")


# What pydantic says of a body that is no JSON object (`missing`: none at all).
_NOT_AN_OBJECT = frozenset({"missing", "model_attributes_type", "model_type", "dict_type"})


def _body_refusal(exc: RequestValidationError, first: dict[str, Any]) -> JSONResponse:
    """A body that is no JSON object: none, one sent as another media type or with none
    (FastAPI reads JSON from `application/json` and `+json` bodies), or another JSON value."""
    if first.get("type") == "missing":
        message = "The request has no body: send a JSON object."
    elif isinstance(exc.body, bytes | bytearray):
        return json_error(
            415,
            "The request body must be JSON, sent with 'Content-Type: application/json'.",
            "invalid_request_error",
            code="unsupported_media_type",
        )
    else:
        message = "The request body must be a JSON object."
    return json_error(400, message, "invalid_request_error", code="invalid_json")


def _http_response(exc: StarletteHTTPException) -> JSONResponse:
    code = {413: "request_too_large", 400: "invalid_json"}.get(exc.status_code)
    if exc.status_code == 404:
        message = exc.detail if exc.detail != "Not Found" else "Unknown route."
    elif exc.status_code == 405:
        message = "Method not allowed for this route."
    elif exc.status_code == 400:  # FastAPI's: a body it could not decode (UTF-8, nesting)
        message = "We could not parse the JSON body of your request."
    else:
        message = str(exc.detail)
    return json_error(
        exc.status_code, message, _type_for(exc.status_code), code=code, headers=exc.headers
    )


class UnexpectedErrors:
    """Answers an unexpected exception with the 500 error object and keeps the connection.

    Starlette's own handler re-raises after answering, and uvicorn then closes the connection;
    here the traceback is logged once and the client's keep-alive connection stays usable.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            if started:
                raise  # too late for a status: the server ends the response
            log.error("unexpected error on %s", printable(scope.get("path")), exc_info=exc)
            await error_response(exc)(scope, receive, send)


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def _unknown_route(app: FastAPI, request: Request) -> str:
    """A 404's message: the method and path, and the route the client likely meant when its
    base URL lacks `/v1` or its path doubles a slash."""
    path = request.url.path
    message = f"Unknown route: {request.method} {printable(path[:200])}."
    squeezed = "/" + "/".join(part for part in path.split("/") if part)
    for meant in (squeezed, "/v1" + squeezed):
        if meant != path and _serves(app, {**request.scope, "path": meant}):
            return f"{message} Did you mean {meant}? (An OpenAI client's base URL ends in /v1.)"
    return message


def _serves(app: FastAPI, scope: Scope) -> bool:
    return any(route.matches(scope)[0] is Match.FULL for route in app.routes)


def _allowed(app: FastAPI, request: Request) -> str:
    """Every method some route serves on the request's path, asked of the routes themselves."""
    allowed = [
        method
        for method in _METHODS
        if any(
            route.matches({**request.scope, "method": method})[0] is Match.FULL
            for route in app.routes
        )
    ]
    return ", ".join(allowed)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error through `error_response`."""

    async def handle(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, StarletteHTTPException) and exc.status_code == 405:
            # Starlette names the methods of the first route on the path; there may be more.
            exc = StarletteHTTPException(405, headers={"Allow": _allowed(app, request)})
        elif isinstance(exc, StarletteHTTPException) and exc.status_code == 404:
            exc = StarletteHTTPException(404, detail=_unknown_route(app, request))
        return error_response(exc)

    for exc_type in (HotloraError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(exc_type, handle)
    app.add_middleware(UnexpectedErrors)


def json_bytes(payload: Any) -> str:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
