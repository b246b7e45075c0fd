"""Every error a client can meet, as it travels: status, OpenAI type, param, code and headers."""

from __future__ import annotations

import json

import pytest

from hotlora.adapters import (
    AdapterConflict,
    AdapterNotFound,
    AdapterPathRefused,
    InvalidAdapter,
    InvalidAdapterSpec,
)
from hotlora.config.errors import HotloraError, InvalidRequest, ModelNotFound
from hotlora.server.engine import QueueFull
from hotlora.server.http.error_responses import error_response
from hotlora.server.http.request_errors import (
    ClientDisconnected,
    ContextOverflow,
    NotReady,
    Unauthorized,
)

WIRE = [
    # (exception, status, type, param, code, headers)
    (InvalidRequest("no", param="n"), 400, "invalid_request_error", "n", "invalid_value", {}),
    (ContextOverflow("long", param="messages"), 400, "invalid_request_error", "messages",
     "context_length_exceeded", {}),
    (ModelNotFound("x", ["tiny"]), 404, "invalid_request_error", "model", "model_not_found", {}),
    (InvalidAdapter("bad", param="path"), 400, "invalid_request_error", "path", "invalid_adapter",
     {}),
    (AdapterPathRefused("out"), 400, "invalid_request_error", "path", "adapter_path_refused", {}),
    (InvalidAdapterSpec("spec"), 400, "invalid_request_error", "adapter", "invalid_adapter_spec",
     {}),
    (AdapterNotFound("x", ["a"]), 404, "not_found_error", "adapter", "adapter_not_found", {}),
    (AdapterConflict("mounted"), 409, "conflict_error", "id", "adapter_conflict", {}),
    (Unauthorized("key"), 401, "authentication_error", None, "invalid_api_key",
     {"www-authenticate": "Bearer"}),
    (ClientDisconnected("gone"), 499, "client_closed_request", None, None, {}),
    (NotReady("loading"), 503, "service_unavailable", None, "model_not_ready",
     {"retry-after": "5"}),
    (QueueFull("busy"), 503, "service_unavailable", None, "queue_full", {"retry-after": "1"}),
]  # fmt: skip


@pytest.mark.parametrize(
    ("exc", "status", "type_", "param", "code", "headers"),
    WIRE,
    ids=[type(row[0]).__name__ for row in WIRE],
)
def test_each_error_keeps_its_wire_form(exc, status, type_, param, code, headers):
    response = error_response(exc)
    assert response.status_code == status
    body = json.loads(bytes(response.body))
    assert body == {"error": {"message": exc.message, "type": type_, "param": param, "code": code}}
    for name, value in headers.items():
        assert response.headers[name] == value


@pytest.mark.parametrize("exc", [RuntimeError("/secret"), HotloraError("/secret unmapped")])
def test_anything_else_is_a_500_without_details(exc):
    response = error_response(exc)
    assert response.status_code == 500
    assert "/secret" not in bytes(response.body).decode()
