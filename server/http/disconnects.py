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
    """Await `work`, cancelling it (and so its generation) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise ClientDisconnected("The client disconnected; generation was stopped.")
    finally:
        if not task.done():
            task.cancel()


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
