"""POST /v1/responses: OpenAI's Responses API, run as the chat completion it describes."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from hotlora.server.api.responses_objects import ResponseObject
from hotlora.server.api.responses_request import ResponsesRequest, responses_params
from hotlora.server.deps import InferenceDep
from hotlora.server.http.auth import InferenceRoute
from hotlora.server.http.disconnects import EventStream
from hotlora.server.http.tenants import request_tenant
from hotlora.server.render import responses_output as render
from hotlora.server.routes import paths
from hotlora.server.routes.answering import event_stream, whole_answer

router = APIRouter(tags=["inference"], route_class=InferenceRoute)

_OK: dict[int | str, dict[str, Any]] = {
    200: {
        "model": ResponseObject,
        "description": (
            "The response; with `stream: true`, server-sent events named by their `type` "
            "(`response.created` ... `response.completed`), no `[DONE]`."
        ),
        # Each event, as OpenAPI 3.1 describes one event of a `text/event-stream`.
        "content": {
            "text/event-stream": {
                "schema": {
                    "type": "object",
                    "required": ["event", "data"],
                    "properties": {
                        "event": {"type": "string"},
                        "data": {"type": "string", "contentMediaType": "application/json"},
                    },
                }
            }
        },
    }
}


@router.post(paths.RESPONSES, response_model=None, responses=_OK)
async def create_response(
    body: ResponsesRequest, request: Request, service: InferenceDep
) -> ResponseObject | EventStream:
    chat = body.chat_request()
    with responses_params():
        submitted = service.submit(await service.prepare_chat(chat), request_tenant(request))
    if body.stream:
        return event_stream(service, submitted, render.response_stream(service, submitted, body))
    outcome = await whole_answer(request, service, submitted)
    return render.response_object(body, submitted.prepared, outcome)
