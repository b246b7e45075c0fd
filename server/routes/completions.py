"""POST /v1/chat/completions and POST /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request

from hotlora.server.api.completion_answers import ChatCompletionResponse, CompletionResponse
from hotlora.server.api.completion_requests import ChatCompletionRequest, CompletionRequest
from hotlora.server.deps import InferenceDep
from hotlora.server.http.auth import InferenceRoute
from hotlora.server.http.disconnects import EventStream
from hotlora.server.http.tenants import request_tenant
from hotlora.server.render import completion_output
from hotlora.server.routes import paths
from hotlora.server.routes.answering import event_stream, whole_answer

router = APIRouter(tags=["inference"], route_class=InferenceRoute)


@router.post(paths.CHAT_COMPLETIONS, response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, service: InferenceDep
) -> ChatCompletionResponse | EventStream:
    submitted = service.submit(await service.prepare_chat(body), request_tenant(request))
    if body.stream:
        stream = completion_output.chat_stream(
            service, submitted, body.include_usage, body.continuous_usage
        )
        return event_stream(service, submitted, completion_output.with_error_event(stream))
    outcome = await whole_answer(request, service, submitted)
    return completion_output.chat_response(submitted.prepared, outcome)


@router.post(paths.COMPLETIONS, response_model=None)
async def completions(
    body: CompletionRequest, request: Request, service: InferenceDep
) -> CompletionResponse | EventStream:
    submitted = service.submit(await service.prepare_completion(body), request_tenant(request))
    if body.stream:
        stream = completion_output.completion_stream(
            service, submitted, body.include_usage, body.continuous_usage
        )
        return event_stream(service, submitted, completion_output.with_error_event(stream))
    outcome = await whole_answer(request, service, submitted)
    return completion_output.completion_response(submitted.prepared, outcome)
