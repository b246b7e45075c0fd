"""What the completion endpoints answer: completions, stream chunks, usage, logprobs, tool calls.

Fields in the order of OpenAI's reference.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field


def completion_id(prefix: str, request_id: str | None = None) -> str:
    """The answer's id: the client's request id (vLLM's `request_id`) after the prefix, or a
    new one."""
    return f"{prefix}-{request_id or uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None  # the model never refuses: always null


class OutputFunctionCall(BaseModel):
    name: str
    arguments: str


class OutputToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: OutputFunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None  # the model never refuses: always null, as OpenAI sends it
    reasoning_content: str | None = Field(
        default=None, description="A thinking model's reasoning, written before its answer."
    )
    # An array or nothing, as OpenAI's schema has it: left out when the answer calls no tool.
    tool_calls: list[OutputToolCall] | None = Field(
        default=None, exclude_if=lambda calls: calls is None
    )


FinishReason = Literal["stop", "length", "tool_calls"]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None


class PromptLogprob(BaseModel):
    """vLLM's entry for one token at one prompt position."""

    logprob: float
    rank: int
    decoded_token: str


# vLLM's `prompt_logprobs`: per prompt token, its token id and the top alternatives' (the first
# prompt token has none: null).
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None


class DeltaToolCall(OutputToolCall):
    index: int  # the call's place among the choice's tool calls


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    # With `echo`, the prompt's tokens come first; its first token's entries are null.
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
