"""One HTTP request carried to an ASGI app in another process, its answer streamed back.

The front (`RelayedRequest.read`, `relayed_response`) turns a request into plain data and a
stream of answer parts back into a response; the back (`call_app`) runs the app on that data
and yields the parts as the app sends them: first the status and headers, then each body
chunk, so server-sent events arrive one by one. Closing the back's stream early is the client
disconnecting: the app sees `http.disconnect` and stops its generation.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import ASGIApp, Message

log = logging.getLogger("hotlora")

Headers = list[tuple[bytes, bytes]]
Part = dict[str, Any] | bytes  # the start ({"status", "headers"}), then body chunks


@dataclass
class RelayedRequest:
    """What the app needs of an HTTP request, as plain picklable data."""

    method: str
    path: str
    raw_path: bytes
    query_string: bytes
    headers: Headers
    body: bytes
    client: tuple[str, int] | None = None
    scheme: str = "http"
    http_version: str = "1.1"
    server: tuple[str, int] | None = None

    @classmethod
    async def read(cls, request: Request, max_body_bytes: int) -> RelayedRequest:
        """Read `request` whole, but never more than one byte past `max_body_bytes`: the app
        refuses a body over its limit with 413 from what arrives."""
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                del body[max_body_bytes + 1 :]
                break
        scope = request.scope
        client = scope.get("client")
        server = scope.get("server")
        return cls(
            method=request.method,
            path=scope["path"],
            raw_path=scope.get("raw_path") or scope["path"].encode(),
            query_string=scope.get("query_string", b""),
            headers=[(bytes(k), bytes(v)) for k, v in scope.get("headers", ())],
            body=bytes(body),
            client=(str(client[0]), int(client[1])) if client else None,
            scheme=scope.get("scheme", "http"),
            http_version=scope.get("http_version", "1.1"),
            server=(str(server[0]), int(server[1] or 0)) if server else None,
        )

    def header(self, name: bytes) -> bytes | None:
        return next((value for key, value in self.headers if key.lower() == name), None)

    def scope(self) -> dict[str, Any]:
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": self.http_version,
            "method": self.method,
            "scheme": self.scheme,
            "path": self.path,
            "raw_path": self.raw_path,
            "root_path": "",
            "query_string": self.query_string,
            "headers": list(self.headers),
            "client": self.client,
            "server": self.server,
            "state": {},
        }


# Apps still finishing after their answer was sent (access logs, cleanup): kept referenced.
_finishing: set[asyncio.Task[None]] = set()


async def call_app(app: ASGIApp, request: RelayedRequest) -> AsyncIterator[Part]:
    """Run `app` on `request`; yield the response start, then its body chunks as sent."""
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_read = False

    async def receive() -> Message:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()  # the client is there until the stream is closed
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)

    async def run() -> None:
        try:
            await app(request.scope(), receive, send)
        except Exception:  # noqa: BLE001 - the app has answered 500 and logged it
            log.debug("relayed app raised", exc_info=True)
        finally:
            await sent.put(None)

    task = asyncio.create_task(run())
    _finishing.add(task)
    task.add_done_callback(_finishing.discard)
    started = False
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                started = True
                headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", ())]
                yield {"status": message["status"], "headers": headers}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
        if not started:
            yield {"status": 500, "headers": [(b"content-length", b"0")]}
    finally:
        gone.set()


def relayed_response(start: dict[str, Any], rest: AsyncIterator[bytes]) -> StreamingResponse:
    """The response whose start and body chunks came from `call_app`, headers as the app
    sent them (repeated ones included)."""
    response = StreamingResponse(rest, status_code=start["status"])
    response.raw_headers = [(bytes(k), bytes(v)) for k, v in start["headers"]]
    return response


class Lifespan:
    """Runs an app's ASGI lifespan outside a server: `start` until its startup is done, `stop`
    until its shutdown is (what uvicorn does around serving)."""

    def __init__(self, app: ASGIApp):
        self._app = app
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._outbox: asyncio.Queue[Message] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}}

        async def run() -> None:
            await self._app(scope, self._inbox.get, self._outbox.put)

        self._task = asyncio.create_task(run())
        await self._step("startup")

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            await self._step("shutdown")

    async def _step(self, phase: str) -> None:
        await self._inbox.put({"type": f"lifespan.{phase}"})
        message = await self._outbox.get()
        if message["type"] != f"lifespan.{phase}.complete":
            raise RuntimeError(f"the app's {phase} failed: {message.get('message', message)}")
