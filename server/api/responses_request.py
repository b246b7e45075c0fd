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
from hotlora.config.log_text import printable
from hotlora.server.api.completion_requests import (
    AdapterSpec,
    ChatCompletionRequest,
    RequestBody,
    TextOrRefusal,
    refuse_misplaced_refusals,
    refuse_unreadable_parts,
)
from hotlora.server.api.field_support import RESPONSES_REFUSED, check_fields, declared_names
from hotlora.server.api.wire_base import ClosedObject, RequestMetadata, unknown_key_message


class InputText(TextOrRefusal):
    """A text part of an input message; `output_text` is an earlier answer sent back, and
    `refusal` an earlier refusal, shown to the model as the assistant's words."""

    type: Literal["input_text", "output_text", "refusal"]

    # An earlier answer's part, sent back as the SDKs received it.
    tolerated = frozenset({"annotations", "logprobs"})


class InputMessage(ClosedObject):
    """One message of `input`: the easy form (no `type`) and the `"type": "message"` item."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: list[InputText]
    id: str | None = Field(default=None, description="An earlier answer's id; not read.")
    status: str | None = Field(default=None, description="An earlier answer's status; not read.")

    # An earlier answer's phase (commentary or final answer), which OpenAI asks to send back.
    tolerated = frozenset({"phase"})

    # A string arrives as one `input_text` part.
    @field_validator("content", mode="before", json_schema_input_type=str | list[InputText])
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [{"type": "input_text", "text": value}]
        refuse_unreadable_parts(value, "input_text")
        return value

    @model_validator(mode="after")
    def _refusals_are_the_assistant_s(self) -> InputMessage:
        refuse_misplaced_refusals(self.role, self.content)
        return self

    def text(self) -> str:
        return "".join(part.words for part in self.content)


class FunctionCallItem(ClosedObject):
    """A tool call the model made earlier, sent back with the conversation."""

    type: Literal["function_call"]
    id: str | None = None
    call_id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    status: str | None = None

    # What an earlier answer's item holds in the SDKs' types (its caller, the tool's namespace,
    # whether it ran asynchronously: `async_` as the Python SDK's `model_dump()` names it), sent
    # back as dumped: not read.
    tolerated = frozenset({"caller", "namespace", "async", "async_"})


class FunctionCallOutputItem(ClosedObject):
    """The result of a tool call, for the model to read."""

    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str
    output: str | list[InputText]
    status: str | None = None

    tolerated = frozenset({"caller", "namespace"})  # as on function_call items

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.words for part in self.output)


class ReasoningItem(ClosedObject):
    """A model's earlier reasoning, sent back with the conversation; chat templates drop
    earlier turns' thinking, so it is not shown to the model."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_INPUT_ITEMS: dict[str, type[ClosedObject]] = {
    "message": InputMessage,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


def _input_item(index: int, item: Any) -> Any:
    """One input item read as the model its `type` names (a message when it has none, or
    null), its problems located in it; an item that is not an object is left to the schema to
    refuse."""
    if not isinstance(item, dict):
        return item
    kind = item.get("type")
    kind = "message" if kind is None else kind
    model = _INPUT_ITEMS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise InvalidRequest(
            f"input items of type {kind!r} are not supported by this server; send messages, "
            "function_call and function_call_output items",
            param=f"input.{index}.type",
            code="invalid_value",
        )
    try:
        return model.model_validate(item)
    except ValidationError as exc:
        errors = exc.errors()
        unknown = [e for e in errors if e["type"] == "extra_forbidden"]
        error = (unknown or errors)[0]
        where = "input." + ".".join(str(part) for part in (index, *error["loc"]))
        if unknown:
            raise InvalidRequest(
                unknown_key_message(where), param=where, code="unknown_parameter"
            ) from exc
        message = error["msg"].removeprefix("Value error, ")
        raise InvalidRequest(
            f"{message} (param '{where}')", param=where, code="invalid_value"
        ) from exc


class FunctionTool(ClosedObject):
    """A function the model may call: the Responses API's flat form of a chat tool."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    def chat_tool(self) -> dict[str, Any]:
        spec = {
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "strict": self.strict,
        }
        function = {key: value for key, value in spec.items() if value is not None}
        return {"type": "function", "function": function}


class FunctionToolChoice(ClosedObject):
    """`tool_choice` naming the one function the answer must call."""

    type: Literal["function"]
    name: str


class TextFormat(ClosedObject):
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


class TextConfig(ClosedObject):
    format: TextFormat = Field(default_factory=lambda: TextFormat(type="text"))
    verbosity: Literal["medium"] | None = Field(
        default=None, description="Only 'medium', the default: the answer's length is not tuned."
    )


class ResponsesRequest(RequestBody, RequestMetadata):
    """POST /v1/responses: one generation, nothing stored."""

    background: StrictBool = False
    conversation: str | dict[str, Any] | None = None
    input: list[InputItem] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
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
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice = "auto"
    tools: list[FunctionTool] = Field(default_factory=list)
    top_p: StrictFloat | None = Field(
        default=None, ge=0.0, le=1.0, description="Nucleus sampling; 0 keeps the top token alone."
    )
    truncation: Literal["disabled"] = "disabled"
    seed: StrictInt | None = Field(
        default=None,
        ge=-(2**63),
        lt=2**64,
        description=(
            "Sample reproducibly: the same seed and request give the same answer; -1 (llama.cpp's "
            "spelling) draws a random seed."
        ),
    )
    adapter: AdapterSpec = Field(
        default=(),
        description=(
            "LoRA adapters to apply for this request, summed in order: 'sft', 'sft+dpo', "
            "'sft@0.5+dpo', or [{'id': 'sft', 'scale': 0.5}, {'id': 'dpo'}]. 'none' or absent "
            "serves the base model."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _no_field_ignored(cls, data: Any) -> Any:
        check_fields(data, declared_names(cls), RESPONSES_REFUSED)
        return data

    # A string arrives as one user message; a message without `type` is a message item.
    @field_validator("input", mode="before", json_schema_input_type=str | list[InputItem])
    @classmethod
    def _known_items(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [InputMessage(role="user", content=[InputText(type="input_text", text=value)])]
        if not isinstance(value, list):
            return value
        return [_input_item(i, item) for i, item in enumerate(value)]

    @field_validator("input")
    @classmethod
    def _outputs_answer_calls(cls, items: list[InputItem]) -> list[InputItem]:
        called: set[str] = set()
        for index, item in enumerate(items):
            if isinstance(item, FunctionCallItem):
                called.add(item.call_id)
            elif isinstance(item, FunctionCallOutputItem) and item.call_id not in called:
                raise InvalidRequest(
                    f"No tool call found for function call output with call_id "
                    f"{printable(item.call_id)!r} (input.{index}): send the function_call item "
                    "before its output.",
                    param=f"input.{index}.call_id",
                )
        return items

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

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, value: Any) -> Any:
        for tool in value if isinstance(value, list) else ():
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise ValueError(
                    f"tools of type {kind!r} are not supported by this server; send function tools"
                )
        return value

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages: a run of function calls is one assistant message
        with `tool_calls` (joined to the assistant's text just before it), an output a `tool`
        message."""
        # A developer message stays one: rendering makes it a system message for a template
        # that does not name the role (`ChatTemplate.with_roles`), as on chat.
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        for item in self.input:
            if isinstance(item, InputMessage):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append(
                    {"role": "tool", "tool_call_id": item.call_id, "content": item.text()}
                )
        return messages

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion this request asks for, validated as the chat route validates."""
        fields: dict[str, Any] = {
            "model": self.model,
            "messages": self.chat_messages(),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stream": self.stream,
            "adapter": [{"id": ref.id, "scale": ref.weight} for ref in self.adapter],
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        if self.tools:
            fields["tools"] = [tool.chat_tool() for tool in self.tools]
        choice = self.tool_choice
        if isinstance(choice, FunctionToolChoice):
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif self.tools or choice != "auto":
            fields["tool_choice"] = choice
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
    if head in ("tools", "tool_choice"):
        # A Responses tool holds its function's fields itself, not under `function`.
        return chat_param.replace(".function.", ".", 1).replace(".function", "", 1)
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
