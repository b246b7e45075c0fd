"""`response_format` over HTTP on the tiny random model: JSON that parses and validates, whole,
streamed and with several choices, and a 400 naming what cannot be enforced."""

from __future__ import annotations

import json
import logging

import jsonschema
import pytest
from fastapi.testclient import TestClient

from tests.support.sse import sse_events

CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Describe a user as JSON."}],
    "max_tokens": 200,
}
# Nested objects, an array of objects, enums, required and optional keys; every string,
# number and array bounded, so that the tiny model's answers end within max_tokens.
USER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "name": {"type": "string", "maxLength": 6},
        "role": {"type": "string", "enum": ["admin", "editor", "viewer"]},
        "active": {"type": "boolean"},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 5},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "pets": {
            "type": "array",
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer"}},
                "required": ["kind"],
                "additionalProperties": False,
            },
        },
        "nickname": {"type": ["string", "null"], "maxLength": 4},
    },
    "required": ["id", "name", "role", "active", "address", "pets"],
    "additionalProperties": False,
}


def schema_format(schema: dict, strict: bool | None = True) -> dict:
    spec: dict = {"name": "user", "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


def answers(client: TestClient, **fields) -> list[dict]:
    response = client.post("/v1/chat/completions", json={**CHAT, **fields})
    assert response.status_code == 200, response.text
    return response.json()["choices"]


def valid(choice: dict, schema: dict) -> dict:
    assert choice["finish_reason"] == "stop", choice["message"]["content"]
    value = json.loads(choice["message"]["content"])
    jsonschema.validate(value, schema)
    return value


@pytest.mark.parametrize("strict", [True, False, None])
def test_json_schema_answers_validate(client: TestClient, strict):
    for temperature, seed in ((0, None), (1.0, 7), (1.0, 8)):
        [choice] = answers(
            client, response_format=schema_format(USER, strict), temperature=temperature, seed=seed
        )
        value = valid(choice, USER)
        assert list(value)[:6] == ["id", "name", "role", "active", "address", "pets"]


def test_json_object_answers_are_json_objects(client: TestClient):
    for content in ("Describe a user as JSON.", "A JSON object, please.", "{}"):
        messages = [{"role": "user", "content": content}]
        [choice] = answers(
            client, messages=messages, response_format={"type": "json_object"}, temperature=0
        )
        assert choice["finish_reason"] == "stop"
        assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_text_format_and_no_format_answer_the_same(client: TestClient):
    plain = answers(client, temperature=0, max_tokens=12)
    text = answers(client, temperature=0, max_tokens=12, response_format={"type": "text"})
    assert text[0]["message"]["content"] == plain[0]["message"]["content"]


def test_a_streamed_answer_equals_the_whole_one(client: TestClient):
    fields = {"response_format": schema_format(USER), "temperature": 0}
    [whole] = answers(client, **fields)
    valid(whole, USER)
    response = client.post("/v1/chat/completions", json={**CHAT, **fields, "stream": True})
    chunks = [json.loads(e) for e in sse_events(response)[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == whole["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_each_of_n_choices_validates(client: TestClient):
    choices = answers(
        client, response_format=schema_format(USER), n=2, temperature=1.0, seed=3, logprobs=True
    )
    assert [c["index"] for c in choices] == [0, 1]
    values = [valid(c, USER) for c in choices]
    assert values[0] != values[1]
    for choice in choices:
        tokens = choice["logprobs"]["content"]
        assert "".join(t["token"] for t in tokens) == choice["message"]["content"]


def _bad(response_format: dict, **fields) -> dict:
    return {**CHAT, "response_format": response_format, **fields}


REFUSED = [
    (_bad(schema_format({"type": "array", "uniqueItems": True})), "response_format", "uniqueItems"),
    (_bad(schema_format({"not": {"type": "string"}})), "response_format", "not"),
    (_bad(schema_format({"type": "strin"})), "response_format", "strin"),
    (_bad(schema_format({"$ref": "#/$defs/gone"})), "response_format", "gone"),
    (_bad(schema_format({"type": "string", "format": "colour"})), "response_format", "colour"),
    (_bad({"type": "json_schema"}), "response_format", "json_schema"),
    (_bad({"type": "json_schema", "json_schema": {"schema": {}}}), "response_format", "name"),
    (
        _bad({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}),
        "response_format",
        "name",
    ),
    (_bad({"type": "json_schema", "json_schema": {"name": "x"}}), "response_format", "schema"),
    (_bad({"type": "xml"}), "response_format.type", "json_schema"),
]


@pytest.mark.parametrize(("body", "param", "named"), REFUSED)
def test_what_cannot_be_enforced_is_a_400_naming_it(client: TestClient, body, param, named):
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"].startswith(param)
    assert named in error["message"]


# A schema whose literal is too long for the grammar engine's lexer (~600 KB as JSON).
HUGE = {
    "type": "object",
    "properties": {"motto": {"const": "pirate " * 86_000}},
    "required": ["motto"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", _bad(schema_format(HUGE)), "response_format"),
        ("/v1/chat/completions", _bad(schema_format(HUGE), stream=True), "response_format"),
        (
            "/v1/responses",
            {
                "model": "tiny",
                "input": "hi",
                "stream": True,
                "text": {"format": {"type": "json_schema", "name": "motto", "schema": HUGE}},
            },
            "text.format",
        ),
    ],
)
def test_a_huge_schema_is_refused_before_generation_and_logged_by_size(
    make_client, caplog, path, body, param
):
    client = make_client(max_body_bytes=2 << 20)
    with caplog.at_level(logging.INFO, logger="hotlora"):
        response = client.post(path, json=body)
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert error["param"] == param and "bytes" in error["message"]
    assert len(response.text) < 1000
    logged = [record.getMessage() for record in caplog.records]
    assert any(m.startswith("refused response_format of 60") for m in logged), logged
    assert all(len(m) < 1000 and "pirate" not in m for m in logged)


def test_a_constraint_past_the_grammar_engines_limits_is_a_400(client: TestClient):
    """A pattern that compiles but that the grammar engine cannot follow for long (counted
    repetitions nested a thousand deep) is the request's to simplify: a 400, streamed as an
    error event, and the server serves on."""
    body = {**CHAT, "max_tokens": 8, "guided_regex": "(a{1000}){1000}"}
    refused = client.post("/v1/chat/completions", json=body)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "grammar_failed")
    assert "could not be followed: the grammar engine reached one of its limits" in error["message"]
    assert "\n" not in error["message"] and "<" not in error["message"]  # one line, said
    streamed = client.post("/v1/chat/completions", json={**body, "stream": True})
    events = [json.loads(e) for e in sse_events(streamed)[:-1]]
    assert events[-1]["error"]["code"] == "grammar_failed"
    assert client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2}).status_code == 200
