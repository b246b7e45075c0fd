"""OpenAI's published answer schemas (`answers.json`, trimmed from openai/openai-openapi by
`extract.py`), as JSON Schema validators, with the places the document is stricter than
OpenAI's own answers allowed by name."""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator, ValidationError

SOURCE = Path(__file__).with_name("answers.json")
PREFIX = "#/components/schemas/"


def _null_allowed(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _nullable(node: Any) -> Any:
    """OpenAPI 3.0's `nullable: true` (still in the 3.1 document) as a JSON Schema null branch."""
    if isinstance(node, list):
        return [_nullable(value) for value in node]
    if not isinstance(node, dict):
        return node
    node = {key: _nullable(value) for key, value in node.items()}
    if node.pop("nullable", False):
        return _null_allowed(node)
    return node


@functools.cache
def schemas() -> dict[str, Any]:
    """Every vendored schema by name, `nullable` turned into JSON Schema."""
    return _nullable(json.loads(SOURCE.read_text(encoding="utf-8"))["schemas"])


def source() -> dict[str, Any]:
    """Where the schemas came from: repository, commit, file, the document's version."""
    return dict(json.loads(SOURCE.read_text(encoding="utf-8"))["source"])


# Where the document is stricter than OpenAI's own answers, each allowed only where named.
def _base64_embedding(found: dict[str, Any]) -> None:
    """`encoding_format: "base64"` answers each embedding as a base64 string."""
    embedding = found["Embedding"]["properties"]
    embedding["embedding"] = {"anyOf": [embedding["embedding"], {"type": "string"}]}


def _streamed_finish_reason(found: dict[str, Any]) -> None:
    """A streamed text completion's chunks have `finish_reason: null` until the last."""
    choice = found["CreateCompletionResponse"]["properties"]["choices"]["items"]["properties"]
    choice["finish_reason"] = _null_allowed(choice["finish_reason"])


def _usage_in_progress(found: dict[str, Any]) -> None:
    """A response not yet finished (`response.created`, `response.in_progress`) has no usage."""
    [own] = [part for part in found["Response"]["allOf"] if "usage" in part.get("properties", {})]
    own["properties"]["usage"] = _null_allowed(own["properties"]["usage"])


def _echoed_first_token(found: dict[str, Any]) -> None:
    """An echoed prompt's first token has no log-probability (nothing comes before it): its
    `token_logprobs` and `top_logprobs` entries are null, as OpenAI's legacy completions sent
    them and lm-evaluation-harness reads them."""
    choice = found["CreateCompletionResponse"]["properties"]["choices"]["items"]["properties"]
    [logprobs] = [b for b in choice["logprobs"]["anyOf"] if b.get("type") == "object"]
    for key in ("token_logprobs", "top_logprobs"):
        logprobs["properties"][key]["items"] = _null_allowed(logprobs["properties"][key]["items"])


EXCEPTIONS: dict[str, Callable[[dict[str, Any]], None]] = {
    "base64_embedding": _base64_embedding,
    "streamed_finish_reason": _streamed_finish_reason,
    "usage_in_progress": _usage_in_progress,
    "echoed_first_token": _echoed_first_token,
}


@functools.cache
def validator(name: str, allow: frozenset[str] = frozenset()) -> Draft202012Validator:
    """A validator for the schema `name`, with the named `EXCEPTIONS` allowed."""
    found = copy.deepcopy(schemas())
    for exception in sorted(allow):
        EXCEPTIONS[exception](found)
    return Draft202012Validator({"$ref": PREFIX + name, "components": {"schemas": found}})


@functools.cache
def stream_event_schemas() -> dict[str, str]:
    """Each Responses stream event's `type` and the name of its schema."""
    named: dict[str, str] = {}
    for branch in schemas()["ResponseStreamEvent"]["anyOf"]:
        name = branch["$ref"].removeprefix(PREFIX)
        for kind in schemas()[name]["properties"]["type"]["enum"]:
            named[kind] = name
    return named


def _leaves(error: ValidationError) -> list[ValidationError]:
    """The errors under an `anyOf`/`oneOf` error, its branches' own; a branch that only says
    the value is not null is left out when another says more."""
    if not error.context:
        return [error]
    found = [leaf for branch in error.context for leaf in _leaves(branch)]
    telling = [leaf for leaf in found if leaf.validator != "type" or leaf.validator_value != "null"]
    return telling or found


def problems(name: str, body: Any, allow: frozenset[str] = frozenset()) -> list[str]:
    """Where `body` breaks the schema `name`: one line per error, its JSON path first (in a
    union, each branch's)."""
    return [
        f"{leaf.json_path}: {leaf.message}"
        for error in validator(name, allow).iter_errors(body)
        for leaf in _leaves(error)
    ]
