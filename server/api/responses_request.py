"""The Responses API request: its schema and its chat-request form (the answer's schema is in
`responses_objects`).

A Responses request runs as the chat completion it describes; `chat_request` builds that, and
`responses_params` renames a chat refusal's fields (`max_tokens`, `messages`) to the ones the
client sent. Fields in the order of OpenAI's reference; those OpenAI does not have carry a
`Field(description=...)`.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from hotlora.config.errors import HotloraError, InvalidRequest
from hotlora.server.api.completion_requests import (
    AdapterSpec,
    ChatCompletionRequest,
    OpenAIBase,
    RequestBody,
    refuse_unreadable_parts,
)

MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


class InputText(OpenAIBase):
    """A text part of an input message; `output_text` is an earlier answer sent back."""

    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(OpenAIBase):
    """One message of `input`: the easy form (no `type`) and the `"type": "message"` item."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: list[InputText]

    # A string arrives as one `input_text` part.
    @field_validator("content", mode="before", json_schema_input_type=str | list[InputText])
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [{"type": "input_text", "text": value}]
        refuse_unreadable_parts(value, "input_text")
        return value

    def text(self) -> str:
        return "".join(part.text for part in self.content)


class TextFormat(OpenAIBase):
    """`text.format`: plain text, any JSON object, or JSON matching `schema`."""

    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    # `schema` itself would shadow a pydantic method.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _schema_named(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a format of type 'json_schema' needs a 'name' and a 'schema'")
        return self

    def response_format(self) -> dict[str, Any]:
        """The chat request's `response_format` asking for the same output."""
        if self.type != "json_schema":
            return {"type": self.type}
        spec: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "schema": self.schema_,
            "strict": self.strict,
        }
        return {
            "type": "json_schema",
            "json_schema": {key: value for key, value in spec.items() if value is not None},
        }


class TextConfig(OpenAIBase):
    format: TextFormat = Field(default_factory=lambda: TextFormat(type="text"))


class ResponsesRequest(RequestBody):
    """POST /v1/responses: one generation, nothing stored."""

    background: StrictBool = False
    conversation: str | dict[str, Any] | None = None
    input: list[InputMessage] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    metadata: dict[str, str] | None = None
    model: str
    parallel_tool_calls: StrictBool = True
    previous_response_id: str | None = None
    prompt: dict[str, Any] | None = None
    store: StrictBool | None = Field(
        default=None,
        description="Accepted for compatibility; this server is stateless and stores nothing.",
    )
    stream: StrictBool = False
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0)
    text: TextConfig = Field(default_factory=TextConfig)
    tool_choice: Literal["none", "auto"] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    truncation: Literal["disabled"] = "disabled"
    seed: StrictInt | None = Field(
        default=None,
        ge=-(2**63),
        lt=2**64,
        description="Sample reproducibly: the same seed and request give the same answer.",
    )
    adapter: AdapterSpec = Field(
        default=(),
        description=(
            "LoRA adapters to apply for this request, summed in order: 'sft', 'sft+dpo', "
            "'sft@0.5+dpo', or [{'id': 'sft', 'scale': 0.5}, {'id': 'dpo'}]. 'none' or absent "
            "serves the base model."
        ),
    )

    # A string arrives as one user message.
    @field_validator("input", mode="before", json_schema_input_type=str | list[InputMessage])
    @classmethod
    def _messages_only(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [{"role": "user", "content": value}]
        if isinstance(value, list):
            for item in value:
                kind = item.get("type", "message") if isinstance(item, dict) else "message"
                if kind != "message":
                    raise ValueError(
                        f"input items of type {kind!r} are not supported by this server; "
                        "send messages"
                    )
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_size(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        if len(value) > MAX_METADATA_KEYS:
            raise ValueError(f"metadata may have at most {MAX_METADATA_KEYS} keys")
        if any(len(key) > MAX_METADATA_KEY_CHARS for key in value):
            raise ValueError(f"metadata keys may be at most {MAX_METADATA_KEY_CHARS} characters")
        if any(len(item) > MAX_METADATA_VALUE_CHARS for item in value.values()):
            raise ValueError(
                f"metadata values may be at most {MAX_METADATA_VALUE_CHARS} characters"
            )
        return value

    @field_validator("previous_response_id", "conversation", "prompt")
    @classmethod
    def _stateless(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(
                "this server is stateless and keeps no responses, conversations or prompts; "
                "send the whole conversation in 'input' instead"
            )
        return value

    @field_validator("background")
    @classmethod
    def _in_the_foreground(cls, value: bool) -> bool:
        if value:
            raise ValueError("background responses are not supported by this server")
        return value

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if value:
            raise ValueError("tools are not supported on /v1/responses by this server")
        return value

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion this request asks for, validated as the chat route validates."""
        # Chat templates know "system"; OpenAI treats "developer" as its successor.
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.input
        ]
        fields: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stream": self.stream,
            "adapter": [{"id": ref.id, "scale": ref.weight} for ref in self.adapter],
        }
        if self.text.format.type != "text":
            fields["response_format"] = self.text.format.response_format()
        try:
            return ChatCompletionRequest.model_validate(fields)
        except ValidationError as exc:
            error = exc.errors()[0]
            chat_param = ".".join(str(part) for part in error["loc"]) or None
            message = error["msg"].removeprefix("Value error, ")
            raise InvalidRequest(
                _renamed(message), param=_responses_param(chat_param), code="invalid_value"
            ) from exc


# Chat fields the client did not send, and the Responses field each one came from.
_CHAT_TO_RESPONSES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}
_CHAT_WORDS = re.compile(r"\b(max_tokens|max_completion_tokens|response_format)\b")


def _responses_param(chat_param: str | None) -> str | None:
    if chat_param is None:
        return None
    head, _, rest = chat_param.partition(".")
    if head == "messages":
        return "input"  # a message index would be off by one after the instructions
    if head == "response_format":
        # `text.format` holds the schema's fields itself, not under `json_schema`.
        rest = rest.removeprefix("json_schema").removeprefix(".")
    if head in _CHAT_TO_RESPONSES:
        return ".".join(part for part in (_CHAT_TO_RESPONSES[head], rest) if part)
    return chat_param


def _renamed(message: str) -> str:
    return _CHAT_WORDS.sub(lambda m: _CHAT_TO_RESPONSES[m.group(1)], message)


@contextlib.contextmanager
def responses_params() -> Iterator[None]:
    """Refusals raised by the chat path name the Responses fields the client sent."""
    try:
        yield
    except HotloraError as exc:
        renamed = _responses_param(exc.param)
        if renamed != exc.param:
            exc.param = renamed
            exc.message = _renamed(exc.message)
            exc.args = (exc.message,)
        raise
