"""POST /v1/chat/completions and POST /v1/completions."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse

from hotlora.server import responses
from hotlora.server.deps import InferenceDep
from hotlora.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
)
from hotlora.server.request_errors import ClientDisconnected

router = APIRouter(prefix="/v1", tags=["inference"])

T = TypeVar("T")


@router.post("/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, service: InferenceDep
) -> ChatCompletionResponse | EventSourceResponse:
    submitted = service.submit(service.prepare_chat(body))
    if body.stream:
        return _sse(responses.chat_stream(service, submitted, body.include_usage))
    outcome = await _until_disconnect(request, service.run(submitted))
    return responses.chat_response(submitted.prepared, outcome)


@router.post("/completions", response_model=None)
async def completions(
    body: CompletionRequest, request: Request, service: InferenceDep
) -> CompletionResponse | EventSourceResponse:
    submitted = service.submit(service.prepare_completion(body))
    if body.stream:
        return _sse(responses.completion_stream(service, submitted, body.include_usage))
    outcome = await _until_disconnect(request, service.run(submitted))
    return responses.completion_response(submitted.prepared, outcome)


def _sse(chunks: AsyncIterator[str]) -> EventSourceResponse:
    # sse-starlette cancels the generator when the client goes away, which cancels the job.
    return EventSourceResponse(responses.with_error_event(chunks), sep="\n", ping=15)


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
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
