"""The base of every request model: strict numbers and booleans, and valid Unicode throughout."""

from __future__ import annotations

import logging
import re
from functools import cache
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, GetJsonSchemaHandler, field_validator, model_validator
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from hotlora.config.errors import InvalidRequest
from hotlora.config.log_text import printable

log = logging.getLogger("hotlora")

_SURROGATE = re.compile("[\ud800-\udfff]")
MAX_JSON_DEPTH = 64


class OpenAIBase(BaseModel):
    # Fields a model does not declare are dropped here; each request body checks its own first
    # (`field_support`), and the objects inside a request are `ClosedObject`s, so that none is
    # ignored without a word. NaN and infinities are
    # refused wherever a number is read. Request fields are typed `StrictInt`, `StrictFloat` and
    # `StrictBool`: as OpenAI does, "3", true and 3.5 are refused where an integer goes, and
    # "0.5" and true where a number does, never converted.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        # null for a field whose default is a value (`n`, `stream`, `echo`) stands for that
        # value, as OpenAI's nullable fields take it and its SDKs send an argument left None; a
        # field whose default is null takes it as it is, and a required one refuses it by type.
        if not isinstance(data, dict):
            return data
        defaulted = _defaulted_keys(cls)
        return {k: v for k, v in data.items() if v is not None or k not in defaulted}

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        # The document says what `_null_is_the_default` takes: null, for a defaulted field.
        schema = handler(core_schema)
        properties = handler.resolve_ref_schema(schema).get("properties", {})
        for key in _defaulted_keys(cls) & properties.keys():
            field = properties[key]
            if _takes_null(field):
                continue
            shown = {k: field.pop(k) for k in ("title", "description", "default") if k in field}
            properties[key] = {"anyOf": [field, {"type": "null"}], **shown}
        return schema


def _takes_null(field: dict[str, Any]) -> bool:
    return field.get("type") == "null" or any(
        option.get("type") == "null" for option in field.get("anyOf", ())
    )


@cache
def _defaulted_keys(model: type[BaseModel]) -> frozenset[str]:
    """The keys of `model`'s fields that have a default other than null."""
    return frozenset(
        key
        for name, field in model.model_fields.items()
        if not field.is_required() and field.default is not None
        for key in (name, field.alias or name)
    )


class ClosedObject(OpenAIBase):
    """An object inside a request (a message, a tool, `stream_options`): a key it does not
    declare is a 400 naming its dotted path (`stream_options.include_usag`), never dropped.

    `tolerated` lists keys that clients are known to send back with an earlier answer (an
    assistant message's `refusal` or `annotations`) and that have no effect here: they are
    accepted, and logged once per name when they hold a value.
    """

    model_config = ConfigDict(extra="forbid")
    tolerated: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _drop_tolerated(cls, data: Any) -> Any:
        if not cls.tolerated or not isinstance(data, dict):
            return data
        kept = {}
        for key, value in data.items():
            if key not in cls.tolerated:
                kept[key] = value
            elif value not in (None, [], {}, "") and (cls.__name__, key) not in _noted:
                _noted.add((cls.__name__, key))
                log.warning(
                    "%s key %r is accepted with no effect (logged once per key)",
                    cls.__name__,
                    printable(key),
                )
        return kept


_noted: set[tuple[str, str]] = set()


def unknown_key_message(param: str | None) -> str:
    """What a 400 says of a key that no object of the request declares."""
    return (
        f"Unrecognized request argument supplied: '{param}'; this server does not know it, so "
        "it would have no effect."
    )


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


MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


class RequestMetadata(OpenAIBase):
    """OpenAI's fields about a request rather than its answer (`field_support.METADATA`): typed
    and bounded as OpenAI's schema has them on every endpoint that takes them, with no effect on
    the answer (a response object echoes its `metadata`)."""

    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None

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
