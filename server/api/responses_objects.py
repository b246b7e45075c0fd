"""The Responses API's answer: the response object and its stream events, fields in the order
of OpenAI's reference."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field


def response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def function_call_id() -> str:
    return f"fc_{uuid.uuid4().hex}"


def reasoning_id() -> str:
    return f"rs_{uuid.uuid4().hex}"


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] = Field(default_factory=list)  # none are served here


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallOutput(BaseModel):
    """A tool call the answer makes; the client runs it and sends a `function_call_output`."""

    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOutput(BaseModel):
    """What a thinking model wrote between its think tags, before its answer."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = ReasoningOutput | OutputMessage | FunctionCallOutput


class InputTokensDetails(BaseModel):
    cached_tokens: int
    cache_write_tokens: int = 0  # the prompt cache is written as a side effect, not billed


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


# The codes OpenAI's schema allows a failed response's `error`, of those that can happen here.
ResponseErrorCode = Literal["server_error", "rate_limit_exceeded", "invalid_prompt"]


def response_error_code(code: str) -> ResponseErrorCode:
    """A failed response's `error.code` for the error object's `code` (its `error` event keeps
    the code itself): anything else that fails a response after its 200 is the server's."""
    if code == "rate_limit_exceeded":
        return "rate_limit_exceeded"
    return "invalid_prompt" if code == "invalid_prompt" else "server_error"


class ResponseError(BaseModel):
    code: ResponseErrorCode
    message: str


class ResponseObject(BaseModel):
    """A response as OpenAI's SDK reads it; the request's settings are echoed back."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None  # once completed, as OpenAI's
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: None = None
    store: Literal[False] = False
    temperature: float
    text: dict[str, Any]
    tool_choice: Literal["none", "auto", "required"] | dict[str, str]
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class StreamEvent(BaseModel):
    """One server-sent event of a streamed response; numbered as it is sent."""

    type: str
    sequence_number: int = 0


class ResponseEvent(StreamEvent):
    type: Literal[
        "response.created",
        "response.in_progress",
        "response.completed",
        "response.incomplete",
        "response.failed",
    ]
    response: ResponseObject


class OutputItemEvent(StreamEvent):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(StreamEvent):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class TextDeltaEvent(StreamEvent):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class TextDoneEvent(StreamEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ArgumentsDeltaEvent(StreamEvent):
    type: Literal["response.function_call_arguments.delta"] = (
        "response.function_call_arguments.delta"
    )
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(StreamEvent):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    name: str
    arguments: str


class ReasoningDeltaEvent(StreamEvent):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningDoneEvent(StreamEvent):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    item_id: str
    output_index: int
    content_index: int
    text: str


class ErrorEvent(StreamEvent):
    """A failure after the stream began; a `response.failed` event follows it."""

    type: Literal["error"] = "error"
    code: str | None
    message: str
    param: str | None
