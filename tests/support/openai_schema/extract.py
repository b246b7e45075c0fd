"""Trim OpenAI's OpenAPI document to the answer schemas this server's tests validate against.

Reads `openapi.json` from the public repository openai/openai-openapi and writes
`answers.json` beside this file: the schemas named in `ROOTS` and every schema they reference,
each as the document writes it less its prose (`description`, `title`, `example(s)`, `x-*`).
Nothing else is changed; `load` in this package turns OpenAPI's `nullable` into JSON Schema.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# What the OpenAI routes answer: chat (whole, chunk), legacy completions (whole and chunk),
# embeddings, models, Responses (the object and every stream event), errors.
ROOTS = (
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionResponse",
    "CreateEmbeddingResponse",
    "ListModelsResponse",
    "Model",
    "Response",
    "ResponseStreamEvent",
    "ErrorResponse",
)
PROSE = frozenset({"description", "title", "example", "examples"})
OUT = Path(__file__).with_name("answers.json")
PREFIX = "#/components/schemas/"


def _without_prose(node: Any) -> Any:
    if isinstance(node, dict):
        return {
            key: _without_prose(value)
            for key, value in node.items()
            if key not in PROSE and not key.startswith("x-")
        }
    if isinstance(node, list):
        return [_without_prose(value) for value in node]
    return node


def _refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"].removeprefix(PREFIX)} if isinstance(node.get("$ref"), str) else set()
        return found.union(*(_refs(value) for value in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(value) for value in node))
    return set()


def trimmed(document: dict[str, Any], roots: tuple[str, ...] = ROOTS) -> dict[str, Any]:
    """`roots` and the schemas they reach, prose dropped, keyed by name."""
    schemas = document["components"]["schemas"]
    kept: dict[str, Any] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name not in kept:
            kept[name] = _without_prose(schemas[name])
            todo.extend(_refs(kept[name]))
    return dict(sorted(kept.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("openapi", type=Path, help="openapi.json of openai/openai-openapi")
    parser.add_argument("--commit", required=True, help="the commit the file was taken from")
    parser.add_argument(
        "--out", type=Path, default=OUT, help="where to write (default: %(default)s)"
    )
    args = parser.parse_args()
    document = json.loads(args.openapi.read_text(encoding="utf-8"))
    body = {
        "source": {
            "repository": "openai/openai-openapi",
            "commit": args.commit,
            "file": args.openapi.name,
            "openapi": document["openapi"],
            "version": document["info"]["version"],
            "roots": list(ROOTS),
        },
        "schemas": trimmed(document),
    }
    args.out.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"{len(body['schemas'])} schemas written to {args.out}")


if __name__ == "__main__":
    main()
