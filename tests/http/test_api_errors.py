"""The HTTP API in-process on the tiny random model: what it refuses, and how it fails."""

from __future__ import annotations

import gzip
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
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": None}]},
        400,
        "messages.0.content",
        "invalid_value",
    ),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "system"}, {"role": "user", "content": "hi"}]},
        400,
        "messages.0.content",
        "invalid_value",
    ),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": []}]},
        400,
        "messages.0.content",
        "invalid_value",
    ),
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
        {"model": "tiny", "prompt": "x", "max_tokens": 10, "min_tokens": 20},
        400,
        "min_tokens",
        "invalid_value",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "max_completion_tokens": 2, "min_tokens": 3},
        400,
        "min_tokens",
        "invalid_value",
    ),
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
    assert missing.json()["error"]["message"] == "Unknown route: GET /v1/nothing-here."
    # A base URL without /v1, a doubled slash: the route meant is named.
    hint = " (An OpenAI client's base URL ends in /v1.)"
    for method, path, meant in (
        ("POST", "/chat/completions", "/v1/chat/completions"),
        ("GET", "/models", "/v1/models"),
        ("POST", "/v1//chat/completions", "/v1/chat/completions"),
    ):
        lost = client.request(method, path)
        assert lost.status_code == 404
        said = f"Unknown route: {method} {path}. Did you mean {meant}?{hint}"
        assert lost.json()["error"]["message"] == said
    wrong = client.get("/v1/chat/completions")
    assert wrong.status_code == 405 and "error" in wrong.json()


def test_bodies_that_cannot_be_read_are_named_and_routes_keep_their_spelling(client: TestClient):
    """A body FastAPI cannot decode (invalid UTF-8, nesting past Python's recursion limit) is
    invalid JSON as any other; a compressed body is refused, not read as JSON; a path with a
    trailing slash is no route (no redirect to wherever the Host header points)."""
    chat = json.dumps({**CHAT, "max_tokens": 1}).encode()
    json_type = {"content-type": "application/json"}
    for body in (chat.replace(b'"user"', b'"us\xe9\xffr"'), b"[" * 5000 + b"]" * 5000):
        bad = client.post("/v1/chat/completions", content=body, headers=json_type)
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["code"] == "invalid_json"
        assert bad.json()["error"]["message"] == "We could not parse the JSON body of your request."
    packed = client.post(
        "/v1/chat/completions",
        content=gzip.compress(chat),
        headers={**json_type, "content-encoding": "gzip"},
    )
    assert packed.status_code == 415 and packed.json()["error"]["code"] == "unsupported_media_type"
    assert "Content-Encoding 'gzip' is not supported" in packed.json()["error"]["message"]
    plain = client.post(
        "/v1/chat/completions", content=chat, headers={**json_type, "content-encoding": "identity"}
    )
    assert plain.status_code == 200
    assert client.get("/health", headers={"content-encoding": "gzip"}).status_code == 200  # no body
    for method, path in (
        ("DELETE", "/v1/adapters/"),
        ("GET", "/v1/models/"),
        ("GET", "/health/"),
        ("POST", "/v1/completions/"),
    ):
        slashed = client.request(method, path, headers={"host": "elsewhere.localhost"})
        assert slashed.status_code == 404 and "location" not in slashed.headers
        assert slashed.json()["error"]["message"].startswith(f"Unknown route: {method} {path}.")
    for path in ("/health", "/ready"):
        head = client.head(path)
        assert head.status_code == 200 and head.content == b""


def test_a_body_that_is_no_json_object_says_what_it_is(client: TestClient):
    """`curl -d` without a JSON content type, no body, another JSON value: each named as
    such, never a field-level complaint with no field."""
    form = client.post(
        "/v1/chat/completions",
        content=json.dumps({**CHAT, "max_tokens": 1}).encode(),
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert form.status_code == 415
    assert form.json()["error"]["code"] == "unsupported_media_type"
    assert "application/json" in form.json()["error"]["message"]
    empty = client.post("/v1/chat/completions", headers={"content-type": "application/json"})
    assert empty.status_code == 400 and "no body" in empty.json()["error"]["message"]
    listed = client.post("/v1/chat/completions", json=[CHAT])
    assert listed.status_code == 400 and "JSON object" in listed.json()["error"]["message"]
    # A JSON object a whole-body rule refuses is no such case: its own words.
    both = client.post("/tokenize", json={"model": "tiny", "prompt": "hi", **CHAT})
    assert both.status_code == 400 and "'prompt' or 'messages'" in both.json()["error"]["message"]
    for response in (form, empty, listed, both):
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1}).status_code == 200


def test_a_missing_or_mistyped_path_is_named(client: TestClient):
    for body in ({"id": "z1"}, {"id": "z2", "path": 5}):
        response = client.post("/v1/adapters", json=body)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "path" and "'path'" in error["message"]
    assert client.get("/v1/adapters").json()["data"] == []


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", CHAT),
        ("/v1/completions", {"model": "tiny", "prompt": "hi"}),
        ("/v1/responses", {"model": "tiny", "input": "hi"}),
        ("/v1/embeddings", {"model": "tiny", "input": "hi"}),
    ],
)
def test_user_and_metadata_are_typed_alike_everywhere(client: TestClient, path, body):
    for fields, param in (({"user": 5}, "user"), ({"metadata": {"a": 1}}, "metadata.a")):
        if path == "/v1/embeddings" and "metadata" in fields:
            continue
        response = client.post(path, json={**body, **fields})
        assert response.status_code == 400 and response.json()["error"]["param"] == param
    ok = {"user": "u-1"} | ({} if path == "/v1/embeddings" else {"metadata": {"a": "b"}})
    assert client.post(path, json={**body, **ok}).status_code == 200


def test_a_field_of_the_other_endpoint_is_named_with_it(client: TestClient):
    prompt = client.post("/v1/chat/completions", json={**CHAT, "prompt": "x"}).json()["error"]
    assert prompt["param"] == "prompt" and "text completions (/v1/completions)" in prompt["message"]
    body = {"model": "tiny", "prompt": "x", "messages": CHAT["messages"]}
    messages = client.post("/v1/completions", json=body).json()["error"]
    assert messages["param"] == "messages"
    assert "chat completions (/v1/chat/completions)" in messages["message"]
    top = client.post("/v1/chat/completions", json={**CHAT, "top_logprobs": 2}).json()["error"]
    assert top["param"] == "top_logprobs" and top["code"] == "invalid_value"


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
    # Never ended early by a sampled end of generation: the failing call is always reached.
    body = {**CHAT, "max_tokens": 8, "stream": True, "ignore_eos": True}
    response = client.post("/v1/chat/completions", json=body)
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


NULLS = [
    # (path, body, fields OpenAI's schema makes nullable, sent as null)
    ("/v1/chat/completions", CHAT, ("n", "logprobs", "stream", "parallel_tool_calls")),
    ("/v1/completions", {"model": "tiny", "prompt": "hi"}, ("n", "echo", "stream")),
    ("/v1/responses", {"model": "tiny", "input": "hi"}, ("parallel_tool_calls", "background")),
    ("/v1/responses", {"model": "tiny", "input": "hi"}, ("truncation", "stream", "store")),
]


def answer_text(body: dict) -> str:
    """A chat completion's, text completion's or response's first answer."""
    if "output" in body:
        return str(body["output"][0]["content"][0]["text"])
    choice = body["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


@pytest.mark.parametrize(("path", "body", "fields"), NULLS)
def test_null_stands_for_a_fields_default(client: TestClient, path, body, fields):
    """OpenAI's SDKs send null for an argument left None: the field's default, the same answer
    as without it; a required field's null is refused by its name."""
    body = {**body, "max_tokens" if "input" not in body else "max_output_tokens": 3}
    body = {**body, "temperature": 0}
    plain = client.post(path, json=body)
    nulls = client.post(path, json={**body, **dict.fromkeys(fields)})
    assert plain.status_code == nulls.status_code == 200, nulls.text
    assert answer_text(nulls.json()) == answer_text(plain.json())
    if path == "/v1/responses":  # an input item's null type: a message, as none is
        item = {"type": None, "role": "user", "content": "hi"}
        typed = client.post(path, json={**body, "input": [item]})
        assert answer_text(typed.json()) == answer_text(plain.json())
    refused = client.post(path, json={**body, "model": None})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"


def test_a_list_of_prompts_counts_against_max_choices_and_n_against_max_n(make_client):
    client = make_client(max_n=3, max_choices=12)
    body = {"model": "tiny", "prompt": ["a", "b", "c"], "n": 4, "max_tokens": 1}
    error = client.post("/v1/completions", json=body).json()["error"]
    assert error["param"] == "n" and "at most 3" in error["message"]
    many = {**body, "prompt": ["a"] * 13, "n": 1}
    error = client.post("/v1/completions", json=many).json()["error"]
    assert error["param"] == "prompt" and "13 prompts x n=1" in error["message"]
    ok = client.post("/v1/completions", json={**body, "n": 3})  # 9 choices: a batch, not n
    assert [c["index"] for c in ok.json()["choices"]] == list(range(9))
    twelve = client.post("/v1/completions", json={**many, "prompt": ["a"] * 12})
    assert twelve.status_code == 200, twelve.text


def test_a_seeded_prompt_samples_the_same_wherever_it_stands_in_a_list(client: TestClient):
    body = {"model": "tiny", "max_tokens": 8, "temperature": 1.0, "seed": 42}
    alone = client.post("/v1/completions", json={**body, "prompt": "once upon"}).json()
    listed = client.post(
        "/v1/completions", json={**body, "prompt": ["the cat", "once upon"], "n": 2}
    ).json()
    texts = [c["text"] for c in sorted(listed["choices"], key=lambda c: c["index"])]
    assert texts[2] == alone["choices"][0]["text"]  # choice 0 of the second prompt
    assert texts[2] != texts[3]  # its second choice: seed + 1


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


def test_an_answer_s_id_is_the_request_id_its_log_line_names(client: TestClient):
    for path, body, prefix in (
        ("/v1/chat/completions", {**CHAT, "max_tokens": 2}, "chatcmpl-"),
        ("/v1/completions", {"model": "tiny", "prompt": "the", "max_tokens": 2}, "cmpl-"),
    ):
        answer = client.post(path, json=body)
        assert answer.json()["id"] == prefix + answer.headers["x-request-id"]
        named = client.post(path, json=body, headers={"x-request-id": "mine-7"})
        assert named.json()["id"] == prefix + "mine-7"
