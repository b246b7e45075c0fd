"""What browser chat pages and SDKs rely on: CORS, `x-request-id`, server-side sampling defaults."""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from hotlora.config.settings import Settings
from hotlora.server.app import create_app
from hotlora.server.engine import SamplingParams
from hotlora.server.http.request_ids import current_request_id
from hotlora.server.serving import InferenceService

from tests.http.conftest import wait_ready
from tests.support.server_process import LOCALHOST
from tests.support.sse import sse_events

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3}
# The tiny model's EOS banned: every choice runs to its max_tokens.
NO_EOS = {"ignore_eos": True}  # runs to max_tokens past every end-of-generation token
GENERATED_ID = re.compile(r"[0-9a-f]{32}")


def preflight(
    client: TestClient, origin: str, path: str = "/v1/chat/completions", method: str = "POST"
):
    return client.options(
        path,
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": method,
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )


def spy_params(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> list[SamplingParams]:
    """The sampling parameters of every request the app submits from now on."""
    service: InferenceService = client.app.state.runtime.inference
    seen: list[SamplingParams] = []
    submit = service.submit

    def spy(prepared, *args, **kwargs):
        seen.append(prepared.params)
        return submit(prepared, *args, **kwargs)

    monkeypatch.setattr(service, "submit", spy)
    return seen


# CORS.

LOOPBACK_PAGES = ["http://localhost:5173", "http://127.0.0.1:8080", "http://[::1]:3000"]
FOREIGN_PAGES = [
    "https://chat.example.com",
    "http://localhost.example.com:5173",
    "http://127.0.0.1.nip.io:8080",
    "https://localhost:5173",
    "null",
]


@pytest.mark.parametrize("origin", [*LOOPBACK_PAGES, "http://localhost"])
def test_preflight_from_a_loopback_page_is_allowed_by_default(client: TestClient, origin):
    response = preflight(client, origin)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == origin
    assert {"POST", "GET", "DELETE", "OPTIONS"} <= set(
        response.headers["access-control-allow-methods"].split(", ")
    )
    assert response.headers["access-control-allow-headers"] == "authorization, content-type"
    assert GENERATED_ID.fullmatch(response.headers["x-request-id"])


@pytest.mark.parametrize("origin", FOREIGN_PAGES)
def test_preflight_from_another_page_is_refused_by_default(client: TestClient, origin):
    response = preflight(client, origin)
    assert response.status_code == 400
    assert "access-control-allow-origin" not in response.headers
    assert "x-request-id" in response.headers


@pytest.mark.parametrize(
    ("path", "method"),
    [
        ("/v1/models", "GET"),
        ("/v1/completions", "POST"),
        ("/v1/adapters/some-id", "DELETE"),
        ("/health", "GET"),
        ("/no/such/route", "GET"),
    ],
)
def test_preflight_is_answered_on_every_route(client: TestClient, path, method):
    response = preflight(client, "http://localhost:3000", path, method)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_preflight_for_a_method_the_api_does_not_use_is_refused(client: TestClient):
    assert preflight(client, "http://localhost:3000", "/v1/models", "PUT").status_code == 400


def test_any_origin_with_star(make_client: Callable[..., TestClient]):
    client = make_client(allowed_origins="*")
    for origin in [*FOREIGN_PAGES, *LOOPBACK_PAGES]:
        response = preflight(client, origin)
        assert response.status_code == 200, origin
        assert response.headers["access-control-allow-origin"] == "*"
    answer = client.get("/v1/models", headers={"Origin": "https://chat.example.com"})
    assert answer.headers["access-control-allow-origin"] == "*"


def test_an_origin_list_replaces_the_default(make_client: Callable[..., TestClient]):
    client = make_client(allowed_origins="https://chat.example.com, http://10.0.0.5:*")
    allowed = ["https://chat.example.com", "http://10.0.0.5:8080", "http://10.0.0.5"]
    refused = ["https://chat.example.com:8443", "http://10.0.0.50:80", "http://localhost:3000"]
    for origin in allowed:
        response = preflight(client, origin)
        assert response.status_code == 200, origin
        assert response.headers["access-control-allow-origin"] == origin
    for origin in refused:
        response = preflight(client, origin)
        assert response.status_code == 400, origin
        assert "access-control-allow-origin" not in response.headers


def test_an_empty_list_allows_no_page(make_client: Callable[..., TestClient]):
    client = make_client(allowed_origins="")
    for origin in LOOPBACK_PAGES:
        assert preflight(client, origin).status_code == 400


@pytest.mark.parametrize(
    "value", ["chat.example.com", "https://chat.example.com/", "http://localhost:port", "*.com"]
)
def test_an_origin_that_is_not_one_is_refused_at_start(value):
    with pytest.raises(ValueError, match="is not an origin"):
        Settings(allowed_origins=value)


def test_env_var_sets_the_origins(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HOTLORA_ALLOWED_ORIGINS", "https://a.example,https://b.example:8443")
    assert Settings().allowed_origin_list == ["https://a.example", "https://b.example:8443"]


def test_actual_responses_carry_cors_headers_and_expose_the_request_id(client: TestClient):
    origin = "http://localhost:5173"
    models = client.get("/v1/models", headers={"Origin": origin})
    assert models.status_code == 200
    assert models.headers["access-control-allow-origin"] == origin
    assert "origin" in models.headers["vary"].lower()
    assert "x-request-id" in models.headers["access-control-expose-headers"]
    chat = client.post("/v1/chat/completions", json=CHAT, headers={"Origin": origin})
    assert chat.status_code == 200
    assert chat.headers["access-control-allow-origin"] == origin
    foreign = client.get("/v1/models", headers={"Origin": "https://chat.example.com"})
    assert foreign.status_code == 200  # the browser, not the server, withholds it from the page
    assert "access-control-allow-origin" not in foreign.headers


def test_error_responses_carry_cors_and_request_id_headers(
    make_client: Callable[..., TestClient], monkeypatch: pytest.MonkeyPatch
):
    origin = "http://127.0.0.1:8080"
    client = make_client(api_key="sk-test", max_body_bytes=4096, raise_server_exceptions=False)
    auth = {"Origin": origin, "Authorization": "Bearer sk-test"}

    def boom(*_: object) -> None:
        raise RuntimeError("unexpected")

    monkeypatch.setattr(client.app.state.runtime.inference, "prepare_chat", boom)
    answers = {
        401: client.get("/v1/models", headers={"Origin": origin}),
        404: client.get("/no/such/route", headers=auth),
        400: client.post("/v1/completions", json={"model": "tiny"}, headers=auth),
        413: client.post(
            "/v1/completions", json={"model": "tiny", "prompt": "x" * 8192}, headers=auth
        ),
        500: client.post("/v1/chat/completions", json=CHAT, headers=auth),
    }
    for status, response in answers.items():
        assert response.status_code == status, response.text
        assert "error" in response.json()
        assert response.headers["access-control-allow-origin"] == origin, status
        assert GENERATED_ID.fullmatch(response.headers["x-request-id"]), status


# x-request-id.


def test_a_request_id_is_generated_for_each_response(client: TestClient):
    ids = {client.get("/v1/models").headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3
    assert all(GENERATED_ID.fullmatch(i) for i in ids)


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("POST", "/v1/chat/completions", CHAT, 200),
        ("POST", "/v1/chat/completions", {**CHAT, "temperature": 9}, 400),
        ("POST", "/v1/chat/completions", {**CHAT, "model": "nope"}, 404),
        ("GET", "/no/such/route", None, 404),
        ("DELETE", "/v1/models", None, 405),
    ],
)
def test_the_clients_request_id_is_echoed(client: TestClient, method, path, body, status):
    given = "req-2024-01-01T00:00:00Z/abc_DEF.123"
    response = client.request(method, path, json=body, headers={"x-request-id": given})
    assert response.status_code == status
    assert response.headers["x-request-id"] == given


def test_the_clients_request_id_is_echoed_on_a_stream(client: TestClient):
    response = client.post(
        "/v1/chat/completions", json={**CHAT, "stream": True}, headers={"X-Request-Id": "s-1"}
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-request-id"] == "s-1"
    assert sse_events(response)[-1] == "[DONE]"


@pytest.mark.parametrize(
    "given",
    [
        b"x" * 129,
        b"",
        b"has space",
        b"tab\there",
        "caf\u00e9".encode(),
        b"\x7f",
    ],
    ids=["too-long", "empty", "space", "control", "non-ascii", "delete"],
)
def test_an_unusable_request_id_is_replaced(client: TestClient, given: bytes):
    response = client.get("/v1/models", headers={"x-request-id": given})
    assert response.status_code == 200
    assert GENERATED_ID.fullmatch(response.headers["x-request-id"])


def test_a_request_id_of_128_printable_characters_is_kept(client: TestClient):
    given = "~" * 64 + "A" * 64
    assert client.get("/health", headers={"x-request-id": given}).headers["x-request-id"] == given


def test_one_access_log_line_names_the_request_id(
    client: TestClient, caplog: pytest.LogCaptureFixture
):
    with caplog.at_level(logging.INFO, logger="hotlora.access"):
        client.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "chat-1"})
        client.post(
            "/v1/chat/completions", json={**CHAT, "stream": True}, headers={"x-request-id": "s-2"}
        )
        missing = client.get("/nowhere")
    lines = [r.getMessage() for r in caplog.records if r.name == "hotlora.access"]
    assert len(lines) == 3
    # The line opens with these; the request's facts follow as key=value pairs.
    line = re.compile(r"(GET|POST) (\S+) (\d{3}) \d+\.\dms id=(\S+)(?: \w+=\S+)*")
    parsed = [line.fullmatch(text).groups() for text in lines]
    assert parsed == [
        ("POST", "/v1/chat/completions", "200", "chat-1"),
        ("POST", "/v1/chat/completions", "200", "s-2"),
        ("GET", "/nowhere", "404", missing.headers["x-request-id"]),
    ]
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "hotlora.access")


def test_handlers_can_read_the_request_id(client: TestClient, monkeypatch: pytest.MonkeyPatch):
    service: InferenceService = client.app.state.runtime.inference
    seen: list[str | None] = []
    prepare = service.prepare_chat

    async def spy(request):
        seen.append(current_request_id())
        return await prepare(request)

    monkeypatch.setattr(service, "prepare_chat", spy)
    client.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "inner-1"})
    assert seen == ["inner-1"]
    assert current_request_id() is None


# Server-side sampling defaults.


def test_default_temperature_applies_when_a_request_sets_none(
    make_client: Callable[..., TestClient], monkeypatch: pytest.MonkeyPatch
):
    client = make_client(default_temperature=0)
    seen = spy_params(client, monkeypatch)
    request = {**CHAT, **NO_EOS, "max_tokens": 12}
    texts = [
        client.post("/v1/chat/completions", json=request).json()["choices"][0]["message"]["content"]
        for _ in range(2)
    ]
    greedy = client.post("/v1/chat/completions", json={**request, "temperature": 0}).json()
    assert texts[0] == texts[1] == greedy["choices"][0]["message"]["content"]
    assert [p.temperature for p in seen] == [0, 0, 0]


def test_a_requests_own_sampling_values_win(
    make_client: Callable[..., TestClient], monkeypatch: pytest.MonkeyPatch
):
    client = make_client(default_temperature=0, default_top_p=0.5)
    seen = spy_params(client, monkeypatch)
    client.post("/v1/chat/completions", json=CHAT)
    client.post("/v1/chat/completions", json={**CHAT, "temperature": 1.3, "top_p": 0.9})
    assert [(p.temperature, p.top_p) for p in seen] == [(0, 0.5), (1.3, 0.9)]


def test_default_max_tokens_shows_in_usage(make_client: Callable[..., TestClient]):
    client = make_client(default_max_tokens=4)
    request = {"model": "tiny", "messages": CHAT["messages"], **NO_EOS}
    assert (
        client.post("/v1/chat/completions", json=request).json()["usage"]["completion_tokens"] == 4
    )
    own = client.post("/v1/chat/completions", json={**request, "max_tokens": 6}).json()
    assert own["usage"]["completion_tokens"] == 6


@pytest.fixture
def model_with_sampling_config(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The tiny model with sampling values in its generation_config.json."""
    model = tmp_path / "tiny-sampling"
    shutil.copytree(tiny_model_dir, model)
    config_path = model / "generation_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "temperature": 0.6, "top_p": 0.8}))
    return model


@pytest.fixture
def sampling_config_client(
    model_with_sampling_config: Path, tmp_path: Path
) -> Iterator[Callable[..., TestClient]]:
    clients: list[TestClient] = []

    def make(**overrides: object) -> TestClient:
        settings = Settings(
            model=model_with_sampling_config,
            home=tmp_path / "home",
            served_model_name="tiny",
            cpu_vector_jit=False,
            **overrides,
        )
        client = TestClient(create_app(settings), base_url=LOCALHOST)
        client.__enter__()
        clients.append(client)
        wait_ready(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


def test_the_operators_default_wins_over_the_models(
    sampling_config_client: Callable[..., TestClient], monkeypatch: pytest.MonkeyPatch
):
    plain = sampling_config_client()
    model_only = spy_params(plain, monkeypatch)
    plain.post("/v1/chat/completions", json=CHAT)
    assert [(p.temperature, p.top_p) for p in model_only] == [(0.6, 0.8)]
    operated = sampling_config_client(default_temperature=0.25)
    seen = spy_params(operated, monkeypatch)
    operated.post("/v1/chat/completions", json=CHAT)
    operated.post("/v1/chat/completions", json={**CHAT, "temperature": 1.5})
    assert [(p.temperature, p.top_p) for p in seen] == [(0.25, 0.8), (1.5, 0.8)]


def test_the_chat_page_loads_only_its_own_files_and_no_site_frames_it(client: TestClient):
    page = client.get("/")
    assert page.status_code == 200 and 'src="static/app.js"' in page.text
    policy = page.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert page.headers["x-frame-options"] == "DENY"
    assert page.headers["x-content-type-options"] == "nosniff"
