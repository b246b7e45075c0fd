"""How an admitted request's answer goes out, whole or streamed: either way its rows stop and
its adapters are released however the response ends."""

from __future__ import annotations

from collections.abc import AsyncIterable

from fastapi import Request

from hotlora.server.http.disconnects import EventStream, until_disconnect
from hotlora.server.serving import InferenceService, Outcome, Submitted


async def whole_answer(
    request: Request, service: InferenceService, submitted: Submitted
) -> Outcome:
    """Every choice of `submitted`, generation stopped if the client goes away first."""
    try:
        return await until_disconnect(request, service.run(submitted))
    finally:
        service.let_go(submitted)  # a task cancelled before it started never ran its own end


def event_stream(
    service: InferenceService, submitted: Submitted, events: AsyncIterable[str | dict[str, str]]
) -> EventStream:
    """`events` as server-sent events, `submitted` let go when the response ends."""
    return EventStream(events, end=lambda: service.let_go(submitted))
