"""The OpenAPI contract: /openapi.json lists what the server sends, and fuzzing holds it to that.

Schemathesis generates valid and invalid requests for every operation from the document, the
app answers them in-process on the tiny model, and each answer is checked against the document:
no 5xx, only documented statuses and content types, bodies that match their schemas, and every
error in OpenAI's shape.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from jsonschema import Draft202012Validator

from hotlora.config.settings import Settings
from hotlora.server.app import create_app

from tests.support.adapter_builders import random_pairs, tiny_model, write_mlx_adapter

ERROR_KEYS = {"message", "type", "param", "code"}
POST_ERRORS = {"400", "401", "404", "408", "413", "415", "503"}
INFERENCE_ERRORS = POST_ERRORS | {"429"}  # a tenant's limits hold on every inference route
ADMIN_POST = {"201", "200", "400", "401", "403", "404", "408", "409", "413", "415", "503"}
# Every operation and the statuses it can answer with.
STATUSES = {
    ("get", "/health"): {"200"},
    ("get", "/ready"): {"200", "503"},
    ("get", "/v1/models"): {"200", "401", "429", "503"},
    ("get", "/v1/models/{model_id}"): {"200", "401", "404", "429", "503"},
    ("post", "/v1/chat/completions"): {"200", "500"} | INFERENCE_ERRORS,
    ("post", "/v1/completions"): {"200", "500"} | INFERENCE_ERRORS,
    ("post", "/v1/responses"): {"200", "500"} | INFERENCE_ERRORS,
    ("get", "/v1/adapters"): {"200", "401", "403", "503"},
    ("get", "/v1/adapter_root"): {"200", "401", "403", "503"},
    ("post", "/v1/adapters"): ADMIN_POST,
    ("get", "/v1/adapters/{adapter_id}"): {"200", "401", "403", "404", "503"},
    ("delete", "/v1/adapters/{adapter_id}"): {"200", "401", "403", "404", "503"},
    ("post", "/v1/load_lora_adapter"): ADMIN_POST - {"201"},
    ("post", "/v1/unload_lora_adapter"): {"200", "403"} | POST_ERRORS,
    ("post", "/v1/embeddings"): {"200"} | INFERENCE_ERRORS,
    ("post", "/tokenize"): {"200"} | INFERENCE_ERRORS,
    ("post", "/detokenize"): {"200"} | INFERENCE_ERRORS,
    ("get", "/version"): {"200"},
    ("get", "/v1/usage"): {"200", "401", "403"},
}
STREAMED = {"/v1/chat/completions": "ChatCompletionChunk", "/v1/completions": "CompletionResponse"}

# Bounded and reproducible: a fixed number of examples per operation, derandomized, and
# generation kept short by the app's settings (`small_app`). Fuzzed models, adapter ids, paths
# and lengths often take values that exist or fit, so requests also get past the lookups and
# limits to generation.
CONFIG = schemathesis.Config.from_dict(
    {
        "generation": {"mode": "all", "max-examples": 25, "deterministic": True},
        "phases": {"coverage": {"enabled": True}},
        # A failure's report shows the request as sent (`max_tokens` is no secret).
        "output": {"sanitization": {"enabled": False}},
        "checks": {
            "enabled": False,
            "not_a_server_error": {"enabled": True},
            "status_code_conformance": {"enabled": True},
            "content_type_conformance": {"enabled": True},
            "response_schema_conformance": {"enabled": True},
            "response_headers_conformance": {"enabled": True},
            "unsupported_method": {"enabled": True},
        },
        "dictionaries": {
            "models": {"values": ["tiny", "a", "tiny:a"]},
            "adapters": {"values": ["a", "b"]},
            "lengths": {"values": [1, 2, 8]},
        },
        "parameters": {
            "body.model": {"dictionary": "models", "probability": 0.8},
            "path.model_id": {"dictionary": "models", "probability": 0.5},
            "path.adapter_id": {"dictionary": "adapters", "probability": 0.5},
            "body.id": {"dictionary": "adapters", "probability": 0.5},
            "body.lora_name": {"dictionary": "adapters", "probability": 0.5},
            "body.path": {"dictionary": "adapters", "probability": 0.5},
            "body.lora_path": {"dictionary": "adapters", "probability": 0.5},
            "body.max_tokens": {"dictionary": "lengths", "probability": 0.8},
            "body.max_completion_tokens": {"dictionary": "lengths", "probability": 0.8},
            "body.n": {"dictionary": "lengths", "probability": 0.8},
        },
    }
)


@pytest.fixture
def small_app(make_client: Callable[..., TestClient], tmp_path: Path) -> TestClient:
    """The app with short generations and adapter `a` mounted (`b` lies ready to mount)."""
    root = tmp_path / "adapters"
    model = tiny_model(quantize=True)
    write_mlx_adapter(root / "a", random_pairs(model, seed=1))
    write_mlx_adapter(root / "b", random_pairs(model, seed=2))
    return make_client(
        raise_server_exceptions=False,
        max_tokens_limit=8,
        default_max_tokens=4,
        max_n=2,
        adapter_root=root,
        startup_adapters={"a": "a"},
    )


def openai_error_shape(
    ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case
) -> None:
    """Every non-2xx body is `{"error": {"message", "type", "param", "code"}}`."""
    if 200 <= response.status_code < 300:
        return
    error = response.json().get("error")
    assert isinstance(error, dict) and set(error) == ERROR_KEYS, response.text
    assert isinstance(error["message"], str) and isinstance(error["type"], str), response.text


def send(client: TestClient, case: schemathesis.Case) -> httpx.Response:
    """Send `case` through the app's test client, its JSON body encoded as `requests` does."""
    request = case.as_transport_kwargs()
    if "json" in request:
        request["data"] = json.dumps(request.pop("json")).encode()
    return client.request(
        request["method"],
        request["url"],
        params=request["params"],
        headers=request["headers"],
        content=request.get("data"),
    )


# The document needs no model: an app that never starts serves it. (Loading the schema from a
# fixture would be the usual way; schemathesis's fixture loader does not run on pytest 9.2.)
schema = schemathesis.openapi.from_dict(create_app(Settings()).openapi(), config=CONFIG)


@schema.parametrize()
# One app per operation: its examples run one after another on it, state and all.
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_fuzzed_requests_get_documented_answers(case: schemathesis.Case, small_app: TestClient):
    case.validate_response(send(small_app, case), additional_checks=[openai_error_shape])


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 4}
STREAM = {"stream": True, "stream_options": {"include_usage": True}}
# Answers fuzzing seldom reaches, in order on one app: (method, path, case fields, status).
SCENARIO = [
    ("POST", "/v1/chat/completions", {"body": CHAT}, 200),
    ("POST", "/v1/chat/completions", {"body": {**CHAT, **STREAM, "logprobs": True}}, 200),
    ("POST", "/v1/completions", {"body": {"model": "a", "prompt": "the", "logprobs": 2}}, 200),
    ("POST", "/v1/completions", {"body": {"model": "tiny:a", "prompt": "the", **STREAM}}, 200),
    ("POST", "/v1/adapters", {"body": {"id": "b", "path": "b"}}, 201),
    ("POST", "/v1/adapters", {"body": {"id": "b", "path": "b"}}, 200),
    ("POST", "/v1/adapters", {"body": {"id": "b", "path": "a"}}, 409),
    ("GET", "/v1/models/{model_id}", {"path_parameters": {"model_id": "b"}}, 200),
    ("DELETE", "/v1/adapters/{adapter_id}", {"path_parameters": {"adapter_id": "b"}}, 200),
    ("GET", "/v1/adapters/{adapter_id}", {"path_parameters": {"adapter_id": "b"}}, 404),
    ("POST", "/v1/chat/completions", {"body": {**CHAT, "model": "b"}}, 404),
]


def test_rarely_fuzzed_answers_match_the_document(small_app: TestClient):
    for method, path, fields, status in SCENARIO:
        case = schema[path][method].Case(**fields)
        response = send(small_app, case)
        assert response.status_code == status, (method, path, fields, response.text)
        case.validate_response(response, additional_checks=[openai_error_shape])


def test_401s_match_the_document(make_client: Callable[..., TestClient]):
    keyed = make_client(api_key="secret", raise_server_exceptions=False)
    for (method, path), statuses in STATUSES.items():
        if "401" not in statuses:
            continue
        body = {"body": {}} if method == "post" else {}
        case = schema[path][method].Case(
            path_parameters={"model_id": "tiny", "adapter_id": "a"}, **body
        )
        response = send(keyed, case)
        assert response.status_code == 401, (method, path, response.text)
        case.validate_response(response, additional_checks=[openai_error_shape])


def test_403s_match_the_document(make_client: Callable[..., TestClient]):
    """An inference key on every operation the document says may answer 403: each does."""
    keyed = make_client(api_key="user", admin_api_key="admin", raise_server_exceptions=False)
    forbidden = [op for op, statuses in STATUSES.items() if "403" in statuses]
    assert len(forbidden) == 8
    for method, path in forbidden:
        body = {"body": {}} if method == "post" else {}
        case = schema[path][method].Case(
            path_parameters={"model_id": "tiny", "adapter_id": "a"},
            headers={"Authorization": "Bearer user"},
            **body,
        )
        response = send(keyed, case)
        assert response.status_code == 403, (method, path, response.text)
        case.validate_response(response, additional_checks=[openai_error_shape])


@pytest.fixture
def document(client: TestClient) -> dict[str, Any]:
    return client.get("/openapi.json").json()


def test_no_422_anywhere(document: dict[str, Any]):
    text = json.dumps(document)
    assert '"422"' not in text
    assert "ValidationError" not in text


def test_each_route_lists_the_statuses_it_sends(document: dict[str, Any]):
    listed = {
        (method, path): set(operation["responses"])
        for path, operations in document["paths"].items()
        for method, operation in operations.items()
    }
    assert listed == STATUSES
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, operations in document["paths"].items():
        for operation in operations.values():
            for status, response in operation["responses"].items():
                if int(status) >= 400:
                    assert response["content"] == {"application/json": {"schema": error}}, path
    details = document["components"]["schemas"]["ErrorDetail"]
    assert set(details["required"]) == set(details["properties"]) == ERROR_KEYS


@pytest.mark.parametrize("path", sorted(STREAMED))
def test_completions_document_the_object_and_the_event_stream(document: dict[str, Any], path: str):
    content = document["paths"][path]["post"]["responses"]["200"]["content"]
    assert set(content) == {"application/json", "text/event-stream"}
    data = content["text/event-stream"]["schema"]["properties"]["data"]
    assert {"const": "[DONE]"} in data["anyOf"]
    assert f"schemas/{STREAMED[path]}" in json.dumps(data)


@pytest.mark.parametrize("path", sorted({path for _, path in STATUSES}))
def test_405_names_the_allowed_methods(client: TestClient, path: str):
    allowed = {method.upper() for method, documented in STATUSES if documented == path}
    if path in ("/health", "/ready"):
        allowed.add("HEAD")  # for probes, left out of the document
    concrete = path.replace("{model_id}", "tiny").replace("{adapter_id}", "a")
    response = client.request("PATCH", concrete)
    assert response.status_code == 405
    assert set(response.headers["allow"].replace(" ", "").split(",")) == allowed
    assert set(response.json()["error"]) == ERROR_KEYS


# Bodies the server refuses: the document must not call them valid. (path, body)
REFUSED = [
    ("/v1/adapters", {"id": "", "path": "b"}),
    ("/v1/adapters", {"id": "a" * 65, "path": "b"}),
    ("/v1/adapters", {"id": "a+b", "path": "b"}),
    ("/v1/adapters", {"id": "..", "path": "b"}),
    ("/v1/adapters", {"id": "None", "path": "b"}),
    ("/v1/load_lora_adapter", {"lora_name": "", "lora_path": "b"}),
    ("/v1/load_lora_adapter", {"lora_name": ".", "lora_path": "b"}),
    ("/v1/unload_lora_adapter", {"lora_name": ""}),
    ("/v1/completions", {"model": "tiny", "prompt": ""}),
    ("/v1/completions", {"model": "tiny", "prompt": []}),
    ("/v1/completions", {"model": "tiny", "prompt": ["the", ""]}),
    ("/v1/completions", {"model": "tiny", "prompt": [[5], []]}),
    ("/v1/completions", {"model": "tiny", "prompt": "the", "max_tokens": "3"}),
    ("/v1/chat/completions", {**CHAT, "messages": []}),
    ("/v1/chat/completions", {**CHAT, "stream": "true"}),
    ("/v1/completions", {"model": "tiny", "prompt": "0", "guided_choice": []}),
    ("/v1/completions", {"model": "tiny", "prompt": "0", "guided_choice": ["a", ""]}),
    ("/v1/completions", {"model": "tiny", "prompt": "0", "guided_choice": ["a"] * 257}),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"choice": []}}),
]


def request_schema(document: dict[str, Any], path: str) -> Draft202012Validator:
    """A validator for `path`'s POST body as the document describes it."""
    content = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    return Draft202012Validator({**content["schema"], "components": document["components"]})


@pytest.mark.parametrize(("path", "body"), REFUSED)
def test_what_the_server_refuses_the_document_does_not_allow(
    small_app: TestClient, document: dict[str, Any], path: str, body: dict[str, Any]
):
    response = small_app.post(path, json=body)
    assert response.status_code in (400, 404), response.text
    assert not request_schema(document, path).is_valid(body)


# Their neighbours that the server takes: the document allows them too.
SERVED = [
    ("/v1/adapters", {"id": "...", "path": "b"}),
    ("/v1/adapters", {"id": "b" * 64, "path": "b"}),
    ("/v1/completions", {"model": "tiny", "prompt": " ", "max_tokens": 1}),
    ("/v1/completions", {"model": "tiny", "prompt": [[5], [6, 7]], "max_tokens": 1}),
    ("/v1/completions", {"model": "tiny", "prompt": "0", "max_tokens": 1, "guided_choice": ["a"]}),
    # null for a defaulted field is that default, as the SDKs send an argument left None.
    ("/v1/chat/completions", {**CHAT, "max_tokens": 1, "stream": None, "n": None}),
    ("/tokenize", {"model": "tiny", "prompt": "x", "return_token_strs": None}),
]


@pytest.mark.parametrize(("path", "body"), SERVED)
def test_what_the_server_takes_the_document_allows(
    small_app: TestClient, document: dict[str, Any], path: str, body: dict[str, Any]
):
    response = small_app.post(path, json=body)
    assert response.status_code in (200, 201), response.text
    assert request_schema(document, path).is_valid(body)
