"""The process around the app: a graceful drain on SIGTERM or Ctrl-C, and bounded connections.

On the first signal the server keeps listening but refuses new requests with 503, lets the
requests in flight finish for up to `--drain-timeout` seconds, ends the rest (a stream with an
error event and `[DONE]`, a plain request with a 503), and exits 0. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from hotlora.server.runtime import Runtime

log = logging.getLogger("hotlora")


class InFlight:
    """Counts the HTTP requests being answered (a stream until its last byte) on the runtime."""

    def __init__(self, app: ASGIApp, runtime: Runtime):
        self.app = app
        self.runtime = runtime

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.runtime.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.runtime.in_flight -= 1


class BoundedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 connection, bounded: a connection beyond `limit_concurrency` is closed
    on arrival, and one that sends nothing is closed after the keep-alive timeout, as an idle
    keep-alive connection is. Half-open connections cannot pile up."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limit = self.limit_concurrency
        if limit is not None and len(self.connections) > limit:
            transport.close()
            return
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM/SIGINT drains (`drain`) before it exits."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]):
        super().__init__(config)
        self._drain = drain
        self._draining: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded as uvicorn's captured signal: it would be re-raised after the drain and
        # turn a clean exit into death by signal.
        if self._draining is not None or self._loop is None or not self.started:
            self.should_exit = self.force_exit = True  # a second signal, or still starting
            return
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._draining is None:
            self._draining = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        except Exception:  # noqa: BLE001 - the process exits either way
            log.exception("the drain failed")
        finally:
            self.should_exit = True


def uvicorn_config(
    app: Any, *, host: str, port: int, log_level: str, **limits: Any
) -> uvicorn.Config:
    """uvicorn's settings for hotlora: bounded connections (`limits`: limit_concurrency and
    timeout_keep_alive); no access log of uvicorn's, since hotlora's names the request id."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=BoundedH11Protocol,
        access_log=False,
        **limits,
    )
