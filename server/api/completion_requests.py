"""The wire schema: OpenAI request and response models, fields in the order of the reference.

Fields that OpenAI does not have carry a `Field(description=...)`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
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
from hotlora.config.log_text import printable
from hotlora.server.api.field_support import check_fields, declared_names
from hotlora.server.api.output_formats import GuidedFields, ResponseFormat
from hotlora.server.api.wire_base import ClosedObject, RequestBody, RequestMetadata

MAX_STOP_SEQUENCES = 64  # OpenAI takes 4; llama.cpp any number
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
MAX_STOP_TOKEN_IDS = 64


class TextOrRefusal(ClosedObject):
    """A content part holding `text`, or (type `refusal`) an earlier answer's refusal, as
    OpenAI's schema lets a replayed answer hold one: the model is shown either as the words."""

    type: str
    text: str | None = None
    refusal: str | None = None

    @model_validator(mode="after")
    def _its_own_field(self) -> TextOrRefusal:
        field, other = ("refusal", "text") if self.type == "refusal" else ("text", "refusal")
        if getattr(self, field) is None:
            raise ValueError(f"a '{self.type}' part needs its '{field}'")
        if getattr(self, other) is not None:
            raise ValueError(f"a '{self.type}' part holds '{field}', not '{other}'")
        return self

    @property
    def words(self) -> str:
        return self.text if self.text is not None else self.refusal or ""


class TextPart(TextOrRefusal):
    """A chat message's text part; an assistant's may be a refusal."""

    type: Literal["text", "refusal"]

    # Prompt-caching marks some clients (LiteLLM, for Anthropic) put on parts; caching is
    # automatic here.
    tolerated = frozenset({"cache_control"})


# Content parts for inputs this server cannot read: what a refusal calls them (chat's and the
# Responses API's spellings).
_UNSUPPORTED_PARTS = {
    "image_url": "images are",
    "input_image": "images are",
    "input_audio": "audio is",
    "file": "files are",
    "input_file": "files are",
}


def refuse_misplaced_refusals(role: str | None, parts: Any) -> None:
    """A ValueError for a refusal part outside an assistant's message (only an answer refuses)."""
    refusals = isinstance(parts, list) and any(getattr(p, "type", None) == "refusal" for p in parts)
    if refusals and role != "assistant":
        raise ValueError("only an assistant message may hold a refusal part")


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


class FunctionDefinition(ClosedObject):
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(ClosedObject):
    type: Literal["function"]
    function: FunctionDefinition

    tolerated = frozenset({"cache_control"})  # as on text parts


class FunctionName(ClosedObject):
    name: str


class NamedToolChoice(ClosedObject):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(ClosedObject):
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    # The openai SDK's `parse` and `stream` helpers add the arguments they parsed.
    tolerated = frozenset({"parsed_arguments"})


class ToolCall(ClosedObject):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    # Clients that gather a streamed call from its deltas keep the deltas' index.
    tolerated = frozenset({"index"})


# The roles OpenAI defines. A chat template may take others (Llama 3.1's `ipython`, a
# `tool_response`, ...): those reach the template as sent, and it decides.
OPENAI_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


_CONTENT_REQUIRED = frozenset({"system", "developer", "user", "tool"})


class ChatMessage(ClosedObject):
    role: str = Field(
        min_length=1,
        max_length=64,
        description=(
            "OpenAI's system, developer, user, assistant or tool; any other role goes to the "
            "chat template as sent, and one it cannot render is a 400 naming it."
        ),
    )
    content: str | list[TextPart] | None = Field(default=None, validate_default=True)
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: None = Field(
        default=None, description="OpenAI's deprecated single call: refused, send tool_calls."
    )

    # What the openai SDKs, LangChain and LiteLLM send back when they replay an assistant
    # answer: its refusal, annotations, audio reference, (vLLM's, this server's, OpenRouter's)
    # reasoning, the SDK's `parse` helpers' parsed content, LiteLLM's own fields and thinking
    # blocks. Chat templates do not show them, and drop an earlier turn's thinking. And the
    # prompt-caching mark of text parts, which LiteLLM also puts on messages.
    tolerated = frozenset(
        {
            "refusal",
            "annotations",
            "audio",
            "reasoning_content",
            "reasoning",
            "parsed",
            "provider_specific_fields",
            "thinking_blocks",
            "reasoning_details",
            "cache_control",
        }
    )

    @field_validator("function_call", mode="before")
    @classmethod
    def _tool_calls_instead(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("function_call is not supported by this server; send tool_calls")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        refuse_unreadable_parts(value, "text")
        return value

    @field_validator("content")
    @classmethod
    def _content_where_openai_requires_it(cls, value: Any, info: ValidationInfo) -> Any:
        # As OpenAI's schema has it: a list holds one part at least, and only the assistant
        # (whose turn may be tool calls alone) and roles OpenAI does not define may leave the
        # content out or null.
        if isinstance(value, list) and not value:
            raise ValueError("an empty list of content parts; send one part at least, or a string")
        role = info.data.get("role")
        refuse_misplaced_refusals(role, value)
        if value is None and role in _CONTENT_REQUIRED:
            raise ValueError(f"messages with role '{role}' must have a 'content'")
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
        return "".join(part.words for part in self.content)


class StreamOptions(ClosedObject):
    include_usage: StrictBool = False
    include_obfuscation: StrictBool | None = Field(
        default=None,
        description="Chunks here carry no obfuscation padding; true (asking for it) is refused.",
    )
    continuous_usage_stats: StrictBool = Field(
        default=False, description="vLLM: usage (so far) on every chunk of the stream."
    )

    @field_validator("include_obfuscation")
    @classmethod
    def _no_padding(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("stream obfuscation padding is not implemented; send false")
        return value


class SamplingFields(GuidedFields, RequestBody, RequestMetadata):
    """Fields shared by chat and text completions."""

    model: str
    frequency_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    n: StrictInt = Field(default=1, ge=1)
    logit_bias: dict[str, StrictFloat] | None = None
    seed: StrictInt | None = Field(
        default=None,
        ge=-(2**63),
        lt=2**64,
        description="Sample reproducibly; -1 (llama.cpp's spelling) draws a random seed.",
    )
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(
        default=None, ge=0.0, le=1.0, description="Nucleus sampling; 0 keeps the top token alone."
    )
    top_k: StrictInt | None = Field(
        default=None,
        ge=-1,
        description="Sample from the k most likely tokens; 0 or -1 (vLLM's spelling) disables.",
    )
    min_p: StrictFloat | None = Field(
        default=None, ge=0.0, le=1.0, description="Drop tokens below min_p x the top probability."
    )
    repetition_penalty: StrictFloat | None = Field(
        default=None,
        ge=0.01,
        le=10.0,
        description=(
            "Multiplicative penalty on the prompt's and the generated tokens (0.01 to 10; 1 is "
            "none)."
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
    # vLLM's sampling parameters.
    min_tokens: StrictInt = Field(
        default=0,
        ge=0,
        description="EOS and stop_token_ids cannot end the answer before this many tokens.",
    )
    ignore_eos: StrictBool = Field(default=False, description="EOS does not end the answer.")
    stop_token_ids: list[StrictInt] | None = Field(
        default=None,
        max_length=MAX_STOP_TOKEN_IDS,
        description="Token ids that end the answer, as EOS does.",
    )
    include_stop_str_in_output: StrictBool = Field(
        default=False,
        description="Keep the stop string (or stop token) that ended the answer in its text.",
    )
    skip_special_tokens: StrictBool = Field(
        default=True, description="false writes control tokens into the text."
    )
    allowed_token_ids: list[StrictInt] | None = Field(
        default=None, min_length=1, description="Only these token ids may be generated."
    )
    truncate_prompt_tokens: StrictInt | None = Field(
        default=None,
        ge=-1,
        description="Keep only the last N prompt tokens; -1 keeps the context length.",
    )
    prompt_logprobs: StrictInt | None = Field(
        default=None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="Log-probabilities of the prompt's tokens, with this many alternatives.",
    )
    request_id: str | None = Field(
        default=None,
        pattern=r"^[\x21-\x7e]{1,128}$",
        description="vLLM: the answer's id is chatcmpl-<request_id> (cmpl-<request_id>).",
    )
    cache_salt: str | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        description=(
            "vLLM: the prompt cache is salted with it; a request reads only prompts cached by "
            "requests of the same salt (and the same tenant)."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _no_field_ignored(cls, data: Any) -> Any:
        check_fields(data, declared_names(cls))
        return data

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keeps_something(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("truncate_prompt_tokens must be -1 or at least 1")
        return value

    @model_validator(mode="after")
    def _prompt_logprobs_whole(self) -> SamplingFields:
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequest(
                "prompt_logprobs are not available when streaming.", param="prompt_logprobs"
            )
        return self

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

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        """The field `requested_max_tokens` came from, for a refusal to name."""
        return "max_tokens"

    @model_validator(mode="after")
    def _min_within_max(self) -> SamplingFields:
        most = self.requested_max_tokens
        if most is not None and self.min_tokens > most:
            raise InvalidRequest(
                f"min_tokens ({self.min_tokens}) must be at most the answer's token limit "
                f"({most}).",
                param="min_tokens",
            )
        return self


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    include_reasoning: StrictBool | None = Field(
        default=None, description="vLLM: whether the answer carries the model's reasoning."
    )
    # vLLM's chat parameters.
    echo: StrictBool = Field(
        default=False,
        description="vLLM: the answer's content starts with the last message's when that is "
        "the assistant's (a prefill continued).",
    )
    add_generation_prompt: StrictBool = Field(
        default=True,
        description="End the prompt with the opening of the assistant's turn, as the chat "
        "template writes it.",
    )
    continue_final_message: StrictBool = Field(
        default=False,
        description="Continue the last message (an assistant prefill): it is left open, with no "
        "end of turn. Implies add_generation_prompt false.",
    )
    add_special_tokens: StrictBool = Field(
        default=False,
        description="Add the tokenizer's special tokens (BOS) on top of what the template writes.",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None,
        description="Variables passed to the chat template (e.g. enable_thinking); each must be "
        "one the template reads.",
    )
    documents: list[dict[str, str]] | None = Field(
        default=None, description="Documents passed to a chat template that reads them."
    )

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
    def _tool_replies_answer_calls(self) -> ChatCompletionRequest:
        # A reply to no call is a conversation put together wrongly (a trimmed history, an id
        # mistyped): a template would show the model a result of nothing it asked for.
        called: set[str] = set()
        for index, message in enumerate(self.messages):
            called.update(call.id for call in message.tool_calls or ())
            if message.role == "tool" and message.tool_call_id not in called:
                raise InvalidRequest(
                    f"messages.{index} answers the tool call "
                    f"{printable(str(message.tool_call_id))!r}, which no earlier assistant "
                    "message's tool_calls holds; a tool message must follow the assistant "
                    "message with that call.",
                    param=f"messages.{index}.tool_call_id",
                )
        return self

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true.", param="top_logprobs")
        if self.continue_final_message:
            if self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
                raise InvalidRequest(
                    "continue_final_message and add_generation_prompt cannot both be true.",
                    param="continue_final_message",
                )
            self.add_generation_prompt = False
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"


# A prompt or an input as the document shows it: no empty text, list or token list (`_non_empty`
# refuses them).
TEXT_OR_TOKENS_SCHEMA = {
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

TextOrTokens = Annotated[
    str | list[str] | list[StrictInt] | list[list[StrictInt]], WithJsonSchema(TEXT_OR_TOKENS_SCHEMA)
]


class CompletionRequest(SamplingFields):
    prompt: TextOrTokens
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # 0 with `echo`: the prompt scored, nothing generated (OpenAI's legacy completions, vLLM).
    max_tokens: StrictInt | None = Field(default=None, ge=0)
    response_format: ResponseFormat | None = None
    add_special_tokens: StrictBool = Field(
        default=True, description="Add the tokenizer's special tokens (BOS) to a text prompt."
    )

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be an empty list")
        # Refused whatever the tokenizer would make of them (one that adds BOS makes a token).
        if value == "" or (isinstance(value, list) and any(p in ("", []) for p in value)):
            raise ValueError("prompt must not be empty, nor hold an empty prompt")
        return value

    @model_validator(mode="after")
    def _echo_fields(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequest(
                "max_tokens 0 asks for no completion: send echo true to have the prompt (and "
                "with logprobs, its scores) back, or ask for at least 1 token.",
                param="max_tokens",
            )
        scored = self.prompt_logprobs
        if self.echo and self.logprobs is not None and scored not in (None, self.logprobs):
            raise InvalidRequest(
                f"echo with logprobs {self.logprobs} reports the prompt's tokens with "
                f"{self.logprobs} alternatives; prompt_logprobs {scored} asks for another "
                "count: leave it out, or send the same.",
                param="prompt_logprobs",
            )
        return self

    @property
    def scored_prompt(self) -> int | None:
        """Alternatives per prompt token to compute: vLLM's `prompt_logprobs`, or `logprobs`
        when the prompt is echoed; None: the prompt is not scored."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None


def template_refusal(exc: Exception, messages: list[dict[str, Any]]) -> InvalidRequest:
    """The 400 for a conversation the chat template refused to render: naming the first
    message whose role OpenAI does not define, the likely cause, else the messages."""
    message = f"The model's chat template cannot render these messages: {exc}"
    for index, sent in enumerate(messages):
        role = sent.get("role")
        if role not in OPENAI_ROLES:
            return InvalidRequest(
                f"{message} (messages.{index} has the role {printable(str(role))!r}, which "
                "OpenAI does not define; this model's chat template may not take it)",
                param=f"messages.{index}.role",
            )
    return InvalidRequest(message, param="messages")
