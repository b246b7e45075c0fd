"""Tools through the official `openai` client, in-process: a tiny model whose chat template
shows tools (Qwen's `<tool_call>` JSON), its output steered to a tool call. A template without
tool support: tests/http/test_generic_tools.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import openai
import pytest
from fastapi.testclient import TestClient

from hotlora.server.api.tool_calls import ToolCalls, ToolFormat

from tests.support.tiny import EOS_TOKEN_ID, TOOL_CHAT_TEMPLATE, write_tiny_llama

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALL_TEXT = (
    'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
)
ASK = [{"role": "user", "content": "weather in paris?"}]


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(
        tmp_path_factory.mktemp("tiny-tools"), quantize=True, chat_template=TOOL_CHAT_TEMPLATE
    )


@pytest.fixture
def tool_client(make_client, tool_model_dir: Path) -> TestClient:
    return make_client(model=tool_model_dir)


def sdk(client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://localhost/v1", api_key="x", http_client=client, max_retries=0
    )


def steer(client: TestClient, text: str) -> Callable[[], list[int]]:
    """Make the served model write `text` then stop, whatever it is asked; returns a function
    giving the prompts the model was called with."""
    runtime = client.app.state.runtime
    scheduler = runtime.worker.scheduler
    model = scheduler.model
    script = list(runtime.worker.engine.tokenizer.encode(text, add_special_tokens=False))
    script.append(EOS_TOKEN_ID)
    steps = {"n": 0}

    def call(tokens: mx.array, cache=None):
        logits = model(tokens, cache=cache)
        if tokens.shape[1] != 1:  # a prefill chunk: nothing sampled from it
            return logits
        target = script[min(steps["n"], len(script) - 1)]
        steps["n"] += 1
        hot = mx.arange(logits.shape[-1]) == target
        return mx.broadcast_to(mx.where(hot, 100.0, -100.0), logits.shape)

    scheduler.model = call
    return lambda: script


def test_the_template_and_parser_are_found(tool_client):
    service = tool_client.app.state.runtime.inference
    assert service.tool_format is not None and service.tool_format.start == "<tool_call>"


def test_a_tool_call_comes_back_as_tool_calls(tool_client):
    steer(tool_client, CALL_TEXT)
    response = sdk(tool_client).chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], max_tokens=200, temperature=0
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.message.content == "Let me check."


def test_a_streamed_tool_call_arrives_as_deltas(tool_client):
    steer(tool_client, CALL_TEXT)
    stream = sdk(tool_client).chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], max_tokens=200, temperature=0, stream=True
    )
    content, calls, finish = "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls.extend(delta.tool_calls or [])
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Let me check."  # no markup leaks into the text
    assert finish == "tool_calls"
    [call] = calls
    assert call.index == 0 and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_tool_results_round_trip_through_the_template(tool_client):
    steer(tool_client, "It is sunny.")
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]
    response = sdk(tool_client).chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER], max_tokens=40, temperature=0
    )
    assert response.choices[0].message.content == "It is sunny."
    assert response.choices[0].finish_reason == "stop"
    tokenizer = tool_client.app.state.runtime.worker.engine.tokenizer
    rendered = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "weather in paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {"role": "tool", "content": "sunny, 21C", "tool_call_id": "call_1"},
        ],
        tools=[WEATHER],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}' in rendered
    assert response.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))


def test_markup_the_parser_cannot_read_stays_text(tool_client):
    broken = "<tool_call>{not json</tool_call>"
    steer(tool_client, broken)
    response = sdk(tool_client).chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], max_tokens=200, temperature=0
    )
    assert response.choices[0].message.content == broken
    assert response.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            None,
        ),
        ({"tool_choice": "required"}, None),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, None),
        ({"tools": [{"type": "retrieval"}]}, None),
    ],
)
def test_malformed_tools_are_400s(client, fields, param):
    body = {"model": "tiny", "messages": ASK, "max_tokens": 2, **fields}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] is not None and error["param"].split(".")[0] in ("tools", "tool_choice")
    if param is not None:
        assert error["param"] == param


def test_the_stream_splitter_holds_back_a_partial_marker():
    fmt = ToolFormat("<tool_call>", "</tool_call>", lambda body, tools: json.loads(body))
    stream = ToolCalls(fmt, []).stream()
    shown, calls = [], []
    for piece in ["Hi <tool", "_ca", 'll>{"name": "f", "argu', 'ments": {}}</tool_c', "all> bye"]:
        text, found = stream.feed(piece)
        shown.append(text)
        calls += found
    text, found = stream.flush()
    shown.append(text)
    assert "".join(shown) == "Hi  bye" and [c.function.name for c in calls + found] == ["f"]
    assert shown[0] == "Hi "  # "<tool" might start a call: held back


def test_an_unclosed_call_is_read_at_the_end():
    fmt = ToolFormat("[TOOL_CALLS]", None, lambda body, tools: json.loads(body))
    text, calls = ToolCalls(fmt, []).split('ok[TOOL_CALLS]{"name": "f", "arguments": {"a": 1}}')
    assert text == "ok" and calls[0].function.arguments == '{"a": 1}'


BOUNDED = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
SMALL_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}},
            "required": ["city"],
        },
    },
}


@pytest.mark.parametrize(
    "answer",
    [
        CALL_TEXT,
        CALL_TEXT.removeprefix("Let me check."),  # calls alone: content null
        "No need.",
        "",  # no text, no call: content ""
    ],
)
def test_a_streamed_answer_gathers_into_the_unstreamed_message(tool_client, answer: str):
    """The SDK's stream helper gathers the deltas (logprobs too) into what the same request
    answers unstreamed: a call's tokens bring their logprobs with no empty content."""
    ask = {"model": "tiny", "messages": ASK, "tools": [WEATHER], "max_tokens": 200}
    ask |= {"temperature": 0, "logprobs": True}
    steer(tool_client, answer)
    whole = sdk(tool_client).chat.completions.create(**ask).choices[0]
    steer(tool_client, answer)
    with sdk(tool_client).chat.completions.stream(**ask) as stream:
        gathered = stream.get_final_completion().choices[0]
    assert gathered.message.content == whole.message.content
    assert whole.message.content == (None if answer.startswith("<") else answer.split("<")[0])
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]
    assert [(c.function.name, c.function.arguments) for c in gathered.message.tool_calls or ()] == (
        calls
    )
    assert gathered.finish_reason == whole.finish_reason
    tokens = [
        [lp.token for lp in (c.logprobs and c.logprobs.content) or ()] for c in (whole, gathered)
    ]
    assert tokens[0] == tokens[1] and (len(tokens[0]) > 0) == bool(answer)


@pytest.mark.parametrize(
    ("choice", "names"),
    [
        ("required", {"get_weather", "get_time"}),
        ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
    ],
)
def test_a_required_tool_call_is_enforced_while_decoding(tool_client, choice, names):
    """The random tiny model, left to itself, writes a valid call: the grammar holds it to one."""
    response = sdk(tool_client).chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[SMALL_WEATHER, BOUNDED],
        tool_choice=choice,
        max_tokens=300,
        temperature=0,
    )
    choice_out = response.choices[0]
    assert choice_out.finish_reason == "tool_calls", choice_out
    [call] = choice_out.message.tool_calls
    assert call.function.name in names
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_time":
        assert arguments["zone"] in ("UTC", "CET")
    else:
        assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 6


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_required_call_with_a_response_format_is_the_call(tool_client, choice):
    """OpenAI's pair: the format would hold a text answer; this one is the call."""
    body = {
        "model": "tiny",
        "messages": ASK,
        "tools": [SMALL_WEATHER],
        "tool_choice": choice,
        "response_format": {"type": "json_object"},
        "max_tokens": 300,
        "temperature": 0,
    }
    response = tool_client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    [answer] = response.json()["choices"]
    assert answer["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in answer["message"]["tool_calls"]] == ["get_weather"]
    auto = tool_client.post("/v1/chat/completions", json={**body, "tool_choice": "auto"})
    assert auto.status_code == 200


def test_auto_beside_a_schema_format_calls_the_tool_or_answers_in_the_format(tool_client):
    """An agent's tools beside its structured answer: the model's own call markup, or the
    format's JSON; the format alone would have masked the call's first token."""
    schema = {
        "type": "object",
        "properties": {"sky": {"type": "string", "enum": ["sunny", "rainy"]}},
        "required": ["sky"],
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": schema}}
    body = {
        "model": "tiny",
        "messages": ASK,
        "tools": [WEATHER],
        "response_format": response_format,
        "max_tokens": 120,
        "temperature": 0,
    }
    steer(tool_client, CALL_TEXT.removeprefix("Let me check."))
    response = tool_client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    [answer] = response.json()["choices"]
    assert answer["finish_reason"] == "tool_calls", answer
    [call] = answer["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    steer(tool_client, '{"sky": "sunny"}')
    [answer] = tool_client.post("/v1/chat/completions", json=body).json()["choices"]
    assert answer["finish_reason"] == "stop"
    assert answer["message"]["content"] == '{"sky": "sunny"}'
    assert not answer["message"].get("tool_calls")
    # A format whose schema cannot be enforced is refused by its own field, as it is alone.
    broken = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}
    refused = tool_client.post("/v1/chat/completions", json={**body, "response_format": broken})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format"


def test_auto_beside_a_format_takes_what_each_alone_takes(tool_client):
    """Tools the grammar cannot hold (served under `auto` alone, unheld) leave the answer to the
    format; a format near the size limit and one with llguidance options of its own are taken
    beside tools as they are alone."""
    unheld = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"x": {"not": {"type": "string"}}}},
        },
    }
    near_limit = {"type": "string", "enum": [f"option-{i:05d}-abcdefgh" for i in range(2600)]}
    coerced = {
        "type": "object",
        "properties": {"v": {"oneOf": [{"type": "integer"}, {"type": "number"}]}},
        "x-guidance": {"coerce_one_of": True},
    }
    cases = [([unheld], {"type": "object"}), ([WEATHER], near_limit), ([WEATHER], coerced)]
    for tools, schema in cases:
        assert len(json.dumps(schema)) < 64 * 1024
        body = {
            "model": "tiny",
            "messages": ASK,
            "tools": tools,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": schema},
            },
            "max_tokens": 4,
        }
        for tool_choice in ("none", "auto"):
            answer = tool_client.post(
                "/v1/chat/completions", json={**body, "tool_choice": tool_choice}
            )
            assert answer.status_code == 200, (tool_choice, schema, answer.text)


@pytest.mark.parametrize(
    "parameters",
    [
        '{"type": "object", "properties": {"x": {"type": "number", "maximum": NaN}}}',
        '{"type": "object", "properties": {"x": {"not": {"type": "string"}}}}',
    ],
)
def test_parameters_a_required_call_cannot_be_held_to_are_400s(tool_client, parameters):
    body = (
        '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, '
        '"tool_choice": "required", "tools": [{"type": "function", "function": '
        '{"name": "f", "parameters": ' + parameters + "}}]}"
    )
    response = tool_client.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools" and "tool's parameters" in error["message"]
