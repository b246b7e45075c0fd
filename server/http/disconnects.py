"""Waiting on a request's work while watching its client: one that leaves cancels the work."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from sse_starlette import EventSourceResponse
from starlette.types import Receive, Scope, Send

from hotlora.server.http.request_errors import ClientDisconnected

T = TypeVar("T")


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so its generation) as soon as the client disconnects."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientDisconnected("The client disconnected; generation was stopped.")
    finally:
        for pending in (task, gone):
            if not pending.done():
                pending.cancel()


async def _disconnected(request: Request) -> None:
    """Return when the client goes: its body read, the next message the server passes on is
    the disconnect (at once, where polling would see it a while later)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class EventStream(EventSourceResponse):
    """Server-sent events of admitted work, whose `end` runs however the response ends: sent
    whole, its client gone, or cut before the first event was asked for (then the events'
    generator never started, and its own cleanup never runs). sse-starlette cancels the
    generator when the client goes away, which cancels the work."""

    def __init__(self, events: AsyncIterable[str | dict[str, str]], end: Callable[[], None]):
        super().__init__(events, sep="\n", ping=15)
        self._end = end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._end()
