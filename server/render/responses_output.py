"""Responses API output: a generation as one response object, or as its stream of events.

A stream tells the life of the response: created, in progress, then its output items in turn,
each added, grown by deltas and done: a thinking model's reasoning, the message whose text part
grows, and each function call the answer makes (its arguments in one delta); then completed (or
incomplete at `max_output_tokens`). A failure after the 200 becomes an `error` event followed
by `response.failed`.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from hotlora.server.api.completion_answers import OutputToolCall, now
from hotlora.server.api.responses_objects import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ErrorEvent,
    FunctionCallOutput,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    ReasoningDeltaEvent,
    ReasoningDoneEvent,
    ReasoningOutput,
    ReasoningText,
    ResponseError,
    ResponseEvent,
    ResponseObject,
    ResponseUsage,
    StreamEvent,
    TextDeltaEvent,
    TextDoneEvent,
    function_call_id,
    message_id,
    reasoning_id,
    response_error_code,
    response_id,
)
from hotlora.server.api.responses_request import FunctionToolChoice, ResponsesRequest
from hotlora.server.engine import Delta
from hotlora.server.http.error_responses import error_response
from hotlora.server.serving import InferenceService, Outcome, Prepared, Submitted, UsageTally

Status = Literal["in_progress", "completed", "incomplete", "failed"]
Finished = Literal["completed", "incomplete"]


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


def _function_call(call: OutputToolCall, status: Finished) -> FunctionCallOutput:
    return FunctionCallOutput(
        id=function_call_id(),
        call_id=call.id,
        name=call.function.name,
        arguments=call.function.arguments,
        status=status,
    )


def _reasoning(item_id: str, text: str) -> ReasoningOutput:
    return ReasoningOutput(id=item_id, content=[ReasoningText(text=text)], status="completed")


@dataclass
class ResponseDraft:
    """One response's identity and the request settings it echoes, whatever its status."""

    request: ResponsesRequest
    prepared: Prepared
    id: str = field(default_factory=response_id)
    created_at: int = field(default_factory=now)

    def response(
        self,
        status: Status,
        output: Sequence[OutputItem] = (),
        usage: ResponseUsage | None = None,
        error: ResponseError | None = None,
    ) -> ResponseObject:
        request, params = self.request, self.prepared.params
        incomplete = status == "incomplete"
        choice = request.tool_choice
        return ResponseObject(
            id=self.id,
            created_at=self.created_at,
            completed_at=now() if status == "completed" else None,
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
            tool_choice=choice.model_dump() if isinstance(choice, FunctionToolChoice) else choice,
            # Every key of OpenAI's function tool, `strict` and `parameters` null when not sent.
            tools=[tool.model_dump() for tool in request.tools],
            top_p=params.top_p,
            usage=usage,
            metadata=request.metadata or {},
        )

    def output(self, text: str, status: Finished) -> list[OutputItem]:
        """A whole answer's items: its reasoning, its message (left out when the answer is only
        tool calls), its function calls (each whole, so `completed`, as streamed: a call cut
        short is never one)."""
        prepared, reasoning, calls = self.prepared, "", []
        if prepared.reasoning is not None:
            reasoning, text = prepared.reasoning.split(text)
        if prepared.tool_calls is not None:
            text, calls = prepared.tool_calls.split(text)
        items: list[OutputItem] = []
        if reasoning:
            items.append(_reasoning(reasoning_id(), reasoning))
        if text.strip() or not calls:
            items.append(_message(message_id(), text, status))
        items.extend(_function_call(call, "completed") for call in calls)
        return items


def _message(item_id: str, text: str, status: Finished) -> OutputMessage:
    return OutputMessage(id=item_id, status=status, content=[OutputText(text=text)])


def response_object(
    request: ResponsesRequest, prepared: Prepared, outcome: Outcome
) -> ResponseObject:
    """The whole response once generation has finished."""
    draft = ResponseDraft(request, prepared)
    [choice] = outcome.choices
    status = _status(choice.finish_reason)
    return draft.response(status, draft.output(choice.text, status), _usage(outcome.usage))


async def response_stream(
    service: InferenceService, submitted: Submitted, request: ResponsesRequest
) -> AsyncIterator[dict[str, str]]:
    """Server-sent events, each named by its `type` and numbered in order."""
    draft = ResponseDraft(request, submitted.prepared)
    numbers = itertools.count()

    def sse(event: StreamEvent) -> dict[str, str]:
        event.sequence_number = next(numbers)
        return {"event": event.type, "data": event.model_dump_json()}

    # A failed response tells what it used up to its failure.
    spent = UsageTally(1, prompt_tokens=sum(len(p) for p in submitted.prepared.prompts))
    try:
        async for event in _events(service, submitted, draft, spent):
            yield sse(event)
    except Exception as exc:
        error = json.loads(bytes(error_response(exc).body))["error"]
        code = error["code"] or error["type"]
        yield sse(ErrorEvent(code=code, message=error["message"], param=error["param"]))
        failed = ResponseError(code=response_error_code(code), message=error["message"])
        ended = draft.response("failed", usage=_usage(spent), error=failed)
        yield sse(ResponseEvent(type="response.failed", response=ended))


async def _events(
    service: InferenceService, submitted: Submitted, draft: ResponseDraft, spent: UsageTally
) -> AsyncIterator[StreamEvent]:
    started = draft.response("in_progress")
    yield ResponseEvent(type="response.created", response=started)
    yield ResponseEvent(type="response.in_progress", response=started)
    items = _StreamedItems(draft.prepared)
    finish_reason, tally = "length", UsageTally(1)
    async for index, event in service.events(submitted):
        if isinstance(event, Delta):
            spent.completion_tokens = event.generated
            for step in items.feed(event.text):
                yield step
        else:
            finish_reason = event.finish_reason
            tally.add(index, event)
    status = _status(finish_reason)
    for step in items.finish(status):
        yield step
    final = draft.response(status, items.done, _usage(tally))
    kind = "response.completed" if status == "completed" else "response.incomplete"
    yield ResponseEvent(type=kind, response=final)


class _StreamedItems:
    """The answer's output items as its text arrives: at most one open (reasoning or message)
    at a time, each function call added and done whole."""

    def __init__(self, prepared: Prepared):
        self.thoughts = prepared.reasoning.stream() if prepared.reasoning else None
        self.calls = prepared.tool_calls.stream() if prepared.tool_calls else None
        self.done: list[OutputItem] = []
        self._open: Literal["reasoning", "message"] | None = None
        self._id = ""
        self._text: list[str] = []

    @property
    def _index(self) -> int:
        return len(self.done)

    def feed(self, text: str, *, last: bool = False) -> Iterator[StreamEvent]:
        reasoning, calls = "", []
        if self.thoughts is not None:
            reasoning, text = self.thoughts.feed(text)
            if last:
                more_reasoning, more_text = self.thoughts.flush()
                reasoning, text = reasoning + more_reasoning, text + more_text
        if self.calls is not None:
            text, calls = self.calls.feed(text)
            if last:
                tail, more = self.calls.flush()
                text, calls = text + tail, calls + more
        if reasoning:
            yield from self._grow("reasoning", reasoning)
        if text:
            yield from self._grow("message", text)
        for call in calls:
            yield from self._call(call)

    def finish(self, status: Finished) -> Iterator[StreamEvent]:
        """The end of the answer: held text comes out, the open item closes; an answer with
        neither text nor calls still has its (empty) message."""
        yield from self.feed("", last=True)
        spoke = any(isinstance(item, OutputMessage | FunctionCallOutput) for item in self.done)
        if self._open != "message" and not spoke:
            yield from self._close("completed")
            yield from self._begin("message")
        yield from self._close(status)

    def _grow(self, kind: Literal["reasoning", "message"], delta: str) -> Iterator[StreamEvent]:
        if self._open != kind:
            yield from self._close("completed")
            yield from self._begin(kind)
        self._text.append(delta)
        place = {"item_id": self._id, "output_index": self._index, "content_index": 0}
        if kind == "reasoning":
            yield ReasoningDeltaEvent(**place, delta=delta)
        else:
            yield TextDeltaEvent(**place, delta=delta)

    def _begin(self, kind: Literal["reasoning", "message"]) -> Iterator[StreamEvent]:
        self._open, self._text = kind, []
        index = self._index
        if kind == "reasoning":
            self._id = reasoning_id()
            item: OutputItem = ReasoningOutput(id=self._id, content=[], status="in_progress")
            yield OutputItemEvent(type="response.output_item.added", output_index=index, item=item)
            return
        self._id = message_id()
        item = OutputMessage(id=self._id, status="in_progress", content=[])
        yield OutputItemEvent(type="response.output_item.added", output_index=index, item=item)
        yield ContentPartEvent(
            type="response.content_part.added",
            item_id=self._id,
            output_index=index,
            content_index=0,
            part=OutputText(text=""),
        )

    def _close(self, status: Finished) -> Iterator[StreamEvent]:
        kind, self._open = self._open, None
        if kind is None:
            return
        text, index = "".join(self._text), self._index
        place = {"item_id": self._id, "output_index": index, "content_index": 0}
        if kind == "reasoning":
            yield ReasoningDoneEvent(**place, text=text)
            item: OutputItem = _reasoning(self._id, text)
        else:
            yield TextDoneEvent(**place, text=text)
            yield ContentPartEvent(
                type="response.content_part.done", **place, part=OutputText(text=text)
            )
            item = _message(self._id, text, status)
        yield OutputItemEvent(type="response.output_item.done", output_index=index, item=item)
        self.done.append(item)

    def _call(self, call: OutputToolCall) -> Iterator[StreamEvent]:
        yield from self._close("completed")
        index, item = self._index, _function_call(call, "completed")
        started = item.model_copy(update={"arguments": "", "status": "in_progress"})
        yield OutputItemEvent(type="response.output_item.added", output_index=index, item=started)
        place = {"item_id": item.id, "output_index": index}
        yield ArgumentsDeltaEvent(**place, delta=item.arguments)
        yield ArgumentsDoneEvent(**place, name=item.name, arguments=item.arguments)
        yield OutputItemEvent(type="response.output_item.done", output_index=index, item=item)
        self.done.append(item)
