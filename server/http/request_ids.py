"""Request ids: every response carries `x-request-id`, and one access-log line names it."""

from __future__ import annotations

import re
import uuid
from contextvars import ContextVar

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hotlora.server.telemetry.access_log import close_record, log_request, open_record

HEADER = "x-request-id"
# Printable ASCII without spaces: the id goes unquoted into headers and log lines.
_USABLE = re.compile(r"[\x21-\x7e]{1,128}")

_current: ContextVar[str | None] = ContextVar("hotlora_request_id", default=None)
_given: ContextVar[str | None] = ContextVar("hotlora_client_request_id", default=None)


def current_request_id() -> str | None:
    """The id of the request being answered in this context; None outside a request."""
    return _current.get()


def client_request_id() -> str | None:
    """The client's own usable `x-request-id` for the request in this context; None when it
    sent none (or one that is not usable) and outside a request."""
    return _given.get()


def _given_id(scope: Scope) -> str | None:
    """The client's `x-request-id` when it is usable."""
    for name, value in scope.get("headers", ()):
        if name == HEADER.encode():
            given = value.decode("latin-1")
            return given if _USABLE.fullmatch(given) else None
    return None


class RequestIds:
    """Gives each HTTP request an id (`request.state.request_id`, `current_request_id()`), puts
    it on the response, and logs the request once it is answered (a stream: after its last
    byte)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _given_id(scope)
        request_id = given or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        token = _current.set(request_id)
        given_token = _given.set(given)
        record, record_token = open_record(request_id)
        status: int | None = None

        async def tagged(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                MutableHeaders(scope=message)[HEADER] = request_id
            await send(message)

        try:
            await self.app(scope, receive, tagged)
        except Exception:
            status = status or 500
            raise
        finally:
            _current.reset(token)
            _given.reset(given_token)
            close_record(record_token)
            log_request(scope, status, record)
