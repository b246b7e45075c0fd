"""The wire schema: OpenAI request and response models, fields in the order of the reference.

Fields that OpenAI does not have carry a `Field(description=...)`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from hotlora.adapters import AdapterRef, parse_adapter_spec
from hotlora.config.errors import InvalidRequest

MAX_STOP_SEQUENCES = 16
# The `adapter` field: parsed at validation into the ordered adapter references.
AdapterSpec = Annotated[
    tuple[AdapterRef, ...],
    BeforeValidator(parse_adapter_spec),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "object"}]}},
                {"type": "null"},
            ]
        }
    ),
]
MAX_TOP_LOGPROBS = 20


_SURROGATE = re.compile("[\ud800-\udfff]")
MAX_JSON_DEPTH = 64


class OpenAIBase(BaseModel):
    # Clients send fields we do not use (e.g. `user`, `store`); OpenAI ignores them too.
    # NaN and infinities are refused wherever a number is read. Request fields are typed
    # `StrictInt`, `StrictFloat` and `StrictBool`: as OpenAI does, "3", true and 3.5 are refused
    # where an integer goes, and "0.5" and true where a number does, never converted.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class RequestBody(OpenAIBase):
    """A whole request body: its text must be valid Unicode before any field reads it."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        # JSON may escape lone UTF-16 surrogates ("\ud800"), which no encoder can write out.
        where = _lone_surrogate(data, ())
        if where is not None:
            param = ".".join(where) or None
            raise InvalidRequest(
                f"The request contains text that is not valid Unicode (a lone UTF-16 surrogate) "
                f"in '{param or 'body'}'.",
                param=param,
                code="invalid_value",
            )
        return data


def _lone_surrogate(value: Any, path: tuple[str, ...], depth: int = 0) -> tuple[str, ...] | None:
    """Where in a parsed JSON value a string (or key) holds a lone surrogate; None if nowhere."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if depth > MAX_JSON_DEPTH:
        return None  # deeper than any field reads; left to the schema to refuse
    if isinstance(value, dict):
        for key, item in value.items():
            here = (*path, str(key).encode("ascii", "backslashreplace").decode())
            if isinstance(key, str) and _SURROGATE.search(key):
                return here
            found = _lone_surrogate(item, here, depth + 1)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _lone_surrogate(item, (*path, str(i)), depth + 1)
            if found is not None:
                return found
    return None


class TextPart(OpenAIBase):
    type: Literal["text"]
    text: str


# Content parts for inputs this server cannot read: what a refusal calls them (chat's and the
# Responses API's spellings).
_UNSUPPORTED_PARTS = {
    "image_url": "images are",
    "input_image": "images are",
    "input_audio": "audio is",
    "file": "files are",
    "input_file": "files are",
}


def refuse_unreadable_parts(value: Any, text_parts: str) -> None:
    """A ValueError for the first content part that is not text, naming what it holds."""
    if not isinstance(value, list):
        return
    for part in value:
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind in _UNSUPPORTED_PARTS:
            raise ValueError(
                f"{_UNSUPPORTED_PARTS[kind]} not supported by this server (a content part of "
                f"type '{kind}'); send {text_parts} parts only"
            )


_FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"


class FunctionDefinition(OpenAIBase):
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(OpenAIBase):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(OpenAIBase):
    name: str


class NamedToolChoice(OpenAIBase):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(OpenAIBase):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(OpenAIBase):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBase):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        refuse_unreadable_parts(value, "text")
        return value

    @model_validator(mode="after")
    def _tool_reply_names_its_call(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("messages with role 'tool' must have a 'tool_call_id'")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages may carry tool_calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(OpenAIBase):
    include_usage: StrictBool = False


class SamplingFields(RequestBody):
    """Fields shared by chat and text completions."""

    model: str
    frequency_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    n: StrictInt = Field(default=1, ge=1)
    logit_bias: dict[str, StrictFloat] | None = None
    seed: StrictInt | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(
        default=None, ge=0, description="Sample from the k most likely tokens; 0 disables."
    )
    min_p: StrictFloat | None = Field(
        default=None, ge=0.0, le=1.0, description="Drop tokens below min_p x the top probability."
    )
    repetition_penalty: StrictFloat | None = Field(
        default=None,
        ge=0.01,
        le=10.0,
        description="Multiplicative penalty on recently seen tokens (0.01 to 10; 1 is none).",
    )
    adapter: AdapterSpec = Field(
        default=(),
        description=(
            "LoRA adapters to apply for this request, summed in order: 'sft', 'sft+dpo', "
            "'sft@0.5+dpo', or [{'id': 'sft', 'scale': 0.5}, {'id': 'dpo'}]. 'none' or absent "
            "serves the base model."
        ),
    )

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value and any(not -100.0 <= bias <= 100.0 for bias in value.values()):
            raise ValueError("logit_bias values must be between -100 and 100")
        return value

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if any(stop == "" for stop in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @property
    def stop_list(self) -> list[str]:
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class JsonSchemaFormat(OpenAIBase):
    """`response_format.json_schema`: the JSON Schema the answer must validate against."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    # `schema` itself would shadow a pydantic attribute.
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(OpenAIBase):
    """`response_format`: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a response_format of type 'json_schema' needs 'json_schema'")
        return self

    @property
    def enforced_schema(self) -> dict[str, Any] | None:
        """The JSON Schema the answer must match, enforced while decoding; None: plain text."""
        if self.type == "json_object":
            return {"type": "object"}
        return self.json_schema.schema_ if self.json_schema else None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, value: list[Tool] | None) -> list[Tool] | None:
        names = [tool.function.name for tool in value or ()]
        if len(names) != len(set(names)):
            raise ValueError("tool function names must be unique")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_names_a_tool(cls, choice: Any, info: ValidationInfo) -> Any:
        names = {tool.function.name for tool in info.data.get("tools") or ()}
        if choice not in (None, "none", "auto") and not names:
            raise ValueError("tool_choice requires tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names '{choice.function.name}', which is not in tools")
        return choice

    @property
    def tool_use(self) -> str:
        """'none', 'auto', 'required', or the function a named tool_choice requires."""
        if not self.tools:
            return "none"
        choice = self.tool_choice or "auto"
        return choice.function.name if isinstance(choice, NamedToolChoice) else choice

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# A prompt as the document shows it: no empty text, list or token list (`_non_empty` refuses them).
_PROMPT_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
        {"type": "array", "minItems": 1, "items": {"type": "integer"}},
        {
            "type": "array",
            "minItems": 1,
            "items": {"type": "array", "minItems": 1, "items": {"type": "integer"}},
        },
    ]
}


class CompletionRequest(SamplingFields):
    prompt: Annotated[
        str | list[str] | list[StrictInt] | list[list[StrictInt]], WithJsonSchema(_PROMPT_SCHEMA)
    ]
    best_of: StrictInt | None = Field(default=None, ge=1, le=1)
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=5)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be an empty list")
        # Refused whatever the tokenizer would make of them (one that adds BOS makes a token).
        if value == "" or (isinstance(value, list) and any(p in ("", []) for p in value)):
            raise ValueError("prompt must not be empty, nor hold an empty prompt")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens
