"""The process around the app: a graceful drain on SIGTERM or Ctrl-C, and bounded connections.

On the first signal the server keeps listening but refuses new requests with 503, lets the
requests in flight finish for up to `--drain-timeout` seconds, ends the rest (a stream with an
error event and `[DONE]`, a plain request with a 503), cuts the connections still busy, and
exits 0. A second signal ends the requests in flight at once, as the drain's timeout would; a
third exits without waiting for anything. A connection is bounded in time both ways: its client
must send each request within `--request-timeout`, and take some of its answer within
`--send-timeout`; and at `--max-connections` a connection without a whole request sent makes
way for a new one (`connections.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from types import FrameType
from typing import Any

import h11
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from hotlora.server.http import connections
from hotlora.server.http.connections import (
    UNFINISHED_PER_PEER,
    keep_to_the_cap,
    make_room,
    waiting_order,
)
from hotlora.server.http.error_responses import error_response
from hotlora.server.http.request_errors import RequestTimeout
from hotlora.server.runtime import Runtime

log = logging.getLogger("hotlora")

_TASKS_AFTER_DRAIN_S = 5.0  # how long requests' tasks get to end once their connections are cut


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


@dataclass(frozen=True)
class ClientTimeouts:
    """How long a connection waits on its client, each way."""

    request: float = 30.0  # to send a whole request (headers and body), from its first byte
    send: float = 30.0  # to take any of a response its socket can no longer buffer


class ServerConfig(uvicorn.Config):
    """uvicorn's settings, with the client timeouts and the connection limit that
    `BoundedH11Protocol` enforces (uvicorn's own `limit_concurrency` stays off: it would answer
    503 to every request while the limit is reached, whatever holds it)."""

    def __init__(
        self,
        app: Any,
        *,
        timeouts: ClientTimeouts,
        max_connections: int | None = None,
        unfinished_per_peer: int = UNFINISHED_PER_PEER,
        **kwargs: Any,
    ):
        super().__init__(app, **kwargs)
        self.timeouts = timeouts
        self.max_connections = max_connections
        self.unfinished_per_peer = unfinished_per_peer


class BoundedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 connection, bounded so that no client can hold it forever.

    A connection beyond `max_connections` takes the place of one that has not sent a whole
    request, or is closed on arrival when all are answering (`make_room`); an address's such
    connections are capped a second after each arrival (`keep_to_the_cap`); one that sends
    nothing is closed after the keep-alive
    timeout, as an idle keep-alive connection is; one that starts a
    request and does not finish it within the request timeout is closed (with a 408 when its
    headers are in and nothing was answered yet); one whose client takes no byte of its answer
    for the send timeout, its socket's buffers full, is cut. Slow or stuck clients cannot pile
    up connections, nor keep a drain from ending.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ):
        super().__init__(config, server_state, app_state, _loop)
        self.per_peer = UNFINISHED_PER_PEER
        if isinstance(config, ServerConfig):
            self.timeouts, self.max_connections = config.timeouts, config.max_connections
            self.per_peer = config.unfinished_per_peer
        else:
            self.timeouts, self.max_connections = ClientTimeouts(), config.limit_concurrency
        self._since = 0  # when (`waiting_order()`) it last began to wait for a request
        self._settling: asyncio.TimerHandle | None = None  # the cap's look, SETTLE_S on
        self._reading: asyncio.TimerHandle | None = None  # the request timeout, while one arrives
        self._writing: asyncio.TimerHandle | None = None  # the send timeout, while writes wait
        self._unsent = 0  # bytes waiting in the transport when the send timer was last set

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._since = waiting_order()
        limit = self.max_connections
        room = len(self.connections) if limit is None else limit
        if not make_room(self, self.connections, room, self.per_peer):
            transport.close()
            return
        if self.per_peer > 0:
            # Its address's connections are counted once those that arrived with it had time
            # to send their requests.
            self._settling = self.loop.call_later(
                connections.SETTLE_S, self._keep_to_the_cap, self._since
            )
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def on_response_complete(self) -> None:
        self._since = waiting_order()
        super().on_response_complete()

    def _keep_to_the_cap(self, arrived: int) -> None:
        self._settling = None
        keep_to_the_cap(self.peer, arrived, self.connections, self.per_peer)

    # Room at the limit: what `make_room` reads and calls.

    @property
    def open(self) -> bool:
        return not self.transport.is_closing()

    @property
    def peer(self) -> str | None:
        return self.client[0] if self.client else None

    @property
    def unfinished_since(self) -> int | None:
        cycle, state = self.cycle, self.conn.their_state
        if state is h11.IDLE:
            answering = cycle is not None and not cycle.response_complete
            return None if answering or self.transport.get_write_buffer_size() else self._since
        if state is h11.SEND_BODY and cycle is not None and not cycle.response_started:
            return self._since
        return None

    def make_way(self) -> None:
        self._close_unfinished(
            "The connection was closed for a newer one: the server is at its connection limit "
            "and this request was not received in full."
        )

    def connection_lost(self, exc: Exception | None) -> None:
        if self._settling is not None:
            self._settling.cancel()
            self._settling = None
        self._stop_reading_timer()
        self._stop_writing_timer()
        super().connection_lost(exc)

    # Reading: the whole request within `timeouts.request`.

    def data_received(self, data: bytes) -> None:
        if self._reading is None and self.conn.their_state is h11.IDLE:
            self._reading = self.loop.call_later(self.timeouts.request, self._request_timed_out)
        super().data_received(data)
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            self._stop_reading_timer()  # the request is in (or the connection is done)

    def _stop_reading_timer(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
            self._reading = None

    def _request_timed_out(self) -> None:
        self._reading = None
        if self.transport.is_closing():
            return
        log.warning(
            "closing a connection that did not send its whole request within %gs",
            self.timeouts.request,
        )
        self._close_unfinished(
            f"The request was not received in full within {self.timeouts.request:g} seconds."
        )

    def _close_unfinished(self, message: str) -> None:
        """Close a connection whose request is not in: with a 408 saying `message` when its
        headers are."""
        self._stop_reading_timer()
        cycle = self.cycle if self.conn.their_state is h11.SEND_BODY else None
        if cycle is not None and not cycle.response_started:
            # The app waits on the body: it is told the client left, and whatever it answers
            # goes nowhere; the client gets the 408 instead.
            cycle.disconnected = True
            cycle.message_event.set()
            self._send_error(RequestTimeout(message))
        self.transport.close()

    def _send_error(self, exc: Exception) -> None:
        response = error_response(exc)
        headers = [(name, value) for name, value in response.raw_headers]
        status = response.status_code
        reason = HTTPStatus(status).phrase.encode()
        out = self.conn.send(h11.Response(status_code=status, headers=headers, reason=reason))
        out += self.conn.send(h11.Data(data=bytes(response.body)))
        out += self.conn.send(h11.EndOfMessage())
        self.transport.write(out)

    # Writing: some of the answer taken within `timeouts.send` once the buffers are full.

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._writing is None:
            self._arm_writing_timer()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_writing_timer()

    def _arm_writing_timer(self) -> None:
        self._unsent = self.transport.get_write_buffer_size()
        self._writing = self.loop.call_later(self.timeouts.send, self._send_timed_out)

    def _stop_writing_timer(self) -> None:
        if self._writing is not None:
            self._writing.cancel()
            self._writing = None

    def _send_timed_out(self) -> None:
        self._writing = None
        if self.transport.get_write_buffer_size() < self._unsent:
            self._arm_writing_timer()  # the client reads, however slowly
            return
        log.warning(
            "cutting a connection whose client took none of its answer for %gs",
            self.timeouts.send,
        )
        self.abort()

    def abort(self) -> None:
        """Cut the connection now, dropping what it has not sent: its client left the app's
        answer unread, or the server is exiting. The app sees the client leave."""
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            # A reset, not a close: a close leaves the kernel holding the unsent megabytes,
            # and the socket, for as long as the client keeps its window shut.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    @property
    def busy(self) -> bool:
        """A request is being received or answered, or an answer waits to be sent."""
        cycle = self.cycle
        receiving = self.conn.their_state is h11.SEND_BODY
        answering = cycle is not None and not cycle.response_complete
        return receiving or answering or self.transport.get_write_buffer_size() > 0


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM/SIGINT drains (`drain`) before it exits."""

    def __init__(
        self,
        config: uvicorn.Config,
        drain: Callable[[], Awaitable[None]],
        hurry: Callable[[], None] | None = None,
    ):
        super().__init__(config)
        self._drain = drain
        self._hurry = hurry  # a second signal: the drain ends what is in flight at once
        self._signals = 0  # counted as they come: the loop may not have run since the first
        self._draining: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # The drain is over: a connection still busy belongs to a client that does not read its
        # answer or never finished its request. uvicorn would wait on it for ever.
        busy = [
            c
            for c in list(self.server_state.connections)
            if isinstance(c, BoundedH11Protocol) and c.busy
        ]
        if busy:
            log.warning("exiting: cutting %d connections still busy", len(busy))
        for connection in busy:
            connection.abort()
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded as uvicorn's captured signal: it would be re-raised after the drain and
        # turn a clean exit into death by signal.
        # One read and write: a handler may run inside another, between two statements.
        count = self._signals = self._signals + 1
        drained = self._draining is not None and self._draining.done()
        if self._loop is None or not self.started:
            self.should_exit = self.force_exit = True  # still starting
        elif count == 1:
            self._loop.call_soon_threadsafe(self._start_drain)
        elif count == 2 and self._hurry is not None and not drained:
            self._loop.call_soon_threadsafe(self._hurry)
        else:
            self.should_exit = self.force_exit = True  # a third, or the drain is over

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
    app: Any,
    *,
    host: str,
    port: int,
    log_level: str,
    timeouts: ClientTimeouts,
    **limits: Any,
) -> ServerConfig:
    """uvicorn's settings for hotlora: bounded connections (`timeouts`, and `limits`:
    limit_concurrency, the connection limit hotlora's protocol enforces in place of uvicorn's,
    and timeout_keep_alive); no access log of uvicorn's, since hotlora's names the request id."""
    max_connections = limits.pop("limit_concurrency", None)
    unfinished_per_peer = limits.pop("unfinished_per_peer", UNFINISHED_PER_PEER)
    return ServerConfig(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=BoundedH11Protocol,
        access_log=False,
        timeouts=timeouts,
        max_connections=max_connections,
        unfinished_per_peer=unfinished_per_peer,
        # Every connection still busy is cut once the drain ends; this bounds the tasks left.
        timeout_graceful_shutdown=_TASKS_AFTER_DRAIN_S,
        **limits,
    )
