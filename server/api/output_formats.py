"""What the answer must look like: `response_format`, vLLM's `guided_*` and `structured_outputs`,
llama.cpp's `json_schema` and `grammar`, read into one `OutputSpec` that the grammar engine
enforces while decoding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ConfigDict, Field, StrictBool, field_validator, model_validator
from pydantic.json_schema import JsonDict

from hotlora.config.errors import InvalidRequest
from hotlora.server.api.wire_base import ClosedObject, OpenAIBase

MAX_CHOICES = 256

OutputKind = Literal["json", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class OutputSpec:
    """One constraint on the answer, and the request field it came in.

    `json`: a JSON Schema (dict); `regex`: a regular expression; `choice`: the answer is one of
    these strings; `grammar`: a Lark or GBNF grammar. `closed`: objects that list `properties`
    and say nothing of `additionalProperties` take no other keys.
    """

    kind: OutputKind
    value: Any
    param: str
    closed: bool = True


class JsonSchemaFormat(ClosedObject):
    """`response_format.json_schema`: the JSON Schema the answer must validate against."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    # `schema` itself would shadow a pydantic attribute.
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(ClosedObject):
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


# What `_choices` holds a list to, shown in the OpenAPI document (on an array only, null passes).
_CHOICES_SCHEMA: JsonDict = {"minItems": 1, "maxItems": MAX_CHOICES, "items": {"minLength": 1}}


def _choices(value: list[str] | None) -> list[str] | None:
    if value is not None and (not value or len(value) > MAX_CHOICES):
        raise ValueError(f"give between 1 and {MAX_CHOICES} choices")
    if value is not None and any(choice == "" for choice in value):
        raise ValueError("choices must not be empty strings")
    return value


def _schema(value: dict[str, Any] | str | None) -> dict[str, Any] | None:
    """A JSON Schema given as an object or as JSON text (vLLM takes both)."""
    if not isinstance(value, str):
        return value
    try:
        schema = json.loads(value)
    except ValueError as exc:
        raise ValueError(f"the schema is not valid JSON: {exc}") from exc
    if not isinstance(schema, dict):
        raise ValueError("the schema must be a JSON object")
    return schema


class StructuredOutputs(OpenAIBase):
    """vLLM's `structured_outputs`: one of json, regex, choice, grammar or json_object."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, json_schema_extra=_CHOICES_SCHEMA)
    grammar: str | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool | None = Field(
        default=None, description="JSON is always written without free whitespace here."
    )
    disable_additional_properties: StrictBool | None = Field(
        default=None,
        description="false leaves objects without additionalProperties open to other keys.",
    )
    disable_fallback: StrictBool | None = Field(
        default=None, description="Accepted: this server has one grammar engine, no fallback."
    )

    model_config = ConfigDict(populate_by_name=True)

    @field_validator("choice")
    @classmethod
    def _check_choice(cls, value: list[str] | None) -> list[str] | None:
        return _choices(value)

    @field_validator("json_")
    @classmethod
    def _check_json(cls, value: dict[str, Any] | str | None) -> dict[str, Any] | None:
        return _schema(value)

    @field_validator("disable_any_whitespace")
    @classmethod
    def _compact_only(cls, value: bool | None) -> bool | None:
        if value is False:
            raise ValueError("JSON is always written compact here: free whitespace is not offered")
        return value

    @model_validator(mode="before")
    @classmethod
    def _nothing_unknown(cls, data: Any) -> Any:
        # `structural_tag`, `whitespace_pattern` and whatever else: refused, never dropped.
        if isinstance(data, dict):
            for key, value in data.items():
                if key not in _STRUCTURED_KEYS and value is not None:
                    raise InvalidRequest(
                        f"structured_outputs.{key} is not supported by this server; send one "
                        "of json, regex, choice, grammar or json_object.",
                        param=f"structured_outputs.{key}",
                        code="unsupported_parameter",
                    )
        return data


_STRUCTURED_KEYS = frozenset(
    {
        "json",
        "regex",
        "choice",
        "grammar",
        "json_object",
        "disable_any_whitespace",
        "disable_additional_properties",
        "disable_fallback",
    }
)


class GuidedFields(OpenAIBase):
    """The request fields that constrain the answer, beyond OpenAI's `response_format`."""

    guided_json: dict[str, Any] | str | None = Field(
        default=None, description="vLLM: the answer is JSON valid under this JSON Schema."
    )
    guided_regex: str | None = Field(
        default=None, description="vLLM: the answer matches this regular expression."
    )
    guided_choice: list[str] | None = Field(
        default=None,
        description="vLLM: the answer is exactly one of these strings.",
        json_schema_extra=_CHOICES_SCHEMA,
    )
    guided_grammar: str | None = Field(
        default=None, description="vLLM: the answer follows this grammar (Lark or GBNF)."
    )
    structured_outputs: StructuredOutputs | None = Field(
        default=None, description="vLLM's newer spelling of the guided_* fields."
    )
    json_schema: dict[str, Any] | None = Field(
        default=None, description="llama.cpp: the answer is JSON valid under this JSON Schema."
    )
    grammar: str | None = Field(
        default=None, description="llama.cpp: the answer follows this GBNF (or Lark) grammar."
    )

    @field_validator("guided_choice")
    @classmethod
    def _check_choice(cls, value: list[str] | None) -> list[str] | None:
        return _choices(value)

    @field_validator("guided_json")
    @classmethod
    def _check_json(cls, value: dict[str, Any] | str | None) -> dict[str, Any] | None:
        return _schema(value)

    def output_spec(self, response_format: ResponseFormat | None) -> OutputSpec | None:
        """The one constraint the request puts on its answer; None: free text. Two of them
        (say `response_format` and `guided_regex`) are refused: which should win is not clear."""
        specs = [
            spec
            for spec in (
                _from_response_format(response_format),
                *self._guided_specs(),
                *_from_structured(self.structured_outputs),
            )
            if spec is not None
        ]
        if len(specs) > 1:
            raise InvalidRequest(
                f"'{specs[1].param}' cannot be combined with '{specs[0].param}': send one "
                "constraint on the answer.",
                param=specs[1].param,
            )
        return specs[0] if specs else None

    def _guided_specs(self) -> list[OutputSpec | None]:
        def make(kind: OutputKind, value: Any, param: str) -> OutputSpec | None:
            return None if value is None else OutputSpec(kind, value, param)

        return [
            make("json", self.guided_json, "guided_json"),
            make("regex", self.guided_regex, "guided_regex"),
            make("choice", self.guided_choice, "guided_choice"),
            make("grammar", self.guided_grammar, "guided_grammar"),
            make("json", self.json_schema, "json_schema"),
            make("grammar", self.grammar, "grammar"),
        ]


def _from_response_format(fmt: ResponseFormat | None) -> OutputSpec | None:
    schema = fmt.enforced_schema if fmt else None
    return None if schema is None else OutputSpec("json", schema, "response_format")


def _from_structured(outputs: StructuredOutputs | None) -> list[OutputSpec]:
    if outputs is None:
        return []
    closed = outputs.disable_additional_properties is not False
    param = "structured_outputs"
    found: tuple[tuple[OutputKind, str, Any], ...] = (
        ("json", "json", outputs.json_),
        ("regex", "regex", outputs.regex),
        ("choice", "choice", outputs.choice),
        ("grammar", "grammar", outputs.grammar),
        ("json", "json_object", {"type": "object"} if outputs.json_object else None),
    )
    return [
        OutputSpec(kind, value, f"{param}.{name}", closed)
        for kind, name, value in found
        if value is not None
    ]
