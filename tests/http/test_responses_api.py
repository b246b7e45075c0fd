"""POST /v1/responses in-process on the tiny model: the chat completion it describes, in
OpenAI's Responses shapes, read back through the official client and as raw events."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from hotlora.config.errors import InvalidRequest
from hotlora.server.api.responses_request import TextFormat, responses_params
from hotlora.server.engine import Delta, Finished

from tests.support.adapter_builders import random_pairs, tiny_model, write_mlx_adapter

GREEDY = {"model": "tiny", "temperature": 0, "max_output_tokens": 6}
EVENT_ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    # response.output_text.delta, once per piece of text
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def sdk(client: TestClient) -> openai.OpenAI:
    """The official client, its requests answered by the in-process app."""
    return openai.OpenAI(
        base_url="http://localhost/v1", api_key="x", http_client=client, max_retries=0
    )


def chat(client: TestClient, messages: list[dict[str, str]], **fields: Any) -> dict[str, Any]:
    """The chat completion a Responses request should equal (greedy, same length)."""
    body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 6, **fields}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def events(response: Any) -> list[tuple[str, dict[str, Any]]]:
    """The (event name, JSON data) pairs of a raw SSE response."""
    out, name = [], None
    for line in response.text.splitlines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            out.append((name, json.loads(line[len("data: ") :])))
            name = None
    return out


def finishing_with_stop(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs end as if the model chose its end token: the tiny model never does by itself."""
    service = client.app.state.runtime.require_inference()
    original = service.events

    async def stopped(submitted: Any) -> AsyncIterator[tuple[int, Delta | Finished]]:
        async with contextlib.aclosing(original(submitted)) as inner:
            async for index, event in inner:
                if isinstance(event, Finished):
                    event = dataclasses.replace(event, finish_reason="stop")
                yield index, event

    monkeypatch.setattr(service, "events", stopped)


# Whole responses.


def test_text_input_equals_the_chat_completion(client: TestClient):
    response = sdk(client).responses.create(input="hi there", **GREEDY)
    expected = chat(client, [{"role": "user", "content": "hi there"}])
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.model == "tiny"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    assert response.output_text == expected["choices"][0]["message"]["content"]
    usage = response.usage
    assert usage.input_tokens == expected["usage"]["prompt_tokens"]
    assert usage.output_tokens == expected["usage"]["completion_tokens"]
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert response.error is None and response.tools == []


def test_message_items_and_instructions_become_chat_messages(client: TestClient):
    items = [
        {"role": "user", "content": "hi there"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "hello", "annotations": []}],
        },
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "how "},
                {"type": "input_text", "text": "are you"},
            ],
        },
    ]
    response = sdk(client).responses.create(input=items, instructions="Be brief.", **GREEDY)
    expected = chat(
        client,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi there"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "how are you"},
        ],
    )
    assert response.output_text == expected["choices"][0]["message"]["content"]
    assert response.usage.input_tokens == expected["usage"]["prompt_tokens"]
    assert response.instructions == "Be brief."


def test_developer_role_is_the_system_message(client: TestClient):
    items = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    response = sdk(client).responses.create(input=items, **GREEDY)
    expected = chat(client, [{"role": "system", "content": "Be brief."}, items[1]])
    assert response.usage.input_tokens == expected["usage"]["prompt_tokens"]
    assert response.output_text == expected["choices"][0]["message"]["content"]


def test_max_output_tokens_ends_incomplete(client: TestClient):
    response = sdk(client).responses.create(input="hi there", **{**GREEDY, "max_output_tokens": 3})
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"
    assert response.usage.output_tokens == 3
    assert response.max_output_tokens == 3
    assert response.completed_at is None  # only a completed response has one


def test_a_finished_answer_is_completed(client: TestClient, monkeypatch: pytest.MonkeyPatch):
    finishing_with_stop(client, monkeypatch)
    response = sdk(client).responses.create(input="hi there", **GREEDY)
    assert response.status == "completed" and response.incomplete_details is None
    assert response.output[0].status == "completed"
    assert response.completed_at is not None and response.completed_at >= response.created_at


def test_seed_reproduces_sampling_as_chat_does(client: TestClient):
    body = {"model": "tiny", "input": "hi there", "max_output_tokens": 16, "temperature": 1.5}

    def answer(seed: int) -> str:
        return client.post("/v1/responses", json={**body, "seed": seed}).json()["output"][0][
            "content"
        ][0]["text"]

    first = answer(7)
    assert answer(7) == first
    same = chat(
        client,
        [{"role": "user", "content": "hi there"}],
        max_tokens=16,
        temperature=1.5,
        seed=7,
    )
    assert same["choices"][0]["message"]["content"] == first
    assert len({answer(seed) for seed in range(8, 12)} | {first}) > 1  # the seed decides


def test_settings_and_metadata_are_echoed(client: TestClient):
    body = {
        **GREEDY,
        "input": "hi",
        "temperature": 0.5,
        "top_p": 0.9,
        "metadata": {"run": "7"},
        "store": True,
        "text": {"format": {"type": "text"}},
    }
    echoed = client.post("/v1/responses", json=body).json()
    assert echoed["temperature"] == 0.5 and echoed["top_p"] == 0.9
    assert echoed["metadata"] == {"run": "7"}
    assert echoed["store"] is False  # nothing is stored, whatever the request asked
    assert echoed["text"] == {"format": {"type": "text"}}
    assert echoed["previous_response_id"] is None
    assert echoed["tool_choice"] == "auto" and echoed["parallel_tool_calls"] is True
    # Unset sampling values echo what generation used.
    plain = client.post(
        "/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 1}
    )
    assert plain.json()["temperature"] == 1.0 and plain.json()["top_p"] == 1.0
    assert plain.json()["metadata"] == {} and plain.json()["instructions"] is None


@pytest.fixture
def adapter_client(make_client: Callable[..., TestClient], tmp_path: Path) -> TestClient:
    """The app with adapter `a` mounted at start-up."""
    root = tmp_path / "adapters"
    write_mlx_adapter(root / "a", random_pairs(tiny_model(quantize=True), seed=1))
    return make_client(adapter_root=root, startup_adapters={"a": "a"})


def test_adapter_field_selects_the_adapter_as_chat_does(adapter_client: TestClient):
    client = sdk(adapter_client)
    base = client.responses.create(input="hi there", **GREEDY)
    adapted = client.responses.create(input="hi there", extra_body={"adapter": "a"}, **GREEDY)
    by_name = client.responses.create(input="hi there", **{**GREEDY, "model": "tiny:a"})
    messages = [{"role": "user", "content": "hi there"}]
    expected = chat(adapter_client, messages, adapter="a")["choices"][0]["message"]["content"]
    assert adapted.output_text == by_name.output_text == expected
    assert adapted.output_text != base.output_text
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(input="hi", extra_body={"adapter": "b"}, **GREEDY)
    assert missing.value.body["param"] == "adapter"


# Streams.


def test_stream_events_in_order_with_sequence_numbers(client: TestClient):
    whole = client.post("/v1/responses", json={**GREEDY, "input": "hi there"}).json()
    streamed = client.post("/v1/responses", json={**GREEDY, "input": "hi there", "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in streamed.text
    sent = events(streamed)
    assert [name for name, _ in sent] == [data["type"] for _, data in sent]
    assert [data["sequence_number"] for _, data in sent] == list(range(len(sent)))
    names = [name for name, _ in sent if name != "response.output_text.delta"]
    assert names == [*EVENT_ORDER, "response.incomplete"]
    deltas = [data for name, data in sent if name == "response.output_text.delta"]
    first_delta = [name for name, _ in sent].index("response.output_text.delta")
    assert deltas and first_delta == 4 and len(deltas) == len(sent) - 8
    created, final = sent[0][1]["response"], sent[-1][1]["response"]
    item_id = sent[2][1]["item"]["id"]
    assert created["status"] == "in_progress" and created["output"] == []
    assert all(
        d["item_id"] == item_id and d["output_index"] == d["content_index"] == 0 for d in deltas
    )
    text = "".join(d["delta"] for d in deltas)
    assert text == whole["output"][0]["content"][0]["text"]
    assert sent[-4][1]["text"] == text
    assert final["id"] == created["id"] and final["output"][0]["id"] == item_id
    assert final["status"] == "incomplete" and final["usage"]["output_tokens"] == 6


def test_sdk_stream_and_stream_helper(client: TestClient, monkeypatch: pytest.MonkeyPatch):
    finishing_with_stop(client, monkeypatch)
    api = sdk(client)
    whole = api.responses.create(input="hi there", **GREEDY)
    kinds = [event.type for event in api.responses.create(input="hi there", stream=True, **GREEDY)]
    assert kinds[-1] == "response.completed" and kinds[0] == "response.created"
    with api.responses.stream(input="hi there", **GREEDY) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == whole.output_text
    assert final.status == "completed"


def test_a_failure_after_the_200_is_an_error_then_response_failed(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
):
    service = client.app.state.runtime.require_inference()
    original = service.events

    async def failing(submitted: Any) -> AsyncIterator[tuple[int, Delta | Finished]]:
        async with contextlib.aclosing(original(submitted)) as inner:
            async for item in inner:
                yield item
                raise RuntimeError("the generation thread broke")

    monkeypatch.setattr(service, "events", failing)
    sent = events(client.post("/v1/responses", json={**GREEDY, "input": "hi", "stream": True}))
    names = [name for name, _ in sent]
    assert names[-2:] == ["error", "response.failed"]
    error, failed = sent[-2][1], sent[-1][1]["response"]
    assert error["code"] == "internal_error" and "thread" not in error["message"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert [data["sequence_number"] for _, data in sent] == list(range(len(sent)))
    # The client sees the events; its stream ends without raising.
    kinds = [e.type for e in sdk(client).responses.create(input="hi", stream=True, **GREEDY)]
    assert kinds[-2:] == ["error", "response.failed"]


# Structured output.


@pytest.mark.parametrize(
    ("text_format", "response_format"),
    [
        ({"type": "json_object"}, {"type": "json_object"}),
        (
            {"type": "json_schema", "name": "answer", "schema": {"type": "object"}, "strict": True},
            {
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": {"type": "object"}, "strict": True},
            },
        ),
    ],
)
def test_text_format_maps_to_response_format(
    text_format: dict[str, Any], response_format: dict[str, Any]
):
    assert TextFormat.model_validate(text_format).response_format() == response_format


def test_json_schema_output_parses(client: TestClient):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    text = {"format": {"type": "json_schema", "name": "flag", "schema": schema, "strict": True}}
    body = {**GREEDY, "input": "hi", "max_output_tokens": 32, "text": text}
    response = client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["text"] == text
    output = response.json()["output"][0]["content"][0]["text"]
    assert isinstance(json.loads(output)["ok"], bool)


# Refusals: each names the Responses field it is about.

BAD_REQUESTS = [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "stateless"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation", "stateless"),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt", "stateless"),
    ({"input": "hi", "background": True}, "background", "background"),
    ({"input": []}, "input", "at least 1"),
    ({"input": 5}, "input", "valid list"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role", "'user'"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input.0.type", "function_call"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id", "required"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input.0.content",
        "images",
    ),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "greater than"),
    ({"input": "hi", "max_output_tokens": 100_000}, "max_output_tokens", "max_output_tokens is"),
    ({"input": "hi", "temperature": 3}, "temperature", "less than"),
    ({"input": "hi", "top_p": -0.1}, "top_p", "greater than or equal"),
    ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format", "'schema'"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type", "'text'"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools", "function tools"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f g"}]}, "tools.0.name", "pattern"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice", "requires tools"),
    ({"input": "hi", "truncation": "auto"}, "truncation", "'disabled'"),
    ({"input": "hi", "metadata": {str(i): "x" for i in range(17)}}, "metadata", "16 keys"),
    ({"input": "hi", "adapter": "a+a"}, "adapter", "named twice"),
    ({"input": "hi", "stream": "often"}, "stream", "boolean"),
    ({"input": "x " * 600}, "input", "maximum context length"),
]


@pytest.mark.parametrize(
    ("fields", "param", "says"), BAD_REQUESTS, ids=[c[1] for c in BAD_REQUESTS]
)
def test_bad_requests_name_the_responses_field(
    client: TestClient, fields: dict[str, Any], param: str, says: str
):
    response = client.post("/v1/responses", json={"model": "tiny", **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert says in error["message"]


@pytest.mark.parametrize(
    ("chat_param", "param"),
    [
        ("messages", "input"),
        ("messages.2.content", "input"),
        ("max_tokens", "max_output_tokens"),
        ("response_format", "text.format"),
        ("response_format.json_schema.schema", "text.format.schema"),
        ("adapter", "adapter"),
    ],
)
def test_chat_refusals_name_the_responses_field(chat_param: str, param: str):
    with pytest.raises(InvalidRequest) as refused, responses_params():
        raise InvalidRequest("max_tokens is too large", param=chat_param)
    assert refused.value.param == param
    if param != chat_param:
        assert refused.value.message == "max_output_tokens is too large"


def test_unknown_model_is_404_through_the_client(client: TestClient):
    with pytest.raises(openai.NotFoundError) as missing:
        sdk(client).responses.create(model="nope", input="hi")
    assert missing.value.body["param"] == "model"
    assert missing.value.body["code"] == "model_not_found"


def test_previous_response_id_is_refused_through_the_client(client: TestClient):
    with pytest.raises(openai.BadRequestError) as refused:
        sdk(client).responses.create(model="tiny", input="hi", previous_response_id="resp_1")
    assert refused.value.body["param"] == "previous_response_id"


def test_the_api_key_guards_responses(make_client: Callable[..., TestClient]):
    keyed = make_client(api_key="secret")
    refused = keyed.post("/v1/responses", json={"model": "tiny", "input": "hi"})
    assert refused.status_code == 401
    answered = keyed.post(
        "/v1/responses",
        json={"model": "tiny", "input": "hi", "max_output_tokens": 1},
        headers={"Authorization": "Bearer secret"},
    )
    assert answered.status_code == 200
