"""The schema of vLLM's /tokenize and /detokenize and of /v1/embeddings, fields in the order of
vLLM's and OpenAI's references.

Fields that neither has carry a `Field(description=...)`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

from hotlora.server.api.completion_requests import (
    AdapterSpec,
    ChatMessage,
    RequestBody,
    TextOrTokens,
    Tool,
)
from hotlora.server.api.field_support import TOKEN_ROUTES_REFUSED, check_fields, declared_names

# OpenAI's bound on the inputs of one embeddings request.
MAX_EMBEDDING_INPUTS = 2048


class TokenRouteBody(RequestBody):
    """A body of /tokenize, /detokenize or /v1/embeddings: a field other servers define there
    and these routes do not implement is refused by name, never dropped."""

    @model_validator(mode="before")
    @classmethod
    def _no_field_ignored(cls, data: Any) -> Any:
        check_fields(data, declared_names(cls), TOKEN_ROUTES_REFUSED)
        return data


class TokenizeRequest(TokenRouteBody):
    """vLLM's POST /tokenize: a `prompt`, or `messages` rendered by the chat template first."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool | None = Field(
        default=None,
        description=(
            "Add the tokenizer's special tokens (a BOS); default true for `prompt`, false for "
            "`messages` (the chat template writes its own)."
        ),
    )
    return_token_strs: StrictBool = False
    tools: list[Tool] | None = None

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either 'prompt' or 'messages'")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(TokenRouteBody):
    """vLLM's POST /detokenize: token ids back to text."""

    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str


class EmbeddingRequest(TokenRouteBody):
    """POST /v1/embeddings: one input or many, text or token ids."""

    input: TextOrTokens
    model: str
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(default=None, ge=1)
    user: str | None = None
    adapter: AdapterSpec = Field(
        default=(),
        description=(
            "LoRA adapters whose hidden states are pooled, summed in order, as on chat: 'sft', "
            "'sft+dpo', 'sft@0.5+dpo'. 'none' or absent pools the base model's."
        ),
    )

    @field_validator("input")
    @classmethod
    def _inputs(cls, value: Any) -> Any:
        if value == "" or value == []:
            raise ValueError("input must not be empty")
        if isinstance(value, list) and any(item in ("", []) for item in value):
            raise ValueError("input must not hold an empty string or token list")
        # One list of token ids is one input, however long.
        many = isinstance(value, list) and not all(isinstance(item, int) for item in value)
        if many and len(value) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"input may hold at most {MAX_EMBEDDING_INPUTS} items")
        return value

    @property
    def inputs(self) -> list[str | list[int]]:
        """Each input alone: a string, or one list of token ids."""
        value = self.input
        if isinstance(value, str) or all(isinstance(item, int) for item in value):
            return [value]
        return list(value)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str
    index: int


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
