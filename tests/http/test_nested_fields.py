"""Keys inside request objects (a message, a tool, `stream_options`, `text.format`) and the
fields of /v1/responses, /v1/embeddings, /tokenize and /detokenize over HTTP on the tiny model:
each honoured, refused with a 400 naming its dotted path, or (what SDKs send back with an
earlier answer) accepted and logged once; never dropped without a word. And vLLM's `request_id`
as the answer's id.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from hotlora.config.settings import Settings
from hotlora.server.api import wire_base
from hotlora.server.app import create_app

from tests.http.conftest import wait_ready
from tests.support.server_process import LOCALHOST
from tests.support.sse import sse_events

USER = {"role": "user", "content": "the cat"}
CHAT = {"model": "tiny", "messages": [USER], "max_tokens": 2}
TEXT = {"model": "tiny", "prompt": "the cat", "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
SCHEMA = {"name": "s", "schema": {"type": "object"}}
RESPONSES = {"model": "tiny", "input": "the cat", "max_output_tokens": 2}
RESPONSES_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    settings = Settings(
        home=tmp_path_factory.mktemp("home"),
        model=tiny_model_dir,
        served_model_name="tiny",
        cpu_vector_jit=False,
    )
    with TestClient(create_app(settings), base_url=LOCALHOST) as client:
        wait_ready(client)
        yield client


def _with(body: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {**body, **fields}


# (route, body, the param the 400 names): a key no object of the request declares.
UNKNOWN_KEYS = [
    (
        "/v1/chat/completions",
        _with(CHAT, stream=True, stream_options={"include_usag": True}),
        "stream_options.include_usag",
    ),
    ("/v1/chat/completions", _with(CHAT, messages=[{**USER, "colour": 1}]), "messages.0.colour"),
    (
        "/v1/chat/completions",
        _with(
            CHAT, messages=[{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]
        ),
        "messages.0.content.0.x",
    ),
    ("/v1/chat/completions", _with(CHAT, tools=[{**TOOL, "colour": 1}]), "tools.0.colour"),
    (
        "/v1/chat/completions",
        _with(CHAT, tools=[{"type": "function", "function": {"name": "f", "params": {}}}]),
        "tools.0.function.params",
    ),
    (
        "/v1/chat/completions",
        _with(
            CHAT, tools=[TOOL], tool_choice={"type": "function", "function": {"name": "f"}, "x": 1}
        ),
        "tool_choice.x",
    ),
    (
        "/v1/chat/completions",
        _with(CHAT, tools=[TOOL], tool_choice={"type": "function", "function": {"nam": "f"}}),
        "tool_choice.function.nam",
    ),
    (
        "/v1/chat/completions",
        _with(CHAT, messages=[USER, {"role": "assistant", "tool_calls": [{**CALL, "x": 1}]}]),
        "messages.1.tool_calls.0.x",
    ),
    (
        "/v1/chat/completions",
        _with(
            CHAT,
            messages=[
                USER,
                {
                    "role": "assistant",
                    "tool_calls": [{**CALL, "function": {"name": "f", "args": "{}"}}],
                },
            ],
        ),
        "messages.1.tool_calls.0.function.args",
    ),
    (
        "/v1/chat/completions",
        _with(CHAT, response_format={"type": "json_object", "schema": {}}),
        "response_format.schema",
    ),
    (
        "/v1/chat/completions",
        _with(CHAT, response_format={"type": "json_schema", "json_schema": {**SCHEMA, "x": 1}}),
        "response_format.json_schema.x",
    ),
    (
        "/v1/completions",
        _with(TEXT, response_format={"type": "json_object", "strict": True}),
        "response_format.strict",
    ),
    (
        "/v1/completions",
        _with(TEXT, stream=True, stream_options={"continuous_usage": True}),
        "stream_options.continuous_usage",
    ),
    ("/v1/responses", _with(RESPONSES, input=[{**USER, "colour": 1}]), "input.0.colour"),
    (
        "/v1/responses",
        _with(
            RESPONSES,
            input=[{"role": "user", "content": [{"type": "input_text", "text": "a", "x": 1}]}],
        ),
        "input.0.content.0.x",
    ),
    ("/v1/responses", _with(RESPONSES, tools=[{**RESPONSES_TOOL, "x": 1}]), "tools.0.x"),
    (
        "/v1/responses",
        _with(
            RESPONSES, tools=[RESPONSES_TOOL], tool_choice={"type": "function", "name": "f", "x": 1}
        ),
        "tool_choice.x",
    ),
    (
        "/v1/responses",
        _with(RESPONSES, text={"format": {"type": "json_schema", **SCHEMA, "x": 1}}),
        "text.format.x",
    ),
    ("/v1/responses", _with(RESPONSES, text={"formats": {"type": "text"}}), "text.formats"),
    (
        "/tokenize",
        {"model": "tiny", "messages": [{**USER, "colour": 1}]},
        "messages.0.colour",
    ),
    ("/v1/adapters", {"id": "a", "path": "a", "replce": True}, "replce"),
    ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "a", "inplace": True}, "inplace"),
    ("/v1/unload_lora_adapter", {"lora_name": "a", "lora_id": 1}, "lora_id"),
]


@pytest.mark.parametrize(("path", "body", "param"), UNKNOWN_KEYS)
def test_an_unknown_nested_key_is_a_400_naming_its_path(tiny: TestClient, path, body, param):
    response = tiny.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["code"] == "unknown_parameter"
    assert f"'{param}'" in error["message"]


# (route, body, the param the 400 names): a field another server defines on that route and this
# one does not implement, or a field of chat completions sent elsewhere.
REFUSED_FIELDS = [
    ("/v1/responses", _with(RESPONSES, include=["reasoning.encrypted_content"]), "include"),
    ("/v1/responses", _with(RESPONSES, reasoning={"effort": "low"}), "reasoning"),
    ("/v1/responses", _with(RESPONSES, max_tool_calls=2), "max_tool_calls"),
    ("/v1/responses", _with(RESPONSES, top_logprobs=2), "top_logprobs"),
    (
        "/v1/responses",
        _with(RESPONSES, stream=True, stream_options={"include_obfuscation": True}),
        "stream_options",
    ),
    ("/v1/responses", _with(RESPONSES, max_tokens=5), "max_tokens"),
    ("/v1/responses", _with(RESPONSES, top_k=3), "top_k"),
    ("/v1/responses", _with(RESPONSES, use_beam_search=True), "use_beam_search"),
    ("/v1/responses", _with(RESPONSES, text={"verbosity": "low"}), "text.verbosity"),
    ("/v1/embeddings", {"model": "tiny", "input": "a", "normalize": False}, "normalize"),
    (
        "/v1/embeddings",
        {"model": "tiny", "input": "a", "truncate_prompt_tokens": 3},
        "truncate_prompt_tokens",
    ),
    ("/v1/embeddings", {"model": "tiny", "input": "a", "embed_dtype": "float16"}, "embed_dtype"),
    ("/v1/embeddings", {"model": "tiny", "input": "a", "temperature": 0.5}, "temperature"),
    (
        "/tokenize",
        {"model": "tiny", "prompt": "a", "chat_template_kwargs": {"x": 1}},
        "chat_template_kwargs",
    ),
    ("/tokenize", {"model": "tiny", "prompt": "a", "chat_template": "{{ x }}"}, "chat_template"),
    (
        "/detokenize",
        {"model": "tiny", "tokens": [1], "skip_special_tokens": False},
        "skip_special_tokens",
    ),
    (
        "/v1/chat/completions",
        _with(CHAT, stream=True, stream_options={"include_obfuscation": True}),
        "stream_options.include_obfuscation",
    ),
    (
        "/v1/chat/completions",
        _with(
            CHAT,
            messages=[
                USER,
                {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}},
            ],
        ),
        "messages.1.function_call",
    ),
    ("/v1/chat/completions", _with(CHAT, request_id="has a space"), "request_id"),
    # logit_bias in shapes other than OpenAI's {token id: bias}.
    ("/v1/chat/completions", _with(CHAT, logit_bias=[[5, 1.0]]), "logit_bias"),
    ("/v1/chat/completions", _with(CHAT, logit_bias={"5": {"bias": 1.0}}), "logit_bias.5"),
    ("/v1/completions", _with(TEXT, logit_bias={"the": 1.0}), "logit_bias"),
]


@pytest.mark.parametrize(("path", "body", "param"), REFUSED_FIELDS)
def test_a_field_not_implemented_on_the_route_is_a_400(tiny: TestClient, path, body, param):
    response = tiny.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_neutral_values_pass_on_every_route(tiny: TestClient):
    """Defaults that scripts written for vLLM or OpenAI send, asking for nothing."""
    sent = [
        ("/v1/responses", _with(RESPONSES, include=[], service_tier="auto", user="u")),
        (
            "/v1/responses",
            _with(RESPONSES, stream=True, stream_options={"include_obfuscation": False}),
        ),
        (
            "/v1/responses",
            _with(RESPONSES, text={"format": {"type": "text"}, "verbosity": "medium"}),
        ),
        ("/v1/embeddings", {"model": "tiny", "input": "a", "normalize": True, "user": "u"}),
        ("/tokenize", {"model": "tiny", "prompt": "a", "priority": 0}),
        (
            "/v1/chat/completions",
            _with(CHAT, stream=True, stream_options={"include_obfuscation": False}),
        ),
        # An object whose members are all null asks for what an empty one does.
        ("/v1/responses", _with(RESPONSES, reasoning={})),
        ("/v1/responses", _with(RESPONSES, reasoning={"effort": None, "summary": None})),
        ("/v1/responses", _with(RESPONSES, stream_options={"include_obfuscation": None})),
        ("/v1/chat/completions", _with(CHAT, function_call="none")),
    ]
    for path, body in sent:
        response = tiny.post(path, json=body)
        assert response.status_code == 200, (path, response.text)
    for path, body, param in [
        ("/v1/responses", _with(RESPONSES, reasoning={"effort": "high"}), "reasoning"),
        ("/v1/chat/completions", _with(CHAT, function_call="auto"), "function_call"),
    ]:
        response = tiny.post(path, json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_an_assistant_turn_replayed_by_an_sdk_is_accepted_and_logged_once(
    tiny: TestClient, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
):
    """The openai SDKs send back an answer's message as they parsed it (with `refusal`,
    `annotations`, `audio`, this server's `reasoning_content`, and the `parse` helpers'
    `parsed` and `parsed_arguments`), LiteLLM with its `provider_specific_fields`, and LangChain
    gathers a streamed tool call with its delta `index`."""
    replayed = {
        "role": "assistant",
        "content": "a b",
        "refusal": None,
        "annotations": [],
        "audio": None,
        "function_call": None,
        "reasoning_content": "thought about it",
        "parsed": None,
        "provider_specific_fields": {"refusal": None},
        "thinking_blocks": None,
        "tool_calls": [
            {**CALL, "index": 0, "function": {**CALL["function"], "parsed_arguments": {"x": 1}}}
        ],
    }
    messages = [USER, replayed, {"role": "tool", "tool_call_id": "c1", "content": "1"}, USER]
    monkeypatch.setattr(wire_base, "_noted", set())  # as in a fresh process
    with caplog.at_level(logging.WARNING, logger="hotlora"):
        for _ in range(2):
            response = tiny.post("/v1/chat/completions", json=_with(CHAT, messages=messages))
            assert response.status_code == 200, response.text
    noted = [r.getMessage() for r in caplog.records if "accepted with no effect" in r.getMessage()]
    # Once for each key that held a value; keys sent empty (`refusal: null`) ask for nothing.
    said = " is accepted with no effect (logged once per key)"
    assert sorted(noted) == [
        f"ChatMessage key 'provider_specific_fields'{said}",
        f"ChatMessage key 'reasoning_content'{said}",
        f"FunctionCall key 'parsed_arguments'{said}",
        f"ToolCall key 'index'{said}",
    ]
    # The text parts' prompt-caching mark some clients add is accepted too.
    mark = {"type": "ephemeral"}
    cached = {
        "role": "user",
        "content": [{"type": "text", "text": "a", "cache_control": mark}],
        "cache_control": mark,
    }
    body = _with(CHAT, messages=[cached], tools=[{**TOOL, "cache_control": mark}])
    assert tiny.post("/v1/chat/completions", json=body).status_code == 200


def test_a_refusal_part_is_what_the_assistant_said(tiny: TestClient):
    def prompt(content: object, role: str = "assistant") -> dict:
        turn = {"role": role, "content": content, "reasoning_details": [{"type": "reasoning.text"}]}
        body = {"model": "tiny", "messages": [USER, turn, USER]}
        return tiny.post("/tokenize", json=body).json()

    as_part = prompt([{"type": "refusal", "refusal": "I cannot help with that."}])
    assert as_part["tokens"] == prompt("I cannot help with that.")["tokens"]
    refused = prompt([{"type": "refusal", "refusal": "no"}], role="user")
    assert refused["error"]["param"] == "messages.1.content"
    assert "only an assistant message may hold a refusal part" in refused["error"]["message"]


def test_a_responses_refusal_part_is_what_the_assistant_said(tiny: TestClient):
    def spent(part: dict, role: str = "assistant") -> dict:
        earlier = {"type": "message", "role": role, "content": [part]}
        return tiny.post("/v1/responses", json=_with(RESPONSES, input=[USER, earlier, USER])).json()

    said = "I cannot help with that."
    as_refusal = spent({"type": "refusal", "refusal": said})
    as_text = spent({"type": "output_text", "text": said})
    assert as_refusal["usage"]["input_tokens"] == as_text["usage"]["input_tokens"]
    refused = spent({"type": "refusal", "refusal": said}, role="user")
    assert refused["error"]["param"] == "input.1"
    assert "only an assistant message may hold a refusal part" in refused["error"]["message"]


def test_a_responses_output_replayed_is_accepted(tiny: TestClient):
    """openai-agents sends an earlier output message back with its id, status, and its text
    part's annotations and logprobs; an output dumped with the SDK's `model_dump()` holds every
    key its types declare (a message's `phase`, a call's `caller`, `namespace` and `async`)."""
    earlier = {
        "type": "message",
        "id": "msg_1",
        "status": "completed",
        "phase": "final_answer",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "a b", "annotations": [], "logprobs": []}],
    }
    body = _with(RESPONSES, input=[USER, earlier, USER])
    response = tiny.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    call = {
        "type": "function_call",
        "call_id": "c1",
        "name": "f",
        "arguments": "{}",
        "caller": None,
        "namespace": None,
        "async": False,
    }
    output = {"type": "function_call_output", "call_id": "c1", "output": "1", "caller": None}
    dumped = {("async_" if key == "async" else key): value for key, value in call.items()}
    for sent in (call, dumped):  # `async_`: what the Python SDK's `model_dump()` writes
        body = _with(RESPONSES, input=[USER, sent, output])
        response = tiny.post("/v1/responses", json=body)
        assert response.status_code == 200, response.text


def test_request_id_is_the_answers_id(tiny: TestClient):
    """vLLM names its answer chatcmpl-<request_id> (cmpl-<request_id> on completions)."""
    chat = tiny.post("/v1/chat/completions", json=_with(CHAT, request_id="job-7"))
    assert chat.status_code == 200, chat.text
    assert chat.json()["id"] == "chatcmpl-job-7"
    text = tiny.post("/v1/completions", json=_with(TEXT, request_id="job-8"))
    assert text.json()["id"] == "cmpl-job-8"
    for path, body, prefix in (
        ("/v1/chat/completions", CHAT, "chatcmpl"),
        ("/v1/completions", TEXT, "cmpl"),
    ):
        streamed = tiny.post(path, json=_with(body, stream=True, request_id="job-9"))
        expected = f"{prefix}-job-9"
        chunks = [json.loads(e) for e in sse_events(streamed)[:-1]]
        assert chunks and {c["id"] for c in chunks} == {expected}
    # vLLM's order: the client's x-request-id header first, then request_id.
    headed = tiny.post(
        "/v1/chat/completions",
        json=_with(CHAT, request_id="job-11"),
        headers={"x-request-id": "trace-5"},
    )
    assert headed.json()["id"] == "chatcmpl-trace-5"
    assert headed.headers["x-request-id"] == "trace-5"
    # Without one, each answer gets a new id.
    first, second = (tiny.post("/v1/chat/completions", json=CHAT).json()["id"] for _ in "ab")
    assert first != second and first.startswith("chatcmpl-")


def test_the_openai_sdk_replays_its_own_answers(tiny: TestClient):
    """The answer objects the openai client parsed, sent back as they are: the chat message
    (`messages.append(completion.choices[0].message)`) and the Responses output items."""
    client = OpenAI(base_url="http://localhost/v1", api_key="none", http_client=tiny)
    messages: list[Any] = [USER]
    completion = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    messages += [completion.choices[0].message, USER]
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert again.choices[0].message.role == "assistant"
    response = client.responses.create(model="tiny", input="the cat", max_output_tokens=2)
    items: list[Any] = [USER, *response.output, USER]
    assert client.responses.create(model="tiny", input=items, max_output_tokens=2).output
