"""The access log: one line per request on `hotlora.access`, with what its generation did.

The request-id middleware opens a `RequestRecord` for each request; the inference service fills
in the generation facts and the error mapping the refusal's code, from whatever task runs them
(a stream's generator runs in a task of its own, which shares the record through the context).
Neither headers nor bodies are read here: keys and prompts never reach the log, and the text line
escapes what the client wrote (`printable`).
"""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import Any

from starlette.types import Scope

from hotlora.config.log_text import printable

access_log = logging.getLogger("hotlora.access")


CLIENT_CLOSED_REQUEST = 499
"""The status logged for a client that left before its response was ready (nginx's)."""


@dataclass
class RequestRecord:
    """What one HTTP request did, filled in while it is answered."""

    request_id: str
    began: float = field(default_factory=time.perf_counter)  # on the perf_counter clock
    tenant: str | None = None  # whose key the request came with (`default`: no keys configured)
    model: str | None = None  # the model the answer names: base, adapter id or base:spec
    adapters: tuple[str, ...] | None = None  # the adapter ids applied; () for the base alone
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    ttft: float | None = None  # seconds from arrival to the first generated token
    finish_reason: str | None = None  # per choice, comma-separated when n > 1
    error: str | None = None  # the error code the response (or a stream's error event) carried


_current: ContextVar[RequestRecord | None] = ContextVar("hotlora_request_record", default=None)


def open_record(request_id: str) -> tuple[RequestRecord, Token[RequestRecord | None]]:
    """Start recording a request in this context; `close_record(token)` when it is answered."""
    record = RequestRecord(request_id)
    return record, _current.set(record)


def close_record(token: Token[RequestRecord | None]) -> None:
    _current.reset(token)


def current_record() -> RequestRecord | None:
    """The record of the request being answered in this context; None outside a request."""
    return _current.get()


def note_error(code: str) -> None:
    """Name the error the current request is answered with (the last one named wins)."""
    record = _current.get()
    if record is not None:
        record.error = code


def log_request(scope: Scope, status: int | None, record: RequestRecord) -> None:
    """The request's access-log line: readable text, with every fact also as a record field
    (`fields`) for the JSON formatter."""
    route = scope.get("route")
    fields: dict[str, Any] = {
        "request_id": record.request_id,
        "method": scope["method"],
        "path": scope["path"],
        "route": getattr(route, "path", None),
        "status": status,
        "duration_ms": _ms(time.perf_counter() - record.began),
        "tenant": record.tenant,
        "model": record.model,
        "adapters": list(record.adapters) if record.adapters is not None else None,
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
        "cached_tokens": record.cached_tokens,
        "ttft_ms": _ms(record.ttft) if record.ttft is not None else None,
        "finish_reason": record.finish_reason,
        "error": record.error,
    }
    # The path, the model and the adapter ids are the client's text.
    access_log.info("%s", printable(_text(fields)), extra={"fields": fields})


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def _text(f: dict[str, Any]) -> str:
    """`POST /v1/chat/completions 200 12.3ms id=... model=... prompt=5 ...`: the known facts."""
    parts = [f"{f['method']} {f['path']} {f['status'] or '-'} {f['duration_ms']}ms"]
    parts.append(f"id={f['request_id']}")
    if f["tenant"] is not None:
        parts.append(f"tenant={f['tenant']}")
    if f["model"] is not None:
        parts.append(f"model={f['model']}")
    if f["adapters"]:
        parts.append(f"adapters={'+'.join(f['adapters'])}")
    if f["prompt_tokens"] is not None:
        parts.append(f"prompt={f['prompt_tokens']}")
        if f["completion_tokens"] is not None:  # embeddings generate nothing
            parts.append(f"completion={f['completion_tokens']}")
        if f["cached_tokens"] is not None:  # embeddings cache nothing
            parts.append(f"cached={f['cached_tokens']}")
    if f["ttft_ms"] is not None:
        parts.append(f"ttft={f['ttft_ms']}ms")
    if f["finish_reason"] is not None:
        parts.append(f"finish={f['finish_reason']}")
    if f["error"] is not None:
        parts.append(f"error={f['error']}")
    return " ".join(parts)
