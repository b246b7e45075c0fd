"""The OpenAPI document as the server behaves: its real error statuses and the stream type.

FastAPI documents a 422 the error handlers never send, and nothing else that can go wrong;
`install_openapi` rewrites its output once: every error status in OpenAI's error object,
the 200 of a mount that changed nothing, and the event stream of `stream: true`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from hotlora.server.api.completion_answers import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
)
from hotlora.server.routes import paths


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every non-2xx response (and of a stream's error event)."""

    error: ErrorDetail


_REF = "#/components/schemas/{model}"

_ADMIN_POST = (400, 401, 403, 404, 408, 409, 413, 415, 503)
# The error statuses each operation can answer with; 405 and unknown routes are not operations.
# Every inference route counts against its key's limits (429).
ERROR_STATUSES: Mapping[tuple[str, str], tuple[int, ...]] = {
    ("get", "/health"): (),
    ("get", "/ready"): (503,),
    ("get", paths.MODELS): (401, 429, 503),
    ("get", f"{paths.MODELS}/{{model_id}}"): (401, 404, 429, 503),
    ("post", paths.CHAT_COMPLETIONS): (400, 401, 404, 408, 413, 415, 429, 500, 503),
    ("post", paths.COMPLETIONS): (400, 401, 404, 408, 413, 415, 429, 500, 503),
    ("post", paths.RESPONSES): (400, 401, 404, 408, 413, 415, 429, 500, 503),
    ("post", paths.EMBEDDINGS): (400, 401, 404, 408, 413, 415, 429, 503),
    ("post", paths.TOKENIZE): (400, 401, 404, 408, 413, 415, 429, 503),
    ("post", paths.DETOKENIZE): (400, 401, 404, 408, 413, 415, 429, 503),
    ("get", paths.VERSION): (),
    ("post", paths.ADAPTERS): _ADMIN_POST,
    ("get", paths.ADAPTERS): (401, 403, 503),
    ("get", paths.ADAPTER_ROOT): (401, 403, 503),
    ("get", f"{paths.ADAPTERS}/{{adapter_id}}"): (401, 403, 404, 503),
    ("delete", f"{paths.ADAPTERS}/{{adapter_id}}"): (401, 403, 404, 503),
    ("post", paths.LOAD_LORA_ADAPTER): _ADMIN_POST,
    ("post", paths.UNLOAD_LORA_ADAPTER): (400, 401, 403, 404, 408, 413, 415, 503),
    ("get", paths.USAGE): (401, 403),
}

_DESCRIPTIONS = {
    400: "Invalid request: unparsable JSON, a field out of range, or an unsupported option.",
    401: "Missing or wrong bearer key.",
    403: "A valid bearer key whose tenant may not use this route (an inference key here).",
    404: "Unknown model or adapter, or one outside the key's scope.",
    409: "Another adapter is mounted under this id; mount with `replace` to swap it.",
    413: "The request body is over the server's limit.",
    408: "The request was not received in full within the server's request timeout.",
    415: "The body was sent as another media type than `application/json`, or compressed.",
    429: "A limit of the key's tenant is reached (requests or tokens a minute, requests at once).",
    500: "The model computed NaN or infinite logits for this request (`non_finite_logits`).",
    503: "The model is loading, the wait list is full, or the server is shutting down.",
}
_HEADERS = {
    401: {"WWW-Authenticate": {"schema": {"type": "string"}, "description": "`Bearer`."}},
    429: {"Retry-After": {"schema": {"type": "string"}, "description": "Seconds to wait."}},
    503: {"Retry-After": {"schema": {"type": "string"}, "description": "Seconds to wait."}},
}

# The completion routes: the object answered without `stream`, the chunk streamed with it.
_STREAMS = {
    paths.CHAT_COMPLETIONS: (ChatCompletionResponse, ChatCompletionChunk),
    paths.COMPLETIONS: (CompletionResponse, CompletionResponse),
}
# A mount that finds the same files already mounted answers 200 instead of 201.
_MOUNTS = (paths.ADAPTERS,)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _error(status: int) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": _DESCRIPTIONS[status],
        "content": {"application/json": {"schema": _ref(ErrorResponse)}},
    }
    if status in _HEADERS:
        response["headers"] = _HEADERS[status]
    return response


def _event_stream(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event, as OpenAPI 3.1 describes each event of a `text/event-stream`."""
    payload = {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "type": "string",
                "anyOf": [
                    {"const": "[DONE]"},
                    {"contentMediaType": "application/json", "contentSchema": payload},
                ],
            }
        },
    }


def _completion_ok(answer: type[BaseModel], chunk: type[BaseModel]) -> dict[str, Any]:
    return {
        "description": (
            f"The completion; with `stream: true`, server-sent events whose data are "
            f"`{chunk.__name__}` objects (an error object if generation fails after the 200), "
            f"then `[DONE]`."
        ),
        "content": {
            "application/json": {"schema": _ref(answer)},
            "text/event-stream": {"schema": _event_stream(chunk)},
        },
    }


def truthful_openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document for `app`, with the responses the server really sends."""
    doc = get_openapi(
        title=app.title,
        version=app.version,
        openapi_version=app.openapi_version,
        description=app.description,
        routes=app.routes,
    )
    models = (ChatCompletionResponse, ChatCompletionChunk, CompletionResponse, ErrorResponse)
    _, defs = models_json_schema([(m, "serialization") for m in models], ref_template=_REF)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(defs["$defs"])
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            responses.pop("422", None)
            if path in _STREAMS:
                responses["200"] = _completion_ok(*_STREAMS[path])
            if path in _MOUNTS and method == "post":
                responses["200"] = {**responses["201"], "description": "Already mounted."}
            for status in ERROR_STATUSES.get((method, path), ()):
                responses[str(status)] = _error(status)
    # The 422 body's schemas, once nothing refers to them (the second is used by the first).
    for name in ("HTTPValidationError", "ValidationError"):
        if json.dumps(_REF.format(model=name)) not in json.dumps(doc):
            schemas.pop(name, None)
    return doc


def install_openapi(app: FastAPI) -> None:
    """Serve `truthful_openapi` at /openapi.json, built on first use and then cached."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = truthful_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
