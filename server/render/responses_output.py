"""Responses API output: a generation as one response object, or as its stream of events.

A stream tells the life of the response: created, in progress, one message item whose text part
grows by deltas, then completed (or incomplete at `max_output_tokens`). A failure after the 200
becomes an `error` event followed by `response.failed`.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypedDict

from hotlora.server.api.completion_answers import now
from hotlora.server.api.responses_objects import (
    ContentPartEvent,
    ErrorEvent,
    IncompleteDetails,
    InputTokensDetails,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    ResponseError,
    ResponseEvent,
    ResponseObject,
    ResponseUsage,
    StreamEvent,
    TextDeltaEvent,
    TextDoneEvent,
    message_id,
    response_id,
)
from hotlora.server.api.responses_request import ResponsesRequest
from hotlora.server.engine import Delta
from hotlora.server.http.error_responses import error_response
from hotlora.server.serving import InferenceService, Outcome, Prepared, Submitted, UsageTally

Status = Literal["in_progress", "completed", "incomplete", "failed"]
Finished = Literal["completed", "incomplete"]


class _TextPlace(TypedDict):
    """Where a text part sits: its message item, the item's index, the part's index."""

    item_id: str
    output_index: int
    content_index: int


def _status(finish_reason: str) -> Finished:
    # A cancelled job has no client left to read its status.
    return "incomplete" if finish_reason == "length" else "completed"


def _usage(tally: UsageTally) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=tally.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=tally.cached_tokens),
        output_tokens=tally.completion_tokens,
        total_tokens=tally.prompt_tokens + tally.completion_tokens,
    )


@dataclass
class ResponseDraft:
    """One response's identity and the request settings it echoes, whatever its status."""

    request: ResponsesRequest
    prepared: Prepared
    id: str = field(default_factory=response_id)
    message_id: str = field(default_factory=message_id)
    created_at: int = field(default_factory=now)

    def response(
        self,
        status: Status,
        output: Sequence[OutputMessage] = (),
        usage: ResponseUsage | None = None,
        error: ResponseError | None = None,
    ) -> ResponseObject:
        request, params = self.request, self.prepared.params
        incomplete = status == "incomplete"
        return ResponseObject(
            id=self.id,
            created_at=self.created_at,
            status=status,
            error=error,
            incomplete_details=IncompleteDetails(reason="max_output_tokens")
            if incomplete
            else None,
            instructions=request.instructions,
            max_output_tokens=request.max_output_tokens,
            model=self.prepared.lease.model,
            output=list(output),
            parallel_tool_calls=request.parallel_tool_calls,
            # The values generation used, server defaults included.
            temperature=params.temperature,
            text=request.text.model_dump(by_alias=True, exclude_none=True),
            tool_choice=request.tool_choice,
            top_p=params.top_p,
            usage=usage,
            metadata=request.metadata or {},
        )

    def message(self, text: str, status: Finished) -> OutputMessage:
        return OutputMessage(id=self.message_id, status=status, content=[OutputText(text=text)])


def response_object(
    request: ResponsesRequest, prepared: Prepared, outcome: Outcome
) -> ResponseObject:
    """The whole response once generation has finished."""
    draft = ResponseDraft(request, prepared)
    [choice] = outcome.choices
    status = _status(choice.finish_reason)
    return draft.response(status, [draft.message(choice.text, status)], _usage(outcome.usage))


async def response_stream(
    service: InferenceService, submitted: Submitted, request: ResponsesRequest
) -> AsyncIterator[dict[str, str]]:
    """Server-sent events, each named by its `type` and numbered in order."""
    draft = ResponseDraft(request, submitted.prepared)
    numbers = itertools.count()

    def sse(event: StreamEvent) -> dict[str, str]:
        event.sequence_number = next(numbers)
        return {"event": event.type, "data": event.model_dump_json()}

    try:
        async for event in _events(service, submitted, draft):
            yield sse(event)
    except Exception as exc:
        error = json.loads(bytes(error_response(exc).body))["error"]
        code = error["code"] or error["type"]
        yield sse(ErrorEvent(code=code, message=error["message"], param=error["param"]))
        failed = ResponseError(code=code, message=error["message"])
        yield sse(
            ResponseEvent(type="response.failed", response=draft.response("failed", error=failed))
        )


async def _events(
    service: InferenceService, submitted: Submitted, draft: ResponseDraft
) -> AsyncIterator[StreamEvent]:
    started = draft.response("in_progress")
    yield ResponseEvent(type="response.created", response=started)
    yield ResponseEvent(type="response.in_progress", response=started)
    empty = OutputMessage(id=draft.message_id, status="in_progress", content=[])
    yield OutputItemEvent(type="response.output_item.added", output_index=0, item=empty)
    at = _TextPlace(item_id=draft.message_id, output_index=0, content_index=0)
    yield ContentPartEvent(type="response.content_part.added", **at, part=OutputText(text=""))
    pieces: list[str] = []
    finish_reason, tally = "length", UsageTally(1)
    async for index, event in service.events(submitted):
        if isinstance(event, Delta):
            if event.text:
                pieces.append(event.text)
                yield TextDeltaEvent(**at, delta=event.text)
        else:
            finish_reason = event.finish_reason
            tally.add(index, event)
    status, text = _status(finish_reason), "".join(pieces)
    yield TextDoneEvent(**at, text=text)
    yield ContentPartEvent(type="response.content_part.done", **at, part=OutputText(text=text))
    message = draft.message(text, status)
    yield OutputItemEvent(type="response.output_item.done", output_index=0, item=message)
    final = draft.response(status, [message], _usage(tally))
    kind = "response.completed" if status == "completed" else "response.incomplete"
    yield ResponseEvent(type=kind, response=final)
