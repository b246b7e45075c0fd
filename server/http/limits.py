"""ASGI middleware that refuses request bodies over the configured size with 413."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hotlora.server.http.error_responses import error_body, json_bytes


def too_large_message(max_bytes: int) -> str:
    return f"The request body is larger than this server's limit of {max_bytes} bytes."


class BodyLimit:
    """Refuses on a declared Content-Length, and counts bytes as they arrive (it may be absent)."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", ())).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # Raised inside the route's body read; the error handlers shape the 413.
                    raise HTTPException(413, detail=too_large_message(self.max_bytes))
            return message

        await self.app(scope, counted, send)

    async def _refuse(self, send: Send) -> None:
        body = json_bytes(
            error_body(
                too_large_message(self.max_bytes), "invalid_request_error", code="request_too_large"
            )
        ).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
