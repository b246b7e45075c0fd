"""POST /v1/chat/completions and POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse

from hotlora.server.api.completion_answers import ChatCompletionResponse, CompletionResponse
from hotlora.server.api.completion_requests import ChatCompletionRequest, CompletionRequest
from hotlora.server.deps import InferenceDep
from hotlora.server.http.auth import InferenceRoute
from hotlora.server.http.disconnects import until_disconnect
from hotlora.server.http.tenants import request_tenant
from hotlora.server.render import completion_output
from hotlora.server.routes import paths

router = APIRouter(tags=["inference"], route_class=InferenceRoute)


@router.post(paths.CHAT_COMPLETIONS, response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, service: InferenceDep
) -> ChatCompletionResponse | EventSourceResponse:
    submitted = service.submit(await service.prepare_chat(body), request_tenant(request))
    if body.stream:
        stream = completion_output.chat_stream(
            service, submitted, body.include_usage, body.continuous_usage
        )
        return _sse(stream)
    outcome = await until_disconnect(request, service.run(submitted))
    return completion_output.chat_response(submitted.prepared, outcome)


@router.post(paths.COMPLETIONS, response_model=None)
async def completions(
    body: CompletionRequest, request: Request, service: InferenceDep
) -> CompletionResponse | EventSourceResponse:
    submitted = service.submit(await service.prepare_completion(body), request_tenant(request))
    if body.stream:
        stream = completion_output.completion_stream(
            service, submitted, body.include_usage, body.continuous_usage
        )
        return _sse(stream)
    outcome = await until_disconnect(request, service.run(submitted))
    return completion_output.completion_response(submitted.prepared, outcome)


def _sse(chunks: AsyncIterator[str]) -> EventSourceResponse:
    # sse-starlette cancels the generator when the client goes away, which cancels the job.
    return EventSourceResponse(completion_output.with_error_event(chunks), sep="\n", ping=15)
