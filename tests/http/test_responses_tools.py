"""Tools and reasoning on /v1/responses, in-process: function tools and function_call items as
chat's tools and tool calls (a tiny model whose template shows tools, its output steered), and a
thinking model's reasoning as a `reasoning` item, whole, streamed and through the official
client."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.http.test_reasoning import QWEN_THINKING
from tests.http.test_responses_api import events, sdk
from tests.http.test_tools import CALL_TEXT, SMALL_WEATHER, WEATHER, steer
from tests.support.tiny import TOOL_CHAT_TEMPLATE, write_tiny_llama

# The Responses API's flat form of chat's WEATHER tool.
TOOL = {"type": "function", **WEATHER["function"]}
ASK = "weather in paris?"
BODY = {"model": "tiny", "input": ASK, "tools": [TOOL], "temperature": 0}


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(
        tmp_path_factory.mktemp("tiny-tools"), quantize=True, chat_template=TOOL_CHAT_TEMPLATE
    )


@pytest.fixture
def tool_client(make_client, tool_model_dir: Path) -> TestClient:
    return make_client(model=tool_model_dir)


def respond(client: TestClient, **fields: object) -> dict:
    response = client.post("/v1/responses", json={**BODY, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_tool_call_is_a_function_call_item(tool_client: TestClient):
    steer(tool_client, CALL_TEXT)
    answer = respond(tool_client)
    message, call = answer["output"]
    assert message["type"] == "message"
    assert message["content"][0]["text"] == "Let me check."
    assert call["type"] == "function_call" and call["status"] == "completed"
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert answer["status"] == "completed"
    assert answer["tools"] == [{**TOOL, "strict": None}] and answer["tool_choice"] == "auto"
    # Only a call: no message item.
    steer(tool_client, CALL_TEXT.removeprefix("Let me check."))
    assert [item["type"] for item in respond(tool_client)["output"]] == ["function_call"]


def test_a_streamed_tool_call_is_added_its_arguments_given_and_done(tool_client: TestClient):
    steer(tool_client, CALL_TEXT)
    response = tool_client.post("/v1/responses", json={**BODY, "stream": True})
    assert response.status_code == 200, response.text
    sent = events(response)
    names = [name for name, _ in sent if name != "response.output_text.delta"]
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in sent] == list(range(len(sent)))
    by_name = {name: data for name, data in sent}
    added = [data for name, data in sent if name == "response.output_item.added"][1]
    assert added["item"]["type"] == "function_call" and added["item"]["arguments"] == ""
    assert added["item"]["status"] == "in_progress"
    done = by_name["response.function_call_arguments.done"]
    assert done["output_index"] == 1 and done["name"] == "get_weather"
    assert json.loads(done["arguments"]) == {"city": "Paris"}
    final = by_name["response.completed"]["response"]
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert final["output"][1]["id"] == done["item_id"]
    text = "".join(d["delta"] for n, d in sent if n == "response.output_text.delta")
    assert text == "Let me check."


def test_the_official_client_reads_calls_and_sends_results_back(tool_client: TestClient):
    steer(tool_client, CALL_TEXT)
    api = sdk(tool_client)
    first = api.responses.create(model="tiny", input=ASK, tools=[TOOL], temperature=0)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather"
    prompt = steer(tool_client, "It is sunny.")
    # The earlier output goes back as input, with the call's result.
    history = [
        {"role": "user", "content": ASK},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"},
    ]
    second = api.responses.create(model="tiny", input=history, tools=[TOOL], temperature=0)
    assert second.output_text == "It is sunny."
    assert prompt()  # the steered script ran
    # The same conversation as chat messages renders the same prompt.
    chat = tool_client.post(
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "max_tokens": 1,
            "tools": [WEATHER],
            "messages": [
                {"role": "user", "content": ASK},
                {
                    "role": "assistant",
                    "content": "Let me check.",
                    "tool_calls": [
                        {
                            "id": call.call_id,
                            "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21C"},
            ],
        },
    ).json()
    assert second.usage.input_tokens == chat["usage"]["prompt_tokens"]


def test_an_output_of_no_call_is_refused(tool_client: TestClient):
    history = [
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_b", "output": "sunny, 21C"},
    ]
    response = tool_client.post("/v1/responses", json={**BODY, "input": history})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("input.2.call_id", "invalid_value")
    assert "call_id 'call_b'" in error["message"]


def test_required_and_named_tool_choice_hold_the_answer_to_a_call(tool_client: TestClient):
    """The random tiny model, left to itself, writes a valid call: the grammar holds it to one."""
    small = {"type": "function", **SMALL_WEATHER["function"]}
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        answer = respond(tool_client, tools=[small], tool_choice=choice, max_output_tokens=300)
        [call] = answer["output"]
        assert call["type"] == "function_call" and call["name"] == "get_weather"
        city = json.loads(call["arguments"])["city"]
        assert isinstance(city, str) and len(city) <= 6
        assert answer["tool_choice"] == choice


def test_reasoning_is_a_reasoning_item(make_client, tmp_path_factory):
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny-think"), chat_template=QWEN_THINKING)
    client = make_client(model=model)
    script = "<think>\nParis, surely.\n</think>\n\nParis."
    steer(client, script)
    body = {"model": "tiny", "input": "capital of france?", "temperature": 0}
    answer = client.post("/v1/responses", json=body).json()
    reasoning, message = answer["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "\nParis, surely.\n"}]
    assert message["content"][0]["text"] == "Paris."
    steer(client, script)
    sent = events(client.post("/v1/responses", json={**body, "stream": True}))
    thought = "".join(d["delta"] for n, d in sent if n == "response.reasoning_text.delta")
    said = "".join(d["delta"] for n, d in sent if n == "response.output_text.delta")
    assert (thought, said) == ("\nParis, surely.\n", "Paris.")
    done = [d for n, d in sent if n == "response.output_item.done"]
    assert [(d["output_index"], d["item"]["type"]) for d in done] == [
        (0, "reasoning"),
        (1, "message"),
    ]
    final = sent[-1][1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    steer(client, script)
    with sdk(client).responses.stream(model="tiny", input="capital of france?") as stream:
        for _ in stream:
            pass
        parsed = stream.get_final_response()
    assert parsed.output_text == "Paris."
    assert parsed.output[0].type == "reasoning"
