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


def current_request_id() -> str | None:
    """The id of the request being answered in this context; None outside a request."""
    return _current.get()


def request_id_for(scope: Scope) -> str:
    """The client's `x-request-id` when it is usable, else a new one."""
    for name, value in scope.get("headers", ()):
        if name == HEADER.encode():
            given = value.decode("latin-1")
            if _USABLE.fullmatch(given):
                return given
            break
    return uuid.uuid4().hex


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
        request_id = request_id_for(scope)
        scope.setdefault("state", {})["request_id"] = request_id
        token = _current.set(request_id)
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
            close_record(record_token)
            log_request(scope, status, record)
