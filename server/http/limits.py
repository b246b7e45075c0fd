"""ASGI middleware that refuses request bodies over the configured size with 413, and bodies
sent compressed (a `Content-Encoding` other than identity) with 415: they are read as sent."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hotlora.server.http.error_responses import json_error


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
        headers = dict(scope.get("headers", ()))
        declared = headers.get(b"content-length", b"")
        encoding = headers.get(b"content-encoding", b"identity").strip().lower()
        with_body = declared not in (b"", b"0") or b"transfer-encoding" in headers
        if with_body and encoding not in (b"", b"identity"):
            shown = encoding.decode("latin-1")[:40]
            await self._refuse(
                scope,
                receive,
                send,
                415,
                f"Content-Encoding '{shown}' is not supported: send the body uncompressed.",
                "unsupported_media_type",
            )
            return
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(
                scope, receive, send, 413, too_large_message(self.max_bytes), "request_too_large"
            )
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

    @staticmethod
    async def _refuse(
        scope: Scope, receive: Receive, send: Send, status: int, message: str, code: str
    ) -> None:
        refusal = json_error(status, message, "invalid_request_error", code=code)
        await refusal(scope, receive, send)
