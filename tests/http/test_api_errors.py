"""The HTTP API in-process on the tiny random model: what it refuses, and how it fails."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from fastapi.testclient import TestClient

from hotlora.models.cpu.weights import has_gpu
from hotlora.server.engine.sampling import RowSampler

from tests.support.sse import sse_events
from tests.support.tiny import MAX_POSITION_EMBEDDINGS

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi there"}]}


ERRORS = [
    # (path, body, status, param, code)
    ("/v1/chat/completions", {**CHAT, "model": "nope"}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "temperature": 5}, 400, "temperature", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "n": 99}, 400, "n", None),
    (
        "/v1/chat/completions",
        {**CHAT, "max_tokens": MAX_POSITION_EMBEDDINGS},
        400,
        "messages",
        "context_length_exceeded",
    ),
    ("/v1/chat/completions", {"messages": CHAT["messages"]}, 400, "model", "invalid_value"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, 99999]}, 400, "prompt", None),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "x", "max_tokens": 100000},
        400,
        "max_tokens",
        None,
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), ERRORS)
def test_error_table(client: TestClient, path, body, status, param, code):
    response = client.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert error["message"]
    if code is not None:
        assert error["code"] == code


def test_context_overflow_names_both_numbers(client: TestClient):
    error = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 600}).json()["error"]
    assert str(MAX_POSITION_EMBEDDINGS) in error["message"] and "600" in error["message"]


def test_invalid_json_unknown_route_and_method(client: TestClient):
    bad = client.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    missing = client.get("/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    wrong = client.get("/v1/chat/completions")
    assert wrong.status_code == 405 and "error" in wrong.json()


def test_body_limit(make_client):
    client = make_client(max_body_bytes=200)
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 500}]}
    response = client.post("/v1/chat/completions", json=big)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"

    def chunked():
        yield json.dumps(big).encode()

    response = client.post(
        "/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"}
    )
    assert response.status_code == 413
    ok = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1})
    assert ok.status_code == 200


def test_internal_error_hides_details(make_client, monkeypatch):
    client = make_client(raise_server_exceptions=False)
    scheduler = client.app.state.runtime.worker.scheduler

    def explode(tokens, cache=None):
        raise RuntimeError("/secret/path/file.py exploded")

    monkeypatch.setattr(scheduler, "model", explode)
    response = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
    assert response.status_code == 500
    assert "/secret" not in response.text and "Traceback" not in response.text
    monkeypatch.undo()
    assert client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2}).status_code == 200


def test_a_template_that_refuses_the_messages_is_a_400(make_client, monkeypatch):
    client = make_client()
    tokenizer = client.app.state.runtime.worker.engine.tokenizer

    def refuse(*args, **kwargs):
        from jinja2 import TemplateError

        raise TemplateError("Conversation roles must alternate user/assistant")

    monkeypatch.setattr(tokenizer, "apply_chat_template", refuse)
    response = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages" and "must alternate" in error["message"]


# Llama 3.1's template takes `ipython` (a tool's output); other templates know other roles.
OTHER_ROLE = [{"role": "user", "content": "hi"}, {"role": "ipython", "content": "42"}]


def test_a_role_openai_does_not_define_reaches_the_template(client: TestClient):
    """The tiny model's ChatML template writes any role as it is sent."""
    tokens = client.post("/tokenize", json={"model": "tiny", "messages": OTHER_ROLE})
    assert tokens.status_code == 200, tokens.text
    text = client.post("/detokenize", json={"tokens": tokens.json()["tokens"]}).json()["prompt"]
    assert "<|im_start|>ipython\n42<|im_end|>" in text
    answer = client.post(
        "/v1/chat/completions", json={**CHAT, "messages": OTHER_ROLE, "max_tokens": 2}
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] == tokens.json()["count"]


def test_a_template_that_refuses_a_role_is_a_400_naming_it(make_client, monkeypatch):
    client = make_client()
    tokenizer = client.app.state.runtime.worker.engine.tokenizer

    def refuse(*args, **kwargs):
        from jinja2 import TemplateError

        raise TemplateError("Unknown role")

    monkeypatch.setattr(tokenizer, "apply_chat_template", refuse)
    for path in ("/v1/chat/completions", "/tokenize"):
        response = client.post(path, json={**CHAT, "messages": OTHER_ROLE})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "messages.1.role", error
        assert "'ipython'" in error["message"] and "Unknown role" in error["message"]


@pytest.mark.parametrize("role", ["", "r" * 65, None, 3])
def test_a_role_that_is_no_name_is_a_400(client: TestClient, role: object):
    body = {**CHAT, "messages": [{"role": role, "content": "hi"}]}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages.0.role"


def test_a_failed_sampler_fails_its_request_only(make_client, monkeypatch):
    client = make_client(raise_server_exceptions=False)
    sampled = {**CHAT, "max_tokens": 6, "temperature": 1.0}
    real = RowSampler.sample

    def failing(self, logprobs: mx.array) -> mx.array:
        if self.temperature == 1.0:
            raise RuntimeError("the sampler failed")
        return real(self, logprobs)

    monkeypatch.setattr(RowSampler, "sample", failing)
    failed = client.post("/v1/chat/completions", json=sampled)
    assert failed.status_code == 500
    # A greedy request is served meanwhile, and sampled ones are once the sampler works.
    greedy = {**CHAT, "max_tokens": 2, "temperature": 0}
    assert client.post("/v1/chat/completions", json=greedy).status_code == 200
    monkeypatch.undo()
    for _ in range(2):
        after = client.post("/v1/chat/completions", json=sampled)
        assert after.status_code == 200, after.text


def test_stream_failure_becomes_an_error_event(make_client, monkeypatch):
    client = make_client(raise_server_exceptions=False)
    scheduler = client.app.state.runtime.worker.scheduler
    model = scheduler.model
    calls = []

    def fail_midway(tokens, cache=None):
        calls.append(tokens.shape)
        if len(calls) == 4:  # after the prefill and a few decode steps
            raise RuntimeError("/secret/path exploded")
        return model(tokens, cache=cache)

    monkeypatch.setattr(scheduler, "model", fail_midway)
    response = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 8, "stream": True})
    assert response.status_code == 200
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "/secret" not in error["message"]


MORE_ERRORS = [
    ({**CHAT, "seed": 2**70}, "seed"),
    (
        {**CHAT, "tools": [{"type": "function", "function": {"name": "f g"}}]},
        "tools.0.function.name",
    ),
    ({**CHAT, "tool_choice": "required"}, "tool_choice"),
    ({**CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
    ({**CHAT, "logit_bias": {"5": 500}}, "logit_bias"),
    ({**CHAT, "logit_bias": {"99999": 1}}, "logit_bias"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
]


@pytest.mark.parametrize(("body", "param"), MORE_ERRORS)
def test_unsupported_or_out_of_range_fields_are_refused(client: TestClient, body, param):
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_batch_prompts_count_against_max_n(client: TestClient):
    body = {"model": "tiny", "prompt": ["a", "b", "c"], "n": 3, "max_tokens": 1}
    error = client.post("/v1/completions", json=body).json()["error"]
    assert error["param"] == "prompt" and "9" in error["message"]
    ok = client.post("/v1/completions", json={**body, "n": 2})
    assert [c["index"] for c in ok.json()["choices"]] == list(range(6))


def test_auth_headers_on_refusals(make_client):
    client = make_client(api_key="k")
    response = client.get("/v1/models")
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    # With only an inference key, the admin routes take that key rather than staying open.
    assert client.get("/v1/adapters").status_code == 401
    assert client.get("/v1/adapters", headers={"Authorization": "Bearer k"}).status_code == 200


def test_empty_keys_are_refused():
    from pydantic import ValidationError

    from hotlora.config.settings import Settings

    with pytest.raises(ValidationError, match="must not be empty"):
        Settings(api_key="")


def test_decode_ahead_reaches_the_scheduler_and_changes_no_answer(make_client):
    body = {**CHAT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "n": 2}
    answers = {}
    for asked, launches in (("auto", has_gpu()), ("on", True), ("off", False)):
        client = make_client(decode_ahead=asked)
        assert client.app.state.runtime.worker.scheduler.look_ahead is launches, asked
        choices = client.post("/v1/chat/completions", json=body).json()["choices"]
        answers[asked] = [choice["message"]["content"] for choice in choices]
    assert answers["on"] == answers["off"] == answers["auto"]
    assert all(answers["on"])
